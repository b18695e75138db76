"""``stepformer-course export``: the whole course's grades, every student × assignment, for a spreadsheet or an LMS.

One gradebook (the grader's work folder, or an nbgrader course folder) holds every assignment; this
reads it and writes:

- ``csv``: one table: student, names, e-mail, one column per assignment, total, maximum, and the
  columns that make gaps visible: the assignments with no submission, those with answers still to
  grade by hand, those handed in late (with the penalty), and whether the student is on the roster;
- ``canvas``: one file per assignment for Canvas's Gradebook import (``Student``, ``ID``,
  ``SIS User ID``, ``SIS Login ID``, ``Section``, the assignment, and a ``Points Possible`` row);
- ``moodle``: one file per assignment for Moodle's "Import grades from CSV file" (``First name``,
  ``Last name``, ``ID number``, ``Email address``, the assignment), in points: each grade item's
  maximum must be set in Moodle to the assignment's, which the command prints.

An LMS file never holds an empty grade cell: both importers read an empty cell as "remove this
grade" (Canvas's ``GradebookImporter``, Moodle's ``gradeimport_csv_load_data``), so a student whose
grade is not ready (no submission, or answers not yet graded by hand) is left out of that
assignment's file, and the command prints a note for each. With a roster, only the students on it
are exported unless asked otherwise: Moodle aborts a whole import on one unknown user.

A score is the gradebook's current one (manual scores over automatic ones) less the late penalty,
computed now from that score by nbgrader's configured late-penalty plugin (:func:`late_penalty`):
nbgrader itself fixes the penalty when it autogrades, before any manual points exist.
"""

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("csv", "canvas", "moodle")


class ExportError(ValueError):
    """The gradebook or the roster cannot be read, or the format is unknown."""


@dataclass
class Student:
    """One student's row: who they are and, per assignment, what the gradebook holds now."""

    id: str
    first_name: str = ""
    last_name: str = ""
    email: str = ""
    lms_user_id: str = ""
    scores: dict[str, float | None] = field(default_factory=dict)  # assignment -> score, None: nothing handed in
    ungraded: dict[str, list[str]] = field(default_factory=dict)  # assignment -> cells still to grade by hand
    late: dict[str, tuple[float, float]] = field(default_factory=dict)  # assignment -> (seconds late, penalty)
    on_roster: bool = True
    in_gradebook: bool = True

    @property
    def missing(self) -> list[str]:
        return [a for a, s in self.scores.items() if s is None]

    def ready(self, assignment: str) -> bool:
        """Whether the assignment's grade is final enough to send to an LMS: handed in, nothing left to grade."""
        return self.scores.get(assignment) is not None and not self.ungraded.get(assignment)


def late_plugin(config: Any):
    """nbgrader's late-penalty plugin as ``config`` sets it (``AssignLatePenalties.plugin_class``, by default
    ``LateSubmissionPlugin`` with its ``penalty_method``), built the way nbgrader's own preprocessor builds it."""
    from nbgrader.preprocessors import AssignLatePenalties

    assigner = AssignLatePenalties(config=config)
    assigner.init_plugin()
    return assigner.plugin_inst


def late_penalty(plugin: Any, student: str, notebook_scores: list[float], seconds_late: float) -> float:
    """The late penalty of one submission, from its notebooks' current scores.

    As nbgrader's ``AssignLatePenalties`` does at autograde time, per notebook: the plugin's penalty
    (``None``: none), kept between 0 and the notebook's score; the submission's is their sum. Done
    here with today's scores, so points given by hand after autograding are penalised like the rest.
    Both ``grades.csv`` and the export call this: they cannot disagree.
    """
    if seconds_late <= 0:
        return 0.0
    total = 0.0
    for score in notebook_scores:
        penalty = plugin.late_submission_penalty(student, score, seconds_late)
        if penalty is not None:
            total += min(max(float(penalty), 0.0), score)
    return total


