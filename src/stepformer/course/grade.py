"""Autograde a folder (or zip) of submissions with nbgrader; write feedback and grades.csv.

Layout of SUBMISSIONS (the layout of nbgrader's ``submitted/``)::

    SUBMISSIONS/<student_id>/<assignment>/<notebook>.ipynb
    SUBMISSIONS/<student_id>/<notebook>.ipynb          (the assignment folder may be left out)

A .zip holding that layout (optionally inside one top-level folder) works the same.
Each student is graded on their own: one that crashes costs only its own points.
"""

import csv
import shutil
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from stepformer.course.nbgrader_setup import api, load_config
from stepformer.course.paths import assignments


class SubmissionsError(ValueError):
    """The submissions cannot be read at all (a single student's problem never raises this)."""


@dataclass
class StudentResult:
    student: str
    score: float = 0.0
    max_score: float = 0.0
    status: str = "graded"
    detail: str = ""
    cells: dict[str, float] = field(default_factory=dict)


def unpack(submissions: Path, into: Path) -> Path:
    """The folder holding one sub-folder per student (a zip is extracted into ``into``)."""
    if not submissions.exists():
        raise SubmissionsError(f"{submissions} does not exist")
    if submissions.is_file():
        if not zipfile.is_zipfile(submissions):
            raise SubmissionsError(f"{submissions} is neither a folder nor a .zip file")
        with zipfile.ZipFile(submissions) as archive:
            for member in archive.namelist():
                parts = PurePosixPath(member).parts
                if PurePosixPath(member).is_absolute() or ".." in parts:
                    raise SubmissionsError(f"{submissions}: unsafe path in the zip: {member!r}")
            archive.extractall(into)
        folder = into
    else:
        folder = submissions
    entries = [p for p in folder.iterdir() if not p.name.startswith((".", "__MACOSX"))]
    # A zip of the folder itself holds one top-level folder whose children are the students.
    if len(entries) == 1 and entries[0].is_dir() and all(c.is_dir() for c in entries[0].iterdir()) \
            and any(d.is_dir() for c in entries[0].iterdir() for d in c.iterdir()):
        folder = entries[0]
    return folder


def student_notebooks(student_dir: Path, assignment: str) -> list[Path]:
    inner = student_dir / assignment
    return sorted((inner if inner.is_dir() else student_dir).glob("*.ipynb"))


def grade(root: Path, submissions: Path, assignment: str, out: Path, workdir: Path,
          progress: bool = True) -> list[StudentResult]:
    """Grade every student in ``submissions``; feedback and grades.csv go to ``out``."""
    # nbgrader's own session handling warns on every submission; the warning is harmless noise.
    warnings.filterwarnings("ignore", message=".*not in session.*")
    if assignment not in assignments(root):
        raise SubmissionsError(f"unknown assignment {assignment!r}; known: {', '.join(assignments(root))}")
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "source").mkdir(parents=True)
    shutil.copytree(root / "solutions" / assignment, workdir / "source" / assignment)
    config = load_config(
        root, root=str(workdir), source_directory="source", release_directory="release",
        submitted_directory="submitted", autograded_directory="autograded",
        feedback_directory="feedback", db_url=f"sqlite:///{workdir / 'gradebook.db'}",
    )
    grader = api(config)
    generated = grader.generate_assignment(assignment, force=True)
    if not generated["success"]:
        raise RuntimeError(f"nbgrader could not generate {assignment}:\n{generated['log']}")
    expected = sorted(p.name for p in (workdir / "release" / assignment).glob("*.ipynb"))

    results = []
    with tempfile.TemporaryDirectory(prefix="stepformer-unzip-") as scratch:
        folder = unpack(submissions, Path(scratch))
        students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not students:
            raise SubmissionsError(f"{submissions}: no student folders found (expected <student_id>/...)")
        for student_dir in tqdm(students, desc=f"grading {assignment}", unit="student", disable=not progress):
            results.append(_grade_one(grader, workdir, assignment, student_dir, expected, out))
    _write_csv(workdir, assignment, results, out / "grades.csv")
    return results


