"""Autograde a folder (or zip) of submissions: sandboxed, parallel, resumable, on one machine or many.

``stepformer-course grade SUBMISSIONS --assignment A`` runs three phases. Intake reads the submissions
once (``intake``), copies them into nbgrader's ``submitted/`` and writes a manifest of the students to
grade. Work: workers pull students from the manifest (``claims``) and grade each in a process of its
own (``worker``: nbgrader autograde in the sandbox kernel, the grader's re-check). Finish puts the
manual scores back and writes each student's feedback from the gradebook (``feedback``),
``grades.csv`` and a summary table. The phases also run apart (``--intake-only``, ``grade-worker``
on any number of machines, ``grade-finish``). A run that is stopped half-way resumes where it was:
a student whose ``done/<student>.json`` records the same notebooks (by sha256) and hand-in time is
not graded again, and nbgrader's gradebook keeps one grade per student and cell, so nothing is lost
or counted twice. A changed, new or newly timed hand-in is graded again, and says so
(:func:`_regrade_reason`).
"""

import contextlib
import csv
import dataclasses
import datetime
import hashlib
import json
import multiprocessing
import os
import pkgutil
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from stepformer.course.claims import (
    CLAIM_MARGIN,
    Budget,
    ManifestMissing,
    RunReplaced,
    claims_folder,
    finished,
    latest_claims,
    live_claims,
    new_run_id,
    pull,
    read_manifest,
    worker_name,
    write_manifest,
)
from stepformer.course.intake import (
    Intake,
    SubmissionsError,
    infer_assignment,
    load_roster,
    read_submissions,
    write_lms_feedback,
)
from stepformer.course.paths import assignments, notebook_names
from stepformer.course.sandbox import Limits, install_kernelspec, sandbox_problem

__all__ = ["SubmissionsError", "StudentResult", "grade", "grade_command", "grade_finish", "grade_intake",
           "grade_work"]


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
    by_hand: float = 0.0  # points of answers still to be graded by hand (counted as 0 in score until then)


def _fingerprint(root: Path, assignment: str) -> str:
    """What the grades depend on: the assignment's source and the checks' code."""
    h = hashlib.sha256()
    for folder in (root / "solutions" / assignment, Path(__file__).resolve().parents[1] / "checks"):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


MARKER = ".stepformer-grader.json"  # the file that makes a folder this grader's own


class WorkFolderRefused(SubmissionsError):
    """The work folder holds files this grader did not create: it is left as it is."""


def _prepare(root: Path, assignment: str, workdir: Path, fresh: bool) -> None:
    """The work folder: nbgrader's course layout, with one gradebook for every assignment, kept between runs.

    Only a folder that is new, empty or this grader's own (it holds ``MARKER``) is used; any other is
    refused untouched. When an assignment's source or the checks change (or ``fresh``), its students are
    graded again, and the instructor's manual scores and comments are set aside first and put back
    after (:func:`_restore_overrides`); nothing but the grader's own files is ever deleted.
    """
    marker = workdir / MARKER
    fingerprint = _fingerprint(root, assignment)
    if workdir.exists() and not workdir.is_dir():
        raise WorkFolderRefused(f"{workdir} is a file, not a folder; give --workdir a new or empty folder")
    if workdir.is_dir() and any(workdir.iterdir()) and not marker.is_file():
        raise WorkFolderRefused(
            f"{workdir} is not empty and is not a work folder of this grader (it has no {MARKER}), so it was "
            "left untouched. Give --workdir a new or empty folder (the default, autograder/work/grading, is "
            "the grader's own), or grade an nbgrader course folder in place with --course.")
    recorded = json.loads(marker.read_text())["fingerprints"] if marker.is_file() else {}
    if recorded.get(assignment) == fingerprint and not fresh:
        _write_work_config(workdir)
        return
    if assignment in recorded:
        _set_overrides_aside(root, workdir, assignment)
        # The grader's own files for this assignment: the copies of source and release, and which
        # students are finished. Submissions, autograded notebooks and feedback are rewritten per student.
        for own in (workdir / "source" / assignment, workdir / "release" / assignment):
            shutil.rmtree(own, ignore_errors=True)
        for done in (_state(workdir, assignment) / "done").glob("*.json"):
            done.unlink()
    from stepformer.course.nbgrader_setup import api
    from stepformer.course.worker import course_config

    (workdir / "source").mkdir(parents=True, exist_ok=True)
    shutil.copytree(root / "solutions" / assignment, workdir / "source" / assignment)
    generated = api(course_config(root, workdir)).generate_assignment(assignment, force=True)
    if not generated["success"]:
        raise RuntimeError(f"nbgrader could not generate {assignment}:\n{generated['log']}")
    tmp = workdir / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"fingerprints": {**recorded, assignment: fingerprint}}, indent=1) + "\n")
    os.replace(tmp, marker)
    _write_work_config(workdir)  # after the marker: a folder holding only this file would be refused


def _write_work_config(workdir: Path) -> None:
    """The work folder's nbgrader_config.py, for formgrader and nbgrader's own commands started there."""
    from stepformer.course.feedback import write_work_config

    if note := write_work_config(workdir):
        print(f"warning: {note}", file=sys.stderr)


def _state(workdir: Path, assignment: str) -> Path:
    """The grader's bookkeeping for one assignment: done/, logs/, intake/, the sandbox's kernel."""
    return workdir / ".stepformer-grader" / assignment


