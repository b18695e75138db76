"""The `cpu` preset's training throughput, the baseline commit against this tree, side by side in one run.

    .venv/bin/python benchmarks/cpu_step_speed.py --data-dir ../shared/data/multi30k --out --minutes 25 # or all rounds
    .venv/bin/python benchmarks/cpu_step_speed.py --data-dir ../shared/data/multi30k --rounds 2 --warmup-rounds 1 \
        --block 3                                                                          # a quick look

Issue 24 asks that the refactored trainer (the training split padded once into ``PaddedTable``, the
step's results read every ``log_every`` steps, the loop in ``stepformer.runs``, the sinusoidal table
a buffer) train the ``cpu`` preset at least as fast as before it (``--baseline``, default
``89963e4``). The baseline's code is unpacked from git (``git archive``) into a temporary folder,
removed at the end even after an error; the current code is this checkout's ``src/``.

Each side is a subprocess of its own, with ``PYTHONPATH`` set to its own ``src/`` (each checks that
it imported that ``stepformer``), and runs its own commit's whole ``stepformer.translator.train.train``
on Multi30k with the preset as it is (its ``max_tokens``, model, the precision ``auto`` resolves to
on this machine, shape checks on as in ``stepformer-translate train``), but for three things that
are not the step: a budget of exactly the steps needed, no progress bar, and no checkpoint or
validation inside the measured steps (a checkpoint write and a greedy decode of val would land in
one side's block and not the other's). The only thing patched is the module's ``train_step``, wrapped
so that before every ``--block``-th step the process reports the block it has just run and waits
on its stdin for its next turn. So the loop, the batching (padding per step before, a gather from
the table now), the logging and the step are each commit's own, and a block's time runs from the
go to the next block's first step: every step and every piece of the loop between them.

The two processes take turns, block by block, in the order old, new, new, old, old, ... (each
round swaps who goes first, so a load that rises or falls through a round does not always favour
one side), and while one runs the other blocks on a pipe and takes no CPU. Both start from the same
seed and see the same batches in the same order: round ``r`` of either side is the same ``block``
batches, so the rounds pair up, and their losses, printed, show that both compute the same thing.
Why blocks and not whole ``stepformer-translate train`` runs in alternation: a whole run spends
about a minute on things that are not the step (reading the data, training the tokenizer, checkpoints,
averaging), so a few runs of each give a few samples minutes apart, each under a different share of
a machine that others use; blocks of seconds give many paired samples on the same batches, a
few seconds apart, and the setup is done once per side, outside the timing.

The first ``--warmup-rounds`` rounds are left out: a process's first steps are slower than the
rest. ``--minutes`` bounds the run on a busy machine: no round starts after that many minutes of
rounds, and the table says how many were run. Per side: tokens/s of each round (target tokens,
without padding, as the trainer's ``tokens_per_s``), their median and interquartile range, and the
CPU seconds the process used per wall second (near the thread count when it had the cores to itself).
The ratio new/old is that of the medians, with a 95% bootstrap interval (the rounds resampled in
pairs) and the smallest and largest ratio of a round's pair. ``--out`` writes everything, with both
commits, the hardware, threads and the 1-minute load average before and after, to
``book/results/cpu_step_speed.json``. Not a test: timings do not belong in tests.
"""

import argparse
import datetime
import inspect
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIDES = ("old", "new")


class _Finished(Exception):
    """Raised inside the trainer when the controller says stop: the run ends where it is."""


