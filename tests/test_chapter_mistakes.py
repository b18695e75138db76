"""The grader catches real mistakes: per chapter, the solution gets full marks, the untouched
release gets zero, and each realistic mistake gets its exact partial marks with a feedback line
that names it (fixtures: tests/fixtures/mistakes_<module>.py).

Every other mistake of a chapter is handed in as a Chinese notebook (the student answered
``<assignment>/zh/<notebook>``): it must get the same exact points, and its feedback speaks Chinese,
every check failure included. Each case is graded once, in one language, so that both languages
cost one grading run (tests/test_corpus.py grades Chinese twins of the same code side by side)."""

import importlib
import re
from pathlib import Path

import pytest

from stepformer.course.grade import grade
from stepformer.course.sandbox import sandbox_problem
from tests.fixtures.submissions import write_chinese_twins, write_submissions

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
            english = [case for case in chapter.CASES if not _in_chinese(chapter, case)]
            chinese = [case for case in chapter.CASES if _in_chinese(chapter, case)]
            write_submissions(english, chapter.ASSIGNMENT, chapter.NOTEBOOK, ROOT / "exercises", base / "subs")
            write_chinese_twins(chinese, chapter.ASSIGNMENT, chapter.NOTEBOOK, ROOT / "exercises", base / "subs",
                                prefix="")
            results = grade(ROOT, base / "subs", chapter.ASSIGNMENT, base / "out", base / "work", workers=2,
                            sandbox=sandbox_problem() is None, progress=False)
            found[chapter.ASSIGNMENT] = ({r.student: r for r in results}, base / "out")
        return found[chapter.ASSIGNMENT]

    return chapter_results


CASES = [(chapter, case) for chapter in CHAPTERS for case in chapter.CASES]
# A check's failure as the feedback page shows it: the traceback cut to its last line (ShortTracebacks).
FAILURE_LINE = re.compile(r"CheckFailure: ([^<\n]*)")
CJK = re.compile(r"[\u4e00-\u9fff]")


def _in_chinese(chapter, case) -> bool:
    """Whether a case is handed in as a Chinese notebook: every other mistake (never the solution or the stub)."""
    mistakes = [c.name for c in chapter.CASES if c.name not in ("correct", "untouched")]
    return case.name in mistakes[1::2]


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
    page = (out / "feedback" / case.name / chapter.ASSIGNMENT / chapter.NOTEBOOK.replace(".ipynb", ".html")).read_text()
    failures = FAILURE_LINE.findall(page)
    if not _in_chinese(chapter, case):
        assert case.feedback in page + result.detail
        assert not [line for line in failures if CJK.search(line)], failures
        return
    # The same points in Chinese; every check that failed says so in Chinese, and the English phrase is not shown.
    assert "zh/" in result.detail, result.detail
    assert failures and all(CJK.search(line) for line in failures), failures
    assert case.feedback not in "".join(failures)


def test_every_chapter_has_at_least_two_mistakes():
    for chapter in CHAPTERS:
        assert len([c for c in chapter.CASES if c.name not in ("correct", "untouched")]) >= 2, chapter.ASSIGNMENT
