"""The course-wide export: every student x assignment from one gradebook, as CSV and for Canvas and Moodle.

The gradebooks are built with nbgrader's ``Gradebook`` API in a temporary SQLite file: no notebook runs.
"""

import csv
import datetime
import json
import shutil
import sys
from pathlib import Path

import pytest
from traitlets.config import Config

from stepformer.course.export import ExportError, notes, read_gradebook, read_roster, write

ROOT = Path(__file__).resolve().parents[1]
DUE = datetime.datetime(2026, 12, 1, 17, 0)


def _config(method: str) -> Config:
    config = Config()
    config.LateSubmissionPlugin.penalty_method = method
    return config


@pytest.fixture(scope="module")
def _template(tmp_path_factory) -> Path:
    """Two assignments (3 and 2 points); ann did both (one cell overridden by hand), ben only the first,
    two hours late, autograded to 3 with nbgrader's "zero" penalty stored (3) and a written answer
    (``why``, 1 point) nobody graded yet; cy never handed anything in."""
    from nbgrader.api import Gradebook

    from stepformer.course.nbgrader_setup import tools_on_path

    tools_on_path()  # nbgrader's gradebook runs alembic
    path = tmp_path_factory.mktemp("template") / "gradebook.db"
    url = f"sqlite:///{path}"
    with Gradebook(url, course_id="tf101") as gb:
        for name, cells in (("01_attention", {"ex1": 2, "ex2": 1}), ("02_masks", {"ex1": 2})):
            gb.add_assignment(name, duedate=DUE)
            gb.add_notebook("nb", name)
            for cell, points in cells.items():
                gb.add_grade_cell(cell, "nb", name, max_score=points, cell_type="code")
        gb.add_grade_cell("why", "nb", "02_masks", max_score=1, cell_type="markdown")
        gb.add_student("ann", first_name="Ann", last_name="Lee", email="ann@example.org", lms_user_id="101")
        gb.add_student("ben", first_name="Ben", last_name="Ode", email="ben@example.org")
        gb.add_student("cy")
        gb.add_submission("01_attention", "ann", timestamp=DUE - datetime.timedelta(hours=1))
        gb.add_submission("02_masks", "ann", timestamp=DUE)
        gb.add_submission("01_attention", "ben", timestamp=DUE + datetime.timedelta(hours=2))
        for student, assignment, cell, score in (("ann", "01_attention", "ex1", 2), ("ann", "01_attention", "ex2", 0),
                                                 ("ann", "02_masks", "ex1", 1), ("ben", "01_attention", "ex1", 2),
                                                 ("ben", "01_attention", "ex2", 1)):
            grade = gb.find_grade(cell, "nb", assignment, student)
            grade.auto_score, grade.needs_manual_grade = score, False
        gb.find_grade("why", "nb", "02_masks", "ann").needs_manual_grade = True  # as autograde leaves it
        manual = gb.find_grade("ex2", "nb", "01_attention", "ann")
        manual.manual_score = 0.5  # formgrader's override wins
        gb.find_submission_notebook("nb", "01_attention", "ben").late_submission_penalty = 3.0
        gb.db.commit()
    return path


@pytest.fixture
def gradebook(_template, tmp_path) -> str:
    """A copy of the template gradebook (a test may change it), in ``tmp_path``: its URL."""
    shutil.copyfile(_template, tmp_path / "gradebook.db")
    return f"sqlite:///{tmp_path / 'gradebook.db'}"


def _rows(path: Path) -> list[list[str]]:
    return list(csv.reader(path.open(newline="", encoding="utf-8")))


def _roster(tmp_path: Path) -> Path:
    roster = tmp_path / "roster.csv"
    roster.write_text("student,first_name,last_name,email\nann,Ann,Lee,ann@example.org\nben,Ben,Ode,ben@example.org\n"
                      "dee,Dee,Roy,dee@example.org\n")
    return roster


