"""How long each solution notebook takes, top to bottom, and its slowest cell.

    .venv/bin/python benchmarks/notebooks.py                      # every chapter: about 2 minutes on 2 idle cores
    .venv/bin/python benchmarks/notebooks.py --chapters 10_gqa    # one

A student runs the whole notebook many times, and nbgrader gives each cell 60 s when it grades: this
measures both, on the solutions (``solutions/*/*.ipynb``), each run by ``nbclient`` in a fresh kernel.
A notebook that fails stops the script with the cell's error. Whether each notebook earns its points is
tested (``tests/test_chapter_mistakes.py`` and ``tests/test_corpus.py`` grade the solutions); this only
times them. Writes ``--out`` (``benchmarks/results/notebooks.json``) and prints a Markdown table.
Not a test.
"""

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import nbclient
import nbformat
import torch
from tqdm import tqdm

from stepformer.course.sandbox import Limits
from stepformer.runs import commit as run_commit
from stepformer.runs import save_json

ROOT = Path(__file__).resolve().parents[1]
CELL_LIMIT = Limits.cell_seconds  # the grader's per-cell time-out


def _time(path: Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    cells: list[tuple[float, int]] = []

    starts: dict[int, float] = {}

    def cell_started(cell, cell_index: int) -> None:
        starts[cell_index] = time.perf_counter()

    def cell_done(cell, cell_index: int, execute_reply) -> None:
        cells.append((time.perf_counter() - starts[cell_index], cell_index))

    started = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=10 * CELL_LIMIT, kernel_name="python3", on_cell_execute=cell_started,
                            on_cell_executed=cell_done, resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds, index = max(cells)
    cell = nb.cells[index]
    name = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or f"cell {index}"
    return {"chapter": path.parent.name, "seconds": round(time.perf_counter() - started, 1),
            "slowest_cell": name, "slowest_cell_seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapters", nargs="*", help="chapter folders, e.g. 10_gqa (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "notebooks.json")
    args = parser.parse_args()
    paths = sorted((ROOT / "solutions").glob("*/*.ipynb"))
    if args.chapters:
        unknown = set(args.chapters) - {p.parent.name for p in paths}
        if unknown:
            parser.error(f"no solution notebook for {sorted(unknown)}; the chapters are "
                         f"{', '.join(p.parent.name for p in paths)}")
        paths = [p for p in paths if p.parent.name in args.chapters]
    load = os.getloadavg()[0]
    rows = [_time(path) for path in tqdm(paths, desc="solution notebooks", unit="notebook")]
    commit = run_commit(ROOT)
    record = {"date": datetime.date.today().isoformat(), "commit": commit, "cpus": os.cpu_count(),
              "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "load_before": round(load, 2), "cell_limit": CELL_LIMIT, "rows": rows}
    save_json(record, args.out)
    print(f"{record['date']}, commit {commit}, {record['cpus']} cores, torch {record['torch']}, "
          f"load average {load:.1f} before the run\n")
    print("| chapter | seconds | slowest cell | its seconds |\n| --- | --- | --- | --- |")
    for row in rows:
        flag = " (over nbgrader's limit)" if row["slowest_cell_seconds"] > CELL_LIMIT else ""
        print(f"| {row['chapter']} | {row['seconds']} | {row['slowest_cell']} | {row['slowest_cell_seconds']}{flag} |")


if __name__ == "__main__":
    main()
