"""Grade one student, in a process of its own: ``python -m stepformer.course.worker ARGS``.

The grading command (or ``grade-worker``) starts one of these per student it claimed, so a
submission that brings a worker down (or outlasts its time) costs only that student, and W
workers grade W students at once.
The worker autogrades with nbgrader (student code in the sandbox kernel), re-checks every
graded cell in its own process (``trusted``), lowers the points that the re-check or the
own-work rule refuse, and last of all writes ``done/<student>.json``:
a student with that file is finished and is never graded again by a resumed run.
"""

import argparse
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path

import nbformat
import torch

from stepformer.checks._messages import LANGUAGE_ENV, notebook_language, t
from stepformer.course.execute import entries, records_folder
from stepformer.course.nbgrader_setup import api, load_config
from stepformer.course.sandbox import RUNTIME_ENV, make_runtime
from stepformer.course.translation import LANGUAGE as TRANSLATED
from stepformer.course.translation import TranslationMissing, chinese_twin
from stepformer.course.trusted import exercise_of, recheck, reference_use

PREPROCESSORS = [
    "stepformer.course.execute.GradingExecute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]


COURSE_ID = "stepformer"  # the course id when the configuration names none


def course_config(root: Path, workdir: Path):
    """nbgrader's configuration for a grading work folder or an nbgrader course folder.

    The course's grading settings (``autograder/nbgrader_config.py``), then the folder's own
    ``nbgrader_config.py`` where it has one (an nbgrader course: its course id, exchange, late
    penalty, gradebook), with nbgrader's standard folder names.
    """
    config = load_config(root, root=str(workdir), source_directory="source", release_directory="release",
                         submitted_directory="submitted", autograded_directory="autograded",
                         feedback_directory="feedback", db_url=f"sqlite:///{workdir / 'gradebook.db'}")
    if (workdir / "nbgrader_config.py").is_file():
        from traitlets.config.loader import PyFileConfigLoader

        config.merge(PyFileConfigLoader("nbgrader_config.py", path=str(workdir)).load_config())
        config.CourseDirectory.root = str(workdir)
    # A named course: PostgreSQL enforces the gradebook's foreign key to its course row.
    if not config.CourseDirectory.get("course_id"):
        config.CourseDirectory.course_id = COURSE_ID
    if os.environ.get("STEPFORMER_DB_URL"):
        config.CourseDirectory.db_url = os.environ["STEPFORMER_DB_URL"]
    return config


def grade_student(root: Path, workdir: Path, assignment: str, student: str, limits: dict,
                  kernel: str | None) -> dict:
    from traitlets.utils.importstring import import_item

    config = course_config(root, workdir)
    # The checks in the kernel and in the re-check speak the submission's language (stepformer.checks._messages).
    language = submission_language(workdir / "submitted" / student / assignment)
    os.environ[LANGUAGE_ENV] = language
    config.Autograde.autograde_preprocessors = [import_item(name) for name in PREPROCESSORS]
    # A deleted check cell is put back and graded, rather than silently skipped.
    config.OverwriteCells.add_missing_cells = True
    config.GradingExecute.timeout = limits["cell_seconds"]
    config.GradingExecute.notebook_timeout = limits["notebook_seconds"]
    # Every graded cell's records are sealed as the cell ends, so nothing waits on the kernel's own exit: a
    # graceful shutdown (a request, then waiting for the kernel to end) cost a second and a half a student.
    config.GradingExecute.shutdown_kernel = "immediate"
    records_dir = None
    if kernel:
        # A short folder of its own: a socket's path may not exceed 107 bytes, which a deep work
        # folder and a long student id would. It holds the only two folders the sandbox binds
        # writable: sock/ for the ipc sockets, records/ for the checks' records (the connection
        # file, wherever jupyter_client puts it, is bound read-only). The launcher, started with
        # this process's environment, finds it through RUNTIME_ENV; it goes when grading ends.
        runtime = Path(tempfile.mkdtemp(prefix="stepformer-", dir="/tmp" if os.path.isdir("/tmp") else None))
        folders = make_runtime(runtime)
        os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
        os.environ[RUNTIME_ENV] = str(runtime)
        config.GradingExecute.kernel_name = kernel
        # ipc sockets in a folder the sandbox binds: the kernel needs no network at all.
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = str(folders["sock"] / "kernel")
        records_dir = folders["records"]
        config.GradingExecute.records_dir = str(records_dir)
        # The only host folders the kernel writes: their total is watched (the rest are sized tmpfs).
        config.GradingExecute.runtime_dir = str(runtime)
        config.GradingExecute.runtime_bytes = limits["tmp_bytes"]
    # Where each graded cell's records go once it has run: a folder of the grader's that the
    # kernel never sees, so a later cell cannot rewrite what an earlier check recorded.
    sealed = Path(tempfile.mkdtemp(prefix="stepformer-sealed-", dir="/tmp" if os.path.isdir("/tmp") else None))
    config.GradingExecute.sealed_dir = str(sealed)
    try:
        result = _autograde(api(config), workdir, assignment, student, sealed)
        result["language"] = language
        if language == TRANSLATED and result["status"] == "graded":
            result["notes"] += translate_graded(root, workdir / "autograded" / student / assignment)
        return result
    finally:
        shutil.rmtree(sealed, ignore_errors=True)
        if kernel:
            shutil.rmtree(runtime, ignore_errors=True)


def submission_language(folder: Path) -> str:
    """The language of a student's submitted notebooks, from their metadata: ``zh`` if any says so (a Chinese
    notebook is graded in its English twin's place), else ``en``."""
    for path in sorted(folder.glob("*.ipynb")):
        try:
            if notebook_language(json.loads(path.read_text(encoding="utf-8"))) == TRANSLATED:
                return TRANSLATED
        except (OSError, ValueError, AttributeError):
            continue
    return "en"


def translate_graded(root: Path, folder: Path) -> list[str]:
    """Put the Chinese prose back into a Chinese submission's graded notebooks (nbgrader's autograde restored the
    locked cells' English source), so that its feedback is Chinese; notes for what could not be translated."""
    notes = []
    for path in sorted(folder.glob("*.ipynb")):
        try:
            nb = chinese_twin(root, folder.name, path.name, nbformat.read(path, as_version=4))
        except (OSError, TranslationMissing) as error:
            notes.append(f"{path.name}: the feedback stays in English ({error})")
            continue
        nbformat.write(nb, path)
    return notes


def remove_special_files(folder: Path) -> list[str]:
    """Delete every link, FIFO, socket or device under ``folder`` (never following links); return their names.

    nbgrader copies the autograded folder's files into the feedback with ``shutil.copy``, which
    follows links; the grader reads the records. Only plain files and folders may remain.
    """
    removed = []
    for path, info in entries(folder):
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            path.unlink(missing_ok=True)
            removed.append(str(path.relative_to(folder)))
    return removed


def _autograde(grader, workdir: Path, assignment: str, student: str, sealed: Path) -> dict:
    result = {"student": student, "status": "graded", "detail": "", "notes": []}
    graded = grader.autograde(assignment, student, force=True, create=False)
    if not graded["success"]:
        result.update(status="error", detail=_last_error(graded))
        return result

    autograded = workdir / "autograded" / student / assignment
    # The sandboxed kernel cannot write here, but a kernel without the sandbox (or a bug) could.
    for name in remove_special_files(autograded):
        result["notes"].append(f"removed {name} from the graded folder (a link or special file)")
    remove_special_files(sealed)
    with grader.gradebook as gb:
        for path in sorted(p for p in autograded.glob("*.ipynb") if p.is_file() and not p.is_symlink()):
            verdicts = recheck(path, records_folder(autograded, path.stem, sealed))
            findings = reference_use(path)
            # Records are sealed as each graded cell ends, so a cell that tampers can only have
            # changed the checks that run after it: those, and only those, lose their points.
            tampering = min((f for f in findings if f.kind == "tampering"), key=lambda f: f.cell, default=None)
            refused = {f.exercise: f for f in findings if f.kind == "reference"}
            result["notes"] += [f"{path.stem}: a cell outside the exercises uses {f.what}"
                                for f in findings if f.kind == "review"]
            nb = nbformat.read(path, as_version=4)
            for index, cell in enumerate(nb.cells):
                meta = cell.get("metadata", {}).get("nbgrader", {})
                if cell.cell_type != "code" or not meta.get("grade"):
                    continue
                grade_id = meta["grade_id"]
                grade = gb.find_grade(grade_id, path.stem, assignment, student)
                reason = label = None  # what the student reads (in their language), what the instructor's report says
                if tampering and tampering.cell < index:
                    label = "Points withheld"
                    reason = t("Points withheld: cell {cell}, before this check, {what}; after that the grader "
                               "cannot trust what a check records (only checks before it keep their points).",
                               cell=tampering.cell + 1, what=tampering.what)
                elif exercise_of(grade_id) in refused:
                    f = refused[exercise_of(grade_id)]
                    label = "Not your own work"
                    reason = t("Not your own work: your solution uses {what}; write it yourself.", what=f.what)
                elif grade_id in verdicts and not verdicts[grade_id].passed and (grade.auto_score or 0) > 0:
                    label = "The grader's re-run of this check failed"
                    reason = t("The grader's re-run of this check failed: {reason}", reason=verdicts[grade_id].reason)
                # The automatic score is lowered, never the manual one: an instructor's score in
                # formgrader overrides the grader's, and survives a regrade.
                if reason and (grade.auto_score or 0) > 0:
                    grade.auto_score = 0.0
                    cell.outputs.append(nbformat.v4.new_output(
                        "error", ename="GradingCheck", evalue=reason, traceback=[f"GradingCheck: {reason}"]))
                    result["notes"].append(f"{grade_id}: {label}")
            graded_cells = [i for i, c in enumerate(nb.cells)
                            if c.cell_type == "code" and c.get("metadata", {}).get("nbgrader", {}).get("grade")]
            if tampering and not any(i > tampering.cell for i in graded_cells):
                result["notes"].append(f"{path.stem}: cell {tampering.cell + 1} {tampering.what}; it runs after every "
                                       "check, so no points were withheld (worth a look)")
            nbformat.write(nb, path)
        gb.db.commit()
    # No feedback here: it is made once every student is graded and the manual scores are back
    # (stepformer.course.feedback.generate), so a page never shows a score the gradebook no longer holds.
    return result


def _last_error(result: dict) -> str:
    """The line of nbgrader's log that says what went wrong (the whole log goes to the worker's log file)."""
    text = "\n".join(filter(None, [result.get("log"), result.get("error")]))
    print(text, file=sys.stderr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", line)]
    errors = [line for line in lines if "[ERROR]" in line and "Please see" not in line]
    found = (causes or errors or lines or ["unknown error"])[-1]
    return "nbgrader could not grade it: " + found[:300]


def write_done(state: Path, result: dict) -> None:
    """Atomically: a half-written file must never mark a student as finished."""
    done = state / "done"
    done.mkdir(parents=True, exist_ok=True)
    tmp = done / f".{result['student']}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, done / f"{result['student']}.json")


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent ends.

    The parent is the forkserver, which ends with the grading command: a command that is killed
    (a cluster job past its time, kill -9) must not leave a grading process behind, still writing
    the gradebook, once another worker has taken its claim over. Elsewhere this does nothing.
    """
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent ended before the request was made
        os._exit(1)


def run_logged(argv: list[str], env: dict[str, str], log: Path) -> None:
    """``main(argv)`` in a forked worker: the grader's environment, all output to ``log``."""
    _die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    # Appended: a student graded again (after an error) keeps the log of every attempt.
    handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(handle, 1)
    os.dup2(handle, 2)
    os.close(handle)
    print(f"=== grading started {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    sys.exit(main(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--state", type=Path, default=None, help="where done/<student>.json goes (default: workdir)")
    parser.add_argument("--assignment", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--limits", required=True, help="JSON of stepformer.course.sandbox.Limits")
    parser.add_argument("--kernel", default=None, help="kernel name (the sandbox's); default: plain python3")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own, harmless
    # The re-check runs the checks on tiny tensors, as the sandboxed kernel does on one thread: with one
    # grading process per core, a second thread only spins waiting for the first (a re-check took 4 s of
    # CPU instead of 0.3 on a busy 2-core machine). One thread also computes as the kernel did.
    torch.set_num_threads(1)
    started = time.monotonic()
    result = grade_student(args.root, args.workdir, args.assignment, args.student, json.loads(args.limits),
                           args.kernel)
    result["seconds"] = round(time.monotonic() - started, 1)
    write_done(args.state or args.workdir, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
