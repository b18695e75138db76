"""Grading the sample submissions gives exactly the expected points, whatever the others do."""

import csv
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from stepformer.course.grade import MARKER, SubmissionsError, WorkFolderRefused, _run_worker, grade, grade_command
from stepformer.course.intake import infer_assignment
from stepformer.course.paths import notebook_names
from stepformer.course.sandbox import Limits, sandbox_problem
from tests.fixtures.pages import FULL_TRACEBACK, leaks, page_score, page_text
from tests.fixtures.submissions import ATTENTION, write_submissions

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
pytestmark = pytest.mark.slow
# The sample submissions are honest: they grade the same with or without the sandbox, so
# these tests also run where bubblewrap is missing (the adversarial corpus does not).
SANDBOX = sandbox_problem() is None


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The sample submissions and the work folder that ``graded`` grades them in."""
    folder = write_submissions(ATTENTION, ASSIGNMENT, NOTEBOOK, ROOT / "exercises",
                               tmp_path_factory.mktemp("submissions"))
    # The release exactly as students receive it: nothing answered.
    (folder / "untouched").mkdir()
    shutil.copy(ROOT / "exercises" / ASSIGNMENT / NOTEBOOK, folder / "untouched" / NOTEBOOK)
    return {"submissions": folder, "work": tmp_path_factory.mktemp("work")}


@pytest.fixture(scope="module")
def graded(tmp_path_factory, folders):
    out = tmp_path_factory.mktemp("grades")
    results = grade(ROOT, folders["submissions"], ASSIGNMENT, out, folders["work"], progress=False, sandbox=SANDBOX)
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
    assert results["untouched"].max_score == 11  # 9 checked automatically, 2 graded by hand
    assert results["correct"].by_hand == 2 and "(ex3-explain)" in results["correct"].detail


def test_grades_csv_has_one_row_per_student_with_cell_scores(graded):
    results, out = graded
    rows = {row["student"]: row for row in csv.DictReader((out / "grades.csv").open())}
    assert set(rows) == set(results)
    assert rows["missing_scale"]["attention:ex1-shapes"] == "1"
    assert rows["missing_scale"]["attention:ex1-values"] == "0"
    assert sum(float(v) for k, v in rows["correct"].items() if k.startswith("attention:")) == 9


def test_feedback_does_not_reveal_hidden_tests(graded):
    results, out = graded
    pages = sorted((out / "feedback").glob(f"*/{ASSIGNMENT}/*.html"))
    assert {p.parts[-3] for p in pages} == {s for s, r in results.items() if r.status == "graded"}
    for page in pages:
        assert leaks(page, ASSIGNMENT, NOTEBOOK) == [], page
    # A failing check keeps its message, never the whole traceback around it.
    text = page_text(out / "feedback" / "missing_scale" / ASSIGNMENT / "attention.html")
    assert "You did not divide the scores by sqrt(d_k)." in text and FULL_TRACEBACK not in text


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


def test_a_folder_that_is_not_the_graders_own_is_refused_untouched(tmp_path):
    """An existing nbgrader course (or any non-empty folder) given as --workdir loses nothing."""
    course = tmp_path / "course"
    kept = course / "submitted" / "alice" / ASSIGNMENT / "important.txt"
    kept.parent.mkdir(parents=True)
    kept.write_text("my work")
    folder = write_submissions(ATTENTION[:1], ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "class")
    with pytest.raises(WorkFolderRefused, match="not a work folder of this grader.*left untouched"):
        grade(ROOT, folder, ASSIGNMENT, tmp_path / "out", course, progress=False, sandbox=SANDBOX)
    assert kept.read_text() == "my work"
    assert sorted(p.relative_to(course).as_posix() for p in course.rglob("*")) == [
        "submitted", "submitted/alice", f"submitted/alice/{ASSIGNMENT}", f"submitted/alice/{ASSIGNMENT}/important.txt"]


def test_manual_scores_and_comments_survive_a_change_of_the_checks(tmp_path):
    """A regrade after the checks or solutions change keeps what the instructor set in formgrader."""
    from nbgrader.api import Gradebook

    from stepformer.course.worker import COURSE_ID, course_config

    folder = write_submissions(ATTENTION[:1], ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "class")
    work = tmp_path / "work"
    first = grade(ROOT, folder, ASSIGNMENT, tmp_path / "out", work, progress=False, sandbox=SANDBOX)
    cell, other = sorted(first[0].cells)[:2]
    notebook_name, cell_id = cell.split(":")
    with Gradebook(course_config(ROOT, work).CourseDirectory.db_url, course_id=COURSE_ID) as gb:
        grade_row = gb.find_grade(cell_id, notebook_name, ASSIGNMENT, "correct")
        grade_row.manual_score = 0.5
        gb.find_comment("ex1-solution", notebook_name, ASSIGNMENT, "correct").manual_comment = "see me"
        gb.db.commit()
    # The checks changed: what the work folder was made from is no longer what the grader has now.
    marker = work / MARKER
    marker.write_text(json.dumps({"fingerprints": {ASSIGNMENT: "checks of last week"}}))
    (work / "overrides").mkdir()
    (work / "overrides" / f"pending-{ASSIGNMENT}.json").write_text(json.dumps([{
        "student": "correct", "notebook": notebook_name, "cell": "a-cell-since-removed", "manual_score": 1.0,
        "extra_credit": None, "auto_score": 1.0}]))
    again = grade(ROOT, folder, ASSIGNMENT, tmp_path / "out", work, progress=False, sandbox=SANDBOX)
    assert again[0].cells[cell] == 0.5 and again[0].cells[other] == first[0].cells[other]
    assert f"{cell}: manual score kept" in again[0].detail
    assert "a-cell-since-removed: a manual score or comment was set aside (the cell is gone)" in again[0].detail
    with Gradebook(course_config(ROOT, work).CourseDirectory.db_url, course_id=COURSE_ID) as gb:
        assert gb.find_comment("ex1-solution", notebook_name, ASSIGNMENT, "correct").manual_comment == "see me"
        assert gb.find_grade(cell_id, notebook_name, ASSIGNMENT, "correct").manual_score == 0.5
    # A dated copy of what was set aside stays; the cell that is gone waits in pending-<assignment>.json.
    (archive,) = (work / "overrides").glob(f"{ASSIGNMENT}-*.json")
    assert {e.get("manual_comment") for e in json.loads(archive.read_text())} >= {"see me"}
    assert [e["cell"] for e in json.loads((work / "overrides" / f"pending-{ASSIGNMENT}.json").read_text())] == [
        "a-cell-since-removed"]


def test_another_assignments_notebook_is_named_as_such_never_taken_for_a_renamed_one(tmp_path):
    folder = write_submissions(ATTENTION[:1], ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "class")
    (folder / "bob").mkdir()
    shutil.copy(ROOT / "exercises" / "03_multihead" / "multihead.ipynb", folder / "bob" / "multihead.ipynb")
    archive = tmp_path / "week3.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in folder.rglob("*.ipynb"):
            zf.write(path, path.relative_to(folder))
    results = {r.student: r for r in grade(ROOT, archive, ASSIGNMENT, tmp_path / "out", tmp_path / "work",
                                           progress=False, sandbox=SANDBOX)}
    assert results["correct"].score == 9
    assert results["bob"].score == 0 and "renamed" not in results["bob"].detail
    assert "multihead.ipynb is the notebook of assignment 03_multihead, not of 01_attention" in results["bob"].detail
    # Without an assignment, a mixed zip is not guessed: the command stops and says what it found.
    code, err = _command(archive, tmp_path)
    assert code == 2
    assert "holds notebooks of 2 assignments (01_attention: attention.ipynb; 03_multihead: multihead.ipynb)" in err
    assert not (tmp_path / "cli-out").exists()


def _command(submissions: Path, tmp_path: Path) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = grade_command(ROOT, submissions, None, tmp_path / "cli-out", tmp_path / "cli-work", sandbox=SANDBOX)
    return code, err.getvalue()


def test_the_assignment_is_inferred_only_when_every_notebook_is_one_assignments(tmp_path):
    notebooks = notebook_names(ROOT)
    folder = tmp_path / "class"
    for student, name in (("ann", "attention.ipynb"), ("ben", "Attention (1).ipynb"), ("cy", "attention.ipynb")):
        (folder / student).mkdir(parents=True)
        shutil.copy(ROOT / "exercises" / ASSIGNMENT / NOTEBOOK, folder / student / name)
    for student in ("eve", "fay", "gus", "hal", "ivy", "jo"):  # a zip per student, more of them than zips may nest
        with zipfile.ZipFile(folder / f"{student}.zip", "w") as zf:
            zf.write(ROOT / "exercises" / ASSIGNMENT / NOTEBOOK, f"{student}/{ASSIGNMENT}/{NOTEBOOK}")
    assert infer_assignment(folder, notebooks, tmp_path / "scratch") == ASSIGNMENT
    # One student's zip inside the class folder counts too.
    with zipfile.ZipFile(folder / "dee.zip", "w") as zf:
        zf.write(ROOT / "exercises" / "02_masks" / "masks.ipynb", "dee/masks.ipynb")
    with pytest.raises(SubmissionsError, match=r"2 assignments \(01_attention: .*; 02_masks: masks.ipynb\)"):
        infer_assignment(folder, notebooks, tmp_path / "scratch2")
    (folder / "dee.zip").unlink()
    shutil.copy(ROOT / "exercises" / ASSIGNMENT / NOTEBOOK, folder / "cy" / "scratch work.ipynb")
    with pytest.raises(SubmissionsError, match="scratch work.ipynb: not the name of any assignment's notebook"):
        infer_assignment(folder, notebooks, tmp_path / "scratch3")


def test_make_grade_passes_no_default_assignment():
    import subprocess

    dry = subprocess.run(["make", "-n", "grade", "SUBMISSIONS=week3.zip"], cwd=ROOT, capture_output=True, text=True)
    line = next(x for x in dry.stdout.splitlines() if "stepformer-course grade" in x)
    assert "--assignment" not in line
    dry = subprocess.run(["make", "-n", "grade", "SUBMISSIONS=week3.zip", "ASSIGNMENT=02_masks"], cwd=ROOT,
                         capture_output=True, text=True)
    assert "--assignment 02_masks" in dry.stdout


def test_an_instructors_own_assignment_grades_with_nbgraders_semantics(tmp_path):
    """Plain ``assert`` test cells: their points unless they raise, hidden tests included, still sandboxed;
    a manually graded answer is left for the instructor and the summary says so."""
    import copy

    import nbformat

    from stepformer.course.release import release
    from stepformer.course.scaffold import ScaffoldError, new_assignment

    course = tmp_path / "course"
    (course / "autograder").mkdir(parents=True)
    shutil.copy(ROOT / "autograder" / "nbgrader_config.py", course / "autograder")
    (course / "solutions").mkdir()
    assert new_assignment(course, "12_sums") == course / "solutions" / "12_sums" / "sums.ipynb"
    with pytest.raises(ScaffoldError, match="exists already"):
        new_assignment(course, "12_sums")
    with pytest.raises(ScaffoldError, match="two digits"):
        new_assignment(course, "Sums")
    release(course, course / "exercises")
    handed_out = nbformat.read(course / "exercises" / "12_sums" / "sums.ipynb", as_version=4)
    text = "\n".join(cell.source for cell in handed_out.cells)
    assert "raise NotImplementedError" in text
    assert "HIDDEN" not in text and "0.75" not in text and "Rubric" not in text and "return a + b" not in text

    def answered(body: str) -> nbformat.NotebookNode:
        nb = copy.deepcopy(handed_out)
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id == "ex1-solution":
                cell.source = f"def add(a, b):\n    {body}"
            elif grade_id == "ex2-answer":
                cell.source = "'22': + joins the two strings."
        return nb

    submissions = tmp_path / "submissions"
    for student, body in {"right": "return a + b", "wrong": "return a - b",
                          "visible_tests_only": "return a + b if isinstance(a, int) else 0"}.items():
        (submissions / student).mkdir(parents=True)
        nbformat.write(answered(body), submissions / student / "sums.ipynb")
    results = {r.student: r for r in grade(course, submissions, "12_sums", tmp_path / "out", tmp_path / "work",
                                           progress=False, sandbox=SANDBOX)}
    assert results["right"].cells == {"sums:ex1-tests": 2.0, "sums:ex2-answer": 0.0}
    assert results["right"].max_score == 3 and results["right"].status == "graded"
    assert "1 answer(s) to grade by hand in formgrader (ex2-answer)" in results["right"].detail
    assert "re-run" not in results["right"].detail
    assert results["wrong"].score == 0 and results["visible_tests_only"].score == 0


def test_a_manual_score_and_comment_reach_the_feedback_page_with_the_total_of_grades_csv(graded, folders, tmp_path):
    """What the instructor sets in formgrader after grading shows on the student's page after the next grading
    run (which grades nobody again) and after ``stepformer-course feedback``."""
    from nbgrader.api import Gradebook

    from stepformer.course.worker import COURSE_ID, course_config

    results, _ = graded
    work, page_name = folders["work"], NOTEBOOK.replace(".ipynb", ".html")
    assert results["correct"].score == 9  # ex3-explain, 2 points, waits for a grade by hand

    def set_by_hand(score: float | None, comment: str | None) -> None:
        with Gradebook(course_config(ROOT, work).CourseDirectory.db_url, course_id=COURSE_ID) as gb:
            gb.find_grade("ex3-explain", "attention", ASSIGNMENT, "correct").manual_score = score
            gb.find_comment("ex3-explain", "attention", ASSIGNMENT, "correct").manual_comment = comment
            gb.db.commit()

    try:
        set_by_hand(2, "Right: unscaled scores grow with the width, so the softmax saturates.")
        grade(ROOT, folders["submissions"], ASSIGNMENT, tmp_path / "again", work, progress=False, sandbox=SANDBOX)
        rows = {row["student"]: row for row in csv.DictReader((tmp_path / "again" / "grades.csv").open())}
        assert rows["correct"]["score"] == "11"
        for student, row in rows.items():
            page = tmp_path / "again" / "feedback" / student / ASSIGNMENT / page_name
            assert page_score(page) == (float(row["score"]), float(row["max_score"])), student
        page = tmp_path / "again" / "feedback" / "correct" / ASSIGNMENT / page_name
        assert "the softmax saturates" in page_text(page)

        set_by_hand(1.5, "Half right: say why the scores grow.")
        from stepformer.course.feedback import feedback_command

        assert feedback_command(ROOT, ASSIGNMENT, workdir=work, out=tmp_path / "fb", only=["correct"]) == 0
        page = tmp_path / "fb" / "feedback" / "correct" / ASSIGNMENT / page_name
        assert page_score(page) == (10.5, 11) and "Half right: say why the scores grow." in page_text(page)
        assert sorted(p.name for p in (tmp_path / "fb" / "feedback").iterdir()) == ["correct"]
        assert page.read_bytes() == (work / "feedback" / "correct" / ASSIGNMENT / page_name).read_bytes()
    finally:
        set_by_hand(None, None)


def test_nbgraders_own_generate_feedback_in_the_work_folder_hides_the_hidden_checks(graded, folders):
    """What formgrader's "Generate Feedback" button does: nbgrader, started in the work folder, reads its
    nbgrader_config.py there."""
    import subprocess
    import sys

    results, _ = graded
    work, tools = folders["work"], str(Path(sys.executable).parent)
    done = subprocess.run([f"{tools}/nbgrader", "generate_feedback", ASSIGNMENT, "--force"], cwd=work,
                          capture_output=True, text=True, env=dict(os.environ, PATH=f"{tools}{os.pathsep}"
                                                                                    f"{os.environ['PATH']}"))
    assert done.returncode == 0, done.stderr
    pages = sorted((work / "feedback").glob(f"*/{ASSIGNMENT}/*.html"))
    assert {p.parts[-3] for p in pages} == set(results)
    for page in pages:
        assert leaks(page, ASSIGNMENT, NOTEBOOK) == [], page
    text = page_text(work / "feedback" / "missing_scale" / ASSIGNMENT / "attention.html")
    assert "You did not divide the scores by sqrt(d_k)." in text and FULL_TRACEBACK not in text
