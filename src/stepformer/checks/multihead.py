"""Checks for chapter 03: splitting and merging heads, multi-head attention, its parameter count.

The oracle is ``torch.nn.MultiheadAttention(batch_first=True)`` with seeded weights that are copied
into the student's module; for dropout it is the definition, with the student's ``self.dropout``
swapped for a stand-in that drops a known half of the attention weights. Every touch of the student's
module (building it, loading the weights, switching train/eval, running it) goes through :func:`call`,
with the small helpers below.
"""

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from beartype import beartype
from einops import einsum, rearrange
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
    kind,
    passed,
    refuse_extra_parameters,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import parameter_shapes as _parameter_shapes
from stepformer.checks._modules import set_training as _set_training
from stepformer.checks.attention import _expect_kept, _first_line, _joined

AXES = ("batch", "heads", "q_len", "k_len", "d_head")
PROJECTIONS = ("w_q", "w_k", "w_v", "w_o")
# What this chapter asks students to write themselves. (Not scaled_dot_product_attention: the
# notebook hands students chapter 01's, under that name.)
BUILT_IN_MHA = {
    "torch.nn.MultiheadAttention": marked("PyTorch's built-in multi-head attention"),
    "torch.nn.functional.multi_head_attention_forward": marked("PyTorch's built-in multi-head attention"),
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, d_model = heads * d_head included, so a swapped axis cannot pass."""
    return distinct_sizes(seed, AXES, span=8, fixed=(2, 3, 5, 7, 4), products={"d_model": ("heads", "d_head")})


# -- exercises 1 and 2: split and merge ----------------------------------------------------

def _named(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={n}" for a, n in sizes.items())


@check
def check_split_heads(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """(batch, seq, d_model) -> (batch, heads, seq, d_head), head h taking features h·d_head ... (h+1)·d_head - 1;
    batch=1 and heads=1 too."""
    s = _sizes(seed)
    b, h, seq = s["batch"], s["heads"], s["q_len"]
    x = torch.randn(b, seq, s["d_model"], generator=torch.Generator().manual_seed(seed), dtype=dtype)
    # One sentence and one head (d_head = d_model) last: no axis of size 1 may go.
    for x_, h_ in ((x, h), (x[:1], h), (x, 1)):
        b_, d_ = x_.shape[0], x_.shape[-1] // h_
        sizes = {"batch": b_, "heads": h_, "seq": seq, "d_head": d_}
        got = _expect_kept(call(fn, x_, h_), "split_heads(x, heads)", (b_, h_, seq, d_),
                           "batch heads seq d_head", dtype)
        expected = x_.view(b_, seq, h_, d_).transpose(1, 2)  # PyTorch's own layout of the heads
        if torch.equal(got, expected):
            continue
        found = difference(got, expected, sizes)
        if torch.equal(got, x_.view(b_, seq, d_, h_).permute(0, 3, 1, 2)):
            raise CheckFailure(t(
                "You read d_model as (d_head heads): head h then gets every heads-th feature. Head h must get "
                "the contiguous block h*d_head ... (h+1)*d_head - 1, so write '(heads d_head)' in the pattern "
                "({found}).", found=found))
        raise CheckFailure(t(
            "Your split moves the numbers around differently from x.view(batch, seq, heads, d_head).transpose(1, 2) "
            "({found}): use rearrange(x, 'batch seq (heads d_head) -> batch heads seq d_head', heads=heads).",
            found=found))
    passed(t("split_heads: (batch, seq, d_model) -> (batch, heads, seq, d_head) in the (heads d_head) order, "
             "batch=1 and heads=1 too ({dtype})", dtype=dtype_name(dtype)))


@check
def check_merge_heads(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """(batch, heads, seq, d_head) -> (batch, seq, d_model), the exact inverse of split_heads; batch=1 and heads=1
    too."""
    s = _sizes(seed)
    b, h, seq, d_head = s["batch"], s["heads"], s["q_len"], s["d_head"]
    x = torch.randn(b, h, seq, d_head, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    for x_ in (x, x[:1], x[:, :1]):
        b_, h_ = x_.shape[:2]
        d_ = h_ * d_head
        sizes = {"batch": b_, "heads": h_, "seq": seq, "d_head": d_head}
        got = _expect_kept(call(fn, x_), "merge_heads(x)", (b_, seq, d_), "batch seq d_model", dtype)
        expected = x_.transpose(1, 2).reshape(b_, seq, d_)
        if torch.equal(got, expected):
            continue
        found = difference(got, expected, sizes)
        if torch.equal(got, x_.permute(0, 2, 3, 1).reshape(b_, seq, d_)):
            raise CheckFailure(t(
                "You merged the heads as (d_head heads), which interleaves them: feature j then comes from head "
                "j % heads. Write '(heads d_head)' as in split_heads, so that merge_heads undoes split_heads and "
                "W_O finds head h's features at h*d_head ... (h+1)*d_head - 1 ({found}).", found=found))
        raise CheckFailure(t(
            "Your merge differs from x.transpose(1, 2).reshape(batch, seq, heads * d_head) ({found}): use "
            "rearrange(x, 'batch heads seq d_head -> batch seq (heads d_head)').", found=found))
    passed(t("merge_heads: (batch, heads, seq, d_head) -> (batch, seq, d_model), the inverse of split_heads, "
             "batch=1 and heads=1 too ({dtype})", dtype=dtype_name(dtype)))


# -- helpers that touch the student's module, always through call() -------------------------


def _expect_parameters(module: Any, d_model: int, bias: bool) -> None:
    shapes = call(_parameter_shapes, module)
    expected = {f"{p}.weight": [d_model, d_model] for p in PROJECTIONS}
    if bias:
        expected |= {f"{p}.bias": [d_model] for p in PROJECTIONS}
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckFailure(t(
                "Your module has no parameter {name}. Store the four projections as self.w_q, self.w_k, self.w_v "
                "and self.w_o, each nn.Linear(d_model, d_model, bias=bias).", name=name))
        if shapes[name] != shape:
            raise CheckFailure(t(
                "{name} has shape {got}; it should be {shape} with d_model={d_model}. Each "
                "projection maps d_model features to d_model features: all the heads at once, not one head's d_head.",
                name=name, got=tuple(shapes[name]), shape=tuple(shape), d_model=d_model))
    refuse_extra_parameters(shapes, expected, bias)


def _oracle(s: dict[str, int], dtype: torch.dtype, seed: int,
            bias: bool = True) -> tuple[nn.MultiheadAttention, dict[str, Tensor]]:
    """PyTorch's module with seeded weights (biases too, so a missing bias shows), and its weights by our names."""
    d_model = s["d_model"]
    g = torch.Generator().manual_seed(seed + 11)
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        oracle = nn.MultiheadAttention(d_model, s["heads"], bias=bias, batch_first=True, dtype=dtype).eval()
    with torch.no_grad():
        for param in (oracle.in_proj_weight, oracle.out_proj.weight):
            param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) / math.sqrt(d_model))
        if bias:
            for param in (oracle.in_proj_bias, oracle.out_proj.bias):
                param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) * 0.5)
    # PyTorch packs the input projections as (q, k, v) along the output axis.
    weights = rearrange(oracle.in_proj_weight.detach(), "(qkv d_out) d_in -> qkv d_out d_in", qkv=3)
    state = {f"{name}.weight": weights[i].clone() for i, name in enumerate(PROJECTIONS[:3])}
    state["w_o.weight"] = oracle.out_proj.weight.detach().clone()
    if bias:
        biases = rearrange(oracle.in_proj_bias.detach(), "(qkv d_out) -> qkv d_out", qkv=3)
        state |= {f"{name}.bias": biases[i].clone() for i, name in enumerate(PROJECTIONS[:3])}
        state["w_o.bias"] = oracle.out_proj.bias.detach().clone()
    return oracle, state


