"""How `make test` spreads the suite over its workers (``pytest -n 2 --dist loadgroup``).

Tests that share an expensive fixture (one book build, one graded corpus, one graded chapter)
must run on the same worker, so they form an xdist group; every other test is a unit of its own.
The heaviest groups go first (longest-processing-time-first scheduling), so that the workers
finish together instead of one grading a corpus while the other has long been idle.
"""

import os
from pathlib import Path

import pytest
import torch

from tests.fixtures.prerequisites import missing

# The real Multi30k files beside the project (never in it): ../shared/data/multi30k.
SHARED_MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


@pytest.fixture
def one_thread():
    """Tiny tensors run fastest on one thread; several only wait for each other on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def real_data() -> Path:
    """The shared folder with the real Multi30k files; skipped (failed in CI) where it is missing."""
    if not (SHARED_MULTI30K / "SHA256SUMS").is_file():
        missing(f"the real Multi30k files are not at {SHARED_MULTI30K} (see the project's README on shared data)")
    return SHARED_MULTI30K


@pytest.fixture(scope="session")
def book(tmp_path_factory: pytest.TempPathFactory):
    """The English site, built once per session (tests/test_book.py, tests/test_book_zh.py)."""
    from tests.test_book import REUSE_SITE, Build, build_book

    if reused := os.environ.get(REUSE_SITE):
        return Build(0, f"{REUSE_SITE}={reused}: not built here", Path(reused))
    return build_book(tmp_path_factory.mktemp("book"))


@pytest.fixture(scope="session")
def built(book) -> Path:
    """The English site's HTML folder; the test fails where it did not build."""
    if book.returncode != 0:
        pytest.fail(f"the book did not build (exit {book.returncode}):\n{book.tail()}")
    return book.html


@pytest.fixture(scope="module")
def sandbox_required() -> None:
    """Skip (saying why) where the grading sandbox cannot start; in CI, fail instead."""
    from stepformer.course.sandbox import sandbox_problem

    if (problem := sandbox_problem()) is not None:
        missing(f"the grading sandbox cannot start here: {problem}")

# Rough seconds of each group on two idle cores, measured from earlier runs; only the order matters.
WEIGHTS = {
    "book": 1030,  # the English site, then from its executed pages the class edition and the Chinese sites
    "student-env": 120,
    "corpus": 450,
    "corpus-resume": 240,
    "grading": 120,
    "grading-scale": 50,
    "sandbox": 90,
    "postgres": 60,
    "lab": 60,
}
CHAPTER_GRADING = 80  # each chapter's mistake fixtures: nbgrader's release plus ~6 notebooks
# Single tests that train the translator in subprocesses.
HEAVY_TESTS = {
    "test_a_killed_run_resumes_to_the_same_weights": 80,
    "test_two_processes_give_the_losses_of_one_on_the_same_global_batch": 35,
    "test_train_evaluate_translate_from_the_command_line": 20,
    "test_two_processes_killed_and_resumed_end_with_the_weights_of_two_that_never_stopped": 25,
    "test_a_wall_clock_budget_that_runs_out_while_rank_0_writes_a_checkpoint_ends_both_processes": 15,  # each of 2
    # Grading runs of their own: two notebooks graded; the guide's way B set up in a course folder.
    "test_a_late_first_hand_in_then_a_changed_notebook_are_graded_and_manual_scores_survive": 30,
    "test_way_b_set_up_runs_as_written_in_a_course_folder_outside_the_checkout": 25,
    "test_release_fetch_submit_collect_grade_and_return_feedback": 35,
    # A chapter's sample of mutants (tests/test_mutants.py): its definitions, then a few exercises' cells.
    "test_sampled_mutants_of_each_chapter_lose_points": 6,
}


def _group(item: pytest.Item) -> str | None:
    """The xdist group of a test, or None for a test that shares nothing expensive."""
    module = item.path.stem
    if module == "test_book":
        return "book"
    if module in ("test_book_class", "test_book_zh"):
        return "book"  # the class edition's and the Chinese site's builds reuse the English open one's executed pages
    if module == "test_class_edition" and item.get_closest_marker("slow"):
        return "student-env"
    if module == "test_corpus":
        return "corpus-resume" if item.name.startswith("test_killed_run") else "corpus"
    if module == "test_chapter_mistakes" and hasattr(item, "callspec"):
        return f"mistakes-{item.callspec.params['chapter'].ASSIGNMENT}"
    if module == "test_lab":
        return "lab"
    if module == "test_grading_scale" and item.get_closest_marker("slow"):
        return "grading-scale"  # one fixture grades for all three
    return {"test_grading": "grading", "test_sandbox": "sandbox", "test_gradebook_postgres": "postgres"}.get(module)


def _weight(item: pytest.Item, group: str | None) -> float:
    if group is None:
        return HEAVY_TESTS.get(getattr(item, "originalname", item.name), 0)  # a parametrized test's every case
    return CHAPTER_GRADING if group.startswith("mistakes-") else WEIGHTS[group]


@pytest.hookimpl(tryfirst=True)  # before xdist appends each group's name to the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weights = {}
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        weights[item.nodeid] = _weight(item, group)
    # A stable sort: within a group (and among the light tests) the file order is kept.
    items.sort(key=lambda item: -weights[item.nodeid])
