"""Checks for chapter 01: scaled dot-product attention and attention entropy."""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stepformer.checks._core import CheckFailure, call, check, close, difference, expect_tensor, kind, passed, show

AXES = ("batch", "heads", "q_len", "k_len", "d_k", "d_v")
# What exercise 1 asks students to write themselves.
BUILT_IN_ATTENTION = {
    "torch.nn.functional.scaled_dot_product_attention": "PyTorch's built-in attention",
    "torch.nn.functional.multi_head_attention_forward": "PyTorch's built-in multi-head attention",
    "torch.nn.MultiheadAttention": "PyTorch's built-in multi-head attention",
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis changes a shape and cannot pass."""
    if seed == 0:
        return dict(zip(AXES, (2, 3, 5, 7, 4, 6), strict=True))
    picks = torch.randperm(8, generator=torch.Generator().manual_seed(seed))[: len(AXES)] + 2
    return dict(zip(AXES, picks.tolist(), strict=True))


def _qkv(seed: int, dtype: torch.dtype, scale: float = 1.0) -> tuple[dict[str, int], Tensor, Tensor, Tensor]:
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s["batch"], s["heads"], s["q_len"], s["d_k"], generator=g, dtype=dtype) * scale
    k = torch.randn(s["batch"], s["heads"], s["k_len"], s["d_k"], generator=g, dtype=dtype) * scale
    v = torch.randn(s["batch"], s["heads"], s["k_len"], s["d_v"], generator=g, dtype=dtype)
    return s, q, k, v


def _result(fn: Callable[..., Any], s: dict[str, int], dtype: torch.dtype, *args: Any) -> tuple[Tensor, Tensor]:
    result = call(fn, *args)
    if not isinstance(result, tuple) or len(result) != 2:
        raise CheckFailure(
            f"scaled_dot_product_attention should return a pair (output, weights), got {kind(result)}."
        )
    b, h, q_len, k_len, d_v = s["batch"], s["heads"], s["q_len"], s["k_len"], s["d_v"]
    output = expect_tensor(result[0], "output", (b, h, q_len, d_v), "batch heads q_len d_v", dtype)
    weights = expect_tensor(result[1], "weights", (b, h, q_len, k_len), "batch heads q_len k_len", dtype)
    return output, weights


def _mask_variants(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The outputs of the common ways to get a mask wrong, each computed in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = mask.expand_as(scores)
    minus_inf = torch.tensor(-torch.inf, dtype=torch.float64)

    def attend(weights: Tensor) -> Tensor:
        return torch.nan_to_num(weights) @ v

    return {
        "Your mask is inverted: True means 'may attend', so fill the scores where the mask is False.":
            F.scaled_dot_product_attention(q, k, v, attn_mask=~mask),
        "You masked after the softmax: the masked keys get 0 but the rest no longer sum to 1. Fill the scores "
        "with -inf before the softmax.": attend(torch.softmax(scores, dim=-1) * mask),
        "You filled the masked scores with 0, which is an ordinary score: fill them with -inf.":
            attend(torch.softmax(scores.masked_fill(~mask, 0.0), dim=-1)),
        "You added the mask to the scores as numbers: use it to choose, torch.where(mask, scores, -inf) or "
        "scores.masked_fill(~mask, -inf).": attend(torch.softmax(scores + mask.double(), dim=-1)),
        "You took the softmax over the query axis: take it over k_len (dim=-1).":
            attend(torch.softmax(torch.where(mask, scores, minus_inf), dim=-2)),
    }


def _diagnose(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, output: Tensor, weights: Tensor) -> str:
    """Name the likely mistake by comparing with the oracle under each common error; the last resort says
    where the output differs, on which sizes."""
    dtype, d_k = q.dtype, q.shape[-1]
    sizes = dict(zip(AXES, (*q.shape[:3], k.shape[2], d_k, v.shape[-1]), strict=True))
    if torch.isnan(weights).any() or torch.isnan(output).any():
        # A softmax over the query axis gives NaN wherever a key is masked for every query.
        columns = torch.nan_to_num(weights).sum(-2)
        reached = mask.expand_as(weights).any(-2) if mask is not None else torch.ones_like(columns, dtype=torch.bool)
        if weights.shape[-2] > 1 and close(columns[reached], torch.ones_like(columns[reached]), dtype, 1e-4):
            return "You took the softmax over the query axis: take it over k_len (dim=-1)."
        return (
            "Your result contains NaN. If you wrote exp() yourself, subtract each row's maximum "
            "first (or use torch.softmax); a row with every key masked must give zeros, not NaN."
        )
    sums_k, sums_q = weights.sum(-1), weights.sum(-2)
    if mask is None and not close(sums_k, torch.ones_like(sums_k), dtype):
        if close(sums_q, torch.ones_like(sums_q), dtype):
            return "Your weights sum to 1 over the query axis: take the softmax over k_len (dim=-1), not q_len."
        return "Each row of your weights should sum to 1 over k_len: is softmax applied at all?"
    variants = {
        hint: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        for hint, scale in (("You did not divide the scores by sqrt(d_k).", 1.0),
                            ("You divided the scores by d_k: divide by sqrt(d_k).", 1.0 / d_k),
                            ("You multiplied the scores by sqrt(d_k): divide by it instead.", math.sqrt(d_k)))
    }
    if mask is not None:
        variants.update({hint: out.to(dtype) for hint, out in _mask_variants(q, k, v, mask).items()})
    for hint, expected in variants.items():
        if close(output, expected, dtype, 1e-4 if dtype == torch.float32 else None):
            return hint
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask).to(dtype)
    return (f"Your output differs from the oracle's ({difference(output, expected, sizes)}), and matches none of "
            "the common mistakes. Compare your scores with q @ k.transpose(-2, -1) / sqrt(d_k) and your weights "
            "with their softmax over k_len on a small example.")


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_shapes(fn: Callable[..., Any], seed: int = 0) -> None:
    """output is (batch, heads, q_len, d_v) and weights (batch, heads, q_len, k_len)."""
    for dtype in (torch.float32, torch.float64):
        s, q, k, v = _qkv(seed, dtype)
        _result(fn, s, dtype, q, k, v)
    passed("shapes and dtypes are right")


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_values(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.functional.scaled_dot_product_attention without a mask, large scores included."""
    for scale, label in ((1.0, "random"), (30.0, "large")):
        s, q, k, v = _qkv(seed, dtype, scale)
        output, weights = _result(fn, s, dtype, q, k, v)
        scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(s["d_k"])
        # Scores in the thousands carry rounding of eps * |score| into the softmax, in any correct
        # code, PyTorch's included: compare with float64 at that tolerance. Overflow (NaN, inf) or a
        # missing max-subtraction is off by far more.
        tolerance = max(1e-5 if dtype == torch.float32 else 1e-10,
                        2 * torch.finfo(dtype).eps * scores.abs().max().item())
        expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).to(dtype)
        if not close(output, expected, dtype, tolerance):
            raise CheckFailure(
                f"With {label} scores, your output differs from PyTorch's: {_diagnose(q, k, v, None, output, weights)}"
            )
        if not close(weights, torch.softmax(scores, dim=-1).to(dtype), dtype, tolerance):
            raise CheckFailure(
                "Your output is right but the weights you return are not softmax(q kᵀ / sqrt(d_k)): "
                "return the weights that you multiplied v by."
            )
    passed(f"equal to torch.nn.functional.scaled_dot_product_attention ({str(dtype).removeprefix('torch.')})")


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_mask(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Masked keys get zero weight, masks broadcast, and a fully masked row gives zeros, not NaN."""
    s, q, k, v = _qkv(seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    b, h, q_len, k_len = s["batch"], s["heads"], s["q_len"], s["k_len"]
    full = torch.rand(b, h, q_len, k_len, generator=g) < 0.6
    full[..., 0] = True  # at least one key per row, so the oracle is well defined
    lengths = torch.randint(1, k_len + 1, (b,), generator=g)
    padding = torch.arange(k_len).expand(b, 1, 1, k_len) < lengths.view(b, 1, 1, 1)
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    for name, mask in (("a random (batch, heads, q_len, k_len)", full), ("a padding (batch, 1, 1, k_len)", padding),
                       ("a causal (q_len, k_len)", causal)):
        output, weights = _result(fn, s, dtype, q, k, v, mask)
        if not close(output, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), dtype):
            raise CheckFailure(f"With {name} mask: {_diagnose(q, k, v, mask, output, weights)}")
        leaked = weights.masked_select(~mask.expand_as(weights))
        if leaked.numel() and leaked.abs().max() != 0:
            raise CheckFailure(
                f"With {name} mask, masked keys got weight up to {leaked.abs().max().item():.3g}; "
                "they must get exactly 0 (fill their scores with -inf before the softmax)."
            )
    blind = full.clone()
    blind[:, :, 1, :] = False
    output, weights = _result(fn, s, dtype, q, k, v, blind)
    row_out, row_w = output[:, :, 1], weights[:, :, 1]
    if torch.isnan(row_out).any() or torch.isnan(row_w).any():
        raise CheckFailure(
            "A query whose keys are all masked gives NaN (softmax of all -inf). Give such rows zero "
            "weights and a zero output: e.g. find them with mask.any(dim=-1, keepdim=True)."
        )
    if row_out.abs().max() != 0 or row_w.abs().max() != 0:
        raise CheckFailure(
            "A query whose keys are all masked should get zero weights and a zero output, "
            f"got weights {show(row_w[0, 0])}."
        )
    passed("masks: masked keys get 0, masks broadcast, a fully masked row gives zeros")


@check
def check_attention_entropy(fn: Callable[..., Any], seed: int = 0) -> None:
    """Equal to torch.distributions.Categorical's entropy; 0·log 0 counts as 0."""
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s["batch"], s["heads"], s["q_len"], s["k_len"], generator=g, dtype=torch.float64)
    weights = torch.softmax(logits, dim=-1)
    expected = torch.distributions.Categorical(probs=weights).entropy()
    got = expect_tensor(call(fn, weights), "entropy", tuple(expected.shape), "batch heads q_len", torch.float64)
    if not close(got, expected, torch.float64):
        if close(got, -expected, torch.float64):
            raise CheckFailure("Your entropy has the wrong sign: H = -Σ p log p is never negative.")
        if close(got, expected / math.log(2), torch.float64):
            raise CheckFailure("You used log base 2: the course measures entropy in nats (natural log).")
        raise CheckFailure("Your entropy differs from -Σ_k p log p summed over the k_len axis.")
    one_hot = torch.zeros_like(weights)
    one_hot[..., 0] = 1.0
    got = call(fn, one_hot)
    if torch.isnan(got).any() or not close(got, torch.zeros_like(got), torch.float64):
        raise CheckFailure(
            "Weights with zeros give NaN or a nonzero entropy: 0·log 0 must count as 0 "
            "(torch.where(p > 0, p * p.log(), 0.0))."
        )
    passed("equal to torch.distributions.Categorical(probs=weights).entropy()")


