"""Attention against sequence length: time, memory and FLOPs of the naive, fused and tiled computations.

    .venv/bin/python benchmarks/attention_scale.py [--lengths 256 512 ... 8192] [--heads 4] [--d-head 64]
                                                   [--block 128] [--repeats 3] [--device cpu] [--out PATH]
    .venv/bin/python benchmarks/attention_scale.py --lengths 64 128 --heads 2 --repeats 1   # seconds

One attention core, softmax(q kᵀ / sqrt(d_head)) v over ``heads`` heads of a batch of 1, with
q, k and v of ``n`` positions each, three ways:

- ``naive``: chapter 01's ``stepformer.attention.scaled_dot_product_attention``, which holds the
  ``(n, n)`` scores and weights of every head; causal with chapter 02's ``causal_mask``, made in the
  measured call;
- ``fused``: ``torch.nn.functional.scaled_dot_product_attention`` (``is_causal=True`` when causal);
- ``tiled``: chapter 13's ``stepformer.scale.tiled_attention`` in blocks of ``--block`` queries and
  keys (``causal=True`` skips the blocks above the diagonal); forward and backward through
  ``stepformer.scale.flash_attention``, whose backward recomputes the weights block by block.

Each runs forward only (inputs without gradients) and forward + backward (the output's gradient
given, the inputs' gradients computed; naive and fused through autograd). Per row: the median wall
time of ``--repeats`` calls after one warm-up call, the methods taking turns call by call (so that
a machine that slows down for a while slows all three alike), then one more call with memory and
FLOPs counted. Memory is the peak of the bytes that the call itself allocated, inputs not included: on a
CPU counted by ``stepformer.scale.LiveBytes`` (every new tensor an operation returns, once per
storage, until it is freed; views of the inputs are not new; scratch space inside a kernel is not
seen), on a GPU
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was allocated
before. FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode``; it has no formula for
PyTorch's fused CPU kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward) and counts 0 for them, so where it counts nothing the tables give the naive
computation's count in brackets and the results file ``null``. The naive count is that of full
matrix products, causal or not; the tiled one counts only the blocks it visits. Then, per
method, the slopes of log(time) and log(memory) against log(n) by least squares over the lengths
from ``--fit-from`` up: 2 for a cost that grows as n², 1 for one that grows as n.

At the first length the script checks that the three agree (outputs, and the inputs' gradients).
The runtime shape checks (jaxtyping with beartype) are off: the script sets ``JAXTYPING_DISABLE=1``
before importing stepformer. ``--out`` writes the rows, slopes, settings and provenance (commit,
hardware, date, the 1-minute load average before and after the run, wall time) as JSON. Not a test.
"""

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # before stepformer is imported: jaxtyping reads it then

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from tqdm import tqdm  # noqa: E402

from stepformer.attention import scaled_dot_product_attention  # noqa: E402
from stepformer.masks import causal_mask  # noqa: E402
from stepformer.runs import (  # noqa: E402
    commit,
    hardware,
    save_json,  # noqa: E402
)
from stepformer.scale import LiveBytes, flash_attention, tiled_attention  # noqa: E402

METHODS = ("naive", "fused", "tiled")
PASSES = ("forward", "forward+backward")
UNCOUNTED = "FlopCounterMode counts 0 for this kernel"


def attention(method: str, causal: bool, block: int):
    """The attention core of ``method``: a function of (q, k, v) that returns the output."""
    if method == "naive":
        def naive(q, k, v):
            mask = causal_mask(q.shape[-2], device=q.device) if causal else None
            return scaled_dot_product_attention(q, k, v, mask)[0]
        return naive
    if method == "fused":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda q, k, v: tiled_attention(q, k, v, causal=causal, block_q=block, block_k=block)[0]


def one_pass(method: str, kind: str, causal: bool, block: int, q, k, v, grad_out):
    """One call of the measured work: forward, or forward and backward (the inputs' gradients left in ``.grad``)."""
    if kind == "forward":
        return lambda: attention(method, causal, block)(q, k, v)
    if method == "tiled":  # the recomputing backward; autograd through tiled_attention would store every block
        forward = lambda q, k, v: flash_attention(q, k, v, causal=causal, block_q=block, block_k=block)  # noqa: E731
    else:
        forward = attention(method, causal, block)

    def forward_backward():
        for x in (q, k, v):
            x.grad = None
        forward(q, k, v).backward(grad_out)
    return forward_backward


