"""Adversarial and broken submissions, graded in the sandbox: each gets exactly its points.

Also: a run killed half-way resumes without regrading or losing anyone, a re-run gives the
same grades, and parallel workers give the same gradebook as one worker.
"""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepformer.course.grade import grade
from stepformer.course.sandbox import Limits
from stepformer.course.worker import COURSE_ID
from tests.fixtures.corpus import CORPUS
from tests.fixtures.submissions import (
    ATTENTION,
    assert_chinese_twin,
    feedback_page,
    first_heading,
    write_chinese_twins,
    write_submissions,
)

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
# Generous per-cell time: two graders share two cores in CI; the looping cases pay it once each.
# Small file space, so that the case that fills the grader's folders passes it in a second or two.
LIMITS = Limits(cell_seconds=20, notebook_seconds=200, tmp_bytes=64 * 2**20)
# Chinese twins, graded in the same run: every case handed in as a notebook, answered in the Chinese notebook
# (<assignment>/zh/<notebook>) with the English case's code. The cases whose file is not the release notebook (not a
# notebook, malformed, empty, an old format, renamed) or who are not on the roster have no Chinese twin.
TWINS = [case for case in CORPUS if case.file is None and case.filename is None and case.status != "not-on-roster"]
ROSTER = [case.name for case in CORPUS if case.status != "not-on-roster"] + ["absent_student"]
ROSTER += [f"zh_{case.name}" for case in TWINS]
# Lines found only in the course's own files: no feedback may contain them.
SECRETS = ["### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS", "SQLite format 3"]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("sandbox_required")]


def _host_sockets(tag: str) -> list[tuple[Path, socket.socket]]:
    """Listening Unix sockets where host daemons keep theirs (/var/tmp, and /run where writable)."""
    listeners = []
    for folder in (Path("/var/tmp"), Path("/run")):
        if folder.is_dir() and os.access(folder, os.W_OK):
            path = folder / f"stepformer-{tag}-{os.getpid()}.sock"
            path.unlink(missing_ok=True)
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(path))
            listener.listen(8)
            listener.settimeout(0.2)
            listeners.append((path, listener))
    return listeners


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpus")
    work = base / "work"
    listeners = _host_sockets("corpus")
    places = {"root": str(ROOT), "workdir": str(work), "sockets": repr([str(p) for p, _ in listeners])}
    write_submissions(CORPUS, ASSIGNMENT, NOTEBOOK, ROOT / "exercises", base / "submissions", places)
    write_chinese_twins(TWINS, ASSIGNMENT, NOTEBOOK, ROOT / "exercises", base / "submissions", places)
    os.environ["STEPFORMER_GRADER_SECRET"] = "must-not-reach-the-kernel"
    try:
        results = grade(ROOT, base / "submissions", ASSIGNMENT, base / "out", work, workers=2, limits=LIMITS,
                        roster=ROSTER, progress=False)
        yield {r.student: r for r in results}, base, listeners
    finally:
        os.environ.pop("STEPFORMER_GRADER_SECRET", None)
        for path, listener in listeners:
            listener.close()
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_corpus_case_gets_exactly_its_points(corpus, case):
    results, base, _ = corpus
    result = results[case.name]
    assert (result.score, result.status) == (case.points, case.status), result.detail
    page = base / "out" / "feedback" / case.name / ASSIGNMENT / NOTEBOOK.replace(".ipynb", ".html")
    shown = (page.read_text() if page.exists() else "") + result.detail
    assert case.feedback in shown
    # The feedback is the graded notebook's page and nothing else: no file the kernel planted
    # or linked (a solution, the gradebook), no solution code, no hidden test.
    for folder in (base / "out" / "feedback" / case.name, base / "work" / "feedback" / case.name):
        for path in folder.rglob("*"):
            assert not path.is_symlink() and (path.is_dir() or path.is_file()), path
            assert path.is_dir() or path.suffix == ".html", f"{path} in the feedback"
            if path.is_file():
                text = path.read_bytes().decode(errors="replace")
                assert not [s for s in SECRETS if s in text], f"{path} shows {[s for s in SECRETS if s in text]}"