def _grade_one(grader, workdir: Path, assignment: str, student_dir: Path, expected: list[str],
               out: Path) -> StudentResult:
    student = student_dir.name
    result = StudentResult(student)
    notebooks = {p.name: p for p in student_notebooks(student_dir, assignment)}
    missing = [name for name in expected if name not in notebooks]
    target = workdir / "submitted" / student / assignment
    target.mkdir(parents=True, exist_ok=True)
    for name, path in notebooks.items():
        shutil.copy2(path, target / name)
    if missing and len(missing) == len(expected):
        result.status, result.detail = "missing", f"no {', '.join(expected)} found"
        return result
    if missing:
        result.detail = f"missing {', '.join(missing)}"
    with grader.gradebook as gb:
        gb.update_or_create_student(student)
    graded = grader.autograde(assignment, student, force=True, create=True)
    if not graded["success"]:
        result.status = "error"
        result.detail = _last_error(graded)
        return result
    feedback = grader.generate_feedback(assignment, student, force=True)
    if feedback["success"]:
        source = workdir / "feedback" / student / assignment
        shutil.copytree(source, out / "feedback" / student / assignment, dirs_exist_ok=True)
    else:
        result.detail = "feedback could not be generated: " + _last_error(feedback)
    return result


def _last_error(result: dict) -> str:
    lines = [line for line in (result.get("log") or result.get("error") or "").splitlines() if line.strip()]
    errors = [line for line in lines if "[ERROR]" in line] or lines
    return errors[-1].strip()[:200] if errors else "unknown error"


def _write_csv(workdir: Path, assignment: str, results: list[StudentResult], path: Path) -> None:
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(f"sqlite:///{workdir / 'gradebook.db'}") as gb:
        cells = sorted(
            {(nb.name, cell.name) for nb in gb.find_assignment(assignment).notebooks for cell in nb.grade_cells}
        )
        maximum = gb.find_assignment(assignment).max_score
        for result in results:
            result.max_score = maximum
            if result.status in ("missing", "error"):
                result.cells = {f"{nb}:{cell}": 0.0 for nb, cell in cells}
                continue
            try:
                submission = gb.find_submission(assignment, result.student)
            except MissingEntry:
                result.status, result.detail = "error", result.detail or "nbgrader recorded no submission"
                continue
            result.score = submission.score
            for nb_name, cell in cells:
                try:
                    result.cells[f"{nb_name}:{cell}"] = gb.find_grade(cell, nb_name, assignment, result.student).score
                except MissingEntry:
                    result.cells[f"{nb_name}:{cell}"] = 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = [f"{nb}:{cell}" for nb, cell in cells]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["student", "assignment", "score", "max_score", "status", "detail", *columns])
        for r in results:
            writer.writerow([r.student, assignment, f"{r.score:g}", f"{r.max_score:g}", r.status, r.detail,
                             *(f"{r.cells.get(c, 0.0):g}" for c in columns)])


def summary_table(results: list[StudentResult]) -> str:
    width = max([7, *(len(r.student) for r in results)])
    lines = [f"{'student':<{width}}  {'score':>11}  status   detail", "-" * (width + 40)]
    for r in results:
        lines.append(f"{r.student:<{width}}  {r.score:>5g} / {r.max_score:<3g}  {r.status:<7}  {r.detail}")
    return "\n".join(lines)


def grade_command(root: Path, submissions: Path, assignment: str | None, out: Path, workdir: Path | None) -> int:
    names = assignments(root)
    if assignment is None:
        if len(names) != 1:
            print(f"Say which assignment: --assignment one of {', '.join(names)}", file=sys.stderr)
            return 2
        assignment = names[0]
    workdir = (workdir or root / "autograder" / "work" / assignment).resolve()
    out = out.resolve()
    try:
        results = grade(root, submissions.resolve(), assignment, out, workdir)
    except SubmissionsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary_table(results))
    print(f"\ngrades: {out / 'grades.csv'}\nfeedback: {out / 'feedback'}/<student>/{assignment}/")
    return 0
