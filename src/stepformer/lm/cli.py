"""``stepformer-lm``: the command line of chapter 12's runs."""

import argparse
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from stepformer.lm.config import PRESETS, RunConfig
from stepformer.lm.data import prepare_data
from stepformer.lm.experiments import adaptation_experiment, language_model_experiment, masked_lm_experiment
from stepformer.runs import Budget, commit, hardware, preset, save_json
from stepformer.translator.config import pick_device
from stepformer.translator.data import SPLITS, DataError

COMMANDS = {
    "train": "train the LLaMA-style language model on the English captions; perplexity, samples, decoding speed",
    "mlm": "train a BERT-like encoder with the masked-LM objective; masked-token accuracy and top-5 guesses",
    "lora": "train the language model, then adapt it to German with LoRA and with full fine-tuning",
    "all": "train, mlm and lora in one run, sharing one language model, into one results.json",
}


# How `all --minutes M` shares M between its phases (the adaptations also stop at --adapt-steps). BERT's
# objective gets the most: it learns only at the pieces it masks, the language model at every piece.
SHARES = {"lm": 0.375, "mlm": 0.5, "adapt": 0.125}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepformer-lm",
        description="Chapter 12's models trained on Multi30k's captions on a CPU: a LLaMA-style language model, "
        "BERT's masked-LM objective, and LoRA against full fine-tuning.\nEach command writes OUT/results.json "
        "(settings, hardware, commit and what was measured) and OUT/metrics.jsonl (one line per training step).",
        epilog="Examples:\n"
        "  stepformer-lm all --out results/lm                    # everything, about 16 minutes on 2 CPU cores\n"
        "  stepformer-lm train --minutes 2 --out runs/lm-quick    # only the language model, 2 minutes of training\n"
        "  stepformer-lm all --preset tiny --steps 20 --out /tmp/lm   # seconds: see what the results hold\n"
        "  stepformer-lm all --data-dir ../shared/data/multi30k --threads 1 --out results/lm --replace\n\n"
        "Multi30k is downloaded on first use unless --data-dir names a local copy. No model weights are saved.\n"
        "Run 'stepformer-lm COMMAND --help' for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        command = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        command.add_argument("--out", type=Path, default=Path("results") / ("lm" if name == "all" else f"lm-{name}"),
                             help="the folder for results.json and metrics.jsonl; it must not exist yet unless "
                             "--replace (default: %(default)s)")
        command.add_argument("--replace", action="store_true", help="overwrite the results in an existing --out")
        budget = command.add_mutually_exclusive_group()
        budget.add_argument("--minutes", type=float,
                            help="wall-clock budget of the training" + (
                                " (default 14), shared: language model 37.5%%, masked LM 50%%, LoRA and "
                                "full fine-tuning 12.5%% each"
                                if name == "all" else " (default 4)"))
        budget.add_argument("--steps", type=int, help="a budget in optimiser steps instead, which makes a run "
                            "reproducible" + (" (for the language model and the masked LM each; the adaptations "
                                              "take --adapt-steps)" if name in ("all", "lora") else ""))
        if name in ("lora", "all"):
            command.add_argument("--adapt-steps", type=int,
                                 help="steps of each German adaptation (default: the preset's, 200 for cpu)")
        if name in ("mlm", "all"):
            command.add_argument("--mask-rate", type=float,
                                 help="the share of pieces BERT's objective chooses in training (default: the "
                                 "preset's, 0.4; BERT's was 0.15); the held-out test always chooses 0.15")
        command.add_argument("--seed", type=int, default=1234, help="seeds the weights, batches and sampling "
                             "(default: %(default)s)")
        command.add_argument("--preset", default="cpu", help=f"model sizes and settings: {', '.join(PRESETS)} "
                             "(default: cpu; tiny takes seconds and learns little)")
        command.add_argument("--data-dir", type=Path, help="a local folder with Multi30k's <split>.<lang>.gz files "
                             "instead of downloading them")
        command.add_argument("--eval-split", default="val", help="the held-out split: val (default) or "
                             "test_2016_flickr")
        command.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: its own choice, one per "
                             "core); on a machine busy with other work, 1 is often several times faster")
        command.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args, argv if argv is not None else sys.argv[1:])
    except (ValueError, FileNotFoundError, FileExistsError, DataError) as error:
        print(f"stepformer-lm {args.command}: error: {error}", file=sys.stderr)
        return 2


