"""Checks for chapter 10: repeat_kv, grouped attention, GroupedQueryAttention, from_multihead, cache bytes.

The oracle is PyTorch's fused ``F.scaled_dot_product_attention(..., enable_gqa=True)``, which
shares each key/value head among its group of query heads without copying it, and
``torch.nn.MultiheadAttention`` for ``kv_heads == heads``. Weights are seeded and copied into the
student's module. Every touch of the student's code (building a module, loading weights, running
it, reading its cache) goes through :func:`call`, with the small helpers below.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, reduce, repeat
from torch import Tensor, nn

from stepformer.checks._core import CheckFailure, call, check, close, expect_tensor, kind, passed
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import parameter_shapes as _parameter_shapes
from stepformer.checks._modules import parameters_of as _state_of
from stepformer.checks._modules import set_training as _set_training
from stepformer.checks.multihead import _inputs, _padding_mask

AXES = ("batch", "kv_heads", "group", "q_len", "k_len", "d_head")
PROJECTIONS = ("w_q", "w_k", "w_v", "w_o")
# grouped_attention is where students share the key/value heads themselves: PyTorch's fused
# attention, whose enable_gqa does exactly that, is off limits there. Not in the module: the
# reference's `fast` path calls it (through _fused_attention), and the grouping of the module's
# own path is graded through grouped_attention, which it calls.
BUILT_IN_GQA = {
    "torch.nn.functional.scaled_dot_product_attention": "PyTorch's fused attention, whose enable_gqa does the grouping",
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes (heads = kv_heads * group and d_model = heads * d_head computed), so a swapped
    axis cannot pass."""
    if seed == 0:
        sizes = dict(zip(AXES, (3, 2, 4, 5, 7, 6), strict=True))
    else:
        g = torch.Generator().manual_seed(seed)
        while True:
            kv_heads, group = (torch.randperm(3, generator=g)[:2] + 2).tolist()
            rest = (torch.randperm(8, generator=g)[:4] + 2).tolist()
            sizes = dict(zip(AXES, (rest[0], kv_heads, group, rest[1], rest[2], rest[3]), strict=True))
            values = [*sizes.values(), kv_heads * group]
            if len(set(values)) == len(values):
                break
    heads = sizes["kv_heads"] * sizes["group"]
    return {**sizes, "heads": heads, "d_model": heads * sizes["d_head"]}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- exercise 1: repeat_kv -----------------------------------------------------------------

