"""Checks for chapter 12: LLaMA's layer from the course's parts, top-k and nucleus filtering, LoRA, a measurement.

The oracles are PyTorch's own pieces fed the same weights: ``F.rms_norm``, ``F.scaled_dot_product_attention(...,
enable_gqa=True)`` over queries and keys turned by RoPE (written out by its definition, chapter 06's interleaved
pairs, as chapter 10's checks do), ``F.silu``, ``torch.topk``, ``F.linear``. Where no built-in exists the oracle is
the defining property: decoding one position at a time with a KV-cache equals one causal pass; the nucleus is the
smallest set of most likely tokens whose probabilities reach ``p``; a LoRA layer starts equal to its base layer,
trains ``r · (in + out)`` numbers, and ``merged()`` computes the same function. Nothing here imports the course's
reference library or ``transformers``. Every touch of the student's code (building a module, loading weights, running
it, reading its cache or its gradients) goes through :func:`call`, with the small helpers below.
"""

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    call,
    check,
    close,
    difference,
    draw_sizes,
    dtype_name,
    expect_tensor,
    kind,
    passed,
    raised_error,
    show,
)
from stepformer.checks._messages import language, marked, t, tr
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import parameter_shapes as _parameter_shapes
from stepformer.checks._modules import set_training as _set_training
from stepformer.checks.gqa import _FixedDropout, _module_oracle


def _set_attribute(module: nn.Module, name: str, value: Any) -> None:
    setattr(module, name, value)


def _stops() -> str:
    """The full stops that end a sentence of a message: a Chinese message may end in either."""
    return ".。" if language() == "zh" else "."


def _changes_its_input(fn: Callable[..., Any], x: Tensor, *args: Any, **kwargs: Any) -> bool:
    """Whether ``fn`` writes into the tensor it is given (``x += ...``, ``masked_fill_``): run on a copy, compared."""
    copy = x.clone()
    fn(copy, *args, **kwargs)
    return not torch.equal(copy, x)


# -- exercise 1: LLaMA's layer ------------------------------------------------------------------------

BLOCK_AXES = ("batch", "seq", "kv_heads", "group", "d_head", "d_ff")
# Tolerances of the block's output, the roundings of two norms, the attention and SwiGLU: over 40 seeds a correct block
# differs from the float64 reference by up to 3.3e-6 in float32 and 5e-15 in float64.
BLOCK_TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10}


def _block_sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes (heads = kv_heads * group and d_model = heads * d_head computed; d_head even, which
    RoPE needs), so that a swapped axis cannot pass."""
    if seed == 0:
        sizes = dict(zip(BLOCK_AXES, (3, 5, 2, 4, 6, 7), strict=True))
    else:
        g = torch.Generator().manual_seed(seed)
        while True:
            grouping = draw_sizes(g, ("kv_heads", "group"), span=3)
            d_head = 2 * int(torch.randint(1, 5, (1,), generator=g))  # even, drawn between the two
            drawn = {**draw_sizes(g, ("batch", "seq", "d_ff"), span=10), **grouping, "d_head": d_head}
            sizes = {axis: drawn[axis] for axis in BLOCK_AXES}
            values = [*sizes.values(), sizes["kv_heads"] * sizes["group"]]
            if len(set(values)) == len(values) and sizes["seq"] >= 4:
                break
    heads = sizes["kv_heads"] * sizes["group"]
    return {**sizes, "heads": heads, "d_model": heads * sizes["d_head"]}


def _kv_choices(s: dict[str, int]) -> tuple[tuple[int, str], ...]:
    return ((s["kv_heads"], f"GQA (kv_heads={s['kv_heads']})"), (1, "MQA (kv_heads=1)"),
            (s["heads"], f"kv_heads=heads={s['heads']}"))


def _block_shapes(d_model: int, heads: int, kv_heads: int, d_ff: int) -> dict[str, list[int]]:
    kv = kv_heads * (d_model // heads)
    return {"norm1.weight": [d_model], "self_attn.w_q.weight": [d_model, d_model],
            "self_attn.w_k.weight": [kv, d_model], "self_attn.w_v.weight": [kv, d_model],
            "self_attn.w_o.weight": [d_model, d_model], "norm2.weight": [d_model],
            "ffn.w_gate.weight": [d_ff, d_model], "ffn.w_up.weight": [d_ff, d_model],
            "ffn.w_down.weight": [d_model, d_ff]}


def _expect_block_parameters(module: Any, s: dict[str, int], kv_heads: int) -> None:
    shapes = call(_parameter_shapes, module)
    if type(shapes) is not dict:
        raise CheckFailure(t("LlamaBlock(...) should build an nn.Module, got {kind}.", kind=kind(module)))
    expected = _block_shapes(s["d_model"], s["heads"], kv_heads, s["d_ff"])
    extra, missing = sorted(set(shapes) - set(expected)), sorted(set(expected) - set(shapes))
    if any(name.startswith("norm") and name.endswith(".bias") for name in extra):
        raise CheckFailure(t("Your block has {names}: that is a LayerNorm's shift. LLaMA normalises with RMSNorm "
                             "(chapter 05), which has a weight only: RMSNorm(d_model, eps).",
                             names=", ".join(n for n in extra if n.startswith("norm"))))
    if any(name.endswith(".bias") for name in extra):
        raise CheckFailure(t("Your block has biases ({names}); LLaMA's layer has none: GroupedQueryAttention(d_model, "
                             "heads, kv_heads, bias=False, rope=True), and SwiGLU has none of its own.",
                             names=", ".join(n for n in extra if n.endswith(".bias"))))
    if missing or extra:
        raise CheckFailure(t(
            "Your block's parameters are {found}; LLaMA's layer built from the course's parts has {expected}. Name "
            "the parts norm1, self_attn, norm2 and ffn (the checks copy weights in by name): RMSNorm, "
            "GroupedQueryAttention and SwiGLU from the cells above.", found=sorted(shapes), expected=sorted(expected)))
    for name, shape in expected.items():
        if shapes[name] == shape:
            continue
        if name.startswith(("self_attn.w_k", "self_attn.w_v")):
            hint = t(" It projects to {features} features, {found_heads} heads of d_head={d_head}: pass "
                     "kv_heads={kv_heads} on to GroupedQueryAttention, so that the keys and values have kv_heads "
                     "heads.",
                     features=shapes[name][0], found_heads=shapes[name][0] // s["d_head"], d_head=s["d_head"],
                     kv_heads=kv_heads) if shapes[name][0] != shape[0] else ""
        elif name.startswith("ffn."):
            hint = t(" Build SwiGLU(d_model, d_ff) with d_model={d_model} and d_ff={d_ff}, in that order.",
                     d_model=s["d_model"], d_ff=s["d_ff"])
        else:
            hint = ""
        raise CheckFailure(t("{name} has shape {shape}; it should be {expected} with d_model={d_model}, heads={heads}, "
                             "kv_heads={kv_heads}, d_ff={d_ff}.{hint}", name=name, shape=tuple(shapes[name]),
                             expected=tuple(shape), d_model=s["d_model"], heads=s["heads"], kv_heads=kv_heads,
                             d_ff=s["d_ff"], hint=hint))


def _block_state(s: dict[str, int], kv_heads: int, dtype: torch.dtype, seed: int) -> dict[str, Tensor]:
    """Seeded weights; the norms' weights away from 1 (as after training), so that a missing or shared one shows."""
    g = torch.Generator().manual_seed(seed + 17)
    state = {}
    for name, shape in _block_shapes(s["d_model"], s["heads"], kv_heads, s["d_ff"]).items():
        if name.startswith("norm"):
            state[name] = 1 + 0.5 * torch.randn(shape, generator=g, dtype=dtype)
        else:
            state[name] = torch.randn(shape, generator=g, dtype=dtype) / math.sqrt(shape[1])
    return state


def _build_block(cls: Any, s: dict[str, int], kv_heads: int, dtype: torch.dtype, seed: int,
                 eps: float | None = None) -> tuple[Any, dict[str, Tensor]]:
    args = (s["d_model"], s["heads"], kv_heads, s["d_ff"]) + (() if eps is None else (eps,))
    module = call(cls, *args)
    _expect_block_parameters(module, s, kv_heads)
    state = _block_state(s, kv_heads, dtype, seed)
    call(_load, module, state)
    return module, state


def _block_inputs(s: dict[str, int], dtype: torch.dtype, seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed + 23)
    return scale * torch.randn(s["batch"], s["seq"], s["d_model"], generator=g, dtype=dtype)


def _causal(seq: int) -> Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).tril()


def _padding(s: dict[str, int], seed: int) -> Tensor:
    """(batch, total), True = a real token: the first sentence full, one padded at the end, and the last padded at the
    start (as batched generation pads a shorter prompt): its first queries may read no key at all."""
    g = torch.Generator().manual_seed(seed + 29)
    batch, seq = s["batch"], s["seq"]
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[0], lengths[1] = seq, seq - 2
    positions = rearrange(torch.arange(seq), "seq -> 1 seq")
    padding = positions < rearrange(lengths, "batch -> batch 1")
    padding[-1] = positions[0] >= 2  # left padding: positions 0 and 1 are not tokens
    return padding


def _causal_and_padding(s: dict[str, int], seed: int) -> Tensor:
    """(batch, 1, seq, total): a query reads earlier real tokens only."""
    return _causal(s["seq"]) & rearrange(_padding(s, seed), "batch total -> batch 1 1 total")