def _build(cls: Any, s: dict[str, int], dtype: torch.dtype, seed: int, bias: bool = True,
           **kwargs: Any) -> tuple[Any, Any, dict]:
    module = call(cls, s["d_model"], s["heads"], **({} if bias else {"bias": False}), **kwargs)
    _expect_parameters(module, s["d_model"], bias=bias)
    oracle, state = _oracle(s, dtype, seed, bias)
    call(_load, module, state)
    return module, oracle, state


def _reference(state: dict[str, Tensor], heads: int, query: Tensor, key: Tensor, value: Tensor,
               mask: Tensor | None, *, split: str = "heads d_head", merge: str = "heads d_head", w_o: bool = True,
               scale: float | None = None, roles: tuple[str, str, str] = ("w_q", "w_k", "w_v"),
               drop: Tensor | None = None, prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Multi-head attention written out, with switches for the usual mistakes (to name them); ``drop``
    multiplies the attention weights (dropout with a known mask); ``prefix``: cached keys and values
    ``(batch, heads, cached, d_head)`` read before the projected ones, as a decoding step reads its cache."""
    def project(name: str, x: Tensor) -> Tensor:
        bias = state.get(f"{name}.bias")
        return x @ state[f"{name}.weight"].T + (0.0 if bias is None else bias)

    q, k, v = (rearrange(project(role, x), f"batch seq ({split}) -> batch heads seq d_head", heads=heads)
               for role, x in zip(roles, (query, key, value), strict=True))
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], dim=-2), torch.cat([prefix[1], v], dim=-2)
    scale = math.sqrt(q.shape[-1]) if scale is None else scale
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len") / scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    if drop is not None:
        weights = weights * drop
    out = einsum(weights, v, "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
    concat = rearrange(out, f"batch heads seq d_head -> batch seq ({merge})")
    return project("w_o", concat) if w_o else concat


def _sizes_of(query: Tensor, key: Tensor, heads: int) -> dict[str, int]:
    """The sizes of one forward pass, for messages."""
    b, q_len, d_model = query.shape
    return {"batch": b, "heads": heads, "q_len": q_len, "k_len": key.shape[1], "d_head": d_model // heads,
            "d_model": d_model}


def _diagnose(state: dict[str, Tensor], s: dict[str, int], query: Tensor, key: Tensor, value: Tensor,
              mask: Tensor | None, output: Tensor) -> str:
    """Name the likely mistake: the first written-out mistake that reproduces the student's output."""
    if torch.isnan(output).any():
        return t("Your output contains NaN: does every head get the mask, and is the softmax over k_len?")
    heads, d_model = s["heads"], s["d_model"]
    variants: dict[str, Any] = {
        t("You merged the heads as (d_head heads), which interleaves them; W_O expects head h's features at "
          "h*d_head ... (h+1)*d_head - 1: merge as (heads d_head), the order of split_heads."): dict(
            merge="d_head heads"),
        t("You split and merged d_model as (d_head heads): each head then gets every heads-th feature instead of a "
          "contiguous block. Use (heads d_head) in both patterns."): dict(split="d_head heads", merge="d_head heads"),
        t("You return the concatenated heads without the output projection: apply self.w_o to merge_heads(...)."):
            dict(w_o=False),
        t("You scaled the scores by sqrt(d_model); each head's queries and keys have d_head features, so the scale "
          "is sqrt(d_head) (chapter 01's scaled_dot_product_attention does it for you)."): dict(
            scale=math.sqrt(d_model)),
        t("You did not scale the scores at all: divide by sqrt(d_head)."): dict(scale=1.0),
        t("You projected the keys with w_q: the keys need their own projection, self.w_k(key)."): dict(
            roles=("w_q", "w_q", "w_v")),
        t("You projected the values with w_k: the values need their own projection, self.w_v(value)."): dict(
            roles=("w_q", "w_k", "w_k")),
        t("You projected the queries with w_k: the queries need their own projection, self.w_q(query)."): dict(
            roles=("w_k", "w_k", "w_v")),
    }
    if not torch.equal(key, value):
        variants[t("You took the values from `key`: project the `value` argument with w_v.")] = dict(value=key)
    if mask is not None:
        variants[t("Your output ignores the mask: pass it on to scaled_dot_product_attention.")] = dict(mask=None)
    if mask is not None and mask.dim() == 4 and mask.shape[1:3] != (1, 1):
        # A (batch, heads, q_len, k_len) or (batch, 1, q_len, k_len) mask read as if it were a padding mask.
        one_row = t("Your module reads one row of the mask, mask[:, 0, 0, :], for every head and query: a 4-D mask "
                    "may differ per head and per query (a decoder's causal & padding mask does). Pass the mask on "
                    "whole to scaled_dot_product_attention; broadcasting does the rest.")
        variants[one_row] = dict(mask=mask[:, :1, :1, :])
        if mask.shape[1] != 1:
            variants[t("Your module gives every head the first head's mask, mask[:, :1]: a (batch, heads, q_len, "
                       "k_len) mask holds one mask per head. Pass it on whole.")] = dict(mask=mask[:, :1])
    for hint, mistake in variants.items():
        inputs = {"query": query, "key": key, "value": value, "mask": mask}
        inputs |= {k: v for k, v in mistake.items() if k in inputs}
        switches = {k: v for k, v in mistake.items() if k not in inputs}
        expected = _reference(state, heads, inputs["query"], inputs["key"], inputs["value"], inputs["mask"],
                              **switches)
        if close(output, expected, output.dtype):
            return hint
    return t("Compare, on one small example, your q, k and v after split_heads with those of "
             "torch.nn.MultiheadAttention (its in_proj_weight packs W_Q, W_K, W_V in this order).")


# What a crash on a small case adds after the error (see _run), named by the case: its label is for reading only.
NO_BIAS = marked(" With bias=False each nn.Linear's .bias is None: apply the layers (self.w_o(x)) rather than "
                 "writing x @ weight.T + bias out by hand.")
SIZE_ONE = marked(" An axis of size 1 must be kept: is there a squeeze() without an axis, or a shape taken from the "
                  "data that assumes more than one head or sentence?")


def _run(module: Any, what: str, *args: Tensor, crash: str = "") -> Any:
    """Run the student's module; a crash on a small case (batch=1, heads=1, bias=False) says which case and adds
    ``crash`` (:data:`NO_BIAS`, :data:`SIZE_ONE` or nothing)."""
    try:
        return call(module, *args)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        hint = tr(crash) if crash else ""
        raise failure.reworded(t("For {what}: {error}{hint}", what=what, error=_first_line(failure),
                                 hint=hint)) from None


def _w_o_input(module: Any, *args: Tensor) -> Tensor | None:
    """What the student's forward passes to ``self.w_o``, whether or not the forward then raises."""
    w_o = getattr(module, "w_o", None)
    if not isinstance(w_o, nn.Module):
        return None
    seen: list[Tensor] = []

    def note(_: nn.Module, inputs: tuple) -> None:
        if inputs and isinstance(inputs[0], Tensor):
            seen.append(inputs[0].detach().clone())

    handle = w_o.register_forward_pre_hook(note)
    try:
        with torch.no_grad():
            module(*args)
    except Exception:  # noqa: BLE001 - the caller reports what the forward raised; here only w_o's input matters
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None


def _merge_mistake(module: Any, state: dict[str, Tensor], s: dict[str, int], query: Tensor, key: Tensor,
                   value: Tensor, mask: Tensor | None) -> str | None:
    """After a crash: is the tensor the forward hands to w_o the heads' outputs with their axes in another order,
    merged as (batch, heads, q_len, d_head) would be? Named only where exactly one order reproduces it."""
    args = (query, key, value) if mask is None else (query, key, value, mask)
    seen = call(_w_o_input, module, *args)
    if type(seen) is not Tensor:
        return None
    heads = s["heads"]
    concat = _reference(state, heads, query, key, value, mask, w_o=False)
    heads_out = rearrange(concat, "batch seq (heads d_head) -> batch heads seq d_head", heads=heads)
    axes = ("batch", "heads", "q_len", "d_head")
    found = []
    for order in list(itertools.permutations(range(4)))[1:]:  # every order but the right one
        laid = rearrange(heads_out.permute(order), "a b c d -> a c (b d)")
        if laid.shape == seen.shape and close(seen, laid.to(seen.dtype), seen.dtype):
            found.append(order)
    if len(found) != 1:
        return None
    b, q_len, d_model = query.shape
    named = ", ".join(axes[i] for i in found[0])
    return t("The tensor your forward passes to w_o has shape {shape}, not (batch={batch}, q_len={q_len}, "
             "d_model={d_model}): it is the heads' outputs with their axes in the order ({named}) instead of (batch, "
             "heads, q_len, d_head), then merged. Look at the pattern that makes the heads' outputs (the weighted sum "
             "of the values): its output must be batch heads q_len d_head, the layout merge_heads expects.",
             shape=tuple(seen.shape), batch=b, q_len=q_len, d_model=d_model, named=named)


def _compare(module: Any, oracle: nn.MultiheadAttention, state: dict[str, Tensor], s: dict[str, int],
             dtype: torch.dtype, what: str, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
             crash: str = "") -> None:
    """The student's module against PyTorch's on one case, ``what`` (a label, already in the reader's language);
    ``crash``: what a crash adds (see :func:`_run`)."""
    args = (query, key, value) if mask is None else (query, key, value, mask)
    sizes = _sizes_of(query, key, s["heads"])
    b, q_len, d_model = query.shape
    try:
        result = _run(module, what, *args, crash=crash)
    except CheckFailure as failure:
        hint = _merge_mistake(module, state, s, query, key, value, mask) if isinstance(failure, CodeRaised) else None
        if hint is None:
            raise
        raise CheckFailure(t("{failure} {hint}", failure=str(failure).rstrip(), hint=hint)) from None
    output = _expect_kept(result, t("the output"), (b, q_len, d_model), "batch q_len d_model", dtype)
    kwargs: dict[str, Tensor] = {}
    if mask is not None:
        # PyTorch's True means "ignore this key"; its 3-D mask holds one (q_len, k_len) mask per batch and head.
        full = mask.expand(b, s["heads"], q_len, key.shape[1])
        kwargs["attn_mask"] = ~rearrange(full, "batch heads q_len k_len -> (batch heads) q_len k_len")
    with torch.no_grad():
        expected = oracle(query, key, value, need_weights=False, **kwargs)[0]
    if not close(output, expected, dtype):
        raise CheckFailure(t(
            "For {what}, your output differs from torch.nn.MultiheadAttention's with the same weights "
            "({found}). {diagnosis}", what=what, found=difference(output, expected, sizes),
            diagnosis=_diagnose(state, s, query, key, value, mask, output)))


def _inputs(s: dict[str, int], dtype: torch.dtype, seed: int, *lengths: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed + 3)
    return [torch.randn(s["batch"], n, s["d_model"], generator=g, dtype=dtype) for n in lengths]


def _padding_mask(s: dict[str, int], k_len: int, seed: int) -> Tensor:
    """(batch, 1, 1, k_len), True = a real token; the first sentence is full, the others shorter."""
    g = torch.Generator().manual_seed(seed + 5)
    lengths = torch.randint(1, k_len + 1, (s["batch"],), generator=g)
    lengths[0] = k_len
    lengths[-1] = max(1, k_len - 2)
    return rearrange(torch.arange(k_len), "k_len -> 1 1 1 k_len") < rearrange(lengths, "batch -> batch 1 1 1")


def _random_mask(shape: tuple[int, ...], seed: int) -> Tensor:
    """A random boolean mask with at least one key per row (PyTorch's attention gives NaN for a row without)."""
    g = torch.Generator().manual_seed(seed + 7)
    mask = torch.rand(shape, generator=g) < 0.5
    mask[..., 0] |= ~mask.any(-1)
    return mask


# -- exercise 3: the module ------------------------------------------------------------------

@check(forbid=BUILT_IN_MHA)
def check_mha_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """w_q, w_k, w_v, w_o are (d_model, d_model) nn.Linear; bias=False drops the biases; bad heads raise ValueError."""
    s = _sizes(seed)
    d_model, heads = s["d_model"], s["heads"]
    _expect_parameters(call(cls, d_model, heads), d_model, bias=True)
    _expect_parameters(call(cls, d_model, heads, bias=False), d_model, bias=False)
    error = call(_error_of, cls, d_model + 1, heads)
    if error != "ValueError":
        if error is None:
            raise CheckFailure(t(
                "MultiHeadAttention({features}, {heads}) should raise a ValueError, since {heads} heads cannot share "
                "{features} features equally; it raised no error. Check d_model % heads in __init__.",
                features=d_model + 1, heads=heads))
        raise CheckFailure(t(
            "MultiHeadAttention({features}, {heads}) should raise a ValueError, since {heads} heads cannot share "
            "{features} features equally; it raised a {error}. Check d_model % heads in __init__.",
            features=d_model + 1, heads=heads, error=error))
    # d_model is not a multiple of 0 (0 · n = 0), so heads=0 is refused too, with the same ValueError.
    error = call(_error_of, cls, d_model, 0)
    if error != "ValueError":
        hint = (t(" Your __init__ divides by heads, which is 0 (d_model % heads does): test heads < 1 before it.")
                if error == "ZeroDivisionError" else "")
        if error is None:
            raise CheckFailure(t(
                "MultiHeadAttention({d_model}, 0) should raise a ValueError, since {d_model} is not a multiple of 0 "
                "heads; it raised no error.", d_model=d_model))
        raise CheckFailure(t(
            "MultiHeadAttention({d_model}, 0) should raise a ValueError, since {d_model} is not a multiple of 0 "
            "heads; it raised a {error}.{hint}", d_model=d_model, error=error, hint=hint))
    passed(t("w_q, w_k, w_v, w_o are (d_model, d_model), biases only with bias=True, "
             "ValueError when heads does not divide d_model"))


class _FixedDropout(nn.Module):
    """Stands in for the student's ``self.dropout``: multiplies by a fixed mask of 0 and 2 (p = 0.5), so that the
    check knows which weights were dropped, and notes the shape of what it was given and whether its rows summed
    to 1 (attention weights do)."""

    p = 0.5

    def __init__(self, keep: Bool[Tensor, "batch heads q_len k_len"]) -> None:
        super().__init__()
        self.keep = keep
        self.seen: list[list[int]] = []

    def forward(self, x: Tensor) -> Tensor:
        rows = bool(torch.allclose(x.sum(-1), torch.ones((), dtype=x.dtype), atol=1e-5))
        self.seen.append([*x.shape, int(rows)])
        return x * (2 * self.keep).to(x.dtype) if x.shape == self.keep.shape else x


@jaxtyped(typechecker=beartype)
def _with_fixed_dropout(module: nn.Module, keep: Bool[Tensor, "batch heads seq seq"],
                        x: Float[Tensor, "batch seq d_model"]) -> dict[str, Any]:
    """Self-attention in training mode with ``module.dropout`` swapped for a :class:`_FixedDropout`."""
    original = getattr(module, "dropout", None)
    if not isinstance(original, nn.Module):
        return {"missing": True}
    stand_in = _FixedDropout(keep)
    module.dropout = stand_in
    module.train()
    try:
        output = module(x, x, x)
    finally:
        module.dropout = original
    return {"output": output.detach(), "seen": stand_in.seen}


def _check_dropout(cls: Any, oracle: nn.MultiheadAttention, state: dict[str, Tensor], s: dict[str, int],
                   dtype: torch.dtype, seed: int, x: Tensor) -> None:
    """Dropout does nothing in eval mode, drops every weight with p = 1, and acts on the attention weights."""
    sizes = _sizes_of(x, x, s["heads"])
    dropping, _, _ = _build(cls, s, dtype, seed, dropout=1.0)
    # The crash hint of a case of size 1, as ever (the case was told apart by "=1" in its label).
    _compare(dropping, oracle, state, s, dtype, t("dropout=1.0 in eval() mode"), x, x, x, None, crash=SIZE_ONE)
    call(_set_training, dropping, True)
    got = call(dropping, x, x, x)
    bias_only = state["w_o.bias"].expand_as(got)
    if not close(got, bias_only, dtype):
        if close(got, oracle(x, x, x, need_weights=False)[0].detach(), dtype):
            hint = t("your module ignores dropout: pass self.dropout to scaled_dot_product_attention, which applies "
                     "it to the attention weights.")
        else:
            hint = t("apply self.dropout (nn.Dropout(dropout)) to the attention weights before the weighted sum.")
        raise CheckFailure(t(
            "With dropout=1.0 in training mode every attention weight is dropped, so the output should be "
            "w_o's bias alone ({found}); {hint}", found=difference(got, bias_only, sizes), hint=hint))
    # p = 1 cannot tell the weights from the values or the heads' outputs (all give w_o's bias): a known mask can.
    b, h, seq = s["batch"], s["heads"], x.shape[1]
    keep = torch.rand(b, h, seq, seq, generator=torch.Generator().manual_seed(seed + 13)) < 0.5
    result = call(_with_fixed_dropout, dropping, keep, x)
    if type(result) is not dict:
        raise CheckFailure(t("Could not run your module with a stand-in for self.dropout: got {kind}.",
                             kind=kind(result)))
    if result.get("missing"):
        raise CheckFailure(t("Your module has no nn.Dropout in the attribute `dropout`: store nn.Dropout(dropout) as "
                             "self.dropout, as the exercise asks, and pass it to scaled_dot_product_attention."))
    expected = _reference(state, h, x, x, x, None, drop=2 * keep.to(dtype))
    output = _expect_kept(result["output"], t("the output"), tuple(x.shape), "batch q_len d_model", dtype)
    if close(output, expected, dtype):
        return
    weights_shape = [b, h, seq, seq]
    seen = result["seen"]
    if not seen:
        where = t("Your forward never calls self.dropout (F.dropout(..., self.dropout.p) does not count): pass "
                  "self.dropout to scaled_dot_product_attention, which applies it to the attention weights.")
    elif all(shape[:-1] != weights_shape for shape in seen):
        shapes = _joined([str(tuple(shape[:-1])) for shape in seen])
        where = t("self.dropout was applied to a tensor of shape {shapes}, not to the attention weights (batch={b}, "
                  "heads={h}, q_len={seq}, k_len={seq}): dropping values or the heads' outputs is another model. "
                  "Apply it to the weights, before the weighted sum of the values.", shapes=shapes, b=b, h=h, seq=seq)
    elif not any(shape[-1] for shape in seen if shape[:-1] == weights_shape):
        where = t("self.dropout was applied to scores whose rows do not sum to 1: apply it after the softmax, to the "
                  "attention weights.")
    else:
        where = t("Apply self.dropout once, to the attention weights, and take the weighted sum with the dropped "
                  "weights.")
    raise CheckFailure(t(
        "With a stand-in for self.dropout that drops a known half of the attention weights (and doubles the rest), "
        "your output differs from multi-head attention with those weights dropped "
        "({found}). {where}", found=difference(output, expected, sizes), where=where))


@check(forbid=BUILT_IN_MHA)
def check_mha_self_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Self-attention equal to torch.nn.MultiheadAttention: no mask, padding, causal, per-head and causal & padding
    masks; batch=1, heads=1, bias=False; dropout on the attention weights."""
    s = _sizes(seed)
    module, oracle, state = _build(cls, s, dtype, seed)
    (x,) = _inputs(s, dtype, seed, s["q_len"])
    b, h, seq = s["batch"], s["heads"], s["q_len"]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    padding = _padding_mask(s, seq, seed)
    for what, x_, mask, crash in (
        (t("self-attention without a mask"), x, None, ""),
        (t("self-attention with a padding mask (batch, 1, 1, k_len)"), x, padding, ""),
        (t("self-attention with a causal mask (q_len, k_len)"), x, causal, ""),
        (t("self-attention with a per-head mask (batch, heads, q_len, k_len)"), x, _random_mask((b, h, seq, seq), seed),
         ""),
        (t("self-attention with a causal & padding mask (batch, 1, q_len, k_len)"), x, causal & padding, ""),
        (t("self-attention with batch=1 and a padding mask"), x[:1], padding[:1], SIZE_ONE),
    ):
        _compare(module, oracle, state, s, dtype, what, x_, x_, x_, mask, crash=crash)
    # One head (d_head = d_model) and no biases: an axis of size 1 kept, the biases not assumed.
    one = dict(s, heads=1, d_head=s["d_model"])
    single, single_oracle, single_state = _build(cls, one, dtype, seed)
    _compare(single, single_oracle, single_state, one, dtype, t("self-attention with heads=1 and a padding mask"),
             x, x, x, padding, crash=SIZE_ONE)
    unbiased, unbiased_oracle, unbiased_state = _build(cls, s, dtype, seed, bias=False)
    _compare(unbiased, unbiased_oracle, unbiased_state, s, dtype, t("self-attention with bias=False and a causal mask"),
             x, x, x, causal, crash=NO_BIAS)
    _check_dropout(cls, oracle, state, s, dtype, seed, x)
    _check_cache(module, state, s, dtype, seed)
    passed(t("self-attention equal to torch.nn.MultiheadAttention without a mask and with padding, causal, per-head "
             "and causal & padding masks, batch=1, heads=1 and bias=False; dropout on the attention weights, only in "
             "training; over the keys and values a cache gives back ({dtype})", dtype=dtype_name(dtype)))


# -- the cache (chapter 09 passes one): k, v = cache.update(k, v) ---------------------------

class _PrefixCache:
    """The check's own cache: ``update(k, v)`` returns the earlier steps' keys and values (fixed here) followed by
    ``k`` and ``v``, and notes the shapes it was given."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        self.keys, self.values, self.given = keys, values, []

    def update(self, keys: Any, values: Any) -> tuple[Tensor, Tensor]:
        self.given.append([list(getattr(t, "shape", ())) for t in (keys, values)])
        return torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)

    def __len__(self) -> int:
        return self.keys.shape[-2]

    def __repr__(self) -> str:
        return t("<the check's cache>")


