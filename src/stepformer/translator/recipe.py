"""Chapter 11: the training recipe's pieces, each one function: the loss, the learning rate, one
training step, one beam step.

These are what the capstone exercise asks students to write; the trainer (:mod:`.train`, which
adds mixed precision and several processes around the same step) and the decoder
(:mod:`.search`) use them as they are here, except the loss, which the trainer computes in
cache-sized blocks (:mod:`.fast`, tested equal to :func:`label_smoothed_loss`).
"""

import math

import torch
from beartype import beartype
from einops import rearrange, reduce
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor, nn


@jaxtyped(typechecker=beartype)
def label_smoothed_loss(
    logits: Float[Tensor, "batch tgt_len vocab"],
    target: Int[Tensor, "batch tgt_len"],
    pad_id: int,
    smoothing: float = 0.1,
    reduction: str = "mean",
) -> Float[Tensor, ""]:
    """Cross-entropy against a smoothed target, ignoring padding (Szegedy et al. 2016; section 5.4 of the paper).

    The target distribution puts ``1 - smoothing`` on the right token and spreads ``smoothing``
    evenly over all ``vocab`` tokens, so each position's loss is
    ``(1 - smoothing) · (-log p[target]) + smoothing · mean over the vocabulary of (-log p)``,
    PyTorch's ``label_smoothing`` convention. Positions whose target is ``pad_id`` count for
    nothing, neither in the sum nor in the number of tokens. ``reduction="mean"`` divides by the
    number of real tokens (0 when there are none), ``"sum"`` does not: the trainer sums over a
    batch split between processes and divides by the whole batch's token count once.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    # At least float32 for the log-softmax (float64 stays float64): under bf16 autocast the logits
    # are bf16, and a bf16 log-probability has 3 significant digits.
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    nll = -log_probs.gather(-1, target[..., None])[..., 0]
    uniform = -reduce(log_probs, "batch tgt_len vocab -> batch tgt_len", "mean")
    per_token = (1.0 - smoothing) * nll + smoothing * uniform
    real = target != pad_id
    total = per_token.masked_fill(~real, 0.0).sum()
    if reduction == "sum":
        return total
    return total / real.sum().clamp(min=1)


def inverse_sqrt_lr(step: int, peak_lr: float, warmup: int) -> float:
    """The learning rate at optimiser step ``step`` (1, 2, ...): linear warmup, then 1/sqrt decay.

    ``peak_lr · min(step / warmup, sqrt(warmup / step))``: it rises in a straight line to
    ``peak_lr`` at ``step == warmup`` and then falls as ``1 / sqrt(step)``. This is the schedule
    of section 5.3 of the paper, ``d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)``, written with
    its peak as the one number to tune: the paper's peak is ``(d_model · warmup)^-0.5``.
    """
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 step, got {warmup}")
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    return peak_lr * min(step / warmup, math.sqrt(warmup / step))


@jaxtyped(typechecker=beartype)
def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    src: Int[Tensor, "batch src_len"],
    tgt: Int[Tensor, "batch tgt_len"],
    pad_id: int,
    lr: float,
    smoothing: float = 0.1,
    clip_norm: float = 1.0,
) -> float:
    """One optimiser step of teacher forcing on a batch; returns the batch's loss before the step.

    ``tgt`` is ``<s> y_1 ... y_n </s>`` (then padding): the decoder reads ``tgt[:, :-1]`` and
    every position is trained, all at once, to predict the next token, ``tgt[:, 1:]``, with
    :func:`label_smoothed_loss`. The gradients' global norm is clipped to ``clip_norm`` (one
    unlucky batch cannot throw the weights far), every parameter group gets ``lr``, then the
    optimiser steps and the gradients are cleared.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(src, tgt[:, :-1])
    loss = label_smoothed_loss(logits, tgt[:, 1:], pad_id, smoothing)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@jaxtyped(typechecker=beartype)
def memorise(
    model: nn.Module,
    src: Int[Tensor, "batch src_len"],
    tgt: Int[Tensor, "batch tgt_len"],
    pad_id: int,
    steps: int = 150,
    peak_lr: float = 1e-2,
    warmup: int = 20,
) -> list[float]:
    """Learn one batch by heart: ``steps`` calls of :func:`train_step` on it; every step's loss.

    AdamW with the paper's betas (0.9, 0.98); step ``s`` (1, 2, ...) has the learning rate
    ``inverse_sqrt_lr(s, peak_lr, warmup)``; no label smoothing, so that the loss can reach 0.
    """
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.98))
    return [
        train_step(model, optimizer, src, tgt, pad_id, inverse_sqrt_lr(step, peak_lr, warmup), smoothing=0.0)
        for step in range(1, steps + 1)
    ]


@jaxtyped(typechecker=beartype)
def beam_step(
    scores: Float[Tensor, "batch beam"], log_probs: Float[Tensor, "batch beam vocab"], k: int
) -> tuple[Float[Tensor, "batch k"], Int[Tensor, "batch k"], Int[Tensor, "batch k"]]:
    """One step of beam search: the ``k`` best one-token extensions of all the beams of each sentence.

    ``scores`` are the beams' summed log-probabilities so far, ``log_probs`` the next token's
    log-probabilities after each beam. A candidate is a (beam, token) pair scored
    ``scores[beam] + log_probs[beam, token]``; all ``beam · vocab`` candidates of a sentence
    compete together, so a strong beam may supply several of the ``k`` winners and a weak one
    none. Returns the winners' scores (best first), the beam each extends and its token.
    A beam with score ``-inf`` (an unused slot, as at the first step) never wins.
    """
    vocab = log_probs.shape[-1]
    if not 1 <= k <= log_probs.shape[1] * vocab:
        raise ValueError(f"k must be between 1 and beam · vocab = {log_probs.shape[1] * vocab}, got {k}")
    candidates = rearrange(scores, "batch beam -> batch beam 1") + log_probs
    # Beam outermost, token innermost: candidate c is (beam c // vocab, token c % vocab).
    best, flat_index = rearrange(candidates, "batch beam vocab -> batch (beam vocab)").topk(k, dim=-1)
    return best, flat_index // vocab, flat_index % vocab