BLOCK_MISTAKES = {  # shown with tr()
    "post-norm": marked("You normalise after each residual sum (post-norm, the original Transformer's order). LLaMA "
                        "normalises each sublayer's input and leaves the residual stream alone (pre-norm): "
                        "h = x + self_attn(norm1(x)), out = h + ffn(norm2(h))."),
    "parallel": marked("Your feed-forward reads norm2(x), the block's input, instead of norm2(h), the stream after the "
                       "attention: that is the parallel block of GPT-J and PaLM. In LLaMA the sublayers run one after "
                       "the other: out = h + ffn(norm2(h)) with h = x + self_attn(norm1(x))."),
    "one norm": marked("Both sublayers read norm1: the feed-forward has its own RMSNorm, norm2, with its own weight."),
    "no rope": marked("Your attention does not turn queries and keys by their positions: LLaMA has no position "
                      "embeddings, its positions come from RoPE inside the attention: GroupedQueryAttention(..., "
                      "rope=True)."),
    "no mask": marked("Your block ignores the mask: pass it on, self.self_attn(h, h, h, mask, cache=cache)."),
    "no attention residual": marked("The attention's output replaces the stream instead of adding to it: "
                                    "h = x + self_attn(norm1(x))."),
    "no ffn residual": marked("The feed-forward's output replaces the stream instead of adding to it: "
                              "out = h + ffn(norm2(h))."),
    "no norm before ffn": marked("The feed-forward reads h itself: normalise it first, ffn(norm2(h))."),
    "no norm before attention": marked("The attention reads x itself: normalise it first, self_attn(norm1(x)) (the "
                                       "same normalised tensor as query, key and value)."),
}


def _block_reference(state: dict[str, Tensor], heads: int, kv_heads: int, x: Tensor, mask: Tensor | None,
                     eps: float | tuple[float, float], mistake: str = "") -> Tensor:
    """LLaMA's layer from PyTorch's pieces, in float64; ``mistake`` (a key of BLOCK_MISTAKES) builds a usual one.
    ``eps`` may be a pair, norm1's and norm2's, to build a block that passes it on to one norm only."""
    state = {name: value.double() for name, value in state.items()}
    eps1, eps2 = eps if isinstance(eps, tuple) else (eps, eps)
    x = x.double()
    attention_state = {name.removeprefix("self_attn."): value for name, value in state.items()
                       if name.startswith("self_attn.")}
    positions = None if mistake == "no rope" else torch.arange(x.shape[1])

    def norm(i: int, t: Tensor) -> Tensor:
        return F.rms_norm(t, (t.shape[-1],), state[f"norm{i}.weight"], eps1 if i == 1 else eps2)

    def attention(t: Tensor) -> Tensor:
        return _module_oracle(attention_state, heads, kv_heads, t, t, t, None if mistake == "no mask" else mask,
                              positions)

    def ffn(t: Tensor) -> Tensor:
        gate = F.silu(F.linear(t, state["ffn.w_gate.weight"]))
        return F.linear(gate * F.linear(t, state["ffn.w_up.weight"]), state["ffn.w_down.weight"])

    if mistake == "post-norm":
        h = norm(1, x + attention(x))
        return norm(2, h + ffn(h))
    if mistake == "parallel":
        return x + attention(norm(1, x)) + ffn(norm(2, x))
    h = attention(norm(1, x)) if mistake == "no attention residual" else (
        x + attention(x) if mistake == "no norm before attention" else x + attention(norm(1, x)))
    if mistake == "no ffn residual":
        return ffn(norm(2, h))
    if mistake == "no norm before ffn":
        return h + ffn(h)
    return h + ffn(norm(1 if mistake == "one norm" else 2, h))


def _diagnose_block(state: dict[str, Tensor], heads: int, kv_heads: int, x: Tensor, mask: Tensor | None,
                    eps: float, output: Tensor) -> str:
    if torch.isnan(output).any():
        return t("Your output contains NaN: a query that may read no key (the left-padded sentence) must get zeros "
                 "from the attention, as the given GroupedQueryAttention does; does your mask reach it unchanged?")
    tolerance = BLOCK_TOLERANCE[output.dtype]
    mistakes = [m for m in BLOCK_MISTAKES if m != "no mask" or mask is not None]
    for mistake in mistakes:
        if close(output, _block_reference(state, heads, kv_heads, x, mask, eps, mistake).to(output.dtype),
                 output.dtype, tolerance):
            return tr(BLOCK_MISTAKES[mistake])
    if eps != 1e-6:
        # Which norms use RMSNorm's default eps: both, norm1 alone, norm2 alone (each rebuilt, and matched exactly).
        for eps_pair, message in (
            ((1e-6, 1e-6), marked("Your RMSNorms use eps=1e-6, RMSNorm's default, although the block was built with "
                                  "eps={eps}: pass eps on to both, RMSNorm(d_model, eps).")),
            ((1e-6, eps), marked("Your norm1 uses eps=1e-6, RMSNorm's default, although the block was built with "
                                 "eps={eps}: pass eps on to norm1, RMSNorm(d_model, eps).")),
            ((eps, 1e-6), marked("Your norm2 uses eps=1e-6, RMSNorm's default, although the block was built with "
                                 "eps={eps}: pass eps on to norm2, RMSNorm(d_model, eps).")),
        ):
            if close(output, _block_reference(state, heads, kv_heads, x, mask, eps_pair).to(output.dtype),
                     output.dtype, tolerance):
                return tr(message, eps=eps)
    return t("Write forward as the two equations: h = x + self_attn(n, n, n, mask, cache=cache) with n = norm1(x), "
             "then out = h + ffn(norm2(h)); and build self_attn as GroupedQueryAttention(d_model, heads, kv_heads, "
             "bias=False, rope=True).")


def _compare_block(module: Any, state: dict[str, Tensor], s: dict[str, int], kv_heads: int, dtype: torch.dtype,
                   what: str, x: Tensor, mask: Tensor | None, eps: float = 1e-6) -> None:
    try:
        output = call(module, x) if mask is None else call(module, x, mask)
    except CheckFailure as failure:  # say which case broke it
        raise CheckFailure(t("For {what}: {failure}", what=what, failure=str(failure))) from failure
    output = expect_tensor(output, t("the block's output for {what}", what=what), tuple(x.shape), "batch seq d_model",
                           dtype)
    expected = _block_reference(state, s["heads"], kv_heads, x, mask, eps).to(dtype)
    if not close(output, expected, dtype, BLOCK_TOLERANCE[dtype]):
        sizes = {"batch": x.shape[0], "seq": x.shape[1], "d_model": x.shape[2], "heads": s["heads"],
                 "kv_heads": kv_heads, "d_ff": s["d_ff"]}
        raise CheckFailure(t(
            "For {what}, your block's output differs from LLaMA's layer built from PyTorch's own pieces with the same "
            "weights (F.rms_norm, F.scaled_dot_product_attention with enable_gqa=True over RoPE-turned queries and "
            "keys, F.silu) ({difference}). {diagnosis}", what=what, difference=difference(output, expected, sizes),
            diagnosis=_diagnose_block(state, s["heads"], kv_heads, x, mask, eps, output)))


def _expect_input_kept(module: Any, x: Tensor, what: str) -> None:
    if call(_changes_its_input, module, x):
        raise CheckFailure(t("Your block changed the tensor it was given ({what}): x += ... writes into the caller's "
                             "tensor. Write x = x + ... (or h = x + ...), so that the input stays as it was.",
                             what=what))


@check
def check_llama_block_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """norm1, self_attn, norm2, ffn with LLaMA's shapes: RMSNorm weights, w_k and w_v of kv_heads heads, no biases."""
    s = _block_sizes(seed)
    for kv_heads, _ in _kv_choices(s):
        module = call(cls, s["d_model"], s["heads"], kv_heads, s["d_ff"])
        _expect_block_parameters(module, s, kv_heads)
    _expect_block_parameters(call(cls, s["d_model"], s["heads"], s["kv_heads"], s["d_ff"], 1e-5), s, s["kv_heads"])
    passed(t("LlamaBlock(d_model={d_model}, heads={heads}, kv_heads, d_ff={d_ff}) has norm1, self_attn, norm2 and ffn "
             "with LLaMA's shapes, no biases, w_k and w_v of kv_heads heads (kv_heads = heads, {kv_heads}, 1)",
             d_model=s["d_model"], heads=s["heads"], d_ff=s["d_ff"], kv_heads=s["kv_heads"]))