@pytest.mark.parametrize("case", TWINS, ids=lambda c: c.name)
def test_a_chinese_twin_gets_the_english_points_and_chinese_feedback(corpus, case):
    """The same code answered in the Chinese notebook: the same points, cell by cell; feedback that shows the same
    checks passing and failing, in Chinese (the prose, the checks' messages, the grader's own), where the English
    twin's is English."""
    results, base, _ = corpus
    english, chinese = results[case.name], results[f"zh_{case.name}"]
    english_page = feedback_page(base / "out", case.name, ASSIGNMENT, NOTEBOOK)
    chinese_page = feedback_page(base / "out", f"zh_{case.name}", ASSIGNMENT, NOTEBOOK)
    assert_chinese_twin(english, chinese, english_page, chinese_page, ASSIGNMENT, NOTEBOOK)
    assert "zh/attention.ipynb" in chinese.detail, chinese.detail
    title, zh_title = first_heading(ASSIGNMENT, NOTEBOOK)
    assert title in english_page and zh_title not in english_page
    if case.name == "untouched":
        assert "尚未实现" in chinese_page and "not implemented yet" not in chinese_page
    if "Points withheld" in english_page:
        assert "不计分" in chinese_page and "Points withheld" not in chinese_page
    if case.name == "missing_scale":
        assert "You did not divide the scores by sqrt(d_k)." not in chinese_page


def test_no_kernel_reached_a_host_socket(corpus):
    _, _, listeners = corpus
    assert listeners, "no socket folder was writable"
    for path, listener in listeners:
        with pytest.raises(TimeoutError):
            listener.accept()
            pytest.fail(f"a kernel connected to {path}")


def test_corpus_run_is_complete_and_repeatable(corpus):
    results, base, _ = corpus
    assert results["absent_student"].status == "missing" and results["absent_student"].score == 0
    assert len(CORPUS) >= 25
    assert set(results) == {c.name for c in CORPUS} | {"absent_student"} | {f"zh_{c.name}" for c in TWINS}
    assert not (ROOT / "solutions" / ASSIGNMENT / "planted.txt").exists(), "a submission wrote into the course"
    assert not Path("/usr/lib/planted.txt").exists()
    first = (base / "out" / "grades.csv").read_text()
    done = base / "work" / ".stepformer-grader" / ASSIGNMENT / "done"  # the grader's record of who is finished
    finished = {p.name: p.stat().st_mtime_ns for p in done.glob("*.json")}
    assert {f"{student}.json" for student in ROSTER} <= set(finished)
    grade(ROOT, base / "submissions", ASSIGNMENT, base / "out", base / "work", workers=2, limits=LIMITS,
          roster=ROSTER, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in done.glob("*.json")} == finished, \
        "a re-run must not grade finished students again"
    assert (base / "out" / "grades.csv").read_text() == first


def _gradebook(work: Path) -> dict[tuple[str, str], float]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{work / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        grades = {}
        for submission in gb.assignment_submissions(ASSIGNMENT):
            for notebook in submission.notebooks:
                for g in notebook.grades:
                    key = (submission.student.id, g.name)
                    assert key not in grades, f"duplicate grade {key}"
                    grades[key] = g.score
        assert len({s.student.id for s in gb.assignment_submissions(ASSIGNMENT)}) == len(
            gb.assignment_submissions(ASSIGNMENT)), "one submission per student"
        return grades


def test_killed_run_resumes_and_parallel_matches_sequential(tmp_path):
    cases = [*ATTENTION, *(c for c in CORPUS if c.name in ("softmax_over_queries", "untouched", "os_exit"))]
    subs = write_submissions(cases, ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "submissions")
    work = tmp_path / "sequential"
    done_folder = work / ".stepformer-grader" / ASSIGNMENT / "done"  # the grader's record of who is finished
    command = [sys.executable, "-m", "stepformer.course.cli", "grade", str(subs), "--assignment", ASSIGNMENT,
               "--out", str(tmp_path / "out1"), "--workdir", str(work), "--workers", "1"]
    run = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(list(done_folder.glob("*.json"))) < 2 and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)  # the grader, its worker and the kernel, mid-way
    run.wait()
    finished = {p.name: p.stat().st_mtime_ns for p in done_folder.glob("*.json")}
    assert 2 <= len(finished) < len(cases), "the kill should land half-way"
    failed = [p.read_text() for p in done_folder.glob("*.json") if json.loads(p.read_text())["status"] != "graded"]
    assert not failed, f"grading failed before the kill: {failed}"

    resumed = grade(ROOT, subs, ASSIGNMENT, tmp_path / "out1", work, workers=1, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in done_folder.glob("*.json") if p.name in finished} == finished
    assert {r.student: r.score for r in resumed} == {c.name: c.points for c in cases}, \
        {r.student: r.detail for r in resumed if r.detail}

    parallel = grade(ROOT, subs, ASSIGNMENT, tmp_path / "out2", tmp_path / "parallel", workers=2, progress=False)
    assert {r.student: r.score for r in parallel} == {r.student: r.score for r in resumed}
    assert _gradebook(work) == _gradebook(tmp_path / "parallel")
    rows = lambda out: list(csv.reader((out / "grades.csv").open()))  # noqa: E731
    assert rows(tmp_path / "out1") == rows(tmp_path / "out2")
    assert all(json.loads(p.read_text())["status"] == "graded" for p in done_folder.glob("*.json"))
