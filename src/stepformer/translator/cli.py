"""``stepformer-translate``: train a German↔English translator, translate with it, score it.

Examples::

    stepformer-translate train --preset cpu --out runs/de-en          # 50 minutes on a laptop CPU
    stepformer-translate train --preset cpu --out runs/de-en --resume # continue after a stop
    stepformer-translate translate --checkpoint runs/de-en/averaged.pt "Ein Hund rennt im Schnee."
    stepformer-translate evaluate --checkpoint runs/de-en/averaged.pt --split test_2016_flickr
    torchrun --nproc_per_node 2 -m stepformer.translator.cli train --preset tiny --out runs/ddp
"""

import argparse
import json
import sys
from pathlib import Path

from stepformer.translator.config import PRESETS, preset
from stepformer.translator.data import SPLITS, DataError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepformer-translate",
        description="Train, run and score the course's Transformer translator on Multi30k (chapter 11).",
        epilog="Run 'stepformer-translate COMMAND --help' for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train", help="train a translator (downloads Multi30k on first use)",
        description="Train a translator into --out: checkpoints, metrics.jsonl, curves.png, then averaged.pt. "
        "The presets: " + "; ".join(
            f"{name} ({c.model.layers}+{c.model.layers} layers, d_model {c.model.d_model}, "
            + (f"{c.max_minutes:g} min" if c.max_minutes else f"{c.max_steps} steps") + ")"
            for name, c in PRESETS.items()),
    )
    train.add_argument("--preset", default="cpu", help=f"one of {', '.join(PRESETS)} (default: cpu)")
    train.add_argument("--out", required=True, type=Path, help="the run's folder")
    train.add_argument("--src", help="source language: de, en or fr (default: the preset's, de)")
    train.add_argument("--tgt", help="target language (default: the preset's, en)")
    train.add_argument("--steps", type=int, help="stop after this many optimiser steps")
    train.add_argument("--epochs", type=int, help="stop after this many passes over the training data")
    train.add_argument("--minutes", type=float, help="stop after this much wall-clock time (resumed runs count all)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="change any other setting, e.g. --set warmup=800 --set model.dropout=0.3 (the model's "
                       "settings as model.NAME; repeatable)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    _data_options(train)
    train.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to stderr)")

    translate = commands.add_parser(
        "translate", help="translate sentences given as arguments, in a file, or on standard input",
        description="Translate with a trained checkpoint. Sentences come from the arguments, else from --file, "
        "else from standard input, one per line; translations go to standard output, one per line.",
    )
    translate.add_argument("sentences", nargs="*", help="sentences to translate")
    translate.add_argument("--checkpoint", required=True, type=Path, help="e.g. runs/de-en/averaged.pt")
    translate.add_argument("--file", type=Path, help="a text file, one sentence per line")
    _decoding_options(translate)

    evaluate = commands.add_parser(
        "evaluate", help="score a checkpoint on a split with sacreBLEU and chrF",
        description="Translate a whole split and score it against the raw references: sacreBLEU (13a, cased) and "
        "chrF with their signatures and bootstrap 95% intervals, and the older lowercased tokenized BLEU for "
        "comparison.",
    )
    evaluate.add_argument("--checkpoint", required=True, type=Path)
    evaluate.add_argument("--split", default="test_2016_flickr", choices=SPLITS)
    evaluate.add_argument("--limit", type=int, help="only the split's first N sentences (a quick look, not a score)")
    evaluate.add_argument("--results", type=Path, help="append the result (JSON, one line) to this file")
    evaluate.add_argument("--hypotheses", type=Path, help="write the translations here, one per line")
    _data_options(evaluate)
    _decoding_options(evaluate)
    return parser


def _data_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path,
                        help="a local folder with Multi30k's <split>.<lang>.gz files instead of downloading them")


def _decoding_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--beam", type=int, help="beam size; 1 is greedy (default: the checkpoint's, 4)")
    parser.add_argument("--length-penalty", type=float, help="score / length^this (default: the checkpoint's, 1.0)")
    parser.add_argument("--no-cache", action="store_true", help="recompute the prefix at every step (slower)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "translate":
            return _translate(args)
        return _evaluate(args)
    except (ValueError, FileNotFoundError, FileExistsError, DataError) as error:
        print(f"stepformer-translate {args.command}: error: {error}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    from stepformer.translator.train import train

    config = preset(args.preset)
    overrides = dict(_key_value(item) for item in args.set)
    for key, value in (("src_lang", args.src), ("tgt_lang", args.tgt), ("max_steps", args.steps),
                       ("max_epochs", args.epochs), ("max_minutes", args.minutes)):
        if value is not None:
            overrides[key] = str(value)
    if any(v is not None for v in (args.steps, args.epochs, args.minutes)):
        # A budget given on the command line replaces the preset's, rather than adding to it.
        for key in ("max_steps", "max_epochs", "max_minutes"):
            overrides.setdefault(key, "None")
    config = config.with_overrides(overrides)
    averaged = train(config, args.out, args.data_dir, resume=args.resume, progress=not args.no_progress)
    print(averaged)
    return 0


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


def _translate(args: argparse.Namespace) -> int:
    from stepformer.translator.evaluate import Translator

    if args.sentences:
        sentences = args.sentences
    elif args.file is not None:
        if not args.file.is_file():
            raise FileNotFoundError(f"no file at {args.file}")
        sentences = args.file.read_text(encoding="utf-8").splitlines()
    else:
        sentences = sys.stdin.read().splitlines()
    translator = Translator.load(args.checkpoint)
    for line in translator.translate(sentences, args.beam, args.length_penalty, not args.no_cache):
        print(line)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from stepformer.translator.evaluate import evaluate

    result = evaluate(args.checkpoint, args.split, args.data_dir, args.beam, args.length_penalty, not args.no_cache,
                      limit=args.limit)
    hypotheses = result.pop("hypotheses")
    if args.limit is not None:
        print(f"only the first {result['sentences']} sentences of {result['split']}: not comparable with full scores")
    for name, key in (("BLEU", "bleu"), ("chrF", "chrf")):
        low, high = result[f"{key}_ci95"]
        print(f"{result['direction']} {result['split']}: {name} {result[key]:.2f}, 95% interval {low:.2f}–{high:.2f}  "
              f"({result[f'{key}_signature']})")
    print(f"  intervals: sacreBLEU's bootstrap, {result['n_bootstrap']} resampled test sets, seed "
          f"{result['bootstrap_seed']}")
    print(f"  for comparison, lowercased Moses-tokenized BLEU: {result['bleu_lowercased_moses_tokenized']:.2f}")
    print(f"  beam {result['beam']}, length penalty {result['length_penalty']}, KV-cache {result['kv_cache']}, "
          f"{result['decode_seconds']} s on {result['decode_hardware']}; checkpoint {result['checkpoint']} "
          f"(step {result['steps']}, {result['train_minutes']} min of training in {result['train_precision']}, "
          f"seed {result['seed']}, commit {result['train_commit']})")
    if args.results is not None:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(result, ensure_ascii=False) + "\n")
    if args.hypotheses is not None:
        args.hypotheses.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