OUTPUTS = ("results.json", "metrics.jsonl")


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    chosen = preset(PRESETS, args.preset)
    if args.eval_split not in SPLITS or args.eval_split == "train":
        raise ValueError(f"unknown held-out split {args.eval_split!r}; it is val or test_2016_flickr")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.minutes is not None and not args.minutes > 0:
        raise ValueError(f"--minutes must be positive, got {args.minutes}")
    if args.data_dir is not None and not args.data_dir.is_dir():
        raise FileNotFoundError(f"the data folder {args.data_dir} does not exist; it must hold Multi30k's "
                                "<split>.<lang>.gz files")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.replace:
        raise FileExistsError(f"{out} already exists and is not empty: pass --replace to overwrite its results, "
                              "or choose another --out")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    run = replace(chosen, seed=args.seed)
    adapt_steps = getattr(args, "adapt_steps", None)
    if adapt_steps is not None:
        if adapt_steps < 1:
            raise ValueError(f"--adapt-steps must be at least 1, got {adapt_steps}")
        run = replace(run, adapt_steps=adapt_steps)
    mask_rate = getattr(args, "mask_rate", None)
    if mask_rate is not None:
        if not 0.0 < mask_rate < 1.0:
            raise ValueError(f"--mask-rate must lie between 0 and 1, got {mask_rate}")
        run = replace(run, mlm_mask=mask_rate)
    budgets = _budgets(args, run)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log = lambda message: tqdm.write(message, file=sys.stderr)  # noqa: E731
    progress = not args.no_progress
    started = time.perf_counter()
    device = pick_device()
    data = prepare_data(run, args.data_dir, args.eval_split, progress)
    log(f"data: {len(data.en_train):,} English and {len(data.de_train):,} German training captions; vocabulary "
        f"{data.tokenizer.vocab_size:,} subwords; held-out split {args.eval_split}; on {hardware(device)}")
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    results = {
        "command": "stepformer-lm " + shlex.join(argv), "commit": commit(), "hardware": hardware(device),
        "torch": torch.__version__, "seed": run.seed, "preset": args.preset, "settings": run.to_dict(),
        "budgets": {k: asdict(v) for k, v in budgets.items() if k in _phases(args.command)},
        **data.describe(),
    }
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as metrics:
        if args.command in ("train", "lora", "all"):
            model, results["language_model"] = language_model_experiment(data, run, budgets["lm"], device, metrics,
                                                                         progress, log)
        if args.command in ("mlm", "all"):
            results["masked_lm"] = masked_lm_experiment(data, run, budgets["mlm"], device, metrics, progress, log)
        if args.command in ("lora", "all"):
            results["adaptation"] = adaptation_experiment(model, data, run, budgets["adapt"], device, metrics,
                                                          progress, log)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    save_json(results, out / "results.json")
    log(f"wrote {out / 'results.json'} and {out / 'metrics.jsonl'} in {results['wall_s'] / 60:.1f} min")
    return 0


def _phases(command: str) -> tuple[str, ...]:
    return {"train": ("lm",), "mlm": ("mlm",), "lora": ("lm", "adapt"), "all": ("lm", "mlm", "adapt")}[command]


def _budgets(args: argparse.Namespace, run: RunConfig) -> dict[str, Budget]:
    """Each phase's budget from --steps or --minutes; ``all`` shares its minutes (:data:`SHARES`).

    Each German adaptation stops after ``run.adapt_steps`` steps, or earlier at its share of
    ``all``'s minutes.
    """
    if args.steps is not None:
        steps = Budget(max_steps=args.steps)
        return {"lm": steps, "mlm": steps, "adapt": Budget(max_steps=run.adapt_steps)}
    if args.command == "all":
        minutes = 14.0 if args.minutes is None else args.minutes
        return {"lm": Budget(max_minutes=minutes * SHARES["lm"]), "mlm": Budget(max_minutes=minutes * SHARES["mlm"]),
                "adapt": Budget(max_steps=run.adapt_steps, max_minutes=minutes * SHARES["adapt"])}
    minutes = Budget(max_minutes=4.0 if args.minutes is None else args.minutes)
    return {"lm": minutes, "mlm": minutes, "adapt": Budget(max_steps=run.adapt_steps)}


if __name__ == "__main__":
    sys.exit(main())
