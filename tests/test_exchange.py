"""A term's loop through nbgrader's own exchange, with the sandboxed grader in the middle.

release → students fetch → submit (one on time, one late) → instructor collects → the grader
autogrades the course folder in place → the instructor grades an answer by hand → feedback is made
again by nbgrader's own generate_feedback, released, and fetched by the students. Everything but
the grading step is nbgrader's own code, on a temporary exchange folder.
"""

import datetime
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from traitlets.config import Config

from stepformer.course.feedback import FEEDBACK_PREPROCESSORS
from stepformer.course.grade import SubmissionsError, grade_course
from stepformer.course.nbgrader_setup import api
from stepformer.course.sandbox import sandbox_problem
from stepformer.course.worker import course_config
from tests.fixtures.pages import leaks, page_score, page_text
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
        c.GenerateFeedback.preprocessors = {FEEDBACK_PREPROCESSORS!r}
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
    # The instructor grades ann's answer by hand (as in formgrader) and comments on it.
    with Gradebook(instructor.coursedir.db_url, course_id=COURSE_ID) as gb:
        gb.find_grade("ex3-explain", "attention", ASSIGNMENT, "ann").manual_score = 2
        gb.find_comment("ex3-explain", "attention", ASSIGNMENT, "ann").manual_comment = "Clear and right."
        gb.db.commit()
    # A second run grades nobody again (a newly collected submission would be), but makes the pages anew.
    again = grade_course(ROOT, course, ASSIGNMENT, tmp_path / "grades", progress=False, sandbox=SANDBOX)
    assert {r.student: r.score for r in again} == {"ann": 11, "ben": 0}
    page_name = NOTEBOOK.replace(".ipynb", ".html")
    for name in students:
        page = tmp_path / "grades" / "feedback" / name / ASSIGNMENT / page_name
        assert page_score(page) == ({"ann": 11, "ben": 0}[name], 11) and leaks(page, ASSIGNMENT, NOTEBOOK) == []
    assert "Clear and right." in page_text(tmp_path / "grades" / "feedback" / "ann" / ASSIGNMENT / page_name)

    # nbgrader's own generate_feedback in the course folder (as formgrader's button), with the line the guide
    # says to add to nbgrader_config.py; then its release and the students' fetch.
    tools = str(Path(sys.executable).parent)
    made = subprocess.run([f"{tools}/nbgrader", "generate_feedback", ASSIGNMENT, "--force"], cwd=course,
                          capture_output=True, text=True,
                          env=dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ['PATH']}"))
    assert made.returncode == 0, made.stderr
    assert instructor.release_feedback(ASSIGNMENT)["success"]
    for name, student in students.items():
        student["fetch_feedback"]()
        (page,) = (tmp_path / "home" / name / ASSIGNMENT / "feedback").glob(f"*/{page_name}")
        assert "✔" in page_text(page) and leaks(page, ASSIGNMENT, NOTEBOOK) == []
        assert page_score(page) == ({"ann": 11, "ben": 0}[name], 11)

    with pytest.raises(SubmissionsError, match="not in the gradebook"):
        grade_course(ROOT, course, "02_masks", tmp_path / "grades", progress=False, sandbox=SANDBOX)
