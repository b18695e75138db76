"""Checks for chapter 03: splitting and merging heads, multi-head attention, its parameter count.

The oracle is ``torch.nn.MultiheadAttention(batch_first=True)`` with seeded weights that are copied
into the student's module. Every touch of the student's module (building it, loading the weights,
switching train/eval, running it) goes through :func:`call`, with the small helpers below.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from einops import einsum, rearrange
from torch import Tensor, nn

from stepformer.checks._core import CheckFailure, call, check, close, expect_tensor, kind, passed
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import parameter_shapes as _parameter_shapes
from stepformer.checks._modules import set_training as _set_training

AXES = ("batch", "heads", "q_len", "k_len", "d_head")
PROJECTIONS = ("w_q", "w_k", "w_v", "w_o")
# What this chapter asks students to write themselves. (Not scaled_dot_product_attention: the
# notebook hands students chapter 01's, under that name.)
BUILT_IN_MHA = {
    "torch.nn.MultiheadAttention": "PyTorch's built-in multi-head attention",
    "torch.nn.functional.multi_head_attention_forward": "PyTorch's built-in multi-head attention",
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, d_model = heads * d_head included, so a swapped axis cannot pass."""
    if seed == 0:
        sizes = dict(zip(AXES, (2, 3, 5, 7, 4), strict=True))
    else:
        g = torch.Generator().manual_seed(seed)
        while True:
            picks = (torch.randperm(8, generator=g)[: len(AXES)] + 2).tolist()
            if picks[1] * picks[4] not in picks:
                break
        sizes = dict(zip(AXES, picks, strict=True))
    return {**sizes, "d_model": sizes["heads"] * sizes["d_head"]}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- exercises 1 and 2: split and merge ----------------------------------------------------

