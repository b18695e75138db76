"""`make test` runs with ``-n 2 --dist loadgroup``: tests of one xdist group must share a worker.

Each group shares an expensive module fixture (a book build, a graded corpus); a group split
over two workers builds it twice and the suite runs past CI's budget without failing anything.
Some pytest and pytest-xdist versions ignore the groups silently, so this runs a small suite.
"""

import subprocess
import sys
from collections import defaultdict

SUITE = '''
import os
import pytest

@pytest.mark.xdist_group("first")
@pytest.mark.parametrize("i", range(8))
def test_first(i):
    with open("ran.txt", "a") as ran:
        ran.write(f"first {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.xdist_group("second")
@pytest.mark.parametrize("i", range(8))
def test_second(i):
    with open("ran.txt", "a") as ran:
        ran.write(f"second {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_each_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_groups.py").write_text(SUITE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q",
         "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    workers = defaultdict(set)
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        group, worker = line.split()
        workers[group].add(worker)
    assert set(workers) == {"first", "second"}
    assert all(len(w) == 1 for w in workers.values()), f"a group ran on several workers: {dict(workers)}"
