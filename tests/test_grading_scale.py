"""Grading that scales out: the class is read once into a manifest, workers pull students from it by claims.

The claim tests need no notebooks. One slow fixture grades two sample students twice: with one
worker (``grade``), and with two ``grade-worker`` processes pulling from one manifest after the
submissions folder has been moved away; the gradebooks must agree cell by cell.
"""

import csv
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepformer.course import claims as claims_module
from stepformer.course.claims import (
    RunReplaced,
    claim_next,
    claims_folder,
    new_run_id,
    pull,
    try_claim,
    write_manifest,
)
from stepformer.course.sandbox import sandbox_problem

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
SANDBOX = sandbox_problem() is None


def _run(tmp_path: Path, students: list[str]) -> tuple[Path, Path, Path]:
    """A state folder with a manifest of ``students`` and its claims folder: (state, claims, done)."""
    state = tmp_path / "state"
    manifest = {"run": new_run_id(), "limits": {}, "students": [{"student": s, "grade": True} for s in students]}
    write_manifest(state, manifest)
    (state / "done").mkdir()
    return state, claims_folder(state, manifest["run"]), state / "done"


def _plant(claims: Path, student: str, *, generation: int = 1, age: float = 0.0, machine: str = "elsewhere/pid:[1]",
           pid: int = 1) -> Path:
    """A claim file as another worker would have left it, ``age`` seconds old."""
    path = claims / f"{student}.{generation}"
    path.write_text(json.dumps({"worker": f"node7 pid {pid} #0", "machine": machine, "pid": pid,
                                "claimed": "2026-11-24 10:00:00 +0000"}))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def _grade_by_marking(args: tuple[Path, Path, list[str], str]) -> list[str]:
    """A worker process whose 'grading' writes the done record, as the real worker does last."""
    claims, done, students, worker = args

    def grade_one(student: str) -> None:
        time.sleep(0.01)
        (done / f"{student}.json").write_text(json.dumps({"student": student, "status": "graded", "by": worker}))

    return pull(claims, done, students, grade_one, worker=worker, take_over_after=3600)


def test_workers_pulling_from_one_manifest_grade_each_student_exactly_once(tmp_path):
    students = [f"s{i:02d}" for i in range(24)]
    _, claims, done = _run(tmp_path, students)
    with multiprocessing.get_context("fork").Pool(3) as pool:
        graded = pool.map(_grade_by_marking, [(claims, done, students, f"w{i}") for i in range(3)])
    everyone = [s for worker in graded for s in worker]
    assert sorted(everyone) == students  # nobody twice, nobody left out
    assert sorted(p.name for p in claims.iterdir()) == sorted(f"{s}.1" for s in students)
    for worker, theirs in enumerate(graded):
        assert all(json.loads((done / f"{s}.json").read_text())["by"] == f"w{worker}" for s in theirs)


def test_an_abandoned_claim_is_taken_over_and_a_live_one_is_left_alone(tmp_path):
    """A worker that died holding a claim does not lose its student; one that may still be grading keeps it."""
    _, claims, done = _run(tmp_path, ["alice", "bob", "carol", "dave"])
    _plant(claims, "alice", age=2000)  # another machine's, older than the grading process's own limit
    _plant(claims, "bob", age=10)  # another machine's, young: its worker may still be grading
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _plant(claims, "carol", machine=claims_module.machine(), pid=int(gone.stdout))  # this machine's, process gone
    (done / "dave.json").write_text("{}")  # graded already
    graded = pull(claims, done, ["alice", "bob", "carol", "dave"], lambda s: None, worker="me",
                  take_over_after=1000)
    assert graded == ["alice", "carol"]
    assert json.loads((claims / "alice.2").read_text())["worker"] == "me"
    assert not (claims / "bob.2").exists()


def test_of_two_workers_taking_over_one_claim_exactly_one_wins(tmp_path):
    _, claims, _ = _run(tmp_path, ["alice"])
    _plant(claims, "alice", age=5000)
    assert [try_claim(claims, "alice", 2, worker) for worker in ("a", "b")] == [True, False]


def test_a_worker_stops_when_a_newer_intake_replaced_its_run(tmp_path):
    state, claims, done = _run(tmp_path, ["alice"])
    write_manifest(state, {"run": new_run_id(), "limits": {}, "students": []})
    with pytest.raises(RunReplaced, match="a newer intake replaced this run"):
        claim_next(claims, done, ["alice"], "me", 1000)
    with pytest.raises(RunReplaced, match="a newer intake replaced this run"):
        try_claim(claims, "alice", 1, "me")


def test_a_new_intake_is_refused_while_a_worker_may_still_be_grading(tmp_path):
    """Rewriting submitted/ under a grading worker would mix two submissions: the intake says so and stops."""
    from stepformer.course.grade import SubmissionsError, _refuse_while_claimed, _state

    work = tmp_path / "work"
    state = _state(work, ASSIGNMENT)
    manifest = {"run": new_run_id(), "limits": {"notebook_seconds": 600},
                "students": [{"student": "alice", "grade": True}]}
    write_manifest(state, manifest)
    claim = _plant(claims_folder(state, manifest["run"]), "alice", age=60)
    with pytest.raises(SubmissionsError, match=r"1 student\(s\) of 01_attention are claimed .* alice, claimed by "
                                               r"node7 pid 1 #0 .* --take-over-after 0"):
        _refuse_while_claimed(work, ASSIGNMENT)
    # Older than the grading process's own limit (2 x 600 + 120 s) plus the margin: nobody grades it.
    os.utime(claim, (time.time() - 1700, time.time() - 1700))
    _refuse_while_claimed(work, ASSIGNMENT)


