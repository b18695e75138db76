"""Run plumbing shared by chapter 11's translator and chapter 12's language models: everything around a step.

A chapter brings its data and one optimiser step; :func:`training_loop` runs that step over the
epochs' batches until the budget (steps, epochs or minutes, :class:`Budget`) is spent, resuming
from a :class:`Position`. Around it: the processes of a ``torchrun`` run (:class:`Distributed`),
their random states, checkpoints (written atomically, the last N kept, loaded with clear errors,
averaged), the progress bar, the metrics log (JSON lines) and the provenance of every result
(:func:`commit`, :func:`hardware`). Nothing here knows a model, a tokenizer or a chapter.
"""

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple, Protocol, TypeVar

import jaxtyping
import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

CHECKPOINT_FORMAT = 1


# -- provenance ---------------------------------------------------------------------------------------------


def commit(folder: Path | None = None) -> str:
    """The course's git commit (``$STEPFORMER_COMMIT`` if set; ``unknown`` outside a checkout), kept with results.

    ``+dirty`` marks a working tree that differs from it: a changed file, or a new one that git does
    not ignore. Changes under ``book/results/`` do not count: they are what the benchmarks write,
    and a benchmark that scores two runs one after the other would otherwise mark the second dirty
    with the first one's results. ``folder``: any folder of the checkout (default: this package's).
    """
    if os.environ.get("STEPFORMER_COMMIT"):  # a copy of the tree sent elsewhere says which commit it was
        return os.environ["STEPFORMER_COMMIT"]
    folder = folder or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ":(top)", ":(top,exclude)book/results"],
                               cwd=folder, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.stdout.strip() + ("+dirty" if dirty else "")) if out.returncode == 0 else "unknown"


