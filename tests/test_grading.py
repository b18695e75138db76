"""Grading the sample submissions gives exactly the expected points, whatever the others do."""

import csv
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from stepformer.course.grade import SubmissionsError, _run_worker, grade
from stepformer.course.sandbox import Limits, sandbox_problem
from tests.fixtures.submissions import ATTENTION, write_submissions

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
pytestmark = pytest.mark.slow
# The sample submissions are honest: they grade the same with or without the sandbox, so
# these tests also run where bubblewrap is missing (the adversarial corpus does not).
SANDBOX = sandbox_problem() is None


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = write_submissions(ATTENTION, ASSIGNMENT, NOTEBOOK, ROOT / "exercises",
                               tmp_path_factory.mktemp("submissions"))
    # The release exactly as students receive it: nothing answered.
    (folder / "untouched").mkdir()
    shutil.copy(ROOT / "exercises" / ASSIGNMENT / NOTEBOOK, folder / "untouched" / NOTEBOOK)
    out = tmp_path_factory.mktemp("grades")
    results = grade(ROOT, folder, ASSIGNMENT, out, tmp_path_factory.mktemp("work"), progress=False, sandbox=SANDBOX)
    return {r.student: r for r in results}, out


@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: c.name)
def test_sample_submission_gets_exactly_its_points(graded, case):
    results, out = graded
    assert results[case.name].status == "graded"
    assert results[case.name].score == case.points
    feedback = (out / "feedback" / case.name / ASSIGNMENT / "attention.html").read_text()
    assert case.feedback in feedback


def test_untouched_release_scores_zero(graded):
    results, _ = graded
    assert results["untouched"].score == 0
    assert results["untouched"].max_score == 9


def test_grades_csv_has_one_row_per_student_with_cell_scores(graded):
    results, out = graded
    rows = {row["student"]: row for row in csv.DictReader((out / "grades.csv").open())}
    assert set(rows) == set(results)
    assert rows["missing_scale"]["attention:ex1-shapes"] == "1"
    assert rows["missing_scale"]["attention:ex1-values"] == "0"
    assert sum(float(v) for k, v in rows["correct"].items() if k.startswith("attention:")) == 9


def test_feedback_does_not_reveal_hidden_tests(graded):
    _, out = graded
    for page in (out / "feedback").glob(f"*/{ASSIGNMENT}/*.html"):
        text = page.read_text()
        assert "seed=202" not in text and "BEGIN HIDDEN TESTS" not in text


def test_a_zip_with_a_top_level_folder_grades_the_same(tmp_path):
    folder = write_submissions(ATTENTION[:1], ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "class")
    archive = tmp_path / "class.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in folder.rglob("*.ipynb"):
            zf.write(path, Path("class") / path.relative_to(folder))
    results = grade(ROOT, archive, ASSIGNMENT, tmp_path / "out", tmp_path / "work", progress=False, sandbox=SANDBOX)
    assert [(r.student, r.score) for r in results] == [("correct", 9)]


def test_unknown_assignment_and_missing_folder_are_clear_errors(tmp_path):
    with pytest.raises(SubmissionsError, match="unknown assignment"):
        grade(ROOT, tmp_path, "99_nothing", tmp_path / "out", tmp_path / "work", progress=False, sandbox=SANDBOX)
    with pytest.raises(SubmissionsError, match="does not exist"):
        grade(ROOT, tmp_path / "absent", ASSIGNMENT, tmp_path / "out", tmp_path / "work", sandbox=SANDBOX)


def test_a_crashed_worker_costs_only_its_student_and_leaves_its_traceback(tmp_path):
    """A worker process that dies is recorded as an error for that student, never as finished."""
    # Not a course: the worker fails while reading nbgrader's configuration and exits.
    work = tmp_path / "work"
    work.mkdir()
    _run_worker(tmp_path, work, ASSIGNMENT, "alice", Limits(), None, dict(os.environ))
    done = json.loads((work / "done" / "alice.json").read_text())
    assert done["status"] == "error"
    assert "the grading process failed (exit 1)" in done["detail"]
    assert "Traceback" in (work / "logs" / "alice.log").read_text()
