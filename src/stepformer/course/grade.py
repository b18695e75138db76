"""Autograde a folder (or zip) of submissions: sandboxed, parallel, resumable.

``stepformer-course grade SUBMISSIONS --assignment A`` reads the submissions (``intake``),
grades every student in a worker process of its own (``worker``: nbgrader autograde in the
sandbox kernel, the grader's re-check, feedback), W at a time, and writes ``grades.csv``,
each student's feedback and a summary table. A run that is stopped half-way resumes where it
was: a student whose ``done/<student>.json`` exists is not graded again, and nbgrader's
gradebook keeps one grade per student and cell, so nothing is lost or counted twice.
"""

import csv
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from stepformer.course.intake import Intake, SubmissionsError, load_roster, read_submissions
from stepformer.course.paths import assignments
from stepformer.course.sandbox import Limits, install_kernelspec, sandbox_problem
from stepformer.course.worker import COURSE_ID, db_url

__all__ = ["SubmissionsError", "StudentResult", "grade", "grade_command"]


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here and the instructor did not opt out of it."""


@dataclass
class StudentResult:
    student: str
    score: float = 0.0
    max_score: float = 0.0
    status: str = "graded"
    detail: str = ""
    cells: dict[str, float] = field(default_factory=dict)


def _fingerprint(root: Path, assignment: str) -> str:
    """What the grades depend on: the assignment's source and the checks' code."""
    h = hashlib.sha256()
    for folder in (root / "solutions" / assignment, Path(__file__).resolve().parents[1] / "checks"):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _prepare(root: Path, assignment: str, workdir: Path, fresh: bool) -> None:
    """The work folder: nbgrader's course layout and gradebook, kept between runs."""
    stamp = workdir / "fingerprint"
    fingerprint = _fingerprint(root, assignment)
    if fresh or (stamp.exists() and stamp.read_text() != fingerprint):
        shutil.rmtree(workdir, ignore_errors=True)
    if stamp.exists():
        return
    from stepformer.course.nbgrader_setup import api
    from stepformer.course.worker import course_config

    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "source").mkdir(parents=True)
    shutil.copytree(root / "solutions" / assignment, workdir / "source" / assignment)
    generated = api(course_config(root, workdir)).generate_assignment(assignment, force=True)
    if not generated["success"]:
        raise RuntimeError(f"nbgrader could not generate {assignment}:\n{generated['log']}")
    stamp.write_text(fingerprint)


def grade(root: Path, submissions: Path, assignment: str, out: Path, workdir: Path, *,
          workers: int | None = None, sandbox: bool = True, limits: Limits | None = None,
          roster: list[str] | None = None, fresh: bool = False, progress: bool = True,
          only: list[str] | None = None) -> list[StudentResult]:
    """Grade every student in ``submissions`` (or just ``only``); feedback and grades.csv go to ``out``.

    The workers are started with multiprocessing's forkserver, so a script that calls this must
    do so under ``if __name__ == "__main__":`` (the command line and notebooks need nothing).
    """
    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own, harmless
    if assignment not in assignments(root):
        raise SubmissionsError(f"unknown assignment {assignment!r}; known: {', '.join(assignments(root))}")
    limits = limits or Limits()
    kernel = None
    if sandbox:
        if problem := sandbox_problem():
            raise SandboxUnavailable(
                f"the sandbox for student code cannot start: {problem}. Fix that, or grade without it "
                "(--no-sandbox) only for submissions you trust."
            )
    workdir, out = workdir.resolve(), out.resolve()
    _prepare(root, assignment, workdir, fresh)
    if sandbox:
        # Hide the course, the work folder, the outputs and everyone's raw submissions.
        raw = submissions.resolve() if submissions.is_dir() else submissions.resolve().parent
        hidden = [p for p in (root, workdir, out, raw) if p != Path(p.anchor)]
        kernel = install_kernelspec(workdir / "jupyter" / "kernels", limits=limits, hidden=hidden)
    expected = sorted(p.name for p in (workdir / "release" / assignment).glob("*.ipynb"))
    intakes, warnings_ = read_submissions(submissions, assignment, expected, workdir / "intake", roster)
    for line in warnings_:
        print(f"warning: {line}", file=sys.stderr)
    if only:
        unknown = sorted(set(only) - {i.student for i in intakes})
        if unknown:
            raise SubmissionsError(f"not among the submissions: {', '.join(unknown)}")
        intakes = [i for i in intakes if i.student in only]
    if not intakes:
        raise SubmissionsError(f"{submissions}: no student submissions found (expected <student_id>/...)")

    pending = []
    for intake in intakes:
        if not _finished(workdir, intake.student):
            if intake.notebooks:
                _submit(workdir, assignment, intake)
                pending.append(intake)
            else:
                from stepformer.course.worker import write_done

                write_done(workdir, {"student": intake.student, "status": intake.status, "detail": "", "notes": []})
    workers = max(1, workers or os.cpu_count() or 1)
    env = dict(os.environ, JUPYTER_PATH=os.pathsep.join([str(workdir / "jupyter"), os.environ.get("JUPYTER_PATH", "")]))
    with ThreadPoolExecutor(workers) as pool:
        jobs = [pool.submit(_run_worker, root, workdir, assignment, i.student, limits, kernel, env) for i in pending]
        for job in tqdm(as_completed(jobs), total=len(jobs), desc=f"grading {assignment}", unit="student",
                        disable=not progress):
            job.result()
    results = _collect(workdir, assignment, intakes)
    _write_outputs(workdir, assignment, results, out)
    return results


def _finished(workdir: Path, student: str) -> bool:
    """Graded before (a student whose grading failed is tried again)."""
    done = workdir / "done" / f"{student}.json"
    return done.exists() and json.loads(done.read_text()).get("status") != "error"


