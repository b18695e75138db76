"""The translator's quality: train a preset in both directions with the real command, score it, and write the
results file that chapter 11 shows.

    .venv/bin/python benchmarks/translator_quality.py --data-dir ../shared/data/multi30k            # 2 x 50 min
    .venv/bin/python benchmarks/translator_quality.py --data-dir ../shared/data/multi30k --directions \
        --ablation-steps 600                                                     # 3 x ~10 min

For each direction (de→en, en→de) it runs ``stepformer-translate train --preset cpu`` into
``runs/cpu-<src>-<tgt>`` (skipped when that run has finished already: ``averaged.pt`` exists), then
``stepformer-translate evaluate`` on ``val`` with the averaged checkpoint and beam search for each
length penalty in ``LENGTH_PENALTIES``, keeps the best on val, and with it decodes ``test_2016_flickr``
once; on the test set also greedy, the last checkpoint alone (no averaging) and beam
search without the KV-cache (its decoding time). Every score line is what the command printed and
saved: sacreBLEU and chrF with signatures and bootstrap 95% intervals, hardware, wall time, seed, commit;
each row's translations go to ``translations/`` beside the results file (``hypotheses_file``). It adds the loss and
validation curves, example translations chosen by a rule (the best, middle and worst by sentence
chrF), and cross-attention maps of the averaged model on two test sentences chosen by a rule (the
first of 8 and of 14 source tokens), all into ``--results`` (default ``book/results/translator.json``).

``--ablation-steps STEPS`` also trains de→en for ``STEPS`` optimiser steps three times, as it is, without
label smoothing and without warmup, and scores each on the test set (beam 4, averaged,
length penalty 1). A budget in steps, not minutes, so that every variant sees the same batches and the
comparison holds on a busy machine too (each row keeps its wall time). ``--directions`` with no direction
skips the full runs. Not a test.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import sacrebleu
import torch

from stepformer.translator.evaluate import interval_text

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "stepformer.translator.cli"]
LENGTH_PENALTIES = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0)
TRANSLATIONS = "translations"  # beside the results file: the translations of every reported row


def run(args: list[str]) -> str:
    print("$ stepformer-translate " + " ".join(args), flush=True)
    result = subprocess.run([*COMMAND, *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the command failed ({result.returncode}):\n{result.stderr[-3000:]}")
    print(result.stdout, end="", flush=True)
    return result.stdout


def train(out: Path, src: str, tgt: str, data: list[str], preset: str, extra: list[str] = ()) -> float:
    """Train unless the run has finished; the wall time of the command (0 when skipped)."""
    if (out / "averaged.pt").is_file():
        print(f"{out}/averaged.pt exists: not training again", flush=True)
        return 0.0
    started = time.perf_counter()
    resume = ["--resume"] if (out / "checkpoints").is_dir() else []
    run(["train", "--preset", preset, "--src", src, "--tgt", tgt, "--out", str(out), "--no-progress", *data, *resume,
         *extra])
    return time.perf_counter() - started


def evaluate(checkpoint: Path, split: str, data: list[str], options: list[str]) -> dict:
    """The command's result, with its translations under ``hypotheses`` (one string per sentence)."""
    stem = checkpoint.parent / f".eval-{time.time_ns()}"
    with_results, hypotheses = stem.with_suffix(".jsonl"), stem.with_suffix(".txt")
    try:
        run(["evaluate", "--checkpoint", str(checkpoint), "--split", split, "--results", str(with_results),
             "--hypotheses", str(hypotheses), *data, *options])
        translations = hypotheses.read_text(encoding="utf-8").splitlines()
        return {**json.loads(with_results.read_text()), "hypotheses": translations}
    finally:
        with_results.unlink(missing_ok=True)
        hypotheses.unlink(missing_ok=True)


def keep_translations(row: dict, results: Path, name: str) -> dict:
    """The row without its translations, which go to ``translations/NAME.txt`` beside the results file (one per
    line; about 70 kB for a test set), named in the row, so that its scores and intervals can be computed again."""
    path = results.parent / TRANSLATIONS / f"{name.replace(' ', '-').replace(',', '').lower()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in row["hypotheses"]), encoding="utf-8")
    return {k: v for k, v in row.items() if k != "hypotheses"} | {"hypotheses_file": f"{TRANSLATIONS}/{path.name}"}