@check
def check_repeat_kv(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """(batch, kv_heads, seq, d_head) -> (batch, heads, seq, d_head), query head h reading key head h // group."""
    s = _sizes(seed)
    b, kv, group, seq, d_head = s["batch"], s["kv_heads"], s["group"], s["k_len"], s["d_head"]
    g = torch.Generator().manual_seed(seed)
    for kv_heads, heads in ((kv, kv * group), (1, group), (kv, kv)):
        x = torch.randn(b, kv_heads, seq, d_head, generator=g, dtype=dtype)
        got = expect_tensor(call(fn, x, heads), f"repeat_kv(x, heads={heads}) with kv_heads={kv_heads}",
                            (b, heads, seq, d_head), "batch heads seq d_head", dtype)
        expected = x.repeat_interleave(heads // kv_heads, dim=1)
        if torch.equal(got, expected):
            continue
        if torch.equal(got, x.repeat(1, heads // kv_heads, 1, 1)):
            raise CheckFailure(
                "You repeated the key/value heads in the (group kv_heads) order, the order of Tensor.repeat: query "
                "head h then reads key head h % kv_heads. Consecutive query heads form a group, so query head h "
                "must read key head h // group: write '(kv_heads group)' in the pattern (or use repeat_interleave)."
            )
        raise CheckFailure(
            f"With kv_heads={kv_heads} and heads={heads}, query head h should get key/value head h // "
            f"{heads // kv_heads} unchanged, as x.repeat_interleave(heads // kv_heads, dim=1) gives: use "
            "repeat(x, 'batch kv_heads seq d_head -> batch (kv_heads group) seq d_head', group=heads // kv_heads)."
        )
    x = torch.randn(b, kv, seq, d_head, generator=g, dtype=dtype)
    error = call(_error_of, fn, x, kv * group + 1)
    if error != "ValueError":
        got = "no error" if error is None else f"a {error}"
        raise CheckFailure(
            f"repeat_kv(x, heads={kv * group + 1}) with kv_heads={kv} should raise a ValueError, since {kv} key heads "
            f"cannot be shared equally by {kv * group + 1} query heads; it raised {got}. Check heads % kv_heads."
        )
    passed(f"repeat_kv: (batch, kv_heads, seq, d_head) -> (batch, heads, seq, d_head) in the (kv_heads group) order, "
           f"ValueError when kv_heads does not divide heads ({_dtype_name(dtype)})")


# -- exercise 2: grouped attention -----------------------------------------------------------

def _grouped_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, order: str = "kv_heads group",
                       scale: float | None = None, use_mask: bool = True) -> Tensor:
    """Grouped attention written out, with switches for the usual mistakes (to name them)."""
    group = q.shape[1] // k.shape[1]
    k, v = (repeat(t, f"batch kv_heads seq d_head -> batch ({order}) seq d_head", group=group) for t in (k, v))
    scale = math.sqrt(q.shape[-1]) if scale is None else scale
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len") / scale
    if mask is not None and use_mask:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num()
    return einsum(weights, v, "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")


def _fused_oracle(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """PyTorch's fused attention, with the course's rule that a query with no readable key outputs zeros."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if mask is not None:
        readable = mask.expand(*q.shape[:-1], k.shape[-2]).any(dim=-1, keepdim=True)
        out = torch.where(readable, out, torch.zeros_like(out))
    return out


def _diagnose_grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, output: Tensor) -> str:
    if torch.isnan(output).any():
        return ("Your output contains NaN: a query whose keys are all masked must get zero weights and a zero "
                "output, as in chapter 01 (softmax over all -inf is NaN: fill such rows before and after it).")
    variants = {
        "You repeated the key/value heads in the (group kv_heads) order (Tensor.repeat): query head h must read "
        "key/value head h // group, the (kv_heads group) order of your repeat_kv.": dict(order="group kv_heads"),
        "You scaled the scores by something other than sqrt(d_head): each head's dot products have d_head "
        "terms.": dict(scale=math.sqrt(q.shape[1] * q.shape[-1])),
        "You did not scale the scores at all: divide by sqrt(d_head).": dict(scale=1.0),
    }
    if mask is not None:
        variants["Your output ignores the mask: fill the scores of masked keys with -inf before the softmax."] = dict(
            use_mask=False)
    for hint, mistake in variants.items():
        if close(output, _grouped_reference(q, k, v, mask, **mistake), output.dtype):
            return hint
    return ("Repeat k and v with your repeat_kv to `heads` heads, then attend as in chapter 01: scores q·k / "
            "sqrt(d_head) with einsum, masked keys -inf, softmax over k_len, weighted sum of the repeated values.")


def _grouped_cases(s: dict[str, int], dtype: torch.dtype, seed: int) -> list[tuple[str, tuple[Tensor, ...]]]:
    g = torch.Generator().manual_seed(seed + 7)
    b, heads, kv, q_len, k_len, d_head = s["batch"], s["heads"], s["kv_heads"], s["q_len"], s["k_len"], s["d_head"]
    cases = []
    for kv_heads, name in ((kv, "GQA"), (1, "MQA (kv_heads=1)"), (heads, "MHA (kv_heads=heads)")):
        q = torch.randn(b, heads, q_len, d_head, generator=g, dtype=dtype)
        k, v = (torch.randn(b, kv_heads, k_len, d_head, generator=g, dtype=dtype) for _ in range(2))
        cases.append((f"{name} without a mask", (q, k, v, None)))
    q = torch.randn(b, heads, q_len, d_head, generator=g, dtype=dtype)
    k, v = (torch.randn(b, kv, k_len, d_head, generator=g, dtype=dtype) for _ in range(2))
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    cases.append(("GQA with a causal mask (q_len, k_len)", (q, k, v, causal)))
    padding = torch.rand(b, 1, 1, k_len, generator=g) < 0.6
    padding[:, ..., 0] = True
    padding[-1] = False  # the last sentence is all padding: its rows may read nothing
    cases.append(("GQA with a padding mask (batch, 1, 1, k_len) and fully masked rows", (q, k, v, padding)))
    return cases


@check(forbid=BUILT_IN_GQA)
def check_grouped_attention(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to F.scaled_dot_product_attention(enable_gqa=True) for GQA, MQA and MHA, with masks; dropout on weights."""
    s = _sizes(seed)
    for what, (q, k, v, mask) in _grouped_cases(s, dtype, seed):
        got = expect_tensor(call(fn, q, k, v, mask), f"the output for {what}", tuple(q.shape),
                            "batch heads q_len d_head", dtype)
        expected = _fused_oracle(q, k, v, mask)
        if not close(got, expected, dtype):
            raise CheckFailure(
                f"For {what} (heads={q.shape[1]}, kv_heads={k.shape[1]}), your output differs from "
                f"F.scaled_dot_product_attention(q, k, v, enable_gqa=True) (largest difference "
                f"{(got - expected).nan_to_num(1e9).abs().max().item():.3g}). {_diagnose_grouped(q, k, v, mask, got)}"
            )
    q, k, v, _ = _grouped_cases(s, dtype, seed)[0][1]
    dropped = expect_tensor(call(fn, q, k, v, None, nn.Dropout(1.0).train()), "the output with dropout=1.0",
                            tuple(q.shape), "batch heads q_len d_head", dtype)
    if not torch.equal(dropped, torch.zeros_like(dropped)):
        raise CheckFailure(
            "With dropout=nn.Dropout(1.0) in training mode every attention weight is dropped, so the output should "
            "be all zeros: apply `dropout` (when it is not None) to the weights before the weighted sum."
        )
    passed(f"grouped_attention equal to F.scaled_dot_product_attention(enable_gqa=True) for GQA, MQA and MHA, "
           f"with causal and padding masks, zeros for fully masked rows; dropout on the weights ({_dtype_name(dtype)})")


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
            raise CheckFailure(
                f"Your module has no parameter {name}. Store the four projections as self.w_q, self.w_k, self.w_v "
                "and self.w_o (nn.Linear, bias=bias)."
            )
        if shapes[name] == shape:
            continue
        if name.startswith(("w_k", "w_v")) and shapes[name][0] == d_model and kv_heads != heads:
            raise CheckFailure(
                f"{name} has shape {tuple(shapes[name])}: it still projects to all d_model={d_model} features, as in "
                f"multi-head attention, so the keys and values keep {heads} heads and GQA saves no memory. With "
                f"kv_heads={kv_heads} it must map d_model to kv_heads * d_head = {kv_heads * d_head} features: "
                f"shape {tuple(shape)}."
            )
        raise CheckFailure(
            f"{name} has shape {tuple(shapes[name])}; it should be {tuple(shape)} with d_model={d_model}, "
            f"heads={heads}, kv_heads={kv_heads} (d_head={d_head}): w_q and w_o are (d_model, d_model), w_k and w_v "
            "map d_model to kv_heads * d_head."
        )
    extra = sorted(set(shapes) - set(expected))
    if extra:
        hint = " With bias=False, pass bias=bias to every nn.Linear." if not bias else ""
        raise CheckFailure(f"Unexpected parameters {extra}: only w_q, w_k, w_v and w_o are learned.{hint}")


def _random_state(d_model: int, kv_heads: int, d_head: int, dtype: torch.dtype, seed: int) -> dict[str, Tensor]:
    """Seeded weights, biases too (so that a missing bias shows)."""
    g = torch.Generator().manual_seed(seed + 11)
    state = {}
    for name, shape in _expected_shapes(d_model, kv_heads, d_head, bias=True).items():
        size = 1 / math.sqrt(d_model) if name.endswith("weight") else 0.5
        state[name] = torch.randn(shape, generator=g, dtype=dtype) * size
    return state


def _projected(state: dict[str, Tensor], heads: int, kv_heads: int, query: Tensor, key: Tensor,
               value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    def project(name: str, x: Tensor, n: int) -> Tensor:
        y = x @ state[f"{name}.weight"].T + state[f"{name}.bias"]
        return rearrange(y, "batch seq (heads d_head) -> batch heads seq d_head", heads=n)

    return project("w_q", query, heads), project("w_k", key, kv_heads), project("w_v", value, kv_heads)


def _merge_project(state: dict[str, Tensor], heads_out: Tensor) -> Tensor:
    return rearrange(heads_out, "batch heads seq d_head -> batch seq (heads d_head)") @ state["w_o.weight"].T \
        + state["w_o.bias"]


def _module_oracle(state: dict[str, Tensor], heads: int, kv_heads: int, query: Tensor, key: Tensor, value: Tensor,
                   mask: Tensor | None) -> Tensor:
    """Project with the state's weights, attend with F.scaled_dot_product_attention(enable_gqa=True), apply W_O."""
    q, k, v = _projected(state, heads, kv_heads, query, key, value)
    return _merge_project(state, _fused_oracle(q, k, v, mask))


def _diagnose_module(state: dict[str, Tensor], heads: int, kv_heads: int, query: Tensor, key: Tensor, value: Tensor,
                     mask: Tensor | None, output: Tensor) -> str:
    if torch.isnan(output).any():
        return "Your output contains NaN: does the mask reach the attention, and is the softmax over k_len?"
    q, k, v = _projected(state, heads, kv_heads, query, key, value)
    d_model = query.shape[-1]
    variants = {
        "You repeated the key/value heads in the (group kv_heads) order (Tensor.repeat): query head h must read "
        "key/value head h // group, the (kv_heads group) order.": dict(order="group kv_heads"),
        "You scaled the scores by sqrt(d_model); each head's queries and keys have d_head features, so the scale "
        "is sqrt(d_head) (your grouped_attention does it for you).": dict(scale=math.sqrt(d_model)),
        "You did not scale the scores at all: divide by sqrt(d_head).": dict(scale=1.0),
    }
    if mask is not None:
        variants["Your output ignores the mask: pass it on to the attention."] = dict(use_mask=False)
    for hint, mistake in variants.items():
        if close(output, _merge_project(state, _grouped_reference(q, k, v, mask, **mistake)), output.dtype):
            return hint
    no_w_o = rearrange(_fused_oracle(q, k, v, mask), "batch heads seq d_head -> batch seq (heads d_head)")
    if close(output, no_w_o, output.dtype):
        return "You return the concatenated heads without the output projection: apply self.w_o to merge_heads(...)."
    return ("Compare, on one small example, your q (heads heads), k and v (kv_heads heads) after split_heads with "
            "those of the check: w_q's output splits into heads, w_k's and w_v's into kv_heads.")


def _build(cls: Any, s: dict[str, int], kv_heads: int, dtype: torch.dtype, seed: int,
           **kwargs: Any) -> tuple[Any, dict[str, Tensor]]:
    module = call(cls, s["d_model"], s["heads"], kv_heads, **kwargs)
    _expect_parameters(module, s["d_model"], s["heads"], kv_heads, bias=True)
    state = _random_state(s["d_model"], kv_heads, s["d_head"], dtype, seed)
    call(_load, module, state)
    return module, state


def _compare(module: Any, state: dict[str, Tensor], s: dict[str, int], kv_heads: int, dtype: torch.dtype,
             what: str, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> None:
    args = (query, key, value) if mask is None else (query, key, value, mask)
    b, q_len, d_model = query.shape
    output = expect_tensor(call(module, *args), "the output", (b, q_len, d_model), "batch q_len d_model", dtype)
    expected = _module_oracle(state, s["heads"], kv_heads, query, key, value, mask)
    if not close(output, expected, dtype):
        raise CheckFailure(
            f"For {what} (heads={s['heads']}, kv_heads={kv_heads}), your output differs from "
            f"F.scaled_dot_product_attention(..., enable_gqa=True) with the same projections (largest difference "
            f"{(output - expected).nan_to_num(1e9).abs().max().item():.3g}). "
            f"{_diagnose_module(state, s['heads'], kv_heads, query, key, value, mask, output)}"
        )


@check
def check_gqa_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """w_k, w_v map d_model to kv_heads * d_head; kv_heads=None means heads; bad sizes raise ValueError."""
    s = _sizes(seed)
    d_model, heads, kv = s["d_model"], s["heads"], s["kv_heads"]
    for kv_heads in (kv, 1, heads):
        _expect_parameters(call(cls, d_model, heads, kv_heads), d_model, heads, kv_heads, bias=True)
    _expect_parameters(call(cls, d_model, heads, kv, bias=False), d_model, heads, kv, bias=False)
    _expect_parameters(call(cls, d_model, heads), d_model, heads, heads, bias=True)
    for args, why in (((d_model, heads, heads - 1), f"{heads - 1} key/value heads cannot be shared equally by "
                       f"{heads} query heads (check heads % kv_heads)"),
                      ((d_model + 1, heads, kv), f"{heads} heads cannot share {d_model + 1} features equally "
                       "(check d_model % heads)")):
        error = call(_error_of, cls, *args)
        if error != "ValueError":
            got = "no error" if error is None else f"a {error}"
            raise CheckFailure(f"GroupedQueryAttention{args} should raise a ValueError, since {why}; it raised {got}.")
    passed("w_q, w_o are (d_model, d_model), w_k, w_v are (kv_heads * d_head, d_model); kv_heads=None means heads; "
           "ValueError for sizes that do not divide")


@check
def check_gqa_self_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Self-attention equal to fused attention with enable_gqa=True (GQA, MQA, masks); to MHA when kv_heads=heads."""
    s = _sizes(seed)
    (x,) = _inputs(s, dtype, seed, s["q_len"])
    seq = s["q_len"]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for kv_heads in (s["kv_heads"], 1):
        module, state = _build(cls, s, kv_heads, dtype, seed + kv_heads)
        for what, mask in (("self-attention without a mask", None),
                           ("self-attention with a padding mask (batch, 1, 1, k_len)", _padding_mask(s, seq, seed)),
                           ("self-attention with a causal mask (q_len, k_len)", causal)):
            _compare(module, state, s, kv_heads, dtype, what, x, x, x, mask)
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
    got = expect_tensor(call(module, x, x, x, causal), "the output", tuple(x.shape), "batch q_len d_model", dtype)
    if not close(got, expected, dtype):
        raise CheckFailure(
            f"With kv_heads == heads == {s['heads']}, your module should be multi-head attention, equal to "
            "torch.nn.MultiheadAttention with the same weights; it is not. "
            f"{_diagnose_module(state, s['heads'], s['heads'], x, x, x, causal, got)}"
        )
    # Dropout: nothing in eval mode; in training with p = 1 every weight is dropped: only w_o's bias is left.
    dropping, state = _build(cls, s, s["kv_heads"], dtype, seed, dropout=1.0)
    _compare(dropping, state, s, s["kv_heads"], dtype, "dropout=1.0 in eval() mode", x, x, x, None)
    call(_set_training, dropping, True)
    got = call(dropping, x, x, x)
    if not close(got, state["w_o.bias"].expand_as(got), dtype):
        raise CheckFailure(
            "With dropout=1.0 in training mode every attention weight is dropped, so the output should be w_o's bias "
            "alone: apply self.dropout (nn.Dropout(dropout)) to the attention weights, e.g. by passing it to "
            "grouped_attention."
        )
    passed(f"self-attention equal to F.scaled_dot_product_attention(enable_gqa=True) for GQA and MQA, with padding "
           f"and causal masks; equal to torch.nn.MultiheadAttention when kv_heads == heads; dropout "
           f"({_dtype_name(dtype)})")


@check
def check_gqa_cross_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention (q_len != k_len, key != value) equal to fused attention with enable_gqa=True."""
    s = _sizes(seed)
    query, key, value = _inputs(s, dtype, seed + 1, s["q_len"], s["k_len"], s["k_len"])
    padding = _padding_mask(s, s["k_len"], seed)
    for kv_heads in (s["kv_heads"], 1):
        module, state = _build(cls, s, kv_heads, dtype, seed + 2 * kv_heads)
        for what, mask in (("cross-attention without a mask", None),
                           ("cross-attention with a padding mask (batch, 1, 1, k_len)", padding)):
            _compare(module, state, s, kv_heads, dtype, what, query, key, value, mask)
    passed(f"cross-attention (q_len={s['q_len']}, k_len={s['k_len']}) equal to "
           f"F.scaled_dot_product_attention(enable_gqa=True) for GQA and MQA ({_dtype_name(dtype)})")


def _decode_with_cache(module: nn.Module, cache: Any, x: Tensor) -> Tensor:
    """Feed the positions of x one at a time, as a decoder does, each reading the cache of the earlier ones."""
    return torch.cat([module(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache) for t in range(x.shape[1])],
                     dim=1)


def _cache_keys(cache: Any) -> tuple[Tensor, Tensor]:
    return cache.keys.detach().clone(), cache.values.detach().clone()


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
    module, state = _build(cls, s, kv, dtype, seed + 9)
    full = expect_tensor(call(module, x, x, x, causal), "the output without a cache", tuple(x.shape),
                         "batch q_len d_model", dtype)
    cache = call(cache_cls)
    stepwise = expect_tensor(call(_decode_with_cache, module, cache, x), "the outputs decoded one at a time",
                             tuple(x.shape), "batch q_len d_model", dtype)
    keys, values = call(_cache_keys, cache)
    for name, got in (("keys", keys), ("values", values)):
        if type(got) is not Tensor or tuple(got.shape) != (b, kv, length, d_head):
            shape = tuple(got.shape) if type(got) is Tensor else kind(got)
            hint = (f" It holds {s['heads']} heads: are your keys and values split into kv_heads heads (and w_k, w_v "
                    "narrower than d_model)?" if type(got) is Tensor and got.shape[1] == s["heads"] else "")
            raise CheckFailure(
                f"After {length} steps the cache's {name} should have shape (batch={b}, kv_heads={kv}, "
                f"length={length}, d_head={d_head}), got {shape}. Append the new positions' k and v (before "
                f"repeat_kv) with cache.append(k, v), which returns every cached position.{hint}"
            )
    _, expected_k, expected_v = _projected(state, s["heads"], kv, x, x, x)
    if not (close(keys, expected_k, dtype) and close(values, expected_v, dtype)):
        raise CheckFailure(
            "The cache holds the right shape but not the keys and values of w_k(x) and w_v(x) split into kv_heads "
            "heads: append them before repeating them for the query heads."
        )
    if not close(stepwise, full, dtype):
        raise CheckFailure(
            "Decoding one position at a time with the cache gives other outputs than one pass with a causal mask "
            f"(largest difference {(stepwise - full).nan_to_num(1e9).abs().max().item():.3g}): each step must attend "
            "to every cached key and value (what cache.append returns), not only the new one."
        )
    passed(f"decoding with a KVCache equals the causal full pass; the cache holds (batch, kv_heads={kv}, length, "
           f"d_head) ({_dtype_name(dtype)})")


# -- exercise 4: converting a multi-head checkpoint ----------------------------------------

class _MultiHeadCheckpoint(nn.Module):
    """A multi-head layer with chapter 03's attribute names and the given weights: what from_multihead reads."""

    def __init__(self, state: dict[str, Tensor], heads: int) -> None:
        super().__init__()
        d_model, dtype = state["w_q.weight"].shape[1], state["w_q.weight"].dtype
        self.heads = heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model, dtype=dtype) for _ in PROJECTIONS)
        self.dropout = nn.Dropout(0.0)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(state[name])


@check
def check_from_multihead(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Mean-pooling each group's key/value heads (the GQA paper); w_q and w_o kept; kv_heads == heads exact."""
    s = _sizes(seed)
    d_model, heads, d_head = s["d_model"], s["heads"], s["d_head"]
    state = _random_state(d_model, heads, d_head, dtype, seed + 21)
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        source = _MultiHeadCheckpoint(state, heads)
    for kv_heads in (s["kv_heads"], 1, heads):
        converted = call(fn, source, kv_heads)
        got = call(_state_of, converted)
        if type(got) is not dict or any(type(v) is not Tensor for v in got.values()):
            raise CheckFailure(f"from_multihead should return a GroupedQueryAttention module, got {kind(converted)}.")
        expected_shapes = _expected_shapes(d_model, kv_heads, d_head, bias=True)
        shapes = {name: list(v.shape) for name, v in got.items()}
        if shapes != expected_shapes:
            raise CheckFailure(
                f"from_multihead(mha, kv_heads={kv_heads}) returned parameters of shapes {shapes}; a "
                f"GroupedQueryAttention(d_model={d_model}, heads={heads}, kv_heads={kv_heads}) has {expected_shapes}."
            )
        for name in ("w_q.weight", "w_q.bias", "w_o.weight", "w_o.bias"):
            if not torch.equal(got[name], state[name]):
                raise CheckFailure(f"{name} should be copied from the multi-head module unchanged; it is not.")
        for name in ("w_k.weight", "w_k.bias", "w_v.weight", "w_v.bias"):
            pattern = "(kv_heads group d_head) ... -> (kv_heads d_head) ..."
            expected = reduce(state[name], pattern, "mean", kv_heads=kv_heads, d_head=d_head)
            if close(got[name], expected, dtype):
                continue
            across = reduce(state[name], "(group kv_heads d_head) ... -> (kv_heads d_head) ...", "mean",
                            kv_heads=kv_heads, d_head=d_head)
            first = rearrange(state[name], "(kv_heads group d_head) ... -> kv_heads group d_head ...",
                              kv_heads=kv_heads, d_head=d_head)[:, 0]
            if close(got[name], across, dtype):
                hint = ("You averaged across the groups, (group kv_heads d_head): key head g then mixes heads g, "
                        "g + kv_heads, ... of different groups. A group is `group` consecutive heads, the "
                        "(kv_heads group d_head) order of repeat_kv: average within it.")
            elif close(got[name], rearrange(first, "kv_heads d_head ... -> (kv_heads d_head) ..."), dtype):
                hint = "You kept the first head of each group; the GQA paper averages (mean-pools) all of its heads."
            else:
                hint = ("Read the rows of the multi-head weight as (kv_heads group d_head) and average over group: "
                        "reduce(w, '(kv_heads group d_head) d_model -> (kv_heads d_head) d_model', 'mean', ...).")
            raise CheckFailure(
                f"With kv_heads={kv_heads}, {name} is not the mean of each group's {heads // kv_heads} heads. {hint}"
            )
    (x,) = _inputs(s, dtype, seed + 6, s["q_len"])
    exact = call(fn, source, heads)
    same = expect_tensor(call(exact, x, x, x), "the converted module's output", tuple(x.shape), "batch q_len d_model",
                         dtype)
    if not close(same, _module_oracle(state, heads, heads, x, x, x, None), dtype):
        raise CheckFailure("With kv_heads == heads nothing is pooled, so the converted module should give the "
                           "multi-head module's outputs exactly; it does not.")
    passed(f"from_multihead mean-pools each group of consecutive key/value heads, keeps w_q and w_o, and is exact for "
           f"kv_heads == heads ({_dtype_name(dtype)})")


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
            raise CheckFailure(f"measure_cache_bytes should return a Python int (the cache's nbytes), got {kind(got)}.")
        expected = 2 * kv_heads * d_head * length * batch * 4
        if got == expected:
            continue
        if got == 2 * heads * d_head * length * batch * 4:
            hint = ("That is what multi-head attention keeps: your cache holds all the query heads' worth of keys and "
                    "values. Are w_k and w_v narrower (kv_heads * d_head) and k, v split into kv_heads heads?")
        elif got == expected // 2:
            hint = "That is half: count the values as well as the keys."
        elif got == expected // length or got == expected // batch:
            hint = "Feed all `length` positions, one at a time, through the layer with the same cache, for the batch."
        else:
            hint = ("Build your GroupedQueryAttention(d_model, heads, kv_heads), run the positions through it one at a "
                    "time in self-attention with one KVCache, and return cache.nbytes.")
        raise CheckFailure(
            f"For d_model={heads * d_head}, heads={heads}, kv_heads={kv_heads}, length={length}, batch={batch} you "
            f"measured {got:,} bytes; float32 keys and values of kv_heads heads take {expected:,}. {hint}"
        )
    passed("measured KV-cache bytes equal 2 · kv_heads · d_head · length · batch · 4 for MHA, GQA and MQA")