def submission_state(submission: Any, plugin: Any) -> tuple[float, float, list[str]]:
    """(score less the late penalty, the penalty, the cells still to grade by hand) of an nbgrader submission."""
    notebooks = list(submission.notebooks)
    scores = [float(nb.score or 0.0) for nb in notebooks]
    penalty = late_penalty(plugin, submission.student.id, scores, float(submission.total_seconds_late))
    # nbgrader marks a cell "needs manual grade" until someone gives it a manual score; it stays
    # marked after a re-autograde as a request to review a score that exists, which is not missing.
    ungraded = [f"{nb.name}:{grade.name}" for nb in notebooks for grade in nb.grades
                if grade.needs_manual_grade and grade.manual_score is None]
    return max(0.0, sum(scores) - penalty), penalty, ungraded


def read_gradebook(db_url: str, course_id: str, roster: list[dict[str, str]] | None = None, *,
                   config: Any = None, all_students: bool = False
                   ) -> tuple[list[tuple[str, float]], list[Student], list[Student]]:
    """(assignments in order with their maximum scores, the students to export, the students left out).

    ``config`` is nbgrader's configuration (its late-penalty plugin); without one, nbgrader's defaults.
    With a roster, the students who are not on it are left out unless ``all_students``.
    """
    from nbgrader.api import Gradebook, MissingEntry
    from traitlets.config import Config

    from stepformer.course.nbgrader_setup import tools_on_path

    tools_on_path()
    plugin = late_plugin(config if config is not None else Config())
    with Gradebook(db_url, course_id=course_id) as gb:
        assignments = [(a.name, float(a.max_score)) for a in sorted(gb.assignments, key=lambda a: a.name)]
        students = {}
        for s in gb.students:
            student = Student(s.id, s.first_name or "", s.last_name or "", s.email or "", s.lms_user_id or "")
            for name, _ in assignments:
                try:
                    submission = gb.find_submission(name, s.id)
                except MissingEntry:
                    student.scores[name] = None
                    continue
                score, penalty, ungraded = submission_state(submission, plugin)
                student.scores[name] = score
                if ungraded:
                    student.ungraded[name] = ungraded
                if submission.total_seconds_late > 0:
                    student.late[name] = (float(submission.total_seconds_late), penalty)
            students[s.id] = student
    left_out: list[Student] = []
    if roster is not None:
        listed = {row["student"] for row in roster}
        for student in students.values():
            student.on_roster = student.id in listed
        for row in roster:
            if row["student"] not in students:
                students[row["student"]] = Student(
                    row["student"], row.get("first_name", ""), row.get("last_name", ""), row.get("email", ""),
                    row.get("lms_user_id", ""), dict.fromkeys((a for a, _ in assignments), None), in_gradebook=False)
            else:  # the roster's names win: it is the registrar's list
                student = students[row["student"]]
                for key in ("first_name", "last_name", "email", "lms_user_id"):
                    if row.get(key):
                        setattr(student, key, row[key])
        if not all_students:
            left_out = sorted((s for s in students.values() if not s.on_roster), key=lambda s: s.id)
            students = {k: s for k, s in students.items() if s.on_roster}
    return assignments, sorted(students.values(), key=lambda s: s.id), left_out


def read_roster(path: Path) -> list[dict[str, str]]:
    """A CSV with a ``student`` (or ``id``) column and optional ``first_name``, ``last_name``, ``email``,
    ``lms_user_id`` columns."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise ExportError(f"cannot read roster {path}: {error}") from None
    if not rows:
        raise ExportError(f"roster {path} has no rows")
    key = next((k for k in ("student", "id", "student_id") if k in rows[0]), None)
    if key is None:
        raise ExportError(f"roster {path} has no 'student' or 'id' column (columns: {', '.join(rows[0])})")
    return [{**{k.strip(): (v or "").strip() for k, v in row.items() if k}, "student": row[key].strip()}
            for row in rows if (row.get(key) or "").strip()]


def _number(score: float | None) -> str:
    return "" if score is None else f"{score:g}"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def lms_path(out: Path, assignment: str) -> Path:
    """The LMS file of one assignment: ``course-canvas.csv`` -> ``course-canvas-01_attention.csv``."""
    out = Path(out)
    return out.with_name(f"{out.stem}-{assignment}{out.suffix or '.csv'}")


def _write_rows(path: Path, rows: list[list[str]]) -> None:
    """Write ``rows`` as CSV to ``path`` atomically: a half-written file never replaces a good one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    os.replace(tmp, path)


