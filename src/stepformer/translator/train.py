"""Chapter 11: training the translator, on one device or several processes (``torchrun``), resumable.

One optimiser step: a batch of sentence pairs by tokens, the label-smoothed loss over the real
target tokens, gradients clipped, AdamW with warmup and inverse square-root decay. Around it:
checkpoints every N steps, written atomically, from which ``resume=True`` continues a killed
run to the same weights as an uninterrupted one; a budget in steps, epochs or minutes; a
progress bar; a metrics log (JSON lines) and a plot of the loss and validation BLEU. With
``torchrun --nproc_per_node N`` each process takes every N-th sentence of the same global
batch, and the loss is divided by the whole batch's token count, so the gradients (and the
losses) are those of one process on the whole batch.
"""

import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from stepformer.transformer import Transformer
from stepformer.translator.batching import Encoded, PaddedTable, collate, encode_pairs, token_batches
from stepformer.translator.config import TranslatorConfig, autocast_dtype, pick_device
from stepformer.translator.data import load_split
from stepformer.translator.fast import fused_label_smoothed_loss, loss_for, packed_dropout
from stepformer.translator.recipe import inverse_sqrt_lr
from stepformer.translator.tokenizer import SubwordTokenizer

CHECKPOINT_FORMAT = 1
# Steps between two reads of the losses from the device: a read waits for the device to finish, so
# reading every step would keep the host from queueing the next step while this one runs.
LOG_EVERY = 50


def build_model(config: TranslatorConfig, vocab_size: int, pad_id: int) -> Transformer:
    """Chapter 08's Transformer with one embedding matrix shared by source, target and output layer.

    Tying the three (Press and Wolf 2017; section 3.4 of the paper) fits a joint vocabulary: a
    subword is the same row whichever language it comes from, and the model has a third fewer
    parameters to learn from 29,000 sentences. With ``config.fast`` its dropout draws its masks
    four elements per random number (:class:`.fast.PackedDropout`).
    """
    model = Transformer(
        vocab_size, vocab_size, d_model=config.d_model, heads=config.heads, n_encoder_layers=config.layers,
        n_decoder_layers=config.layers, d_ff=config.d_ff, dropout=config.dropout, norm_first=config.norm_first,
        tie_embeddings=True, max_len=config.max_len, pad_id=pad_id, activation=config.activation,
        kv_heads=config.kv_heads, fast=config.fast,
    )
    return packed_dropout(model) if config.fast else model


def make_optimizer(model: torch.nn.Module, config: TranslatorConfig, device: torch.device) -> torch.optim.AdamW:
    """The trainer's AdamW (the learning rate is set before every step by the schedule)."""
    # The fused update is one kernel over all parameters instead of several per tensor (CPU and CUDA).
    return torch.optim.AdamW(model.parameters(), lr=config.peak_lr, betas=config.betas, eps=1e-9,
                             weight_decay=config.weight_decay, fused=device.type in ("cpu", "cuda"))


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


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")  # NCCL reduces CUDA tensors only

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, *values: float) -> list[float]:
        """Sums over the processes (the values themselves with one process)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_sum_tensor(self, value: Tensor) -> Tensor:
        """A tensor summed over the processes, left on its device (itself with one process: no copy, no wait)."""
        if self.world == 1:
            return value
        value = value.clone()
        dist.all_reduce(value)
        return value

    def mean(self, value: float) -> float:
        """The mean over the processes (the value itself with one process)."""
        return self.all_sum(value)[0] / self.world


def _init_distributed(device: torch.device) -> Distributed:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return Distributed(dist.get_rank(), dist.get_world_size(), device)


def checkpoint_paths(out_dir: Path) -> list[Path]:
    """The run's step checkpoints, oldest first."""
    return sorted((out_dir / "checkpoints").glob("step_*.pt"))


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