def _run_with_cache(module: nn.Module, x: Tensor, mask: Tensor | None, keys: Tensor, values: Tensor) -> dict[str, Any]:
    """The student's self-attention over ``x`` with a cache holding ``keys`` and ``values`` of earlier positions:
    the output (or the error) and the shapes its ``update`` was given."""
    cache = _PrefixCache(keys, values)
    try:
        out = module(x, x, x, mask, cache=cache)
    except Exception as error:
        return {"out": None, "error": f"{type(error).__name__}: {error}", "given": cache.given}
    return {"out": out if type(out) is Tensor else kind(out), "error": "", "given": cache.given}


def _check_cache(module: Any, state: dict[str, Tensor], s: dict[str, int], dtype: torch.dtype, seed: int) -> None:
    """Decoding steps: one new position, then two under a causal mask aligned to the last key, each reading
    ``cached`` earlier positions that the check's cache gives back from ``update``."""
    b, h, d_head = s["batch"], s["heads"], s["d_head"]
    cached = s["k_len"]
    g = torch.Generator().manual_seed(seed + 29)
    keys = torch.randn(b, h, cached, d_head, generator=g, dtype=dtype)
    values = torch.randn(b, h, cached, d_head, generator=g, dtype=dtype)
    x = torch.randn(b, 2, s["d_model"], generator=g, dtype=dtype)
    aligned = torch.ones(2, cached + 2, dtype=torch.bool).tril(diagonal=cached)
    for what, x_, mask in ((t("one new position and no mask"), x[:, :1], None),
                           (t("two new positions under a causal mask (2, {keys}) aligned to the last key",
                              keys=cached + 2), x, aligned)):
        result = call(_run_with_cache, module, x_, mask, keys, values)
        where = t("With a cache of {cached} earlier positions and {what}", cached=cached, what=what)
        heads_shape = [b, h, x_.shape[1], d_head]
        if result["given"] and result["given"][0][0] != heads_shape:
            raise CheckFailure(t("{where}, your forward called cache.update with keys of shape "
                                 "{shape}; the cache keeps (batch, heads, k_len, d_head) = "
                                 "{expected}: call it after splitting the heads.", where=where,
                                 shape=tuple(result["given"][0][0]), expected=tuple(heads_shape)))
        if result["error"]:
            if not result["given"]:
                raise CheckFailure(t("{where}, your forward raised {error} (cache.update was never called).",
                                     where=where, error=result["error"]))
            raise CheckFailure(t("{where}, your forward raised {error}.", where=where, error=result["error"]))
        expected = _reference(state, h, x_, x_, x_, mask, prefix=(keys, values))
        out = _expect_kept(result["out"], t("the output {what} with a cache", what=what),
                           (b, x_.shape[1], s["d_model"]), "batch q_len d_model", dtype)
        if close(out, expected, dtype):
            continue
        uncached = _reference(state, h, x_, x_, x_, None if mask is None else mask[:, cached:])
        if close(out, uncached, dtype):
            if not result["given"]:
                raise CheckFailure(t("{where}, your output is the attention over the new positions alone: your "
                                     "forward never calls cache.update. Attend over what k, v = cache.update(k, v) "
                                     "gives back.", where=where))
            raise CheckFailure(t("{where}, your output is the attention over the new positions alone: your forward "
                                 "calls cache.update but attends over this call's keys and values only. Attend over "
                                 "what k, v = cache.update(k, v) gives back.", where=where))
        raise CheckFailure(t("{where}, your output differs from attention over the cached and the new keys "
                             "({found}).", where=where,
                             found=difference(out, expected, dict(batch=b, heads=h, cached=cached, new=x_.shape[1]))))


