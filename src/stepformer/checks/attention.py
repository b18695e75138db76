"""Checks for chapter 01: scaled dot-product attention (with its mask and dropout) and attention entropy."""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import einsum
from jaxtyping import Bool, Float, jaxtyped
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    call,
    check,
    close,
    difference,
    distinct_sizes,
    dtype_name,
    expect_tensor,
    kind,
    passed,
    show,
)
from stepformer.checks._messages import marked, t
from stepformer.checks._noise import SPREAD_CALLS, SPREAD_THRESHOLD

AXES = ("batch", "heads", "q_len", "k_len", "d_k", "d_v")
# What exercise 1 asks students to write themselves.
BUILT_IN_ATTENTION = {
    "torch.nn.functional.scaled_dot_product_attention": marked("PyTorch's built-in attention"),
    "torch.nn.functional.multi_head_attention_forward": marked("PyTorch's built-in multi-head attention"),
    "torch.nn.MultiheadAttention": marked("PyTorch's built-in multi-head attention"),
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis changes a shape and cannot pass."""
    return distinct_sizes(seed, AXES, span=8, fixed=(2, 3, 5, 7, 4, 6))


def _qkv(seed: int, dtype: torch.dtype, scale: float = 1.0) -> tuple[dict[str, int], Tensor, Tensor, Tensor]:
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s["batch"], s["heads"], s["q_len"], s["d_k"], generator=g, dtype=dtype) * scale
    k = torch.randn(s["batch"], s["heads"], s["k_len"], s["d_k"], generator=g, dtype=dtype) * scale
    v = torch.randn(s["batch"], s["heads"], s["k_len"], s["d_v"], generator=g, dtype=dtype)
    return s, q, k, v


def _lead_names(count: int) -> tuple[str, ...]:
    """The names of ``count`` leading axes, the innermost last: (batch, heads), (heads,) or ()."""
    return ("batch", "heads")[2 - count:] if count else ()


def _sizes_of(q: Tensor, k: Tensor, v: Tensor) -> dict[str, int]:
    """The sizes of one call, named, for messages: its leading axes, then q_len, k_len, d_k, d_v."""
    lead = dict(zip(_lead_names(q.dim() - 2), q.shape[:-2], strict=True))
    return {**lead, "q_len": q.shape[-2], "k_len": k.shape[-2], "d_k": q.shape[-1], "d_v": v.shape[-1]}


def _expect_kept(x: Any, what: str, shape: tuple[int, ...], axes: str, dtype: torch.dtype) -> Tensor:
    """:func:`expect_tensor`, which also names the usual cause of a lost axis of size 1 (batch=1, heads=1)."""
    if type(x) is Tensor and tuple(x.shape) != shape and tuple(x.shape) == tuple(n for n in shape if n != 1):
        named = ", ".join(f"{a}={n}" for a, n in zip(axes.split(), shape, strict=True))
        raise CheckFailure(t(
            "{what} should have shape ({named}), got {shape}: the axes of size 1 are gone. "
            "squeeze() without an axis drops every axis of size 1, batch and heads included when they are 1: "
            "squeeze only the axis you mean (squeeze(dim)), or use rearrange with named axes.",
            what=what, named=named, shape=tuple(x.shape)))
    return expect_tensor(x, what, shape, axes, dtype)


def _first_line(failure: CheckFailure) -> str:
    """The first line of a failure, ending a sentence (an exception's text may run over many lines)."""
    line = str(failure).splitlines()[0].rstrip(" .:")
    return line + "."


def _result(fn: Callable[..., Any], dtype: torch.dtype, q: Tensor, k: Tensor, v: Tensor,
            mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Call ``fn`` on inputs with any leading axes; check the pair's types, shapes and dtypes."""
    s = _sizes_of(q, k, v)
    lead = [f"{a}={n}" for a, n in s.items()][: q.dim() - 2]
    try:
        result = call(fn, q, k, v) if mask is None else call(fn, q, k, v, mask)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        same_with_dropout = _raise_if_only_without_dropout(fn, q, k, v, mask, failure)
        if mask is None:
            _raise_if_only_without_mask(fn, q, k, v, failure, same_with_dropout)
        if q.dim() == 4:
            raise
        shape = ", ".join([*lead, f"q_len={s['q_len']}", f"d_k={s['d_k']}"])
        advice = t("The leading axes are *batch, any number of them, none included: write einsum patterns with '...' "
                   "(\"... q_len d_k, ... k_len d_k -> ... q_len k_len\") and transpose with transpose(-2, -1), never "
                   "with fixed axis numbers.")
        if q.dim() == 2:
            message = t("On q of shape ({shape}), with no leading axes instead of (batch, heads): {error} {advice}",
                        shape=shape, error=_first_line(failure), advice=advice)
        elif q.dim() == 3:
            message = t("On q of shape ({shape}), with 1 leading axis instead of (batch, heads): {error} {advice}",
                        shape=shape, error=_first_line(failure), advice=advice)
        else:
            message = t("On q of shape ({shape}), with {count} leading axes instead of (batch, heads): {error} "
                        "{advice}", shape=shape, count=q.dim() - 2, error=_first_line(failure), advice=advice)
        # Reworded, not a new CheckFailure: the failure keeps what the code raised (error, text), which
        # check_attention_mask reads.
        raise failure.reworded(message) from None
    return _pair(result, dtype, q, k, v)


def _pair(result: Any, dtype: torch.dtype, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The (output, weights) of one call on these inputs, their types, shapes and dtypes checked."""
    s = _sizes_of(q, k, v)
    if not isinstance(result, tuple) or len(result) != 2:
        raise CheckFailure(t("scaled_dot_product_attention should return a pair (output, weights), got {kind}.",
                             kind=kind(result)))
    names = list(_lead_names(q.dim() - 2))
    sizes = [s[a] for a in names]
    output = _expect_kept(result[0], t("output"), (*sizes, s["q_len"], s["d_v"]), " ".join([*names, "q_len d_v"]),
                         dtype)
    weights = _expect_kept(result[1], t("weights"), (*sizes, s["q_len"], s["k_len"]),
                          " ".join([*names, "q_len k_len"]), dtype)
    return output, weights


def _raise_if_only_without_dropout(fn: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                                   failure: CodeRaised) -> bool:
    """A call without dropout (dropout=None, the default) raised on a None: if the same call with a dropout that
    changes nothing (nn.Identity()) runs, the dropout=None path is what fails; say so. Otherwise: whether that call
    raised the same error."""
    if "NoneType" not in failure.text:
        return False
    try:
        call(fn, q, k, v, mask, dropout=nn.Identity())
    except CheckFailure as again:
        return isinstance(again, CodeRaised) and again.raised == failure.raised
    raise failure.reworded(t(
        "{error} Called without dropout (dropout=None, the default), your function fails on a "
        "None, but the same call with dropout=nn.Identity() (which changes nothing) runs: the None it used is "
        "dropout=None. Apply dropout only when one is given: `if dropout is not None:`.", error=_first_line(failure)
    )) from None


def _raise_if_only_without_mask(fn: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor,
                                failure: CodeRaised, same_with_dropout: bool) -> None:
    """A call without a mask raised: if the same call with an all-True mask (which hides nothing) runs, the
    mask=None path is what fails; say so. ``same_with_dropout``: the call with a dropout given raised the same."""
    if "'NoneType' object has no attribute" in failure.text:
        if same_with_dropout:
            message = t("{error} Called without a mask, your function used a None as a tensor, and with a dropout "
                        "given it raises the same: the only None left is mask=None. Look at each "
                        "`if mask is not None:` test and at what runs when there is no mask.",
                        error=_first_line(failure))
        else:
            message = t("{error} Called without a mask, your function used a None as a tensor, and the Nones it was "
                        "given are mask=None and dropout=None. Look at each `if mask is not None:` test and at what "
                        "runs when there is no mask.", error=_first_line(failure))
        raise failure.reworded(message) from None
    everything = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    try:
        call(fn, q, k, v, everything)
    except CheckFailure:
        return
    raise failure.reworded(t(
        "{error} Without a mask your function raises, but the same call with an all-True mask "
        "(which hides nothing) runs: the mask=None path is what fails. Look at each `if mask is not None:` "
        "branch and at any name that only the masked path defines.", error=_first_line(failure)
    )) from None


def _samples(q: Tensor, k: Tensor, v: Tensor) -> list[tuple[str, Tensor, Tensor, Tensor]]:
    """The same inputs with (batch, heads), batch=1, (heads,) and no leading axes: *batch means any."""
    return [("", q, k, v), (t(" (batch=1)"), q[:1], k[:1], v[:1]),
            (t(" (3-D inputs: heads, seq, d)"), q[0], k[0], v[0]),
            (t(" (2-D inputs: seq, d)"), q[0, 0], k[0, 0], v[0, 0])]


def _mask_variants(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The outputs of the common ways to get a mask wrong, each computed in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = mask.expand_as(scores)
    minus_inf = torch.tensor(-torch.inf, dtype=torch.float64)

    def attend(weights: Tensor) -> Tensor:
        return torch.nan_to_num(weights) @ v

    return {
        t("Your mask is inverted: True means 'may attend', so fill the scores where the mask is False."):
            F.scaled_dot_product_attention(q, k, v, attn_mask=~mask),
        t("You masked after the softmax: the masked keys get 0 but the rest no longer sum to 1. Fill the scores "
          "with -inf before the softmax."): attend(torch.softmax(scores, dim=-1) * mask),
        t("You filled the masked scores with 0, which is an ordinary score: fill them with -inf."):
            attend(torch.softmax(scores.masked_fill(~mask, 0.0), dim=-1)),
        t("You added the mask to the scores as numbers: use it to choose, torch.where(mask, scores, -inf) or "
          "scores.masked_fill(~mask, -inf)."): attend(torch.softmax(scores + mask.double(), dim=-1)),
        t("You took the softmax over the query axis: take it over k_len (dim=-1)."):
            attend(torch.softmax(torch.where(mask, scores, minus_inf), dim=-2)),
    }


def _guarded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, fill_where: bool = False, reduction: str = "any",
             dim: int = -1, keepdim: bool = True, neutral_where: bool = False, zero_where: bool = False) -> Tensor:
    """The solution's guard of fully masked rows, in float64, with a switch for each way to get it wrong:
    fill the scores where the mask is True, find the rows with ``mask.all`` or along ``dim=-2`` or without
    ``keepdim``, neutralise (scores set to 0) or zero (weights) the rows that have a key instead of those without."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    has_key = getattr(mask, reduction)(dim=dim, keepdim=keepdim)
    scores = scores.masked_fill(mask if fill_where else ~mask, -math.inf)
    scores = scores.masked_fill(has_key if neutral_where else ~has_key, 0.0)
    weights = torch.softmax(scores, dim=-1).masked_fill(has_key if zero_where else ~has_key, 0.0)
    return weights @ v


def _same(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> bool:
    """Equal to the tolerance of :func:`_hint`, NaN where NaN is expected: a written-out mistake may give NaN."""
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    return actual.shape == expected.shape and bool(
        torch.isclose(actual.double(), expected.double(), rtol=tolerance, atol=tolerance, equal_nan=True).all())


def _guard_mistake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, output: Tensor) -> str | None:
    """The one mistake in the guard of fully masked rows (or in the mask's sense) that reproduces ``output``,
    NaN included, where exactly one does and the correct output differs from it."""
    correct = _guarded(q, k, v, mask)
    inverted = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=~mask)
    variants = {
        t("Your mask is inverted: True means 'may attend', so fill the scores where the mask is False."):
            [inverted, inverted.nan_to_num(0.0), _guarded(q, k, v, mask, fill_where=True)],
        t("You zeroed every query that has at least one masked key: the rows to zero are the queries with no key "
          "at all, mask.any(dim=-1, keepdim=True), not those where not every key is allowed (mask.all)."):
            [_guarded(q, k, v, mask, reduction="all")],
        t("You looked for fully masked rows over the query axis: mask.any(dim=-2) tells which keys some query may "
          "read. A query with no key is a row of the mask: reduce over k_len, mask.any(dim=-1, keepdim=True)."):
            [_guarded(q, k, v, mask, dim=-2)],
        t("The rows whose scores you set to 0 before the softmax are the queries that have a key (has_key), not "
          "those without one (~has_key): their weights spread evenly over every key, masked ones included."):
            [_guarded(q, k, v, mask, neutral_where=True)],
        t("The rows whose weights you zero after the softmax are the queries that have a key (has_key), not those "
          "without one (~has_key)."): [_guarded(q, k, v, mask, zero_where=True)],
    }
    found = [hint for hint, outs in variants.items()
             if any(_same(output, out, output.dtype) and not _same(out, correct, output.dtype) for out in outs)]
    return found[0] if len(found) == 1 else None


def _keepdim_mistake(fn: Callable[..., Any], dtype: torch.dtype, seed: int) -> str | None:
    """After a shape error with a mask: on square 2-D inputs (q_len = k_len), where a (q_len,) row test lines up
    with the key axis without an error, does the student's output equal the guard written without keepdim?"""
    g = torch.Generator().manual_seed(seed + 11)
    n = 6
    q, k, v = (torch.randn(n, n, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.rand(n, n, generator=g) < 0.6
    mask[:, 0] = True
    mask[2] = False  # one query with no key, so that the row test matters
    try:
        output = call(fn, q, k, v, mask)
    except CheckFailure:
        return None
    output = output[0] if isinstance(output, tuple) and len(output) == 2 else output
    if type(output) is not Tensor:
        return None
    lost = _guarded(q, k, v, mask, keepdim=False)
    if not (_same(output, lost, dtype) and not _same(lost, _guarded(q, k, v, mask), dtype)):
        return None
    return t("On square inputs (q_len = k_len = 6, 2-D) the same code runs and equals the guard of fully masked rows "
             "written without keepdim: mask.any(dim=-1) has shape (..., q_len), which lines up with the k_len axis "
             "of the scores instead of standing beside it. Keep the reduced axis: mask.any(dim=-1, keepdim=True).")


def _diagnose(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, output: Tensor, weights: Tensor) -> str:
    """Name the likely mistake by comparing with the oracle under each common error; the last resort says
    where the output differs. Either way, say by how much and on which sizes."""
    dtype = q.dtype
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask).to(dtype)
    found = difference(output, expected, _sizes_of(q, k, v))
    hint = _hint(q, k, v, mask, output, weights)
    if hint is None:
        return t("Your output differs from the oracle's ({found}), and matches none of the common mistakes. "
                 "Compare your scores with q @ k.transpose(-2, -1) / sqrt(d_k) and your weights with their softmax "
                 "over k_len on a small example.", found=found)
    return t("{hint} (Your output: {found}.)", hint=hint, found=found)


def _hint(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, output: Tensor, weights: Tensor) -> str | None:
    """The common mistake that reproduces the student's output, if one does."""
    dtype, d_k = q.dtype, q.shape[-1]
    if mask is not None:
        guard = _guard_mistake(q, k, v, mask, output)
        if guard is not None:
            return guard
    if torch.isnan(weights).any() or torch.isnan(output).any():
        # A softmax over the query axis gives NaN wherever a key is masked for every query.
        columns = torch.nan_to_num(weights).sum(-2)
        reached = mask.expand_as(weights).any(-2) if mask is not None else torch.ones_like(columns, dtype=torch.bool)
        if weights.shape[-2] > 1 and close(columns[reached], torch.ones_like(columns[reached]), dtype, 1e-4):
            return t("You took the softmax over the query axis: take it over k_len (dim=-1).")
        return t(
            "Your result contains NaN. If you wrote exp() yourself, subtract each row's maximum "
            "first (or use torch.softmax); a row with every key masked must give zeros, not NaN."
        )
    sums_k, sums_q = weights.sum(-1), weights.sum(-2)
    if mask is None and not close(sums_k, torch.ones_like(sums_k), dtype):
        if close(sums_q, torch.ones_like(sums_q), dtype):
            return t("Your weights sum to 1 over the query axis: take the softmax over k_len (dim=-1), not q_len.")
        return t("Each row of your weights should sum to 1 over k_len: is softmax applied at all?")
    scales = [(t("You did not divide the scores by sqrt(d_k)."), 1.0),
              (t("You divided the scores by d_k: divide by sqrt(d_k)."), 1.0 / d_k),
              (t("You multiplied the scores by sqrt(d_k): divide by it instead."), math.sqrt(d_k))]
    # d_k read off the wrong axis: q.shape[-2] (q_len), k.shape[-2] (k_len) or v.shape[-1] (d_v).
    for name, axis, size in (("q_len", "q.shape[-2]", q.shape[-2]), ("k_len", "k.shape[-2]", k.shape[-2]),
                             ("d_v", "v.shape[-1]", v.shape[-1])):
        if size != d_k:
            scales.append((t("You divided the scores by sqrt({name}) = sqrt({size}), the size of another axis "
                             "({axis}): d_k is the size of the last axis of q and k, q.shape[-1].",
                             name=name, size=size, axis=axis), 1.0 / math.sqrt(size)))
    variants = {hint: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) for hint, scale in scales}
    if mask is not None:
        variants.update({hint: out.to(dtype) for hint, out in _mask_variants(q, k, v, mask).items()})
    found = [hint for hint, expected in variants.items()
             if close(output, expected, dtype, 1e-4 if dtype == torch.float32 else None)]
    # Two mistakes that give the same output here (on sizes where two axes coincide) cannot be told apart.
    return found[0] if len(found) == 1 else None


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_shapes(fn: Callable[..., Any], seed: int = 0) -> None:
    """output is (*batch, q_len, d_v) and weights (*batch, q_len, k_len), for any leading axes, batch=1 included."""
    for dtype in (torch.float32, torch.float64):
        _, q, k, v = _qkv(seed, dtype)
        for _, *inputs in _samples(q, k, v):
            _result(fn, dtype, *inputs)
    passed(t("shapes and dtypes are right, with (batch, heads), batch=1, one and no leading axes"))


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_values(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.functional.scaled_dot_product_attention without a mask, large scores and any leading
    axes included."""
    for scale in (1.0, 30.0):  # random scores, then large ones
        _, q, k, v = _qkv(seed, dtype, scale)
        for where, *inputs in _samples(q, k, v) if scale == 1.0 else [("", q, k, v)]:
            q_, k_, v_ = inputs
            output, weights = _result(fn, dtype, q_, k_, v_)
            scores = q_.double() @ k_.double().transpose(-2, -1) / math.sqrt(q_.shape[-1])
            # Scores in the thousands carry rounding of eps * |score| into the softmax, in any correct
            # code, PyTorch's included: compare with float64 at that tolerance. Overflow (NaN, inf) or a
            # missing max-subtraction is off by far more.
            tolerance = max(1e-5 if dtype == torch.float32 else 1e-10,
                            2 * torch.finfo(dtype).eps * scores.abs().max().item())
            expected = F.scaled_dot_product_attention(q_.double(), k_.double(), v_.double()).to(dtype)
            if not close(output, expected, dtype, tolerance):
                diagnosis = _diagnose(q_, k_, v_, None, output, weights)
                raise CheckFailure(
                    t("With random scores{where}, your output differs from PyTorch's: {diagnosis}", where=where,
                      diagnosis=diagnosis) if scale == 1.0 else
                    t("With large scores{where}, your output differs from PyTorch's: {diagnosis}", where=where,
                      diagnosis=diagnosis))
            softmax = torch.softmax(scores, dim=-1).to(dtype)
            if not close(weights, softmax, dtype, tolerance):
                found = difference(weights, softmax, _sizes_of(q_, k_, v_))
                raise CheckFailure(
                    t("With random scores{where}, your output is right but the weights you return are not "
                      "softmax(q kᵀ / sqrt(d_k)) ({found}): return the weights that you multiplied v by.",
                      where=where, found=found) if scale == 1.0 else
                    t("With large scores{where}, your output is right but the weights you return are not "
                      "softmax(q kᵀ / sqrt(d_k)) ({found}): return the weights that you multiplied v by.",
                      where=where, found=found))
    # Exact answers: with one key every query gives it weight 1 and reads its value; one query is a single row.
    _, q, k, v = _qkv(seed, dtype)
    output, weights = _result(fn, dtype, q, k[..., :1, :], v[..., :1, :])
    sizes = _sizes_of(q, k[..., :1, :], v)
    if not (close(weights, torch.ones_like(weights), dtype) and close(output, v[..., :1, :].expand_as(output), dtype)):
        raise CheckFailure(t(
            "With one key (k_len=1) every query gives it weight 1 and its output is that key's value; yours "
            "differ (weights: {weights_found}; output: {output_found}). Look at the axis of your softmax (it "
            "must be k_len, dim=-1) and at anything that drops the k_len axis when it is 1 (a squeeze).",
            weights_found=difference(weights, torch.ones_like(weights), sizes),
            output_found=difference(output, v[..., :1, :].expand_as(output), sizes)))
    output, weights = _result(fn, dtype, q[..., :1, :], k, v)
    expected = F.scaled_dot_product_attention(q[..., :1, :].double(), k.double(), v.double()).to(dtype)
    if not close(output, expected, dtype):
        raise CheckFailure(t("With one query (q_len=1), your output differs from PyTorch's: {diagnosis}",
                             diagnosis=_diagnose(q[..., :1, :], k, v, None, output, weights)))
    passed(t("equal to torch.nn.functional.scaled_dot_product_attention, weights included, with any leading axes, "
             "one key and one query ({dtype})", dtype=dtype_name(dtype)))


@jaxtyped(typechecker=beartype)
def _masked_softmax(q: Float[Tensor, "*batch q_len d_k"], k: Float[Tensor, "*batch k_len d_k"],
                    mask: Bool[Tensor, "*#batch #q_len #k_len"]) -> Float[Tensor, "*batch q_len k_len"]:
    """softmax(where(mask, scores, -inf)) over k_len in float64, zeros for a query with no key."""
    scores = einsum(q.double(), k.double(), "... q_len d_k, ... k_len d_k -> ... q_len k_len") / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_mask(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Masked keys get zero weight, the others their softmax weight, masks broadcast, and a fully masked row
    gives zeros, not NaN."""
    s, q, k, v = _qkv(seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    b, h, q_len, k_len = s["batch"], s["heads"], s["q_len"], s["k_len"]
    full = torch.rand(b, h, q_len, k_len, generator=g) < 0.6
    full[..., 0] = True  # at least one key per row, so the oracle is well defined
    lengths = torch.randint(1, k_len + 1, (b,), generator=g)
    padding = torch.arange(k_len).expand(b, 1, 1, k_len) < lengths.view(b, 1, 1, 1)
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    # Each name is shown as "With {name} mask".
    cases = ((t("a random (batch, heads, q_len, k_len)"), q, k, v, full),
             (t("a padding (batch, 1, 1, k_len)"), q, k, v, padding),
             (t("a causal (q_len, k_len)"), q, k, v, causal),
             (t("a padding (batch=1, 1, 1, k_len)"), q[:1], k[:1], v[:1], padding[:1]),
             (t("a causal (q_len, k_len) mask on 3-D (heads, seq, d) inputs, that is"), q[0], k[0], v[0], causal))
    for name, q_, k_, v_, mask in cases:
        sizes = _sizes_of(q_, k_, v_)
        try:
            output, weights = _result(fn, dtype, q_, k_, v_, mask)
        except CheckFailure as failure:
            # What the student's code raised (a broadcast between (..., q_len) and k_len), not our words: the same
            # test in every language. _result keeps it through its rewording.
            shape_error = isinstance(failure, CodeRaised) and "must match the size" in failure.text
            hint = _keepdim_mistake(fn, dtype, seed) if shape_error else None
            if hint is None:
                raise
            raise CheckFailure(t("With {name} mask: {error} {hint}", name=name, error=_first_line(failure),
                                 hint=hint)) from None
        if not close(output, F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask), dtype):
            raise CheckFailure(t("With {name} mask: {diagnosis}", name=name,
                                 diagnosis=_diagnose(q_, k_, v_, mask, output, weights)))
        leaked = weights.masked_select(~mask.expand_as(weights))
        if leaked.numel() and leaked.abs().max() != 0:
            raise CheckFailure(t(
                "With {name} mask, masked keys got weight up to {weight:.3g} on sizes {sizes}; they must get "
                "exactly 0 (fill their scores with -inf before the softmax).", name=name,
                weight=leaked.abs().max().item(), sizes=", ".join(f"{a}={n}" for a, n in sizes.items())))
        expected = _masked_softmax(q_, k_, mask).to(dtype)
        if not close(weights, expected, dtype):
            unmasked = torch.ones(mask.shape[-2:], dtype=torch.bool)
            after = (_masked_softmax(q_, k_, unmasked) * mask).to(dtype)
            hint = (t("Your weights are masked after the softmax: the kept ones no longer sum to 1. Return the "
                      "weights of the masked softmax, the ones your output is made of.") if close(weights, after, dtype)
                    else t("Return the weights that you multiplied v by."))
            raise CheckFailure(t(
                "With {name} mask your output is right, but the weights you return differ from "
                "softmax(where(mask, scores, -inf)) ({found}). {hint}", name=name,
                found=difference(weights, expected, sizes), hint=hint))
    blind = full.clone()
    blind[:, :, 1, :] = False
    output, weights = _result(fn, dtype, q, k, v, blind)
    row_out, row_w = output[:, :, 1], weights[:, :, 1]
    where = t("query 1 of every (batch, heads), on sizes {sizes}", sizes=", ".join(f"{a}={n}" for a, n in s.items()))
    if torch.isnan(row_out).any() or torch.isnan(row_w).any():
        raise CheckFailure(t(
            "A query whose keys are all masked gives NaN (softmax of all -inf), {where}. Give such rows zero "
            "weights and a zero output: e.g. find them with mask.any(dim=-1, keepdim=True).", where=where))
    if row_out.abs().max() != 0 or row_w.abs().max() != 0:
        raise CheckFailure(t(
            "A query whose keys are all masked should get zero weights and a zero output ({where}), "
            "got weights {weights} (output: {found}).", where=where, weights=show(row_w[0, 0]),
            found=difference(row_out, torch.zeros_like(row_out))))
    passed(t("masks: masked keys get 0 and the others their softmax weight, masks broadcast (batch=1 and 3-D inputs "
             "too), a fully masked row gives zeros"))


# -- dropout: the module a caller passes acts on the weights before the weighted sum ---------

def _factor(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """The stand-in's factor for a tensor of ``shape``: 0 or 2 (dropout with p = 0.5), fixed by the shape and seed."""
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    return 2 * keep.to(dtype)


class _FixedDropout(nn.Module):
    """Stands in for ``dropout``: zeroes a known half of whatever it is given and doubles the rest (p = 0.5), so that
    the check can compute what dropout at each place gives; notes the shape of each tensor it was given."""

    p = 0.5

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.seen: list[list[int]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(list(x.shape))
        return x * _factor(tuple(x.shape), self.seed, x.dtype)


class _WatchedDropout(nn.Dropout):
    """PyTorch's dropout, noting the shape of each tensor it was given."""

    def __init__(self, p: float) -> None:
        super().__init__(p)
        self.seen: list[list[int]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(list(x.shape))
        return super().forward(x)


def _with_dropout(fn: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, which: str, seed: int) -> dict[str, Any]:
    """``fn(q, k, v, dropout=...)`` with the stand-in (``which="fixed"``), nn.Dropout(0.5) in eval() mode ("eval") or
    nn.Dropout(1.0) in training mode ("all"); its result, and the shapes the dropout was given."""
    dropout = {"fixed": lambda: _FixedDropout(seed), "eval": lambda: _WatchedDropout(0.5).eval(),
               "all": lambda: _WatchedDropout(1.0)}[which]()
    return {"result": fn(q, k, v, dropout=dropout), "seen": dropout.seen}


def _dropout_run(fn: Callable[..., Any], dtype: torch.dtype, q: Tensor, k: Tensor, v: Tensor, which: str, seed: int,
                 what: str) -> tuple[Tensor, Tensor, list[list[int]]]:
    """:func:`_with_dropout` through :func:`call`: the checked (output, weights) and the shapes dropout was given."""
    try:
        run = call(_with_dropout, fn, q, k, v, which, seed)
    except CodeRaised as failure:
        hint = (t(" Your function takes no argument `dropout`: keep the exercise's signature, "
                  "scaled_dot_product_attention(q, k, v, mask=None, dropout=None).")
                if "unexpected keyword argument 'dropout'" in failure.text else "")
        raise CheckFailure(t("Called with {what}, your function raised {raised}.{hint}", what=what,
                             raised=failure.raised, hint=hint)) from None
    if type(run) is not dict:
        raise CheckFailure(t("Called with {what}, your function returned {kind}, not a pair of tensors.", what=what,
                             kind=kind(run)))
    output, weights = _pair(run["result"], dtype, q, k, v)
    return output, weights, run["seen"]


def _dropout_variants(q: Tensor, k: Tensor, v: Tensor, seed: int) -> dict[str, Tensor]:
    """The outputs, in float64, of dropout (the stand-in's) applied where it does not belong."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores, dim=-1)
    kept = _factor(tuple(weights.shape), seed, torch.float64)
    output = weights @ v
    return {
        t("You applied dropout to the output, the weighted sum: apply it to the attention weights, dropout(weights), "
          "and sum the values with the dropped weights."): output * _factor(tuple(output.shape), seed, torch.float64),
        t("You applied dropout to the scores, before the softmax: a dropped score is 0, an ordinary score, not a "
          "dropped key. Apply it to the weights that the softmax gives."): torch.softmax(scores * kept, dim=-1) @ v,
        t("You applied dropout to v: apply it to the attention weights, dropout(weights), not to the values."):
            weights @ (v * _factor(tuple(v.shape), seed, torch.float64)),
        t("You applied dropout to the weights twice: apply it once."): (weights * kept * kept) @ v,
    }


@check(forbid=BUILT_IN_ATTENTION)
def check_attention_dropout(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """``dropout`` acts on the attention weights before the weighted sum (a stand-in that drops a known half of
    them, and nn.Dropout(1.0)); nn.Dropout in eval() mode changes nothing; the weights returned are those before
    dropout."""
    s, q, k, v = _qkv(seed, dtype)
    sizes = _sizes_of(q, k, v)
    weights_shape = [s["batch"], s["heads"], s["q_len"], s["k_len"]]
    softmax = _masked_softmax(q, k, torch.ones(s["q_len"], s["k_len"], dtype=torch.bool))
    plain = softmax @ v.double()
    # Dropout is judged against attention that is right without it; check_attention_values says more.
    output, weights = _result(fn, dtype, q, k, v)
    if not close(output, plain.to(dtype), dtype):
        raise CheckFailure(t("Without dropout your output already differs from PyTorch's: {diagnosis}",
                             diagnosis=_diagnose(q, k, v, None, output, weights)))
    stand_in = t("a stand-in for dropout that zeroes a known half of what it is given and doubles the rest "
                 "(nn.Dropout(0.5) with a fixed mask)")
    output, weights, seen = _dropout_run(fn, dtype, q, k, v, "fixed", seed + 21, stand_in)
    kept = _factor(tuple(weights_shape), seed + 21, torch.float64)
    expected = (softmax * kept) @ v.double()
    if not close(output, expected.to(dtype), dtype):
        found = difference(output, expected.to(dtype), sizes)
        shapes = _joined([str(tuple(shape)) for shape in seen])
        if not seen:
            hint = t("Your function never called dropout (F.dropout(weights, dropout.p) does not count: the module "
                     "knows whether it is training): apply it to the weights, dropout(weights).")
        elif close(output, plain.to(dtype), dtype):
            hint = t("Your function called dropout on a tensor of shape {shapes}, yet its output is attention without "
                     "dropout: take the weighted sum of v with the dropped weights, not with the weights before "
                     "dropout.", shapes=shapes)
        else:
            found_hints = [h for h, out in _dropout_variants(q, k, v, seed + 21).items()
                           if close(output, out.to(dtype), dtype)]
            hint = found_hints[0] if len(found_hints) == 1 else t(
                "Your function gave dropout tensors of shape {shapes}; the weights are "
                "{weights_shape} (batch, heads, q_len, k_len). Apply dropout once, to the weights after the "
                "softmax (and after the zeroing of fully masked rows), and sum the values with the dropped weights.",
                shapes=shapes, weights_shape=tuple(weights_shape))
        raise CheckFailure(t("With {what}, your output differs from attention with that half of the weights "
                             "dropped ({found}). {hint}", what=stand_in, found=found, hint=hint))
    _expect_undropped(weights, softmax, kept, dtype, sizes, stand_in)
    every = t("nn.Dropout(1.0) in training mode")
    output, weights, _ = _dropout_run(fn, dtype, q, k, v, "all", seed, every)
    zeros = torch.zeros_like(output)
    if not close(output, zeros, dtype):
        raise CheckFailure(t(
            "With nn.Dropout(1.0) in training mode every weight is dropped, so the output should be all zeros "
            "({found}). Apply the dropout you are given to the weights, dropout(weights).",
            found=difference(output, zeros, sizes)))
    _expect_undropped(weights, softmax, torch.zeros_like(kept), dtype, sizes, every)
    evaluating = t("nn.Dropout(0.5) in eval() mode")
    output, weights, seen = _dropout_run(fn, dtype, q, k, v, "eval", seed, evaluating)
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).to(dtype)
    if not close(output, theirs, dtype):
        hint = (t("Your function did not call the dropout module it was given: call it, dropout(weights), for it "
                  "knows its mode (F.dropout(weights, dropout.p) drops in eval() mode too).") if not seen else
                t("Call the dropout module itself, dropout(weights), and nothing else that draws at random."))
        raise CheckFailure(t(
            "With nn.Dropout(0.5) in eval() mode, which passes its input through unchanged, your output differs from "
            "torch.nn.functional.scaled_dot_product_attention without dropout ({found}). {hint}",
            found=difference(output, theirs, sizes), hint=hint))
    _expect_undropped(weights, softmax, torch.ones_like(kept), dtype, sizes, evaluating)
    passed(t("dropout acts on the attention weights before the weighted sum, does nothing in eval() mode, and the "
             "weights returned are those before dropout ({dtype})", dtype=dtype_name(dtype)))


def _joined(items: list[str]) -> str:
    """``"A and B and C"``: shapes listed in a sentence, the conjunction in the reader's language."""
    joined = items[0] if items else ""
    for item in items[1:]:
        joined = t("{earlier} and {last}", earlier=joined, last=item)
    return joined


def _expect_undropped(weights: Tensor, softmax: Tensor, kept: Tensor, dtype: torch.dtype, sizes: dict[str, int],
                      what: str) -> None:
    """The weights returned with a dropout are softmax(q kᵀ / sqrt(d_k)), not the dropped ones (softmax * kept)."""
    expected = softmax.to(dtype)
    if close(weights, expected, dtype):
        return
    dropped = close(weights, (softmax * kept).to(dtype), dtype)
    hint = (t("they are the dropped weights: return the weights before dropout, which sum to 1 over k_len (what a "
              "plot or an entropy reads); only the weighted sum takes the dropped ones.") if dropped else
            t("return the weights before dropout, softmax(q kᵀ / sqrt(d_k))."))
    raise CheckFailure(t("With {what}, your output is right, but the weights you return differ from softmax(q kᵀ / "
                         "sqrt(d_k)) ({found}): {hint}", what=what, found=difference(weights, expected, sizes),
                         hint=hint))


def _entropy_variants(p: Tensor) -> dict[str, Tensor]:
    """The entropies that the usual slips in -Σ_k p log p give, in float64 (NaN and ±inf where they give them)."""
    p = p.double()
    plogp = torch.where(p > 0, p * p.log(), 0.0)
    entropy = -plogp.sum(-1)
    return {
        t("Your entropy has the wrong sign: H = -Σ p log p is never negative."): -entropy,
        t("You used log base 2: the course measures entropy in nats, the natural log."): entropy / math.log(2),
        t("You averaged p log p over the keys (a mean over k_len): the entropy is their sum."): entropy / p.shape[-1],
        t("Your terms are log p without the weight p: H = -Σ p · log p."): -torch.where(p > 0, p.log(), 0.0).sum(-1),
        t("Your terms are p, without log p: H = -Σ p · log p."): -p.sum(-1),
        t("Your terms are p · p, where log p is missing: H = -Σ p · log p."): -(p * p).sum(-1),
        t("You divided p by log p: multiply them, H = -Σ p · log p."): -torch.where(p > 0, p / p.log(), 0.0).sum(-1),
        t("Your torch.where keeps p log p where p = 0 and drops it where p > 0: its two values are the wrong way "
          "round, torch.where(p > 0, p * p.log(), 0.0)."): -torch.where(p > 0, 0.0, p * p.log()).sum(-1),
        t("Your entropy is 0 for every query, on spread-out weights and on weights with zeros alike: every p log p "
          "term is dropped. Look at the condition of your torch.where, which keeps the terms where p > 0."):
            torch.zeros_like(entropy),
    }


def _entropy_mistake(fn: Callable[..., Any], weights: Tensor, got: Tensor) -> str | None:
    """The slip whose entropy equals the student's, on ``weights`` and, to tell apart the slips that differ only
    where a weight is 0, on weights with zeros (one-hot rows, a fully masked row); None unless exactly one fits."""
    zeros = torch.softmax(torch.randn(weights.shape, generator=torch.Generator().manual_seed(5),
                                      dtype=torch.float64), dim=-1).to(weights.dtype)
    zeros[..., 0, :] = 0.0
    zeros[..., 0, 0] = 1.0
    zeros[..., 1, :] = 0.0
    try:
        got_zeros = call(fn, zeros)
    except CheckFailure:
        got_zeros = None
    right = torch.distributions.Categorical(probs=weights.double()).entropy()
    found = []
    for hint, wrong in _entropy_variants(weights).items():
        if not _same(got, wrong, weights.dtype) or _same(wrong, right, weights.dtype):
            continue
        if type(got_zeros) is Tensor and not _same(got_zeros, _entropy_variants(zeros)[hint], weights.dtype):
            continue
        found.append(hint)
    return found[0] if len(found) == 1 else None


@check
def check_attention_entropy(fn: Callable[..., Any], seed: int = 0) -> None:
    """Equal to torch.distributions.Categorical's entropy in float64 and float32; 0·log 0 counts as 0, and a
    fully masked row (all zeros) has entropy 0."""
    s = _sizes(seed)
    sizes = {a: s[a] for a in ("batch", "heads", "q_len", "k_len")}
    axes = "batch heads q_len"
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s["batch"], s["heads"], s["q_len"], s["k_len"], generator=g, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        weights = torch.softmax(logits, dim=-1).to(dtype)
        expected = torch.distributions.Categorical(probs=weights.double()).entropy().to(dtype)
        got = expect_tensor(call(fn, weights), t("entropy"), tuple(expected.shape), axes, dtype)
        if not close(got, expected, dtype):
            found = difference(got, expected, sizes)
            hint = _entropy_mistake(fn, weights, got)
            if hint is not None:
                # The hint's own full stop gives way to the one after the parenthesis.
                raise CheckFailure(t("{hint} ({found}; {dtype}).", hint=hint.removesuffix(".").removesuffix("。"),
                                     found=found, dtype=dtype_name(dtype)))
            raise CheckFailure(t("Your entropy differs from -Σ_k p log p summed over the k_len axis ({found}; "
                                 "{dtype}).", found=found, dtype=dtype_name(dtype)))
    weights = torch.softmax(logits, dim=-1)
    one_hot = torch.zeros_like(weights)
    one_hot[..., 0] = 1.0
    uniform = torch.full_like(weights, 1.0 / s["k_len"])
    blind = weights.clone()
    blind[:, :, 1, :] = 0.0  # query 1 has no key: the weights of a fully masked row
    expected = torch.distributions.Categorical(probs=weights).entropy()
    expected[:, :, 1] = 0.0
    # (what, its grammatical number, inputs, hint, expected entropy): "a row gives", "weights give".
    for what, one, probs, hint, right in (
        (t("Uniform weights (1/k_len on every key)"), False, uniform,
         t("the entropy of k_len equal weights is log(k_len), in nats: -Σ p log p with the natural log, summed over "
           "k_len."), torch.full(expected.shape, math.log(s["k_len"]), dtype=torch.float64)),
        (t("Weights with zeros (one-hot rows)"), False, one_hot,
         t("0·log 0 must count as 0 (torch.where(p > 0, p * p.log(), 0.0))."), torch.zeros(expected.shape,
                                                                                         dtype=torch.float64)),
        (t("A fully masked row (all its weights 0)"), True, blind,
         t("such a row has entropy 0: count 0·log 0 as 0, and do not normalise the weights (they sum to 0, so "
           "p / p.sum() is 0/0; torch.distributions.Categorical normalises them)."), expected),
    ):
        try:
            got = call(fn, probs)
        except CheckFailure as failure:
            if not isinstance(failure, CodeRaised):
                raise
            raise CheckFailure(t("{what}: {error} {hint}", what=what, error=_first_line(failure), hint=hint)) from None
        got = expect_tensor(got, t("entropy"), tuple(right.shape), axes, torch.float64)
        if not close(got, right, torch.float64):
            found = difference(got, right, sizes)
            nan = bool(torch.isnan(got).any())
            if one:
                message = (t("{what} gives NaN ({found}): {hint}", what=what, found=found, hint=hint) if nan else
                           t("{what} gives a wrong entropy ({found}): {hint}", what=what, found=found, hint=hint))
            else:
                message = (t("{what} give NaN ({found}): {hint}", what=what, found=found, hint=hint) if nan else
                           t("{what} give a wrong entropy ({found}): {hint}", what=what, found=found, hint=hint))
            raise CheckFailure(message)
    passed(t("equal to torch.distributions.Categorical(probs=weights).entropy() in float64 and float32; log(k_len) "
             "for uniform weights, 0 for a one-hot or a fully masked row"))


# |your value - a fresh sample's| under correct code, per (d_k, scale) cell. benchmarks/check_noise.py, part
# "entropy": your mean over samples=48 draws and the check's over 256 differ with standard deviation 0.0162,
# 0.0278 (d_k=4, scaled/unscaled), 0.0097, 0.0163 (64), 0.0091, 0.0118 (256), from 50000 draws per cell; the
# reference library's own function agrees (over 1000 seeds in the first three cells, 200 in the first five: largest
# difference 3.5 of these). Tolerance: 5.23
# standard deviations (_noise.normal_tolerance for six comparisons: correct code fails a call with probability
# below 1e-6). Effects of the usual mistakes on the expected value, in nats, and the cells that catch them (by at
# least 4.9 standard deviations beyond the tolerance): keys drawn with the query count (12 keys, not 9) +0.26 in the
# scaled cells (caught there; +0.02 to +0.20 unscaled); k_len ignored (16 keys) +0.53 scaled, +0.40 at d_k=4
# unscaled; scale ignored or inverted +0.49 to +1.67 unscaled; d_k instead of sqrt(d_k) +0.24 to +0.37 scaled;
# torch.rand draws +0.33 to +1.29 everywhere; log base 2 +0.61 to +0.82 (d_k=4 and the scaled cells); softmax over
# the queries -0.26 scaled. Left to the calls after the table: k_len (exactly 0 with one key), seed and samples.
ENTROPY_TOLERANCE = {(4, True): 0.085, (4, False): 0.146, (64, True): 0.051, (64, False): 0.086,
                     (256, True): 0.048, (256, False): 0.062}
# One query over two keys, d_k=4, unscaled: the sd of a single draw's entropy (check_noise.py, 480000 draws).
SINGLE_DRAW_SD = 0.2319


@check(forbid=BUILT_IN_ATTENTION)
def check_entropy_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """Unscaled entropy collapses as d_k grows; scaled entropy stays put; both agree with a fresh sample; one key gives
    exactly 0; seed and samples are used."""
    # Not the defaults (16 keys, 16 queries, 64 samples): a function that ignores an argument fails.
    q_len, k_len, samples = 12, 9, 48
    table = {}
    for d_k in (4, 64, 256):
        for scale in (True, False):
            try:
                value = call(fn, d_k, scale=scale, q_len=q_len, k_len=k_len, samples=samples, seed=seed)
            except CheckFailure as failure:
                # PyTorch's words in what the code raised, never ours: the same test in every language.
                if not (isinstance(failure, CodeRaised) and ("expected scalar type" in failure.text
                                                             or "same dtype" in failure.text)):
                    raise
                # PyTorch names the two dtypes that met in one operation.
                raise CheckFailure(t(
                    "{error} Two tensors of different dtypes met in one operation of your function "
                    "(the error names the two): give q, k and v one dtype, e.g. dtype=torch.float64 "
                    "in each torch.randn and torch.zeros that creates them.", error=_first_line(failure)
                )) from None
            if type(value) is not float:
                one = isinstance(value, Tensor) and value.numel() == 1
                hint = (t(" Your value is a tensor holding one number ({value:.4g}): return value.item(), the Python "
                          "float inside it.", value=value.item()) if one else "")
                raise CheckFailure(t("mean_attention_entropy should return a Python float (use .item()), got "
                                     "{kind}.{hint}", kind=kind(value), hint=hint))
            table[d_k, scale] = value
    g = torch.Generator().manual_seed(seed + 7)

    def fresh(d_k: int, scale: bool, keys: int = k_len) -> float:
        q = torch.randn(256, q_len, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(256, keys, d_k, generator=g, dtype=torch.float64)
        scores = q @ k.transpose(-2, -1) / (math.sqrt(d_k) if scale else 1.0)
        return torch.distributions.Categorical(logits=scores).entropy().mean().item()

    for (d_k, scale), value in table.items():
        if not 0.0 <= value <= math.log(k_len) + 1e-9:
            hint = t("Look at how the keys are drawn (k_len rows, the k_len it is given) and at how the entropies "
                     "are averaged (.mean()).")
            if abs(value - fresh(d_k, scale, keys=16)) <= ENTROPY_TOLERANCE[d_k, scale]:
                hint = t("That is the entropy over 16 keys, the default k_len: draw the keys with k_len rows, the "
                         "k_len it is given.")
            # A sum over the samples' queries instead of their mean: the value divided by their number agrees.
            for count, over in ((samples * q_len, t("queries in all the samples")), (samples, t("samples")),
                                (q_len, t("queries per sample"))):
                if abs(value / count - fresh(d_k, scale)) <= ENTROPY_TOLERANCE[d_k, scale]:
                    hint = t("Divided by {count}, the number of {over}, your value is the expected mean: you summed "
                             "the entropies instead of averaging them (.mean(), not .sum()).", count=count, over=over)
                    break
            raise CheckFailure(t(
                "An entropy over {k_len} keys lies in [0, log {k_len}] = [0, {log_k_len:.3f}], "
                "got {value:.3f} for d_k={d_k}, scale={scale}. {hint}", k_len=k_len, log_k_len=math.log(k_len),
                value=value, d_k=d_k, scale=scale, hint=hint))
    references = {cell: fresh(*cell) for cell in table}
    # scale=True measuring the unscaled entropy and scale=False the scaled one, at every d_k: the test is inverted.
    swapped = all(abs(table[d_k, scale] - references[d_k, not scale]) <= ENTROPY_TOLERANCE[d_k, not scale]
                  for d_k, scale in table)
    for (d_k, scale), value in table.items():
        reference, allowed = references[d_k, scale], ENTROPY_TOLERANCE[d_k, scale]
        if abs(value - reference) > allowed:
            if swapped:
                hint = t("At every d_k your scale=True value is the unscaled entropy and your scale=False value the "
                         "scaled one: your test of scale is inverted (divide by sqrt(d_k) only when scale is True).")
            elif scale and abs(value - fresh(d_k, scale, keys=q_len)) <= allowed:
                hint = t("That is the entropy over {q_len} keys: draw the keys with k_len rows, "
                         "torch.randn(samples, k_len, d_k), and the queries with q_len.", q_len=q_len)
            elif not scale:
                hint = t("Did you divide by sqrt(d_k) only when scale=True?")
            else:
                hint = t("Look at how q and k are drawn: unit variance (torch.randn), with the q_len, k_len and "
                         "samples given.")
            raise CheckFailure(t(
                "For d_k={d_k}, scale={scale}, q_len={q_len}, k_len={k_len}, samples={samples} you measured "
                "{value:.3f} nats; a fresh sample gives about {reference:.3f} (difference "
                "{gap:.3f}, allowed {allowed}: 5.2 standard deviations of the difference "
                "between two such samples). {hint}", d_k=d_k, scale=scale, q_len=q_len, k_len=k_len, samples=samples,
                value=value, reference=reference, gap=abs(value - reference), allowed=allowed, hint=hint))
    first = (table[4, True], (4,), dict(scale=True, q_len=q_len, k_len=k_len, samples=samples, seed=seed))
    _check_measurement_arguments(fn, "mean_attention_entropy", "scale", 0.0, t("the entropy"), seed, SINGLE_DRAW_SD,
                                 first)
    passed(t("unscaled entropy falls from {unscaled_small:.2f} to {unscaled_large:.2f} nats as d_k goes 4 → 256; "
             "scaled stays near {scaled:.2f} (over {k_len} keys); 0 over one key; seed and samples used",
             unscaled_small=table[4, False], unscaled_large=table[256, False], scaled=table[256, True], k_len=k_len))


def _check_measurement_arguments(fn: Callable[..., Any], name: str, option: str, one_key: float, what: str,
                                 seed: int, single_draw_sd: float, first: tuple[float, tuple, dict]) -> None:
    """The arguments that a mean over random draws hides, for a measurement ``name(d_k, *, option, q_len, k_len,
    samples, seed)``: k_len = 1 has an exact answer (``one_key``, whatever the option), the same seed gives the same
    value (``first`` is a value and the arguments it was called with), and calls with samples = 1 (one query over
    two keys) at different seeds are single draws, spread out like one (see ``_noise.SPREAD_THRESHOLD``).

    Shared by chapter 00's top weight and chapter 01's entropy measurements."""
    for choice in (True, False):
        got = call(fn, 4, **{option: choice}, q_len=3, k_len=1, samples=2, seed=seed)
        if not (type(got) is float and abs(got - one_key) <= 1e-9):
            shown = f"{got:.4g}" if type(got) is float else kind(got)
            raise CheckFailure(t(
                "With one key (k_len=1) each query gives it all its weight, so {what} is exactly {one_key:g}; "
                "{name}(4, {option}={choice}, q_len=3, k_len=1, samples=2) gave {shown}. Look at how your keys "
                "are drawn: k_len rows (torch.randn(samples, k_len, d_k)), whatever q_len is.", what=what,
                one_key=one_key, name=name, option=option, choice=choice, shown=shown))
    value, args, kwargs = first
    again = call(fn, *args, **kwargs)
    if again != value:
        raise CheckFailure(t(
            "Called twice with the same arguments and seed={seed}, {name} gave {value!r} and then "
            "{again!r}: draw from torch.Generator().manual_seed(seed) (passed as generator=...), so that a seed "
            "gives one answer.", seed=kwargs["seed"], name=name, value=value, again=again))
    seeds = range(seed + 1000, seed + 1000 + SPREAD_CALLS)
    singles = torch.tensor([call(fn, 4, **{option: False}, q_len=1, k_len=2, samples=1, seed=s) for s in seeds],
                           dtype=torch.float64)
    if singles.std().item() >= SPREAD_THRESHOLD * single_draw_sd:
        return
    if bool((singles == singles[0]).all()):
        raise CheckFailure(t(
            "With samples=1, q_len=1 and k_len=2 each call measures one random draw, so {calls} calls at seeds "
            "{first} ... {last} should spread like single draws (standard deviation about {single_draw_sd}); "
            "all gave {value:.4g}. Your function ignores seed: seed its generator with it.", calls=SPREAD_CALLS,
            first=seeds[0], last=seeds[-1], single_draw_sd=single_draw_sd, value=singles[0].item()))
    raise CheckFailure(t(
        "With samples=1, q_len=1 and k_len=2 each call measures one random draw, so {calls} calls at seeds "
        "{first} ... {last} should spread like single draws (standard deviation about {single_draw_sd}); "
        "their standard deviation is {spread:.3g}. That is the spread of a mean over many draws: does your function "
        "use samples?", calls=SPREAD_CALLS, first=seeds[0], last=seeds[-1], single_draw_sd=single_draw_sd,
        spread=singles.std().item()))