def inputs(heads: int, length: int, d_head: int, device: str, seed: int, grad: bool):
    """q, k, v of shape (1, heads, length, d_head) and the output's gradient, the same for every method."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(1, heads, length, d_head, generator=g).to(device) for _ in range(4))
    return (*(x.requires_grad_(grad) for x in (q, k, v)), grad_out)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(call, device: str) -> float:
    """The seconds of one call."""
    sync(device)
    started = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - started


def counted(call, device: str) -> tuple[int, int]:
    """The peak bytes that one call allocated beyond what was alive before it, and the FLOPs counted."""
    flops = FlopCounterMode(display=False)
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with flops:
            call()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before, flops.get_total_flops()
    with LiveBytes() as live, flops:
        call()
    return live.peak, flops.get_total_flops()


def agree(heads: int, length: int, d_head: int, device: str, seed: int, block: int) -> None:
    """The three methods give the same outputs and gradients, causal or not, or the script stops."""
    for causal in (False, True):
        results = {}
        for method in METHODS:
            q, k, v, grad_out = inputs(heads, length, d_head, device, seed, grad=True)
            one_pass(method, "forward+backward", causal, block, q, k, v, grad_out)()
            with torch.no_grad():
                results[method] = [attention(method, causal, block)(q, k, v), q.grad, k.grad, v.grad]
        for method in ("fused", "tiled"):
            for name, ours, reference in zip(("output", "dq", "dk", "dv"), results[method], results["naive"],
                                             strict=True):
                if not torch.allclose(ours, reference, atol=1e-4, rtol=1e-4):
                    error = (ours - reference).abs().max().item()
                    raise RuntimeError(f"{method} and naive differ in {name} (causal={causal}): max error {error:.2e}")


def slope(lengths: list[int], values: list[float]) -> float | None:
    """The least-squares slope of log(value) against log(length); None below two points."""
    if len(lengths) < 2:
        return None
    return float(np.polyfit(np.log(lengths), np.log(values), 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="sequence lengths (default 256 ... 8192 on a CPU, 256 ... 32768 on a GPU)")
    parser.add_argument("--naive-max", type=int, default=None,
                        help="the longest length the naive method runs at (default 8192 on a CPU, 16384 on a GPU)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--block", type=int, default=128, help="the tiled method's query and key block")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row after one warm-up (median kept)")
    parser.add_argument("--fit-from", type=int, default=1024, help="the shortest length in the slopes' fit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, nargs="?", const=Path("book/results/attention_scale.json"), default=None,
                        help="write the results as JSON (default path: book/results/attention_scale.json)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gpu = args.device.startswith("cuda")
    lengths = args.lengths or [256 * 2**i for i in range(8 if gpu else 6)]
    naive_max = args.naive_max or (16384 if gpu else 8192)
    device = torch.device(args.device)
    if gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    agree(2, min(lengths), args.d_head, args.device, args.seed, args.block)

    groups = [(kind, causal, n, [m for m in METHODS if m != "naive" or n <= naive_max])
              for kind in PASSES for causal in (False, True) for n in lengths]
    rows = []
    bar = tqdm(total=sum(len(methods) for *_, methods in groups) * (args.repeats + 2), unit="call", file=sys.stderr,
               disable=args.no_progress, dynamic_ncols=True)
    for kind, causal, n, methods in groups:
        bar.set_postfix_str(f"{kind}, {'causal' if causal else 'not causal'}, n={n}")
        q, k, v, grad_out = inputs(args.heads, n, args.d_head, args.device, args.seed, grad=kind != "forward")
        calls = {m: one_pass(m, kind, causal, args.block, q, k, v, grad_out) for m in methods}
        seconds: dict[str, list[float]] = {m: [] for m in methods}
        for repeat in range(args.repeats + 1):  # the first is the warm-up: it pays for allocations that later reuse
            for method, call in calls.items():  # taking turns: a machine that slows down slows all alike
                elapsed = timed(call, args.device)
                if repeat:
                    seconds[method].append(elapsed)
                bar.update()
        for method, call in calls.items():
            for x in (q, k, v):
                x.grad = None  # freed before the counted call, so that the GPU's count starts without them
            peak, flops = counted(call, args.device)
            rows.append({"method": method, "pass": kind, "causal": causal, "length": n,
                         "median_ms": statistics.median(seconds[method]) * 1000, "peak_bytes": peak,
                         "flops": flops or None})
            bar.update()
        del q, k, v, grad_out, calls
    bar.close()
    load_after = os.getloadavg()[0]

    slopes = []
    for kind in PASSES:
        for causal in (False, True):
            for method in METHODS:
                fit = [r for r in rows if (r["method"], r["pass"], r["causal"]) == (method, kind, causal)
                       and r["length"] >= args.fit_from]
                slopes.append({"method": method, "pass": kind, "causal": causal,
                               "lengths": [r["length"] for r in fit],
                               "time": slope([r["length"] for r in fit], [r["median_ms"] for r in fit]),
                               "memory": slope([r["length"] for r in fit], [r["peak_bytes"] for r in fit])})
    wall = time.perf_counter() - started

    where = hardware(device)
    print(f"attention core: batch 1, {args.heads} heads, d_head {args.d_head}, float32; tiled blocks "
          f"{args.block} x {args.block}; {where}, torch {torch.__version__}; load average {load_before:.2f} before "
          f"the run, {load_after:.2f} after; runtime shape checks off; median of {args.repeats} calls after 1 "
          "warm-up, the methods taking turns; "
          f"{wall / 60:.1f} min in all")
    memory = ("LiveBytes (new tensors returned by operations)" if not gpu
              else "torch.cuda.max_memory_allocated (less what was allocated before the call)")
    print(f"peak memory: bytes allocated by the call beyond its inputs, by {memory}, in MiB; GFLOP counted by "
          "FlopCounterMode" + ("; [x]: it counts 0 for PyTorch's fused CPU kernel, x is the naive computation's count"
                               if any(r["flops"] is None for r in rows) else ""))
    naive_flops = {(r["pass"], r["causal"], r["length"]): r["flops"] for r in rows if r["method"] == "naive"}
    for kind in PASSES:
        for causal in (False, True):
            print(f"\n{kind}, {'causal' if causal else 'not causal'}:\n")
            print("| n | " + " | ".join(f"{m} ms" for m in METHODS) + " | "
                  + " | ".join(f"{m} MiB" for m in METHODS) + " | " + " | ".join(f"{m} GFLOP" for m in METHODS) + " |")
            print("| --- " * (1 + 3 * len(METHODS)) + "|")
            for n in lengths:
                found = {r["method"]: r for r in rows if (r["pass"], r["causal"], r["length"]) == (kind, causal, n)}
                times = [f"{found[m]['median_ms']:.1f}" if m in found else "-" for m in METHODS]
                peaks = [f"{found[m]['peak_bytes'] / 2**20:.1f}" if m in found else "-" for m in METHODS]
                counts = []
                for m in METHODS:
                    if m not in found:
                        counts.append("-")
                    elif found[m]["flops"] is not None:
                        counts.append(f"{found[m]['flops'] / 1e9:.2f}")
                    elif naive_flops.get((kind, causal, n)) is not None:
                        counts.append(f"[{naive_flops[kind, causal, n] / 1e9:.2f}]")
                    else:
                        counts.append("0")
                print(f"| {n} | " + " | ".join(times + peaks + counts) + " |")
    print(f"\nslopes of log(time) and log(peak memory) against log(n), least squares over n >= {args.fit_from}:\n")
    print("| method | pass | causal | lengths | time slope | memory slope |\n| --- | --- | --- | --- | --- | --- |")
    for s in slopes:
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        span = f"{s['lengths'][0]}-{s['lengths'][-1]}" if s["lengths"] else "-"
        print(f"| {s['method']} | {s['pass']} | {'yes' if s['causal'] else 'no'} | {span} | {fmt(s['time'])} | "
              f"{fmt(s['memory'])} |")

    if args.out is not None:
        results = {
            "command": "benchmarks/attention_scale.py " + shlex.join(sys.argv[1:]), "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "hardware": where,
            "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "seed": args.seed, "load_before": load_before, "load_after": load_after, "wall_s": round(wall, 1),
            "settings": {"batch": 1, "heads": args.heads, "d_head": args.d_head, "block": args.block,
                         "lengths": lengths, "naive_max": naive_max, "repeats": args.repeats,
                         "fit_from": args.fit_from, "dtype": "float32"},
            "memory_counter": memory,
            "flops_note": (None if gpu else f"fused rows have flops null: {UNCOUNTED} "
                           "(aten._scaled_dot_product_flash_attention_for_cpu and its backward)"),
            "rows": [{**r, "median_ms": round(r["median_ms"], 3)} for r in rows],
            "slopes": [{k: (round(x, 3) if isinstance(x, float) else x) for k, x in s.items()} for s in slopes],
        }
        save_json(results, args.out)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
