"""Chapter 11: two pieces of the recipe made fast on a CPU, each tested against the plain one.

A profile of five ``cpu``-preset training steps (bf16 autocast, 2 threads) put a seventh of their
time in matrix products, more than a fifth in dropout's ``bernoulli_`` (one draw of the Mersenne
Twister per element) and about a third in the loss, whose log-softmax, its backward and the
casts around it each walk the whole ``tokens × vocab`` table (``4,000 × 8,000`` floats) through
main memory. The trainer therefore uses

- :class:`PackedDropout`: the same dropout, with each 64-bit random draw deciding four elements;
- :func:`fused_label_smoothed_loss`: :func:`.recipe.label_smoothed_loss`, computed a block of
  rows at a time, so that each block's float32 work stays in the cache and the log-probabilities
  are never stored.

On a GPU both hand over to PyTorch: its dropout is already fast there, and the blocked loss would be
thousands of small kernel launches per batch, where :func:`cross_entropy_sum` (``F.cross_entropy``
with ``label_smoothing``, written out; the same value, tested) is nine. :func:`loss_for` picks by device.
"""

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import rearrange
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor, nn

_LEVELS = 1 << 16  # each element's keep-or-drop is decided by 16 random bits


class PackedDropout(nn.Dropout):
    """``nn.Dropout`` whose mask comes from 16 random bits per element, four per 64-bit draw.

    An element is kept when its 16 bits, read as a signed number, lie at or above
    ``round(p · 65536) - 32768``: probability ``1 - p'`` with ``p' = round(p · 65536) / 65536``
    (``p = 0.2`` gives ``p' = 0.1999969``). Kept elements are scaled by ``1 / (1 - p')``, so the
    expected output is the input exactly, as with ``nn.Dropout``. The draws come from PyTorch's
    generator: ``torch.manual_seed`` makes them reproducible and a resumed run continues them.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu":
            return super().forward(x)
        dropped = round(self.p * _LEVELS)
        if dropped == 0:
            return x
        if dropped == _LEVELS:
            return x * 0.0
        draws = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None)
        bits = draws.view(torch.int16)[: x.numel()].view(x.shape)
        scale = 1.0 / (1.0 - dropped / _LEVELS)
        keep = (bits >= dropped - _LEVELS // 2).to(x.dtype).mul_(scale)
        return x * keep


def swap_dropout(model: nn.Module, kind: type[nn.Dropout]) -> nn.Module:
    """``model`` with every ``nn.Dropout``, subclasses included, made a ``kind`` of the same ``p``, in place."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Dropout) and type(child) is not kind:
                setattr(module, name, kind(child.p))
    return model


def packed_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.Dropout`` replaced by a :class:`PackedDropout` of the same ``p`` (in place)."""
    return swap_dropout(model, PackedDropout)


class _FusedLabelSmoothedLoss(torch.autograd.Function):
    """Per-row loss ``lse - (1 - s) · z[target] - s · mean(z)`` and its gradient, in blocks of rows."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float, rows: int) -> Tensor:
        count, vocab = logits.shape
        compute = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(count, dtype=compute, device=logits.device)
        per_row = torch.empty(count, dtype=compute, device=logits.device)
        # One block-sized buffer, reused: a fresh multi-megabyte tensor per block costs page faults.
        work = torch.empty(min(rows, count), vocab, dtype=compute, device=logits.device)
        for start in range(0, count, rows):
            block = slice(start, start + rows)
            z = work[: len(logits[block])]
            z.copy_(logits[block])
            picked = z.gather(-1, target[block, None])[:, 0]
            mean = z.mean(-1)
            top = z.amax(-1, keepdim=True)
            block_lse = z.sub_(top).exp_().sum(-1).log_().add_(top[:, 0])
            lse[block] = block_lse
            # -log p[target] = lse - z[target]; the mean of -log p over the vocabulary = lse - mean(z).
            per_row[block] = block_lse - (1.0 - smoothing) * picked - smoothing * mean
        ctx.save_for_backward(logits, target, lse)
        ctx.smoothing, ctx.rows = smoothing, rows
        return per_row

    @staticmethod
    def backward(ctx, grad_rows: Tensor) -> tuple[Tensor, None, None, None]:
        logits, target, lse = ctx.saved_tensors
        count, vocab = logits.shape
        smoothing, rows = ctx.smoothing, ctx.rows
        grad = torch.empty_like(logits)
        work = torch.empty(min(rows, count), vocab, dtype=lse.dtype, device=logits.device)
        for start in range(0, count, rows):
            block = slice(start, start + rows)
            g = work[: len(logits[block])]
            # d/dz of the row's loss: softmax(z) - (1 - s) · onehot(target) - s / vocab.
            g.copy_(logits[block]).sub_(lse[block, None]).exp_().sub_(smoothing / vocab)
            g.scatter_add_(-1, target[block, None], torch.full_like(lse[block, None], smoothing - 1.0))
            grad[block] = g.mul_(grad_rows[block, None])
        return grad, None, None, None


