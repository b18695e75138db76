"""``stepformer-course export``: the whole course's grades, every student × assignment, for a spreadsheet or an LMS.

One gradebook (the grader's work folder, or an nbgrader course folder) holds every assignment; this
reads it and writes one table:

- ``csv``: student, names, e-mail, one column per assignment, total, maximum, and two columns that
  make gaps visible: the assignments with no submission, and whether the student is on the roster;
- ``canvas``: Canvas's Gradebook import file (``Student``, ``ID``, ``SIS User ID``, ``SIS Login ID``,
  ``Section``, then one column per assignment, and a ``Points Possible`` row), see the guide
  "How do I import grades in the Gradebook?" in the Canvas Instructor Guide;
- ``moodle``: a file for Moodle's "Import grades from CSV file" (``First name``, ``Last name``,
  ``ID number``, ``Email address``, then one column per assignment), matched on ``ID number`` or
  ``Email address``, see https://docs.moodle.org/en/Grade_import.

A score is the gradebook's (manual scores over automatic ones) less nbgrader's late penalty. A
student with no submission of an assignment gets an empty cell, never a silent 0; a student on the
roster who is not in the gradebook gets a row of empty cells; both are also printed.
"""

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("csv", "canvas", "moodle")


class ExportError(ValueError):
    """The gradebook or the roster cannot be read, or the format is unknown."""


@dataclass
class Student:
    id: str
    first_name: str = ""
    last_name: str = ""
    email: str = ""
    lms_user_id: str = ""
    scores: dict[str, float | None] = field(default_factory=dict)  # assignment -> score, None: nothing handed in
    on_roster: bool = True
    in_gradebook: bool = True

    @property
    def missing(self) -> list[str]:
        return [a for a, s in self.scores.items() if s is None]


def read_gradebook(db_url: str, course_id: str, roster: list[dict[str, str]] | None = None
                   ) -> tuple[list[tuple[str, float]], list[Student]]:
    """(assignments in order with their maximum scores, one :class:`Student` per student)."""
    from nbgrader.api import Gradebook, MissingEntry

    from stepformer.course.nbgrader_setup import tools_on_path

    tools_on_path()
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
                student.scores[name] = max(0.0, float(submission.score) - float(submission.late_submission_penalty))
            students[s.id] = student
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
    return assignments, sorted(students.values(), key=lambda s: s.id)


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


def write(path: Path, fmt: str, assignments: list[tuple[str, float]], students: list[Student]) -> None:
    """Write the table in ``fmt`` to ``path`` (atomically: a half-written file never replaces a good one)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; the formats are {', '.join(FORMATS)}")
    names = [a for a, _ in assignments]
    maximum = sum(m for _, m in assignments)
    rows: list[list[str]]
    if fmt == "csv":
        rows = [["student", "first_name", "last_name", "email", *names, "total", "max_total", "no_submission",
                 "on_roster"]]
        for s in students:
            total = sum(v for v in s.scores.values() if v is not None)
            rows.append([s.id, s.first_name, s.last_name, s.email, *(_number(s.scores[a]) for a in names),
                         f"{total:g}", f"{maximum:g}", " ".join(s.missing), "yes" if s.on_roster else "no"])
    elif fmt == "canvas":
        rows = [["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *names],
                ["Points Possible", "", "", "", "", *(f"{m:g}" for _, m in assignments)]]
        for s in students:
            shown = f"{s.last_name}, {s.first_name}" if s.last_name or s.first_name else s.id
            rows.append([shown, s.lms_user_id, s.id, s.id, "", *(_number(s.scores[a]) for a in names)])
    else:
        rows = [["First name", "Last name", "ID number", "Email address", *names]]
        for s in students:
            rows.append([s.first_name, s.last_name, s.id, s.email, *(_number(s.scores[a]) for a in names)])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    os.replace(tmp, path)


def gaps(assignments: list[tuple[str, float]], students: list[Student]) -> list[str]:
    """One line per student the table cannot give full information for."""
    lines = []
    for s in students:
        if not s.in_gradebook:
            lines.append(f"{s.id}: on the roster, never graded")
        elif not s.on_roster:
            lines.append(f"{s.id}: graded, not on the roster")
        if s.in_gradebook and s.missing:
            lines.append(f"{s.id}: no submission of {', '.join(s.missing)}")
    return lines