# --- A real grading: one worker against two worker processes pulling from one manifest. ---

def _cells(work: Path, students: list[str]) -> dict[str, dict[str, float | None]]:
    """Every automatic score of the gradebook: student -> {notebook:cell: score}."""
    from nbgrader.api import Gradebook

    from stepformer.course.worker import COURSE_ID, course_config

    with Gradebook(course_config(ROOT, work).CourseDirectory.db_url, course_id=COURSE_ID) as gb:
        return {s: {f"{nb.name}:{g.name}": g.auto_score
                    for nb in gb.find_submission(ASSIGNMENT, s).notebooks for g in nb.grades} for s in students}


@pytest.fixture(scope="module")
def two_ways(tmp_path_factory):
    """The same two students graded by one worker, and by two worker processes pulling from one manifest.

    The one-worker run grades while the two processes do (three gradings on two cores): the same work,
    in less time.
    """
    import shutil

    from stepformer.course import grade as grading
    from tests.fixtures.submissions import ATTENTION, write_submissions

    base = tmp_path_factory.mktemp("scale")
    submissions = write_submissions(ATTENTION[:3], ASSIGNMENT, NOTEBOOK, ROOT / "exercises", base / "class")
    shutil.copytree(submissions, base / "class-copy")
    pair = [case.name for case in ATTENTION[:2]]
    reads = []
    real = grading.read_submissions
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grading, "read_submissions", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
        manifest = grading.grade_intake(ROOT, submissions, ASSIGNMENT, base / "out2", base / "many", sandbox=SANDBOX)
        # The third student's worker is somewhere else and still busy: nobody else may grade them.
        state = grading._state(base / "many", ASSIGNMENT)
        _plant(claims_folder(state, manifest["run"]), ATTENTION[2].name, age=5)
        # From here on nothing may read this class's submissions: the workers have the manifest.
        submissions.rename(base / "moved-away")
        env = dict(os.environ, STEPFORMER_COURSE_ROOT=str(ROOT))
        workers = [subprocess.Popen([sys.executable, "-m", "stepformer.course.cli", "grade-worker", "--workdir",
                                     str(base / "many"), "--assignment", ASSIGNMENT, "--limit", "1", "--no-progress"],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for _ in range(2)]
        one = grading.grade(ROOT, base / "class-copy", ASSIGNMENT, base / "out1", base / "one", workers=1, only=pair,
                            sandbox=SANDBOX, progress=False)
        logs = [worker.communicate(timeout=300)[0] for worker in workers]
        finish_code = grading.grade_finish_command(base / "many", ASSIGNMENT)
    return {"one": {r.student: r for r in one}, "reads": reads, "pair": pair,
            "workers": [(w.returncode, log) for w, log in zip(workers, logs, strict=True)], "base": base,
            "finish_code": finish_code, "manifest": manifest, "state": state}


@pytest.mark.slow
def test_two_worker_processes_give_the_gradebook_of_one_worker(two_ways):
    for code, log in two_ways["workers"]:
        assert code == 0 and "this worker graded 1 student(s)" in log, log
    pair, base = two_ways["pair"], two_ways["base"]
    many = _cells(base / "many", pair)
    assert many == _cells(base / "one", pair)
    assert {s: sum(v or 0 for v in cells.values()) for s, cells in many.items()} == {
        s: two_ways["one"][s].score for s in pair}
    # Each process claimed its own student: one claim file each, and nobody claimed twice.
    claims = claims_folder(two_ways["state"], two_ways["manifest"]["run"])
    assert sorted(p.name for p in claims.iterdir() if p.name.split(".")[0] in pair) == [f"{s}.1" for s in pair]


@pytest.mark.slow
def test_the_class_is_read_once_and_never_by_the_workers(two_ways):
    # The intake: one read; the one-worker grade(): one read of its copy; the workers and the finish
    # ran with the submissions moved away (a read would have failed) and read nothing.
    base = two_ways["base"]
    assert two_ways["reads"] == [base / "class", base / "class-copy"]
    rows = {row["student"]: row for row in csv.DictReader((two_ways["base"] / "out2" / "grades.csv").open())}
    assert {s: rows[s]["status"] for s in two_ways["pair"]} == {s: "graded" for s in two_ways["pair"]}
    assert rows["correct"]["score"] == "9"


@pytest.mark.slow
def test_finish_names_a_student_still_claimed_and_fails_until_graded(two_ways):
    rows = {row["student"]: row for row in csv.DictReader((two_ways["base"] / "out2" / "grades.csv").open())}
    assert two_ways["finish_code"] == 1
    assert rows["crash_at_import"]["status"] == "not-graded"
    assert rows["crash_at_import"]["detail"].startswith("not graded: claimed by node7 pid 1 #0 at 2026-11-24")
    assert "run grade-worker again, then grade-finish" in rows["crash_at_import"]["detail"]
    assert rows["crash_at_import"]["max_score"] == "11"