@check
def check_llama_block_values(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to pre-norm RMSNorm, GQA with RoPE and SwiGLU from PyTorch's pieces: kv_heads heads, a divisor and 1,
    without a mask, causal, causal with padding; eps passed on."""
    s = _block_sizes(seed)
    x = _block_inputs(s, dtype, seed)
    masks = ((t("no mask"), None), (t("a causal mask (seq, seq)"), _causal(s["seq"])),
             (t("a causal mask with padding (batch, 1, seq, seq), one sentence padded at the start"),
              _causal_and_padding(s, seed)))
    for i, (kv_heads, name) in enumerate(_kv_choices(s)):
        module, state = _build_block(cls, s, kv_heads, dtype, seed + i)
        if i == 0:
            _expect_input_kept(module, x, t("the input x"))
        for where, mask in masks:
            _compare_block(module, state, s, kv_heads, dtype, t("{name} with {where}", name=name, where=where), x,
                           mask)
    _compare_block(module, state, s, s["heads"], dtype, t("one sentence (batch=1) with a causal mask"), x[:1],
                   _causal(s["seq"]))
    # eps inside the square root matters when the features are small: 0.1 against a mean square of 0.04.
    module, state = _build_block(cls, s, s["kv_heads"], dtype, seed + 5, eps=0.1)
    _compare_block(module, state, s, s["kv_heads"], dtype, t("a block built with eps=0.1, on inputs of size 0.2, "
                                                             "with a causal mask"),
                   _block_inputs(s, dtype, seed + 1, 0.2), _causal(s["seq"]), eps=0.1)
    passed(t("LlamaBlock equal to LLaMA's layer from PyTorch's pieces (pre-norm RMSNorm, GQA with RoPE, SwiGLU) for "
             "kv_heads = {kv_heads}, 1 and heads, without a mask, causal, causal with padding (queries that read "
             "nothing included), batch=1, eps passed on ({dtype})", kv_heads=s["kv_heads"], dtype=dtype_name(dtype)))


def _decode_steps(module: nn.Module, cache: Any, x: Tensor) -> Tensor:
    """Feed the positions of x one at a time with no mask, as a language model decodes: each reads what is cached."""
    x = x.clone()
    return torch.cat([module(x[:, t:t + 1], cache=cache) for t in range(x.shape[1])], dim=1)


def _decode_chunks(module: nn.Module, cache: Any, x: Tensor, bounds: list[int], padding: Tensor) -> Tensor:
    """A prefill and steps of several positions, each under its (new, total) causal mask and the padding of every key
    read so far."""
    x, outputs = x.clone(), []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        causal = torch.ones(stop - start, stop, dtype=torch.bool).tril(start)  # position start + i reads keys <= it
        mask = causal & rearrange(padding[:, :stop], "batch total -> batch 1 1 total")
        outputs.append(module(x[:, start:stop], mask, cache=cache))
    return torch.cat(outputs, dim=1)


def _cached(cache: Any) -> Tensor | None:
    """The cached keys, or None while the cache is empty."""
    keys = getattr(cache, "keys", None)
    return keys.detach().clone() if isinstance(keys, Tensor) else None


@check
def check_llama_block_cache(classes: tuple[Callable[..., Any], Callable[..., Any]], seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> None:
    """Decoding one position at a time (and in chunks, with padding) with a KVCache equals one causal pass.

    ``classes`` is ``(LlamaBlock, KVCache)``: the block and the cache class of the notebook, which travel together.
    """
    cls, cache_cls = classes
    s = _block_sizes(seed)
    x = _block_inputs(s, dtype, seed + 2)
    b, seq, kv, d_head = s["batch"], s["seq"], s["kv_heads"], s["d_head"]
    module, state = _build_block(cls, s, kv, dtype, seed + 7)
    _expect_input_kept(module, x, t("the input x"))
    # The full pass against the oracle first: a mistake made alike with and without a cache shows here.
    _compare_block(module, state, s, kv, dtype, t("one causal pass"), x, _causal(seq))
    cache = call(cache_cls)
    stepwise = expect_tensor(call(_decode_steps, module, cache, x), t("the outputs decoded one position at a time"),
                             tuple(x.shape), "batch seq d_model", dtype)
    keys = call(_cached, cache)
    if keys is None:
        raise CheckFailure(t("After decoding {seq} positions one at a time, the KVCache is still empty: pass it on to "
                             "the attention, self.self_attn(h, h, h, mask, cache=cache), which appends each step's "
                             "keys and values.", seq=seq))
    if type(keys) is not Tensor or tuple(keys.shape) != (b, kv, seq, d_head):
        shape = tuple(keys.shape) if type(keys) is Tensor else kind(keys)
        raise CheckFailure(t("After {seq} steps the cache's keys should have shape (batch={batch}, "
                             "kv_heads={kv_heads}, length={seq}, d_head={d_head}), got {shape}: one cache per block, "
                             "given to self_attn once per step.", seq=seq, batch=b, kv_heads=kv, d_head=d_head,
                             shape=shape))
    expected = _block_reference(state, s["heads"], kv, x, _causal(seq), 1e-6).to(dtype)
    sizes = {"batch": b, "seq": seq, "d_model": s["d_model"], "heads": s["heads"], "kv_heads": kv}
    if not close(stepwise, expected, dtype, BLOCK_TOLERANCE[dtype]):
        raise CheckFailure(t(
            "Decoding one position at a time with a KVCache gives other outputs than one causal pass ({difference}). "
            "Each step must go through the same two equations, with the cache handed to self_attn (it turns the new "
            "query and key by their positions, len(cache) onwards, and attends to every cached key).",
            difference=difference(stepwise, expected, sizes)))
    # Multi-query attention: a prefill and steps of several positions under (new, total) masks, with padding.
    module, state = _build_block(cls, s, 1, dtype, seed + 8)
    bounds = sorted({0, (seq + 1) // 2, min(seq, (seq + 1) // 2 + 2), seq})
    padding = _padding(s, seed)
    chunked = expect_tensor(call(_decode_chunks, module, call(cache_cls), x, bounds, padding),
                            t("the outputs decoded in chunks"), tuple(x.shape), "batch seq d_model", dtype)
    expected = _block_reference(state, s["heads"], 1, x, _causal_and_padding(s, seed), 1e-6).to(dtype)
    if not close(chunked, expected, dtype, BLOCK_TOLERANCE[dtype]):
        raise CheckFailure(t(
            "With kv_heads=1, decoding a prefill and then steps of several positions (chunks {bounds}) under "
            "(new, total) causal masks with padding gives other outputs than one pass under the causal mask with "
            "padding ({difference}). Pass the mask and the cache on to self_attn unchanged: the mask spans every key "
            "read, the cached ones and the new.", bounds=bounds,
            difference=difference(chunked, expected, {**sizes, "kv_heads": 1})))
    passed(t("decoding with a KVCache equals one causal pass, one position at a time (GQA, the cache holding "
             "(batch, kv_heads={kv_heads}, length, d_head)) and in chunks with padding (MQA) ({dtype})", kv_heads=kv,
             dtype=dtype_name(dtype)))


# -- exercise 2: top-k and nucleus filtering ---------------------------------------------------------

NEG_INF = -math.inf
FILTER_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def _vocab_sizes(seed: int) -> dict[str, int]:
    """vocab larger than and distinct from the leading axes."""
    if seed == 0:
        return {"batch": 3, "seq": 2, "vocab": 11}
    g = torch.Generator().manual_seed(seed + 31)
    return {**draw_sizes(g, ("batch", "seq"), span=4), "vocab": int(torch.randint(9, 16, (1,), generator=g))}


def _logit_cases(seed: int, dtype: torch.dtype, ties: bool = False) -> list[tuple[str, Tensor]]:
    """Logits of one row, a batch and (batch, seq). Spread 2 over at most 15 tokens keeps every probability above
    1e-6 (the least over 400 seeds), ten times float32's rounding of a sum near 1: p = 1.0 must keep every token, in
    float32 too. With ``ties``, whole numbers: many tokens share a logit."""
    s = _vocab_sizes(seed)
    g = torch.Generator().manual_seed(seed + 37)
    cases = []
    for name, shape in ((t("one row (vocab,)"), (s["vocab"],)), (t("a batch (batch, vocab)"), (s["batch"], s["vocab"])),
                        ("(batch, seq, vocab)", (s["batch"], s["seq"], s["vocab"]))):
        if ties:
            logits = torch.randint(-2, 3, shape, generator=g).to(dtype)
            cases.append((t("{name} with ties", name=name), logits))
        else:
            cases.append((name, 2 * torch.randn(shape, generator=g, dtype=dtype)))
    return cases


def _axes(x: Tensor) -> str:
    return {1: "vocab", 2: "batch vocab", 3: "batch seq vocab"}[x.dim()]


def _none_hint(fn: Callable[..., Any], logits: Tensor, failure: CheckFailure) -> str:
    """After an error about None: which filter's step runs although its option is None, found by giving each option
    alone (the other one None); empty unless exactly one of them raises about None again."""
    if not _raised_about(failure, "NoneType"):
        return ""
    found = []
    for name, options in (("top_k", {"top_p": 1.0}), ("top_p", {"top_k": logits.shape[-1]})):
        try:
            call(fn, logits.clone(), **options)
        except CheckFailure as probe:
            if _raised_about(probe, "NoneType"):
                found.append((name, options))
    if len(found) != 1:
        return ""
    name, options = found[0]
    return t(" Called with {options} alone, so that {name} is None, your filter_logits again raises an error about "
             "None: your code uses {name} although {name} is None. None means no {name} filter: do the {name} step "
             "only if {name} is not None.", options=_options(options), name=name)


def _raised_about(failure: CheckFailure, word: str) -> bool:
    """Whether ``failure`` reports an error of the student's code whose class or message names ``word``: the
    exception's own words, never the check's (which are in the reader's language)."""
    return isinstance(failure, CodeRaised) and (word in failure.error or word in failure.text)


def _dim_hint(failure: CheckFailure) -> str:
    """What PyTorch's "Dimension out of range" says: which dim the code asked of a tensor with how many axes."""
    found = re.search(r"Dimension out of range \(expected to be in range of \[(-\d+), (\d+)\], but got (-?\d+)\)",
                      failure.text) if isinstance(failure, CodeRaised) else None
    if not found:
        return ""
    axes, asked = int(found.group(2)) + 1, int(found.group(3))
    if axes == 1:
        return t(" Your code asks a tensor with {axes} axis for dim={asked}: filter_logits works along the last axis, "
                 "vocab, which is dim=-1 for (vocab,), (batch, vocab) and (batch, seq, vocab) alike (a negative dim "
                 "counts from the end); every softmax, sort, cumsum, topk and scatter of it takes dim=-1.",
                 axes=axes, asked=asked)
    return t(" Your code asks a tensor with {axes} axes for dim={asked}: filter_logits works along the last axis, "
             "vocab, which is dim=-1 for (vocab,), (batch, vocab) and (batch, seq, vocab) alike (a negative dim "
             "counts from the end); every softmax, sort, cumsum, topk and scatter of it takes dim=-1.",
             axes=axes, asked=asked)


def _filtered(fn: Callable[..., Any], logits: Tensor, what: str, **options: Any) -> Tensor:
    try:
        got = call(fn, logits.clone(), **options)
    except CheckFailure as failure:
        hint = ""
        if options.get("top_k") is not None and options["top_k"] > logits.shape[-1] and raised_error(failure):
            hint = t(" A top_k larger than vocab={vocab} keeps every token: torch.topk needs k <= vocab, so take "
                     "min(top_k, vocab).", vocab=logits.shape[-1])
        hint = hint or _none_hint(fn, logits, failure) or _dim_hint(failure)
        text = str(failure).rstrip()
        if hint and not text.endswith(tuple(_stops())):
            raise CheckFailure(t("For {what}: {failure}.{hint}", what=what, failure=text, hint=hint)) from failure
        raise CheckFailure(t("For {what}: {failure}{hint}", what=what, failure=text, hint=hint)) from failure
    return expect_tensor(got, t("filter_logits on {what}", what=what), tuple(logits.shape), _axes(logits),
                         logits.dtype)


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or t("no top_k and no top_p")


def _with(what: str, options: dict[str, Any]) -> str:
    """``what`` with the filter's options: "one row (vocab,) with top_k=2, top_p=0.5"."""
    return t("{what} with {options}", what=what, options=_options(options))


def _expect_unchanged_input(fn: Callable[..., Any], logits: Tensor, **options: Any) -> None:
    _filtered(fn, logits, _with(t("a batch (batch, vocab)"), options), **options)  # first: its errors named
    if call(_changes_its_input, fn, logits, **options):
        raise CheckFailure(t("filter_logits changed the logits it was given (masked_fill_ or an assignment into "
                             "logits[...]): return a new tensor (masked_fill without the underscore), the caller may "
                             "still need its logits."))


def _fill_problem(got: Tensor, logits: Tensor) -> str | None:
    """What is wrong with the values themselves: NaN, probabilities, a finite fill, kept logits changed or moved."""
    if torch.isnan(got).any():
        return t("Your result contains NaN: every row keeps at least its most likely token, and the others become "
                 "-inf (never NaN).")
    changed = (got != logits) & torch.isfinite(got)
    if not changed.any():
        return None
    if torch.isfinite(got).all() and bool(((got >= 0) & (got <= 1)).all()) and close(
            got.sum(dim=-1), torch.ones_like(got.sum(dim=-1)), got.dtype, 1e-4):
        return t("You return probabilities; filter_logits returns logits: the kept tokens' logits unchanged and -inf "
                 "for the others (sampling takes the softmax afterwards).")
    values = got[changed]
    if bool((values == values[0]).all()):
        return t("The tokens you drop get {value:.4g}; they must become -inf (-math.inf), as the docstring says: a "
                 "finite number leaves them a probability, however small, and is not the same in every dtype.",
                 value=values[0].item())
    return t("The logits you keep changed: return the input itself with -inf where a token is dropped, in the input's "
             "order (a mask found in sorted order must be put back at the tokens' places, e.g. with scatter and the "
             "sort's indices).")


def _kept_by_top_k(logits: Tensor, top_k: int) -> Tensor:
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits >= kth


def _diagnose_top_k(got: Tensor, logits: Tensor, top_k: int) -> str:
    problem = _fill_problem(got, logits)
    if problem:
        return problem
    kept = torch.isfinite(got)
    expected = _kept_by_top_k(logits, top_k)
    counts = kept.sum(-1)
    if torch.equal(kept & expected, kept) and bool((counts == min(top_k, logits.shape[-1])).all()):
        return t("You keep exactly top_k={top_k} tokens per row and drop some whose logit ties with the k-th largest: "
                 "all the tokens whose logit equals the k-th largest stay (compare with the k-th largest value, "
                 "torch.topk(...).values[..., -1:], rather than keeping topk's indices).", top_k=top_k)
    if bool((counts == (expected.sum(-1) - 1)).all()):
        return t("You keep one token too few: the k-th largest logit itself stays (logits < kth are dropped).")
    if bool((counts == (expected.sum(-1) + 1)).all()):
        return t("You keep one token too many: keep the k largest logits, those >= the k-th largest.")
    return t("Keep, in each row (the last axis, vocab), the tokens whose logit is at least the k-th largest of that "
             "row (torch.topk(logits, k, dim=-1).values[..., -1:]); the others become -inf.")


@check
def check_top_k(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """top_k keeps the k largest logits of each row (ties at the k-th all kept), the others -inf; None keeps all."""
    s = _vocab_sizes(seed)
    cases = _logit_cases(seed, dtype) + _logit_cases(seed + 1, dtype, ties=True)
    _expect_unchanged_input(fn, cases[1][1], top_k=3)
    for what, logits in cases:
        for options in ({}, {"top_k": None, "top_p": None}):
            got = _filtered(fn, logits, what, **options)
            if not torch.equal(got, logits):
                raise CheckFailure(t("filter_logits({options}) on {what} should return the logits unchanged; it does "
                                     "not ({difference}). With top_k=None and top_p=None nothing is filtered.",
                                     options=_options(options), what=what, difference=difference(got, logits)))
        for top_k in (1, 2, 4, s["vocab"], s["vocab"] + 3):
            got = _filtered(fn, logits, _with(what, {"top_k": top_k}), top_k=top_k)
            expected = logits.masked_fill(~_kept_by_top_k(logits, top_k), NEG_INF)
            if not torch.equal(got, expected):
                shown = t(" Logits {logits}, expected {expected}, got {got}.", logits=show(logits),
                          expected=show(expected), got=show(got)) if logits.numel() <= 12 else ""
                raise CheckFailure(t("filter_logits(top_k={top_k}) on {what} differs from keeping the logits >= the "
                                     "k-th largest of each row ({difference}).{shown} {diagnosis}", top_k=top_k,
                                     what=what, difference=difference(got, expected, s), shown=shown,
                                     diagnosis=_diagnose_top_k(got, logits, top_k)))
    error = call(_error_of, fn, cases[1][1], top_k=0)
    if error is None:
        raise CheckFailure(t("filter_logits(logits, top_k=0) should raise a ValueError (a top_k below 1 would keep "
                             "nothing); it raised no error."))
    if error != "ValueError":
        raise CheckFailure(t("filter_logits(logits, top_k=0) should raise a ValueError (a top_k below 1 would keep "
                             "nothing); it raised a {error}.", error=error))
    passed(t("top_k keeps the k largest logits of each row, ties at the k-th included, for (vocab,), (batch, vocab) "
             "and (batch, seq, vocab); k >= vocab keeps all; None filters nothing; the input is left as it was; "
             "ValueError for top_k=0 ({dtype})", dtype=dtype_name(dtype)))


def _nucleus_problem(got: Tensor, logits: Tensor, top_p: float, tolerance: float,
                     allowed: Tensor | None = None) -> str | None:
    """Why ``got`` is not a nucleus of softmax(logits) for ``top_p`` (None if it is): the defining properties, row by
    row, so that any choice among tied tokens passes. ``allowed``: the tokens top_k left (the nucleus is then taken
    of their renormalised probabilities)."""
    kept = torch.isfinite(got)
    if allowed is not None and (kept & ~allowed).any():
        return t("You keep tokens that top_k drops: with both, keep only the top-k tokens, then take the nucleus of "
                 "those.")
    source = logits if allowed is None else logits.masked_fill(~allowed, NEG_INF)
    probs = torch.softmax(source.double(), dim=-1)
    variant = _nucleus_variant(kept, source, top_p)
    if variant:
        return variant
    if not kept.any(dim=-1).all():
        return t("A row keeps no token at all: the most likely token always stays (the tokens before it sum to 0, "
                 "less than p).")
    mass = (probs * kept).sum(dim=-1)
    least_kept = probs.masked_fill(~kept, math.inf).amin(dim=-1)
    most_dropped = probs.masked_fill(kept | (probs == 0), -math.inf).amax(dim=-1)
    if (most_dropped > least_kept + tolerance).any():
        return t("You keep a less likely token and drop a more likely one: the nucleus is made of the MOST likely "
                 "tokens. Sort the probabilities in descending order, decide in that order, then put each decision "
                 "back at its token's place (scatter with the sort's indices).")
    if (mass < top_p - tolerance).any():
        short = mass.min().item()
        return t("The tokens you keep have probability {mass:.4g} in all, less than top_p={top_p}: keep the token "
                 "that makes the mass reach p too. A token stays when the tokens sorted before it sum to less than p "
                 "(cumsum(probs) - probs < p), which always keeps the most likely one.", mass=short, top_p=top_p)
    if (mass - least_kept >= top_p + tolerance).any():
        return t("You keep more than the smallest set: without its least likely token, your kept set still has "
                 "probability >= top_p={top_p}. A token stays only while the tokens sorted before it sum to less "
                 "than p.", top_p=top_p)
    return None


def _ascending_rule(source: Tensor, top_p: float, forced: int = -1, keep_forced: bool = True) -> Tensor:
    """The kept tokens by the docstring's rule, in float64: least likely first, a token is dropped while the running
    sum (its own probability included) is at most 1 - p, and the decision at ascending position ``forced`` is set to
    keep (the most likely token, by default) or, with ``keep_forced=False``, to drop: the usual slips in that line."""
    probs, order = torch.sort(torch.softmax(source.double(), dim=-1), dim=-1)
    drop = torch.cumsum(probs, dim=-1) <= 1.0 - top_p
    drop[..., forced] = not keep_forced
    return ~torch.zeros_like(drop).scatter(-1, order, drop) & (source > NEG_INF)


def _rank(j: int) -> str:
    """The token at position ``j`` of an ascending sort, by its likelihood: "least likely", "second least likely"."""
    if j == 0:
        return t("least likely")
    if j == 1:
        return t("second least likely")
    if j == 2:
        return t("third least likely")
    return t("{n}th least likely", n=j + 1)


def _nucleus_variant(kept: Tensor, source: Tensor, top_p: float) -> str | None:
    """The one usual slip whose kept tokens are exactly ``kept`` (rebuilt on these logits), where the right rule keeps
    others; None if no slip, or more than one, gives them."""
    correct = _ascending_rule(source, top_p)
    if torch.equal(kept, correct):
        return None
    vocab = source.shape[-1]
    found = []
    if torch.equal(kept, source > NEG_INF):
        found.append(t("You drop no token at all with top_p={top_p}, where the nucleus is smaller: none of your "
                       "decisions drops. Least likely first, a token is dropped while the running sum of the "
                       "probabilities (cumsum, its own included) is at most 1 − top_p.", top_p=top_p))
    probs = torch.sort(torch.softmax(source.double(), dim=-1), dim=-1).values
    if ((probs[..., 1:] == probs[..., :-1]) & (probs[..., 1:] > 0)).any():
        # Tied tokens: which of them a sort puts first is arbitrary, so a slip at one position cannot be told from a
        # slip in the comparison (eight equal tokens, one more kept: either one).
        return found[0] if len(found) == 1 else None
    if torch.equal(kept, _ascending_rule(source, top_p, -1, keep_forced=False)):
        found.append(t("You drop the most likely token of each row, and keep the rest of the nucleus: that token "
                       "always stays, so its decision is forced to keep (not dropped), never to drop."))
    for j in range(vocab - 1):
        if torch.equal(kept, _ascending_rule(source, top_p, j)):
            found.append(t("Besides the nucleus you keep, in every row, the {rank} token, position {position} of an "
                           "ascending sort, whose decision you force to keep: the token forced to stay is the most "
                           "likely one, the last position of an ascending sort, index -1 (a negative index counts from "
                           "the end), not position {position}.", rank=_rank(j), position=j))
    return found[0] if len(found) == 1 else None


def _check_nucleus(fn: Callable[..., Any], logits: Tensor, what: str, top_p: float, top_k: int | None = None) -> None:
    options = {"top_p": top_p} if top_k is None else {"top_k": top_k, "top_p": top_p}
    got = _filtered(fn, logits, _with(what, options), **options)
    allowed = None if top_k is None else _kept_by_top_k(logits, top_k)
    problem = _fill_problem(got, logits) or _nucleus_problem(got, logits, top_p, FILTER_TOLERANCE[logits.dtype],
                                                             allowed)
    if problem is None:
        return
    if allowed is not None and torch.equal(torch.isfinite(got), allowed & _nucleus_mask(logits, top_p)):
        problem = t("You took the nucleus of the whole distribution (and kept its top-k tokens): filter_logits "
                    "applies top_k first, then takes the nucleus of what is left, its probabilities renormalised over "
                    "the k survivors (the softmax of the top-k-filtered logits), as Hugging Face's samplers do.")
    elif allowed is not None:
        alone = _filtered(fn, logits, _with(what, {"top_k": top_k}), top_k=top_k)
        if not torch.equal(alone, logits.masked_fill(~allowed, NEG_INF)):
            problem = t("Your top_k alone is already wrong on these logits, and with both top_k comes first: "
                        "{diagnosis}", diagnosis=_diagnose_top_k(alone, logits, top_k))
    shown = t(" Logits {logits}, got {got}.", logits=show(logits), got=show(got)) if logits.numel() <= 12 else ""
    raise CheckFailure(t("filter_logits({options}) on {what} does not keep the nucleus: the smallest set of most "
                         "likely tokens whose probabilities sum to at least p.{shown} {problem}",
                         options=_options(options), what=what, shown=shown, problem=problem))


def _nucleus_mask(logits: Tensor, top_p: float) -> Tensor:
    """The nucleus of softmax(logits) by the rule (for diagnosis only): in descending order, a token stays while the
    tokens before it sum to less than p."""
    probs, order = torch.sort(torch.softmax(logits.double(), dim=-1), dim=-1, descending=True)
    keep = (torch.cumsum(probs, dim=-1) - probs) < top_p
    return torch.zeros_like(keep).scatter(-1, order, keep)


@check
def check_top_p(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """top_p keeps the smallest set of most likely tokens whose probabilities reach p (ties, p = 1.0, batched axes)."""
    cases = _logit_cases(seed + 2, dtype) + _logit_cases(seed + 3, dtype, ties=True)
    _expect_unchanged_input(fn, cases[1][1], top_p=0.5)
    g = torch.Generator().manual_seed(seed + 41)
    for what, logits in cases:
        for top_p in (0.2, 0.5, 0.9, round(0.3 + 0.6 * float(torch.rand(1, generator=g)), 3)):
            _check_nucleus(fn, logits, what, top_p)
        got = _filtered(fn, logits, _with(what, {"top_p": 1.0}), top_p=1.0)
        if not torch.equal(got, logits):
            raise CheckFailure(t("filter_logits(top_p=1.0) on {what} should keep every token (all of them are needed "
                                 "to reach a mass of 1); it drops {dropped} ({difference}). Drop a token only when the "
                                 "tokens sorted before it already sum to at least p (cumsum(probs) - probs >= p); a "
                                 "rule on the sum that includes the token itself (cumsum > p) is thrown off by "
                                 "rounding at p = 1.", what=what, dropped=int((got != logits).sum()),
                                 difference=difference(got, logits)))
    # A near-certain token: the nucleus of p = 0.5 is that token alone.
    logits = torch.tensor([0.0, 5.0, 1.0, -1.0, 2.0], dtype=dtype)
    _check_nucleus(fn, logits, t("a row whose most likely token has probability 0.93"), 0.5)
    _check_exact_nucleus(fn, dtype)
    for top_p in (0.0, 1.5):
        error = call(_error_of, fn, cases[1][1], top_p=top_p)
        if error is None:
            raise CheckFailure(t("filter_logits(logits, top_p={top_p}) should raise a ValueError (p lies in (0, 1]); "
                                 "it raised no error.", top_p=top_p))
        if error != "ValueError":
            raise CheckFailure(t("filter_logits(logits, top_p={top_p}) should raise a ValueError (p lies in (0, 1]); "
                                 "it raised a {error}.", top_p=top_p, error=error))
    passed(t("top_p keeps the smallest set of most likely tokens whose probabilities reach p, in the input's order, "
             "for (vocab,), (batch, vocab) and (batch, seq, vocab), ties included; p = 1.0 keeps all; ValueError "
             "outside (0, 1] ({dtype})", dtype=dtype_name(dtype)))


def _check_exact_nucleus(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    """Eight equally likely tokens: every probability (1/8) and every sum of them is exact in float32, so a set whose
    mass is exactly p can be asked for. 'At least p' includes equality: the nucleus of p = k/8 holds k tokens (any k of
    them: they tie)."""
    logits = torch.full((8,), 0.5, dtype=dtype)
    for top_p in (0.25, 0.5, 0.75):
        what = t("a row of 8 equally likely tokens (probability 0.125 each, exact in any dtype)")
        _check_nucleus(fn, logits, what, top_p)
        count = int(torch.isfinite(_filtered(fn, logits, _with(what, {"top_p": top_p}), top_p=top_p)).sum())
        expected = round(8 * top_p)
        if count == expected:
            continue
        hint = ""
        if count == expected + 1:
            # Every nucleus check above passed, and these decisions differ from the right ones only where a sum equals
            # p (or 1 - p) exactly: the comparison that decides it treats equality the other way.
            hint = t(" Your set without its last token has mass {mass} = top_p exactly, which already reaches p: 'at "
                     "least p' includes equality. Where your rule compares a sum with p (or with 1 − p), equality goes "
                     "the other way: a token stays only while the tokens before it sum to strictly less than p; least "
                     "likely first, it is dropped while the running sum is at most 1 − p (<=, not <).",
                     mass=expected / 8)
        raise CheckFailure(t("filter_logits(top_p={top_p}) on {what} keeps {count} tokens; the smallest set whose "
                             "probabilities sum to at least p holds {expected} (mass {mass}).{hint}", top_p=top_p,
                             what=what, count=count, expected=expected, mass=expected / 8, hint=hint))


def _renormalising_row(dtype: torch.dtype, seed: int) -> Tensor:
    """Probabilities 0.4, 0.3, 0.2, 0.1 and small ones, in a seeded order: with top_k=2 and top_p=0.5 the nucleus of
    the two survivors (0.57, 0.43) is one token, the whole distribution's nucleus two."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02], dtype=torch.float64)
    order = torch.randperm(len(probs), generator=torch.Generator().manual_seed(seed + 43))
    return probs.log()[order].to(dtype)


@check
def check_top_k_and_top_p(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """top_k then top_p: the nucleus of the k survivors' renormalised probabilities."""
    s = _vocab_sizes(seed)
    _check_nucleus(fn, _renormalising_row(dtype, seed), t("a row with probabilities 0.4, 0.3, 0.2, ..."), 0.5,
                   top_k=2)
    g = torch.Generator().manual_seed(seed + 47)
    for what, logits in _logit_cases(seed + 4, dtype) + _logit_cases(seed + 5, dtype, ties=True):
        for top_k, top_p in ((2, 0.5), (4, 0.6), (3, 0.9), (s["vocab"], 0.7),
                             (int(torch.randint(2, s["vocab"], (1,), generator=g)), 0.8)):
            _check_nucleus(fn, logits, what, top_p, top_k=top_k)
        got = _filtered(fn, logits, _with(what, {"top_k": 3, "top_p": 1.0}), top_k=3, top_p=1.0)
        expected = logits.masked_fill(~_kept_by_top_k(logits, 3), NEG_INF)
        if not torch.equal(got, expected):
            raise CheckFailure(t("filter_logits(top_k=3, top_p=1.0) on {what} should keep what top_k=3 keeps "
                                 "({difference}): the nucleus of p = 1.0 is every token that top_k left, so p = 1.0 "
                                 "drops nothing more.", what=what, difference=difference(got, expected, s)))
    passed(t("top_k and top_p together keep the nucleus of the top-k tokens' renormalised probabilities, for (vocab,), "
             "(batch, vocab) and (batch, seq, vocab), ties included ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 3: LoRA ---------------------------------------------------------------------------------

LORA_AXES = ("batch", "seq", "d_in", "d_out", "r")


def _lora_sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, the rank r below both widths."""
    if seed == 0:
        return dict(zip(LORA_AXES, (2, 3, 7, 5, 4), strict=True))
    g = torch.Generator().manual_seed(seed + 53)
    drawn = draw_sizes(g, ("batch", "seq", "r"), span=4) | draw_sizes(g, ("d_in", "d_out"), span=6, first=6)
    return {axis: drawn[axis] for axis in LORA_AXES}


class _Weights(NamedTuple):
    """The base layer's weights as the check made them: the student's code holds the layer itself (and may change
    it), so the oracle reads this copy, in the student's kernel and in the grader's replay alike."""

    weight: Tensor
    bias: Tensor | None


def _base(s: dict[str, int], dtype: torch.dtype, seed: int, bias: bool = True) -> tuple[nn.Linear, _Weights]:
    """A "pretrained" layer with seeded weights (PyTorch's initialisation would move the student's random numbers),
    and a copy of its weights."""
    with torch.random.fork_rng(devices=[]):
        base = nn.Linear(s["d_in"], s["d_out"], bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 59)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=g, dtype=dtype) / math.sqrt(s["d_in"]))
        if bias:
            base.bias.copy_(0.5 * torch.randn(base.bias.shape, generator=g, dtype=dtype))
    return base, _Weights(base.weight.detach().clone(), base.bias.detach().clone() if bias else None)


def _parameter_table(module: nn.Module) -> dict[str, list[Any]]:
    """name -> [shape, trains, dtype] of every parameter."""
    return {name: [list(p.shape), bool(p.requires_grad), dtype_name(p.dtype)] for name, p in module.named_parameters()}


def _expect_lora_parameters(layer: Any, s: dict[str, int], r: int, bias: bool, dtype: torch.dtype,
                            trainable: bool = True) -> None:
    """Names, shapes and dtypes of the parameters; with ``trainable``, which of them train (exercise 3's first check
    grades that; the others load weights by name and need the rest only)."""
    table = call(_parameter_table, layer)
    if type(table) is not dict:
        raise CheckFailure(t("LoRALinear(...) should build an nn.Module, got {kind}.", kind=kind(layer)))
    d_in, d_out = s["d_in"], s["d_out"]
    expected = {"base.weight": [[d_out, d_in], False], "lora_a.weight": [[r, d_in], True],
                "lora_b.weight": [[d_out, r], True]}
    if bias:
        expected["base.bias"] = [[d_out], False]
    missing, extra = sorted(set(expected) - set(table)), sorted(set(table) - set(expected))
    if any(name.startswith("lora") and name.endswith(".bias") for name in extra):
        raise CheckFailure(t("Your low-rank maps have biases ({names}): B·A is a matrix, with no shift; build them "
                             "with bias=False.", names=", ".join(extra)))
    if missing or extra:
        raise CheckFailure(t(
            "Your layer's parameters are {found}; they should be {expected}: keep the given layer as self.base, and "
            "name the two low-rank maps lora_a (in_features -> r) and lora_b (r -> out_features), nn.Linear without "
            "bias (the checks copy weights in by name).", found=sorted(table), expected=sorted(expected)))
    for name in ("base.weight", "base.bias", "lora_a.weight", "lora_b.weight"):
        if name not in expected:
            continue
        shape, trains, found_dtype = table[name]
        if shape != expected[name][0]:
            raise CheckFailure(t(
                "{name} has shape {shape}; with in_features={d_in}, out_features={d_out} and r={r} it should be "
                "{expected}. nn.Linear(in, out) stores its weight as (out, in): lora_a = nn.Linear(in_features, r, "
                "bias=False), lora_b = nn.Linear(r, out_features, bias=False).", name=name, shape=tuple(shape),
                d_in=d_in, d_out=d_out, r=r, expected=tuple(expected[name][0])))
        if trainable and trains != expected[name][1]:
            raise CheckFailure(
                t("{name} trains: freeze the base layer, self.base.requires_grad_(False), so that only lora_a and "
                  "lora_b learn.", name=name) if trains else
                t("{name} does not train (requires_grad is False): only the base is frozen; lora_a and lora_b learn.",
                  name=name)
            )
        if found_dtype != dtype_name(dtype):
            raise CheckFailure(t("{name} is {found} although the base layer is {dtype}: create lora_a and lora_b with "
                                 "the base's dtype and device, nn.Linear(..., dtype=base.weight.dtype, "
                                 "device=base.weight.device).", name=name, found=found_dtype, dtype=dtype_name(dtype)))


def _lora_state(s: dict[str, int], r: int, dtype: torch.dtype, seed: int) -> dict[str, Tensor]:
    """Seeded A and B as after some training (B no longer zero)."""
    g = torch.Generator().manual_seed(seed + 61)
    return {"lora_a.weight": torch.randn(r, s["d_in"], generator=g, dtype=dtype) / math.sqrt(s["d_in"]),
            "lora_b.weight": torch.randn(s["d_out"], r, generator=g, dtype=dtype) / math.sqrt(r)}


def _lora_inputs(s: dict[str, int], dtype: torch.dtype, seed: int) -> list[tuple[str, Tensor]]:
    g = torch.Generator().manual_seed(seed + 67)
    return [(t("x of shape (batch, seq, in_features)"), torch.randn(s["batch"], s["seq"], s["d_in"], generator=g,
                                                                      dtype=dtype)),
            (t("x of shape (batch, in_features)"), torch.randn(s["batch"], s["d_in"], generator=g, dtype=dtype))]


def _lora_reference(base: _Weights, state: dict[str, Tensor], alpha: float, r: int, x: Tensor, *,
                    scaling: float | None = None, drop: Callable[[Tensor], Tensor] | None = None,
                    drop_at: str = "input") -> Tensor:
    """base(x) + (alpha / r) · B(A(dropout(x))) with F.linear; ``scaling`` and ``drop_at`` build the usual mistakes."""
    def dropped(t: Tensor, where: str) -> Tensor:
        return drop(t) if drop is not None and where in drop_at.split() else t

    scaling = alpha / r if scaling is None else scaling
    with torch.no_grad():
        frozen = F.linear(dropped(x, "base"), base.weight, base.bias)
        update = F.linear(F.linear(dropped(x, "input"), state["lora_a.weight"]), state["lora_b.weight"])
        return dropped(frozen + scaling * dropped(update, "update"), "output")


def _scaling_hint(got: Tensor, base: _Weights, state: dict[str, Tensor], alpha: float, r: int, x: Tensor) -> str:
    for scaling, hint in ((alpha, marked("You scale the update by alpha; LoRA scales it by alpha / r, so that "
                                         "changing r does not change the update's size.")),
                          (r / alpha, marked("You scale the update by r / alpha; LoRA scales it by alpha / r.")),
                          (1.0, marked("You left out the scaling: multiply B(A(x)) by alpha / r (self.scaling).")),
                          (alpha * r, marked("You scale the update by alpha · r; LoRA scales it by alpha / r.")),
                          (0.0, marked("Your output is base(x) alone: the update (alpha / r) · lora_b(lora_a(x)) does "
                                       "not reach it. Look at whether forward adds it, and at the dropout on its input "
                                       "(nn.Dropout(dropout): with dropout=0 it keeps everything)."))):
        if close(got, _lora_reference(base, state, alpha, r, x, scaling=scaling), got.dtype):
            return tr(hint)
    return t("Compute base(x) + (alpha / r) * lora_b(lora_a(dropout(x))), the dropout on the update's input only.")


def _build_lora(cls: Any, s: dict[str, int], r: int, alpha: float, dtype: torch.dtype, seed: int, bias: bool = True,
                dropout: float | None = None) -> tuple[Any, _Weights, dict[str, Tensor]]:
    base, weights = _base(s, dtype, seed, bias)
    layer = call(cls, base, r, alpha) if dropout is None else call(cls, base, r, alpha, dropout)
    _expect_lora_parameters(layer, s, r, bias, dtype, trainable=False)
    state = _lora_state(s, r, dtype, seed)
    call(_load, layer, state)
    return layer, weights, state


def _gradients(module: nn.Module, x: Tensor, weights: Tensor) -> dict[str, Tensor | None]:
    """Each parameter's gradient of sum(weights * module(x)), or None where none arrives."""
    for p in module.parameters():
        p.grad = None
    with torch.enable_grad():
        y = module(x)
        if not y.requires_grad:  # nothing trainable reached the output: no parameter gets a gradient
            return {name: None for name, _ in module.named_parameters()}
        (y * weights).sum().backward()
    grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    return grads


def _lora_weights(module: nn.Module) -> dict[str, Tensor]:
    params = dict(module.named_parameters())
    return {name: params[name].detach().clone() for name in ("lora_a.weight", "lora_b.weight") if name in params}


def _expect_linear_draw(cls: Callable[..., Any], seed: int) -> None:
    """lora_a drawn as nn.Linear draws a weight: uniform on ±1/sqrt(in_features) (kaiming_uniform_ with a=sqrt(5)).
    Of 1,024 draws a right one has all inside the bound and, but with probability 0.97^1024 (3e-14), one beyond 0.97
    of it (kaiming_uniform_ with a=sqrt(6) reaches 0.926 of it); a uniform draw on ±B shows B as its largest value (to
    0.3 %) and half of its values inside B / 2."""
    s = {"d_in": 64, "d_out": 40}
    r, bound = 16, 1 / math.sqrt(64)
    base, _ = _base(s, torch.float64, seed + 83)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 89)
        layer = call(cls, base, r, 1.0)
    a = call(_lora_weights, layer).get("lora_a.weight")
    if type(a) is not Tensor or tuple(a.shape) != (r, s["d_in"]):
        return  # the shapes are graded above
    largest = a.abs().max().item()
    if bound * 0.97 <= largest <= bound * (1 + 1e-6):
        return
    what = t("lora_a of LoRALinear(nn.Linear({d_in}, {d_out}), r={r}): its {count} values reach {largest:.3g}, where "
             "nn.Linear draws uniformly on ±1/sqrt(in_features) = ±{bound:.4g}", d_in=s["d_in"], d_out=s["d_out"], r=r,
             count=a.numel(), largest=largest, bound=bound)
    inside_half = (a.abs() < largest / 2).double().mean().item()
    if abs(inside_half - 0.5) < 0.07 and largest > 0:  # uniform on ±largest: it is kaiming_uniform_ with some a
        a_squared = 6 / (largest ** 2 * s["d_in"]) - 1
        if a_squared > -0.05:
            hint = t("Your values are spread uniformly over ±{largest:.3g}: that is nn.init.kaiming_uniform_ with "
                     "a ≈ {a:.2g}, whose range is ±sqrt(6 / ((1 + a²) · in_features)); nn.Linear uses a=math.sqrt(5), "
                     "which gives ±1/sqrt(in_features). Leave lora_a as nn.Linear draws it (or pass a=math.sqrt(5)).",
                     largest=largest, a=math.sqrt(max(a_squared, 0.0)))
        else:
            hint = t("Your values are spread uniformly over ±{largest:.3g}: that is nn.init.kaiming_uniform_, whose "
                     "range is ±sqrt(6 / ((1 + a²) · in_features)); nn.Linear uses a=math.sqrt(5), which gives "
                     "±1/sqrt(in_features). Leave lora_a as nn.Linear draws it (or pass a=math.sqrt(5)).",
                     largest=largest)
    else:
        hint = t("Leave lora_a as nn.Linear(in_features, r, bias=False) draws it: the update's size at the start of "
                 "training depends on it (nn.init.kaiming_uniform_ with a=math.sqrt(5)).")
    raise CheckFailure(t("{what}. {hint}", what=what, hint=hint))


@check
def check_lora_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """Frozen base, lora_a (r, in) drawn and lora_b (out, r) zero: the layer starts equal to its base and trains
    r · (in + out) numbers."""
    s = _lora_sizes(seed)
    x = _lora_inputs(s, torch.float32, seed)[0][1]
    for r, alpha, bias, dtype in ((1, 1.0, True, torch.float32), (s["r"], 8.0, False, torch.float32),
                                  (s["r"] + 1, 3.0, True, torch.float64)):
        base, weights = _base(s, dtype, seed + r, bias)
        try:
            layer = call(cls, base, r, alpha)
        except CheckFailure as failure:
            hint = ""
            zero = call(_error_of, cls, _base(s, dtype, seed, bias)[0], 0, alpha) if _raised_about(
                failure, "ValueError") else "ValueError"
            if zero is None:
                hint = t(" LoRALinear(base, r=0, alpha={alpha}) on the other hand raises no error: your test of r is "
                         "inverted. r = 0 (no update at all) is the one to refuse: if r < 1: raise ValueError(...).",
                         alpha=alpha)
            elif zero != "ValueError":
                hint = t(" LoRALinear(base, r=0, alpha={alpha}) on the other hand raises a {error}, not your "
                         "ValueError: your test of r is inverted. r = 0 (no update at all) is the one to refuse: if "
                         "r < 1: raise ValueError(...).", alpha=alpha, error=zero)
            raise CheckFailure(t("LoRALinear(base, r={r}, alpha={alpha}) should build a layer (a rank of 1 or more is "
                                 "valid): {failure}.{hint}", r=r, alpha=alpha,
                                 failure=str(failure).rstrip(_stops()), hint=hint)) from failure
        _expect_lora_parameters(layer, s, r, bias, dtype)
        low_rank = call(_lora_weights, layer)
        a, b = low_rank["lora_a.weight"], low_rank["lora_b.weight"]
        if not torch.equal(b, torch.zeros_like(b)):
            raise CheckFailure(t("lora_b should start at zero (nn.init.zeros_), so that B·A = 0 and the layer starts "
                                 "equal to its base: fine-tuning begins from the pretrained model, not from a "
                                 "randomly shifted one."))
        if torch.equal(a, torch.zeros_like(a)):
            raise CheckFailure(t("lora_a and lora_b both start at zero: then neither ever gets a gradient (each one's "
                                 "gradient goes through the other) and the adapter never learns. Keep lora_a as "
                                 "nn.Linear(in_features, r) draws it; only lora_b starts at zero."))
        xs = x.to(dtype)
        got = expect_tensor(call(layer, xs), t("the output of a new LoRALinear(r={r}, alpha={alpha})", r=r,
                                               alpha=alpha), tuple(xs.shape[:-1]) + (s["d_out"],), "batch seq d_out",
                            dtype)
        expected = F.linear(xs, weights.weight, weights.bias)
        if not close(got, expected, dtype):
            raise CheckFailure(t("A new LoRALinear(r={r}, alpha={alpha}) should compute exactly what its base layer "
                                 "computes (lora_b is zero) ({difference}). Return base(x) + (alpha / r) * "
                                 "lora_b(lora_a(dropout(x))).", r=r, alpha=alpha,
                                 difference=difference(got, expected, s)))
        weights_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed + 71), dtype=dtype)
        grads = call(_gradients, layer, xs, weights_out)
        for name in ("base.weight", "base.bias"):
            if grads.get(name) is not None and grads[name].abs().sum() > 0:
                raise CheckFailure(t("{name} received a gradient: freeze the base, self.base.requires_grad_(False).",
                                     name=name))
        if grads.get("lora_b.weight") is None or not grads["lora_b.weight"].abs().sum() > 0:
            # lora_b is zero at first, so the output cannot show whether the update is there: give it weights.
            state = _lora_state(s, r, dtype, seed)
            call(_load, layer, state)
            with_update = expect_tensor(call(layer, xs), t("the output of LoRALinear(r={r}, alpha={alpha})", r=r,
                                                           alpha=alpha), tuple(xs.shape[:-1]) + (s["d_out"],),
                                        "batch seq d_out", dtype)
            alone = ""
            if close(with_update, expected, dtype) and not close(
                    _lora_reference(weights, state, alpha, r, xs), expected, dtype):
                alone = t(" With lora_a and lora_b given nonzero weights your layer still computes base(x) alone: "
                          "your forward leaves out the update (alpha / r) · lora_b(lora_a(dropout(x))).")
            raise CheckFailure(t("lora_b received no gradient from a backward pass through the layer.{alone} Use "
                                 "lora_a and lora_b in forward (base(x) + (alpha / r) * lora_b(lora_a(dropout(x)))), "
                                 "and leave them trainable.", alone=alone))
    _expect_linear_draw(cls, seed)
    passed(t("LoRALinear freezes its base, adds lora_a (r, in_features) drawn at random and lora_b (out_features, r) "
             "at zero: it starts equal to its base, trains r · (in + out) numbers and gets gradients in lora_b, for "
             "r = 1 and more, with and without a bias, float32 and float64"))


@check
def check_lora_forward(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """base(x) + (alpha / r) · B(A(dropout(x))) for several r and alpha; dropout on the update's input, only in
    training."""
    s = _lora_sizes(seed)
    inputs = _lora_inputs(s, dtype, seed)
    for i, (r, alpha, bias) in enumerate(((1, 1.0, True), (s["r"], 16.0, True), (s["r"] + 1, 3.0, False))):
        layer, base, state = _build_lora(cls, s, r, alpha, dtype, seed + i, bias)
        for training in (False, True):  # no dropout: the same in both modes
            call(_set_training, layer, training)
            for on, x in inputs:
                mode = "train()" if training else "eval()"
                what = t("LoRALinear(r={r}, alpha={alpha}) in {mode} on {x}", r=r, alpha=alpha, mode=mode, x=on) \
                    if bias else t("LoRALinear(r={r}, alpha={alpha}, a base without bias) in {mode} on {x}", r=r,
                                   alpha=alpha, mode=mode, x=on)
                got = expect_tensor(call(layer, x), t("the output of {what}", what=what),
                                    tuple(x.shape[:-1]) + (s["d_out"],),
                                    "batch seq d_out" if x.dim() == 3 else "batch d_out", dtype)
                expected = _lora_reference(base, state, alpha, r, x)
                if not close(got, expected, dtype):
                    raise CheckFailure(t("For {what}, your output differs from base(x) + (alpha / r) · B(A(x)) with "
                                         "the same weights ({difference}). {hint}", what=what,
                                         difference=difference(got, expected, {**s, "r": r}),
                                         hint=_scaling_hint(got, base, state, alpha, r, x)))
    # Dropout 0.5: nothing in eval(); in train() a stand-in with a fixed mask shows where it acts.
    r, alpha = s["r"], 6.0
    layer, base, state = _build_lora(cls, s, r, alpha, dtype, seed + 5, dropout=0.5)
    what, x = inputs[0]
    got = call(layer, x)
    expected = _lora_reference(base, state, alpha, r, x)
    if not close(got, expected, dtype):
        raise CheckFailure(t("LoRALinear(r={r}, alpha={alpha}, dropout=0.5) in eval() mode should not drop anything "
                             "({difference}): use nn.Dropout(dropout), which knows train() and eval(), stored as "
                             "self.dropout.", r=r, alpha=alpha, difference=difference(got, expected, s)))
    drop = _FixedDropout(0.5, seed)
    call(_set_attribute, layer, "dropout", drop)
    call(_set_training, layer, True)
    got = expect_tensor(call(layer, x), t("the output in train()"), tuple(x.shape[:-1]) + (s["d_out"],),
                        "batch seq d_out", dtype)
    expected = _lora_reference(base, state, alpha, r, x, drop=drop)
    if not close(got, expected, dtype):
        if not torch.equal(got, call(layer, x)):  # the stand-in is deterministic: the randomness is elsewhere
            hint = t("Two calls on the same input differ: your layer drops with a dropout of its own (F.dropout?) "
                     "instead of self.dropout. Keep nn.Dropout(dropout) as self.dropout and apply it.")
        else:
            variants = {
                marked("Your layer does not use self.dropout: apply it to the input of the update, "
                       "lora_b(lora_a(self.dropout(x)))."): dict(),
                marked("You apply the dropout to the base layer's input too: it acts on the update's input only, "
                       "base(x) + (alpha / r) · lora_b(lora_a(dropout(x))); the pretrained path stays as it was."):
                    dict(drop=drop, drop_at="base input"),
                marked("You apply the dropout to the update's output: it acts on its input, "
                       "lora_b(lora_a(dropout(x)))."): dict(drop=drop, drop_at="update"),
                marked("You apply the dropout to the layer's output: it acts on the update's input only, "
                       "lora_b(lora_a(dropout(x)))."): dict(drop=drop, drop_at="output"),
            }
            found = next((h for h, v in variants.items() if close(got, _lora_reference(base, state, alpha, r, x, **v),
                                                                     dtype)), None)
            hint = tr(found) if found else t("Apply self.dropout to x on the update's path only: "
                                             "lora_b(lora_a(self.dropout(x))).")
        raise CheckFailure(t("In train(), with self.dropout replaced by a module that zeroes a fixed half of its input "
                             "and doubles the rest, your output differs from base(x) + (alpha / r) · B(A(dropout(x))) "
                             "({difference}). {hint}", difference=difference(got, expected, s), hint=hint))
    # The stand-in above replaced the layer's own dropout, so its p was never used: with p = 1 nn.Dropout zeroes
    # every input of the update, and the layer computes base(x) exactly (nn.Dropout(1 - dropout), or a dropout that
    # ignores the argument, keeps the update).
    layer, base, state = _build_lora(cls, s, r, alpha, dtype, seed + 6, dropout=1.0)
    call(_set_training, layer, True)
    got = call(layer, x)
    expected = F.linear(x, base.weight, base.bias)
    if not close(got, expected, dtype):
        hint = (t("it keeps the whole update, as if nothing were dropped: build self.dropout = nn.Dropout(dropout) "
                  "with the dropout given (nn.Dropout's p is the probability of dropping, not of keeping).")
                if close(got, _lora_reference(base, state, alpha, r, x), dtype) else
                t("it is neither that nor base(x) plus the whole update. Look at the p your self.dropout gets: "
                  "nn.Dropout(dropout), the probability of dropping, with the dropout given."))
        raise CheckFailure(t("LoRALinear(r={r}, alpha={alpha}, dropout=1.0) in train() drops every input of the "
                             "update, so it computes base(x) alone; yours differs ({difference}): {hint}", r=r,
                             alpha=alpha, difference=difference(got, expected, s), hint=hint))
    passed(t("LoRALinear computes base(x) + (alpha / r) · B(A(dropout(x))) for r = 1, {r}, {r_plus_one} and "
             "alpha = 1, 16, 3, with and without a bias, on (batch, seq, in) and (batch, in); dropout on the update's "
             "input with the p given (1.0 leaves base(x)), only in train() ({dtype})", r=s["r"], r_plus_one=s["r"] + 1,
             dtype=dtype_name(dtype)))


def _merged(layer: nn.Module, x: Tensor) -> dict[str, Any]:
    """What merged() returns, as plain data: its kind, weights and output on x; and the layer's output before and
    after (merging must not change the layer)."""
    before = layer(x).detach().clone()
    merged = layer.merged()
    found: dict[str, Any] = {"kind": type(merged).__name__, "linear": isinstance(merged, nn.Linear),
                             "before": before, "after": layer(x).detach().clone()}
    if isinstance(merged, nn.Linear):
        found |= {"weight": merged.weight.detach().clone(),
                  "bias": None if merged.bias is None else merged.bias.detach().clone(),
                  "output": merged(x).detach().clone()}
    return found


def _merged_bias_hint(cls: Callable[..., Any], s: dict[str, int], dtype: torch.dtype, seed: int, x: Tensor,
                      bias: bool, failure: CheckFailure) -> str:
    """After merged() raised on a base with a bias: whether, on a base without one, it builds a layer with a bias."""
    # Any error of the student's code: the call that it names shows the layer, whose base says "bias=True".
    if not bias or not raised_error(failure):
        return ""
    layer, _, _ = _build_lora(cls, s, 2, 5.0, dtype, seed + 11, False, dropout=0.25)
    try:
        found = call(_merged, layer, x)
    except CheckFailure:
        return ""
    if not found["linear"] or found["bias"] is None:
        return ""
    return t(" On a base without bias your merged() builds an nn.Linear with a bias: the merged layer gets a bias "
             "exactly when the base has none, so the test of base.bias is inverted. Build it with "
             "nn.Linear(..., bias=self.base.bias is not None).")


@check
def check_lora_merged(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """merged() is one nn.Linear with weight W + (alpha / r) · B A and the base's bias, computing the same function;
    the layer is left as it was."""
    s = _lora_sizes(seed)
    x = _lora_inputs(s, dtype, seed)[0][1]
    for i, (r, alpha, bias) in enumerate(((s["r"], 12.0, True), (2, 5.0, False))):
        layer, base, state = _build_lora(cls, s, r, alpha, dtype, seed + 10 + i, bias, dropout=0.25)
        what = t("LoRALinear(r={r}, alpha={alpha}, dropout=0.25) in eval()", r=r, alpha=alpha) if bias else \
            t("LoRALinear(r={r}, alpha={alpha}, dropout=0.25, a base without bias) in eval()", r=r, alpha=alpha)
        try:
            found = call(_merged, layer, x)
        except CheckFailure as failure:
            hint = _merged_bias_hint(cls, s, dtype, seed, x, bias, failure)
            raise CheckFailure(t("merged() of {what}: {failure}.{hint}", what=what,
                                 failure=str(failure).rstrip(_stops()), hint=hint)) from failure
        if not found["linear"]:
            raise CheckFailure(t("merged() of {what} should return one nn.Linear, got {kind}.", what=what,
                                 kind=found["kind"]))
        expected = _lora_reference(base, state, alpha, r, x)
        if not close(found["before"], expected, dtype):
            raise CheckFailure(t("{what} does not compute base(x) + (alpha / r) · B(A(x)) ({difference}), so its "
                                 "merged layer cannot either: {hint}", what=what,
                                 difference=difference(found["before"], expected, s),
                                 hint=_scaling_hint(found["before"], base, state, alpha, r, x)))
        if not close(found["after"], found["before"], dtype):
            raise CheckFailure(t("After merged(), {what} computes something else ({difference}): merged() changed the "
                                 "layer itself (did it add B·A into base.weight in place?). Build a new nn.Linear and "
                                 "leave the base as it was: the adapter may still be trained or removed.", what=what,
                                 difference=difference(found["after"], found["before"], s)))
        weight = found["weight"]
        b_a = state["lora_b.weight"] @ state["lora_a.weight"]
        expected_weight = base.weight + alpha / r * b_a
        if weight.dtype != dtype:
            raise CheckFailure(t("The merged layer is {found} although the base is {dtype}: build it with "
                                 "dtype=base.weight.dtype.", found=dtype_name(weight.dtype), dtype=dtype_name(dtype)))
        if not close(weight, expected_weight, dtype):
            if close(weight, base.weight + b_a, dtype):
                hint = t("You added B·A without its scale: the merged weight is W + (alpha / r) · B A.")
            elif close(weight, base.weight, dtype):
                hint = t("Your merged weight is the base's alone, without the update: add (alpha / r) · "
                         "lora_b.weight @ lora_a.weight to it.")
            elif close(weight, alpha / r * b_a, dtype):
                hint = t("Your merged weight is the update (alpha / r) · B A alone, without the base's weight W: the "
                         "merged layer computes both paths, W + (alpha / r) · B A.")
            else:
                hint = t("The merged weight is W + (alpha / r) · lora_b.weight @ lora_a.weight, shape (out, in).")
            raise CheckFailure(t("merged() of {what} has the wrong weight ({difference}). {hint}", what=what,
                                 difference=difference(weight, expected_weight, s), hint=hint))
        if bias and found["bias"] is None:
            raise CheckFailure(t("merged() of {what} should keep the base layer's bias unchanged (the update adds "
                                 "none); it has no bias.", what=what))
        if bias and not torch.equal(found["bias"], base.bias):
            raise CheckFailure(t("merged() of {what} should keep the base layer's bias unchanged (the update adds "
                                 "none); its bias differs.", what=what))
        if not bias and found["bias"] is not None:
            raise CheckFailure(t("merged() of {what}, whose base has no bias, has one: nn.Linear(..., bias=False) "
                                 "when base.bias is None.", what=what))
        if not close(found["output"], expected, dtype):
            raise CheckFailure(t("The merged layer of {what} computes something else than the LoRA layer "
                                 "({difference}).", what=what, difference=difference(found["output"], expected, s)))
    passed(t("merged() returns one nn.Linear with weight W + (alpha / r) · B A and the base's bias (or none), "
             "computing what the LoRA layer computes, and leaves the layer as it was ({dtype})",
             dtype=dtype_name(dtype)))


# -- exercise 4: predict, then measure ------------------------------------------------------------------

def _nucleus_range(logits: Tensor, temperature: float, top_p: float) -> tuple[int, int]:
    """The nucleus sizes that rounding allows: the fewest tokens whose mass reaches p - 1e-5, and p + 1e-5."""
    probs = torch.sort(torch.softmax(logits.double() / temperature, dim=-1), descending=True).values
    mass = torch.cumsum(probs, dim=-1)
    vocab = logits.shape[-1]

    def fewest(target: float) -> int:
        return min(int((mass < target).sum()) + 1, vocab)

    return fewest(top_p - 1e-5), fewest(top_p + 1e-5)


@check
def check_nucleus_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """The number of tokens your filter keeps of logits / temperature, for Zipf-like and random logits."""
    g = torch.Generator().manual_seed(seed + 73)
    vocab = 200 + int(torch.randint(0, 100, (1,), generator=g))
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    distributions = ((t("a Zipf distribution (p_k ∝ 1/k)"), -ranks.log()[torch.randperm(vocab, generator=g)]),
                     (t("random logits (spread 3)"), 3 * torch.randn(vocab, generator=g)))
    counts = []
    for what, logits in distributions:
        for temperature in (0.3, 0.5, 1.0, 2.0, 5.0):
            for top_p in (0.5, 0.9):
                got = call(fn, logits, temperature, top_p)
                if type(got) is not int:
                    raise CheckFailure(t("nucleus_size should return a Python int (the number of kept tokens: "
                                         "int(...)), got {kind}.", kind=kind(got)))
                low, high = _nucleus_range(logits, temperature, top_p)
                counts.append(got)
                if low <= got <= high:
                    continue
                same = _nucleus_range(logits, 1.0, top_p)
                wrong = _nucleus_range(logits, 1 / temperature, top_p)
                if same[0] <= got <= same[1] and temperature != 1.0:
                    hint = t("That is the count at temperature 1: divide the logits by the temperature before "
                             "filtering, filter_logits(logits / temperature, top_p=top_p).")
                elif wrong[0] <= got <= wrong[1]:
                    hint = t("That is the count at temperature 1 / T: divide the logits by the temperature, do not "
                             "multiply them.")
                elif vocab - high <= got <= vocab - low:
                    hint = t("That is the number of tokens dropped: count those whose logit is still finite.")
                else:
                    hint = t("Filter logits / temperature with your filter_logits(..., top_p=top_p) and count the "
                             "tokens whose logit is not -inf. (If your filter_logits fails its checks, fix it first.)")
                if low == high:
                    raise CheckFailure(t("For {what} over {vocab} tokens at temperature {temperature} and "
                                         "top_p={top_p} you counted {got} tokens; the nucleus holds {low}. {hint}",
                                         what=what, vocab=vocab, temperature=temperature, top_p=top_p, got=got,
                                         low=low, hint=hint))
                raise CheckFailure(t("For {what} over {vocab} tokens at temperature {temperature} and top_p={top_p} "
                                     "you counted {got} tokens; the nucleus holds {low} to {high}. {hint}", what=what,
                                     vocab=vocab, temperature=temperature, top_p=top_p, got=got, low=low, high=high,
                                     hint=hint))
    passed(t("nucleus sizes right for a Zipf distribution and random logits over {vocab} tokens, at temperatures 0.3 "
             "to 5 and top_p 0.5 and 0.9 (from {fewest} to {most} tokens)", vocab=vocab, fewest=min(counts),
             most=max(counts)))