@check(forbid=BUILT_IN_MHA)
def check_mha_cross_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention (q_len != k_len, key != value) equal to torch.nn.MultiheadAttention, with a padding and a
    (q_len, k_len) mask; batch=1 and heads=1 too."""
    s = _sizes(seed)
    module, oracle, state = _build(cls, s, dtype, seed)
    query, key, value = _inputs(s, dtype, seed + 1, s["q_len"], s["k_len"], s["k_len"])
    padding = _padding_mask(s, s["k_len"], seed)
    for what, q_, k_, v_, mask, crash in (
        (t("cross-attention without a mask"), query, key, value, None, ""),
        (t("cross-attention with a padding mask (batch, 1, 1, k_len)"), query, key, value, padding, ""),
        (t("cross-attention with a (q_len, k_len) mask"), query, key, value,
         _random_mask((s["q_len"], s["k_len"]), seed), ""),
        (t("cross-attention with batch=1 and a padding mask"), query[:1], key[:1], value[:1], padding[:1], SIZE_ONE),
        (t("cross-attention over one key (k_len=1)"), query, key[:, :1], value[:, :1], None, SIZE_ONE),
    ):
        _compare(module, oracle, state, s, dtype, what, q_, k_, v_, mask, crash=crash)
    one = dict(s, heads=1, d_head=s["d_model"])
    single, single_oracle, single_state = _build(cls, one, dtype, seed)
    _compare(single, single_oracle, single_state, one, dtype, t("cross-attention with heads=1 and a padding mask"),
             query, key, value, padding, crash=SIZE_ONE)
    passed(t("cross-attention (q_len={q_len}, k_len={k_len}) equal to torch.nn.MultiheadAttention, with "
             "padding and (q_len, k_len) masks, batch=1, one key and heads=1 ({dtype})", q_len=s["q_len"],
             k_len=s["k_len"], dtype=dtype_name(dtype)))


# -- exercise 4: predict, then measure -----------------------------------------------------

@check(forbid=BUILT_IN_MHA)
def check_parameter_count(fn: Callable[..., Any], seed: int = 0) -> None:
    """The count equals that of torch.nn.MultiheadAttention (4·d² + 4·d), whatever heads is."""
    s = _sizes(seed)
    d_head = s["d_head"]
    for heads, bias in ((s["heads"], True), (s["heads"], False), (s["batch"], True), (1, True)):
        d_model = heads * d_head * 2
        got = call(fn, d_model, heads, bias=bias)
        if type(got) is not int:
            raise CheckFailure(t("count_parameters should return a Python int (use .numel() and sum), got {kind}.",
                                 kind=kind(got)))
        with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
            expected = sum(p.numel() for p in nn.MultiheadAttention(d_model, heads, bias=bias).parameters())
        if got == expected:
            continue
        if bias and got == 4 * d_model * d_model:
            hint = t("You counted the weights only: with bias=True each of the four nn.Linear also has d_model "
                     "biases.")
        elif got in (3 * d_model * (d_model + bias), 3 * d_model * d_model):
            hint = t("Your count leaves out one projection: is w_o there?")
        elif got == 4 * d_model * (d_model // heads) + 4 * (d_model // heads) * bias:
            hint = t("Each projection maps d_model to d_model (all heads together), not to one head's d_head.")
        else:
            hint = t("Build MultiHeadAttention(d_model, heads, bias=bias) and add up p.numel() over its parameters().")
        raise CheckFailure(t("For d_model={d_model}, heads={heads}, bias={bias} you counted {got:,} parameters; "
                             "torch.nn.MultiheadAttention has {expected:,}. {hint}", d_model=d_model, heads=heads,
                             bias=bias, got=got, expected=expected, hint=hint))
    passed(t("parameter counts equal torch.nn.MultiheadAttention's: 4·d_model² + 4·d_model, the same for any heads"))