@check
def check_split_heads(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """(batch, seq, d_model) -> (batch, heads, seq, d_head), head h taking features h·d_head ... (h+1)·d_head - 1."""
    s = _sizes(seed)
    b, h, seq, d_head = s["batch"], s["heads"], s["q_len"], s["d_head"]
    x = torch.randn(b, seq, s["d_model"], generator=torch.Generator().manual_seed(seed), dtype=dtype)
    got = expect_tensor(call(fn, x, h), "split_heads(x, heads)", (b, h, seq, d_head), "batch heads seq d_head", dtype)
    expected = x.view(b, seq, h, d_head).transpose(1, 2)  # PyTorch's own layout of the heads
    if not torch.equal(got, expected):
        if torch.equal(got, x.view(b, seq, d_head, h).permute(0, 3, 1, 2)):
            raise CheckFailure(
                "You read d_model as (d_head heads): head h then gets every heads-th feature. Head h must get "
                "the contiguous block h*d_head ... (h+1)*d_head - 1, so write '(heads d_head)' in the pattern."
            )
        raise CheckFailure(
            "Your split moves the numbers around differently from x.view(batch, seq, heads, d_head).transpose(1, 2): "
            "use rearrange(x, 'batch seq (heads d_head) -> batch heads seq d_head', heads=heads)."
        )
    passed(f"split_heads: (batch, seq, d_model) -> (batch, heads, seq, d_head) in the (heads d_head) order "
           f"({_dtype_name(dtype)})")


@check
def check_merge_heads(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """(batch, heads, seq, d_head) -> (batch, seq, d_model), the exact inverse of split_heads."""
    s = _sizes(seed)
    b, h, seq, d_head, d_model = s["batch"], s["heads"], s["q_len"], s["d_head"], s["d_model"]
    x = torch.randn(b, h, seq, d_head, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    got = expect_tensor(call(fn, x), "merge_heads(x)", (b, seq, d_model), "batch seq d_model", dtype)
    expected = x.transpose(1, 2).reshape(b, seq, d_model)
    if not torch.equal(got, expected):
        if torch.equal(got, x.permute(0, 2, 3, 1).reshape(b, seq, d_model)):
            raise CheckFailure(
                "You merged the heads as (d_head heads), which interleaves them: feature j then comes from head "
                "j % heads. Write '(heads d_head)' as in split_heads, so that merge_heads undoes split_heads and "
                "W_O finds head h's features at h*d_head ... (h+1)*d_head - 1."
            )
        raise CheckFailure(
            "Your merge differs from x.transpose(1, 2).reshape(batch, seq, heads * d_head): use "
            "rearrange(x, 'batch heads seq d_head -> batch seq (heads d_head)')."
        )
    passed(f"merge_heads: (batch, heads, seq, d_head) -> (batch, seq, d_model), the inverse of split_heads "
           f"({_dtype_name(dtype)})")


# -- helpers that touch the student's module, always through call() -------------------------


def _expect_parameters(module: Any, d_model: int, bias: bool) -> None:
    shapes = call(_parameter_shapes, module)
    expected = {f"{p}.weight": [d_model, d_model] for p in PROJECTIONS}
    if bias:
        expected |= {f"{p}.bias": [d_model] for p in PROJECTIONS}
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckFailure(
                f"Your module has no parameter {name}. Store the four projections as self.w_q, self.w_k, self.w_v "
                "and self.w_o, each nn.Linear(d_model, d_model, bias=bias)."
            )
        if shapes[name] != shape:
            raise CheckFailure(
                f"{name} has shape {tuple(shapes[name])}; it should be {tuple(shape)} with d_model={d_model}. Each "
                "projection maps d_model features to d_model features: all the heads at once, not one head's d_head."
            )
    extra = sorted(set(shapes) - set(expected))
    if extra:
        hint = " With bias=False, pass bias=bias to every nn.Linear." if not bias else ""
        raise CheckFailure(f"Unexpected parameters {extra}: only w_q, w_k, w_v and w_o are learned.{hint}")


def _oracle(s: dict[str, int], dtype: torch.dtype, seed: int) -> tuple[nn.MultiheadAttention, dict[str, Tensor]]:
    """PyTorch's module with seeded weights (biases too, so a missing bias shows), and its weights by our names."""
    d_model = s["d_model"]
    g = torch.Generator().manual_seed(seed + 11)
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        oracle = nn.MultiheadAttention(d_model, s["heads"], batch_first=True, dtype=dtype).eval()
    with torch.no_grad():
        for param in (oracle.in_proj_weight, oracle.out_proj.weight):
            param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) / math.sqrt(d_model))
        for param in (oracle.in_proj_bias, oracle.out_proj.bias):
            param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) * 0.5)
    # PyTorch packs the input projections as (q, k, v) along the output axis.
    weights = rearrange(oracle.in_proj_weight.detach(), "(qkv d_out) d_in -> qkv d_out d_in", qkv=3)
    biases = rearrange(oracle.in_proj_bias.detach(), "(qkv d_out) -> qkv d_out", qkv=3)
    state = {}
    for i, name in enumerate(PROJECTIONS[:3]):
        state[f"{name}.weight"], state[f"{name}.bias"] = weights[i].clone(), biases[i].clone()
    state["w_o.weight"] = oracle.out_proj.weight.detach().clone()
    state["w_o.bias"] = oracle.out_proj.bias.detach().clone()
    return oracle, state


def _build(cls: Any, s: dict[str, int], dtype: torch.dtype, seed: int, **kwargs: Any) -> tuple[Any, Any, dict]:
    module = call(cls, s["d_model"], s["heads"], **kwargs)
    _expect_parameters(module, s["d_model"], bias=True)
    oracle, state = _oracle(s, dtype, seed)
    call(_load, module, state)
    return module, oracle, state


def _reference(state: dict[str, Tensor], heads: int, query: Tensor, key: Tensor, value: Tensor,
               mask: Tensor | None, *, split: str = "heads d_head", merge: str = "heads d_head", w_o: bool = True,
               scale: float | None = None, roles: tuple[str, str, str] = ("w_q", "w_k", "w_v")) -> Tensor:
    """Multi-head attention written out, with switches for the usual mistakes (to name them)."""
    def project(name: str, x: Tensor) -> Tensor:
        return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    q, k, v = (rearrange(project(role, x), f"batch seq ({split}) -> batch heads seq d_head", heads=heads)
               for role, x in zip(roles, (query, key, value), strict=True))
    scale = math.sqrt(q.shape[-1]) if scale is None else scale
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len") / scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    out = einsum(weights, v, "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
    concat = rearrange(out, f"batch heads seq d_head -> batch seq ({merge})")
    return project("w_o", concat) if w_o else concat


