"""Chapter 11: training the translator, on one device or several processes (``torchrun``), resumable.

One optimiser step: a batch of sentence pairs by tokens, the label-smoothed loss over the real
target tokens, gradients clipped, AdamW with warmup and inverse square-root decay. Around it, from
the run plumbing chapter 12 shares (:mod:`stepformer.runs`): checkpoints every N steps, written
atomically, from which ``resume=True`` continues a killed run to the same weights as an
uninterrupted one; a budget in steps, epochs or minutes; a progress bar; a metrics log (JSON
lines) and a plot of the loss and validation BLEU. With ``torchrun --nproc_per_node N`` each
process takes every N-th sentence of the same global batch, and the loss is divided by the whole
batch's token count, so the gradients (and the losses) are those of one process on the whole batch.
"""

import json
import math
import sys
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from stepformer.runs import (
    Distributed,
    MetricsLog,
    Position,
    Progress,
    StepResult,
    adamw,
    average_checkpoints,
    checkpoint_paths,
    commit,
    gather_rng_states,
    hardware,
    init_distributed,
    load_checkpoint,
    restore_rng_states,
    save_text_atomically,
    seed_everything,
    shape_checks,
    training_loop,
    truncate_metrics,
)
from stepformer.translator.batching import Encoded, PaddedTable, collate, encode_pairs, token_batches
from stepformer.translator.checkpoints import resumed_config, write_checkpoint
from stepformer.translator.config import TranslatorConfig, autocast_dtype, pick_device
from stepformer.translator.data import load_split
from stepformer.translator.fast import fused_label_smoothed_loss, loss_for
from stepformer.translator.model import build_model, compile_model
from stepformer.translator.plots import plot_curves
from stepformer.translator.recipe import inverse_sqrt_lr
from stepformer.translator.tokenizer import SubwordTokenizer


def make_optimizer(model: torch.nn.Module, config: TranslatorConfig, device: torch.device) -> torch.optim.AdamW:
    """The trainer's AdamW (the learning rate is set before every step by the schedule).

    Every parameter is decayed, norms and biases too: the runs whose scores the README reports were
    trained so, and their ``weight_decay`` (1e-4) is too small for the difference to be measured.
    """
    # The fused update is one kernel over all parameters instead of several per tensor (CPU and CUDA).
    return adamw(model, config.peak_lr, config.betas, config.weight_decay, decay_norms_and_biases=True,
                 eps=1e-9, fused=device.type in ("cpu", "cuda"))