def hardware(device: torch.device) -> str:
    """The device, in words: the GPU's name, or the CPU's model and the threads used."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {torch.get_num_threads()} threads"


# -- the budget ----------------------------------------------------------------------------------------------


class HasBudget(Protocol):
    """A :class:`Budget`, or any settings with its three fields (chapter 11's ``TranslatorConfig``)."""

    max_steps: int | None
    max_epochs: int | None
    max_minutes: float | None


@dataclass(frozen=True)
class Budget:
    """When a training phase stops: whichever of the limits comes first (``None``: no limit of that kind)."""

    max_steps: int | None = None
    max_minutes: float | None = None
    max_epochs: int | None = None

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_minutes is None and self.max_epochs is None:
            raise ValueError("a training phase needs a budget: steps, minutes or epochs")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"the budget in steps must be at least 1, got {self.max_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"the budget in minutes must be positive, got {self.max_minutes}")


def budget_fraction(c: HasBudget, step: int, epochs: float, elapsed: float) -> float:
    """How much of the budget is spent, from 0 to 1: the largest fraction of the step, epoch and wall-clock limits."""
    spent = [0.0]
    if c.max_steps is not None:
        spent.append(step / c.max_steps)
    if c.max_epochs is not None:
        spent.append(epochs / c.max_epochs)
    if c.max_minutes is not None:
        spent.append(elapsed / (c.max_minutes * 60))
    return min(max(spent), 1.0)


def budget_spent(c: HasBudget, step: int, epoch: int, elapsed: float) -> bool:
    """Whichever of the step, epoch and wall-clock limits comes first ends the run."""
    return ((c.max_steps is not None and step >= c.max_steps)
            or (c.max_epochs is not None and epoch >= c.max_epochs)
            or (c.max_minutes is not None and elapsed >= c.max_minutes * 60))


# -- processes -----------------------------------------------------------------------------------------------


@dataclass
class Distributed:
    """This process's place in a ``torchrun`` run (rank 0 of 1 without one); only rank 0 writes files."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")  # NCCL reduces CUDA tensors only
    # The group for what the host decides (clocks, random states): gloo on CPU tensors, so that agreeing
    # on a clock never waits for the GPU. None: the default group, itself gloo when training on CPU.
    control: object = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum_tensor(self, value: Tensor) -> Tensor:
        """A tensor summed over the processes, left on its device (itself with one process: no copy, no wait)."""
        if self.world == 1:
            return value
        value = value.clone()
        dist.all_reduce(value)
        return value

    def mean(self, value: float) -> float:
        """The mean over the processes (the value itself with one process), reduced on the host.

        Every process must call it at the same point: it is how they agree on a wall clock, so that
        they take the same learning rate and stop at the same step.
        """
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return t.item() / self.world

    def gather(self, value: object) -> list | None:
        """Every process's ``value`` in rank order on rank 0 (None on the others)."""
        if self.world == 1:
            return [value]
        values = [None] * self.world if self.main else None
        dist.gather_object(value, values, dst=0, group=self.control)
        return values


def init_distributed(device: torch.device) -> Distributed:
    """This process's :class:`Distributed`: joins the ``torchrun`` run when ``WORLD_SIZE`` says there is one.

    Each process of a CUDA run takes the GPU ``LOCAL_RANK`` as its current device, so that what
    PyTorch puts on "the" GPU (NCCL's buffers, a generator's state) lands on its own.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed(device=device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return Distributed(dist.get_rank(), dist.get_world_size(), device, control)


# -- random states -------------------------------------------------------------------------------------------


T = TypeVar("T")


def adamw(model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float, *,
          decay_norms_and_biases: bool = False, eps: float = 1e-8, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, in ``model.parameters()``'s order.

    Weight decay pulls every decayed weight towards 0. It is meant for the matrices and embeddings
    that store what the model learned; a norm's gain or a bias sets a scale or an offset, and
    pulling it to 0 only fights the loss, so by default those (the parameters of fewer than two
    axes) are not decayed. ``decay_norms_and_biases=True`` decays every parameter alike, as
    PyTorch's ``AdamW(model.parameters())`` does. ``fused`` runs the update as one kernel over
    all parameters (CPU and CUDA).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if decay_norms_and_biases:
        groups = [{"params": trainable, "weight_decay": weight_decay}]
    else:
        groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, fused=fused)


def preset(presets: dict[str, T], name: str) -> T:
    """``presets[name]``, or an error that lists the presets there are."""
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(presets)}")
    return presets[name]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """This process's random states: Python's, PyTorch's CPU generator and its own accelerator's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "mps" in state and device.type == "mps":
        torch.mps.set_rng_state(state["mps"])


def gather_rng_states(world: Distributed) -> list[dict] | None:
    """Every process's random states, by rank, on rank 0 (None on the others); every process must call it.

    Each process draws its own dropout masks, so each has its own stream to continue.
    """
    return world.gather(rng_state(world.device))


def restore_rng_states(states: list[dict] | dict, world: Distributed) -> None:
    """Restore this process's entry of :func:`gather_rng_states`; refused with another number of processes."""
    if isinstance(states, dict):  # written by one process before each process's states were kept
        states = [states]
    if len(states) != world.world:
        raise ValueError(f"this checkpoint holds the random states of {len(states)} process(es) but this run has "
                         f"{world.world}: resume it with {len(states)} (torchrun --nproc_per_node {len(states)}), "
                         "or each process's dropout would not continue the masks it was drawing")
    set_rng_state(states[world.rank], world.device)


# -- checkpoints ---------------------------------------------------------------------------------------------


def save_atomically(state: object, path: Path, write=torch.save) -> None:
    """Write to a temporary file beside ``path``, flush it to disk, then rename: a kill leaves either
    the old file or the new one, never half of one. ``write(state, binary_file)`` writes the bytes
    (``torch.save`` for a checkpoint; chapter 12's results are JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_text_atomically(text: str, path: Path) -> None:
    """:func:`save_atomically` for UTF-8 text."""
    save_atomically(text, path, write=lambda obj, file: file.write(obj.encode("utf-8")))


def save_json(results: dict, path: Path) -> None:
    """``results`` as indented UTF-8 JSON, written atomically (:func:`save_atomically`): a run's results file."""
    save_text_atomically(json.dumps(results, indent=1, ensure_ascii=False) + "\n", path)


def checkpoint_paths(out_dir: Path) -> list[Path]:
    """The run's step checkpoints, oldest first."""
    return sorted((out_dir / "checkpoints").glob("step_*.pt"))


def save_checkpoint(state: dict, out_dir: Path, step: int, keep: int) -> Path:
    """``state`` as ``out_dir/checkpoints/step_<step>.pt`` (atomically, stamped with :data:`CHECKPOINT_FORMAT`);
    older ones beyond the last ``keep`` are removed (only the run's own ``step_*.pt`` files)."""
    path = out_dir / "checkpoints" / f"step_{step:07d}.pt"
    save_atomically({"format": CHECKPOINT_FORMAT, **state}, path)
    for old in checkpoint_paths(out_dir)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: Path | str) -> dict:
    """A checkpoint of :func:`save_checkpoint` or :func:`average_checkpoints`; a clear error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated or foreign file: torch raises several kinds
        raise ValueError(f"{path} is not a readable checkpoint: {error}") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a training checkpoint of this course (format {CHECKPOINT_FORMAT})")
    return state


def average_checkpoints(paths: list[Path], out: Path) -> Path:
    """The mean of the weights of ``paths`` (Vaswani et al. 2017, section 6.1: the last 5 or 20 checkpoints).

    Checkpoints a few hundred steps apart lie around one minimum; their mean usually sits nearer
    its centre than any one of them, for a BLEU point or so, free. Everything but the weights
    is the newest checkpoint's.
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    states = [load_checkpoint(p) for p in paths]
    fingerprints = {s.get("fingerprint") for s in states}
    if len(fingerprints) > 1:
        raise ValueError(f"these checkpoints use different vocabularies ({sorted(map(str, fingerprints))}): "
                         "not averaged")
    averaged = {}
    for key, value in states[-1]["model"].items():
        if value.is_floating_point():
            averaged[key] = sum(s["model"][key].double() for s in states).div(len(states)).to(value.dtype)
        else:
            averaged[key] = value
    result = {k: v for k, v in states[-1].items() if k not in ("optimizer", "rng")}
    result["model"] = averaged
    result["averaged"] = [p.name for p in paths]
    save_atomically(result, out)
    return out