def worker(args: argparse.Namespace) -> None:
    """One side: its own commit's ``train`` on the preset, paused before every ``block``-th step."""
    # The controller reads this process's stdout; anything the library prints goes to stderr instead.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    import torch

    import stepformer
    from stepformer.translator import train as trainer
    from stepformer.translator.config import preset

    imported = Path(stepformer.__file__).resolve()
    if Path(args.src).resolve() not in imported.parents:
        raise RuntimeError(f"imported stepformer from {imported}, not from {args.src}: check PYTHONPATH")
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = (args.warmup_rounds + args.rounds) * args.block + 1  # the last block is reported at the next step
    config = replace(preset(args.preset), max_steps=steps, max_minutes=None, max_epochs=None,
                     checkpoint_every=steps + 1, eval_every=steps + 1)
    out_dir = Path(args.run_dir)
    original = trainer.train_step
    signature = inspect.signature(original)
    calls, results, started = [0], [], [0.0, 0.0]

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")

    def take_turn() -> None:
        if sys.stdin.readline().strip() != "go":
            raise _Finished
        results.clear()
        started[:] = time.perf_counter(), time.process_time()

    def paused_step(*positional, **named):
        if calls[0] % args.block == 0:
            wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
            if calls[0] == 0:
                given = signature.bind(*positional, **named).arguments
                amp_dtype = given["amp_dtype"]
                send({"ready": True, "stepformer": str(imported.parent), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "hardware": trainer.hardware(torch.device("cpu")),
                      "precision": str(amp_dtype or torch.float32).removeprefix("torch."),
                      "max_tokens": given["config"].max_tokens,
                      # a checkout before the model became one ModelConfig had one 'fast' for both
                      "fast": getattr(given["config"], "packed_dropout", getattr(given["config"], "fast", None)),
                      "tokenizer_sha256": _sha256(out_dir / "tokenizer.json")})
            else:
                # Read after the clock: the new trainer's results are tensors, read here, not in the block.
                send({"wall_s": wall, "cpu_s": cpu, "steps": len(results),
                      "tokens": sum(float(tokens) for _, tokens in results),
                      "loss_sum": sum(float(loss) for loss, _ in results), "load1": os.getloadavg()[0]})
            take_turn()
        result = original(*positional, **named)
        calls[0] += 1
        results.append((result[0], result[1]))
        return result

    trainer.train_step = paused_step
    try:
        trainer.train(config, out_dir, args.data_dir, progress=False, device=torch.device("cpu"))
    except _Finished:
        pass
    else:
        raise RuntimeError(f"the run ended after {calls[0]} steps, before the controller said stop")
    send({"finished": True})


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