def curves(run_dir: Path, every: int = 25) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train_rows = [r for r in rows if "loss" in r]
    smoothed = []
    for i in range(every - 1, len(train_rows), every):
        window = train_rows[i - every + 1:i + 1]
        smoothed.append([window[-1]["step"], round(sum(r["loss"] for r in window) / len(window), 4),
                         round(window[-1]["elapsed_s"], 1)])
    val = [[r["step"], round(r["val_bleu"], 2), round(r["val_loss"], 4)] for r in rows if "val_bleu" in r]
    return {"train": smoothed, "val": val}


def examples(sources: list[str], references: list[str], hypotheses: list[str], each: int = 3) -> list[dict]:
    """The ``each`` best, middle and worst translations by sentence chrF: chosen by a rule, not by hand."""
    scored = sorted(((sacrebleu.sentence_chrf(h, [r]).score, i) for i, (h, r) in
                     enumerate(zip(hypotheses, references, strict=True))), key=lambda x: (-x[0], x[1]))
    middle = len(scored) // 2 - each // 2
    picks = [("best", scored[:each]), ("middle", scored[middle:middle + each]), ("worst", scored[-each:])]
    return [{"rank": name, "chrf": round(score, 1), "source": sources[i], "reference": references[i],
             "translation": hypotheses[i]} for name, chosen in picks for score, i in chosen]