# -- where a run stands, and its log ---------------------------------------------------------------------------


@dataclass
class Position:
    """Where a run stands: optimiser steps done, the epoch under way (from 0), the batches of it done, and the
    wall-clock seconds spent (a resumed run's earlier ones included), agreed by every process."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    elapsed: float = 0.0
    epoch_batches: int = field(default=0, compare=False)  # batches in the epoch under way, once started

    @property
    def epochs(self) -> float:
        """Epochs done, with the one under way as a fraction."""
        return self.epoch + (self.batch_in_epoch / self.epoch_batches if self.epoch_batches else 0.0)

    def to_checkpoint(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "elapsed_s": self.elapsed}

    @classmethod
    def from_checkpoint(cls, state: dict) -> "Position":
        return cls(state["step"], state["epoch"], state["batch_in_epoch"], state["elapsed_s"])


class MetricsLog:
    """A JSON-lines log, one object a line, each starting with ``tags`` (chapter 12's ``phase``); ``file``
    None writes nothing (a process other than rank 0)."""

    def __init__(self, file: IO[str] | None, **tags) -> None:
        self.file, self.tags = file, tags

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps({**self.tags, **record}) + "\n")

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the log lines written after the checkpoint a run resumes from: they are about to be redone."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


class Progress:
    """A tqdm bar over the budget: steps when the budget is in steps, else seconds; loss, tokens/s and lr beside it."""

    def __init__(self, c: HasBudget, step: int, enabled: bool) -> None:
        self.by_steps = c.max_steps is not None and c.max_minutes is None
        total = c.max_steps if self.by_steps else (c.max_minutes * 60 if c.max_minutes is not None else None)
        unit = "step" if self.by_steps else "s"
        self.bar = tqdm(total=total, initial=step if self.by_steps else 0, unit=unit, disable=not enabled,
                        dynamic_ncols=True, file=sys.stderr, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} "
                        "[{elapsed}<{remaining}{postfix}]")

    def advance(self, step: int, elapsed: float) -> None:
        """Move the bar (every step: it needs nothing from the device)."""
        self.bar.n = step if self.by_steps else min(elapsed, self.bar.total or elapsed)
        self.bar.refresh()

    def show(self, record: dict) -> None:
        """The newest logged step's numbers beside the bar."""
        self.bar.set_postfix_str(f"step {record['step']}, loss {record['loss']:.3f}, {record['tokens_per_s']:,.0f} "
                                 f"tok/s, lr {record['lr']:.2e}")

    def close(self) -> None:
        self.bar.close()


# -- the loop ------------------------------------------------------------------------------------------------


class StepResult(NamedTuple):
    """What one optimiser step reports: tensors, left on the device until the loop reads a batch of steps
    at once (plain numbers are accepted too).

    The logged loss is ``loss / loss_over``: the translator sums its loss over the target tokens and
    divides by their count here; a step that returns a mean loss leaves ``loss_over`` at 1.
    """

    loss: Tensor | float
    tokens: Tensor | float  # the batch's tokens, for tokens/s (all processes' together)
    grad_norm: Tensor | float  # before clipping
    loss_over: Tensor | float = 1.0


def read_numbers(rows: Sequence[Sequence[Tensor | float]]) -> list[list[float]]:
    """The rows' values as Python floats, every tensor among them read in one transfer (one wait for the device)."""
    tensors = [v for row in rows for v in row if isinstance(v, Tensor)]
    read = []
    if tensors:
        device = tensors[0].device
        # float64 holds float32 values and token counts exactly; Apple's GPU has no float64.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        read = torch.stack([t.detach().reshape(()).to(device, dtype) for t in tensors]).tolist()
    values = iter(read)
    return [[next(values) if isinstance(v, Tensor) else float(v) for v in row] for row in rows]


@dataclass
class _Done:
    """A step run but not yet logged: what the host knew then, and the step's own (device) results."""

    step: int
    epoch: int
    lr: float
    started: float
    ended: float
    elapsed: float
    result: StepResult


def training_loop(
    budget: HasBudget,
    epoch_batches: Callable[[int], Sequence],
    schedule: Callable[[int, float], float],
    step: Callable[[object, float], StepResult],
    write: Callable[[dict], None],
    *,
    position: Position | None = None,
    world: Distributed | None = None,
    progress: Progress | None = None,
    log_every: int = 50,
    every: Sequence[tuple[int, Callable[[Position], object]]] = (),
) -> Position:
    """Run ``step`` over the epochs' batches from ``position`` until ``budget`` is spent; where the run ended.

    - ``epoch_batches(epoch)``: the epoch's batches, as many on every process (each may hold that
      process's share of one global batch);
    - ``schedule(step, spent)``: the learning rate of step ``step`` (from 1), with ``spent`` the
      fraction of the budget used before it (:func:`budget_fraction`);
    - ``step(batch, lr)``: one optimiser step; it returns a :class:`StepResult`;
    - ``write(record)``: takes each step's record (``step``, ``epoch`` from 1, ``loss``, ``lr``,
      ``tokens``, ``grad_norm``, ``tokens_per_s`` over the last 50 steps, ``elapsed_s``), in order;
    - ``every``: ``(n, hook)`` pairs: ``hook(position)`` after every n-th step (an evaluation, a
      checkpoint), once the records up to that step are written.

    The step's results stay on the device: they are read every ``log_every`` steps, before a
    hook, and at the end, so the host can queue the next steps while the device works. The
    clock is read on the host, and with several processes every decision that depends on it (the
    learning rate, when to stop, mid-epoch or at an epoch's end) uses the mean of their clocks,
    so that all of them take the same steps and stop together.
    """
    position = position or Position()
    world = world or Distributed()
    if log_every < 1:
        raise ValueError(f"log_every must be at least 1, got {log_every}")
    started, before = time.perf_counter(), position.elapsed
    pending: list[_Done] = []
    recent: deque[tuple[float, float]] = deque(maxlen=50)  # (start, tokens) of the last steps: tokens/s

    def clock(now: float | None = None) -> float:
        return world.mean(before + (time.perf_counter() if now is None else now) - started)

    def flush() -> None:
        rows = read_numbers([done.result for done in pending])
        for done, (loss, tokens, grad_norm, loss_over) in zip(pending, rows, strict=True):
            recent.append((done.started, tokens))
            record = {"step": done.step, "epoch": done.epoch, "loss": loss / loss_over, "lr": done.lr,
                      "tokens": int(tokens), "grad_norm": grad_norm,
                      "tokens_per_s": sum(t for _, t in recent) / max(done.ended - recent[0][0], 1e-9),
                      "elapsed_s": done.elapsed}
            write(record)
        if pending and progress is not None:
            progress.show(record)
        pending.clear()

    try:
        while True:
            position.elapsed = clock()
            if budget_spent(budget, position.step, position.epoch, position.elapsed):
                break
            batches = epoch_batches(position.epoch)
            position.epoch_batches = len(batches)
            for batch in batches[position.batch_in_epoch:]:
                step_started = time.perf_counter()
                spent = budget_fraction(budget, position.step, position.epochs, clock(step_started))
                lr = schedule(position.step + 1, spent)
                result = step(batch, lr)
                position.step += 1
                position.batch_in_epoch += 1
                now = time.perf_counter()
                position.elapsed = clock(now)
                pending.append(_Done(position.step, position.epoch + 1, lr, step_started, now, position.elapsed,
                                     result))
                if progress is not None:
                    progress.advance(position.step, position.elapsed)
                due = [hook for n, hook in every if position.step % n == 0]
                if due or position.step % log_every == 0:
                    flush()
                for hook in due:
                    hook(position)
                if due:  # an evaluation or a checkpoint takes time too
                    position.elapsed = clock()
                if budget_spent(budget, position.step, position.epoch, position.elapsed):
                    break
            else:
                position.epoch, position.batch_in_epoch = position.epoch + 1, 0
                continue
            break
        flush()
    finally:
        if progress is not None:
            progress.close()
    return position


@contextlib.contextmanager
def shape_checks(enabled: bool) -> Iterator[None]:
    """jaxtyping's runtime shape checks on or off inside the block, and as they were after it.

    jaxtyping reads its setting at every call of a checked function: with it off, the call is the
    function's own plus one test of the setting (no beartype, no shape memo).
    """
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", not enabled)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)
