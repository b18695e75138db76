"""The host's time per training step: the trainer's step on a model so small that its arithmetic is negligible.

    .venv/bin/python benchmarks/step_overhead.py                       # eager and compiled, fp32 and bf16
    .venv/bin/python benchmarks/step_overhead.py --no-compile --profile # where an eager step's time goes

On a GPU the ``gpu`` preset's step is host-bound: the device waits while Python, the dispatcher and
autograd issue the step's operations. That work hardly depends on the sizes, so it is measured here on
a minuscule model of the same structure (3 + 3 layers, 4 heads, tied embeddings, pre-norm, dropout;
``d_model=16``, ``d_ff=32``, vocabulary 1,000) and batches of a few short sentences. Each step is the
trainer's own (:func:`stepformer.translator.train.train_step`: the batch from a :class:`PaddedTable`,
autocast, the loss, backward, clipping, fused AdamW), on the GPU's path by default (``--path gpu``:
PyTorch's dropout and ``cross_entropy_sum``; ``--path cpu``: the CPU trainer's packed dropout and blocked
loss). On a CPU some arithmetic remains (dropout's random numbers, attention's unfused math path), so
the numbers are an upper bound of the host's share.

Prints, per precision, the median CPU milliseconds per step (this process's CPU time, one thread: on a
shared machine the wall clock also counts the waits for a core) over ``--repeats`` blocks of ``--steps``
steps, the variants' blocks alternated: eager with the shape checks off (as the trainer after its first
step), eager with them on (as every step before), and compiled as the trainer compiles
(:func:`stepformer.translator.model.compile_model`), with the first step's wall time, which compiles.
Also the ATen operations of one eager step (a ``TorchDispatchMode`` counter: forward, backward and
optimiser). ``--profile`` adds cProfile's top functions of the eager steps. Not a test.
"""

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import random
import statistics
import time
from collections import Counter
from dataclasses import replace

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # before stepformer is imported: jaxtyping reads it then

import jaxtyping  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from stepformer.runs import Distributed, commit, hardware  # noqa: E402
from stepformer.translator.batching import Encoded, PaddedTable, token_batches  # noqa: E402
from stepformer.translator.config import MODEL, TranslatorConfig  # noqa: E402
from stepformer.translator.fast import cross_entropy_sum, loss_for, swap_dropout  # noqa: E402
from stepformer.translator.model import build_model, compile_model  # noqa: E402
from stepformer.translator.train import make_optimizer, train_step  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
# The gpu preset's structure at a size where arithmetic costs nothing.
CONFIG = TranslatorConfig(model=replace(MODEL, vocab=1000, d_model=16, heads=4, layers=3, d_ff=32, dropout=0.3),
                          max_tokens=192, max_steps=1, precision="fp32")


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def synthetic_data(sentences: int = 400, seed: int = 0) -> Encoded:
    """Sentence pairs of 4 to 24 random tokens, so that batches come in several shapes, as real ones do."""
    rng = random.Random(seed)
    src = [[rng.randrange(3, CONFIG.model.vocab) for _ in range(rng.randint(4, 24))] for _ in range(sentences)]
    tgt = [[rng.randrange(3, CONFIG.model.vocab) for _ in range(rng.randint(4, 22))] for _ in range(sentences)]
    return Encoded(src, tgt)


class Trainer:
    """The trainer's objects for one variant, and a step over a fixed cycle of batches."""

    def __init__(self, precision: str, path: str, compiled: bool) -> None:
        torch.manual_seed(0)
        self.config = replace(CONFIG, precision=precision, compile=compiled)
        device = torch.device("cpu")
        model = build_model(self.config, CONFIG.model.vocab, PAD)
        self.loss_fn = loss_for(device)
        if path == "gpu":  # what a GPU step issues: PyTorch's dropout and the one-call loss
            model, self.loss_fn = swap_dropout(model, nn.Dropout), cross_entropy_sum
        self.model = model.train()
        self.forward = compile_model(model) if compiled else model
        self.optimizer = make_optimizer(model, self.config, device)
        self.amp = torch.bfloat16 if precision == "bf16" else None
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        data = synthetic_data()
        self.table = PaddedTable(data, PAD, BOS, EOS, device)
        self.batches = token_batches(data, CONFIG.max_tokens, 0, 0)
        self.indices = self.table.indices(self.batches)
        self.world = Distributed(device=device)
        self.i = 0

    def step(self) -> None:
        i = self.i % len(self.batches)
        self.i += 1
        train_step(self.forward, self.model, self.optimizer, self.scaler, self.table, self.batches[i], self.indices[i],
                   PAD, self.config, 1e-4, self.amp, self.loss_fn, self.world)

    def time_block(self, steps: int) -> float:
        """Milliseconds of this process's CPU time per step: on a shared machine, unlike the wall clock, it leaves
        out the time the process waits for a core (with one thread, the host's work is all of it)."""
        started = time.process_time()
        for _ in range(steps):
            self.step()
        return (time.process_time() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=7, help="timed blocks per variant, alternated")
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--path", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: the host's work alone, as on a GPU)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--profile", action="store_true", help="cProfile's top functions of the eager steps")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    modes = ("eager", "checked") if args.no_compile else ("eager", "checked", "compiled")
    print(f"# commit {commit()}, torch {torch.__version__}, {hardware(torch.device('cpu'))}, path {args.path}, "
          f"load average {os.getloadavg()[0]:.1f}")
    trainers, compile_s = {}, {}
    for precision in precisions:
        for mode in modes:
            trainer = Trainer(precision, args.path, mode == "compiled")
            started = time.perf_counter()
            trainer.step()  # the first call compiles (dynamic shapes: once for every batch shape)
            compile_s[precision, mode] = time.perf_counter() - started
            trainer.time_block(len(trainer.batches))  # every batch shape once more
            trainers[precision, mode] = trainer
    # The variants' blocks alternate, so that a neighbour's load on the shared cores falls on all of them alike.
    times = {key: [] for key in trainers}
    for _ in range(args.repeats):
        for (precision, mode), trainer in trainers.items():
            with checks(mode == "checked"):
                times[precision, mode].append(trainer.time_block(args.steps))
    labels = {"eager": "eager", "checked": "eager, shape checks on", "compiled": "compiled"}
    for (precision, mode), trainer in trainers.items():
        counter = OpCounter()
        with counter, checks(mode == "checked"):
            trainer.step()
        ops = f"{sum(counter.ops.values())} ATen ops/step" if mode != "compiled" else "ops not counted"
        first = f", first step {compile_s[precision, mode]:.1f} s (compiling)" if mode == "compiled" else ""
        print(f"{precision} {labels[mode]:<24} {statistics.median(times[precision, mode]):6.2f} CPU ms/step "
              f"(blocks {min(times[precision, mode]):.2f}-{max(times[precision, mode]):.2f}), {ops}{first}")
    if args.profile:
        for (precision, mode), trainer in trainers.items():
            if mode == "eager":
                profiler = cProfile.Profile()
                profiler.enable()
                trainer.time_block(args.steps)
                profiler.disable()
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
                print(f"\n## cProfile, {precision} eager, {args.steps} steps (tottime)\n" + out.getvalue())


@contextlib.contextmanager
def checks(enabled: bool):
    """jaxtyping's shape checks on or off for a block (the script starts with them off)."""
    jaxtyping.config.update("jaxtyping_disable", not enabled)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", True)


if __name__ == "__main__":
    main()