def test_csv_flags_gaps_handwork_and_lateness_and_exports_the_roster_only(gradebook, tmp_path):
    assignments, students, left_out = read_gradebook(gradebook, "tf101", read_roster(_roster(tmp_path)),
                                                     config=_config("none"))
    assert assignments == [("01_attention", 3.0), ("02_masks", 3.0)]
    write(tmp_path / "grades.csv", "csv", assignments, students)
    rows = _rows(tmp_path / "grades.csv")
    assert rows[0] == ["student", "first_name", "last_name", "email", "01_attention", "02_masks", "total",
                       "max_total", "no_submission", "to_grade_by_hand", "late", "on_roster"]
    assert rows[1:] == [  # cy (graded, not on the roster) is left out; dee (never graded) has a row
        ["ann", "Ann", "Lee", "ann@example.org", "2.5", "1", "3.5", "6", "", "02_masks", "", "yes"],
        ["ben", "Ben", "Ode", "ben@example.org", "3", "", "3", "6", "02_masks", "", "01_attention(2.0 h,-0)", "yes"],
        ["dee", "Dee", "Roy", "dee@example.org", "", "", "0", "6", "01_attention 02_masks", "", "", "yes"],
    ]
    assert [s.id for s in left_out] == ["cy"]
    assert notes("csv", assignments, students, left_out) == [
        "left out, not on the roster (--all-students includes them): cy",
        "ann: 02_masks: 1 answer(s) not graded by hand yet (nb:why): the score counts them as 0",
        "ben: no submission of 02_masks", "ben: 01_attention: late by 2.0 h, penalty 0",
        "dee: on the roster, never graded"]
    _, everyone, none_left = read_gradebook(gradebook, "tf101", read_roster(_roster(tmp_path)), all_students=True)
    assert [s.id for s in everyone] == ["ann", "ben", "cy", "dee"] and not none_left
    assert not everyone[2].on_roster


def test_late_penalty_comes_from_the_current_score_not_the_stored_one(gradebook):
    from nbgrader.api import Gradebook

    # ben's stored penalty (3) was fixed at autograde; a grader then takes a point off by hand.
    with Gradebook(gradebook, course_id="tf101") as gb:
        gb.find_grade("ex2", "nb", "01_attention", "ben").manual_score = 0.0
        gb.db.commit()
    scores = {m: {s.id: s.scores["01_attention"] for s in read_gradebook(gradebook, "tf101", config=_config(m))[1]}
              for m in ("none", "zero")}
    assert scores["none"]["ben"] == 2  # the full current score: nbgrader's stored penalty plays no part
    assert scores["zero"]["ben"] == 0 and scores["zero"]["ann"] == 2.5  # on time: no penalty
    # Points added by hand after autograde cannot escape the "zero" penalty either.
    with Gradebook(gradebook, course_id="tf101") as gb:
        gb.find_grade("ex2", "nb", "01_attention", "ben").extra_credit = 5.0
        gb.db.commit()
    assert read_gradebook(gradebook, "tf101", config=_config("zero"))[1][1].scores["01_attention"] == 0


def test_a_custom_late_plugin_from_nbgraders_configuration(gradebook):
    config = Config()
    config.AssignLatePenalties.plugin_class = "stepformer_test_late.HalfOff"
    sys.modules["stepformer_test_late"] = module = type(sys)("stepformer_test_late")
    from nbgrader.plugins import BasePlugin

    class HalfOff(BasePlugin):
        def late_submission_penalty(self, student_id, score, total_seconds_late):
            return score / 2

    module.HalfOff = HalfOff
    try:
        ben = read_gradebook(gradebook, "tf101", config=config)[1][1]
    finally:
        del sys.modules["stepformer_test_late"]
    assert ben.scores["01_attention"] == 1.5 and ben.late["01_attention"] == (7200.0, 1.5)