def _diagnose(state: dict[str, Tensor], s: dict[str, int], query: Tensor, key: Tensor, value: Tensor,
              mask: Tensor | None, output: Tensor) -> str:
    """Name the likely mistake: the first written-out mistake that reproduces the student's output."""
    if torch.isnan(output).any():
        return "Your output contains NaN: does every head get the mask, and is the softmax over k_len?"
    heads, d_model = s["heads"], s["d_model"]
    variants = {
        "You merged the heads as (d_head heads), which interleaves them; W_O expects head h's features at "
        "h*d_head ... (h+1)*d_head - 1: merge as (heads d_head), the order of split_heads.": dict(merge="d_head heads"),
        "You split and merged d_model as (d_head heads): each head then gets every heads-th feature instead of a "
        "contiguous block. Use (heads d_head) in both patterns.": dict(split="d_head heads", merge="d_head heads"),
        "You return the concatenated heads without the output projection: apply self.w_o to merge_heads(...).": dict(
            w_o=False),
        "You scaled the scores by sqrt(d_model); each head's queries and keys have d_head features, so the scale "
        "is sqrt(d_head) (chapter 01's scaled_dot_product_attention does it for you).": dict(scale=math.sqrt(d_model)),
        "You did not scale the scores at all: divide by sqrt(d_head).": dict(scale=1.0),
        "You projected the keys with w_q: the keys need their own projection, self.w_k(key).": dict(
            roles=("w_q", "w_q", "w_v")),
        "You projected the values with w_k: the values need their own projection, self.w_v(value).": dict(
            roles=("w_q", "w_k", "w_k")),
        "You projected the queries with w_k: the queries need their own projection, self.w_q(query).": dict(
            roles=("w_k", "w_k", "w_v")),
    }
    if not torch.equal(key, value):
        variants["You took the values from `key`: project the `value` argument with w_v."] = "key as value"
    if mask is not None:
        variants["Your output ignores the mask: pass it on to scaled_dot_product_attention."] = "no mask"
    for hint, mistake in variants.items():
        if mistake == "key as value":
            expected = _reference(state, heads, query, key, key, mask)
        elif mistake == "no mask":
            expected = _reference(state, heads, query, key, value, None)
        else:
            expected = _reference(state, heads, query, key, value, mask, **mistake)
        if close(output, expected, output.dtype):
            return hint
    return ("Compare, on one small example, your q, k and v after split_heads with those of "
            "torch.nn.MultiheadAttention (its in_proj_weight packs W_Q, W_K, W_V in this order).")


