"""Activation checkpointing on chapter 07's encoder: the memory it saves and the time it costs.

    .venv/bin/python benchmarks/checkpointing.py [--layers 2 4 8 16] [--at-length 256] [--lengths 128 256 512 1024]
                                                 [--at-layers 4] [--d-model 256] [--heads 4] [--d-ff 1024]
                                                 [--batch 8] [--repeats 5] [--out PATH]
    .venv/bin/python benchmarks/checkpointing.py --layers 1 2 --at-layers 1 --lengths 16 32 --at-length 32 \
        --d-model 32 --d-ff 64 --repeats 1                                                   # seconds

``stepformer.encoder.Encoder`` in training mode (dropout 0.1, post-norm, chapter 03's attention)
runs forward and backward on a batch of random vectors (no padding; the output's gradient is
given), once as it is and once through ``stepformer.scale.checkpointed_encoder``, which keeps
only each layer's input for the backward pass and runs the layer's forward again there. The
configurations: each of ``--layers`` at ``--at-length`` positions, and each of ``--lengths`` at
``--at-layers`` layers. Per configuration: the median wall time of ``--repeats`` forward +
backward passes after one warm-up, the two ways taking turns; then one more pass of each,
counted by ``stepformer.scale.LiveBytes`` (the tensors that operations return, once per storage,
until freed): the peak over forward and backward, and the bytes still alive when the forward
has returned, which is what autograd saved for the backward (and the output); the weights and
the input, made before, are not counted. The first configuration also checks that
both ways give the same output and gradients. The runtime shape checks (jaxtyping with
beartype) are off: the script sets ``JAXTYPING_DISABLE=1`` before importing stepformer. ``--out``
writes the rows with the settings and provenance (commit, hardware, date, the 1-minute load
average before and after the run, wall time) as JSON. Not a test.
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

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from stepformer.encoder import Encoder, build_encoder  # noqa: E402
from stepformer.runs import (  # noqa: E402
    commit,
    hardware,
    save_json,  # noqa: E402
)
from stepformer.scale import LiveBytes, checkpointed_encoder  # noqa: E402

WAYS = {"plain": lambda encoder, x: encoder(x), "checkpointed": checkpointed_encoder}


def forward_backward(way: str, encoder: Encoder, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    encoder.zero_grad(set_to_none=True)
    out = WAYS[way](encoder, x)
    out.backward(grad_out)
    return out


def counted(way: str, encoder: Encoder, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[int, int]:
    """The peak bytes over one forward + backward, and the bytes alive right after the forward."""
    encoder.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        out = WAYS[way](encoder, x)
        saved = live.now
        out.backward(grad_out)
        del out
    return live.peak, saved


def same_results(encoder: Encoder, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    """Both ways give the same output and parameter gradients (dropout replays its masks), or the script stops."""
    results = []
    for way in WAYS:
        torch.manual_seed(1)
        out = forward_backward(way, encoder, x, grad_out)
        results.append([out.detach(), *(p.grad.clone() for p in encoder.parameters())])
    for plain, checkpointed in zip(*results, strict=True):
        if not torch.allclose(plain, checkpointed, atol=1e-5, rtol=1e-4):
            raise RuntimeError(f"checkpointed and plain differ: max {(plain - checkpointed).abs().max().item():.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16], help="depths, at --at-length")
    parser.add_argument("--at-length", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024], help="at --at-layers")
    parser.add_argument("--at-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per way after one warm-up (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, nargs="?", const=Path("book/results/checkpointing.json"), default=None,
                        help="write the results as JSON (default path: book/results/checkpointing.json)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    configs = [(layers, args.at_length) for layers in args.layers]
    configs += [(args.at_layers, n) for n in args.lengths if (args.at_layers, n) not in configs]

    rows = []
    bar = tqdm(total=len(configs) * (args.repeats + 1), file=sys.stderr, disable=args.no_progress,
               dynamic_ncols=True, unit="pass pair")
    for i, (layers, length) in enumerate(configs):
        bar.set_postfix_str(f"{layers} layers, length {length}")
        torch.manual_seed(args.seed)
        encoder = build_encoder(args.d_model, args.heads, args.d_ff, layers, dropout=args.dropout).train()
        x = torch.randn(args.batch, length, args.d_model)
        grad_out = torch.randn(args.batch, length, args.d_model)
        if i == 0:
            same_results(encoder, x, grad_out)
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        for repeat in range(args.repeats + 1):  # the first is the warm-up
            for way in WAYS:  # taking turns: a machine that slows down slows both alike
                began = time.perf_counter()
                forward_backward(way, encoder, x, grad_out)
                if repeat:
                    seconds[way].append(time.perf_counter() - began)
            bar.update()
        row = {"layers": layers, "length": length, "d_model": args.d_model, "batch": args.batch}
        row |= {f"{way}_ms": round(statistics.median(seconds[way]) * 1000, 3) for way in WAYS}
        for way in WAYS:
            row[f"{way}_peak_bytes"], row[f"{way}_saved_bytes"] = counted(way, encoder, x, grad_out)
        rows.append(row)
    bar.close()
    load_after = os.getloadavg()[0]
    wall = time.perf_counter() - started

    where = hardware(torch.device("cpu"))
    print(f"stepformer.encoder.Encoder, train mode (dropout {args.dropout}): d_model {args.d_model}, {args.heads} "
          f"heads, d_ff {args.d_ff}, batch {args.batch}, float32; {where}, torch {torch.__version__}; load average "
          f"{load_before:.2f} before the run, {load_after:.2f} after; runtime shape checks off; forward + backward, "
          f"median of {args.repeats} after 1 warm-up, the two ways taking turns; {wall / 60:.1f} min in all")
    print("memory in MiB counted by LiveBytes (weights and input, made before, not counted): peak over forward + "
          "backward, and alive after the forward (saved for backward, and the output)\n")
    print("| layers | length | plain ms | checkpointed ms | time ratio | plain peak | checkpointed peak | peak ratio "
          "| plain saved | checkpointed saved | saved ratio |")
    print("| --- " * 11 + "|")
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    for r in rows:
        print(f"| {r['layers']} | {r['length']} | {r['plain_ms']:.1f} | {r['checkpointed_ms']:.1f} | "
              f"{r['checkpointed_ms'] / r['plain_ms']:.2f} | {mib(r['plain_peak_bytes'])} | "
              f"{mib(r['checkpointed_peak_bytes'])} | {r['checkpointed_peak_bytes'] / r['plain_peak_bytes']:.2f} | "
              f"{mib(r['plain_saved_bytes'])} | {mib(r['checkpointed_saved_bytes'])} | "
              f"{r['checkpointed_saved_bytes'] / r['plain_saved_bytes']:.2f} |")

    if args.out is not None:
        results = {
            "command": "benchmarks/checkpointing.py " + shlex.join(sys.argv[1:]), "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "hardware": where,
            "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__, "seed": args.seed,
            "load_before": load_before, "load_after": load_after, "wall_s": round(wall, 1),
            "settings": {"d_model": args.d_model, "heads": args.heads, "d_ff": args.d_ff, "batch": args.batch,
                         "dropout": args.dropout, "layers": args.layers, "at_length": args.at_length,
                         "lengths": args.lengths, "at_layers": args.at_layers,
                         "repeats": args.repeats, "dtype": "float32"},
            "memory_counter": "LiveBytes (new tensors returned by operations)",
            "rows": rows,
        }
        save_json(results, args.out)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
