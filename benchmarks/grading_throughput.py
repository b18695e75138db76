"""Grading throughput: notebooks per minute, plain nbgrader against ``stepformer-course grade``.

    .venv/bin/python benchmarks/grading_throughput.py [--students 12] [--no-sandbox] [--keep]

Builds ``--students`` copies of the sample submissions (cycling through the cases of
``tests.fixtures.submissions.ATTENTION``: students s000, s001, ...) and grades them three ways,
each from scratch in a folder of its own:

(a) plain nbgrader: ``nbgrader generate_assignment`` then one ``nbgrader autograde`` for all
    students in one process (the course's nbgrader_config, no sandbox, no re-check, no feedback);
(b) ``grade()`` with one worker;
(c) ``grade()`` with one worker per core.

(b) and (c) use the sandbox where bubblewrap works here, include ``generate_assignment`` (``fresh=True``),
the grader's re-check and the feedback, so they do more work per notebook than (a); (a) is timed from
``generate_assignment`` on as well. The gradebook is SQLite in each work folder (STEPFORMER_DB_URL is
ignored here). Not a test: it prints a table.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures, when run as a script

import nbformat  # noqa: E402

from stepformer.course.grade import grade  # noqa: E402
from stepformer.course.sandbox import sandbox_problem  # noqa: E402
from tests.fixtures.submissions import ATTENTION, build  # noqa: E402

ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"


def write_class(folder: Path, students: int) -> dict[str, float]:
    """``folder/sNNN/01_attention/attention.ipynb``; returns each student's expected points."""
    notebooks = {case.name: build(case, ASSIGNMENT, NOTEBOOK, ROOT / "exercises") for case in ATTENTION}
    expected = {}
    for n in range(students):
        case = ATTENTION[n % len(ATTENTION)]
        student = f"s{n:03d}"
        target = folder / student / ASSIGNMENT
        target.mkdir(parents=True)
        nbformat.write(notebooks[case.name], target / NOTEBOOK)
        expected[student] = case.points
    return expected


def plain_nbgrader(submissions: Path, course: Path) -> tuple[float, dict[str, float]]:
    """Seconds for generate_assignment + autograde of every student, and the scores nbgrader gave."""
    (course / "source").mkdir(parents=True)
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, course / "source" / ASSIGNMENT)
    shutil.copytree(submissions, course / "submitted")
    # nbgrader reads nbgrader_config.py from the folder it starts in: the course's config, re-rooted.
    config = (ROOT / "autograder" / "nbgrader_config.py").read_text() + (
        "\n# benchmark: a course folder of its own\n"
        f"c.CourseDirectory.root = {str(course)!r}\n"
        "c.CourseDirectory.source_directory = 'source'\n"
        "c.CourseDirectory.release_directory = 'release'\n"
        f"c.CourseDirectory.db_url = {'sqlite:///' + str(course / 'gradebook.db')!r}\n"
    )
    (course / "nbgrader_config.py").write_text(config)
    nbgrader = str(Path(sys.executable).parent / "nbgrader")
    # nbgrader starts alembic and kernels by name: this environment's bin/ first.
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    started = time.perf_counter()
    for command in ([nbgrader, "generate_assignment", ASSIGNMENT, "--force"],
                    [nbgrader, "autograde", ASSIGNMENT, "--force"]):
        done = subprocess.run(command, cwd=course, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(command[1:])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    seconds = time.perf_counter() - started

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {s.student.id: float(s.score) for s in gb.assignment_submissions(ASSIGNMENT)}
    return seconds, scores


def ours(submissions: Path, scratch: Path, workers: int, sandbox: bool) -> tuple[float, dict[str, tuple]]:
    started = time.perf_counter()
    results = grade(ROOT, submissions, ASSIGNMENT, scratch / "out", scratch / "work", workers=workers,
                    sandbox=sandbox, fresh=True, progress=sys.stderr.isatty())
    seconds = time.perf_counter() - started
    bad = [r for r in results if r.status != "graded"]
    if bad:
        sys.exit(f"not graded: {', '.join(f'{r.student} ({r.status}: {r.detail})' for r in bad)}")
    return seconds, {r.student: (r.score, tuple(sorted(r.cells.items()))) for r in results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=12, help="submissions to grade (default 12)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers of (c) (default: cores)")
    parser.add_argument("--no-sandbox", action="store_true", help="(b) and (c) without the sandbox")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders (printed)")
    args = parser.parse_args()
    # A shared gradebook would make the three runs see each other's students.
    os.environ.pop("STEPFORMER_DB_URL", None)
    problem = None if args.no_sandbox else sandbox_problem()
    sandbox = not args.no_sandbox and problem is None
    if problem:
        print(f"note: no sandbox for (b) and (c): {problem}", file=sys.stderr)

    # Other work on the machine slows every row, the parallel one most: say how busy it was.
    load_before = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="grading-throughput-"))
    try:
        submissions = scratch / "submissions"
        expected = write_class(submissions, args.students)
        n = args.students  # one notebook per student
        rows = []
        print(f"(a) plain nbgrader, {n} notebooks ...", file=sys.stderr, flush=True)
        seconds, plain = plain_nbgrader(submissions, scratch / "plain")
        rows.append(("(a) nbgrader autograde, plain", "no", 1, seconds))
        runs = {}
        for label, workers in (("(b) grade()", 1), ("(c) grade()", args.workers)):
            print(f"{label} with {workers} worker(s), {n} notebooks ...", file=sys.stderr, flush=True)
            seconds, runs[label] = ours(submissions, scratch / label[1], workers, sandbox)
            rows.append((label, "yes" if sandbox else "no", workers, seconds))

        print(f"\n{args.students} students, {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
              f"load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after\n")
        header = ("configuration", "sandbox", "workers", "notebooks", "seconds", "notebooks/min")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(" --- " for _ in header) + "|")
        for label, boxed, workers, seconds in rows:
            print(f"| {label} | {boxed} | {workers} | {n} | {seconds:.1f} | {n / seconds * 60:.1f} |")
        print()
        b, c = runs["(b) grade()"], runs["(c) grade()"]
        same = b == c
        print("(b) and (c) give the same scores per student and per check" if same
              else f"(b) and (c) DIFFER: {sorted(s for s in b if b[s] != c.get(s))}")
        wrong = sorted(s for s, points in expected.items() if b[s][0] != points)
        print("grade() gives every student the expected points" if not wrong
              else f"grade() gives unexpected points to {wrong}")
        # The plain baseline has no re-check; on these honest samples it should still agree.
        plain_wrong = sorted(s for s, points in expected.items() if plain.get(s) != points)
        print("plain nbgrader agrees" if not plain_wrong else f"plain nbgrader differs for {plain_wrong}")
        return 0 if same and not wrong else 1
    finally:
        if args.keep:
            print(f"kept {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
