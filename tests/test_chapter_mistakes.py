"""The grader catches real mistakes: per chapter, the solution gets full marks, the untouched
release gets zero, and each realistic mistake gets its exact partial marks with a feedback line
that names it (fixtures: tests/fixtures/mistakes_<module>.py). A hostile submission per chapter
(the second exercise's answer patches torch for every later check) keeps the points of the checks
before it and loses the others.

Every case is handed in twice in one grading run: as the English notebook (student ``<case>``) and
as the Chinese one (student ``zh_<case>``, who answered ``<assignment>/zh/<notebook>`` with the same
code). The Chinese twin gets the same points, cell by cell; its feedback shows the same checks
passing and failing, in Chinese, where the English twin's is English."""

import importlib
from pathlib import Path

import pytest

from stepformer.course.grade import grade
from stepformer.course.sandbox import sandbox_problem
from tests.fixtures.chinese import CJK
from tests.fixtures.submissions import (
    FAILURE_LINE,
    assert_chinese_twin,
    feedback_page,
    tampering_case,
    write_chinese_twins,
    write_submissions,
)

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = [importlib.import_module(f"tests.fixtures.{p.stem}")
            for p in sorted((ROOT / "tests" / "fixtures").glob("mistakes_*.py"))]
pytestmark = pytest.mark.slow


def _cases(chapter) -> list:
    return [*chapter.CASES, tampering_case(chapter.ASSIGNMENT, chapter.NOTEBOOK)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade a chapter's fixtures, both twins of each, on first use, so that ``-k 07_encoder`` grades that chapter
    only."""
    found = {}

    def chapter_results(chapter):
        if chapter.ASSIGNMENT not in found:
            base = tmp_path_factory.mktemp(chapter.ASSIGNMENT)
            cases = _cases(chapter)
            write_submissions(cases, chapter.ASSIGNMENT, chapter.NOTEBOOK, ROOT / "exercises", base / "subs")
            write_chinese_twins(cases, chapter.ASSIGNMENT, chapter.NOTEBOOK, ROOT / "exercises", base / "subs")
            results = grade(ROOT, base / "subs", chapter.ASSIGNMENT, base / "out", base / "work", workers=2,
                            sandbox=sandbox_problem() is None, progress=False)
            found[chapter.ASSIGNMENT] = ({r.student: r for r in results}, base / "out")
        return found[chapter.ASSIGNMENT]

    return chapter_results


CASES = [(chapter, case) for chapter in CHAPTERS for case in _cases(chapter)]
IDS = [f"{c.ASSIGNMENT}-{k.name}" for c, k in CASES]


def _page(out: Path, student: str, chapter) -> str:
    return feedback_page(out, student, chapter.ASSIGNMENT, chapter.NOTEBOOK)


@pytest.mark.parametrize(("chapter", "case"), CASES, ids=IDS)
def test_mistake_gets_its_points_and_names_the_mistake(graded, chapter, case):
    results, out = graded(chapter)
    result = results[case.name]
    assert (result.score, result.status) == (case.points, case.status), result.detail
    if case.name == "correct":
        assert result.score == result.max_score - result.by_hand  # all but the answers graded by hand
    elif case.name == "untouched":
        assert result.score == 0
    elif case.name != "patches_torch":
        assert 0 < result.score < result.max_score - result.by_hand or case.points == 0
    page = _page(out, case.name, chapter)
    assert case.feedback in page + result.detail
    assert not [line for line in FAILURE_LINE.findall(page) if CJK.search(line)]


@pytest.mark.parametrize(("chapter", "case"), CASES, ids=IDS)
def test_the_chinese_twin_gets_the_same_points_and_its_feedback_in_chinese(graded, chapter, case):
    results, out = graded(chapter)
    english, chinese = results[case.name], results[f"zh_{case.name}"]
    chinese_page = _page(out, f"zh_{case.name}", chapter)
    failures = assert_chinese_twin(english, chinese, _page(out, case.name, chapter), chinese_page, chapter.ASSIGNMENT,
                                   chapter.NOTEBOOK)
    assert "zh/" in chinese.detail, chinese.detail
    # The English phrase is not among the failures, unless the solution's own code says it (an error message it
    # raises is shown as raised).
    solution = (ROOT / "solutions" / chapter.ASSIGNMENT / chapter.NOTEBOOK).read_text()
    assert case.feedback == "✔" or case.feedback in solution or case.feedback not in "".join(failures)
    if case.name == "untouched":
        assert "尚未实现" in chinese_page
    if case.name == "patches_torch":
        assert "不计分" in chinese_page


def test_every_chapter_has_at_least_two_mistakes():
    for chapter in CHAPTERS:
        assert len([c for c in chapter.CASES if c.name not in ("correct", "untouched")]) >= 2, chapter.ASSIGNMENT