def _gradebook(root: Path, workdir: Path):
    """The gradebook of the work folder (or course folder), as nbgrader's configuration names it."""
    from nbgrader.api import Gradebook

    from stepformer.course.nbgrader_setup import tools_on_path
    from stepformer.course.worker import course_config

    tools_on_path()
    directory = course_config(root, workdir).CourseDirectory
    return Gradebook(directory.db_url, course_id=directory.course_id)


def _set_overrides_aside(root: Path, workdir: Path, assignment: str, students: list[str] | None = None) -> None:
    """Save every manual score, extra credit and manual comment of ``assignment``, then forget its submissions.

    The gradebook cannot take a changed assignment while it holds submissions (nbgrader refuses to add or
    remove cells then), so they go; their manual parts are saved to ``overrides/<time>.json`` (kept for
    good) and to ``overrides/pending-<assignment>.json``, from which each student's are put back once
    graded again. With ``students``, only theirs (a changed hand-in graded again from a clean slate, so
    that an old hand-in time or a cell's old flags do not linger).
    """
    from nbgrader.api import MissingEntry

    saved = []
    with _gradebook(root, workdir) as gb:
        try:
            submissions = gb.find_assignment(assignment).submissions
        except MissingEntry:
            return
        if students is not None:
            submissions = [s for s in submissions if s.student.id in students]
        if not submissions:
            return
        for submission in submissions:
            for notebook in submission.notebooks:
                for grade in notebook.grades:
                    if grade.manual_score is not None or grade.extra_credit:
                        saved.append({"student": submission.student.id, "notebook": notebook.name,
                                      "cell": grade.name, "manual_score": grade.manual_score,
                                      "extra_credit": grade.extra_credit, "auto_score": grade.auto_score})
                for comment in notebook.comments:
                    if comment.manual_comment:
                        saved.append({"student": submission.student.id, "notebook": notebook.name,
                                      "cell": comment.name, "manual_comment": comment.manual_comment})
        for student in [s.student.id for s in submissions]:
            gb.remove_submission(assignment, student)
    folder = workdir / "overrides"
    folder.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    archive, n = folder / f"{assignment}-{stamp}.json", 1
    while archive.exists():  # two set-asides in one second: never overwrite the first
        archive, n = folder / f"{assignment}-{stamp}-{n}.json", n + 1
    archive.write_text(json.dumps(saved, indent=1) + "\n")
    pending = folder / f"pending-{assignment}.json"
    earlier = json.loads(pending.read_text()) if pending.is_file() else []
    pending.write_text(json.dumps(earlier + saved, indent=1) + "\n")


def _restore_overrides(root: Path, workdir: Path, assignment: str, students: list[str]) -> dict[str, list[str]]:
    """Put back the manual scores and comments set aside for ``students`` (graded again): notes per student.

    A manual score whose cell's automatic score changed meanwhile is flagged for review in formgrader;
    one whose cell no longer exists stays in ``overrides/pending-<assignment>.json`` and is named in the notes.
    """
    from nbgrader.api import MissingEntry

    pending_file = workdir / "overrides" / f"pending-{assignment}.json"
    if not pending_file.is_file():
        return {}
    pending = json.loads(pending_file.read_text())
    notes: dict[str, list[str]] = {}
    kept = []
    with _gradebook(root, workdir) as gb:
        for entry in pending:
            student, where = entry["student"], f"{entry['notebook']}:{entry['cell']}"
            if student not in students:
                kept.append(entry)
                continue
            try:
                if "manual_comment" in entry:
                    comment = gb.find_comment(entry["cell"], entry["notebook"], assignment, student)
                    comment.manual_comment = entry["manual_comment"]
                    notes.setdefault(student, []).append(f"{where}: manual comment kept")
                    continue
                grade = gb.find_grade(entry["cell"], entry["notebook"], assignment, student)
            except MissingEntry:
                kept.append(entry)
                notes.setdefault(student, []).append(
                    f"{where}: a manual score or comment was set aside (the cell is gone); see {pending_file}")
                continue
            grade.manual_score, grade.extra_credit = entry.get("manual_score"), entry.get("extra_credit")
            changed = grade.auto_score != entry.get("auto_score")
            grade.needs_manual_grade = changed
            notes.setdefault(student, []).append(
                f"{where}: manual score kept" + (f" (automatic score now {grade.auto_score or 0:g}, was "
                                                 f"{entry.get('auto_score') or 0:g}: review it)" if changed else ""))
        gb.db.commit()
    pending_file.write_text(json.dumps(kept, indent=1) + "\n")
    return notes


def grade(root: Path, submissions: Path, assignment: str, out: Path, workdir: Path, *,
          workers: int | None = None, sandbox: bool = True, limits: Limits | None = None,
          roster: list[str] | None = None, fresh: bool = False, progress: bool = True,
          only: list[str] | None = None, due: datetime.datetime | None = None) -> list[StudentResult]:
    """Grade every student in ``submissions`` (or just ``only``); feedback and grades.csv go to ``out``.

    The three phases in a row, on this machine: :func:`grade_intake`, :func:`grade_work` with ``workers``
    local workers, :func:`grade_finish`. On a cluster the same phases run apart (see the guide).

    ``due``: the assignment's due date (UTC); a student folder's ``timestamp.txt`` (as ``nbgrader
    collect`` writes it) is kept, and nbgrader's late penalty (``LateSubmissionPlugin.penalty_method``)
    applies to a submission after it.

    The workers are started with multiprocessing's forkserver, so a script that calls this must
    do so under ``if __name__ == "__main__":`` (the command line and notebooks need nothing).
    """
    manifest = grade_intake(root, submissions, assignment, out, workdir, sandbox=sandbox, limits=limits,
                            roster=roster, fresh=fresh, only=only, due=due)
    grade_work(Path(manifest["workdir"]), assignment, workers=workers, progress=progress)
    return grade_finish(Path(manifest["workdir"]), assignment, progress=progress)