@jaxtyped(typechecker=beartype)
def fused_label_smoothed_loss(
    logits: Float[Tensor, "batch tgt_len vocab"],
    target: Int[Tensor, "batch tgt_len"],
    pad_id: int,
    smoothing: float = 0.1,
    reduction: str = "mean",
    rows: int = 128,
) -> Float[Tensor, ""]:
    """:func:`.recipe.label_smoothed_loss` (same arguments, same value and gradient), ``rows`` rows at a time.

    Padding positions count for nothing: their rows' losses are masked out, so their gradient is
    exactly zero. The loss is computed in at least float32 from logits of any precision, and the
    gradient is returned in the logits' own dtype.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    real = target != pad_id
    vocab = logits.shape[-1]
    # Flattening is a view; selecting the real rows instead would copy the table and scatter its gradient back.
    per_row = _FusedLabelSmoothedLoss.apply(logits.reshape(-1, vocab), target.reshape(-1), smoothing, rows)
    total = per_row.masked_fill(~real.reshape(-1), 0.0).sum()
    if reduction == "sum":
        return total
    return total / real.sum().clamp(min=1)


@jaxtyped(typechecker=beartype)
def cross_entropy_sum(
    logits: Float[Tensor, "batch tgt_len vocab"], target: Int[Tensor, "batch tgt_len"], pad_id: int, smoothing: float
) -> Float[Tensor, ""]:
    """:func:`.recipe.label_smoothed_loss` with ``reduction="sum"`` in a handful of whole-table operations.

    It is what ``F.cross_entropy(..., ignore_index=pad_id, label_smoothing=smoothing, reduction="sum")``
    computes (tested equal), written out: ``(1 - s)`` times the summed ``-log p[target]`` of the real
    positions (``nll_loss`` skips the padding) plus ``s`` times their summed mean of ``-log p`` over the
    vocabulary. PyTorch's own call spends two more operations on its bookkeeping; on a GPU each
    operation is a kernel launch, and this one has nine for bf16 logits (a test counts them). The
    logits are taken to at least float32 first: a softmax over 8,000 entries in bf16 would round each
    probability to 3 significant digits.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    log_p = rearrange(logits, "batch tgt_len vocab -> (batch tgt_len) vocab").log_softmax(-1)
    flat_target = rearrange(target, "batch tgt_len -> (batch tgt_len)")
    picked = F.nll_loss(log_p, flat_target, ignore_index=pad_id, reduction="sum")
    spread = log_p.sum(-1).masked_fill(flat_target == pad_id, 0.0).sum()
    return torch.add(picked * (1.0 - smoothing), spread, alpha=-smoothing / log_p.shape[-1])


def loss_for(device: torch.device):
    """The summed label-smoothed loss ``(logits, target, pad_id, smoothing) -> loss`` that is fastest on ``device``.

    On the CPU the blocked :func:`fused_label_smoothed_loss` (measured faster there: it keeps each
    block in the cache); elsewhere :func:`cross_entropy_sum`, whose few kernels beat the blocks'
    thousands of launches. Both equal :func:`.recipe.label_smoothed_loss` (tested).
    """
    if device.type == "cpu":
        return lambda logits, target, pad_id, smoothing: fused_label_smoothed_loss(logits, target, pad_id, smoothing,
                                                                                  "sum")
    return cross_entropy_sum