@check(forbid=BUILT_IN_ATTENTION)
def check_entropy_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """Unscaled entropy collapses as d_k grows; scaled entropy stays put; both agree with a fresh sample."""
    k_len = 16
    table = {}
    for d_k in (4, 64, 256):
        for scale in (True, False):
            value = call(fn, d_k, scale=scale, q_len=12, k_len=k_len, samples=48, seed=seed)
            if type(value) is not float:
                raise CheckFailure(
                    f"mean_attention_entropy should return a Python float (use .item()), got {kind(value)}."
                )
            if not 0.0 <= value <= math.log(k_len) + 1e-9:
                raise CheckFailure(
                    f"An entropy over {k_len} keys lies in [0, log {k_len}] = [0, {math.log(k_len):.3f}], "
                    f"got {value:.3f}."
                )
            table[d_k, scale] = value
    g = torch.Generator().manual_seed(seed + 7)
    for (d_k, scale), value in table.items():
        q = torch.randn(256, 12, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(256, k_len, d_k, generator=g, dtype=torch.float64)
        scores = q @ k.transpose(-2, -1) / (math.sqrt(d_k) if scale else 1.0)
        reference = torch.distributions.Categorical(logits=scores).entropy().mean().item()
        if abs(value - reference) > 0.15:
            hint = (
                "Did you divide by sqrt(d_k) only when scale=True?" if not scale
                else "Are q and k unit-variance (torch.randn)?"
            )
            raise CheckFailure(
                f"For d_k={d_k}, scale={scale} you measured {value:.3f} nats; a fresh sample gives "
                f"about {reference:.3f}. {hint}"
            )
    passed(
        f"unscaled entropy falls from {table[4, False]:.2f} to {table[256, False]:.2f} nats as d_k goes 4 → 256; "
        f"scaled stays near {table[256, True]:.2f}"
    )