# --- Phase 1, intake: read the class once, write the manifest of the students to grade. ---

def grade_intake(root: Path, submissions: Path, assignment: str, out: Path, workdir: Path, *, sandbox: bool = True,
                 limits: Limits | None = None, roster: list[str] | None = None, fresh: bool = False,
                 only: list[str] | None = None, due: datetime.datetime | None = None) -> dict:
    """Read every submission once, copy each student's notebooks into ``submitted/``, register them: the manifest.

    The only phase that reads the submissions (unpacking and normalising them costs about as much as
    grading a few notebooks, for every student): workers then read the manifest and ``submitted/``.
    Returns the manifest, also written to ``.stepformer-grader/<assignment>/manifest.json``.
    """
    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own, harmless
    if assignment not in assignments(root):
        raise SubmissionsError(f"unknown assignment {assignment!r}; known: {', '.join(assignments(root))}")
    limits = limits or Limits()
    if sandbox:
        _sandbox_ready()
    workdir, out = workdir.resolve(), out.resolve()
    _refuse_while_claimed(workdir, assignment)
    _prepare(root, assignment, workdir, fresh)
    state = _state(workdir, assignment)
    # Hide the course, the work folder, the outputs and everyone's raw submissions.
    raw = submissions.resolve() if submissions.is_dir() else submissions.resolve().parent
    expected = sorted(p.name for p in (workdir / "release" / assignment).glob("*.ipynb"))
    intakes, warnings_ = read_submissions(submissions, assignment, expected, state / "intake", roster,
                                          others=notebook_names(root))
    for line in warnings_:
        print(f"warning: {line}", file=sys.stderr)
    if only:
        unknown = sorted(set(only) - {i.student for i in intakes})
        if unknown:
            raise SubmissionsError(f"not among the submissions: {', '.join(unknown)}")
        intakes = [i for i in intakes if i.student in only]
    if not intakes:
        raise SubmissionsError(f"{submissions}: no student submissions found (expected <student_id>/...)")

    if due is not None:
        with _gradebook(root, workdir) as gb:
            gb.update_or_create_assignment(assignment, duedate=due)
    from stepformer.course.worker import write_done

    # Which students need grading, and why: everyone else keeps the earlier grading.
    reasons = {}
    for intake in intakes:
        _earlier_spelling(state, intake)
        reason = _regrade_reason(state, intake, fresh)
        if reason is None:
            if not intake.notebooks and _done(state, intake.student).get("status") == "graded":
                intake.problems.append(f"no notebook in this download; the grading of "
                                       f"{_graded_when(state, intake.student)} is kept")
            continue
        reasons[intake.student] = reason
        if reason != FIRST_GRADING:
            intake.problems.insert(0, f"graded again: {reason}")
            print(f"graded again: {intake.student}: {reason}", file=sys.stderr)
    again = [s for s, r in reasons.items() if r != FIRST_GRADING]
    if again:
        # A clean slate for each, its manual scores and comments put back after (as for a change of checks).
        _set_overrides_aside(root, workdir, assignment, again)
    pending = []
    for intake in intakes:
        if intake.student not in reasons:
            continue
        if intake.notebooks:
            _submit(root, workdir, assignment, intake)
            pending.append(intake.student)
        else:
            write_done(state, {"student": intake.student, "status": intake.status, "detail": "", "notes": []})
    return _start_run(root, workdir, assignment, out, "files", sandbox, limits, [root, workdir, out, raw],
                      [{"student": i.student, "status": i.status, "problems": i.problems, "timestamp": i.timestamp,
                        "grade": i.student in pending, "digests": i.digests, "lms": i.lms,
                        "reason": reasons.get(i.student)} for i in intakes])