def write(path: Path, fmt: str, assignments: list[tuple[str, float]], students: list[Student]) -> list[Path]:
    """Write ``fmt`` (one table for ``csv``, one file per assignment for an LMS) next to ``path``; the files written."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; the formats are {', '.join(FORMATS)}")
    path = Path(path)
    names = [a for a, _ in assignments]
    if fmt == "csv":
        maximum = sum(m for _, m in assignments)
        rows = [["student", "first_name", "last_name", "email", *names, "total", "max_total", "no_submission",
                 "to_grade_by_hand", "late", "on_roster"]]
        for s in students:
            total = sum(v for v in s.scores.values() if v is not None)
            late = " ".join(f"{a}({_hours(seconds)},-{penalty:g})" for a, (seconds, penalty) in s.late.items())
            rows.append([s.id, s.first_name, s.last_name, s.email, *(_number(s.scores[a]) for a in names),
                         f"{total:g}", f"{maximum:g}", " ".join(s.missing), " ".join(s.ungraded), late,
                         "yes" if s.on_roster else "no"])
        _write_rows(path, rows)
        return [path]
    written = []
    for name, maximum in assignments:
        ready = [s for s in students if s.ready(name)]
        if fmt == "canvas":
            # Canvas reads the row whose first cell says "Points Possible" as each column's maximum.
            rows = [["Student", "ID", "SIS User ID", "SIS Login ID", "Section", name],
                    ["Points Possible", "", "", "", "", f"{maximum:g}"]]
            for s in ready:
                shown = f"{s.last_name}, {s.first_name}" if s.last_name or s.first_name else s.id
                rows.append([shown, s.lms_user_id, s.id, s.id, "", _number(s.scores[name])])
        else:
            rows = [["First name", "Last name", "ID number", "Email address", name]]
            rows += [[s.first_name, s.last_name, s.id, s.email, _number(s.scores[name])] for s in ready]
        target = lms_path(path, name)
        _write_rows(target, rows)
        written.append(target)
    return written


def notes(fmt: str, assignments: list[tuple[str, float]], students: list[Student],
          left_out: Sequence[Student] = ()) -> list[str]:
    """What the export could not say in its cells: one line per gap, per student and assignment."""
    lms = fmt != "csv"
    lines = []
    if left_out:
        lines.append(f"left out, not on the roster (--all-students includes them): "
                     f"{', '.join(s.id for s in left_out)}")
    for s in students:
        if not s.in_gradebook:
            lines.append(f"{s.id}: on the roster, never graded")
        elif not s.on_roster:
            lines.append(f"{s.id}: graded, not on the roster")
        if s.in_gradebook and s.missing:
            lines.append(f"{s.id}: no submission of {', '.join(s.missing)}"
                         + (": left out of those files" if lms else ""))
        for assignment, cells in s.ungraded.items():
            lines.append(f"{s.id}: {assignment}: {len(cells)} answer(s) not graded by hand yet ({', '.join(cells)})"
                         + (": left out of that file until graded in formgrader" if lms
                            else ": the score counts them as 0"))
        for assignment, (seconds, penalty) in s.late.items():
            lines.append(f"{s.id}: {assignment}: late by {_hours(seconds)}, penalty {penalty:g}")
    if lms:
        lines.append(f"{fmt}: a student whose grade is not ready has no row in that assignment's file, never an "
                     "empty cell (the import would remove a grade already in the LMS)")
    if fmt == "moodle":
        lines.append("moodle: the files hold points; before importing, set each grade item's maximum grade to: "
                     + ", ".join(f"{name} {maximum:g}" for name, maximum in assignments))
        if any(maximum > 100 for _, maximum in assignments):
            lines.append("moodle: a maximum above 100 needs the site settings 'unlimitedgrades' and "
                         "'gradepointmax' (Site administration > Grades > General settings)")
    return lines
