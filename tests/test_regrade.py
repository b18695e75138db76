"""A changed, new or late hand-in is graded again, and says why; the same hand-in is not (way A: ``grade()``)."""

import hashlib
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from stepformer.course.grade import FIRST_GRADING, _regrade_reason, grade
from stepformer.course.intake import Intake
from stepformer.course.sandbox import sandbox_problem
from tests.fixtures.submissions import ATTENTION, write_submissions

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
WHEN = "2026-12-01 10:00:00 UTC"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def state(tmp_path) -> Path:
    """The grader's bookkeeping for one assignment, as ``grade()`` lays it out in its work folder."""
    folder = tmp_path / "work" / ".stepformer-grader" / ASSIGNMENT
    (folder / "done").mkdir(parents=True)
    return folder


def record(state: Path, student: str, **fields) -> None:
    done = {"student": student, "status": "graded", "detail": "", "notes": [], "graded_at": WHEN, **fields}
    (state / "done" / f"{student}.json").write_text(json.dumps(done))


def handed_in(student: str, text: str | None = "v1", timestamp: str | None = None) -> Intake:
    notebooks = {NOTEBOOK: Path("/nowhere") / NOTEBOOK} if text is not None else {}
    digests = {NOTEBOOK: digest(text)} if text is not None else {}
    return Intake(student, notebooks, status="ok" if notebooks else "missing", timestamp=timestamp, digests=digests)


def test_the_same_hand_in_is_kept_and_a_changed_one_is_graded_again(state):
    record(state, "ann", digests={NOTEBOOK: digest("v1")}, timestamp=None)
    assert _regrade_reason(state, handed_in("ann"), fresh=False) is None
    assert _regrade_reason(state, handed_in("ann"), fresh=True) == "--fresh"
    assert _regrade_reason(state, handed_in("ann", "v2"), fresh=False) == (
        f"submission changed since it was graded on {WHEN} (attention.ipynb changed)")
    two = handed_in("ann")
    two.digests["heads.ipynb"] = digest("new")
    assert _regrade_reason(state, two, fresh=False).endswith("(heads.ipynb new)")
    # Nothing to grade now (a broken or absent re-upload): the earlier grading stays.
    assert _regrade_reason(state, handed_in("ann", None), fresh=False) is None
    assert _regrade_reason(state, handed_in("bob"), fresh=False) == FIRST_GRADING


def test_a_late_hand_in_of_a_student_who_was_missing_is_graded(state):
    record(state, "cy", status="missing", digests={}, timestamp=None)
    assert _regrade_reason(state, handed_in("cy", None), fresh=False) is None
    assert _regrade_reason(state, handed_in("cy", timestamp="2026-12-03 09:00:00 UTC"), fresh=False) == (
        f"new submission (was missing on {WHEN})")


def test_a_new_hand_in_time_alone_is_graded_again_and_a_failed_grading_retried(state):
    record(state, "di", digests={NOTEBOOK: digest("v1")}, timestamp="2026-12-01 09:00:00 UTC")
    assert _regrade_reason(state, handed_in("di", timestamp="2026-12-01 09:00:00 UTC"), fresh=False) is None
    assert _regrade_reason(state, handed_in("di", timestamp="2026-12-04 09:00:00 UTC"), fresh=False) == (
        f"new hand-in time 2026-12-04 09:00:00 UTC (was 2026-12-01 09:00:00 UTC when graded on {WHEN}), "
        "same notebooks")
    record(state, "ed", status="error")
    assert _regrade_reason(state, handed_in("ed"), fresh=False) == f"its grading on {WHEN} failed"


def test_a_record_that_predates_digests_is_compared_with_what_was_submitted(state):
    record(state, "fay")  # no digests, no timestamp: written before they were recorded
    submitted = state.parents[1] / "submitted" / "fay" / ASSIGNMENT
    submitted.mkdir(parents=True)
    (submitted / NOTEBOOK).write_text("v1")
    assert _regrade_reason(state, handed_in("fay"), fresh=False) is None
    assert "attention.ipynb changed" in _regrade_reason(state, handed_in("fay", "v2"), fresh=False)
    record(state, "gus")
    assert _regrade_reason(state, handed_in("gus"), fresh=False) == f"no record of what was graded on {WHEN}"


@pytest.mark.slow
def test_a_late_first_hand_in_then_a_changed_notebook_are_graded_and_manual_scores_survive(tmp_path):
    """Three runs over one student: missing, then handed in late, then changed (two notebooks graded in all)."""
    from nbgrader.api import Gradebook

    from stepformer.course.worker import COURSE_ID, course_config

    sandbox = sandbox_problem() is None
    answers = write_submissions(ATTENTION[:1], ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "answers")
    folder, work, out = tmp_path / "class", tmp_path / "work", tmp_path / "out"
    for student in ("kim", "zed"):  # zed never hands in: two folders, so the class is not taken for one student
        (folder / student).mkdir(parents=True)
    first = grade(ROOT, folder, ASSIGNMENT, out, work, progress=False, sandbox=sandbox)
    assert [(r.student, r.status) for r in first] == [("kim", "missing"), ("zed", "missing")]

    # The class downloaded again: kim handed in after the first run.
    shutil.copytree(answers / "correct" / ASSIGNMENT, folder / "kim" / ASSIGNMENT)
    (folder / "kim" / ASSIGNMENT / "timestamp.txt").write_text("2026-12-03 09:00:00 UTC")
    late, zed = grade(ROOT, folder, ASSIGNMENT, out, work, progress=False, sandbox=sandbox)
    assert zed.status == "missing" and "graded again" not in zed.detail
    assert late.status == "graded" and late.score == ATTENTION[0].points
    assert late.detail.startswith("graded again: new submission (was missing on ")
    cell = sorted(late.cells)[0]
    notebook_name, cell_id = cell.split(":")
    with Gradebook(course_config(ROOT, work).CourseDirectory.db_url, course_id=COURSE_ID) as gb:
        assert gb.find_submission(ASSIGNMENT, "kim").timestamp is not None
        gb.find_grade(cell_id, notebook_name, ASSIGNMENT, "kim").manual_score = 0.5
        gb.find_comment("ex1-solution", notebook_name, ASSIGNMENT, "kim").manual_comment = "see me"
        gb.db.commit()

    # And again: kim changed the notebook (a regrade request, say).
    path = folder / "kim" / ASSIGNMENT / NOTEBOOK
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("One more thought."))
    nbformat.write(nb, path)
    changed, _ = grade(ROOT, folder, ASSIGNMENT, out, work, progress=False, sandbox=sandbox)
    assert changed.detail.startswith("graded again: submission changed since it was graded on ")
    assert "(attention.ipynb changed)" in changed.detail and f"{cell}: manual score kept" in changed.detail
    assert changed.cells[cell] == 0.5 and changed.score == late.score - late.cells[cell] + 0.5
    with Gradebook(course_config(ROOT, work).CourseDirectory.db_url, course_id=COURSE_ID) as gb:
        assert gb.find_comment("ex1-solution", notebook_name, ASSIGNMENT, "kim").manual_comment == "see me"
    done = json.loads((work / ".stepformer-grader" / ASSIGNMENT / "done" / "kim.json").read_text())
    assert done["timestamp"] == "2026-12-03 09:00:00 UTC" and set(done["digests"]) == {NOTEBOOK}