def _start_run(root: Path, workdir: Path, assignment: str, out: Path, kind: str, sandbox: bool, limits: Limits,
               hidden: list[Path], students: list[dict]) -> dict:
    """Write the manifest of a new run: what every worker needs, wherever it runs, and nothing it must work out.

    A student to grade has no ``done/`` record until this run grades them (an earlier one, an error say,
    would count as this run's result).
    """
    state = _state(workdir, assignment)
    for entry in students:
        if entry["grade"]:
            (state / "done" / f"{entry['student']}.json").unlink(missing_ok=True)
    manifest = {"version": 1, "run": new_run_id(), "kind": kind, "assignment": assignment, "root": str(root),
                "workdir": str(workdir), "out": str(out), "sandbox": sandbox, "limits": dataclasses.asdict(limits),
                "hidden": [str(p) for p in hidden], "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "students": students}
    write_manifest(state, manifest)
    return manifest


def _refuse_while_claimed(workdir: Path, assignment: str) -> None:
    """A new intake would rewrite ``submitted/`` under a worker's feet: refuse while a worker may be grading."""
    state = _state(workdir, assignment)
    try:
        manifest = read_manifest(state)
    except ManifestMissing:
        return
    held = live_claims(state, manifest, _take_over_after(Limits(**manifest["limits"])))
    if held:
        student, claim = held[0]
        raise SubmissionsError(
            f"{len(held)} student(s) of {assignment} are claimed by a grading worker and have no result yet "
            f"(e.g. {student}, {claim.describe()}; claims in {claim.path.parent}): a worker may still be grading. "
            f"Wait for the workers to end; if none runs any more, let one take the claims over: "
            f"stepformer-course grade-worker --workdir {workdir} --assignment {assignment} --take-over-after 0")


def _manifest(state: Path, missing: str) -> dict:
    """The run's manifest; without one, a :class:`SubmissionsError` that ends with what to do (``missing``)."""
    try:
        return read_manifest(state)
    except ManifestMissing as error:
        raise SubmissionsError(f"{error}: {missing}") from None


def _take_over_after(limits: Limits) -> float:
    """When a claim may be taken over: after its grading process has surely been stopped."""
    return _worker_seconds(limits) + CLAIM_MARGIN


def _worker_seconds(limits: Limits) -> int:
    """One grading process's own limit: every notebook's budget plus kernel starts and feedback."""
    return limits.notebook_seconds * 2 + 120


# --- Phase 2, work: any number of workers, here or elsewhere, pull students from the manifest. ---

def grade_work(workdir: Path, assignment: str, *, workers: int | None = None, limit: int | None = None,
               take_over_after: float | None = None, progress: bool = True) -> list[str]:
    """Grade students of the manifest, ``workers`` at a time, until none is left (or ``limit`` are done).

    Each student is claimed first (:mod:`stepformer.course.claims`), so any number of these, on one machine
    or on many sharing the work folder (and a PostgreSQL gradebook), grade each student once. A claim that
    is abandoned (older than ``take_over_after`` seconds, by default the grading process's own limit plus
    ``CLAIM_MARGIN``; or of a process of this machine that is gone) is taken over. Returns the students
    this call graded.
    """
    workdir = workdir.resolve()
    state = _state(workdir, assignment)
    manifest = _manifest(state, "run `stepformer-course grade ... --intake-only` (or grade) first")
    root = Path(manifest["root"])
    if not (root / "solutions" / assignment).is_dir():
        raise SubmissionsError(f"the course recorded by the intake, {root}, has no solutions/{assignment} on this "
                               "machine: workers need the course at the same path as the intake")
    limits = Limits(**manifest["limits"])
    take_over_after = _take_over_after(limits) if take_over_after is None else take_over_after
    students = [entry["student"] for entry in manifest["students"] if entry["grade"]]
    claims = claims_folder(state, manifest["run"])
    workers = max(1, workers or os.cpu_count() or 1)
    left = len(set(students) - finished(state / "done"))
    # The sandbox's kernel is this machine's own (its Python, its home to hide), in a folder of this worker's.
    with tempfile.TemporaryDirectory(prefix="stepformer-kernels-") as jupyter:
        kernel = None
        if manifest["sandbox"]:
            _sandbox_ready()
            kernel = _sandbox_kernel(Path(jupyter), limits, [*map(Path, manifest["hidden"]), root, workdir])
        env = dict(os.environ, JUPYTER_PATH=os.pathsep.join([jupyter, os.environ.get("JUPYTER_PATH", "")]))
        with tqdm(total=min(left, limit) if limit is not None else left, desc=f"grading {assignment}",
                  unit="student", disable=not progress) as bar:

            def grade_one(student: str) -> None:
                _run_worker(root, workdir, assignment, student, limits, kernel, env, state)
                bar.update()

            budget = Budget(limit)
            with ThreadPoolExecutor(workers) as pool:
                jobs = [pool.submit(pull, claims, state / "done", students, grade_one, worker=worker_name(i),
                                    take_over_after=take_over_after, budget=budget) for i in range(workers)]
                return [student for job in jobs for student in job.result()]


# --- Phase 3, finish: manual scores back, then grades.csv and the feedback of everyone in the manifest. ---

def grade_finish(workdir: Path, assignment: str, out: Path | None = None, *,
                 progress: bool = True) -> list[StudentResult]:
    """Merge what the workers did: restore the manual scores, write ``grades.csv`` and copy the feedback.

    A student of the manifest whose grading has not ended (no worker claimed them yet, or a worker holds
    them or died holding them) is listed as ``not-graded``, saying which; run ``grade-worker`` again and
    then this again: nothing is lost.
    """
    workdir = workdir.resolve()
    state = _state(workdir, assignment)
    manifest = _manifest(state, "nothing to finish")
    root, out = Path(manifest["root"]), (out or Path(manifest["out"])).resolve()
    intakes = [Intake(e["student"], problems=e["problems"], status=e["status"], timestamp=e.get("timestamp"),
                      lms=e.get("lms") or {}) for e in manifest["students"]]
    to_grade = [e for e in manifest["students"] if e["grade"]]
    over = finished(state / "done")
    graded = [e["student"] for e in to_grade if e["student"] in over]
    unfinished = {e["student"] for e in to_grade} - over
    from stepformer.course.worker import write_done

    if manifest["kind"] == "course":
        # What was graded: a newer collected submission is graded again.
        for entry in to_grade:
            if entry["student"] in over:
                write_done(state, {**_done(state, entry["student"]), "timestamp": entry["timestamp"]})
        kept: dict[str, list[str]] = {}
    else:
        graded_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        for entry in to_grade:
            done = _done(state, entry["student"])
            if entry["student"] in over and "digests" not in done:
                # What was graded, so that the next intake can tell a changed hand-in from the same one.
                write_done(state, {**done, "digests": entry.get("digests") or {}, "timestamp": entry["timestamp"],
                                   "graded_at": graded_at, "lms": entry.get("lms") or {},
                                   "reason": entry.get("reason")})
        kept = _restore_overrides(root, workdir, assignment, graded)
    # Manual scores and comments are back: from here on the feedback shows what grades.csv shows.
    results = _collect(root, workdir, state, assignment, [i for i in intakes if i.student not in unfinished], kept)
    _feedback(root, workdir, assignment, results, out, progress)
    if unfinished:
        results = _with_unfinished(root, workdir, state, manifest, results, unfinished)
    if manifest["kind"] == "course":
        from stepformer.course.feedback import course_config_note

        if note := course_config_note(workdir):
            print(note, file=sys.stderr)
    _write_outputs(workdir, assignment, results, out)
    for path in write_lms_feedback(out, assignment, [(i.student, i.lms) for i in intakes if i.lms]):
        print(f"feedback for the LMS's bulk upload: {path}", file=sys.stderr)
    return results


FIRST_GRADING = "not graded before"


def _regrade_reason(state: Path, intake: Intake, fresh: bool) -> str | None:
    """Why ``intake``'s student is to be graded now (a sentence for the detail), or None to keep the earlier grading.

    Compared with ``done/<student>.json``: the sha256 of each normalised notebook and the hand-in time
    (``timestamp.txt``). A record from before these were kept is compared with what its grading left in
    ``submitted/``. A student with nothing to grade now keeps what was graded before.
    """
    if fresh:
        return "--fresh"
    done = _done(state, intake.student)
    if not done:
        return FIRST_GRADING
    when = _graded_when(state, intake.student)
    status = done.get("status")
    if status == "error":
        return f"its grading on {when} failed"
    if not intake.notebooks:
        return None
    if status != "graded":
        return f"new submission (was {status} on {when})"
    submitted = state.parents[1] / "submitted" / intake.student / state.name
    earlier = done.get("digests")
    if earlier is None:
        earlier = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(submitted.glob("*.ipynb"))}
        if not earlier:
            return f"no record of what was graded on {when}"
    if earlier != intake.digests:
        changes = [f"{name} changed" for name in sorted(earlier.keys() & intake.digests.keys())
                   if earlier[name] != intake.digests[name]]
        changes += [f"{name} new" for name in sorted(intake.digests.keys() - earlier.keys())]
        changes += [f"{name} no longer handed in" for name in sorted(earlier.keys() - intake.digests.keys())]
        return f"submission changed since it was graded on {when} ({', '.join(changes)})"
    stamp = done["timestamp"] if "timestamp" in done else _read_timestamp(submitted)
    if stamp != intake.timestamp:
        return (f"new hand-in time {intake.timestamp or '(none)'} (was {stamp or '(none)'} when graded on {when}), "
                "same notebooks")
    return None