def _compare(module: Any, oracle: nn.MultiheadAttention, state: dict[str, Tensor], s: dict[str, int],
             dtype: torch.dtype, what: str, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> None:
    args = (query, key, value) if mask is None else (query, key, value, mask)
    b, q_len, d_model = query.shape
    output = expect_tensor(call(module, *args), "the output", (b, q_len, d_model), "batch q_len d_model", dtype)
    kwargs: dict[str, Tensor] = {}
    if mask is not None and mask.dim() == 4:
        kwargs["key_padding_mask"] = ~mask[:, 0, 0, :]  # PyTorch's True means "ignore this key"
    elif mask is not None:
        kwargs["attn_mask"] = ~mask
    with torch.no_grad():
        expected = oracle(query, key, value, need_weights=False, **kwargs)[0]
    if not close(output, expected, dtype):
        raise CheckFailure(
            f"For {what}, your output differs from torch.nn.MultiheadAttention's with the same weights "
            f"(largest difference {(output - expected).abs().max().item():.3g}). "
            f"{_diagnose(state, s, query, key, value, mask, output)}"
        )


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
        got = "no error" if error is None else f"a {error}"
        raise CheckFailure(
            f"MultiHeadAttention({d_model + 1}, {heads}) should raise a ValueError, since {heads} heads cannot share "
            f"{d_model + 1} features equally; it raised {got}. Check d_model % heads in __init__."
        )
    passed("w_q, w_k, w_v, w_o are (d_model, d_model), biases only with bias=True, "
           "ValueError when heads does not divide d_model")


@check(forbid=BUILT_IN_MHA)
def check_mha_self_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Self-attention equal to torch.nn.MultiheadAttention: no mask, a padding mask, a causal mask; dropout."""
    s = _sizes(seed)
    module, oracle, state = _build(cls, s, dtype, seed)
    (x,) = _inputs(s, dtype, seed, s["q_len"])
    seq = s["q_len"]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for what, mask in (("self-attention without a mask", None),
                       ("self-attention with a padding mask (batch, 1, 1, k_len)", _padding_mask(s, seq, seed)),
                       ("self-attention with a causal mask (q_len, k_len)", causal)):
        _compare(module, oracle, state, s, dtype, what, x, x, x, mask)
    # Dropout: nothing in eval mode; in training with p = 1 every attention weight is dropped,
    # so only w_o's bias is left.
    dropping, _, _ = _build(cls, s, dtype, seed, dropout=1.0)
    _compare(dropping, oracle, state, s, dtype, "dropout=1.0 in eval() mode", x, x, x, None)
    call(_set_training, dropping, True)
    got = call(dropping, x, x, x)
    if not close(got, state["w_o.bias"].expand_as(got), dtype):
        if close(got, oracle(x, x, x, need_weights=False)[0].detach(), dtype):
            hint = "your module ignores dropout: apply self.dropout to the attention weights."
        else:
            hint = "apply self.dropout (nn.Dropout(dropout)) to the attention weights before the weighted sum."
        raise CheckFailure(
            "With dropout=1.0 in training mode every attention weight is dropped, so the output should be "
            f"w_o's bias alone; {hint}"
        )
    passed(f"self-attention equal to torch.nn.MultiheadAttention without a mask, with padding and causal masks; "
           f"dropout only in training ({_dtype_name(dtype)})")


@check(forbid=BUILT_IN_MHA)
def check_mha_cross_attention(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention (q_len != k_len, key != value) equal to torch.nn.MultiheadAttention, with a padding mask."""
    s = _sizes(seed)
    module, oracle, state = _build(cls, s, dtype, seed)
    query, key, value = _inputs(s, dtype, seed + 1, s["q_len"], s["k_len"], s["k_len"])
    padding = _padding_mask(s, s["k_len"], seed)
    for what, mask in (("cross-attention without a mask", None),
                       ("cross-attention with a padding mask (batch, 1, 1, k_len)", padding)):
        _compare(module, oracle, state, s, dtype, what, query, key, value, mask)
    passed(f"cross-attention (q_len={s['q_len']}, k_len={s['k_len']}) equal to torch.nn.MultiheadAttention "
           f"({_dtype_name(dtype)})")


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
            raise CheckFailure(f"count_parameters should return a Python int (use .numel() and sum), got {kind(got)}.")
        with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
            expected = sum(p.numel() for p in nn.MultiheadAttention(d_model, heads, bias=bias).parameters())
        if got == expected:
            continue
        if bias and got == 4 * d_model * d_model:
            hint = "You counted the weights only: with bias=True each of the four nn.Linear also has d_model biases."
        elif got in (3 * d_model * (d_model + bias), 3 * d_model * d_model):
            hint = "Your count leaves out one projection: is w_o there?"
        elif got == 4 * d_model * (d_model // heads) + 4 * (d_model // heads) * bias:
            hint = "Each projection maps d_model to d_model (all heads together), not to one head's d_head."
        else:
            hint = "Build MultiHeadAttention(d_model, heads, bias=bias) and add up p.numel() over its parameters()."
        raise CheckFailure(f"For d_model={d_model}, heads={heads}, bias={bias} you counted {got:,} parameters; "
                           f"torch.nn.MultiheadAttention has {expected:,}. {hint}")
    passed("parameter counts equal torch.nn.MultiheadAttention's: 4·d_model² + 4·d_model, the same for any heads")