def _submit(workdir: Path, assignment: str, intake: Intake) -> None:
    """Copy the student's notebooks into nbgrader's submitted/ and register the student."""
    from nbgrader.api import Gradebook

    target = workdir / "submitted" / intake.student / assignment
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name, path in intake.notebooks.items():
        shutil.copy2(path, target / name)
    with Gradebook(db_url(workdir), course_id=COURSE_ID) as gb:
        gb.update_or_create_student(intake.student)


# Each student's worker is a fresh process forked from a server that imported the grader once
# (torch, nbgrader, nbformat: about five seconds a process otherwise), so a crash or a timeout
# still costs only that student while the imports are paid once per run.
_WORKERS = multiprocessing.get_context("forkserver")
_WORKERS.set_forkserver_preload(["stepformer.course.worker"])


def _run_worker(root: Path, workdir: Path, assignment: str, student: str, limits: Limits, kernel: str | None,
                env: dict[str, str]) -> None:
    from stepformer.course.worker import run_logged, write_done

    argv = ["--root", str(root), "--workdir", str(workdir), "--assignment", assignment, "--student", student,
            "--limits", json.dumps(dataclasses.asdict(limits))]
    if kernel:
        argv += ["--kernel", kernel]
    # The worker's own limit: every notebook's budget plus kernel starts and feedback.
    wall = limits.notebook_seconds * 2 + 120
    log = workdir / "logs" / f"{student}.log"
    log.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    process = _WORKERS.Process(target=run_logged, args=(argv, env, log), name=f"grade {student}")
    process.start()
    process.join(wall)
    failure = ""
    if process.is_alive():
        process.kill()
        process.join()
        failure = f"grading took longer than {wall} s and was stopped"
    elif process.exitcode:
        failure = f"the grading process failed (exit {process.exitcode})"
    process.close()
    if failure and not (workdir / "done" / f"{student}.json").exists():
        write_done(workdir, {"student": student, "status": "error", "detail": f"{failure}; see {log}", "notes": [],
                             "seconds": round(time.monotonic() - started, 1)})


def _collect(workdir: Path, assignment: str, intakes: list[Intake]) -> list[StudentResult]:
    from nbgrader.api import Gradebook, MissingEntry

    results = []
    with Gradebook(db_url(workdir), course_id=COURSE_ID) as gb:
        nbgrader_assignment = gb.find_assignment(assignment)
        cells = sorted((nb.name, cell.name) for nb in nbgrader_assignment.notebooks for cell in nb.grade_cells)
        for intake in intakes:
            done = json.loads((workdir / "done" / f"{intake.student}.json").read_text())
            notes = [*intake.problems, *done.get("notes", []), *([done["detail"]] if done.get("detail") else [])]
            result = StudentResult(intake.student, max_score=nbgrader_assignment.max_score, status=done["status"],
                                   detail="; ".join(notes))
            if intake.status == "not-on-roster":
                result.status = "not-on-roster" if done["status"] == "graded" else done["status"]
            for nb_name, cell in cells:
                try:
                    score = gb.find_grade(cell, nb_name, assignment, intake.student).score if done["status"] in (
                        "graded",) else 0.0
                except MissingEntry:
                    score = 0.0
                result.cells[f"{nb_name}:{cell}"] = float(score or 0.0)
            result.score = sum(result.cells.values())
            results.append(result)
    return results


def _write_outputs(workdir: Path, assignment: str, results: list[StudentResult], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for result in results:
        source = workdir / "feedback" / result.student / assignment
        if source.is_dir():
            shutil.copytree(source, out / "feedback" / result.student / assignment, dirs_exist_ok=True)
    columns = sorted({c for r in results for c in r.cells})
    tmp = out / f".grades.csv.{os.getpid()}.tmp"
    with tmp.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["student", "assignment", "score", "max_score", "status", "detail", *columns])
        for r in results:
            writer.writerow([r.student, assignment, f"{r.score:g}", f"{r.max_score:g}", r.status, r.detail,
                             *(f"{r.cells.get(c, 0.0):g}" for c in columns)])
    os.replace(tmp, out / "grades.csv")


def summary_table(results: list[StudentResult]) -> str:
    width = max([7, *(len(r.student) for r in results)])
    lines = [f"{'student':<{width}}  {'score':>11}  {'status':<13}  detail", "-" * (width + 50)]
    for r in results:
        detail = r.detail if len(r.detail) <= 90 else r.detail[:87] + "..."
        lines.append(f"{r.student:<{width}}  {r.score:>5g} / {r.max_score:<3g}  {r.status:<13}  {detail}")
    return "\n".join(lines)


def grade_command(root: Path, submissions: Path, assignment: str | None, out: Path, workdir: Path | None, *,
                  workers: int | None = None, sandbox: bool = True, roster: Path | None = None,
                  fresh: bool = False, only: list[str] | None = None, limits: Limits | None = None) -> int:
    names = assignments(root)
    if assignment is None:
        if len(names) != 1:
            print(f"Say which assignment: --assignment one of {', '.join(names)}", file=sys.stderr)
            return 2
        assignment = names[0]
    workdir = (workdir or root / "autograder" / "work" / assignment).resolve()
    try:
        results = grade(root, submissions.resolve(), assignment, out, workdir, workers=workers, sandbox=sandbox,
                        roster=load_roster(roster) if roster else None, fresh=fresh, only=only,
                        limits=limits)
    except (SubmissionsError, SandboxUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary_table(results))
    print(f"\ngrades: {out.resolve() / 'grades.csv'}\nfeedback: {out.resolve() / 'feedback'}/<student>/{assignment}/")
    return 0
