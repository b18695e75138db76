"""Mutation testing of the checks: do they take points from realistic slips, and do their messages name them?

    .venv/bin/python benchmarks/mutants.py                                   # every chapter: hours on 2 cores
    .venv/bin/python benchmarks/mutants.py --chapters 02_masks --limit 3     # three mutants per cell: minutes
    .venv/bin/python benchmarks/mutants.py --grade 2 --grade-only            # two per chapter through the grader
    .venv/bin/python benchmarks/mutants.py --table-only                      # the table again, from the results

Every solution cell of every chapter gets mutants, each one small slip made on the cell's syntax tree
(``tests/fixtures/mutants.py`` lists the operators: swapped axes, off-by-one, flipped comparisons and signs,
dropped terms and arguments, wrong reductions, changed constants, ...), at most ``--cap`` per cell. Each mutant
is graded by the fast runner (``tests/fixtures/mutant_runs.py``: the notebook's cells run in a process that
forks one child per mutant at the mutated cell, and score as nbgrader scores them); a mutant that loses no
points is then tested for equivalence against the solution (the checks' own inputs, more seeds, the library's
property tests). The first failing message of each caught mutant is classified
(``tests/fixtures/mutant_messages.py``): it names the mutated construct, is generic, or names something else.

Results go to ``--out`` (``benchmarks/results/mutants.json``) after each chapter, so a stopped run keeps what
it finished (``--chapters`` runs again only those and keeps the rest); the Markdown table to ``--table``
(``benchmarks/mutants.md``). ``--grade N`` grades N mutants per chapter (and the unmutated solution) from the
results file with the project's grading command, ``stepformer.course.grade.grade()`` (the sandbox where it
works), on notebooks written as ``tests/fixtures/submissions.py`` writes them, and records whether the points
per graded cell, and the first failing message, agree with the fast runner's. Not a test: it writes a table.
"""

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures, when run as a script
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "mutants.json"
DEFAULT_TABLE = ROOT / "benchmarks" / "mutants.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chapters", nargs="+", metavar="NN_name", help="only these chapters (default: all)")
    parser.add_argument("--cap", type=int, default=40, help="at most this many mutants per solution cell (40)")
    parser.add_argument("--limit", type=int, default=None, help="fewer mutants per cell, for a quick look")
    parser.add_argument("--seed", type=int, default=27, help="the seed of the per-cell sampling (27)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants graded at once (1)")
    parser.add_argument("--cell-timeout", type=float, default=None, help="seconds per cell (nbgrader's: 60)")
    parser.add_argument("--mutant-timeout", type=float, default=900, help="seconds per mutant, all in (900)")
    parser.add_argument("--no-property-tests", action="store_true",
                        help="skip the library's property tests in the equivalence test")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results file ({DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--table", type=Path, default=DEFAULT_TABLE,
                        help=f"Markdown table ({DEFAULT_TABLE.relative_to(ROOT)})")
    parser.add_argument("--grade", type=int, default=0, metavar="N",
                        help="also grade N mutants per chapter with the real grading command")
    parser.add_argument("--grade-only", action="store_true", help="only the --grade sample, from the results file")
    parser.add_argument("--grade-workers", type=int, default=2, help="grading workers for --grade (2)")
    parser.add_argument("--table-only", action="store_true", help="only write the table from the results file")
    parser.add_argument("--keys", nargs="+", metavar="KEY", help="run only these mutants (keys of the results file, "
                        "chapter/cell/operator/line/hash), replacing their rows")
    parser.add_argument("--redo-timeouts", action="store_true",
                        help="run again only the mutants of the results file that timed out or died (a busy or "
                             "paused machine), replacing their rows")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="RESULTS",
                        help="take the chapters run in these results files (each chapter's rows, controls and "
                             "provenance, its commit included) into --out, then write the table")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs' files here (default: a temporary "
                                                                   "folder in /dev/shm or /tmp, removed)")
    args = parser.parse_args(argv)
    if args.cap < 1 or (args.limit is not None and args.limit < 1) or args.jobs < 1 or args.grade < 0:
        parser.error("--cap, --limit and --jobs must be at least 1, --grade at least 0")
    if args.grade_only and not args.grade:
        parser.error("--grade-only needs --grade N (the mutants per chapter to grade)")
    return args


