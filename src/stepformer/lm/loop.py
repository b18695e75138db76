"""The training loop of the three experiments, on :func:`stepformer.runs.training_loop`: AdamW, warmup and
cosine decay, clipping, held-out evaluations, a JSON-lines log."""

import math
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from stepformer.lm.config import RunConfig
from stepformer.lm.data import Captions, caption_batches, collate_captions
from stepformer.lm.measure import step_bytes
from stepformer.runs import Budget, MetricsLog, Position, Progress, StepResult, adamw, training_loop


def cosine_lr(step: int, spent: float, peak_lr: float, warmup: int, min_lr: float) -> float:
    """Linear warmup over the first ``warmup`` steps, then a half cosine from ``peak_lr`` to ``min_lr · peak_lr``.

    ``step`` counts from 1; ``spent`` is the fraction of the budget used
    (:func:`stepformer.runs.budget_fraction`), so the cosine ends where the budget does, in steps or in minutes.
    """
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if step <= warmup:
        return peak_lr * step / warmup
    return peak_lr * (min_lr + (1.0 - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(spent, 1.0))))


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def train_loop(
    model: nn.Module,
    train: Captions,
    step_loss: Callable[[nn.Module, Tensor, torch.Generator], Tensor],
    run: RunConfig,
    budget: Budget,
    peak_lr: float,
    pad_id: int,
    device: torch.device,
    phase: str,
    warmup: int | None = None,
    evaluate: Callable[[], dict] | None = None,
    metrics=None,
    progress: bool = True,
    measure_memory: bool = False,
) -> dict:
    """Train ``model`` on ``train`` until ``budget`` is spent (:func:`stepformer.runs.training_loop`); its record:
    steps, time, the loss curve.

    ``step_loss(model, tokens, generator)`` gives a batch's loss; ``generator`` is seeded from
    ``run.seed`` (BERT's masking draws from it), as are the batches and their order, so the same
    seed and a budget in steps give the same losses. Every ``run.eval_every`` steps, and at the
    end, ``evaluate()`` adds a held-out point. Each step and each evaluation is a line of
    ``metrics`` (JSON, tagged with ``phase``). ``measure_memory`` counts the bytes that the first
    step holds (:func:`step_bytes`).
    """
    warmup = run.warmup if warmup is None else warmup
    # Matrices and embeddings decayed, norms and biases not (adamw's default).
    optimizer = adamw(model, peak_lr, run.betas, run.weight_decay)
    generator = torch.Generator().manual_seed(run.seed)
    log = MetricsLog(metrics, phase=phase)
    curve, evaluations, seen = [], [], {"tokens": 0, "evaluating_s": 0.0, "memory": None}

    def step(indices: list[int], lr: float) -> StepResult:
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = collate_captions(train, indices, pad_id)
        count = int((batch != pad_id).sum())  # tokens read, for tokens/s (counted before the copy to the device)
        tokens = batch.to(device)
        if measure_memory and seen["memory"] is None:
            loss, grad_norm, seen["memory"] = step_bytes(model, optimizer, tokens, step_loss, generator,
                                                          run.clip_norm, device)
        else:
            loss = step_loss(model, tokens, generator)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), run.clip_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepResult(loss.detach(), count, grad_norm)

    def write(record: dict) -> None:
        curve.append([record["step"], record["loss"]])
        seen["tokens"] += record["tokens"]
        log.write(record)

    def held_out(at: Position) -> None:
        evaluation_started = time.perf_counter()
        evaluations.append({"step": at.step, **evaluate()})
        log.write(evaluations[-1])
        model.train()
        seen["evaluating_s"] += time.perf_counter() - evaluation_started

    model.train()
    started = time.perf_counter()
    end = training_loop(
        budget, lambda epoch: caption_batches(train, run.max_tokens, run.seed, epoch),
        lambda number, spent: cosine_lr(number, spent, peak_lr, warmup, run.min_lr), step, write,
        progress=Progress(budget, 0, enabled=progress), log_every=run.log_every,
        every=((run.eval_every, held_out),) if evaluate is not None else ())
    wall = time.perf_counter() - started
    if evaluate is not None and (not evaluations or evaluations[-1]["step"] != end.step):
        evaluations.append({"step": end.step, **evaluate()})
        log.write(evaluations[-1])
    # The budget is wall-clock, evaluations included; the speed is the training steps' own.
    return {"steps": end.step, "epochs": round(end.epochs, 3), "wall_s": round(wall, 2),
            "evaluating_s": round(seen["evaluating_s"], 2), "tokens": seen["tokens"],
            "tokens_per_s": round(seen["tokens"] / max(wall - seen["evaluating_s"], 1e-9), 1),
            "peak_lr": peak_lr, "warmup": warmup, "loss_curve": _thin(curve), "evaluations": evaluations,
            "trainable_parameters": trainable_parameters(model), "step_memory": seen["memory"]}


def _thin(curve: list[list], points: int = 100) -> list[list]:
    """About ``points`` points of a loss curve, each the mean loss of the steps up to it since the previous one."""
    size = max(1, math.ceil(len(curve) / points))
    return [[curve[min(i + size, len(curve)) - 1][0], round(sum(loss for _, loss in curve[i:i + size])
                                                           / len(curve[i:i + size]), 4)]
            for i in range(0, len(curve), size)]