class Side:
    """A worker process, started in ``root`` with ``root/src`` as its only ``PYTHONPATH``."""

    def __init__(self, name: str, root: Path, run_dir: Path, log: Path, args: argparse.Namespace) -> None:
        self.name, self.log = name, log
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STEPFORMER_COMMIT")}
        env["PYTHONPATH"] = str(root / "src")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--src", str(root / "src"),
                   "--run-dir", str(run_dir), "--preset", args.preset, "--block", str(args.block),
                   "--rounds", str(args.rounds), "--warmup-rounds", str(args.warmup_rounds)]
        if args.data_dir:
            command += ["--data-dir", str(Path(args.data_dir).resolve())]
        if args.threads:
            command += ["--threads", str(args.threads)]
        self.log_file = open(log, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(command, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log_file, text=True, bufsize=1)

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"the {self.name} side ended (exit {self.process.returncode}); its log ends:\n{tail}")
        return json.loads(line)

    def tell(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log_file.close()


def measure(args: argparse.Namespace, baseline_root: Path, tmp: Path) -> tuple[dict, list[dict]]:
    """Start both sides, let them take turns for all the rounds; their ready messages and the rounds."""
    roots = {"old": baseline_root, "new": REPO}
    sides = {}
    try:
        for name in SIDES:
            sides[name] = Side(name, roots[name], tmp / f"run-{name}", tmp / f"{name}.log", args)
        ready = {name: sides[name].read() for name in SIDES}  # both set up (data, tokenizer, model) at once
        rounds = []
        total = args.warmup_rounds + args.rounds
        first_go = time.perf_counter()
        for r in range(total):
            spent = time.perf_counter() - first_go
            if args.minutes is not None and r > args.warmup_rounds and spent > 60 * args.minutes:
                print(f"--minutes {args.minutes:g} spent: {r - args.warmup_rounds} timed rounds", flush=True)
                break
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            row = {"round": r + 1, "warmup": r < args.warmup_rounds, "first": order[0]}
            for name in order:
                sides[name].tell("go")
                row[name] = sides[name].read()
            rounds.append(row)
            old, new = row["old"], row["new"]
            print(f"round {r + 1}/{total}{' (warm-up)' * row['warmup']}: old {old['tokens'] / old['wall_s']:,.0f}, "
                  f"new {new['tokens'] / new['wall_s']:,.0f} tokens/s; load {os.getloadavg()[0]:.2f}", flush=True)
        for name in SIDES:
            sides[name].tell("stop")
            if not sides[name].read().get("finished"):
                raise RuntimeError(f"the {name} side did not finish cleanly; see {sides[name].log}")
            sides[name].process.wait(timeout=60)
    finally:
        for side in sides.values():
            side.close()
    return ready, rounds


def summarise(rounds: list[dict], seed: int, resamples: int) -> dict:
    import numpy as np

    timed = [r for r in rounds if not r["warmup"]]
    rate = {name: np.array([r[name]["tokens"] / r[name]["wall_s"] for r in timed]) for name in SIDES}
    summary = {}
    for name in SIDES:
        q1, median, q3 = np.percentile(rate[name], [25, 50, 75])
        ms = [1000 * r[name]["wall_s"] / r[name]["steps"] for r in timed]
        cpu = [r[name]["cpu_s"] / r[name]["wall_s"] for r in timed]
        summary[name] = {"tokens_per_s_median": float(median), "tokens_per_s_q1": float(q1),
                         "tokens_per_s_q3": float(q3), "tokens_per_s_min": float(rate[name].min()),
                         "tokens_per_s_max": float(rate[name].max()), "ms_per_step_median": float(np.median(ms)),
                         "cpu_s_per_wall_s_median": float(np.median(cpu))}
    paired = rate["new"] / rate["old"]
    picks = np.random.default_rng(seed).integers(0, len(timed), size=(resamples, len(timed)))
    boot = np.median(rate["new"][picks], axis=1) / np.median(rate["old"][picks], axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    summary["ratio"] = {
        "new_over_old": summary["new"]["tokens_per_s_median"] / summary["old"]["tokens_per_s_median"],
        "bootstrap_ci95": [float(low), float(high)], "bootstrap_resamples": resamples, "bootstrap_seed": seed,
        "paired_median": float(np.median(paired)), "paired_min": float(paired.min()),
        "paired_max": float(paired.max()), "rounds_new_faster": int((paired > 1).sum()), "rounds": len(timed)}
    # The same batches and seed on both sides: their losses agree up to rounding (bf16 autocast).
    summary["loss_per_token_max_abs_difference"] = max(
        abs(r["old"]["loss_sum"] / r["old"]["tokens"] - r["new"]["loss_sum"] / r["new"]["tokens"]) for r in rounds)
    summary["tokens_differ_in_rounds"] = [r["round"] for r in rounds if r["old"]["tokens"] != r["new"]["tokens"]]
    return summary


def print_table(result: dict) -> None:
    s, sides = result["summary"], result["sides"]
    print(f"\n{result['hardware']}, torch {result['torch']}; preset {result['preset']}; "
          f"{result['settings']['rounds']} rounds of {result['settings']['block']} steps per side after "
          f"{result['settings']['warmup_rounds']} warm-up rounds; load average {result['load_before']:.2f} before, "
          f"{result['load_after']:.2f} after; {result['wall_s'] / 60:.1f} min\n")
    print("| side | commit | precision | threads | tokens/s median | interquartile range | min - max | ms/step median "
          "| CPU s per s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in SIDES:
        x, side = s[name], sides[name]
        print(f"| {name} | `{side['commit']}` | {side['precision']} | {side['threads']} | "
              f"{x['tokens_per_s_median']:,.0f} | {x['tokens_per_s_q1']:,.0f} - {x['tokens_per_s_q3']:,.0f} | "
              f"{x['tokens_per_s_min']:,.0f} - {x['tokens_per_s_max']:,.0f} | {x['ms_per_step_median']:.1f} | "
              f"{x['cpu_s_per_wall_s_median']:.2f} |")
    ratio = s["ratio"]
    print(f"\nnew/old: {ratio['new_over_old']:.3f} (median over median; bootstrap 95% "
          f"{ratio['bootstrap_ci95'][0]:.3f} - {ratio['bootstrap_ci95'][1]:.3f}); per round "
          f"{ratio['paired_min']:.3f} - {ratio['paired_max']:.3f}, median {ratio['paired_median']:.3f}, new faster in "
          f"{ratio['rounds_new_faster']} of {ratio['rounds']} rounds")
    print(f"loss per token, old against new, largest difference over the rounds: "
          f"{s['loss_per_token_max_abs_difference']:.2e}"
          + (f"; token counts differ in rounds {s['tokens_differ_in_rounds']}" if s["tokens_differ_in_rounds"] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--baseline", default="89963e4",
                        help="the commit to compare with (default: the trainer before the refactor)")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--data-dir", default=None, help="Multi30k's files (default: the library's own download)")
    parser.add_argument("--block", type=int, default=5, help="steps per side per turn")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (a block of each side per round)")
    parser.add_argument("--warmup-rounds", type=int, default=4, help="rounds run first and left out")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no round after this many minutes of rounds (at least one timed round is run)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per side (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--out", type=Path, nargs="?", const=Path("book/results/cpu_step_speed.json"), default=None,
                        help="write the results as JSON (default path: book/results/cpu_step_speed.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if min(args.block, args.rounds) < 1 or args.warmup_rounds < 0:
        parser.error("--block and --rounds must be at least 1, --warmup-rounds at least 0")

    import torch

    from stepformer.runs import commit, hardware, save_json

    # A plain kill runs the clean-up too: the workers are stopped and the temporary folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    baseline = subprocess.run(["git", "rev-parse", "--short", f"{args.baseline}^{{commit}}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cpu_step_speed-") as folder:
        tmp = Path(folder)
        baseline_root = tmp / "baseline"
        baseline_root.mkdir()
        archive = subprocess.run(["git", "archive", "--format=tar", baseline], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(baseline_root)], input=archive, check=True)
        print(f"old: {baseline} unpacked into {baseline_root}; new: {REPO} at {commit(REPO)}; "
              f"load average {load_before[0]:.2f}", flush=True)
        ready, rounds = measure(args, baseline_root, tmp)
    load_after = os.getloadavg()
    if ready["old"]["tokenizer_sha256"] != ready["new"]["tokenizer_sha256"]:
        print("warning: the two sides trained different tokenizers, so their batches differ", file=sys.stderr)
    result = {
        "command": "benchmarks/cpu_step_speed.py " + shlex.join(sys.argv[1:]), "commit": commit(REPO),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": hardware(torch.device("cpu")), "torch": torch.__version__, "python": sys.version.split()[0],
        "preset": args.preset, "load_before": load_before[0], "load_after": load_after[0],
        "load_before_1_5_15": list(load_before), "load_after_1_5_15": list(load_after),
        "wall_s": round(time.perf_counter() - started, 1),
        "settings": {"block": args.block, "rounds": sum(not r["warmup"] for r in rounds),
                     "rounds_asked": args.rounds, "minutes": args.minutes, "warmup_rounds": args.warmup_rounds,
                     "threads": args.threads, "order": "old first in odd rounds, new first in even ones"},
        "sides": {name: {"commit": baseline if name == "old" else commit(REPO), **ready[name]} for name in SIDES},
        "summary": summarise(rounds, args.seed, args.resamples),
        "rounds": rounds,
    }
    for name in SIDES:
        result["sides"][name].pop("ready")
        result["sides"][name]["stepformer"] = "<baseline>/src/stepformer" if name == "old" else "src/stepformer"
    print_table(result)
    if args.out:
        save_json(result, args.out)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