def test_lms_files_have_no_empty_grade_and_carry_the_maxima(gradebook, tmp_path):
    assignments, students, _ = read_gradebook(gradebook, "tf101", config=_config("none"))
    canvas_files = write(tmp_path / "canvas.csv", "canvas", assignments, students)
    assert canvas_files == [tmp_path / "canvas-01_attention.csv", tmp_path / "canvas-02_masks.csv"]
    assert _rows(canvas_files[0]) == [["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_attention"],
                                      ["Points Possible", "", "", "", "", "3"],
                                      ["Lee, Ann", "101", "ann", "ann", "", "2.5"],
                                      ["Ode, Ben", "", "ben", "ben", "", "3"]]
    # ann's 02_masks still has an answer to grade by hand, ben and cy handed nothing in: no row, no empty cell.
    assert _rows(canvas_files[1]) == [["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "02_masks"],
                                      ["Points Possible", "", "", "", "", "3"]]
    moodle_files = write(tmp_path / "moodle.csv", "moodle", assignments, students)
    assert _rows(moodle_files[0]) == [["First name", "Last name", "ID number", "Email address", "01_attention"],
                                      ["Ann", "Lee", "ann", "ann@example.org", "2.5"],
                                      ["Ben", "Ode", "ben", "ben@example.org", "3"]]
    said = notes("moodle", assignments, students)
    assert "moodle: the files hold points; before importing, set each grade item's maximum grade to: " \
           "01_attention 3, 02_masks 3" in said
    assert "ann: 02_masks: 1 answer(s) not graded by hand yet (nb:why): left out of that file until graded in " \
           "formgrader" in said and "cy: no submission of 01_attention, 02_masks: left out of those files" in said
    assert all(row[-1] for path in canvas_files + moodle_files for row in _rows(path)[1:])  # no empty grade
    with pytest.raises(ExportError, match="unknown format"):
        write(tmp_path / "x.csv", "blackboard", assignments, students)


def test_the_export_command(gradebook, tmp_path, monkeypatch, capsys):
    from stepformer.course.cli import main

    monkeypatch.chdir(ROOT)
    work = tmp_path  # the gradebook fixture's folder is a work folder with its gradebook.db
    (work / "nbgrader_config.py").write_text("c = get_config()\nc.CourseDirectory.course_id = 'tf101'\n"
                                             "c.LateSubmissionPlugin.penalty_method = 'zero'\n")
    out = tmp_path / "lms" / "moodle.csv"
    assert main(["export", "--format", "moodle", "--course", str(work), "--out", str(out),
                 "--roster", str(_roster(tmp_path))]) == 0
    done = capsys.readouterr()
    assert "3 students x 2 assignments (moodle)" in done.out and str(tmp_path / "lms" / "moodle-02_masks.csv") \
        in done.out
    assert "note: left out, not on the roster (--all-students includes them): cy" in done.err
    assert "note: ben: 01_attention: late by 2.0 h, penalty 3" in done.err  # zero, from the course's config
    assert _rows(tmp_path / "lms" / "moodle-01_attention.csv")[2] == ["Ben", "Ode", "ben", "ben@example.org", "0"]
    assert main(["export", "--workdir", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no gradebook in" in capsys.readouterr().err
    assert main(["export", "--course", str(work), "--out", str(out), "--all-students"]) == 2
    assert "--all-students only means something with --roster" in capsys.readouterr().err


def test_grades_csv_applies_the_late_penalty_to_the_current_score(gradebook, tmp_path):
    """``grade``'s grades.csv: ben was late under "zero", then got a manual point: still 0 (nbgrader stored 3)."""
    from nbgrader.api import Gradebook

    from stepformer.course.grade import _collect
    from stepformer.course.intake import Intake

    with Gradebook(gradebook, course_id="tf101") as gb:
        gb.find_submission_notebook("nb", "01_attention", "ben").late_submission_penalty = 0.0  # as under "none"
        gb.find_grade("ex1", "nb", "01_attention", "ben").extra_credit = 1.0
        gb.db.commit()
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "ben.json").write_text(json.dumps({"status": "graded", "notes": []}))
    results = {}
    for method in ("none", "zero"):
        (tmp_path / "nbgrader_config.py").write_text("c = get_config()\nc.CourseDirectory.course_id = 'tf101'\n"
                                                     f"c.LateSubmissionPlugin.penalty_method = '{method}'\n")
        [results[method]] = _collect(ROOT, tmp_path, tmp_path, "01_attention", [Intake("ben", status="ok")], {})
    assert results["none"].score == 4 and results["zero"].score == 0
    assert "late by 2 h 0 min: penalty 4" in results["zero"].detail