def load(path: Path) -> dict:
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            sys.exit(f"error: {path} is not a results file ({error}); move it away or give another --out")
    return {"about": {}, "chapters": {}, "mutants": [], "controls": [], "agreement": {}}


def save(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def provenance(args: argparse.Namespace) -> dict:
    import torch

    from stepformer.runs import commit, hardware

    return {"command": "python benchmarks/mutants.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "commit": commit(ROOT), "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "hardware": hardware(torch.device("cpu")), "python": platform.python_version(),
            "torch": torch.__version__, "seed": args.seed, "cap": args.cap, "limit": args.limit,
            "load_average_before": os.getloadavg()[0]}


# --- the fast runner over chapters ------------------------------------------------------------

def run_chapters(args: argparse.Namespace, data: dict) -> None:
    from tqdm import tqdm

    from tests.fixtures.mutant_runs import Options
    from tests.fixtures.mutants import chapters, mutants

    known = [c for c, _ in chapters(ROOT)]
    unknown = sorted(set(args.chapters or []) - set(known))
    if unknown:
        sys.exit(f"error: unknown chapter(s) {', '.join(unknown)}; known: {', '.join(known)}")
    cap = min(args.cap, args.limit) if args.limit else args.cap
    redo = None
    if args.redo_timeouts or args.keys:
        redo = set(args.keys or []) | {r["key"] for r in data["mutants"] if args.redo_timeouts and timed_out(r)}
        redo = {k for k in redo if not args.chapters or k.split("/")[0] in args.chapters}
        plan = [m for m in mutants(ROOT, cap=None, only=args.chapters) if m.key in redo]
        missing = redo - {m.key for m in plan}
        if missing:
            sys.exit(f"error: no such mutant of today's solutions: {', '.join(sorted(missing))}")
        print(f"running again {len(plan)} mutants", file=sys.stderr)
        if not plan:
            return
    else:
        plan = list(mutants(ROOT, cap=cap, seed=args.seed, only=args.chapters))
    by_chapter: dict[str, list] = {}
    for m in plan:
        by_chapter.setdefault(m.chapter, []).append(m)
    options = Options(mutant_seconds=args.mutant_timeout, property_tests=not args.no_property_tests, jobs=args.jobs)
    if args.cell_timeout:
        options.cell_seconds = args.cell_timeout
    if redo is None:
        data["about"] = {**provenance(args), "options": {k: v for k, v in vars(options).items()}}
    else:
        data["about"].setdefault("redone", []).append({**provenance(args), "mutants": len(plan)})
    started = time.monotonic()
    contexts = {m.key: m.edit.context for m in plan}
    with tqdm(total=len(plan), unit="mutant", desc="mutants") as bar:
        for chapter, mutants_of in by_chapter.items():
            bar.set_postfix_str(chapter)
            rows, controls, meta, error = _chapter_in_child(chapter, mutants_of, options, args, bar)
            for row in rows:
                row["context"] = contexts.get(row["key"], "")
            date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
            if redo is None:
                data["mutants"] = [r for r in data["mutants"] if r["chapter"] != chapter] + rows
                data["controls"] = [c for c in data["controls"] if c.get("chapter") != chapter] + controls
                meta.update(mutants=len(mutants_of), finished=len(rows), error=error, date=date,
                            commit=data["about"].get("commit"), command=data["about"].get("command"))
                data["chapters"][chapter] = meta
                data["about"]["seconds"] = round(time.monotonic() - started)
                data["about"]["load_average_after"] = os.getloadavg()[0]
            else:  # only these rows, and the controls of their cells, are replaced
                done = {r["key"] for r in rows}
                cells = {c["cell"] for c in controls}
                data["mutants"] = [r for r in data["mutants"] if r["key"] not in done] + rows
                data["controls"] = [c for c in data["controls"]
                                    if not (c.get("chapter") == chapter and c.get("cell") in cells)] + controls
                data["chapters"][chapter].setdefault("redone", []).append(
                    {"date": date, "mutants": len(mutants_of), "finished": len(rows), "error": error})
            data["mutants"].sort(key=lambda r: (r["chapter"], r["cell"], r["line"], r["col"], r["key"]))
            save(data, args.out)
            write_table(data, args.table)
            if error:
                tqdm.write(f"error in {chapter}: {error}", file=sys.stderr)


def timed_out(row: dict) -> bool:
    """A row whose run ran out of time or died: worth running again on a quieter machine."""
    return row.get("status") in ("timeout", "crashed", "cell-timeout") or \
        (row.get("first_failure") or {}).get("ename") in ("CellTimeoutError", "Timeout", "KernelDied")


def _chapter_in_child(chapter: str, mutants_of: list, options, args, bar) -> tuple[list, list, dict, str | None]:
    """One chapter in a forked process of its own (its cells must not leak into the next chapter)."""
    from tests.fixtures.mutant_runs import run_chapter

    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 0
        try:
            def send(kind: str, item: dict) -> None:
                os.write(write_end, (json.dumps({"kind": kind, "item": item}, ensure_ascii=False) + "\n").encode())

            def report(row: dict) -> None:
                send("control" if row.get("control") else "row", row)

            with tempfile.TemporaryDirectory(prefix=f"mutants-{chapter}-", dir=_scratch(args)) as workdir:
                meta = run_chapter(ROOT, chapter, mutants_of[0].notebook, mutants_of, options, report, Path(workdir))
            send("meta", meta)
        except BaseException as error:  # noqa: BLE001 - the parent reports it and goes on with the next chapter
            import traceback

            send("error", {"error": f"{type(error).__name__}: {str(error)[:500]}", "traceback": traceback.format_exc()})
            code = 1
        os._exit(code)
    os.close(write_end)
    rows, controls, meta, error = [], [], {}, None
    with os.fdopen(read_end) as lines:
        for line in lines:
            message = json.loads(line)
            kind, item = message["kind"], message["item"]
            if kind == "meta":
                meta = item
            elif kind == "error":
                error = item["error"]
                print(item.get("traceback", ""), file=sys.stderr)
            elif kind == "control":
                controls.append(item)
            else:
                rows.append(item)
                bar.update()
    _, status = os.waitpid(pid, 0)
    if status and error is None:
        error = f"the chapter's process ended with status {status}"
    return rows, controls, meta, error


def _scratch(args: argparse.Namespace) -> str:
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return str(args.workdir)
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


# --- the real grader on a sample ----------------------------------------------------------------

def answer(source: str) -> str:
    """A solution cell's code as a student writes it: without nbgrader's markers (as submissions.py does)."""
    from stepformer.course.sync import BEGIN, END

    return "\n".join(line for line in source.splitlines() if line.strip() not in (BEGIN, END))


def grade_sample(args: argparse.Namespace, data: dict) -> None:
    """Grade ``args.grade`` mutants per chapter (and the solution) with grade(); compare with the fast runner."""
    import nbformat

    from stepformer.course.grade import grade
    from stepformer.course.sandbox import sandbox_problem
    from tests.fixtures.mutants import Mutant, edits, solution_cells
    from tests.fixtures.submissions import Submission, build

    rows = [r for r in data["mutants"] if not args.chapters or r["chapter"] in args.chapters]
    if not rows:
        sys.exit(f"error: {args.out} has no mutants to grade (run the fast runner first)")
    sandbox = sandbox_problem() is None
    agreement = data.setdefault("agreement", {})
    rng = random.Random(args.seed)
    chapters_ = sorted({r["chapter"] for r in rows})
    for chapter in chapters_:
        of_chapter = [r for r in rows if r["chapter"] == chapter]
        # Half caught, half not (where there are both): agreement matters for both.
        caught = [r for r in of_chapter if r["caught"]]
        kept = [r for r in of_chapter if not r["caught"]]
        rng.shuffle(caught)
        rng.shuffle(kept)
        sample = (kept[: args.grade // 2] + caught)[: args.grade] if kept else caught[: args.grade]
        notebook = data["chapters"].get(chapter, {}).get("notebook") or next(
            p.name for p in (ROOT / "solutions" / chapter).glob("*.ipynb"))
        sources = dict(solution_cells(ROOT, chapter, notebook))
        by_key = {}
        for cell, source in sources.items():
            for edit in edits(source):
                m = Mutant(chapter, notebook, cell, edit)
                by_key[m.key] = m
        missing = [r["key"] for r in sample if r["key"] not in by_key]
        if missing:
            sys.exit(f"error: {', '.join(missing)}: no longer made from solutions/{chapter} (the solution changed "
                     "since the fast run): run the fast runner on this chapter again first")
        cases = [Submission("solution", points=0, feedback="")]
        for i, row in enumerate(sample):
            m = by_key[row["key"]]
            cases.append(Submission(f"m{i:02d}", points=0, feedback="",
                                    edits={m.cell: [(answer(sources[m.cell]), answer(m.edit.source))]}))
        print(f"grading {len(cases)} notebooks of {chapter} with grade() (sandbox: {'yes' if sandbox else 'no'})",
              file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix=f"mutants-grade-{chapter}-") as tmp:
            base = Path(tmp)
            for case in cases:
                target = base / "subs" / case.name / chapter
                target.mkdir(parents=True)
                nbformat.write(build(case, chapter, notebook, ROOT / "exercises"), target / notebook)
            started = time.monotonic()
            results = grade(ROOT, base / "subs", chapter, base / "out", base / "work", workers=args.grade_workers,
                            sandbox=sandbox, progress=False, fresh=True)
            seconds = time.monotonic() - started
            by_student = {r.student: r for r in results}
            stem = notebook.removesuffix(".ipynb")
            entries = []
            for case, row in zip(cases, [None, *sample], strict=True):
                result = by_student[case.name]
                real = {k.split(":", 1)[1]: v for k, v in result.cells.items()}
                first = _first_failure(base / "work" / "autograded" / case.name / chapter / notebook)
                if row is None:
                    fast_points = {}
                    fast_first = None
                else:
                    fast_points = row["points"]
                    fast_first = row.get("first_failure")
                graded_code = _graded_code_cells(ROOT / "solutions" / chapter / notebook)
                expected = {g: fast_points.get(g, points) for g, points in graded_code.items()}
                got = {g: real.get(g, 0.0) for g in graded_code}
                entries.append({
                    "key": row["key"] if row else "solution", "status": result.status,
                    "points_agree": expected == got, "fast": expected, "grader": got,
                    "first_failure_agrees": _same_failure(fast_first, first),
                    "fast_first": fast_first, "grader_first": first, "detail": result.detail[:500],
                })
        agreement[chapter] = {"sandbox": sandbox, "seconds": round(seconds, 1), "notebooks": len(cases),
                              "entries": entries, "stem": stem,
                              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
        save(data, args.out)
        write_table(data, args.table)


def _graded_code_cells(path: Path) -> dict[str, float]:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return {c.metadata.nbgrader["grade_id"]: float(c.metadata.nbgrader.get("points") or 0) for c in nb.cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")
            and not c.metadata.nbgrader.get("solution")}


def _first_failure(path: Path) -> dict | None:
    """The first graded cell of an autograded notebook with an error (or stderr), as the fast runner reports it."""
    import nbformat

    if not path.is_file():
        return None
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                return {"cell": meta["grade_id"], "ename": output.get("ename"), "message": output.get("evalue", "")}
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                return {"cell": meta["grade_id"], "ename": "stderr", "message": output.get("text", "").strip()}
    return None


def _same_failure(fast: dict | None, real: dict | None) -> bool:
    """The same cell, exception and message (up to white space and the addresses of objects in reprs)."""
    if fast is None or real is None:
        return fast is None and real is None

    def text(message: str) -> str:
        return re.sub(r"0x[0-9a-f]+", "0x…", " ".join(message.split()))

    return fast["cell"] == real["cell"] and fast["ename"] == real["ename"] and \
        text(fast["message"]) == text(real["message"])


# --- the table ------------------------------------------------------------------------------------

def merge(data: dict, files: list[Path]) -> None:
    """Replace the chapters that ``files`` ran (whole chapters, not ``--keys`` reruns) with their results."""
    for path in files:
        other = load(path)
        same = ("seed", "cap", "limit")
        if data["about"] and any(other["about"].get(k) != data["about"].get(k) for k in same):
            sys.exit(f"error: {path} was run with another seed, cap or limit than {', '.join(same)} of --out")
        for chapter, meta in other.get("chapters", {}).items():
            if meta.get("redone") or meta.get("error") or meta.get("finished") != meta.get("mutants"):
                sys.exit(f"error: {path} holds an incomplete or partly rerun {chapter}; run it whole with --chapters")
            meta.setdefault("commit", other["about"].get("commit"))
            meta.setdefault("command", other["about"].get("command"))
            meta["hardware"], meta["torch"] = other["about"].get("hardware"), other["about"].get("torch")
            data["mutants"] = [r for r in data["mutants"] if r["chapter"] != chapter] + \
                [r for r in other["mutants"] if r["chapter"] == chapter]
            data["controls"] = [c for c in data["controls"] if c.get("chapter") != chapter] + \
                [c for c in other["controls"] if c.get("chapter") == chapter]
            data["chapters"][chapter] = meta
            print(f"{chapter}: from {path} (commit {meta['commit']}, {meta.get('date')})", file=sys.stderr)
    data["mutants"].sort(key=lambda r: (r["chapter"], r["cell"], r["line"], r["col"], r["key"]))


def write_table(data: dict, path: Path) -> None:
    from tests.fixtures.mutant_messages import classify, states_the_cause
    from tests.fixtures.mutants import mutants

    contexts = {m.key: m.edit.context for m in mutants(ROOT, cap=None)}  # as the rules read them today
    for row in data["mutants"]:
        row["context"] = contexts.get(row["key"], row.get("context", ""))
        if row.get("caught") and row.get("first_failure"):
            row["class"], row["class_why"] = classify(row)
            row["states_cause"] = states_the_cause(row)
        else:
            row.pop("class", None)
            row.pop("class_why", None)
            row.pop("states_cause", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(data))


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render(data: dict) -> str:
    about = data.get("about", {})
    rows = data["mutants"]
    chapters_ = sorted({r["chapter"] for r in rows} | set(data.get("chapters", {})))
    out = ["# Mutation testing of the checks", "",
           "Generated by `benchmarks/mutants.py` from `benchmarks/results/mutants.json`; do not edit. How it works "
           "and how to run it: [README.md](README.md#mutation-testing-of-the-checks).", ""]
    if about:
        others = {c: m for c, m in data.get("chapters", {}).items()
                  if m.get("commit") and m["commit"] != about.get("commit")}
        first = "The full run" if not others else "The last full run"
        out += [f"{first}: `{about.get('command')}` at commit `{about.get('commit')}`, {about.get('date')}, on "
                f"{about.get('hardware')}, torch {about.get('torch')}, Python {about.get('python')}; seed "
                f"{about.get('seed')}, at most {about.get('cap')} mutants per solution cell"
                + (f" (limited to {about['limit']})" if about.get("limit") else "")
                + f"; {about.get('seconds', 0) / 60:.0f} minutes (load average "
                f"{about.get('load_average_before', 0):.1f} before, "
                f"{about.get('load_average_after', 0):.1f} after).", ""]
    others = {c: m for c, m in sorted(data.get("chapters", {}).items())
              if m.get("commit") and m["commit"] != about.get("commit")}
    if others:
        out += [("Every chapter was" if len(others) == len(data.get("chapters", {})) else "Chapters")
                + " run again later, whole, with the same seed and cap, and taken in by `--merge` (the rows below are "
                "these runs'): "
                + "; ".join(f"{c} at commit `{m['commit']}`, {m.get('date')}, on {m.get('hardware')}"
                            for c, m in others.items()) + ".", ""]
    out += ["Caught: the mutant loses points. Equivalent: no input tells it from the solution (the checks' inputs, "
            "more seeds, the library's property tests). The classes of the first failing message, of the caught "
            "mutants: *named* (names the mutated construct), *generic* (reports observations only), *else* (names "
            "another cause: listed in full below). *Cause %* reads *named* strictly: a sentence that says what the "
            "student did mentions the construct, or the error the code raised does; a recipe or a where-to-look "
            "sentence that mentions it counts for *named*, not for *cause*.", "",
            "| chapter | mutants | equivalent | non-equivalent | caught | caught % | named % | cause % | generic % | "
            "else |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    totals = [0] * 8
    for chapter in chapters_:
        of = [r for r in rows if r["chapter"] == chapter]
        eq = sum(r["equivalent"] for r in of)
        non = len(of) - eq
        caught = [r for r in of if r["caught"]]
        named = sum(r.get("class") == "names-mutated" for r in caught)
        cause = sum(r.get("class") == "names-mutated" and r.get("states_cause", False) for r in caught)
        generic = sum(r.get("class") == "generic" for r in caught)
        other = sum(r.get("class") == "names-something-else" for r in caught)
        meta = data.get("chapters", {}).get(chapter, {})
        note = " (incomplete: see the results file)" if meta.get("error") else ""
        out.append(f"| {chapter}{note} | {len(of)} | {eq} | {non} | {len(caught)} | {_pct(len(caught), non)} | "
                   f"{_pct(named, len(caught))} | {_pct(cause, len(caught))} | {_pct(generic, len(caught))} | "
                   f"{other} |")
        for i, v in enumerate((len(of), eq, non, len(caught), named, cause, generic, other)):
            totals[i] += v
    n, eq, non, caught, named, cause, generic, other = totals
    out.append(f"| **all** | {n} | {eq} | {non} | {caught} | {_pct(caught, non)} | {_pct(named, caught)} | "
               f"{_pct(cause, caught)} | {_pct(generic, caught)} | {other} |")
    ops = sorted({r["operator"] for r in rows})
    out += ["", "Per operator:", "", "| operator | mutants | equivalent | caught % | named % | generic % | else |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for op in ops:
        of = [r for r in rows if r["operator"] == op]
        eq = sum(r["equivalent"] for r in of)
        caught = [r for r in of if r["caught"]]
        out.append(f"| {op} | {len(of)} | {eq} | {_pct(len(caught), len(of) - eq)} | "
                   f"{_pct(sum(r.get('class') == 'names-mutated' for r in caught), len(caught))} | "
                   f"{_pct(sum(r.get('class') == 'generic' for r in caught), len(caught))} | "
                   f"{sum(r.get('class') == 'names-something-else' for r in caught)} |")
    survivors = [r for r in rows if not r["caught"] and not r["equivalent"]]
    out += ["", f"## Survivors ({len(survivors)})", "",
            "Non-equivalent mutants that lose no points, with the input that tells each apart.", ""]
    if survivors:
        out += ["| chapter | cell | operator | line | original | mutated | told apart by |",
                "| --- | --- | --- | ---: | --- | --- | --- |"]
        out += [f"| {r['chapter']} | {r['cell']} | {r['operator']} | {r['line']} | {_code(r['original'])} | "
                f"{_code(r['mutated'])} | {_cell(r['equivalence'])} |" for r in survivors]
    else:
        out.append("None.")
    elsewhere = [r for r in rows if r.get("class") == "names-something-else"]
    out += ["", f"## Messages that name something else ({len(elsewhere)})", "",
            "The first failing message names a cause, and the rules of `tests/fixtures/mutant_messages.py` did not "
            "find the mutated construct in it: for a person to judge.", ""]
    for r in elsewhere:
        f = r["first_failure"]
        out += [f"- **{r['chapter']} {r['cell']}**, {r['operator']}, line {r['line']}: `{r['original']}` → "
                f"`{r['mutated']}`; first failing cell `{f['cell']}`:", "", "  > " + _quote(f["message"]), ""]
    if not elsewhere:
        out.append("None.")
    equivalent = [r for r in rows if r["equivalent"]]
    out += ["", f"## Equivalent mutants ({len(equivalent)})", "",
            "Discarded: the solution's results on every input tried, and its property tests pass.", ""]
    if equivalent:
        out += ["| chapter | cell | operator | line | original | mutated |", "| --- | --- | --- | ---: | --- | --- |"]
        out += [f"| {r['chapter']} | {r['cell']} | {r['operator']} | {r['line']} | {_code(r['original'])} | "
                f"{_code(r['mutated'])} |" for r in equivalent]
    out += _agreement(data)
    controls = data.get("controls", [])
    bad = [c for c in controls if c.get("records_differ") or c.get("points_lost") or c.get("status") != "ok"]
    out += ["", "## Controls", "",
            f"Before the mutants of each solution cell, an unmutated run from the same fork: {len(controls)} runs, "
            f"{len(controls) - len(bad)} reproduced the solution's records and points exactly."]
    for c in bad:
        out.append(f"- {c.get('chapter')} {c.get('cell')}: {c.get('records_differ') or c.get('status')}")
    skipped = {ch: m.get("skipped_extras") for ch, m in data.get("chapters", {}).items() if m.get("skipped_extras")}
    if skipped:
        out += ["", "Extra-seed calls left out of the equivalence test (slower than 5 s each):", ""]
        out += [f"- {ch}: " + "; ".join(f"`{s}`" for s in calls) for ch, calls in skipped.items()]
    return "\n".join(out) + "\n"


def _agreement(data: dict) -> list[str]:
    agreement = data.get("agreement") or {}
    out = ["", "## The fast runner against the grading command", ""]
    if not agreement:
        return out + ["Not measured yet (`--grade N`)."]
    entries = [e for a in agreement.values() for e in a["entries"]]
    for e in entries:  # the rule may have changed since they were graded
        e["first_failure_agrees"] = _same_failure(e["fast_first"], e["grader_first"])
    points = sum(e["points_agree"] for e in entries)
    first = sum(e["first_failure_agrees"] for e in entries)
    out += [f"{len(entries)} notebooks ({len(agreement)} chapters: the unmutated solution and a sample of mutants of "
            "each) graded with `stepformer.course.grade.grade()` "
            f"(sandbox: {', '.join(sorted({'yes' if a['sandbox'] else 'no' for a in agreement.values()}))}): the "
            f"points of every graded cell agree with the fast runner's for {points} of {len(entries)}; the first "
            f"failing cell and its message agree for {first}.", ""]
    for chapter, a in sorted(agreement.items()):
        for e in a["entries"]:
            if not (e["points_agree"] and e["first_failure_agrees"]):
                out.append(f"- {chapter} `{e['key']}`: fast {e['fast']} / {e['fast_first']}; grader {e['grader']} / "
                           f"{e['grader_first']}")
    return out


def _code(text: str) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= 90 else text[:87] + "..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")[:300]


def _quote(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = load(args.out)
    if args.merge:
        merge(data, args.merge)
    if args.table_only or args.merge:
        if not data["mutants"]:
            sys.exit(f"error: {args.out} holds no results yet; run without --table-only first")
        write_table(data, args.table)
        save(data, args.out)
        print(f"wrote {args.table}")
        return 0
    import torch

    torch.set_num_threads(1)
    import matplotlib  # noqa: F401 - imported once here, not in every forked child

    import stepformer.course.trusted as trusted

    trusted.check_namespace()  # every check module, imported before the forks
    if not args.grade_only:
        run_chapters(args, data)
    if args.grade or args.grade_only:
        grade_sample(args, data)
    write_table(data, args.table)
    save(data, args.out)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} and {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
