"""The translator's speed, all in one run: training throughput against ``torch.nn.Transformer``, model FLOP
utilisation against this machine's measured matrix-multiply peak, with and without ``torch.compile``, and
decoding ``test_2016_flickr`` with beam search with and without the KV-cache.

    .venv/bin/python benchmarks/translator_speed.py --checkpoint runs/cpu-de-en/averaged.pt \\
        --data-dir ../shared/data/multi30k [--results book/results/translator.json]

Training: the ``cpu`` preset's model (or the checkpoint's settings) and the same real Multi30k
batches (``max_tokens`` padded positions each) for every model; one step is the trainer's
(autocast as the preset says, the fused label-smoothed loss, clipping, AdamW). ``torch.nn.Transformer``
gets the same embeddings, tied as ours are, the same generator and the same dropout, so both have
the same parameters and arithmetic; the script checks the counts. A last row runs our model with
chapter 11's plain ``label_smoothed_loss`` and ``nn.Dropout``: what ``stepformer.translator.fast``
is worth. FLOPs of one step are counted from the
shapes by ``torch.utils.flop_counter`` (forward and backward); utilisation is achieved FLOP/s over
the peak of a large matrix product in the same precision, measured here first. Decoding: every
test sentence, beam 4, with and without the cache; the script checks that the translations are
the same and prints the share that are. Not a test.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # before stepformer is imported: jaxtyping reads it then

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_step import TorchModel  # noqa: E402

from stepformer.runs import commit, hardware  # noqa: E402
from stepformer.translator.batching import collate, encode_pairs, token_batches  # noqa: E402
from stepformer.translator.config import autocast_dtype, pick_device, preset  # noqa: E402
from stepformer.translator.data import load_split  # noqa: E402
from stepformer.translator.evaluate import Translator  # noqa: E402
from stepformer.translator.fast import fused_label_smoothed_loss, packed_dropout, swap_dropout  # noqa: E402
from stepformer.translator.model import build_model  # noqa: E402
from stepformer.translator.recipe import label_smoothed_loss  # noqa: E402
from stepformer.translator.tokenizer import SubwordTokenizer  # noqa: E402
from stepformer.translator.train import make_optimizer  # noqa: E402


def matmul_peak(dtype: torch.dtype | None, device: torch.device, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of the best of ``repeats`` products of two ``size`` × ``size`` matrices in ``dtype``."""
    a = torch.randn(size, size, device=device, dtype=dtype or torch.float32)
    b = torch.randn(size, size, device=device, dtype=dtype or torch.float32)
    best = float("inf")
    for _ in range(repeats + 2):
        started = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def step_fn(model, optimizer, amp, device, config, pad_id, loss_fn=fused_label_smoothed_loss):
    def step(src, tgt):
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            logits = model(src, tgt[:, :-1])
        loss = loss_fn(logits, tgt[:, 1:], pad_id, config.label_smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def tied_torch_model(ours, config):
    model = config.model
    theirs = TorchModel(ours, model.d_model, model.heads, model.layers, model.d_ff, model.dropout,
                        norm_first=model.placement == "pre")
    theirs.generator.weight = theirs.tgt_embed.tokens.weight
    theirs.embed.tokens.weight = theirs.tgt_embed.tokens.weight
    return theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a trained translator, for the decoding part")
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--batches", type=int, default=12, help="timed training steps per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--results", type=Path, help="merge the numbers into this JSON file under 'speed'")
    args = parser.parse_args()
    device = pick_device()
    config = Translator.load(args.checkpoint).config if args.checkpoint else preset("cpu")
    amp = autocast_dtype(config.precision, device)
    started_all = time.perf_counter()
    report = {"hardware": hardware(device), "torch": torch.__version__, "autocast": str(amp), "commit": commit(),
              "checkpoint": str(args.checkpoint) if args.checkpoint else None}

    peak = matmul_peak(amp, device)
    report["matmul_peak_tflops"] = round(peak / 1e12, 3)
    print(f"{hardware(device)}; autocast {amp}; measured matmul peak {peak / 1e12:.2f} TFLOP/s (2048², best of 10)")

    src_text, tgt_text = load_split("train", config.src_lang, config.tgt_lang, args.data_dir, progress=False)
    tokenizer = SubwordTokenizer.train(src_text + tgt_text, config.model.vocab)
    data = encode_pairs(tokenizer, src_text, tgt_text, config.model.max_len)
    batches = token_batches(data, config.max_tokens, config.seed, 0)[: args.warmup + args.batches]
    tensors = [tuple(t.to(device) for t in collate(data, b, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id))
               for b in batches]

    torch.manual_seed(0)
    ours = build_model(config, tokenizer.vocab_size, tokenizer.pad_id).to(device)
    # The same dropout for both (fast.PackedDropout where the trainer uses it), so that the rows compare models.
    theirs = tied_torch_model(ours, config).to(device)
    if config.packed_dropout:
        packed_dropout(theirs)
    counts = {n: sum(p.numel() for p in m.parameters()) for n, m in (("ours", ours), ("torch", theirs))}
    if counts["ours"] != counts["torch"]:
        raise RuntimeError(f"the models differ in size: {counts}")
    compiled = build_model(config, tokenizer.vocab_size, tokenizer.pad_id).to(device)
    # Back to nn.Dropout, the fused attention and norms kept.
    plain = swap_dropout(build_model(config, tokenizer.vocab_size, tokenizer.pad_id), torch.nn.Dropout).to(device)
    models = {"torch.nn.Transformer": theirs, "stepformer.Transformer": ours,
              "stepformer.Transformer, torch.compile": compiled,
              "stepformer.Transformer, plain dropout and loss": plain}
    steps = {}
    for name, model in models.items():
        optimizer = make_optimizer(model, config, device)
        forward = torch.compile(model, dynamic=True) if "compile" in name else model
        # The last row: chapter 11's label_smoothed_loss and nn.Dropout, to show what fast.py is worth.
        loss_fn = label_smoothed_loss if "plain" in name else fused_label_smoothed_loss
        steps[name] = step_fn(forward, optimizer, amp, device, config, tokenizer.pad_id, loss_fn)
        model.train()

    # FLOPs of each batch's step, counted once (the same for every model: same arithmetic).
    flops = []
    for src, tgt in tensors:
        with FlopCounterMode(display=False) as counter:
            steps["stepformer.Transformer"](src, tgt)
        flops.append(counter.get_total_flops())
    times: dict[str, list[float]] = {name: [] for name in models}
    tokens = [int((s != tokenizer.pad_id).sum() + (t[:, 1:] != tokenizer.pad_id).sum()) for s, t in tensors]
    for i, (src, tgt) in enumerate(tensors):  # the models take turns on each batch
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(src, tgt)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - started)
    timed = slice(args.warmup, None)
    rows = []
    for name in models:
        seconds = sum(times[name])
        rows.append({"model": name, "tokens_per_s": round(sum(tokens[timed]) / seconds),
                     "ms_per_step": round(1000 * statistics.median(times[name]), 1),
                     "tflops": round(sum(flops[timed]) / seconds / 1e12, 3),
                     "mfu": round(sum(flops[timed]) / seconds / peak, 3)})
    reference = rows[0]["tokens_per_s"]
    print(f"\ntraining: {len(tensors) - args.warmup} real batches (max_tokens {config.max_tokens}) after "
          f"{args.warmup} warm-up, {counts['ours']:,} parameters, source + target tokens counted")
    print("| model | tokens/s | vs torch.nn.Transformer | median ms/step | TFLOP/s | MFU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['tokens_per_s']:,} | {r['tokens_per_s'] / reference:.2f} | {r['ms_per_step']} | "
              f"{r['tflops']:.3f} | {100 * r['mfu']:.1f}% |")
    report["training"] = rows

    if args.checkpoint:
        translator = Translator.load(args.checkpoint, device)
        sources, _ = load_split("test_2016_flickr", translator.config.src_lang, translator.config.tgt_lang,
                                args.data_dir, progress=False)
        decoding = {}
        for use_cache in (True, False):
            started = time.perf_counter()
            out = translator.translate(sources, beam=4, use_cache=use_cache)
            decoding[use_cache] = (time.perf_counter() - started, out)
        same = sum(a == b for a, b in zip(decoding[True][1], decoding[False][1], strict=True)) / len(sources)
        speedup = decoding[False][0] / decoding[True][0]
        print(f"\ndecoding test_2016_flickr ({len(sources)} sentences), beam 4, {args.checkpoint}:")
        print("| KV-cache | seconds | sentences/s | speedup |")
        print("| --- | --- | --- | --- |")
        for use_cache in (False, True):
            seconds = decoding[use_cache][0]
            print(f"| {'yes' if use_cache else 'no'} | {seconds:.1f} | {len(sources) / seconds:.1f} | "
                  f"{decoding[False][0] / seconds:.2f}x |")
        print(f"identical translations with and without the cache: {100 * same:.1f}%")
        report["decoding"] = {"sentences": len(sources), "beam": 4, "seconds_with_cache": round(decoding[True][0], 1),
                              "seconds_without_cache": round(decoding[False][0], 1), "speedup": round(speedup, 2),
                              "identical": same}
    report["wall_minutes"] = round((time.perf_counter() - started_all) / 60, 1)
    print(f"\ncommit {report['commit']}; {report['wall_minutes']} minutes in all")
    if args.results:
        existing = json.loads(args.results.read_text()) if args.results.is_file() else {}
        existing["speed"] = report
        args.results.write_text(json.dumps(existing, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