def cross_attention(checkpoint: Path, sources: list[str], data: list[str]) -> list[dict]:
    """The last decoder layer's cross-attention (mean over heads) while the averaged model translates
    two test sentences greedily: the first source of 8 tokens and the first of 14."""
    from stepformer.gqa import repeat_kv
    from stepformer.multihead import split_heads
    from stepformer.translator.evaluate import Translator
    from stepformer.translator.search import greedy_search

    translator = Translator.load(checkpoint, torch.device("cpu"))
    tok, model = translator.tokenizer, translator.model
    lengths = [len(ids) for ids in tok.encode(sources)]
    chosen = [lengths.index(n) for n in (8, 14) if n in lengths]
    maps = []
    for i in chosen:
        src = torch.tensor([tok.encode([sources[i]])[0]])
        out = greedy_search(model, src, tok.bos_id, tok.eos_id)[0]
        tgt = torch.tensor([[tok.bos_id, *out]])
        captured = {}
        attention = model.decoder.layers[-1].cross_attn

        def keep(module, args, captured=captured):
            captured["query"], captured["key"] = args[0], args[1]

        handle = attention.register_forward_pre_hook(keep)
        with torch.no_grad():
            model(src, tgt)
            q = split_heads(attention.w_q(captured["query"]), attention.heads)
            k = repeat_kv(split_heads(attention.w_k(captured["key"]), attention.kv_heads), attention.heads)
            weights = torch.softmax(q @ k.transpose(-1, -2) / attention.d_head**0.5, dim=-1).mean(dim=1)[0]
        handle.remove()
        # Row t: the weights with which the decoder, having read <s> y_1 ... y_t, looks at the source
        # while choosing y_{t+1}; so rows are labelled by the token being produced.
        maps.append({"source": tok.tokens(sources[i]), "produced": [*tok.tokenizer.encode(
            tok.decode([out])[0], add_special_tokens=False).tokens, "</s>"],
            "weights": [[round(float(w), 4) for w in row] for row in weights]})
    return maps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs")
    parser.add_argument("--directions", nargs="*", default=["de-en", "en-de"])
    parser.add_argument("--ablation-steps", type=int, metavar="STEPS", help="also the ablation runs, each this long")
    parser.add_argument("--results", type=Path, default=ROOT / "book" / "results" / "translator.json")
    args = parser.parse_args()
    data = ["--data-dir", str(args.data_dir)] if args.data_dir else []
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results.setdefault("runs", [])
    for direction in args.directions:
        src, tgt = direction.split("-")
        out = args.runs / f"{args.preset}-{src}-{tgt}"
        train(out, src, tgt, data, args.preset)
        averaged, last = out / "averaged.pt", sorted((out / "checkpoints").glob("step_*.pt"))[-1]
        # The length penalty is chosen on val, never on the test set; then the test set is decoded once with it.
        on_val = {penalty: evaluate(averaged, "val", data, ["--beam", "4", "--length-penalty", str(penalty)])
                  for penalty in LENGTH_PENALTIES}
        penalty = max(LENGTH_PENALTIES, key=lambda lp: (on_val[lp]["bleu"], -abs(lp - 1.0)))
        print(f"length penalty chosen on val: {penalty} (val BLEU "
              + ", ".join(f"{lp}: {on_val[lp]['bleu']:.2f}" for lp in LENGTH_PENALTIES) + ")", flush=True)
        beam = ["--beam", "4", "--length-penalty", str(penalty)]
        rows = [
            ("averaged, beam 4", evaluate(averaged, "test_2016_flickr", data, beam)),
            ("averaged, beam 4", on_val[penalty]),
            ("averaged, greedy", evaluate(averaged, "test_2016_flickr", data, ["--beam", "1"])),
            ("last checkpoint, beam 4", evaluate(last, "test_2016_flickr", data, beam)),
            ("averaged, beam 4, no KV-cache", evaluate(averaged, "test_2016_flickr", data, [*beam, "--no-cache"])),
        ]
        results.setdefault("length_penalty_on_val", {})[f"{src}→{tgt}"] = {
            str(lp): round(on_val[lp]["bleu"], 2) for lp in LENGTH_PENALTIES}
        results["runs"] = [r for r in results["runs"] if not (r["preset"] == args.preset and
                                                              r["direction"] == f"{src}→{tgt}")]
        test_translations = rows[0][1]["hypotheses"]
        for variant, row in rows:
            name = f"{args.preset} {src}-{tgt} {row['split']} {variant}"
            results["runs"].append({"preset": args.preset, "variant": variant, **keep_translations(row, args.results,
                                                                                                   name)})
        from stepformer.translator.data import load_split

        sources, references = load_split("test_2016_flickr", src, tgt, args.data_dir, progress=False)
        results.setdefault("curves", {})[f"{src}→{tgt}"] = curves(out)
        results.setdefault("examples", {})[f"{src}→{tgt}"] = examples(sources, references, test_translations)
        results.setdefault("attention", {})[f"{src}→{tgt}"] = cross_attention(averaged, sources, data)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    if args.ablation_steps:
        ablation = []
        for name, extra in (("the cpu recipe", []), ("no label smoothing", ["--set", "label_smoothing=0"]),
                            ("no warmup", ["--set", "warmup=1"])):
            out = args.runs / f"ablation-{args.ablation_steps}steps-{name.replace(' ', '-')}"
            train(out, "de", "en", data, args.preset, ["--steps", str(args.ablation_steps), *extra])
            row = evaluate(out / "averaged.pt", "test_2016_flickr", data, ["--beam", "4"])
            ablation.append({"variant": name, **keep_translations(row, args.results,
                                                                  f"ablation {args.ablation_steps} steps {name}")})
        results["ablation"] = ablation
        args.results.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print("\n| preset | direction | split | variant | BLEU | chrF | 95% interval (BLEU / chrF) | lc-tok BLEU | "
          "decode s | train min | steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["runs"]:
        print(f"| {r['preset']} | {r['direction']} | {r['split']} | {r['variant']} | {r['bleu']:.2f} | "
              f"{r['chrf']:.2f} | {interval_text(r)} | {r['bleu_lowercased_moses_tokenized']:.2f} | "
              f"{r['decode_seconds']} | {r['train_minutes']} | {r['steps']} |")
    if results["runs"]:
        newest = results["runs"][-1]
        print(f"\n{newest['bleu_signature']}\n{newest['chrf_signature']}")
        if "n_bootstrap" in newest:
            print(f"intervals: sacreBLEU's bootstrap, {newest['n_bootstrap']} resampled test sets, seed "
                  f"{newest['bootstrap_seed']}")


if __name__ == "__main__":
    main()