def prepare_data(config: TranslatorConfig, out_dir: Path, data_dir: Path | None, progress: bool, log) -> tuple:
    """The tokenizer (trained on the training split, or the run's own when resuming) and the encoded splits."""
    train_src, train_tgt = load_split("train", config.src_lang, config.tgt_lang, data_dir, progress=progress)
    val_src, val_tgt = load_split("val", config.src_lang, config.tgt_lang, data_dir, progress=progress)
    tokenizer_file = out_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        tokenizer = SubwordTokenizer.from_json(tokenizer_file.read_text())
    else:
        # Both languages' training sentences, never val or test: the vocabulary is part of the model.
        tokenizer = SubwordTokenizer.train(train_src + train_tgt, config.model.vocab)
    train = encode_pairs(tokenizer, train_src, train_tgt, config.model.max_len)
    val = encode_pairs(tokenizer, val_src, val_tgt, config.model.max_len)
    log(f"data: {len(train):,} training pairs, {len(val):,} validation pairs; vocabulary {tokenizer.vocab_size:,} "
        f"subwords; {train.truncated} training and {val.truncated} validation sentences cut to "
        f"{config.model.max_len} tokens")
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
    world = init_distributed(device)
    device = world.device  # under torchrun, this process's own GPU
    existing = checkpoint_paths(out_dir)
    if existing and not resume:
        raise FileExistsError(f"{out_dir} already holds checkpoints ({existing[-1].name}): pass --resume to continue "
                              "that run, or choose another output folder")
    state = load_checkpoint(existing[-1]) if resume and existing else None
    if state is not None:
        config = resumed_config(TranslatorConfig.from_dict(state["config"]), config)
    log = (lambda message: tqdm.write(message, file=sys.stderr)) if world.main else (lambda message: None)

    seed_everything(config.seed)
    if world.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, train_data, val_data, val_refs = prepare_data(config, out_dir, data_dir, progress and world.main, log)

    # Warmup and cadences given in epochs become steps here; config.json keeps them as given.
    steps_per_epoch = len(token_batches(train_data, config.max_tokens, config.seed, 0))
    given, config = config, config.in_steps(steps_per_epoch)
    model = build_model(config, tokenizer.vocab_size, tokenizer.pad_id).to(device)
    if world.main:
        # Atomically: another process that finds tokenizer.json reads it instead of training its own.
        save_text_atomically(tokenizer.to_json(), out_dir / "tokenizer.json")
        save_text_atomically(json.dumps(given.to_dict(), indent=2) + "\n", out_dir / "config.json")
    optimizer = make_optimizer(model, config, device)
    amp_dtype = autocast_dtype(config.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)
    position = Position()
    if state is not None:
        if state["fingerprint"] != tokenizer.fingerprint:
            raise ValueError(f"{existing[-1]} was trained with another vocabulary than {out_dir / 'tokenizer.json'}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        position = Position.from_checkpoint(state)
        restore_rng_states(state["rng"], world)
        if world.main:
            truncate_metrics(out_dir / "metrics.jsonl", position.step)
        log(f"resuming from {existing[-1].name}: step {position.step}, epoch {position.epoch + 1}, "
            f"{position.elapsed / 60:.1f} min done")

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
        forward = compile_model(forward)

    # The training split padded once, on the device: a batch is two gathers there (PaddedTable).
    table = PaddedTable(train_data, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, device)
    loss_fn = loss_for(device)
    metrics = MetricsLog(open(out_dir / "metrics.jsonl", "a") if world.main else None)  # noqa: SIM115 (closed below)

    def epoch_batches(epoch: int) -> list[tuple[list[int], Tensor]]:
        # Each process takes every world-th sentence of each global batch; its indices go to the device
        # in one transfer for the whole epoch.
        mine = [indices[world.rank::world.world]
                for indices in token_batches(train_data, config.max_tokens, config.seed, epoch)]
        return list(zip(mine, table.indices(mine), strict=True))

    checked = config.compile  # a compiled model is never checked: the compiler cannot trace through the checks

    def step(batch: tuple[list[int], Tensor], lr: float) -> StepResult:
        nonlocal checked
        indices, index = batch
        # The first step of an eager run is checked, so a model that does not fit its data fails with the
        # axis's name; later steps run the same code on the same kinds of tensors.
        with shape_checks(not checked):
            loss_sum, n_tokens, grad_norm = train_step(forward, model, optimizer, scaler, table, indices, index,
                                                       tokenizer.pad_id, config, lr, amp_dtype, loss_fn, world)
        checked = True
        return StepResult(loss_sum, n_tokens, grad_norm, loss_over=n_tokens)

    def evaluate(at: Position) -> None:
        if world.main:
            evaluation = validate(model, tokenizer, val_data, val_refs, config, amp_dtype, device)
            metrics.write({"step": at.step, "elapsed_s": at.elapsed, **evaluation})
            log(f"step {at.step}: validation loss {evaluation['val_loss']:.3f}, greedy BLEU "
                f"{evaluation['val_bleu']:.1f} on {config.eval_sentences} val sentences")
            model.train()

    def checkpoint(at: Position) -> None:
        metrics.flush()
        rng = gather_rng_states(world)  # every process's: each draws its own dropout masks
        if world.main:
            write_checkpoint(out_dir, model, optimizer, given, tokenizer, at, rng)

    model.train()
    # The runtime shape checks (beartype over every call's signature) cost an eager step a fifth of its host
    # time (benchmarks/step_overhead.py): off in the loop and its validations, as they were afterwards.
    try:
        with shape_checks(False):
            position = training_loop(
                config, epoch_batches, lambda number, spent: scheduled_lr(config, number, spent), step, metrics.write,
                position=position, world=world, log_every=config.log_every,
                progress=Progress(config, position.step, enabled=progress and world.main),
                every=((config.eval_every, evaluate), (config.checkpoint_every, checkpoint)))
    finally:
        metrics.close()
    rng = gather_rng_states(world)
    if not world.main:
        return out_dir / "averaged.pt"
    if not checkpoint_paths(out_dir) or checkpoint_paths(out_dir)[-1].name != f"step_{position.step:07d}.pt":
        write_checkpoint(out_dir, model, optimizer, given, tokenizer, position, rng)
    plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png")
    averaged = average_checkpoints(checkpoint_paths(out_dir)[-config.keep_checkpoints:], out_dir / "averaged.pt")
    log(f"done: {position.step} steps, {position.epoch + (position.batch_in_epoch > 0)} epochs (the last one partial "
        f"if not a whole), {position.elapsed / 60:.1f} min; averaged the last "
        f"{min(len(checkpoint_paths(out_dir)), config.keep_checkpoints)} checkpoints into {averaged}")
    return averaged


def train_step(forward, model, optimizer, scaler, table: PaddedTable, indices: list[int], index: Tensor,
               pad_id: int, config, lr: float, amp_dtype, loss_fn, world: Distributed) -> tuple[Tensor, Tensor, Tensor]:
    """One optimiser step at learning rate ``lr`` on this process's share of a global batch.

    Returns the whole batch's summed loss and target tokens, and the gradients' norm before clipping,
    as tensors on the device: nothing here waits for the device (the loop reads them every
    ``config.log_every`` steps). ``loss_fn`` is :func:`.fast.loss_for`'s, ``index`` the batch's indices on the device.
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
    # The optimiser's list is model.parameters() in its order (make_optimizer), without walking the modules again.
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.clip_norm)
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
                                max_positions=config.model.max_len)
    texts = tokenizer.decode(ids)
    bleu = sacrebleu.corpus_bleu(texts, [val_refs[: len(sample)]])
    return {"val_loss": loss_sum / tokens, "val_perplexity": math.exp(loss_sum / tokens), "val_bleu": bleu.score}


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