def load_checkpoint(path: Path | str) -> dict:
    """A checkpoint written by :func:`train` or :func:`average_checkpoints`; a clear error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated or foreign file: torch raises several kinds
        raise ValueError(f"{path} is not a readable checkpoint: {error}") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a translator checkpoint of this course (format {CHECKPOINT_FORMAT})")
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
    fingerprints = {s["fingerprint"] for s in states}
    if len(fingerprints) > 1:
        raise ValueError(f"these checkpoints use different vocabularies ({sorted(fingerprints)}): not averaged")
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


def prepare_data(config: TranslatorConfig, out_dir: Path, data_dir: Path | None, progress: bool, log) -> tuple:
    """The tokenizer (trained on the training split, or the run's own when resuming) and the encoded splits."""
    train_src, train_tgt = load_split("train", config.src_lang, config.tgt_lang, data_dir, progress=progress)
    val_src, val_tgt = load_split("val", config.src_lang, config.tgt_lang, data_dir, progress=progress)
    tokenizer_file = out_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        tokenizer = SubwordTokenizer.from_json(tokenizer_file.read_text())
    else:
        # Both languages' training sentences, never val or test: the vocabulary is part of the model.
        tokenizer = SubwordTokenizer.train(train_src + train_tgt, config.vocab_size)
    train = encode_pairs(tokenizer, train_src, train_tgt, config.max_len)
    val = encode_pairs(tokenizer, val_src, val_tgt, config.max_len)
    log(f"data: {len(train):,} training pairs, {len(val):,} validation pairs; vocabulary {tokenizer.vocab_size:,} "
        f"subwords; {train.truncated} training and {val.truncated} validation sentences cut to {config.max_len} tokens")
    return tokenizer, train, val, val_tgt


def train(
    config: TranslatorConfig,
    out_dir: Path | str,
    data_dir: Path | str | None = None,
    resume: bool = False,
    progress: bool = True,
    device: torch.device | None = None,
) -> Path:
    """Train a translator into ``out_dir``; returns the averaged checkpoint ``out_dir/averaged.pt``.

    ``out_dir`` gets ``config.json``, ``tokenizer.json``, ``checkpoints/step_*.pt`` (the last
    ``keep_checkpoints``), ``metrics.jsonl`` and ``curves.png``. An ``out_dir`` that already holds
    checkpoints is refused unless ``resume`` (which then continues from the newest one, with the
    configuration saved there).
    """
    out_dir = Path(out_dir)
    device = device or pick_device()
    world = _init_distributed(device)
    if world.world > 1:
        device = world.device  # this process's GPU under torchrun
    existing = checkpoint_paths(out_dir)
    if existing and not resume:
        raise FileExistsError(f"{out_dir} already holds checkpoints ({existing[-1].name}): pass --resume to continue "
                              "that run, or choose another output folder")
    state = load_checkpoint(existing[-1]) if resume and existing else None
    if state is not None:
        config = resumed_config(TranslatorConfig.from_dict(state["config"]), config)
    log = (lambda message: tqdm.write(message, file=sys.stderr)) if world.main else (lambda message: None)

    seed_everything(config.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, train_data, val_data, val_refs = prepare_data(config, out_dir, data_dir, progress and world.main, log)

    # Warmup and cadences given in epochs become steps here; config.json keeps them as given.
    steps_per_epoch = len(token_batches(train_data, config.max_tokens, config.seed, 0))
    given, config = config, config.in_steps(steps_per_epoch)
    model = build_model(config, tokenizer.vocab_size, tokenizer.pad_id).to(device)
    if world.main:
        (out_dir / "tokenizer.json").write_text(tokenizer.to_json())
        (out_dir / "config.json").write_text(json.dumps(given.to_dict(), indent=2) + "\n")
    optimizer = make_optimizer(model, config, device)
    amp_dtype = autocast_dtype(config.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)
    step, epoch, batch_in_epoch, elapsed_before = 0, 0, 0, 0.0
    if state is not None:
        if state["fingerprint"] != tokenizer.fingerprint:
            raise ValueError(f"{existing[-1]} was trained with another vocabulary than {out_dir / 'tokenizer.json'}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        elapsed_before = state["elapsed_s"]
        set_rng_state(state["rng"])
        truncate_metrics(out_dir / "metrics.jsonl", step)
        log(f"resuming from {existing[-1].name}: step {step}, epoch {epoch + 1}, {elapsed_before / 60:.1f} min done")

    parameters = sum(p.numel() for p in model.parameters())
    log(f"model: {parameters:,} parameters on {hardware(device)}; precision "
        f"{str(amp_dtype or torch.float32).removeprefix('torch.')}{' with a gradient scaler' * scaler.is_enabled()}; "
        f"{world.world} process(es); commit {commit()}")
    log("settings: " + ", ".join(f"{k}={v}" for k, v in config.to_dict().items())
        + f"; {steps_per_epoch} steps per epoch")
    if device.type == "cuda":
        # TF32 tensor cores for what stays float32 (10 mantissa bits, float32's range): the products
        # autocast leaves in float32 and everything when precision=fp32.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    forward = model
    if world.world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if device.type != "cuda"
                                                            else [device.index])
    if config.compile:
        import jaxtyping

        # The shape checks are Python around every call, which the compiler cannot trace through.
        jaxtyping.config.update("jaxtyping_disable", True)
        forward = torch.compile(forward, dynamic=True)

    # The training split padded once, on the device: a batch is two gathers there (PaddedTable).
    table = PaddedTable(train_data, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, device)
    loss_fn = loss_for(device)
    bar = Progress(config, step, enabled=progress and world.main)
    metrics = open(out_dir / "metrics.jsonl", "a") if world.main else None  # noqa: SIM115 (closed below)
    started = time.perf_counter()
    recent: list[tuple[float, float]] = []  # (start time, tokens) of the last steps: tokens/s over a moving window
    pending: list[dict] = []  # steps whose losses are still on the device

    def flush() -> None:
        """Read the pending steps' losses in one transfer, then log them."""
        nonlocal recent
        if not pending:
            return
        values = torch.stack([torch.stack([r.pop("loss_sum").float(), r.pop("n_tokens").float(),
                                           r["grad_norm"].float()]) for r in pending]).tolist()
        for record, (loss_sum, n_tokens, grad_norm) in zip(pending, values, strict=True):
            recent = [*recent[-49:], (record.pop("started"), n_tokens)]
            record.update(loss=loss_sum / n_tokens, tokens=int(n_tokens), grad_norm=grad_norm,
                          tokens_per_s=sum(t for _, t in recent) / max(record.pop("ended") - recent[0][0], 1e-9))
            record = {k: record[k] for k in ("step", "epoch", "loss", "lr", "tokens", "grad_norm", "tokens_per_s",
                                             "elapsed_s")}
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
            bar.update(record["step"], record["elapsed_s"], record)
        pending.clear()

    model.train()
    try:
        while not budget_spent(config, step, epoch, elapsed_before + time.perf_counter() - started):
            batches = token_batches(train_data, config.max_tokens, config.seed, epoch)
            mine = [indices[world.rank::world.world] for indices in batches[batch_in_epoch:]]
            for indices, index in zip(mine, table.indices(mine), strict=True):
                step_started = time.perf_counter()
                spent = budget_fraction(config, step, epoch + batch_in_epoch / len(batches),
                                        world.mean(elapsed_before + step_started - started))
                lr = scheduled_lr(config, step + 1, spent)
                loss_sum, n_tokens, grad_norm = train_step(forward, model, optimizer, scaler, table, indices, index,
                                                           tokenizer.pad_id, config, lr, amp_dtype, loss_fn, world)
                step += 1
                batch_in_epoch += 1
                now = time.perf_counter()
                # Every process must see the same clock, or they would stop at different steps.
                elapsed = world.mean(elapsed_before + now - started)
                pending.append({"step": step, "epoch": epoch + 1, "loss_sum": loss_sum, "n_tokens": n_tokens,
                                "grad_norm": grad_norm, "lr": optimizer.param_groups[0]["lr"], "elapsed_s": elapsed,
                                "started": step_started, "ended": now})
                evaluating = step % config.eval_every == 0 and world.main
                checkpointing = step % config.checkpoint_every == 0
                if step % LOG_EVERY == 0 or evaluating or checkpointing:
                    flush()
                else:
                    bar.update(step, elapsed, None)
                if evaluating:
                    evaluation = validate(model, tokenizer, val_data, val_refs, config, amp_dtype, device)
                    metrics.write(json.dumps({"step": step, "elapsed_s": elapsed, **evaluation}) + "\n")
                    log(f"step {step}: validation loss {evaluation['val_loss']:.3f}, greedy BLEU "
                        f"{evaluation['val_bleu']:.1f} on {config.eval_sentences} val sentences")
                    model.train()
                if checkpointing:
                    if metrics is not None:
                        metrics.flush()
                    if world.main:
                        write_checkpoint(out_dir, model, optimizer, given, tokenizer, step, epoch, batch_in_epoch,
                                         elapsed)
                if budget_spent(config, step, epoch, elapsed):
                    break
            else:
                epoch, batch_in_epoch = epoch + 1, 0
                continue
            break
        flush()
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    elapsed = elapsed_before + time.perf_counter() - started
    if not world.main:
        return out_dir / "averaged.pt"
    if not checkpoint_paths(out_dir) or checkpoint_paths(out_dir)[-1].name != f"step_{step:07d}.pt":
        write_checkpoint(out_dir, model, optimizer, given, tokenizer, step, epoch, batch_in_epoch, elapsed)
    plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png")
    averaged = average_checkpoints(checkpoint_paths(out_dir)[-config.keep_checkpoints:], out_dir / "averaged.pt")
    log(f"done: {step} steps, {epoch + (batch_in_epoch > 0)} epochs (the last one partial if not a whole), "
        f"{elapsed / 60:.1f} min; averaged the last {min(len(checkpoint_paths(out_dir)), config.keep_checkpoints)} "
        f"checkpoints into {averaged}")
    return averaged


def train_step(forward, model, optimizer, scaler, table: PaddedTable, indices: list[int], index: Tensor,
               pad_id: int, config, lr: float, amp_dtype, loss_fn, world: Distributed) -> tuple[Tensor, Tensor, Tensor]:
    """One optimiser step at learning rate ``lr`` on this process's share of a global batch.

    Returns the whole batch's summed loss and target tokens, and the gradients' norm before clipping,
    as tensors on the device: nothing here waits for the device (the trainer reads them every
    ``LOG_EVERY`` steps). ``loss_fn`` is :func:`.fast.loss_for`'s, ``index`` the batch's indices on the device.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    src, tgt_in, tgt_out = table.batch(indices, index)
    tokens = (tgt_out != pad_id).sum()
    global_tokens = world.all_sum_tensor(tokens)
    with torch.autocast(table.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        logits = forward(src, tgt_in)
    # Chapter 11's label_smoothed_loss: in cache-sized blocks on the CPU, one fused call elsewhere (both tested).
    loss_sum = loss_fn(logits, tgt_out, pad_id, config.label_smoothing)
    # DDP averages gradients over the processes; times world / all tokens makes that the
    # gradient of (sum over the whole batch) / (its tokens), as one process would compute.
    scaler.scale(loss_sum * world.world / global_tokens).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return world.all_sum_tensor(loss_sum.detach()), global_tokens, grad_norm.detach()


@torch.no_grad()
def validate(model, tokenizer, val: Encoded, val_refs: list[str], config, amp_dtype, device) -> dict:
    """Validation loss on all of val, and greedy BLEU on its first ``eval_sentences`` sentences (a quick signal)."""
    import sacrebleu

    from stepformer.translator.search import translate_encoded

    model.eval()
    loss_sum, tokens = 0.0, 0.0
    for indices in token_batches(val, config.max_tokens, 0, 0, shuffle=False):
        src, tgt = collate(val, indices, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)
        src, tgt = src.to(device), tgt.to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(src, tgt[:, :-1])
        loss_sum += float(fused_label_smoothed_loss(logits, tgt[:, 1:], tokenizer.pad_id, 0.0, "sum"))
        tokens += float((tgt[:, 1:] != tokenizer.pad_id).sum())
    sample = Encoded(val.src[: config.eval_sentences], val.tgt[: config.eval_sentences])
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        ids = translate_encoded(model, sample, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id,
                                config.max_tokens, 1, max_len_a=config.max_len_a, max_len_b=config.max_len_b,
                                max_positions=config.max_len)
    texts = tokenizer.decode(ids)
    bleu = sacrebleu.corpus_bleu(texts, [val_refs[: len(sample)]])
    return {"val_loss": loss_sum / tokens, "val_perplexity": math.exp(loss_sum / tokens), "val_bleu": bleu.score}


def write_checkpoint(out_dir: Path, model, optimizer, config, tokenizer, step, epoch, batch_in_epoch, elapsed) -> Path:
    """Everything a resumed run needs to continue exactly, and a translation needs to run; older ones beyond
    ``keep_checkpoints`` are removed (only the run's own ``step_*.pt`` files)."""
    path = out_dir / "checkpoints" / f"step_{step:07d}.pt"
    save_atomically({
        "format": CHECKPOINT_FORMAT, "config": config.to_dict(), "tokenizer": tokenizer.to_json(),
        "fingerprint": tokenizer.fingerprint, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "elapsed_s": elapsed, "rng": rng_state(),
        "commit": commit(), "torch": torch.__version__, "hardware": hardware(next(model.parameters()).device),
        "precision": str(autocast_dtype(config.precision, next(model.parameters()).device)
                         or torch.float32).removeprefix("torch."),
        # The machine's load when the checkpoint was written: a run that shared its cores says so.
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }, path)
    for old in checkpoint_paths(out_dir)[: -config.keep_checkpoints]:
        old.unlink()
    return path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the log lines written after the checkpoint a run resumes from: they are about to be redone."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


BUDGET_FIELDS = ("max_steps", "max_epochs", "max_minutes")


def resumed_config(saved: TranslatorConfig, given: TranslatorConfig) -> TranslatorConfig:
    """The saved run's settings with the budget given now (a run may be extended); any other
    difference is refused, since it would silently make the resumed run another run."""
    differences = [f"{k}: saved {v!r}, given {given.to_dict()[k]!r}" for k, v in saved.to_dict().items()
                   if k not in BUDGET_FIELDS and given.to_dict()[k] != v]
    if differences:
        raise ValueError("resuming with other settings than the saved run's: " + "; ".join(differences))
    return given


def budget_fraction(c: TranslatorConfig, step: int, epochs: float, elapsed: float) -> float:
    """How much of the budget is spent, from 0 to 1: the largest fraction of the step, epoch and wall-clock limits."""
    spent = [0.0]
    if c.max_steps is not None:
        spent.append(step / c.max_steps)
    if c.max_epochs is not None:
        spent.append(epochs / c.max_epochs)
    if c.max_minutes is not None:
        spent.append(elapsed / (c.max_minutes * 60))
    return min(max(spent), 1.0)


def scheduled_lr(c: TranslatorConfig, step: int, spent: float) -> float:
    """The paper's warmup and inverse square-root decay, times a linear cooldown to 0 over the budget's last part.

    A run with a budget knows where it ends, and a rate that is still high at the last step leaves the weights
    noisy; cooling down over the last ``c.cooldown`` of the budget (steps, epochs or minutes, whichever ends
    first) removes that noise, as a cosine schedule would, without changing the rest of the run. ``spent`` is
    :func:`budget_fraction` before this step; with no budget at all there is no cooldown.
    """
    lr = inverse_sqrt_lr(step, c.peak_lr, c.warmup)
    if c.cooldown > 0:
        lr *= min(1.0, (1.0 - spent) / c.cooldown)
    return lr


def budget_spent(c: TranslatorConfig, step: int, epoch: int, elapsed: float) -> bool:
    """Whichever of the step, epoch and wall-clock limits comes first ends the run."""
    return ((c.max_steps is not None and step >= c.max_steps)
            or (c.max_epochs is not None and epoch >= c.max_epochs)
            or (c.max_minutes is not None and elapsed >= c.max_minutes * 60))


class Progress:
    """A tqdm bar over the budget: steps when the budget is in steps, else seconds; loss, tokens/s and lr beside it."""

    def __init__(self, c: TranslatorConfig, step: int, enabled: bool) -> None:
        self.by_steps = c.max_steps is not None and c.max_minutes is None
        total = c.max_steps if self.by_steps else (c.max_minutes * 60 if c.max_minutes is not None else None)
        unit = "step" if self.by_steps else "s"
        self.bar = tqdm(total=total, initial=step if self.by_steps else 0, unit=unit, disable=not enabled,
                        dynamic_ncols=True, file=sys.stderr, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} "
                        "[{elapsed}<{remaining}{postfix}]")
        self.last_elapsed = 0.0

    def update(self, step: int, elapsed: float, record: dict | None) -> None:
        """Move the bar to ``step``; ``record`` (a logged step, or None between reads) updates the figures beside it."""
        if self.by_steps:
            self.bar.n = step
        else:
            self.bar.n = min(elapsed, self.bar.total or elapsed)
        if record is not None:
            self.bar.set_postfix_str(f"step {record['step']}, loss {record['loss']:.3f}, "
                                     f"{record['tokens_per_s']:,.0f} tok/s, lr {record['lr']:.2e}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def plot_curves(metrics: Path, out: Path) -> Path | None:
    """The training loss (smoothed), the validation loss and the validation BLEU against steps, in one figure."""
    # A Figure of its own, not pyplot: a notebook that calls train() keeps its own plotting backend.
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_bleu" in r]
    if not train_rows:
        return None
    fig = Figure(figsize=(10, 3.6))
    ax_loss, ax_bleu = fig.subplots(1, 2)
    steps = [r["step"] for r in train_rows]
    window = max(1, len(train_rows) // 50)
    losses = [r["loss"] for r in train_rows]
    smoothed = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                for i in range(len(losses))]
    ax_loss.plot(steps, smoothed, label="training (label-smoothed)")
    if val_rows:
        ax_loss.plot([r["step"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", label="validation (plain)")
        ax_bleu.plot([r["step"] for r in val_rows], [r["val_bleu"] for r in val_rows], "o-", color="C2")
    ax_loss.set(xlabel="step", ylabel="cross-entropy per token (nats)", title="loss")
    ax_loss.legend()
    ax_bleu.set(xlabel="step", ylabel="BLEU", title="validation BLEU (greedy, sample)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out
