"""Grading against a PostgreSQL gradebook (``STEPFORMER_DB_URL``), as on JupyterHub or a cluster.

Starts a throwaway PostgreSQL server (Debian's ``postgresql`` package) on a unix socket, grades three
sample students with two workers, and reads the gradebook back from PostgreSQL. Skipped, saying what to
install, where the server binaries or the ``psycopg2`` driver are missing.
"""

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from stepformer.course.grade import grade
from stepformer.course.sandbox import sandbox_problem
from tests.fixtures.prerequisites import missing
from tests.fixtures.submissions import ATTENTION, write_submissions

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
pytestmark = pytest.mark.slow
SANDBOX = sandbox_problem() is None
INSTALL = "apt-get install postgresql, and pip install psycopg2-binary"
DATABASE, USER = "stepformer", "grader"


def _server_bin() -> Path | None:
    """The newest PostgreSQL's bin/ folder (Debian installs them side by side)."""
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not found:
        return None
    return max((Path(p).parent for p in found), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


@pytest.fixture
def postgres_url():
    """``postgresql+psycopg2://`` URL of an empty database on a server that lives for this test."""
    bin_dir = _server_bin()
    if bin_dir is None:
        missing(f"no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/initdb): {INSTALL}")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        missing(f"no psycopg2 driver for SQLAlchemy: {INSTALL}")
    # initdb and postgres refuse to run as root: run them as nobody, in a folder of nobody's. Not
    # under tmp_path, whose parents are private to root.
    as_user: list[str] = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            missing("running as root without runuser (util-linux) to start PostgreSQL as another user")
        as_user = [runuser, "-u", "nobody", "--"]
    home = Path(tempfile.mkdtemp(prefix="stepformer-pg-"))
    data, sockets = home / "data", home / "sock"
    sockets.mkdir()
    if as_user:
        for path in (home, sockets):
            shutil.chown(path, "nobody", "nogroup")

    def run(*command: str) -> None:
        subprocess.run([*as_user, *command], check=True, capture_output=True, text=True, cwd=home)

    started = False
    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8")
        # Unix socket only (no TCP port to collide with); fsync off: the data is thrown away.
        options = f"-k {sockets} -c listen_addresses='' -c fsync=off -c max_connections=50"
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(home / "server.log"), "-o", options, "-w", "start")
        started = True
        run(str(bin_dir / "createdb"), "-h", str(sockets), "-U", USER, DATABASE)
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; this driver is psycopg2.
        yield f"postgresql+psycopg2://{USER}@/{DATABASE}?host={sockets}"
    except subprocess.CalledProcessError as error:
        log = (home / "server.log").read_text() if (home / "server.log").exists() else ""
        pytest.fail(f"PostgreSQL did not start: {error.cmd}\n{error.stdout}{error.stderr}{log}")
    finally:
        if started:
            subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                           capture_output=True, cwd=home)
        shutil.rmtree(home, ignore_errors=True)


def test_grading_with_a_postgresql_gradebook(postgres_url, tmp_path, monkeypatch):
    import sqlalchemy

    monkeypatch.setenv("STEPFORMER_DB_URL", postgres_url)
    submissions = write_submissions(ATTENTION, ASSIGNMENT, NOTEBOOK, ROOT / "exercises", tmp_path / "submissions")
    work = tmp_path / "work"
    results = grade(ROOT, submissions, ASSIGNMENT, tmp_path / "out", work, workers=2, sandbox=SANDBOX,
                    progress=False)

    assert {r.student: (r.status, r.score) for r in results} == {
        case.name: ("graded", case.points) for case in ATTENTION}, [r.detail for r in results if r.detail]
    # The gradebook is the server's, not a SQLite file in the work folder.
    assert not (work / "gradebook.db").exists()
    engine = sqlalchemy.create_engine(postgres_url)
    try:
        with engine.connect() as db:
            rows = db.execute(sqlalchemy.text(
                "SELECT s.student_id, count(*) FROM submitted_assignment s JOIN assignment a "
                "ON a.id = s.assignment_id WHERE a.name = :name GROUP BY s.student_id"), {"name": ASSIGNMENT}).all()
            points = db.execute(sqlalchemy.text(
                "SELECT sa.student_id, sum(coalesce(g.manual_score, g.auto_score, 0)) FROM grade g "
                "JOIN submitted_notebook sn ON sn.id = g.notebook_id "
                "JOIN submitted_assignment sa ON sa.id = sn.assignment_id GROUP BY sa.student_id")).all()
    finally:
        engine.dispose()
    assert dict(rows) == {case.name: 1 for case in ATTENTION}
    assert {student: float(total) for student, total in points} == {case.name: case.points for case in ATTENTION}
