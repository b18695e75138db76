"""Checks for chapter 10: repeat_kv, grouped attention, GroupedQueryAttention, from_multihead, cache bytes.

The oracle is PyTorch's fused ``F.scaled_dot_product_attention(..., enable_gqa=True)``, which
shares each key/value head among its group of query heads without copying it, and
``torch.nn.MultiheadAttention`` for ``kv_heads == heads``. Weights are seeded and copied into the
student's module. Where no built-in exists the oracle is a definition (RoPE's rotation, dropout as a
fixed mask on the weights) or a defining property (cached decoding equals one causal pass). Every
touch of the student's code (building a module, loading weights, running it, reading its cache) goes
through :func:`call`, with the small helpers below.
"""

import math
import re
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import einsum, rearrange, reduce, repeat
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    NotOwnWork,
    call,
    check,
    close,
    difference,
    draw_sizes,
    dtype_name,
    expect_tensor,
    kind,
    passed,
    refuse_extra_parameters,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import parameter_shapes as _parameter_shapes
from stepformer.checks._modules import parameters_of as _state_of
from stepformer.checks._modules import set_training as _set_training

AXES = ("batch", "kv_heads", "group", "q_len", "k_len", "d_head")
PROJECTIONS = ("w_q", "w_k", "w_v", "w_o")
# grouped_attention is where students share the key/value heads themselves: PyTorch's fused
# attention, whose enable_gqa does exactly that, is off limits there. Not in the module: its `fast`
# path calls it (through the given _fused_attention), and its default path may too; the module's
# checks grade what the module adds (projections, heads, masks, dropout, cache) against the oracle.
BUILT_IN_GQA = {
    "torch.nn.functional.scaled_dot_product_attention":
        marked("PyTorch's fused attention, whose enable_gqa does the grouping"),
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes (heads = kv_heads * group and d_model = heads * d_head computed), so a swapped
    axis cannot pass."""
    if seed == 0:
        sizes = dict(zip(AXES, (3, 2, 4, 5, 7, 6), strict=True))
    else:
        # Two draws, so that heads = kv_heads * group stays small: kv_heads and group from 2 to 4, the rest from 2 to 9.
        g = torch.Generator().manual_seed(seed)
        while True:
            drawn = draw_sizes(g, ("kv_heads", "group"), span=3)
            drawn |= draw_sizes(g, ("batch", "q_len", "k_len", "d_head"), span=8)
            sizes = {axis: drawn[axis] for axis in AXES}
            values = [*sizes.values(), sizes["kv_heads"] * sizes["group"]]
            if len(set(values)) == len(values):
                break
    heads = sizes["kv_heads"] * sizes["group"]
    return {**sizes, "heads": heads, "d_model": heads * sizes["d_head"]}


def _even(s: dict[str, int]) -> dict[str, int]:
    """The same sizes with an even d_head, which RoPE needs (it turns channels in pairs)."""
    d_head = s["d_head"] + s["d_head"] % 2
    return {**s, "d_head": d_head, "d_model": s["heads"] * d_head}


def _inputs(s: dict[str, int], dtype: torch.dtype, seed: int, *lengths: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed + 3)
    return [torch.randn(s["batch"], n, s["d_model"], generator=g, dtype=dtype) for n in lengths]


def _padding_mask(s: dict[str, int], k_len: int, seed: int, empty: bool = False) -> Tensor:
    """(batch, 1, 1, k_len), True = a real token; the first sentence is full, the others shorter, and with
    ``empty`` the last one is all padding (its queries may read nothing)."""
    g = torch.Generator().manual_seed(seed + 5)
    lengths = torch.randint(1, k_len + 1, (s["batch"],), generator=g)
    lengths[0] = k_len
    lengths[-1] = 0 if empty else max(1, k_len - 2)
    return rearrange(torch.arange(k_len), "k_len -> 1 1 1 k_len") < rearrange(lengths, "batch -> batch 1 1 1")


class _FixedDropout(nn.Module):
    """A deterministic stand-in for ``nn.Dropout(p)``: in training it multiplies its input by a fixed seeded mask of
    0 and 1 / (1 - p), the same for every input of one shape, so that where dropout acts can be computed."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p, self.seed = p, seed

    def forward(self, x: Tensor) -> Tensor:
        return _fixed_dropout(x, self.p, self.seed) if self.training else x


@jaxtyped(typechecker=beartype)
def _fixed_dropout(x: Float[Tensor, "*shape"], p: float, seed: int) -> Float[Tensor, "*shape"]:
    # Drawn per element in memory order, so a view of the weights as (batch * heads, q_len, k_len) gets the same mask.
    keep = torch.rand(x.numel(), generator=torch.Generator().manual_seed(seed + 47)) >= p
    return x * keep.reshape(x.shape).to(x.dtype) / (1 - p)


# -- exercise 1: repeat_kv -----------------------------------------------------------------

def _raised_repeat(fn: Callable[..., Any], x: Tensor, heads: int) -> str:
    """After ``repeat_kv(x, heads)`` raised on sizes that divide: which axis of x the code takes for kv_heads, found by
    re-running with that axis as long as the kv_heads axis."""
    g = torch.Generator().manual_seed(19)
    kv_heads = x.shape[1]
    for axis, name in ((0, "batch"), (2, "seq"), (3, "d_head")):
        if x.shape[axis] == kv_heads:
            continue
        shape = list(x.shape)
        shape[axis] = kv_heads
        probe = torch.randn(*shape, generator=g, dtype=x.dtype)
        try:
            got = call(fn, probe, heads)
        except CheckFailure:
            continue
        if type(got) is Tensor and got.shape == (shape[0], heads, *shape[2:]) and \
                torch.equal(got, probe.repeat_interleave(heads // kv_heads, dim=1)):
            return t(" With x's {axis_name} axis (dim {axis}) as long as its kv_heads axis (both {kv_heads}) the same "
                     "call runs and is right: your code reads kv_heads from x.shape[{axis}], the {axis_name} axis, not "
                     "x.shape[1].", axis_name=name, axis=axis, kv_heads=kv_heads)
    return ""


def _head_count_failure(fn: Callable[..., Any], x: Tensor, heads: int, got: Tensor, what: str,
                        dtype: torch.dtype) -> str:
    """repeat_kv gave the wrong number of heads: how many times it repeated each key/value head, and whether that
    count is one of the usual wrong ones on a second pair of sizes too."""
    kv_heads = x.shape[1]
    shape = f"(batch={x.shape[0]}, heads={heads}, seq={x.shape[2]}, d_head={x.shape[3]})"
    message = t("{what} should have shape {shape}, got {got}.", what=what, shape=shape, got=tuple(got.shape))
    if got.shape[1] % kv_heads:
        return message + t(" Repeat every key/value head group = heads // kv_heads times: (kv_heads group) heads.")
    times = got.shape[1] // kv_heads
    message += t(" Each key/value head was repeated {times} times; it should be heads // kv_heads = {group}.",
                 times=times, group=heads // kv_heads)
    other_kv, other_heads = (1, 3) if kv_heads != 1 else (2, 6)
    counts = {t("heads % kv_heads, the remainder (0 whenever kv_heads divides heads), not the quotient heads // "
                "kv_heads"): lambda h, kv: h % kv,
              t("heads, not heads // kv_heads"): lambda h, kv: h,
              t("kv_heads, not heads // kv_heads"): lambda h, kv: kv}
    probe = torch.randn(x.shape[0], other_kv, *x.shape[2:], generator=torch.Generator().manual_seed(23), dtype=dtype)
    try:
        again = call(fn, probe, other_heads)
    except CheckFailure:
        return message
    if type(again) is not Tensor or again.dim() != 4 or again.shape[1] % other_kv:
        return message
    for name, count in counts.items():
        if count(heads, kv_heads) == times and count(other_heads, other_kv) == again.shape[1] // other_kv and \
                count(heads, kv_heads) != heads // kv_heads and count(other_heads, other_kv) != other_heads // other_kv:
            return message + t(" With kv_heads={kv_heads} and heads={heads} too (got {got} heads): your group size "
                               "is {size}.", kv_heads=other_kv, heads=other_heads, got=again.shape[1], size=name)
    return message


@check
def check_repeat_kv(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """(batch, kv_heads, seq, d_head) -> (batch, heads, seq, d_head), query head h reading key head h // group."""
    s = _sizes(seed)
    b, kv, group, seq, d_head = s["batch"], s["kv_heads"], s["group"], s["k_len"], s["d_head"]
    g = torch.Generator().manual_seed(seed)
    # The last case is one sentence: a batch of one catches a .squeeze() that drops the batch axis.
    for batch, kv_heads, heads in ((b, kv, kv * group), (b, 1, group), (b, kv, kv), (1, kv, kv * group)):
        x = torch.randn(batch, kv_heads, seq, d_head, generator=g, dtype=dtype)
        sizes = {"batch": batch, "kv_heads": kv_heads, "heads": heads, "seq": seq, "d_head": d_head}
        what = t("repeat_kv(x, heads={heads}) with kv_heads={kv_heads}", heads=heads, kv_heads=kv_heads)
        try:
            got = call(fn, x, heads)
        except CheckFailure as failure:
            if not isinstance(failure, CodeRaised):
                raise
            raise CheckFailure(str(failure) + _raised_repeat(fn, x, heads)) from failure
        if type(got) is Tensor and got.dim() == 4 and tuple(got.shape) != (batch, heads, seq, d_head) and \
                got.shape[0] == batch and got.shape[2:] == x.shape[2:]:
            raise CheckFailure(_head_count_failure(fn, x, heads, got, what, dtype))
        got = expect_tensor(got, what, (batch, heads, seq, d_head), "batch heads seq d_head", dtype)
        expected = x.repeat_interleave(heads // kv_heads, dim=1)
        if torch.equal(got, expected):
            continue
        if torch.equal(got, x.repeat(1, heads // kv_heads, 1, 1)):
            raise CheckFailure(t(
                "You repeated the key/value heads in the (group kv_heads) order, the order of Tensor.repeat "
                "({difference}): query head h then reads key head h % kv_heads. Consecutive query heads form a group, "
                "so query head h must read key head h // group: write '(kv_heads group)' in the pattern (or use "
                "repeat_interleave).", difference=difference(got, expected, sizes)))
        raise CheckFailure(t(
            "With kv_heads={kv_heads} and heads={heads}, query head h should get key/value head h // {group} "
            "unchanged, as x.repeat_interleave(heads // kv_heads, dim=1) gives ({difference}): use repeat(x, 'batch "
            "kv_heads seq d_head -> batch (kv_heads group) seq d_head', group=heads // kv_heads).", kv_heads=kv_heads,
            heads=heads, group=heads // kv_heads, difference=difference(got, expected, sizes)))
    x = torch.randn(b, kv, seq, d_head, generator=g, dtype=dtype)
    error = call(_error_of, fn, x, kv * group + 1)
    if error is None:
        raise CheckFailure(t(
            "repeat_kv(x, heads={heads}) with kv_heads={kv_heads} should raise a ValueError, since {kv_heads} key "
            "heads cannot be shared equally by {heads} query heads; it raised no error. Check heads % kv_heads.",
            heads=kv * group + 1, kv_heads=kv))
    if error != "ValueError":
        raise CheckFailure(t(
            "repeat_kv(x, heads={heads}) with kv_heads={kv_heads} should raise a ValueError, since {kv_heads} key "
            "heads cannot be shared equally by {heads} query heads; it raised a {error}. Check heads % kv_heads.",
            heads=kv * group + 1, kv_heads=kv, error=error))
    passed(t("repeat_kv: (batch, kv_heads, seq, d_head) -> (batch, heads, seq, d_head) in the (kv_heads group) order, "
             "batch=1 too, ValueError when kv_heads does not divide heads ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 2: grouped attention -----------------------------------------------------------

def _grouped_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, order: str = "kv_heads group",
                       scale: float | None = None, use_mask: bool = True,
                       drop: Callable[[Tensor], Tensor] | None = None, drop_at: str = "weights",
                       nan: bool = False) -> Tensor:
    """Grouped attention written out, with switches for the usual mistakes (to name them); ``drop`` acts on the
    weights, or where ``drop_at`` says ("values", "output"); ``nan`` keeps softmax's NaN for a query that reads
    nothing."""
    def dropped(t: Tensor, where: str) -> Tensor:
        return drop(t) if drop is not None and where == drop_at else t

    group = q.shape[1] // k.shape[1]
    k, v = (repeat(t, f"batch kv_heads seq d_head -> batch ({order}) seq d_head", group=group) for t in (k, v))
    scale = math.sqrt(q.shape[-1]) if scale is None else scale
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len") / scale
    if mask is not None and use_mask:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    weights = weights if nan else weights.nan_to_num()  # ``nan``: a query that reads nothing gives NaN
    out = einsum(dropped(weights, "weights"), dropped(v, "values"),
                 "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
    return dropped(out, "output")


def _fused_oracle(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """PyTorch's fused attention, with the course's rule that a query with no readable key outputs zeros."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if mask is not None:
        readable = mask.expand(*q.shape[:-1], k.shape[-2]).any(dim=-1, keepdim=True)
        out = torch.where(readable, out, torch.zeros_like(out))
    return out


def _attention_sizes(q: Tensor, k: Tensor) -> dict[str, int]:
    return {"batch": q.shape[0], "heads": q.shape[1], "kv_heads": k.shape[1], "q_len": q.shape[2],
            "k_len": k.shape[2], "d_head": q.shape[3]}


def _has_key(mask: Tensor, shape: torch.Size) -> Tensor:
    """(batch, heads, q_len): whether each query may read at least one key."""
    return mask.expand(*shape[:-1], mask.shape[-1]).any(dim=-1)


def _guard_variants(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The outputs of the guard for queries with no readable key applied to the wrong queries: "before" (their
    scores set to one value, so uniform weights over every key) and "after" (their weights zeroed)."""
    has_key = rearrange(_has_key(mask, q.shape[:-1] + k.shape[-2:-1]), "... q_len -> ... q_len 1")
    values = repeat(v, "batch kv_heads k_len d_head -> batch (kv_heads group) k_len d_head",
                    group=q.shape[1] // k.shape[1])
    mean = reduce(values, "batch heads k_len d_head -> batch heads 1 d_head", "mean").expand_as(q)
    zero = torch.zeros_like(q)
    return {"before": torch.where(has_key, mean, zero), "after": torch.where(has_key, zero, mean)}


def _with_empty_rows(mask: Tensor, batch: int) -> Tensor:
    """The mask as (batch, 1, q_len, k_len) with the last sentence's queries reading nothing."""
    probe = mask.expand(batch, 1, *mask.shape[-2:]).clone()
    probe[-1] = False
    return probe


def _diagnose_grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, output: Tensor,
                      fn: Callable[..., Any] | None = None) -> str:
    if mask is not None:
        rows = _has_key(mask, output.shape[:-1] + k.shape[-2:-1])
        inverted = _grouped_reference(q, k, v, ~mask.expand(*q.shape[:-1], k.shape[-2]), nan=True)
        expected = _fused_oracle(q, k, v, mask)
        if rows.any() and torch.allclose(output[rows], inverted[rows], rtol=1e-5, atol=1e-5, equal_nan=True) \
                and not torch.allclose(expected[rows], inverted[rows], rtol=1e-5, atol=1e-5, equal_nan=True):
            return t("On every query that may read a key your output equals attention with the mask inverted "
                     "(NaN where such a query may read every key: all its scores became -inf): fill the scores "
                     "with -inf where mask is False (~mask), since True means may attend.")
        for at, variant in _guard_variants(q, k, v, mask).items():
            if not close(output, variant, output.dtype):
                continue
            # Confirmed on queries of both kinds: the same inputs with one sentence that may read nothing.
            probe = _with_empty_rows(mask, q.shape[0])
            try:
                again = call(fn, q, k, v, probe) if fn is not None else None
            except CheckFailure:
                again = None
            if type(again) is not Tensor or not close(again, _guard_variants(q, k, v, probe)[at], output.dtype):
                break
            if at == "before":
                return t("Your weights are uniform over all k_len keys, masked ones included, for every query that "
                         "may read a key, and zero for the queries that may read none (confirmed with a mask whose "
                         "last sentence reads nothing): the step meant for queries with no readable key (set their "
                         "scores to one value before the softmax) acts on the other queries: its condition is "
                         "inverted.")
            return t("Your output is zero for every query that may read a key, and the mean of all the values for the "
                     "queries that may read none (confirmed with a mask whose last sentence reads nothing): the "
                     "zeroing of the weights meant for queries with no readable key acts on the other queries: its "
                     "condition is inverted.")
    if torch.isnan(output).any():
        nan_rows = torch.isnan(output).any(dim=-1)
        if mask is not None and not (nan_rows & _has_key(mask, output.shape[:-1] + k.shape[-2:-1])).any():
            return t("Your output contains NaN, only for queries whose keys are all masked: such a query must get "
                     "zero weights and a zero output, as in chapter 01 (softmax over all -inf is NaN: fill such rows "
                     "before and after it).")
        where = [int(i) for i in nan_rows.nonzero()[0]]
        if mask is not None:
            return t("Your output contains NaN, e.g. for the query at [batch, head, q_len] = {where}, which may read "
                     "some keys.", where=where)
        return t("Your output contains NaN, e.g. for the query at [batch, head, q_len] = {where}, which may read "
                 "every key.", where=where)
    variants = [
        (t("You repeated the key/value heads in the (group kv_heads) order (Tensor.repeat): query head h must read "
           "key/value head h // group, the (kv_heads group) order of your repeat_kv."), dict(order="group kv_heads")),
        (t("You scaled the scores by something other than sqrt(d_head): each head's dot products have d_head "
           "terms."), dict(scale=math.sqrt(q.shape[1] * q.shape[-1]))),
        (t("You did not scale the scores at all: divide by sqrt(d_head)."), dict(scale=1.0)),
    ]
    if mask is not None:
        variants.append((t("Your output ignores the mask: fill the scores of masked keys with -inf before the "
                           "softmax."), dict(use_mask=False)))
    for hint, mistake in variants:
        if close(output, _grouped_reference(q, k, v, mask, **mistake), output.dtype):
            return hint
    return t("It matches none of the common mistakes. Repeat k and v with repeat_kv to `heads` heads, then attend as "
             "in chapter 01: scores q·k / sqrt(d_head) with einsum, masked keys -inf, softmax over k_len, weighted "
             "sum of the repeated values.")


def _runs_right(fn: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                *extra: Any) -> bool | None:
    """None when ``fn(q, k, v, mask, *extra)`` raises; else whether it equals the oracle (dropout, if any, is
    one that does nothing)."""
    try:
        got = call(fn, q, k, v, mask, *extra)
    except CheckFailure:
        return None
    return type(got) is Tensor and close(got, _fused_oracle(q, k, v, mask), q.dtype)


def _raised_grouped(fn: Callable[..., Any], q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                    error: CodeRaised) -> str:
    """After ``fn(q, k, v, mask)`` raised ``error``: the same call with one thing changed that leaves the attention as
    it is, to find which input the error comes from."""
    g = torch.Generator().manual_seed(17)
    b, heads, q_len, d_head = q.shape
    kv, k_len = k.shape[1], k.shape[2]
    if _runs_right(fn, q, k, v, mask, nn.Identity()):
        return t(" With dropout=nn.Identity() (a dropout that does nothing) the same call runs and is right, so a "
                 "step meant for `dropout` runs when dropout is None: check its condition (dropout is not None).")
    if mask is None:
        everything = torch.ones(q_len, k_len, dtype=torch.bool)
        try:
            call(fn, q, k, v, everything)
        except CheckFailure as failure:
            if isinstance(failure, CodeRaised) and failure.raised == error.raised:
                everything = None
            else:
                return t(" With an all-True (q_len, k_len) mask (the same attention) that error is gone (it raised "
                         "{raised}), so it comes from a step meant for the mask that runs when mask is None: check "
                         "the conditions (mask is not None) around the mask's steps.", raised=_what_raised(failure))
        if everything is not None:
            return t(" With an all-True (q_len, k_len) mask (the same attention) the same call runs, so a step meant "
                     "for the mask runs when mask is None: check the conditions (mask is not None) around the mask's "
                     "steps.")
    else:
        square = torch.randn(b, heads, k_len, d_head, generator=g, dtype=q.dtype)
        square_mask = mask if mask.dim() > 2 and mask.shape[-2] == 1 else torch.ones(k_len, k_len,
                                                                                      dtype=torch.bool).tril()
        if _runs_right(fn, q, k, v, None) and q_len != k_len and _runs_right(fn, square, k, v, square_mask):
            return t(" The same call without the mask runs, and with q_len == k_len the masked call runs and is "
                     "right: your code puts q_len and k_len in each other's place in a tensor it makes from the mask: "
                     "check the order of the axes in the patterns that take the mask (..., q_len, k_len).")
        if mask.dim() > 2 and b > 1 and _runs_right(fn, q[:1], k[:1], v[:1], mask[:1]):
            return t(" The same mask for one sentence (batch=1) runs and is right, so your code moves the mask's "
                     "leading axes (batch, heads): check the order of the axes in the patterns that take the mask "
                     "('...' first, then q_len k_len).")
        if _runs_right(fn, q, k, v, None):
            return t(" The same call without the mask runs, so the error comes from where your code uses the mask: "
                     "compare the shape of each tensor you make from it with the scores' (batch, heads, q_len, "
                     "k_len).")
    # Which axis of q the number of heads is read from: re-run with that axis as long as the heads axis.
    names = {0: "batch", 2: "q_len", 3: "d_head"}
    for axis, name in names.items():
        shape = [b, heads, q_len, d_head]
        if shape[axis] == heads:
            continue
        shape[axis] = heads
        q2 = torch.randn(*shape, generator=g, dtype=q.dtype)
        k2, v2 = (t if axis == 2 else torch.randn(shape[0], kv, k_len, shape[3], generator=g, dtype=q.dtype)
                  for t in (k, v))
        if _runs_right(fn, q2, k2, v2, None):
            return t(" It runs and is right when q's {axis_name} axis (dim {axis}) is as long as its heads axis (both "
                     "{heads}): your code reads the number of heads from q.shape[{axis}], the {axis_name} axis, not "
                     "q.shape[1].", axis_name=name, axis=axis, heads=heads)
    return ""


def _grouped_cases(s: dict[str, int], dtype: torch.dtype, seed: int) -> list[tuple[str, tuple[Tensor, ...]]]:
    g = torch.Generator().manual_seed(seed + 7)
    b, heads, kv, q_len, k_len, d_head = s["batch"], s["heads"], s["kv_heads"], s["q_len"], s["k_len"], s["d_head"]
    cases = []
    for kv_heads, name in ((kv, "GQA"), (1, "MQA (kv_heads=1)"), (heads, "MHA (kv_heads=heads)")):
        q = torch.randn(b, heads, q_len, d_head, generator=g, dtype=dtype)
        k, v = (torch.randn(b, kv_heads, k_len, d_head, generator=g, dtype=dtype) for _ in range(2))
        cases.append((t("{name} without a mask", name=name), (q, k, v, None)))
    q = torch.randn(b, heads, q_len, d_head, generator=g, dtype=dtype)
    k, v = (torch.randn(b, kv, k_len, d_head, generator=g, dtype=dtype) for _ in range(2))
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    cases.append((t("GQA with a causal mask (q_len, k_len)"), (q, k, v, causal)))
    padding = torch.rand(b, 1, 1, k_len, generator=g) < 0.6
    padding[:, ..., 0] = True
    padding[-1] = False  # the last sentence is all padding: its rows may read nothing
    cases.append((t("GQA with a padding mask (batch, 1, 1, k_len) and fully masked rows"), (q, k, v, padding)))
    cases.append((t("GQA for one sentence (batch=1) with a padding mask"), (q[:1], k[:1], v[:1], padding[:1])))
    return cases


DROPOUT_PLACES = {
    "values": marked("You applied dropout to the values: it acts on the attention weights, (batch, heads, q_len, "
                     "k_len), after the softmax and before the weighted sum."),
    "output": marked("You applied dropout to the output: it acts on the attention weights, (batch, heads, q_len, "
                     "k_len), after the softmax and before the weighted sum."),
}


@check(forbid=BUILT_IN_GQA)
def check_grouped_attention(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to F.scaled_dot_product_attention(enable_gqa=True) for GQA, MQA and MHA, with masks; dropout on weights."""
    s = _sizes(seed)
    cases = _grouped_cases(s, dtype, seed)
    for what, (q, k, v, mask) in cases:
        try:
            got = call(fn, q, k, v, mask)
        except CheckFailure as failure:
            if not isinstance(failure, CodeRaised):
                raise
            raise CheckFailure(str(failure) + _raised_grouped(fn, q, k, v, mask, failure)) from failure
        got = expect_tensor(got, t("the output for {what}", what=what), tuple(q.shape), "batch heads q_len d_head",
                            dtype)
        expected = _fused_oracle(q, k, v, mask)
        if not close(got, expected, dtype):
            raise CheckFailure(t(
                "For {what}, your output differs from F.scaled_dot_product_attention(q, k, v, enable_gqa=True) "
                "({difference}). {diagnosis}", what=what, difference=difference(got, expected, _attention_sizes(q, k)),
                diagnosis=_diagnose_grouped(q, k, v, mask, got, fn)))
    # Dropout: a stand-in that multiplies by a fixed mask, so that the weights it must act on can be computed.
    what, (q, k, v, mask) = cases[-2]
    drop = _FixedDropout(0.5, seed).train()
    dropped = expect_tensor(call(fn, q, k, v, mask, drop), t("the output for {what}, with dropout", what=what),
                            tuple(q.shape), "batch heads q_len d_head", dtype)
    expected = _grouped_reference(q, k, v, mask, drop=drop)
    if not close(dropped, expected, dtype):
        if close(dropped, _fused_oracle(q, k, v, mask), dtype):
            hint = t("Your output ignores it: apply `dropout` (when it is not None) to the weights before the "
                     "weighted sum.")
        else:
            hint = next((tr(h) for at, h in DROPOUT_PLACES.items()
                         if close(dropped, _grouped_reference(q, k, v, mask, drop=drop, drop_at=at), dtype)), None)
            hint = hint or t("Apply `dropout` to the softmax's weights, then take the weighted sum of the values.")
        raise CheckFailure(t(
            "For {what}, with a `dropout` module that zeroes a fixed half of its input and doubles the rest, your "
            "output differs from attention whose weights went through it ({difference}). {hint}", what=what,
            difference=difference(dropped, expected, _attention_sizes(q, k)), hint=hint))
    passed(t("grouped_attention equal to F.scaled_dot_product_attention(enable_gqa=True) for GQA, MQA and MHA, "
             "with causal and padding masks, zeros for fully masked rows, batch=1; dropout on the weights "
             "({dtype})", dtype=dtype_name(dtype)))


# -- exercise 3: the module ------------------------------------------------------------------


def _expected_shapes(d_model: int, kv_heads: int, d_head: int, bias: bool) -> dict[str, list[int]]:
    rows = {"w_q": d_model, "w_k": kv_heads * d_head, "w_v": kv_heads * d_head, "w_o": d_model}
    shapes = {f"{p}.weight": [rows[p], d_model] for p in PROJECTIONS}
    if bias:
        shapes |= {f"{p}.bias": [rows[p]] for p in PROJECTIONS}
    return shapes


def _expect_parameters(module: Any, d_model: int, heads: int, kv_heads: int, bias: bool) -> None:
    shapes = call(_parameter_shapes, module)
    d_head = d_model // heads
    expected = _expected_shapes(d_model, kv_heads, d_head, bias)
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckFailure(t(
                "Your module has no parameter {name}. Store the four projections as self.w_q, self.w_k, self.w_v "
                "and self.w_o (nn.Linear, bias=bias).", name=name))
        if shapes[name] == shape:
            continue
        if name.startswith(("w_k", "w_v")) and shapes[name][0] == d_model and kv_heads != heads:
            raise CheckFailure(t(
                "{name} has shape {shape}: it still projects to all d_model={d_model} features, as in multi-head "
                "attention, so the keys and values keep {heads} heads and GQA saves no memory. With "
                "kv_heads={kv_heads} it must map d_model to kv_heads * d_head = {features} features: shape "
                "{expected}.", name=name, shape=tuple(shapes[name]), d_model=d_model, heads=heads,
                kv_heads=kv_heads, features=kv_heads * d_head, expected=tuple(shape)))
        raise CheckFailure(t(
            "{name} has shape {shape}; it should be {expected} with d_model={d_model}, heads={heads}, "
            "kv_heads={kv_heads} (d_head={d_head}): w_q and w_o are (d_model, d_model), w_k and w_v map d_model to "
            "kv_heads * d_head.", name=name, shape=tuple(shapes[name]), expected=tuple(shape), d_model=d_model,
            heads=heads, kv_heads=kv_heads, d_head=d_head))
    refuse_extra_parameters(shapes, expected, bias)


def _random_state(d_model: int, kv_heads: int, d_head: int, dtype: torch.dtype, seed: int,
                  bias: bool = True) -> dict[str, Tensor]:
    """Seeded weights, biases too (so that a missing bias shows)."""
    g = torch.Generator().manual_seed(seed + 11)
    state = {}
    for name, shape in _expected_shapes(d_model, kv_heads, d_head, bias).items():
        size = 1 / math.sqrt(d_model) if name.endswith("weight") else 0.5
        state[name] = torch.randn(shape, generator=g, dtype=dtype) * size
    return state


def _linear(state: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    y = x @ state[f"{name}.weight"].T
    return y + state[f"{name}.bias"] if f"{name}.bias" in state else y  # bias=False: no bias


def _projected(state: dict[str, Tensor], heads: int, kv_heads: int, query: Tensor, key: Tensor,
               value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    def project(name: str, x: Tensor, n: int) -> Tensor:
        return rearrange(_linear(state, name, x), "batch seq (heads d_head) -> batch heads seq d_head", heads=n)

    return project("w_q", query, heads), project("w_k", key, kv_heads), project("w_v", value, kv_heads)


def _merge_project(state: dict[str, Tensor], heads_out: Tensor) -> Tensor:
    return _linear(state, "w_o", rearrange(heads_out, "batch heads seq d_head -> batch seq (heads d_head)"))


@jaxtyped(typechecker=beartype)
def _rotate(x: Float[Tensor, "*batch seq d_head"], positions: Int[Tensor, " seq"],
            base: float = 10000.0) -> Float[Tensor, "*batch seq d_head"]:
    """RoPE by its definition (RoFormer, pairs (0, 1), (2, 3), ... as chapter 06 takes them): pair i of the vector at
    position pos is turned by the angle pos · base^(-2i / d_head), base 10000 as in chapter 06 unless given. Angles
    in float64, whatever x's dtype."""
    d_head = x.shape[-1]
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angle = einsum(positions.to(torch.float64), theta, "seq, pair -> seq pair")
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    pairs = rearrange(x, "... seq (pair two) -> ... seq pair two", two=2)
    even, odd = pairs[..., 0], pairs[..., 1]
    return rearrange([even * cos - odd * sin, even * sin + odd * cos], "two ... seq pair -> ... seq (pair two)")


def _module_oracle(state: dict[str, Tensor], heads: int, kv_heads: int, query: Tensor, key: Tensor, value: Tensor,
                   mask: Tensor | None, positions: Tensor | None = None, rotate: str = "q k",
                   base: float = 10000.0) -> Tensor:
    """Project with the state's weights, attend with F.scaled_dot_product_attention(enable_gqa=True), apply W_O.

    With ``positions`` the queries and keys are turned by RoPE (of ``base``) first (self-attention: the keys sit at
    the queries' positions); ``rotate`` names which of q, k, v are turned, to name the usual mistakes.
    """
    q, k, v = _projected(state, heads, kv_heads, query, key, value)
    if positions is not None:
        turned = rotate.split()
        q, k, v = (_rotate(t, positions, base) if name in turned else t
                   for name, t in zip("qkv", (q, k, v), strict=True))
    return _merge_project(state, _fused_oracle(q, k, v, mask))


def _module_sizes(s: dict[str, int], kv_heads: int, query: Tensor, key: Tensor) -> dict[str, int]:
    return {"batch": query.shape[0], "q_len": query.shape[1], "k_len": key.shape[1], "d_model": query.shape[2],
            "heads": s["heads"], "kv_heads": kv_heads}


def _diagnose_module(state: dict[str, Tensor], heads: int, kv_heads: int, query: Tensor, key: Tensor, value: Tensor,
                     mask: Tensor | None, output: Tensor) -> str:
    if torch.isnan(output).any():
        return t("Your output contains NaN: does the mask reach the attention, is the softmax over k_len, and does "
                 "a query with no readable key get zeros (the given _fused_attention does that for fast=True)?")
    q, k, v = _projected(state, heads, kv_heads, query, key, value)
    d_model = query.shape[-1]
    variants = [
        (t("You repeated the key/value heads in the (group kv_heads) order (Tensor.repeat): query head h must read "
           "key/value head h // group, the (kv_heads group) order."), dict(order="group kv_heads")),
        (t("You scaled the scores by sqrt(d_model); each head's queries and keys have d_head features, so the scale "
           "is sqrt(d_head) (your grouped_attention does it for you)."), dict(scale=math.sqrt(d_model))),
        (t("You did not scale the scores at all: divide by sqrt(d_head)."), dict(scale=1.0)),
    ]
    if mask is not None:
        variants.append((t("Your output ignores the mask: pass it on to the attention."), dict(use_mask=False)))
    for hint, mistake in variants:
        if close(output, _merge_project(state, _grouped_reference(q, k, v, mask, **mistake)), output.dtype):
            return hint
    no_w_o = rearrange(_fused_oracle(q, k, v, mask), "batch heads seq d_head -> batch seq (heads d_head)")
    if close(output, no_w_o, output.dtype):
        return t("You return the concatenated heads without the output projection: apply self.w_o to "
                 "merge_heads(...).")
    return t("Compare, on one small example, your q (heads heads), k and v (kv_heads heads) after split_heads with "
             "those of the check: w_q's output splits into heads, w_k's and w_v's into kv_heads.")


def _build(cls: Any, s: dict[str, int], kv_heads: int, dtype: torch.dtype, seed: int,
           **kwargs: Any) -> tuple[Any, dict[str, Tensor]]:
    module = call(cls, s["d_model"], s["heads"], kv_heads, **kwargs)
    bias = kwargs.get("bias", True)
    _expect_parameters(module, s["d_model"], s["heads"], kv_heads, bias=bias)
    state = _random_state(s["d_model"], kv_heads, s["d_head"], dtype, seed, bias)
    call(_load, module, state)
    return module, state


def _compare(module: Any, state: dict[str, Tensor], s: dict[str, int], kv_heads: int, dtype: torch.dtype,
             what: str, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, cls: Any = None) -> None:
    args = (query, key, value) if mask is None else (query, key, value, mask)
    b, q_len, d_model = query.shape
    try:
        output = call(module, *args)
    except CheckFailure as failure:  # say which case broke it (bias=False, say)
        if not isinstance(failure, CodeRaised):
            raise
        hint = _raised_module(module, args, failure.raised, cls, s, kv_heads, state, dtype)
        raise CheckFailure(t("For {what}: {failure}{hint}", what=what, failure=failure, hint=hint)) from failure
    output = expect_tensor(output, t("the output for {what}", what=what), (b, q_len, d_model), "batch q_len d_model",
                           dtype)
    expected = _module_oracle(state, s["heads"], kv_heads, query, key, value, mask)
    if not close(output, expected, dtype):
        hint = (_eval_mode_hint(module, args, output, expected, state, dtype) or
                _diagnose_module(state, s["heads"], kv_heads, query, key, value, mask, output))
        raise CheckFailure(t(
            "For {what}, your output differs from F.scaled_dot_product_attention(..., enable_gqa=True) with the same "
            "projections ({difference}). {hint}", what=what,
            difference=difference(output, expected, _module_sizes(s, kv_heads, query, key)), hint=hint))


def _cache_class(cls: Any) -> Any:
    """The cache class that ``cls.forward`` is annotated with (the notebook's KVCache), or None."""
    annotation = getattr(getattr(cls, "forward", None), "__annotations__", {}).get("cache")
    return next((t for t in (typing.get_args(annotation) or (annotation,)) if isinstance(t, type) and
                 t is not type(None)), None)


def _what_raised(failure: CheckFailure) -> str:
    """What the student's code raised (``"ValueError: ..."``); for a failure of another kind (a stub, the own-work
    rule), its message."""
    return failure.raised if isinstance(failure, CodeRaised) else str(failure)


def _error_after(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """What ``fn(*args, **kwargs)`` raised (see :func:`_what_raised`), or None when it ran."""
    try:
        call(fn, *args, **kwargs)
    except CheckFailure as failure:
        return _what_raised(failure)
    return None


def _raised_module(module: Any, args: tuple, error: str, cls: Any, s: dict[str, int], kv_heads: int,
                   state: dict[str, Tensor], dtype: torch.dtype) -> str:
    """After ``module(*args)`` raised ``error``: the same call with one thing given that leaves the attention as it is
    (the default positions, an empty cache, a module built with rope=True), to find which step the error comes from."""
    q_len = args[0].shape[1]
    if _error_after(module, *args, positions=torch.arange(q_len)) is None:
        return t(" With positions=torch.arange({q_len}) given, the same call runs, so the error comes from the "
                 "default positions your code computes when positions is None: start, ..., start + query.shape[1] - "
                 "1, one per query, with start = len(cache) with a cache and 0 without (cache is None).", q_len=q_len)
    cache_cls = _cache_class(cls) if cls is not None else None
    if cache_cls is not None:
        other = _error_after(module, *args, cache=call(cache_cls))
        if other is None:
            return t(" With an empty KVCache passed the same call runs, so a step meant for the cache runs when "
                     "cache is None: check the conditions (cache is not None, cache.fixed) around the cache's steps.")
        if other != error:
            return t(" With an empty KVCache passed that error is gone (it raised {raised}), so the error with "
                     "cache=None comes from a step meant for the cache that runs when cache is None: check the "
                     "conditions (cache is not None, cache.fixed) around the cache's steps.", raised=other)
    if cls is not None and s["d_head"] % 2 == 0 and "'NoneType' object is not callable" in error and \
            call(getattr, module, "rope", 1) is None:
        try:
            turning, _ = _build(cls, s, kv_heads, dtype, 0, rope=True, bias="w_q.bias" in state,
                                fast=call(getattr, module, "fast", False) is True)
            call(_load, turning, state)
        except CheckFailure:
            return ""
        if _error_after(turning, *args) is None:
            return t(" Built with rope=True and the same weights, the same call runs, so a step meant for RoPE runs "
                     "when self.rope is None: check the condition around self.rope(...).")
    return ""


def _eval_mode_hint(module: Any, args: tuple, output: Tensor, expected: Tensor, state: dict[str, Tensor],
                    dtype: torch.dtype) -> str:
    """In eval() mode a wrong output that the same module gives right without dropout: dropout acting in eval()."""
    if call(getattr, module, "training", True) is not False:
        return ""
    p = call(_settings, module)["dropout"]
    if p is None:
        return ""
    if p == 0:
        call(_set_training, module, True)
        try:
            again = call(module, *args)
        finally:
            call(_set_training, module, False)
        if type(again) is Tensor and close(again, expected, dtype):
            return t("In train() mode (dropout p = 0) the same module gives the right output; only in eval() mode "
                     "does it differ. Look at the dropout probability used outside training (it is 0.0; with "
                     "fast=True, dropout_p=self.dropout.p if self.training else 0.0).")
        return ""
    dropout = call(getattr, module, "dropout", None)
    call(_set_dropout, module, nn.Dropout(0.0))
    try:
        again = call(module, *args)
    finally:
        call(_set_dropout, module, dropout)
    if type(again) is Tensor and close(again, expected, dtype):
        return t("With self.dropout's p set to 0 the same eval() call gives the right output. Your module drops "
                 "in eval() mode: dropout acts only in training (self.training): nn.Dropout does that itself, and "
                 "with fast=True the given _fused_attention takes dropout_p=self.dropout.p if self.training else "
                 "0.0.")
    return ""


def _set_dropout(module: nn.Module, dropout: nn.Module) -> None:
    module.dropout = dropout


def _check_dropout(cls: Callable[..., Any], s: dict[str, int], dtype: torch.dtype, seed: int, x: Tensor,
                   fast: bool) -> None:
    """dropout=1.0: nothing in eval(); in training every weight is dropped, which leaves w_o's bias alone."""
    dropping, state = _build(cls, s, s["kv_heads"], dtype, seed, dropout=1.0, **({"fast": True} if fast else {}))
    what = (t("self-attention built with dropout=1.0 and fast=True, in eval() mode") if fast else
            t("self-attention built with dropout=1.0, in eval() mode"))
    _compare(dropping, state, s, s["kv_heads"], dtype, what, x, x, x, None, cls=cls)
    call(_set_training, dropping, True)
    got = expect_tensor(call(dropping, x, x, x), t("the output in training"), tuple(x.shape), "batch q_len d_model",
                        dtype)
    expected = state["w_o.bias"].expand_as(x)
    if not close(got, expected, dtype):
        gap = difference(got, expected, _module_sizes(s, s["kv_heads"], x, x))
        if fast:
            raise CheckFailure(t(
                "With dropout=1.0 and fast=True in training mode every attention weight is dropped, so the output "
                "should be w_o's bias alone ({difference}): apply self.dropout (nn.Dropout(dropout)) to the attention "
                "weights, e.g. by passing it to grouped_attention (fast=True: the given _fused_attention, "
                "dropout_p=self.dropout.p while training).", difference=gap))
        raise CheckFailure(t(
            "With dropout=1.0 in training mode every attention weight is dropped, so the output should be w_o's bias "
            "alone ({difference}): apply self.dropout (nn.Dropout(dropout)) to the attention weights, e.g. by passing "
            "it to grouped_attention.", difference=gap))


def _check_dropout_place(cls: Callable[..., Any], s: dict[str, int], dtype: torch.dtype, seed: int,
                         x: Tensor) -> None:
    """self.dropout replaced by a stand-in that multiplies by a fixed mask: the output must be attention whose
    weights went through it."""
    kv = s["kv_heads"]
    module, state = _build(cls, s, kv, dtype, seed + 4, dropout=0.5)
    drop = _FixedDropout(0.5, seed)
    call(_set_dropout, module, drop)
    call(_set_training, module, True)
    got = expect_tensor(call(module, x, x, x), t("the output in training"), tuple(x.shape), "batch q_len d_model",
                        dtype)
    q, k, v = _projected(state, s["heads"], kv, x, x, x)
    expected = _merge_project(state, _grouped_reference(q, k, v, None, drop=drop))
    if close(got, expected, dtype):
        return
    sizes = _module_sizes(s, kv, x, x)
    if not torch.equal(got, call(module, x, x, x)):  # the stand-in is deterministic: the randomness is elsewhere
        fast, _ = _build(cls, s, kv, dtype, seed + 4, dropout=0.5, fast=True)
        call(_load, fast, state)
        call(_set_dropout, fast, drop)
        call(_set_training, fast, True)
        on_fast = call(fast, x, x, x)
        if type(on_fast) is Tensor and close(on_fast, expected, dtype) and torch.equal(on_fast, call(fast, x, x, x)):
            raise CheckFailure(t(
                "In training, with self.dropout replaced by a module that zeroes a fixed half of its input, two calls "
                "on the same input give different outputs ({difference}), while the same module built with fast=True "
                "gives the right output: with fast=False (the default) your module drops on its own, as the fused "
                "path does, and with fast=True it uses self.dropout: are the two paths swapped? fast=False calls "
                "grouped_attention(q, k, v, mask, self.dropout), fast=True the given _fused_attention.",
                difference=difference(got, expected, sizes)))
        raise CheckFailure(t(
            "In training, with self.dropout replaced by a module that zeroes a fixed half of its input, two calls on "
            "the same input give different outputs ({difference}): your module drops with a dropout of its own "
            "(F.dropout?) instead of self.dropout. Keep nn.Dropout(dropout) as self.dropout and pass it to "
            "grouped_attention.", difference=difference(got, expected, sizes)))
    heads_out = _grouped_reference(q, k, v, None)
    merged = rearrange(heads_out, "batch heads seq d_head -> batch seq (heads d_head)")
    variants = [
        (t("Your module does not use self.dropout: keep the nn.Dropout(dropout) as self.dropout and pass it to "
           "grouped_attention, which applies it to the weights."),
         _module_oracle(state, s["heads"], kv, x, x, x, None)),
        (t("You applied self.dropout to the heads' outputs: it acts on the attention weights, before the weighted "
           "sum."), _merge_project(state, drop(heads_out))),
        (t("You applied self.dropout to the merged heads, before w_o: it acts on the attention weights, before the "
           "weighted sum."), _linear(state, "w_o", drop(merged))),
        (t("You applied self.dropout to the output: it acts on the attention weights, before the weighted sum."),
         drop(_merge_project(state, heads_out))),
    ]
    hint = next((h for h, v in variants if close(got, v, dtype)), None)
    hint = hint or t("Pass self.dropout to grouped_attention, which applies it to the softmax's weights.")
    raise CheckFailure(t(
        "In training, with self.dropout replaced by a module that zeroes a fixed half of its input and doubles the "
        "rest, your output differs from attention whose weights went through it ({difference}). {hint}",
        difference=difference(got, expected, sizes), hint=hint))


ROPE_MISTAKES = {
    "q": marked("You turned the queries only: RoPE turns the keys too, by their positions."),
    "k": marked("You turned the keys only: RoPE turns the queries too, by their positions."),
    "q k v": marked("You turned the values too: RoPE turns queries and keys only (values carry no position)."),
}


def _check_rope(module: Any, state: dict[str, Tensor], s: dict[str, int], dtype: torch.dtype, x: Tensor,
                mask: Tensor, positions: Tensor) -> bool:
    """A module built with rope=True, at the default positions 0 ... q_len - 1 and at given ``positions``.

    True when it applies RoPE; False when it ignores rope (chapter 10's notebook lets students leave it out);
    a failure when it does something else.
    """
    kv, heads = s["kv_heads"], s["heads"]
    sizes = _module_sizes(s, kv, x, x)
    try:
        got = call(module, x, x, x, mask)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        hint = _raised_module(module, (x, x, x, mask), failure.raised, None, s, kv, state, dtype)
        raise CheckFailure(t("For self-attention built with rope=True: {failure}{hint}", failure=failure,
                             hint=hint)) from failure
    got = expect_tensor(got, t("the output with rope=True"), tuple(x.shape), "batch q_len d_model", dtype)
    default = torch.arange(x.shape[1])
    expected = _module_oracle(state, heads, kv, x, x, x, mask, default)
    if not close(got, expected, dtype):
        if close(got, _module_oracle(state, heads, kv, x, x, x, mask), dtype):
            return False
        hint = next((tr(h) for rotate, h in ROPE_MISTAKES.items()
                     if close(got, _module_oracle(state, heads, kv, x, x, x, mask, default, rotate), dtype)), None)
        hint = hint or t("Turn q and k (after split_heads, before the scores) with self.rope(q, positions) and "
                         "self.rope(k, positions), positions 0 ... q_len - 1 without a cache.")
        raise CheckFailure(t("For self-attention built with rope=True, with a causal mask, your output differs from "
                             "attention over queries and keys turned by RoPE ({difference}). {hint}",
                             difference=difference(got, expected, sizes), hint=hint))
    got = expect_tensor(call(module, x, x, x, mask, positions=positions), t("the output with rope=True and positions"),
                        tuple(x.shape), "batch q_len d_model", dtype)
    expected = _module_oracle(state, heads, kv, x, x, x, mask, positions)
    if not close(got, expected, dtype):
        hint = (t("Your module ignores `positions`: when they are given, turn q and k by them instead of 0 ... q_len "
                  "- 1.")
                if close(got, _module_oracle(state, heads, kv, x, x, x, mask, default), dtype) else
                t("Turn q and k by the given positions."))
        raise CheckFailure(t("For self-attention built with rope=True and called with positions={positions}, your "
                             "output differs from attention over queries and keys turned by RoPE at those positions "
                             "({difference}). {hint}", positions=positions.tolist(),
                             difference=difference(got, expected, sizes), hint=hint))
    return True


# The base of the RotaryEmbedding that the check gives a module: its turn differs from chapter 06's (base 10000) in
# every pair but the first, so the output tells which rotation turned q and k.
GIVEN_BASE = 100.0


def _rotary_class(cls: Any) -> type[nn.Module]:
    """The RotaryEmbedding class that ``cls`` knows: the module class in the annotation of an ``__init__``'s ``rope``
    (the notebook's signature names it), else the name RotaryEmbedding where an ``__init__`` was defined (the
    notebook's given cell), ``cls``'s own first and then its bases'; else nn.Module."""
    inits = [vars(owner)["__init__"] for owner in getattr(cls, "__mro__", ()) if "__init__" in vars(owner)]
    annotations = [getattr(init, "__annotations__", {}).get("rope") for init in inits]
    named = [t for annotation in annotations for t in (typing.get_args(annotation) or (annotation,))]
    namespaces = [getattr(init, "__globals__", {}).get("RotaryEmbedding") for init in inits]
    return next((t for t in (*named, *namespaces) if isinstance(t, type) and issubclass(t, nn.Module)), nn.Module)


def _given_rotary(cls: Any, d_head: int) -> nn.Module:
    """A RotaryEmbedding to pass as ``rope``: a subclass of :func:`_rotary_class`'s class (so that an
    ``isinstance(rope, RotaryEmbedding)`` in the student's code recognises it) whose forward turns by RoPE of base
    GIVEN_BASE and counts its calls."""
    parent = _rotary_class(cls)

    class GivenRotaryEmbedding(parent):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            if parent is nn.Module:
                super().__init__()
            else:
                super().__init__(d_head)
            self.d_head, self.base, self.calls = d_head, GIVEN_BASE, 0

        def forward(self, x: Tensor, positions: Tensor) -> Tensor:
            self.calls += 1
            return _rotate(x, positions, GIVEN_BASE)

        def __repr__(self) -> str:  # what a failure message shows of it
            return t("<the check's RotaryEmbedding, d_head={d_head}, base={base:g}>", d_head=d_head, base=GIVEN_BASE)

    return GivenRotaryEmbedding()


def _rope_held(module: nn.Module, given: nn.Module) -> tuple[str, str]:
    """What the module keeps as ``self.rope``: ``("given", "")`` when it is that very object, ``("absent", "")``,
    ``("none", "")`` or ``("other", its class's name)``; words for it: :func:`_held_words`."""
    if not hasattr(module, "rope"):
        return "absent", ""
    rope = module.rope
    if rope is given:
        return "given", ""
    return ("none", "") if rope is None else ("other", type(rope).__name__)


def _held_words(held: Any) -> str:
    """What :func:`_rope_held` found, in words."""
    found, name = tuple(held) if type(held) in (tuple, list) and len(held) == 2 else ("other", held)
    if found == "given":
        return t("the given module")
    if found == "absent":
        return t("no attribute rope")
    if found == "none":
        return "None"
    return t("another {name} (not the module given)", name=name)


def _calls_of(given: nn.Module) -> int:
    return given.calls


def _check_given_rope(cls: Callable[..., Any], s: dict[str, int], dtype: torch.dtype, seed: int, x: Tensor,
                      mask: Tensor, turns: bool) -> bool:
    """A module built with ``rope=`` a RotaryEmbedding of base GIVEN_BASE: it keeps that very module as self.rope and
    turns q and k with its forward; one whose d_head is not the layer's is refused with a ValueError.

    ``turns``: whether the module turns q and k with rope=True. One that does not may leave a given module unused too
    (chapter 10's notebook lets students leave rope out): then False. True when it turns q and k by the given module.
    """
    kv, heads, d_head = s["kv_heads"], s["heads"], s["d_head"]
    given = call(_given_rotary, cls, d_head)
    what = t("rope=<a RotaryEmbedding(d_head={d_head}) whose forward turns by base {base:g}>", d_head=d_head,
             base=GIVEN_BASE)
    try:
        module, state = _build(cls, s, kv, dtype, seed + 10, rope=given)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        raise CheckFailure(t("Built with {what}: {failure}", what=what, failure=failure)) from failure
    sizes = _module_sizes(s, kv, x, x)
    got = expect_tensor(call(module, x, x, x, mask), t("the output with {what}", what=what), tuple(x.shape),
                        "batch q_len d_model", dtype)
    unturned = _module_oracle(state, heads, kv, x, x, x, mask)
    if not turns and close(got, unturned, dtype):
        return False
    default = torch.arange(x.shape[1])
    expected = _module_oracle(state, heads, kv, x, x, x, mask, default, base=GIVEN_BASE)
    held, calls = call(_rope_held, module, given), call(_calls_of, given)
    observed = t("Your module's self.rope is {held}, and the given module's forward ran {calls} time(s).",
                 held=_held_words(held), calls=calls)
    if not close(got, expected, dtype):
        if close(got, _module_oracle(state, heads, kv, x, x, x, mask, default), dtype):
            seen = t("your output equals attention over q and k turned by chapter 06's RotaryEmbedding (base 10000)")
        elif close(got, unturned, dtype):
            seen = t("your output equals attention with nothing turned, while built with rope=True it turns q and k")
        else:
            seen = t("your output is neither attention with nothing turned nor with chapter 06's RotaryEmbedding")
        raise CheckFailure(t(
            "For self-attention built with {what}, with a causal mask, {seen}; expected: q and k turned by the given "
            "module ({difference}). {observed} A RotaryEmbedding passed as rope is the layer's part, kept as "
            "self.rope and used as given; only rope=True builds RotaryEmbedding(d_head).", what=what, seen=seen,
            difference=difference(got, expected, sizes), observed=observed))
    if not (type(held) in (tuple, list) and tuple(held)[:1] == ("given",)) or calls == 0:
        raise CheckFailure(t(
            "For self-attention built with {what}, your output is right, but self.rope must be the given module "
            "itself and its forward must turn q and k. {observed}", what=what, observed=observed))
    mismatched = call(_given_rotary, cls, d_head + 2)
    error = call(_error_of, cls, s["d_model"], heads, kv, rope=mismatched)
    if error is None:
        raise CheckFailure(t(
            "GroupedQueryAttention({d_model}, {heads}, {kv_heads}, rope=<a RotaryEmbedding(d_head={rope_d_head})>) "
            "should raise a ValueError, since the given module turns {rope_d_head} features and the heads have "
            "d_head={d_head}; it raised no error. Compare rope.d_head with d_model // heads when rope is a "
            "RotaryEmbedding.", d_model=s["d_model"], heads=heads, kv_heads=kv, rope_d_head=d_head + 2,
            d_head=d_head))
    if error != "ValueError":
        raise CheckFailure(t(
            "GroupedQueryAttention({d_model}, {heads}, {kv_heads}, rope=<a RotaryEmbedding(d_head={rope_d_head})>) "
            "should raise a ValueError, since the given module turns {rope_d_head} features and the heads have "
            "d_head={d_head}; it raised a {error}. Compare rope.d_head with d_model // heads when rope is a "
            "RotaryEmbedding.", d_model=s["d_model"], heads=heads, kv_heads=kv, rope_d_head=d_head + 2,
            d_head=d_head, error=error))
    return True


def _construct(cls: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)``; when it raises, what the error and the same sizes with rope=True tell."""
    try:
        return call(cls, *args, **kwargs)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        # What the code raised (its class and text), never the words of the message around it.
        text = failure.raised
        hint = ""
        if "TypeError" in text and "float" in text:
            hint = t(" A size your __init__ passes to a layer is a float, not an int (the error says so): a size "
                     "computed with `/` is a float even when it divides evenly: w_k and w_v have kv_heads * d_head "
                     "output features, d_head = d_model // heads.")
        elif not kwargs.get("rope") and ("RotaryEmbedding" in text or "rotated in pairs" in text):
            try:
                call(cls, *args, **kwargs, rope=True)
            except CheckFailure:
                pass
            else:
                hint = t(" The same sizes with rope=True build, and without rope (rope=False, the default) the "
                         "RotaryEmbedding's error is raised: your __init__ makes a RotaryEmbedding when rope is "
                         "False: its condition is inverted (self.rope = RotaryEmbedding(d_head) if rope else None).")
        elif "rope" not in kwargs and "AttributeError" in text and "'bool' object" in text:
            hint = _raised_without_given_rope(cls, args, kwargs)
        raise CheckFailure(str(failure) + hint) from failure


def _raised_without_given_rope(cls: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> str:
    """After ``cls(*args, **kwargs)`` (rope=False, the default) raised an AttributeError of a bool: whether the same
    sizes build when rope is a RotaryEmbedding, which shows that the error comes from how rope=False is treated."""
    d_model, heads = args[0], args[1]
    try:
        given = call(_given_rotary, cls, d_model // heads)
        call(cls, *args, **kwargs, rope=given)
    except CheckFailure:
        return ""
    return t(" The same sizes build with rope=<a RotaryEmbedding>, and raise this error of a bool with rope=False "
             "(the default), so a step meant for a RotaryEmbedding given as rope runs when rope is a bool: check the "
             "condition around it (isinstance(rope, RotaryEmbedding)).")


@check
def check_gqa_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """w_k, w_v map d_model to kv_heads * d_head; kv_heads=None means heads; bad sizes raise ValueError."""
    s = _sizes(seed)
    d_model, heads, kv = s["d_model"], s["heads"], s["kv_heads"]
    for kv_heads in (kv, 1, heads):
        _expect_parameters(_construct(cls, d_model, heads, kv_heads), d_model, heads, kv_heads, bias=True)
    _expect_parameters(_construct(cls, d_model, heads, kv, bias=False), d_model, heads, kv, bias=False)
    _expect_parameters(_construct(cls, d_model, heads), d_model, heads, heads, bias=True)
    for args, why in (((d_model, heads, heads - 1), t("{kv_heads} key/value heads cannot be shared equally by "
                                                       "{heads} query heads (check heads % kv_heads)",
                                                       kv_heads=heads - 1, heads=heads)),
                      ((d_model + 1, heads, kv), t("{heads} heads cannot share {d_model} features equally "
                                                   "(check d_model % heads)", heads=heads, d_model=d_model + 1)),
                      ((d_model, 0), t("a layer needs at least one head (check heads >= 1 before d_model % heads, "
                                       "which would divide by zero)")),
                      ((d_model, heads, 0), t("queries need at least one key/value head to read (check kv_heads >= 1 "
                                              "before heads % kv_heads)"))):
        error = call(_error_of, cls, *args)
        if error is None:
            raise CheckFailure(t("GroupedQueryAttention{args} should raise a ValueError, since {why}; it raised no "
                                 "error.", args=args, why=why))
        if error != "ValueError":
            raise CheckFailure(t("GroupedQueryAttention{args} should raise a ValueError, since {why}; it raised a "
                                 "{error}.", args=args, why=why, error=error))
    passed(t("w_q, w_o are (d_model, d_model), w_k, w_v are (kv_heads * d_head, d_model); kv_heads=None means heads; "
             "ValueError for sizes that do not divide and for no heads"))


@check
def check_gqa_self_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Self-attention equal to fused attention with enable_gqa=True (GQA, MQA, masks); to MHA when kv_heads=heads."""
    s = _sizes(seed)
    (x,) = _inputs(s, dtype, seed, s["q_len"])
    seq = s["q_len"]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    padding = _padding_mask(s, seq, seed)
    for kv_heads in (s["kv_heads"], 1):
        module, state = _build(cls, s, kv_heads, dtype, seed + kv_heads)
        for what, mask in ((t("self-attention without a mask"), None),
                           (t("self-attention with a padding mask (batch, 1, 1, k_len)"), padding),
                           (t("self-attention with a causal mask (q_len, k_len)"), causal)):
            _compare(module, state, s, kv_heads, dtype, what, x, x, x, mask, cls=cls)
    _compare(module, state, s, 1, dtype, t("self-attention on one sentence (batch=1) with a padding mask"),
             x[:1], x[:1], x[:1], padding[:1], cls=cls)
    # kv_heads == heads is multi-head attention: PyTorch's own module, with the same weights.
    module, state = _build(cls, s, s["heads"], dtype, seed)
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        mha = nn.MultiheadAttention(s["d_model"], s["heads"], batch_first=True, dtype=dtype).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([state["w_q.weight"], state["w_k.weight"], state["w_v.weight"]]))
        mha.in_proj_bias.copy_(torch.cat([state["w_q.bias"], state["w_k.bias"], state["w_v.bias"]]))
        mha.out_proj.weight.copy_(state["w_o.weight"])
        mha.out_proj.bias.copy_(state["w_o.bias"])
        expected = mha(x, x, x, attn_mask=~causal, need_weights=False)[0]
    got = expect_tensor(call(module, x, x, x, causal), t("the output"), tuple(x.shape), "batch q_len d_model", dtype)
    if not close(got, expected, dtype):
        raise CheckFailure(t(
            "With kv_heads == heads == {heads}, your module should be multi-head attention, equal to "
            "torch.nn.MultiheadAttention with the same weights; it is not ({difference}). {diagnosis}",
            heads=s["heads"], difference=difference(got, expected, _module_sizes(s, s["heads"], x, x)),
            diagnosis=_diagnose_module(state, s["heads"], s["heads"], x, x, x, causal, got)))
    module, state = _build(cls, s, s["kv_heads"], dtype, seed + 3, bias=False)
    _compare(module, state, s, s["kv_heads"], dtype, t("self-attention built with bias=False, with a causal mask"),
             x, x, x, causal, cls=cls)
    # fast=True must give the same results, zeros for queries that may read nothing included.
    module, state = _build(cls, s, s["kv_heads"], dtype, seed + 5, fast=True)
    for what, mask in ((t("self-attention with fast=True and a causal mask"), causal),
                       (t("self-attention with fast=True and a padding mask whose last sentence is all padding"),
                        _padding_mask(s, seq, seed, empty=True))):
        _compare(module, state, s, s["kv_heads"], dtype, what, x, x, x, mask, cls=cls)
    for fast in (False, True):
        _check_dropout(cls, s, dtype, seed, x, fast)
    _check_dropout_place(cls, s, dtype, seed, x)
    # rope=True: optional in the notebook, so a module that ignores it passes; one that applies it must be right.
    r = _even(s)
    (xr,) = _inputs(r, dtype, seed + 8, seq)
    module, state = _build(cls, r, r["kv_heads"], dtype, seed + 6, rope=True)
    positions = torch.randperm(3 * seq, generator=torch.Generator().manual_seed(seed + 9))[:seq].sort().values
    rope = _check_rope(module, state, r, dtype, xr, causal, positions)
    given = _check_given_rope(cls, r, dtype, seed, xr, causal, rope)
    rope_note = t("rope=True turns q and k at their positions") if rope else t("rope=True is ignored (optional here)")
    given_note = (t("a RotaryEmbedding given as rope is kept and turns them") if given else
                  t("a given rope is ignored too"))
    passed(t("self-attention equal to F.scaled_dot_product_attention(enable_gqa=True) for GQA and MQA, with padding "
             "and causal masks, batch=1, bias=False, fast=True; equal to torch.nn.MultiheadAttention when kv_heads == "
             "heads; dropout on the weights, only in training; {rope_note}; {given_note} ({dtype})",
             rope_note=rope_note, given_note=given_note, dtype=dtype_name(dtype)))


@check
def check_gqa_cross_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention (q_len != k_len, key != value) equal to fused attention with enable_gqa=True."""
    s = _sizes(seed)
    query, key, value = _inputs(s, dtype, seed + 1, s["q_len"], s["k_len"], s["k_len"])
    padding = _padding_mask(s, s["k_len"], seed)
    for kv_heads in (s["kv_heads"], 1):
        module, state = _build(cls, s, kv_heads, dtype, seed + 2 * kv_heads)
        for what, mask in ((t("cross-attention without a mask"), None),
                           (t("cross-attention with a padding mask (batch, 1, 1, k_len)"), padding)):
            _compare(module, state, s, kv_heads, dtype, what, query, key, value, mask, cls=cls)
    _compare(module, state, s, 1, dtype, t("cross-attention on one sentence (batch=1) with a padding mask"),
             query[:1], key[:1], value[:1], padding[:1], cls=cls)
    _compare(module, state, s, 1, dtype, t("cross-attention over one key (k_len=1)"), query, key[:, :1],
             value[:, :1], None, cls=cls)
    module, state = _build(cls, s, s["kv_heads"], dtype, seed + 7, fast=True)
    _compare(module, state, s, s["kv_heads"], dtype, t("cross-attention with fast=True and a padding mask whose last "
             "sentence is all padding"), query, key, value, _padding_mask(s, s["k_len"], seed, empty=True), cls=cls)
    passed(t("cross-attention (q_len={q_len}, k_len={k_len}) equal to F.scaled_dot_product_attention(enable_gqa=True) "
             "for GQA and MQA, batch=1, one key, fast=True ({dtype})", q_len=s["q_len"], k_len=s["k_len"],
             dtype=dtype_name(dtype)))


def _decode_with_cache(module: nn.Module, cache: Any, x: Tensor) -> Tensor:
    """Feed the positions of x one at a time, as a decoder does, each reading the cache of the earlier ones."""
    return torch.cat([module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache) for t in range(x.shape[1])],
                     dim=1)


def _decode_in_chunks(module: nn.Module, cache: Any, x: Tensor, bounds: list[int]) -> Tensor:
    """Feed x in chunks [bounds[i], bounds[i + 1]): a prefill, then steps of several positions, each under the
    (new, total) causal mask over the cached keys and its own."""
    outputs = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        chunk = x[:, start:stop]
        mask = torch.ones(stop - start, stop, dtype=torch.bool).tril(start)  # new position start + i reads keys <= it
        outputs.append(module(chunk, chunk, chunk, mask, cache=cache))
    return torch.cat(outputs, dim=1)


def _cache_keys(cache: Any) -> tuple[Tensor, Tensor]:
    return cache.keys.detach().clone(), cache.values.detach().clone()


def _stepwise_failure(what: str, got: Tensor, expected: Tensor, sizes: dict[str, int], hint: str) -> CheckFailure:
    return CheckFailure(t("{what} gives other outputs than one pass of F.scaled_dot_product_attention(enable_gqa=True) "
                          "under a causal mask with the same projections ({difference}). {hint}", what=what,
                          difference=difference(got, expected, sizes), hint=hint))


def _store(cache: Any, keys: Tensor, values: Tensor) -> None:
    cache.store(keys, values)


def _check_fixed_cache_taken(module: Any, state: dict[str, Tensor], s: dict[str, int], cache_cls: Callable[..., Any],
                             dtype: torch.dtype, inputs: tuple[Tensor, ...], failure: CheckFailure) -> None:
    """The first call with an empty fixed cache raised: a module that leaves fixed caches out passes, but one that
    reads or stores a fixed cache (seen with a fixed cache that the check filled with the memory's keys and values)
    must not fail on the first call."""
    query, memory, other, padding = inputs
    kv = s["kv_heads"]
    _, keys, values = _projected(state, s["heads"], kv, query, memory, memory)
    try:
        filled = call(cache_cls, fixed=True)
        call(_store, filled, keys, values)
        later = call(module, query[:, 1:], other, other, padding, cache=filled)
        held = call(_cache_keys, filled)[0]
    except CheckFailure:
        return
    expected = _module_oracle(state, s["heads"], kv, query[:, 1:], memory, memory, padding)
    error = _what_raised(failure).splitlines()[0]
    if type(later) is Tensor and close(later, expected, dtype):
        raise CheckFailure(t(
            "Your module reads a fixed KVCache that holds keys: with the memory's keys and values stored in it, its "
            "output is attention over the memory. But its first call, on an empty fixed cache (cache.keys is None), "
            "raised {error}: on the first call, while cache.keys is None, project key and value and "
            "cache.update(k, v) stores them; on later calls read cache.keys and cache.values.", error=error))
    if type(held) is Tensor and not torch.equal(held, keys):
        raise CheckFailure(t(
            "Your module stores into a fixed KVCache: given one that already holds the memory's keys and values, it "
            "replaced them ({difference}). But its first call, on an empty fixed cache (cache.keys is None), raised "
            "{error}: store only on the first call, while cache.keys is None, and read cache.keys and cache.values "
            "once it holds keys.", difference=difference(held, keys), error=error))


def _check_fixed_cache(module: Any, state: dict[str, Tensor], s: dict[str, int], cache_cls: Callable[..., Any],
                       dtype: torch.dtype, seed: int) -> bool:
    """Cross-attention with a fixed cache: the memory's keys and values are projected on the first call and read
    afterwards, whatever key and value later calls pass. False when the module does not take a fixed cache (the
    notebook lets students leave it out); a failure when it takes one and is wrong."""
    kv = s["kv_heads"]
    query, memory, other = _inputs(s, dtype, seed + 12, s["q_len"], s["k_len"], s["k_len"])
    padding = _padding_mask(s, s["k_len"], seed)
    try:
        fixed = call(cache_cls, fixed=True)
        first = call(module, query[:, :1], memory, memory, padding, cache=fixed)
    except CheckFailure as failure:
        if isinstance(failure, NotOwnWork):
            raise
        _check_fixed_cache_taken(module, state, s, cache_cls, dtype, (query, memory, other, padding), failure)
        return False
    later = call(module, query[:, 1:], other, other, padding, cache=fixed)
    got = expect_tensor(torch.cat([first, later], dim=1) if type(first) is Tensor and type(later) is Tensor else first,
                        t("the cross-attention outputs with a fixed cache"), tuple(query.shape), "batch q_len d_model",
                        dtype)
    expected = _module_oracle(state, s["heads"], kv, query, memory, memory, padding)
    sizes = _module_sizes(s, kv, query, memory)
    if not close(got, expected, dtype):
        reread = torch.cat([expected[:, :1], _module_oracle(state, s["heads"], kv, query[:, 1:], other, other,
                                                             padding)], dim=1)
        hint = (t("Your later calls project the key and value they are given: with a fixed cache that already holds "
                  "keys, read cache.keys and cache.values instead (the memory does not change while decoding).")
                if close(got, reread, dtype) else
                t("On the first call project key and value and cache.update(k, v) stores them; on later calls use "
                  "cache.keys and cache.values."))
        raise CheckFailure(t("Cross-attention with a fixed KVCache, called first with the memory and then with other "
                             "keys and values, differs from attention over the memory ({difference}). {hint}",
                             difference=difference(got, expected, sizes), hint=hint))
    keys, values = call(_cache_keys, fixed)
    _, expected_k, expected_v = _projected(state, s["heads"], kv, query, memory, memory)
    if not close(keys, expected_k, dtype):
        raise CheckFailure(t("The fixed cache should hold the memory's keys, (batch, kv_heads, k_len, d_head), stored "
                             "on the first call ({difference}).", difference=difference(keys, expected_k, sizes)))
    if not close(values, expected_v, dtype):
        raise CheckFailure(t("The fixed cache should hold the memory's values, (batch, kv_heads, k_len, d_head), "
                             "stored on the first call ({difference}).",
                             difference=difference(values, expected_v, sizes)))
    return True


def _first_position_only(state: dict[str, Tensor], s: dict[str, int], x: Tensor, stepwise: Tensor, keys: Tensor,
                         values: Tensor, dtype: torch.dtype) -> str:
    """A cache of one position after several steps: whether it is the first position and every step read only it."""
    kv = s["kv_heads"]
    _, first_k, first_v = _projected(state, s["heads"], kv, x[:, :1], x[:, :1], x[:, :1])
    if not (close(keys, first_k, dtype) and close(values, first_v, dtype)):
        return ""
    if not close(stepwise, _module_oracle(state, s["heads"], kv, x, x[:, :1], x[:, :1], None), dtype):
        return ""
    return t(" It holds the first position's keys and values, and every step attended to that one position only: "
             "after the first step your module read the cache instead of appending to it, as only a fixed "
             "(cross-attention) cache (cache.fixed) is read.")


@check
def check_gqa_cache(classes: tuple[Callable[..., Any], Callable[..., Any]], seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> None:
    """Decoding one position at a time with a KVCache equals the causal full pass; the cache holds kv_heads heads.

    ``classes`` is ``(GroupedQueryAttention, KVCache)``: the student's module and the cache class its
    ``forward`` is annotated with (both are the student's objects, so they travel together).
    """
    cls, cache_cls = classes
    s = _sizes(seed)
    b, kv, d_head, length = s["batch"], s["kv_heads"], s["d_head"], s["k_len"]
    (x,) = _inputs(s, dtype, seed + 4, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    sizes = {**_module_sizes(s, kv, x, x), "d_head": d_head}
    module, state = _build(cls, s, kv, dtype, seed + 9)
    # The full pass against the oracle first: a mistake made alike with and without a cache shows here.
    _compare(module, state, s, kv, dtype, t("self-attention in one pass with a causal mask"), x, x, x, causal,
             cls=cls)
    cache = call(cache_cls)
    stepwise = expect_tensor(call(_decode_with_cache, module, cache, x), t("the outputs decoded one at a time"),
                             tuple(x.shape), "batch q_len d_model", dtype)
    keys, values = call(_cache_keys, cache)
    for name, got in (("keys", keys), ("values", values)):
        if type(got) is not Tensor or tuple(got.shape) != (b, kv, length, d_head):
            shape = tuple(got.shape) if type(got) is Tensor else kind(got)
            hint = (t(" It holds {heads} heads: are your keys and values split into kv_heads heads (and w_k, w_v "
                      "narrower than d_model)?", heads=s["heads"])
                    if type(got) is Tensor and got.shape[1] == s["heads"] else "")
            if type(got) is Tensor and tuple(got.shape) == (b, kv, 1, d_head) and length > 1:
                hint = _first_position_only(state, s, x, stepwise, keys, values, dtype)
            if name == "keys":
                raise CheckFailure(t(
                    "After {length} steps the cache's keys should have shape (batch={batch}, kv_heads={kv_heads}, "
                    "length={length}, d_head={d_head}), got {shape}. Append the new positions' k and v (before "
                    "repeat_kv) with k, v = cache.update(k, v), which returns every cached position.{hint}",
                    length=length, batch=b, kv_heads=kv, d_head=d_head, shape=shape, hint=hint))
            raise CheckFailure(t(
                "After {length} steps the cache's values should have shape (batch={batch}, kv_heads={kv_heads}, "
                "length={length}, d_head={d_head}), got {shape}. Append the new positions' k and v (before "
                "repeat_kv) with k, v = cache.update(k, v), which returns every cached position.{hint}",
                length=length, batch=b, kv_heads=kv, d_head=d_head, shape=shape, hint=hint))
    _, expected_k, expected_v = _projected(state, s["heads"], kv, x, x, x)
    if not (close(keys, expected_k, dtype) and close(values, expected_v, dtype)):
        wrong, expected = (keys, expected_k) if not close(keys, expected_k, dtype) else (values, expected_v)
        raise CheckFailure(t(
            "The cache holds the right shape but not the keys and values of w_k(x) and w_v(x) split into kv_heads "
            "heads ({difference}): append them before repeating them for the query heads.",
            difference=difference(wrong, expected, sizes)))
    expected = _module_oracle(state, s["heads"], kv, x, x, x, causal)
    if not close(stepwise, expected, dtype):
        itself = _module_oracle(state, s["heads"], kv, x, x, x, torch.eye(length, dtype=torch.bool))
        hint = (t("Each step attends to its own position only: it must attend to every cached key and value (what "
                  "cache.update returns), not only the new one.") if close(stepwise, itself, dtype) else
                t("Each step must attend to every cached key and value, what cache.update returns."))
        raise _stepwise_failure(t("Decoding one position at a time with the cache"), stepwise, expected, sizes, hint)
    # A prefill and steps of several positions, each under a (new, total) mask; multi-query attention.
    module, state = _build(cls, s, 1, dtype, seed + 10)
    bounds = sorted({0, (length + 1) // 2, min(length, (length + 1) // 2 + 2), length})
    chunked = expect_tensor(call(_decode_in_chunks, module, call(cache_cls), x, bounds),
                            t("the outputs decoded in chunks"), tuple(x.shape), "batch q_len d_model", dtype)
    expected = _module_oracle(state, s["heads"], 1, x, x, x, causal)
    if not close(chunked, expected, dtype):
        raise _stepwise_failure(
            t("With kv_heads=1, decoding a prefill and then steps of several positions (chunks {bounds}) under "
              "(new, total) causal masks", bounds=bounds), chunked, expected, {**sizes, "kv_heads": 1},
            t("The mask of a step spans every key read, the cached ones and the new: (new, total), as cache.update "
              "returns them all."))
    # A fixed (cross-attention) cache and RoPE with a cache: optional in the notebook.
    module, state = _build(cls, s, kv, dtype, seed + 11)
    fixed = _check_fixed_cache(module, state, s, cache_cls, dtype, seed)
    rope = _check_rope_cache(cls, cache_cls, s, dtype, seed, causal)
    fixed_note = (t("a fixed cache in cross-attention stores the memory once") if fixed else
                  t("a fixed cache is not taken (optional here)"))
    rope_note = t("RoPE positions continue from len(cache)") if rope else t("rope=True is ignored (optional here)")
    passed(t("decoding with a KVCache equals the causal full pass, one position at a time and in chunks (MQA too); "
             "the cache holds (batch, kv_heads={kv_heads}, length, d_head); {fixed_note}; {rope_note} ({dtype})",
             kv_heads=kv, fixed_note=fixed_note, rope_note=rope_note, dtype=dtype_name(dtype)))


def _check_rope_cache(cls: Callable[..., Any], cache_cls: Callable[..., Any], s: dict[str, int], dtype: torch.dtype,
                      seed: int, causal: Tensor) -> bool:
    """rope=True with a cache: position t of a step-by-step decoding is turned by t, so the steps equal the full
    pass. False when the module ignores rope (allowed, and then consistently so)."""
    r = _even(s)
    (x,) = _inputs(r, dtype, seed + 13, causal.shape[0])
    module, state = _build(cls, r, r["kv_heads"], dtype, seed + 14, rope=True)
    full = expect_tensor(call(module, x, x, x, causal), t("the output with rope=True"), tuple(x.shape),
                         "batch q_len d_model", dtype)
    positions = torch.arange(x.shape[1])
    rotated = _module_oracle(state, r["heads"], r["kv_heads"], x, x, x, causal, positions)
    applies = close(full, rotated, dtype)
    expected = rotated if applies else _module_oracle(state, r["heads"], r["kv_heads"], x, x, x, causal)
    stepwise = expect_tensor(call(_decode_with_cache, module, call(cache_cls), x), t("the outputs decoded one at a "
                             "time with rope=True"), tuple(x.shape), "batch q_len d_model", dtype)
    if close(stepwise, expected, dtype):
        return applies
    sizes = {**_module_sizes(r, r["kv_heads"], x, x), "d_head": r["d_head"]}
    if applies and close(stepwise, _module_oracle(state, r["heads"], r["kv_heads"], x, x, x, causal), dtype):
        hint = t("Every step turns its query and key as position 0: with a cache, the new positions start at "
                 "len(cache) (before appending), not at 0.")
    else:
        hint = t("With rope=True and a cache, turn the new q and k by positions len(cache) onwards before appending "
                 "k (the cached keys are turned already).")
    raise _stepwise_failure(t("Decoding one position at a time with a cache and rope=True"), stepwise, expected,
                            sizes, hint)


# -- exercise 4: converting a multi-head checkpoint ----------------------------------------

class _Checkpoint(nn.Module):
    """A layer that from_multihead reads, with the given weights: chapter 03's multi-head attention (its attributes
    heads, w_q, w_k, w_v, w_o and dropout) or, with ``kv_heads``, a GroupedQueryAttention (also kv_heads, rope and
    fast; its rope is a stand-in that only says it is on)."""

    def __init__(self, state: dict[str, Tensor], heads: int, kv_heads: int | None = None, dropout: float = 0.0,
                 rope: bool = False, fast: bool = False) -> None:
        super().__init__()
        d_model, dtype = state["w_q.weight"].shape[1], state["w_q.weight"].dtype
        bias = "w_q.bias" in state
        self.heads = heads
        self.w_q, self.w_o = (nn.Linear(d_model, d_model, bias=bias, dtype=dtype) for _ in range(2))
        rows = state["w_k.weight"].shape[0]
        self.w_k, self.w_v = (nn.Linear(d_model, rows, bias=bias, dtype=dtype) for _ in range(2))
        self.dropout = nn.Dropout(dropout)
        if kv_heads is not None:
            self.kv_heads, self.fast = kv_heads, fast
            self.rope = nn.Identity() if rope else None
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(state[name])

    def __repr__(self) -> str:  # what a failure message shows of it
        kind = "GroupedQueryAttention" if hasattr(self, "kv_heads") else "MultiHeadAttention"
        return t("<the check's {kind}, {features} features, heads={heads}>", kind=kind,
                 features=tuple(self.w_q.weight.shape)[0], heads=self.heads)


def _settings(module: nn.Module) -> dict[str, Any]:
    """What a converted module says about itself: plain values only, so that they can be recorded."""
    def plain(value: Any) -> Any:
        return value if type(value) in (int, bool, float) or value is None else repr(value)

    dropout = getattr(module, "dropout", None)
    return {"heads": plain(getattr(module, "heads", None)), "kv_heads": plain(getattr(module, "kv_heads", None)),
            "fast": plain(getattr(module, "fast", None)), "rope": getattr(module, "rope", None) is not None,
            "dropout": float(dropout.p) if isinstance(dropout, nn.Dropout) else None}


def _raised_pooling(fn: Callable[..., Any], source: nn.Module, state: dict[str, Tensor], heads: int, d_head: int,
                    kv_heads: int, failure: CheckFailure) -> str:
    """After ``from_multihead(source, kv_heads)`` raised: what the error and calls with other kv_heads tell."""
    source_kv = state["w_k.weight"].shape[0] // d_head
    # What the code raised (its class and text); a failure of another kind (a stub, the own-work rule) has none.
    raised = failure.raised if isinstance(failure, CodeRaised) else ""
    if "Could not infer sizes" in raised:
        return "\n" + t("einops could not split the rows into (kv_heads group d_head) from the sizes it was given (the "
                        "error names those it could not infer): pass d_head=... to reduce as well as kv_heads.")
    if raised.startswith("ValueError") and source_kv % kv_heads == 0:
        wrong = next(n for n in range(2, source_kv + 2) if source_kv % n)
        try:
            call(fn, source, wrong)
            other = ""
        except CheckFailure as again:
            other = again.raised if isinstance(again, CodeRaised) else ""
        if not other.startswith("ValueError"):
            return "\n" + t("kv_heads={kv_heads} divides the source's {source_kv} key/value heads, yet it raised a "
                            "ValueError, while kv_heads={wrong}, which does not divide them, raised no ValueError: the "
                            "condition that refuses groups of unequal size is inverted: raise when source_kv_heads % "
                            "kv_heads is not 0.", kv_heads=kv_heads, source_kv=source_kv, wrong=wrong)
        return "\n" + t("kv_heads={kv_heads} divides the source's {source_kv} key/value heads ({source_kv} % "
                        "{kv_heads} == 0), yet it raised a ValueError: raise only when the remainder source_kv_heads % "
                        "kv_heads is not 0.", kv_heads=kv_heads, source_kv=source_kv)
    if kv_heads == source_kv:
        return ""
    try:
        unpooled = call(fn, source, source_kv)
        got = call(_state_of, unpooled)
    except CheckFailure:
        return ""
    if type(got) is not dict or type(got.get("w_k.weight")) is not Tensor:
        return ""
    pooled, source_w = got["w_k.weight"], state["w_k.weight"]
    if pooled.shape == source_w.T.shape and torch.equal(pooled, source_w.T) and not torch.equal(pooled, source_w):
        return "\n" + t("With kv_heads={source_kv} (nothing to pool) it runs, but its w_k.weight is the source's "
                        "transposed: the reduce pattern must keep d_model last, '(kv_heads group d_head) d_model -> "
                        "(kv_heads d_head) d_model', the order of the axes of nn.Linear's weight (out, in).",
                        source_kv=source_kv)
    if not torch.equal(got["w_k.weight"], state["w_k.weight"]):
        return ""
    sizes = re.search(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton "
                      r"dimension 0", raised)
    if sizes and int(sizes.group(1)) == source_kv * d_head and int(sizes.group(2)) == kv_heads * d_head:
        return "\n" + t("With kv_heads={source_kv} (nothing to pool) it runs and copies w_k right. With "
                        "kv_heads={kv_heads} the error copies the pooled {pooled_rows} rows (kv_heads * d_head) into a "
                        "weight of {source_rows} rows, as many as the source has: the GroupedQueryAttention your code "
                        "builds must get kv_heads={kv_heads}: GroupedQueryAttention(d_model, heads, kv_heads, ...).",
                        source_kv=source_kv, kv_heads=kv_heads, pooled_rows=kv_heads * d_head,
                        source_rows=source_kv * d_head)
    return "\n" + t("With kv_heads={source_kv} (nothing to pool) it runs and copies w_k right: the error comes with "
                    "pooling: compare the shape of each pooled weight with the converted module's.",
                    source_kv=source_kv)


def _check_pooling(fn: Callable[..., Any], source: nn.Module, state: dict[str, Tensor], heads: int, d_head: int,
                   kv_heads: int, dtype: torch.dtype, what: str, settings: dict[str, Any]) -> None:
    """from_multihead(source, kv_heads): shapes, w_q and w_o copied, each group's key/value heads averaged, and the
    module's settings carried over."""
    d_model = heads * d_head
    bias = "w_q.bias" in state
    try:
        converted = call(fn, source, kv_heads)
    except CheckFailure as failure:
        source_kv = state["w_k.weight"].shape[0] // d_head
        hint = _raised_pooling(fn, source, state, heads, d_head, kv_heads, failure)
        if not hint and not bias:
            hint = "\n" + t("The source has no biases: pass bias=False (mha.w_q.bias is None) and copy no bias.")
        elif not hint and source_kv != heads:
            hint = "\n" + t("This source has {source_kv} key/value heads, not heads={heads}: read its rows as "
                            "(kv_heads group d_head) with the new kv_heads, so group = {source_kv} // kv_heads.",
                            source_kv=source_kv, heads=heads)
        raise CheckFailure(t("From {what}: {failure}{hint}", what=what, failure=failure, hint=hint)) from failure
    got = call(_state_of, converted)
    if type(got) is not dict or any(type(v) is not Tensor for v in got.values()):
        raise CheckFailure(t("from_multihead should return a GroupedQueryAttention module, got {kind}.",
                             kind=kind(converted)))
    expected_shapes = _expected_shapes(d_model, kv_heads, d_head, bias=bias)
    shapes = {name: list(v.shape) for name, v in got.items()}
    if shapes != expected_shapes:
        hint = t(" The source has no biases: pass bias=False (mha.w_q.bias is None).") if not bias else ""
        raise CheckFailure(t(
            "from_multihead({what}, kv_heads={kv_heads}) returned parameters of shapes {shapes}; a "
            "GroupedQueryAttention(d_model={d_model}, heads={heads}, kv_heads={kv_heads}, bias={bias}) has "
            "{expected}.{hint}", what=what, kv_heads=kv_heads, shapes=shapes, d_model=d_model, heads=heads,
            bias=bias, expected=expected_shapes, hint=hint))
    sizes = {"heads": heads, "kv_heads": kv_heads, "d_head": d_head, "d_model": d_model}
    for name in [f"{p}.{w}" for p in ("w_q", "w_o") for w in ("weight", "bias") if f"{p}.{w}" in state]:
        if not torch.equal(got[name], state[name]):
            hint = (t(" The converted module's {name} is {got}, the source's {source}: put the module on the "
                      "source's dtype and device (gqa.to(dtype=..., device=...)) before copying.", name=name,
                      got=got[name].dtype, source=state[name].dtype)
                    if got[name].dtype != state[name].dtype else "")
            raise CheckFailure(t("From {what}, {name} should be copied unchanged; it is not ({difference}).{hint}",
                                 what=what, name=name, difference=difference(got[name], state[name], sizes),
                                 hint=hint))
    for name in [f"{p}.{w}" for p in ("w_k", "w_v") for w in ("weight", "bias") if f"{p}.{w}" in state]:
        pattern = "(kv_heads group d_head) ... -> (kv_heads d_head) ..."
        expected = reduce(state[name], pattern, "mean", kv_heads=kv_heads, d_head=d_head)
        if close(got[name], expected, dtype):
            continue
        across = reduce(state[name], "(group kv_heads d_head) ... -> (kv_heads d_head) ...", "mean",
                        kv_heads=kv_heads, d_head=d_head)
        first = rearrange(state[name], "(kv_heads group d_head) ... -> kv_heads group d_head ...",
                          kv_heads=kv_heads, d_head=d_head)[:, 0]
        if close(got[name], across, dtype):
            hint = t("You averaged across the groups, (group kv_heads d_head): key head g then mixes heads g, "
                     "g + kv_heads, ... of different groups. A group is `group` consecutive heads, the "
                     "(kv_heads group d_head) order of repeat_kv: average within it.")
        elif close(got[name], rearrange(first, "kv_heads d_head ... -> (kv_heads d_head) ..."), dtype):
            hint = t("You kept the first head of each group; the GQA paper averages (mean-pools) all of its heads.")
        else:
            hint = t("Read the rows of the source's weight as (kv_heads group d_head) and average over group: "
                     "reduce(w, '(kv_heads group d_head) d_model -> (kv_heads d_head) d_model', 'mean', ...).")
        group = state[name].shape[0] // d_head // kv_heads
        raise CheckFailure(t("From {what} with kv_heads={kv_heads}, {name} is not the mean of each group's {group} "
                             "heads ({difference}). {hint}", what=what, kv_heads=kv_heads, name=name, group=group,
                             difference=difference(got[name], expected, sizes), hint=hint))
    found = call(_settings, converted)
    for key, value in settings.items():
        if found.get(key) != value and key in ("fast", "rope") and not hasattr(source, key):
            raise CheckFailure(t("From {what}, the converted module's {key} is {found!r}; it should be {value!r}. A "
                                 "multi-head source has no `{key}` attribute, so the converted module must get "
                                 "{key}'s default, {value!r} (getattr(mha, \"{key}\", ...) with that default).",
                                 what=what, key=key, found=found.get(key), value=value))
        if found.get(key) != value:
            raise CheckFailure(t("From {what}, the converted module's {key} is {found!r}; it should be {value!r}: "
                                 "build GroupedQueryAttention(d_model, heads, kv_heads, bias=..., "
                                 "dropout=mha.dropout.p, ...) with the source's settings (a GroupedQueryAttention "
                                 "source keeps its rope and fast).", what=what, key=key, found=found.get(key),
                                 value=value))


@check
def check_from_multihead(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Mean-pooling each group's key/value heads (the GQA paper); w_q and w_o kept; kv_heads == heads exact."""
    s = _sizes(seed)
    d_model, heads, d_head = s["d_model"], s["heads"], s["d_head"]
    state = _random_state(d_model, heads, d_head, dtype, seed + 21)
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        source = _Checkpoint(state, heads, dropout=0.25)
        bare_state = _random_state(d_model, heads, d_head, dtype, seed + 22, bias=False)
        bare = _Checkpoint(bare_state, heads)
        # A grouped source (8 query heads over 4 key/value heads) with rope and fast, pooled into 2 and refused 3.
        grouped_state = _random_state(8 * 6, 4, 6, dtype, seed + 23)
        grouped = _Checkpoint(grouped_state, 8, kv_heads=4, dropout=0.1, rope=True, fast=True)
    mha = {"heads": heads, "fast": False, "rope": False, "dropout": 0.25}
    for kv_heads in (s["kv_heads"], 1, heads):
        _check_pooling(fn, source, state, heads, d_head, kv_heads, dtype, t("a multi-head layer"),
                       mha | {"kv_heads": kv_heads})
    _check_pooling(fn, bare, bare_state, heads, d_head, s["kv_heads"], dtype, t("a multi-head layer with bias=False"),
                   {"kv_heads": s["kv_heads"]})
    _check_pooling(fn, grouped, grouped_state, 8, 6, 2, dtype, t("a GroupedQueryAttention with kv_heads=4, rope and "
                   "fast"), {"heads": 8, "kv_heads": 2, "fast": True, "rope": True, "dropout": 0.1})
    if call(_error_of, fn, grouped, 3) is None:
        raise CheckFailure(t("from_multihead(gqa, kv_heads=3) of a GroupedQueryAttention with 4 key/value heads "
                             "should raise a ValueError: 4 heads cannot be pooled into 3 groups of equal size; it "
                             "returned a module."))
    (x,) = _inputs(s, dtype, seed + 6, s["q_len"])
    exact = call(fn, source, heads)
    call(_set_training, exact, False)  # the source's dropout came along: off for the comparison
    same = expect_tensor(call(exact, x, x, x), t("the converted module's output"), tuple(x.shape),
                         "batch q_len d_model", dtype)
    expected = _module_oracle(state, heads, heads, x, x, x, None)
    if not close(same, expected, dtype):
        raise CheckFailure(t("With kv_heads == heads nothing is pooled, so the converted module should give the "
                             "multi-head module's outputs (up to rounding); it does not ({difference}).",
                             difference=difference(same, expected, _module_sizes(s, heads, x, x))))
    passed(t("from_multihead mean-pools each group of consecutive key/value heads (from multi-head and grouped "
             "sources, with and without biases), keeps w_q, w_o and the settings, refuses groups that do not divide, "
             "and gives the same outputs for kv_heads == heads ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 5: predict, then measure -----------------------------------------------------

@check
def check_cache_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """The measured bytes equal 2 · kv_heads · d_head · length · batch · 4 for MHA, GQA and MQA."""
    s = _sizes(seed)
    d_head, heads = s["d_head"], s["heads"]
    for kv_heads, length, batch in ((heads, s["k_len"], s["batch"]), (s["kv_heads"], s["q_len"], s["batch"]),
                                    (1, s["k_len"], 1)):
        got = call(fn, heads * d_head, heads, kv_heads, length, batch)
        if type(got) is not int:
            raise CheckFailure(t("measure_cache_bytes should return a Python int (the cache's nbytes), got {kind}.",
                                 kind=kind(got)))
        expected = 2 * kv_heads * d_head * length * batch * 4
        if got == expected:
            continue
        raise CheckFailure(t(
            "For d_model={d_model}, heads={heads}, kv_heads={kv_heads}, length={length}, batch={batch} you measured "
            "{got:,} bytes; float32 keys and values of kv_heads heads take {expected:,}. {hint}",
            d_model=heads * d_head, heads=heads, kv_heads=kv_heads, length=length, batch=batch, got=got,
            expected=expected, hint=_measurement_hint(got, heads, kv_heads, d_head, length, batch)))
    passed(t("measured KV-cache bytes equal 2 · kv_heads · d_head · length · batch · 4 for MHA, GQA and MQA"))


def _measurement_hint(got: int, heads: int, kv_heads: int, d_head: int, length: int, batch: int) -> str:
    """What a wrong byte count is, read as a number of cached positions, sentences, heads or tensors."""
    per_position = 2 * kv_heads * d_head * batch * 4
    positions, rest = divmod(got, per_position)
    if got == 2 * heads * d_head * length * batch * 4 and heads != kv_heads:
        return t("That is what multi-head attention keeps: your cache holds all the query heads' worth of keys and "
                 "values. Are w_k and w_v narrower (kv_heads * d_head) and k, v split into kv_heads heads?")
    if got * 2 == per_position * length:
        return t("That is half: count the values as well as the keys.")
    if batch > 1 and got * batch == per_position * length:
        return t("That is the cache of one sentence, not of batch={batch}: feed x of shape (batch, 1, d_model) at "
                 "every step.", batch=batch)
    if got == 0:
        return t("The cache is empty after {length} steps: no step appended a position. Each step must be one "
                 "position, x[:, t:t + 1], run through the layer with cache=cache.", length=length)
    if rest == 0 and positions != length:
        return _positions_hint(positions, length)
    return t("Build the GroupedQueryAttention(d_model, heads, kv_heads), run the positions through it one at a time "
             "in self-attention with one KVCache, and return cache.nbytes.")


def _positions_hint(positions: int, length: int) -> str:
    """A byte count that is a whole number of cached positions, but not ``length`` of them: how many, in words."""
    if positions == 1:
        if positions == length - 1:
            return t("That is the cache of 1 position, one fewer than length={length}. Each of the `length` steps "
                     "must append exactly one position: x[:, t:t + 1] for t in range(length).", length=length)
        if positions == length + 1:
            return t("That is the cache of 1 position, one more than length={length}. Each of the `length` steps "
                     "must append exactly one position: x[:, t:t + 1] for t in range(length).", length=length)
        if positions < length:
            return t("That is the cache of 1 position, fewer than length={length}. Each of the `length` steps must "
                     "append exactly one position: x[:, t:t + 1] for t in range(length).", length=length)
        return t("That is the cache of 1 position, more than length={length}. Each of the `length` steps must append "
                 "exactly one position: x[:, t:t + 1] for t in range(length).", length=length)
    if positions == length - 1:
        return t("That is the cache of {positions} positions, one fewer than length={length}. Each of the `length` "
                 "steps must append exactly one position: x[:, t:t + 1] for t in range(length).", positions=positions,
                 length=length)
    if positions == length + 1:
        return t("That is the cache of {positions} positions, one more than length={length}. Each of the `length` "
                 "steps must append exactly one position: x[:, t:t + 1] for t in range(length).", positions=positions,
                 length=length)
    if positions < length:
        return t("That is the cache of {positions} positions, fewer than length={length}. Each of the `length` steps "
                 "must append exactly one position: x[:, t:t + 1] for t in range(length).", positions=positions,
                 length=length)
    return t("That is the cache of {positions} positions, more than length={length}. Each of the `length` steps must "
             "append exactly one position: x[:, t:t + 1] for t in range(length).", positions=positions, length=length)
