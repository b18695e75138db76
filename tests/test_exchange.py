"""A term's loop through nbgrader's own exchange, with the sandboxed grader in the middle.

release → students fetch → submit (one on time, one late) → instructor collects → the grader
autogrades the course folder in place → feedback is released → students fetch it. Everything but
the grading step is nbgrader's own code, on a temporary exchange folder.
"""

import datetime
import re
import shutil
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from traitlets.config import Config

from stepformer.course.grade import SubmissionsError, grade_course
from stepformer.course.nbgrader_setup import api
from stepformer.course.sandbox import sandbox_problem
from stepformer.course.worker import course_config
from tests.fixtures.submissions import ATTENTION, build

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
COURSE_ID = "tf101"
SANDBOX = sandbox_problem() is None
pytestmark = pytest.mark.slow


def _student(exchange: Path, home: Path, student: str):
    """What a student's ``nbgrader fetch_assignment`` / ``submit`` / ``fetch_feedback`` do, as ``student``."""
    from nbgrader.auth import Authenticator
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.exchange.default import ExchangeFetchAssignment, ExchangeFetchFeedback, ExchangeSubmit

    config = Config()
    config.Exchange.root = str(exchange)
    config.Exchange.cache = str(home / ".nbgrader-cache")
    config.Exchange.assignment_dir = str(home)
    config.CourseDirectory.course_id = COURSE_ID
    config.CourseDirectory.student_id = student
    home.mkdir(parents=True, exist_ok=True)

    def run(kind):
        coursedir = CourseDirectory(config=config)
        coursedir.assignment_id = ASSIGNMENT
        return kind(coursedir=coursedir, authenticator=Authenticator(config=config), config=config).start()

    return {"fetch": lambda: run(ExchangeFetchAssignment), "submit": lambda: run(ExchangeSubmit),
            "fetch_feedback": lambda: run(ExchangeFetchFeedback)}


def test_release_fetch_submit_collect_grade_and_return_feedback(tmp_path):
    from nbgrader.api import Gradebook

    exchange, course = tmp_path / "exchange", tmp_path / "course"
    exchange.mkdir()
    exchange.chmod(0o777)
    (course / "source").mkdir(parents=True)
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, course / "source" / ASSIGNMENT)
    (course / "nbgrader_config.py").write_text(textwrap.dedent(f"""\
        c = get_config()
        c.CourseDirectory.course_id = {COURSE_ID!r}
        c.Exchange.root = {str(exchange)!r}
        c.LateSubmissionPlugin.penalty_method = "zero"
        """))
    instructor = api(course_config(ROOT, course))
    assert instructor.generate_assignment(ASSIGNMENT, force=True)["success"]
    assert instructor.release_assignment(ASSIGNMENT)["success"]

    answered = build(ATTENTION[0], ASSIGNMENT, NOTEBOOK, ROOT / "exercises")  # every exercise right
    students = {name: _student(exchange, tmp_path / "home" / name, name) for name in ("ann", "ben")}
    for name, student in students.items():
        student["fetch"]()
        fetched = tmp_path / "home" / name / ASSIGNMENT / NOTEBOOK
        assert "raise NotImplementedError" in fetched.read_text()
        nbformat.write(answered, fetched)
    students["ann"]["submit"]()
    due = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)  # nbgrader keeps naive UTC
    time.sleep(1.5)
    students["ben"]["submit"]()  # after the due date
    with Gradebook(instructor.coursedir.db_url, course_id=COURSE_ID) as gb:
        gb.update_or_create_assignment(ASSIGNMENT, duedate=due)

    assert instructor.collect(ASSIGNMENT)["success"]
    for name in students:
        assert (course / "submitted" / name / ASSIGNMENT / "timestamp.txt").is_file()
    results = {r.student: r for r in grade_course(ROOT, course, ASSIGNMENT, tmp_path / "grades", progress=False,
                                                  sandbox=SANDBOX)}
    assert results["ann"].score == 9 and "late" not in results["ann"].detail
    # nbgrader's "zero" late penalty, from the collected timestamp: all of ben's points.
    assert results["ben"].score == 0 and re.search(r"late by 0 min \d+ s: penalty 9", results["ben"].detail)
    assert sum(results["ben"].cells.values()) == 9  # the checks themselves passed
    with Gradebook(instructor.coursedir.db_url, course_id=COURSE_ID) as gb:
        assert {s.student.id: s.score - s.late_submission_penalty for s in gb.assignment_submissions(ASSIGNMENT)
                } == {"ann": 9, "ben": 0}
        assert gb.find_assignment(ASSIGNMENT).course_id == COURSE_ID
    # Graded in place: nbgrader's folders, the grader's bookkeeping apart, nothing of the course's removed.
    assert (course / "autograded" / "ann" / ASSIGNMENT / NOTEBOOK).is_file()
    assert (course / "source" / ASSIGNMENT / NOTEBOOK).is_file()
    assert (course / ".stepformer-grader" / ASSIGNMENT / "done" / "ann.json").is_file()
    # A second run grades nobody again; a newly collected submission would be.
    again = grade_course(ROOT, course, ASSIGNMENT, tmp_path / "grades", progress=False, sandbox=SANDBOX)
    assert {r.student: r.score for r in again} == {"ann": 9, "ben": 0}

    assert instructor.release_feedback(ASSIGNMENT)["success"]
    for name, student in students.items():
        student["fetch_feedback"]()
        (page,) = (tmp_path / "home" / name / ASSIGNMENT / "feedback").glob(f"*/{NOTEBOOK.replace('.ipynb', '.html')}")
        text = page.read_text()
        assert "✔" in text and "BEGIN HIDDEN TESTS" not in text

    with pytest.raises(SubmissionsError, match="not in the gradebook"):
        grade_course(ROOT, course, "02_masks", tmp_path / "grades", progress=False, sandbox=SANDBOX)
