"""Chapter 12's masking rate, chosen on the val captions: BERT's objective trained choosing 15% or 40% of the pieces.

    .venv/bin/python benchmarks/mlm_mask_rate.py --data-dir ../shared/data/multi30k           # about 25 minutes
    .venv/bin/python benchmarks/mlm_mask_rate.py --data-dir ../shared/data/multi30k --reuse   # collect runs made

Each rate is one ``stepformer-lm mlm --steps STEPS --mask-rate RATE`` run into ``RUNS-<percent>`` (the same seed,
batches and model; only the share of chosen pieces differs), tested as BERT is, with 15% of the val captions'
pieces chosen in one fixed draw. ``--reuse`` takes a run folder that already holds a ``results.json`` made with
the same steps, rate and seed instead of training again. The runs go one after the other; ``--parallel`` starts
them side by side, each on ``--threads`` threads. The summary (accuracy, long words, steps, time, commit, hardware
and command of each run) goes to ``--out``, which chapter 12 reads. Not a test.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_folder(prefix: Path, rate: float) -> Path:
    return prefix.with_name(f"{prefix.name}-{round(rate * 100)}")


def reusable(folder: Path, steps: int, rate: float, seed: int) -> bool:
    """Whether ``folder`` holds a finished run with these settings; a run with others is an error, not a reuse."""
    path = folder / "results.json"
    if not path.exists():
        return False
    results = json.loads(path.read_text(encoding="utf-8"))
    made = (results["masked_lm"]["steps"], results["settings"]["mlm_mask"], results["seed"])
    if made != (steps, rate, seed):
        sys.exit(f"{path} was made with (steps, mask rate, seed) = {made}, not {(steps, rate, seed)}: "
                 "remove it or choose another --runs")
    return True


def summary(folder: Path) -> dict:
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    masked = results["masked_lm"]
    return {
        "mask_rate": results["settings"]["mlm_mask"], "steps": masked["steps"], "wall_s": masked["wall_s"],
        "accuracy": masked["accuracy"]["trained"], "long_words": masked["long_words"]["trained"],
        "frequency_baseline": masked["accuracy"]["frequency_baseline"],
        "held_out_masked_tokens": masked["held_out_masked_tokens"],
        "command": results["command"], "commit": results["commit"], "hardware": results["hardware"],
        "torch": results["torch"], "seed": results["seed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, help="a local copy of Multi30k (default: download it)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.15, 0.4])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parallel", action="store_true", help="start the runs side by side")
    parser.add_argument("--reuse", action="store_true", help="keep a finished run with the same settings")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "mlm-rate", help="the run folders' prefix")
    parser.add_argument("--out", type=Path, default=ROOT / "book" / "results" / "mlm_mask_rate.json")
    args = parser.parse_args()
    started = []
    for rate in args.rates:
        folder = run_folder(args.runs, rate)
        if args.reuse and reusable(folder, args.steps, rate, args.seed):
            print(f"reusing {folder}")
            continue
        command = [sys.executable, "-m", "stepformer.lm", "mlm", "--steps", str(args.steps), "--mask-rate", str(rate),
                   "--seed", str(args.seed), "--threads", str(args.threads), "--out", str(folder), "--replace"]
        if args.data_dir is not None:
            command += ["--data-dir", str(args.data_dir)]
        print("running", " ".join(command), flush=True)
        process = subprocess.Popen(command)
        if args.parallel:
            started.append(process)
        elif process.wait() != 0:
            sys.exit(f"the run at mask rate {rate} failed")
    if any(process.wait() != 0 for process in started):
        sys.exit("a run failed")
    runs = [summary(run_folder(args.runs, rate)) for rate in args.rates]
    result = {"split": "val", "chosen_when_evaluated": 0.15, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for run in runs:
        print(f"mask rate {run['mask_rate']:.2f}: {run['accuracy']:.1%} of the held-out blanks, "
              f"{run['long_words']:.1%} of the long words ({run['steps']} steps, {run['wall_s'] / 60:.1f} min)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
