"""The course-wide export: every student x assignment from one gradebook, as CSV and for Canvas and Moodle."""

import csv
import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from stepformer.course.export import ExportError, gaps, read_gradebook, read_roster, write

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gradebook(tmp_path):
    """Two assignments (3 and 2 points); ann did both (one cell overridden by hand), ben only the first,
    late with nbgrader's penalty; cy never handed anything in."""
    from nbgrader.api import Gradebook

    from stepformer.course.nbgrader_setup import tools_on_path

    tools_on_path()  # nbgrader's gradebook runs alembic
    url = f"sqlite:///{tmp_path / 'gradebook.db'}"
    due = datetime.datetime(2026, 12, 1, 17, 0)
    with Gradebook(url, course_id="tf101") as gb:
        for name, cells in (("01_attention", {"ex1": 2, "ex2": 1}), ("02_masks", {"ex1": 2})):
            gb.add_assignment(name, duedate=due)
            gb.add_notebook("nb", name)
            for cell, points in cells.items():
                gb.add_grade_cell(cell, "nb", name, max_score=points, cell_type="code")
        gb.add_student("ann", first_name="Ann", last_name="Lee", email="ann@example.org", lms_user_id="101")
        gb.add_student("ben", first_name="Ben", last_name="Ode", email="ben@example.org")
        gb.add_student("cy")
        gb.add_submission("01_attention", "ann", timestamp=due - datetime.timedelta(hours=1))
        gb.add_submission("02_masks", "ann", timestamp=due)
        gb.add_submission("01_attention", "ben", timestamp=due + datetime.timedelta(hours=2))
        for student, assignment, cell, score in (("ann", "01_attention", "ex1", 2), ("ann", "01_attention", "ex2", 0),
                                                 ("ann", "02_masks", "ex1", 1), ("ben", "01_attention", "ex1", 2),
                                                 ("ben", "01_attention", "ex2", 1)):
            gb.find_grade(cell, "nb", assignment, student).auto_score = score
        gb.find_grade("ex2", "nb", "01_attention", "ann").manual_score = 0.5  # formgrader's override wins
        gb.find_submission_notebook("nb", "01_attention", "ben").late_submission_penalty = 1.0
        gb.db.commit()
    return url


def _rows(path: Path) -> list[list[str]]:
    return list(csv.reader(path.open(newline="", encoding="utf-8")))


def test_every_student_and_assignment_with_overrides_penalties_and_gaps(gradebook, tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text("student,first_name,last_name,email\nann,Ann,Lee,ann@example.org\nben,Ben,Ode,ben@example.org\n"
                      "dee,Dee,Roy,dee@example.org\n")
    assignments, students = read_gradebook(gradebook, "tf101", read_roster(roster))
    assert assignments == [("01_attention", 3.0), ("02_masks", 2.0)]
    write(tmp_path / "grades.csv", "csv", assignments, students)
    rows = _rows(tmp_path / "grades.csv")
    assert rows[0] == ["student", "first_name", "last_name", "email", "01_attention", "02_masks", "total",
                       "max_total", "no_submission", "on_roster"]
    assert rows[1:] == [
        ["ann", "Ann", "Lee", "ann@example.org", "2.5", "1", "3.5", "5", "", "yes"],
        ["ben", "Ben", "Ode", "ben@example.org", "2", "", "2", "5", "02_masks", "yes"],
        ["cy", "", "", "", "", "", "0", "5", "01_attention 02_masks", "no"],
        ["dee", "Dee", "Roy", "dee@example.org", "", "", "0", "5", "01_attention 02_masks", "yes"],
    ]
    assert gaps(assignments, students) == [
        "ben: no submission of 02_masks", "cy: graded, not on the roster",
        "cy: no submission of 01_attention, 02_masks", "dee: on the roster, never graded"]


def test_canvas_and_moodle_files_have_the_columns_their_importers_read(gradebook, tmp_path):
    assignments, students = read_gradebook(gradebook, "tf101")
    write(tmp_path / "canvas.csv", "canvas", assignments, students)
    canvas = _rows(tmp_path / "canvas.csv")
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_attention", "02_masks"]
    assert canvas[1] == ["Points Possible", "", "", "", "", "3", "2"]
    assert canvas[2] == ["Lee, Ann", "101", "ann", "ann", "", "2.5", "1"]
    assert canvas[3][0] == "Ode, Ben" and canvas[3][5:] == ["2", ""]  # no submission: empty, not 0
    write(tmp_path / "moodle.csv", "moodle", assignments, students)
    moodle = _rows(tmp_path / "moodle.csv")
    assert moodle[0] == ["First name", "Last name", "ID number", "Email address", "01_attention", "02_masks"]
    assert moodle[1] == ["Ann", "Lee", "ann", "ann@example.org", "2.5", "1"]
    with pytest.raises(ExportError, match="unknown format"):
        write(tmp_path / "x.csv", "blackboard", assignments, students)


def test_the_export_command(gradebook, tmp_path):
    work = tmp_path  # the gradebook fixture's folder is a work folder with its gradebook.db
    (work / "nbgrader_config.py").write_text("c = get_config()\nc.CourseDirectory.course_id = 'tf101'\n")
    out = tmp_path / "lms" / "canvas.csv"
    done = subprocess.run([sys.executable, "-m", "stepformer.course.cli", "export", "--format", "canvas",
                           "--course", str(work), "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "3 students x 2 assignments" in done.stdout and "note: ben: no submission of 02_masks" in done.stderr
    assert _rows(out)[0][:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
    missing = subprocess.run([sys.executable, "-m", "stepformer.course.cli", "export", "--workdir",
                              str(tmp_path / "nothing"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "no gradebook in" in missing.stderr