def _graded_when(state: Path, student: str) -> str:
    """When the student's recorded grading ended (the record's own time for a record that does not say)."""
    if recorded := _done(state, student).get("graded_at"):
        return recorded
    mtime = (state / "done" / f"{student}.json").stat().st_mtime
    return datetime.datetime.fromtimestamp(mtime, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _earlier_spelling(state: Path, intake: Intake) -> None:
    """Ids compare without case: a student graded before as ``Kim`` stays ``Kim`` when handed in as ``kim``."""
    if (state / "done" / f"{intake.student}.json").exists():
        return
    earlier = [p.stem for p in (state / "done").glob("*.json") if p.stem.casefold() == intake.student.casefold()]
    if len(earlier) == 1:
        intake.problems.append(f"id {intake.student!r} taken as {earlier[0]!r}, its id when graded before")
        intake.student = earlier[0]


def _with_unfinished(root: Path, workdir: Path, state: Path, manifest: dict, results: list[StudentResult],
                     unfinished: set[str]) -> list[StudentResult]:
    """``results`` with a ``not-graded`` row for each student in ``unfinished``, in the manifest's order."""
    with _gradebook(root, workdir) as gb:
        max_score = gb.find_assignment(manifest["assignment"]).max_score
    held = latest_claims(claims_folder(state, manifest["run"]), skip=finished(state / "done"))
    by_student = {r.student: r for r in results}
    for student in unfinished:
        log = state / "logs" / f"{student}.log"
        where = f"{held[student].describe()}, no result yet" if student in held else "no worker has claimed it yet"
        by_student[student] = StudentResult(student, max_score=max_score, status="not-graded", detail=(
            f"not graded: {where}" + (f" (see {log})" if log.is_file() else "")
            + "; run grade-worker again, then grade-finish"))
    return [by_student[e["student"]] for e in manifest["students"] if e["student"] in by_student]


def grade_course(root: Path, course: Path, assignment: str, out: Path, *, workers: int | None = None,
                 sandbox: bool = True, limits: Limits | None = None, fresh: bool = False, progress: bool = True,
                 only: list[str] | None = None) -> list[StudentResult]:
    """Autograde, in the sandbox, what ``nbgrader collect`` put in an nbgrader course folder.

    ``course`` is nbgrader's own folder (``nbgrader_config.py`` with its course id and exchange,
    ``source/``, ``release/``, ``submitted/<student>/<assignment>/`` with ``timestamp.txt``, the
    gradebook): this reads ``submitted/``, writes ``autograded/``, ``feedback/`` and the gradebook as
    ``nbgrader autograde`` and ``generate_feedback`` do (so formgrader, ``release_feedback`` and the late
    penalty work as usual), and keeps its own bookkeeping in ``.stepformer-grader/``; nothing else there
    is written or deleted. A student is graded again when a newer submission has been collected.
    The same three phases as :func:`grade`, with :func:`course_intake` first.
    """
    manifest = course_intake(root, course, assignment, out, sandbox=sandbox, limits=limits, fresh=fresh, only=only)
    grade_work(Path(manifest["workdir"]), assignment, workers=workers, progress=progress)
    return grade_finish(Path(manifest["workdir"]), assignment, progress=progress)


def course_intake(root: Path, course: Path, assignment: str, out: Path, *, sandbox: bool = True,
                  limits: Limits | None = None, fresh: bool = False, only: list[str] | None = None) -> dict:
    """Phase 1 in an nbgrader course folder: the collected students to grade, as a manifest."""
    from nbgrader.api import MissingEntry

    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own, harmless
    if sandbox:
        _sandbox_ready()
    course, out = course.resolve(), out.resolve()
    if not (course / "submitted").is_dir():
        raise SubmissionsError(f"{course} has no submitted/ folder: collect first (nbgrader collect {assignment})")
    with _gradebook(root, course) as gb:
        try:
            gb.find_assignment(assignment)
        except MissingEntry:
            raise SubmissionsError(f"{assignment} is not in the gradebook of {course}: run "
                                   f"`nbgrader generate_assignment {assignment}` there first") from None
    students = sorted(p.parent.name for p in (course / "submitted").glob(f"*/{assignment}") if p.is_dir())
    if only:
        unknown = sorted(set(only) - set(students))
        if unknown:
            raise SubmissionsError(f"not among the collected submissions: {', '.join(unknown)}")
        students = [s for s in students if s in only]
    if not students:
        raise SubmissionsError(f"{course / 'submitted'}: nobody has a collected {assignment}")
    limits = limits or Limits()
    _refuse_while_claimed(course, assignment)
    state = _state(course, assignment)
    stamps = {s: _read_timestamp(course / "submitted" / s / assignment) for s in students}
    pending = []
    for student in students:
        if not fresh and _finished(state, student) and _done(state, student).get("timestamp") == stamps[student]:
            continue
        with _gradebook(root, course) as gb:
            gb.update_or_create_student(student)
        pending.append(student)
    return _start_run(root, course, assignment, out, "course", sandbox, limits, [root, course, out],
                      [{"student": s, "status": "ok", "problems": [], "timestamp": stamps[s], "grade": s in pending}
                       for s in students])


def _feedback(root: Path, folder: Path, assignment: str, results: list[StudentResult], out: Path,
              progress: bool) -> None:
    """Every graded student's feedback, from the gradebook as it is now (manual scores back), into ``out`` too.

    Made here rather than by each worker, so that a page always shows what grades.csv shows; a student whose
    page could not be made says so in ``detail``.
    """
    from stepformer.course.feedback import generate

    graded = [r.student for r in results if r.status in ("graded", "not-on-roster")]
    if not graded:
        return
    made = generate(root, folder, assignment, graded, out, progress=progress)
    for result in results:
        if problem := made.failed.get(result.student):
            result.detail = "; ".join(filter(None, [result.detail, problem]))


def _read_timestamp(folder: Path) -> str | None:
    """``timestamp.txt`` as ``nbgrader collect`` leaves it (None when there is none)."""
    path = folder / "timestamp.txt"
    return path.read_text(errors="replace").strip()[:64] if path.is_file() else None


def _sandbox_ready() -> None:
    if problem := sandbox_problem():
        raise SandboxUnavailable(
            f"the sandbox for student code cannot start: {problem}. Fix that, or grade without it "
            "(--no-sandbox) only for submissions you trust."
        )


def _sandbox_kernel(jupyter: Path, limits: Limits, hidden: list[Path]) -> str:
    """The sandboxed kernel's name, its spec in ``jupyter/kernels``; ``hidden`` are the folders it must not see."""
    return install_kernelspec(jupyter / "kernels", limits=limits,
                              hidden=sorted({p.resolve() for p in hidden if p != Path(p.anchor)}))


def _done(state: Path, student: str) -> dict:
    """The student's record of a finished grading (empty if there is none)."""
    path = state / "done" / f"{student}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _finished(state: Path, student: str) -> bool:
    """Graded before (a student whose grading failed is tried again)."""
    done = _done(state, student)
    return bool(done) and done.get("status") != "error"


def _submit(root: Path, workdir: Path, assignment: str, intake: Intake) -> None:
    """Copy the student's notebooks into nbgrader's submitted/ and register the student."""
    target = workdir / "submitted" / intake.student / assignment
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name, path in intake.notebooks.items():
        shutil.copy2(path, target / name)
    if intake.timestamp:
        (target / "timestamp.txt").write_text(intake.timestamp)
    with _gradebook(root, workdir) as gb:
        gb.update_or_create_student(intake.student)


# Each student's worker is a fresh process forked from a server that imported the grader once
# (torch, nbgrader, nbformat: about five seconds a process otherwise), so a crash or a timeout
# still costs only that student while the imports are paid once per run. The server imports every
# check module too, which the re-check needs (``trusted.check_namespace``): the masks checks alone
# bring in torch._dynamo, a second and a half of CPU in every student's process otherwise.
_CHECKS = Path(__file__).resolve().parents[1] / "checks"
_CHECK_MODULES = [f"stepformer.checks.{m.name}" for m in pkgutil.iter_modules([str(_CHECKS)])
                  if not m.name.startswith("_")]
_WORKERS = multiprocessing.get_context("forkserver")
_WORKERS.set_forkserver_preload(["stepformer.course.worker", *_CHECK_MODULES])


def _run_worker(root: Path, workdir: Path, assignment: str, student: str, limits: Limits, kernel: str | None,
                env: dict[str, str], state: Path | None = None) -> None:
    from stepformer.course.worker import run_logged, write_done

    state = state or workdir
    argv = ["--root", str(root), "--workdir", str(workdir), "--assignment", assignment, "--student", student,
            "--limits", json.dumps(dataclasses.asdict(limits)), "--state", str(state)]
    if kernel:
        argv += ["--kernel", kernel]
    wall = _worker_seconds(limits)
    log = state / "logs" / f"{student}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
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
    if failure and not (state / "done" / f"{student}.json").exists():
        write_done(state, {"student": student, "status": "error", "detail": f"{failure}; see {log}", "notes": [],
                             "seconds": round(time.monotonic() - started, 1)})


def _collect(root: Path, workdir: Path, state: Path, assignment: str, intakes: list[Intake],
             kept: dict[str, list[str]]) -> list[StudentResult]:
    from nbgrader.api import MissingEntry

    from stepformer.course.export import late_penalty, late_plugin
    from stepformer.course.worker import course_config

    plugin = late_plugin(course_config(root, workdir))
    results = []
    with _gradebook(root, workdir) as gb:
        nbgrader_assignment = gb.find_assignment(assignment)
        cells = sorted((nb.name, cell.name) for nb in nbgrader_assignment.notebooks for cell in nb.grade_cells)
        for intake in intakes:
            done = json.loads((state / "done" / f"{intake.student}.json").read_text())
            notes = [*intake.problems, *done.get("notes", []), *([done["detail"]] if done.get("detail") else []),
                     *kept.get(intake.student, [])]
            result = StudentResult(intake.student, max_score=nbgrader_assignment.max_score, status=done["status"],
                                   detail="; ".join(notes))
            if intake.status == "not-on-roster":
                result.status = "not-on-roster" if done["status"] == "graded" else done["status"]
            by_hand = []
            for nb_name, cell in cells:
                score = 0.0
                if done["status"] == "graded":
                    try:
                        grade = gb.find_grade(cell, nb_name, assignment, intake.student)
                    except MissingEntry:
                        grade = None
                    if grade is not None:
                        score = grade.score
                        if grade.needs_manual_grade and grade.manual_score is None:
                            by_hand.append(cell)
                            result.by_hand += float(grade.max_score)
                result.cells[f"{nb_name}:{cell}"] = float(score or 0.0)
            result.score = sum(result.cells.values())
            if done["status"] == "graded":
                with contextlib.suppress(MissingEntry):
                    submission = gb.find_submission(assignment, intake.student)
                    # From today's score, not the penalty nbgrader stored at autograde (before manual points).
                    notebook_scores = [float(nb.score or 0.0) for nb in submission.notebooks]
                    penalty = late_penalty(plugin, intake.student, notebook_scores,
                                           float(submission.total_seconds_late))
                    if submission.total_seconds_late > 0:
                        result.detail = "; ".join(filter(None, [
                            result.detail, f"late by {_duration(submission.total_seconds_late)}: penalty {penalty:g}"]))
                    result.score = max(0.0, result.score - penalty)
            if by_hand:
                result.detail = "; ".join(filter(None, [
                    result.detail, f"{len(by_hand)} answer(s) to grade by hand in formgrader ({', '.join(by_hand)}): "
                                   "not counted yet"]))
            results.append(result)
    return results


def _write_outputs(workdir: Path, assignment: str, results: list[StudentResult], out: Path) -> None:
    # The feedback is copied to out by _feedback, as it is made.
    out.mkdir(parents=True, exist_ok=True)
    columns = sorted({c for r in results for c in r.cells})
    tmp = out / f".grades.csv.{os.getpid()}.tmp"
    with tmp.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["student", "assignment", "score", "max_score", "status", "detail", *columns])
        for r in results:
            writer.writerow([r.student, assignment, f"{r.score:g}", f"{r.max_score:g}", r.status, r.detail,
                             *(f"{r.cells.get(c, 0.0):g}" for c in columns)])
    os.replace(tmp, out / "grades.csv")


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60} min" if hours else f"{rest // 60} min {rest % 60} s"


def summary_table(results: list[StudentResult]) -> str:
    width = max([7, *(len(r.student) for r in results)])
    lines = [f"{'student':<{width}}  {'score':>11}  {'status':<13}  detail", "-" * (width + 50)]
    for r in results:
        detail = r.detail if len(r.detail) <= 90 else r.detail[:87] + "..."
        lines.append(f"{r.student:<{width}}  {r.score:>5g} / {r.max_score:<3g}  {r.status:<13}  {detail}")
    return "\n".join(lines)


def grade_command(root: Path, submissions: Path | None, assignment: str | None, out: Path, workdir: Path | None, *,
                  workers: int | None = None, sandbox: bool = True, roster: Path | None = None,
                  fresh: bool = False, only: list[str] | None = None, limits: Limits | None = None,
                  course: Path | None = None, due: str | None = None, intake_only: bool = False) -> int:
    try:
        if (submissions is None) == (course is None):
            raise SubmissionsError("give either the submissions (a folder or a .zip) or --course DIR (an nbgrader "
                                   "course folder whose submitted/ holds what nbgrader collect gathered)")
        if course is not None:
            if assignment is None:
                raise SubmissionsError("with --course, say which assignment: --assignment NAME")
            if due or roster or workdir:
                raise SubmissionsError("with --course, the due date, the roster and the folders are the course's "
                                       "own (nbgrader db assignment add --duedate, nbgrader db student add)")
            if intake_only:
                return _print_intake(course_intake(root, course, assignment, out, sandbox=sandbox, fresh=fresh,
                                                   only=only, limits=limits), "--course")
            results = grade_course(root, course, assignment, out, workers=workers, sandbox=sandbox, fresh=fresh,
                                   only=only, limits=limits)
        else:
            if assignment is None:
                with tempfile.TemporaryDirectory(prefix="stepformer-infer-") as scratch:
                    assignment = infer_assignment(submissions, notebook_names(root), Path(scratch))
                print(f"assignment: {assignment} (every submitted notebook is one of its notebooks)", file=sys.stderr)
            workdir = (workdir or root / "autograder" / "work" / "grading").resolve()
            options = dict(sandbox=sandbox, roster=load_roster(roster) if roster else None, fresh=fresh, only=only,
                           limits=limits, due=parse_due(due) if due else None)
            if intake_only:
                return _print_intake(grade_intake(root, submissions.resolve(), assignment, out, workdir, **options),
                                     "--workdir")
            results = grade(root, submissions.resolve(), assignment, out, workdir, workers=workers, **options)
    except (SubmissionsError, SandboxUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    _print_results(results, out, assignment)
    return 0


def _print_intake(manifest: dict, folder_option: str) -> int:
    """What the intake wrote, and the two commands that follow it."""
    to_grade = sum(e["grade"] for e in manifest["students"])
    folder, assignment = manifest["workdir"], manifest["assignment"]
    print(f"{len(manifest['students'])} students, {to_grade} to grade: "
          f"{Path(folder) / '.stepformer-grader' / assignment / 'manifest.json'}\n"
          f"next, as many at once as you like, on any machine that shares {folder}:\n"
          f"  stepformer-course grade-worker {folder_option} {folder} --assignment {assignment}\n"
          f"then, once: stepformer-course grade-finish {folder_option} {folder} --assignment {assignment}")
    return 0


def _print_results(results: list[StudentResult], out: Path, assignment: str) -> None:
    print(summary_table(results))
    print(f"\ngrades: {out.resolve() / 'grades.csv'}\nfeedback: {out.resolve() / 'feedback'}/<student>/{assignment}/")


def grade_worker_command(workdir: Path, assignment: str, *, workers: int | None = 1, limit: int | None = None,
                         take_over_after: float | None = None, progress: bool = True) -> int:
    """``stepformer-course grade-worker``: pull and grade students of the manifest until none is left."""
    try:
        graded = grade_work(workdir, assignment, workers=workers, limit=limit, take_over_after=take_over_after,
                            progress=progress)
    except (SubmissionsError, SandboxUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunReplaced as error:
        print(f"stopped: {error}; start the workers again for the new run", file=sys.stderr)
        return 3
    state = _state(workdir.resolve(), assignment)
    manifest = read_manifest(state)
    to_grade = {e["student"] for e in manifest["students"] if e["grade"]}
    left = to_grade - finished(state / "done")
    print(f"this worker graded {len(graded)} student(s); {len(to_grade) - len(left)} of {len(to_grade)} finished, "
          f"{len(left)} still claimed by workers or waiting" + ("" if left else "; next: grade-finish"))
    return 0


def grade_finish_command(workdir: Path, assignment: str, out: Path | None = None) -> int:
    """``stepformer-course grade-finish``: grades.csv and the feedback; exit 1 while some student is not graded."""
    try:
        results = grade_finish(workdir, assignment, out)
    except SubmissionsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = out or Path(read_manifest(_state(workdir.resolve(), assignment))["out"])
    _print_results(results, out, assignment)
    missing = [r.student for r in results if r.status == "not-graded"]
    if missing:
        print(f"\n{len(missing)} student(s) not graded yet (status not-graded): run grade-worker again, then "
              "grade-finish", file=sys.stderr)
        return 1
    return 0


def parse_due(text: str) -> datetime.datetime:
    """A due date as nbgrader reads one (``2026-12-01 17:00``, with an optional zone; UTC when none)."""
    from nbgrader.utils import parse_utc

    try:
        return parse_utc(text)
    except Exception:
        raise SubmissionsError(f"--due {text!r} is not a date and time (e.g. '2026-12-01 17:00 Europe/Paris' or "
                               "'2026-12-01T16:00:00Z')") from None
