"""Decoding speed: tokens/s with and without the KV-cache, for MHA, GQA and MQA, and the cache's bytes.

    .venv/bin/python benchmarks/decoding.py [--lengths 128 512] [--repeats 5] [--d-model 256] [--device cpu]
        [--results book/results/decoding.json]

A randomly initialised ``stepformer.Transformer`` (untrained: speed does not depend on the
weights) generates exactly ``length`` tokens greedily for a batch, once recomputing the whole
prefix at every step (``stepformer.transformer.generate``) and once with the KV-cache
(``stepformer.decoding.generate_cached``); the two must give the same tokens, which the script
checks. Attention runs with ``kv_heads`` = heads (MHA), a middle value (GQA) and 1 (MQA). The
cache's bytes are measured on the actual tensors after decoding and compared with the formula
2 · layers · kv_heads · d_head · length · batch · bytes per element. Not a test: it prints a table,
and with ``--results`` writes its rows, settings and provenance where chapter 09 reads them.

Each model is warmed up first (a short run of both paths). The cached path is timed
``--repeats`` times and the median kept; the uncached one, minutes long at 512 tokens, runs
``--uncached-repeats`` times (default once). The runtime shape checks (jaxtyping with beartype)
are switched off for the timed runs: they cost a fixed few milliseconds per call, which on a
CPU is as much as a cached step itself and would hide the cache's speed-up. The library reads
``JAXTYPING_DISABLE`` when it is imported, so the script sets it before importing stepformer.
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # before stepformer is imported: jaxtyping reads it then

import jaxtyping  # noqa: E402
import torch  # noqa: E402

from stepformer.decoding import generate_cached  # noqa: E402
from stepformer.kvcache import cache_bytes, new_cache  # noqa: E402
from stepformer.parts import ModelConfig, configured_transformer  # noqa: E402
from stepformer.runs import commit, hardware  # noqa: E402
from stepformer.transformer import Transformer, generate  # noqa: E402

BOS, NEVER = 1, -1  # an end-of-sequence id that argmax cannot produce: every run makes `length` tokens


def timed(fn, device: str, repeats: int = 1) -> tuple[float, object]:
    """The median seconds of ``repeats`` calls of ``fn``, and the last call's result."""
    seconds = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def self_attention_cache_bytes(model: Transformer, src: torch.Tensor, length: int) -> int:
    """Decode ``length`` tokens with a cache and add up the bytes of the self-attention keys and values."""
    cache = new_cache(len(model.decoder.layers))
    with torch.no_grad():
        memory = model.encode(src)
        tokens = torch.full((src.shape[0], 1), BOS, device=src.device)
        for _ in range(length):
            hidden = model.decode(tokens, memory, None, None, cache)
            tokens = model.generator(hidden[:, -1]).argmax(-1, keepdim=True)
    return sum(layer.self_attn.nbytes for layer in cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--gqa-kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=3, help="encoder layers = decoder layers")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the cached path (median kept)")
    parser.add_argument("--uncached-repeats", type=int, default=1, help="timed runs of the uncached path")
    parser.add_argument("--no-uncached", action="store_true", help="skip the (slow) runs without a cache")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--results", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []

    torch.manual_seed(0)
    src = torch.randint(2, args.vocab, (args.batch, args.src_len), device=args.device)
    d_head = args.d_model // args.heads
    print(f"d_model={args.d_model} heads={args.heads} layers={args.layers}+{args.layers} vocab={args.vocab} "
          f"batch={args.batch} src_len={args.src_len} device={args.device} threads={torch.get_num_threads()}")
    checks = "off (JAXTYPING_DISABLE=1)" if jaxtyping.config.jaxtyping_disable else "on"
    print(f"runtime shape checks {checks}; after a warm-up, median of {args.repeats} cached runs and "
          f"{args.uncached_repeats} uncached run(s) per row")
    print("| attention | kv_heads | tokens | no cache: tokens/s | cache: tokens/s | speedup | "
          "cache bytes (measured) | formula |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, kv_heads in (("MHA", args.heads), ("GQA", args.gqa_kv_heads), ("MQA", 1)):
        config = ModelConfig.original(args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers,
                                      d_ff=4 * args.d_model, dropout=0.0, kv_heads=kv_heads)
        model = configured_transformer(config).to(args.device).eval()
        # Warm-up: the first calls pay for allocations and kernel choices that later ones reuse.
        generate_cached(model, src, 16, BOS, NEVER)
        if not args.no_uncached:
            generate(model, src, 16, BOS, NEVER)
        for length in args.lengths:
            produced = args.batch * length
            cached_s, (cached_tokens, _) = timed(
                lambda m=model, n=length: generate_cached(m, src, n, BOS, NEVER), args.device, args.repeats)
            if args.no_uncached:
                plain = "-"
                speedup = "-"
            else:
                plain_s, (plain_tokens, _) = timed(lambda m=model, n=length: generate(m, src, n, BOS, NEVER),
                                                   args.device, args.uncached_repeats)
                if not torch.equal(plain_tokens, cached_tokens):
                    raise RuntimeError(f"{label}, {length} tokens: cached and uncached decoding differ")
                plain, speedup = f"{produced / plain_s:.0f}", f"{plain_s / cached_s:.1f}x"
            measured = self_attention_cache_bytes(model, src, length)
            formula = cache_bytes(args.layers, kv_heads, d_head, length, args.batch, 4)
            print(f"| {label} | {kv_heads} | {length} | {plain} | {produced / cached_s:.0f} | {speedup} | "
                  f"{measured:,} | {formula:,} |")
            rows.append({"attention": label, "kv_heads": kv_heads, "tokens": length,
                         "no_cache_tokens_per_s": None if args.no_uncached else round(produced / plain_s),
                         "cache_tokens_per_s": round(produced / cached_s),
                         "speedup": None if args.no_uncached else round(plain_s / cached_s, 1),
                         "cache_bytes": measured})
    if args.results:
        record = {
            "source": "benchmarks/decoding.py " + shlex.join(sys.argv[1:]), "commit": commit(),
            "date": datetime.date.today().isoformat(),
            "hardware": hardware(torch.device(args.device)),
            "torch": torch.__version__,
            "settings": {"d_model": args.d_model, "heads": args.heads, "layers": f"{args.layers} + {args.layers}",
                         "batch": args.batch, "dtype": "float32", "shape_checks": False,
                         "cached_repeats": args.repeats, "uncached_repeats": args.uncached_repeats},
            "rows": rows,
        }
        args.results.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
