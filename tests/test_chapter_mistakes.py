"""The grader catches real mistakes: per chapter, the solution gets full marks, the untouched
release gets zero, and each realistic mistake gets its exact partial marks with a feedback line
that names it (fixtures: tests/fixtures/mistakes_<module>.py)."""

import importlib
from pathlib import Path

import pytest

from stepformer.course.grade import grade
from stepformer.course.sandbox import sandbox_problem
from tests.fixtures.submissions import write_submissions

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = [importlib.import_module(f"tests.fixtures.{p.stem}")
            for p in sorted((ROOT / "tests" / "fixtures").glob("mistakes_*.py"))]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade a chapter's fixtures on first use, so that ``-k 07_encoder`` grades that chapter only."""
    found = {}

    def chapter_results(chapter):
        if chapter.ASSIGNMENT not in found:
            base = tmp_path_factory.mktemp(chapter.ASSIGNMENT)
            write_submissions(chapter.CASES, chapter.ASSIGNMENT, chapter.NOTEBOOK, ROOT / "exercises", base / "subs")
            results = grade(ROOT, base / "subs", chapter.ASSIGNMENT, base / "out", base / "work", workers=2,
                            sandbox=sandbox_problem() is None, progress=False)
            found[chapter.ASSIGNMENT] = ({r.student: r for r in results}, base / "out")
        return found[chapter.ASSIGNMENT]

    return chapter_results


CASES = [(chapter, case) for chapter in CHAPTERS for case in chapter.CASES]


@pytest.mark.parametrize(("chapter", "case"), CASES, ids=[f"{c.ASSIGNMENT}-{k.name}" for c, k in CASES])
def test_mistake_gets_its_points_and_names_the_mistake(graded, chapter, case):
    results, out = graded(chapter)
    result = results[case.name]
    assert (result.score, result.status) == (case.points, case.status), result.detail
    if case.name == "correct":
        assert result.score == result.max_score - result.by_hand  # all but the answers graded by hand
    elif case.name == "untouched":
        assert result.score == 0
    else:
        assert 0 < result.score < result.max_score - result.by_hand or case.points == 0
    page = out / "feedback" / case.name / chapter.ASSIGNMENT / chapter.NOTEBOOK.replace(".ipynb", ".html")
    assert case.feedback in page.read_text() + result.detail


def test_every_chapter_has_at_least_two_mistakes():
    for chapter in CHAPTERS:
        assert len([c for c in chapter.CASES if c.name not in ("correct", "untouched")]) >= 2, chapter.ASSIGNMENT
