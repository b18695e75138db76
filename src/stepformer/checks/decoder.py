"""Checks for chapter 08: the target mask, the decoder layer, greedy generation, and a measurement of teacher forcing.

The decoder layer is given its parts. Its checks hand the student's ``DecoderLayer`` parts of their own
(an attention, a feed-forward network, PyTorch's LayerNorm), so that they check its wiring alone; the
oracle is PyTorch's own ``torch.nn.TransformerDecoderLayer`` (``batch_first=True``) with seeded weights
copied into those parts, run with a causal and padding target mask and a padding mask of the source. To
name a mistake, a check compares the student's output with this module's written-out decoder layer, run
with that mistake switched on. ``build_decoder_layer``, the choice of parts, has a check of its own. Greedy
generation is compared with a loop written out here, on a small seeded model whose sentences end at
different steps. Every touch of a student object goes through :func:`call`.
"""

import contextlib
import copy
import inspect
import math
import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import einsum, rearrange
from jaxtyping import Bool, Float, Int, jaxtyped
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
    raised_error,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import set_training as _set_training
from stepformer.checks.encoder import _expect_parameters, _layer_norm, _layout, _load, _quiet, _randomise, _stored
from stepformer.checks.encoder import _layer_state as _encoder_layer_state
from stepformer.checks.encoder import _run_torch as _run_encoder_layer
from stepformer.checks.encoder import _torch_layer as _torch_encoder_layer

AXES = ("batch", "tgt_len", "src_len", "heads", "d_head", "d_ff")
# What this chapter asks students to write themselves. (Not MultiHeadAttention, FeedForward, LayerNorm or
# add_and_norm: the notebook hands students the earlier chapters' pieces under those names.)
BUILT_IN_DECODER = {
    "torch.nn.TransformerDecoderLayer": marked("PyTorch's built-in decoder layer"),
    "torch.nn.TransformerDecoder": marked("PyTorch's built-in decoder"),
    "torch.nn.Transformer": "PyTorch's built-in Transformer",
    "torch.nn.MultiheadAttention": "PyTorch's built-in multi-head attention",
    "torch.nn.functional.multi_head_attention_forward": "PyTorch's built-in multi-head attention",
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, d_model = heads * d_head included."""
    return distinct_sizes(seed, AXES, span=12, fixed=(3, 5, 7, 2, 4, 11), products={"d_model": ("heads", "d_head")},
                          accept=lambda s: s["heads"] <= 5 and s["batch"] <= 5)


def _lengths(batch: int, length: int, g: torch.Generator) -> Tensor:
    """Sentence lengths 1 ... length: the first sentence full, the last shorter (so padding is always there)."""
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0], lengths[-1] = length, max(1, length - 2)
    return lengths


# -- exercise 1: the target mask ---------------------------------------------------------------

def _tokens(s: dict[str, int], pad_id: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed + 5)
    tokens = torch.randint(0, 20, (s["batch"], s["tgt_len"]), generator=g)
    tokens[tokens == pad_id] = pad_id + 1
    for b, n in enumerate(_lengths(s["batch"], s["tgt_len"], g).tolist()):
        tokens[b, n:] = pad_id
    return tokens


def _target_mask_by_definition(tokens: Tensor, pad_id: int) -> Tensor:
    """Query i of sentence b may read key j when j <= i (no peeking ahead) and token j is not padding."""
    batch, length = tokens.shape
    mask = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    for b in range(batch):
        for i in range(length):
            for j in range(i + 1):
                mask[b, 0, i, j] = bool(tokens[b, j] != pad_id)
    return mask


def _target_mask_variants(tokens: Tensor, pad_id: int) -> dict[str, Tensor]:
    real = tokens != pad_id
    lower = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    keys, queries = real[:, None, None, :], real[:, None, :, None]
    return {
        t("Your mask is only the padding mask: the decoder's self-attention also needs the causal mask, so that "
          "position i cannot read the tokens after it (combine them with &)."): keys & torch.ones_like(lower),
        t("Your mask is only the causal mask: the padding keys must be hidden too (combine the two with &)."):
            lower.expand_as(keys & lower),
        t("You combined the two masks with | (or): a key may be read only when it is both not ahead and not padding, "
          "which is &."): keys | lower,
        t("Your causal part is the upper triangle: query i may read keys 0 ... i, on and below the diagonal "
          "(tril, not triu)."): keys & lower.T,
        t("Your causal part leaves out the diagonal: position i may read itself (tril with diagonal 0)."):
            keys & lower.tril(-1),
        t("Your padding mask lies along the query axis: padding hides keys, the last axis (batch, 1, 1, k_len)."):
            queries & lower,
    }


def _return_shape_hint(message: str, s: dict[str, int]) -> tuple[str, str]:
    """Name the mistake behind a return value that the signature's shape refused (only one of the two masks): which
    mask it is the shape of ("padding", "causal" or ""), and the hint."""
    batch, length = s["batch"], s["tgt_len"]
    if f"bool[{batch},1,1,{length}]" in message:
        return "padding", "\n" + t("That is the shape of the padding mask alone: the decoder's self-attention also "
                                   "needs the causal mask, so that position i cannot read the tokens after it "
                                   "(combine them with &).")
    if f"bool[{length},{length}]" in message:
        return "causal", "\n" + t("That is the shape of the causal mask alone: the padding keys must be hidden too "
                                  "(combine the two with &).")
    return "", ""


def _unchecked(fn: Callable[..., Any], *args: Any) -> Any:
    """What ``fn`` returns without its jaxtyping/beartype wrapper (its return value refused by the signature)."""
    try:
        return inspect.unwrap(fn)(*args)
    except Exception:  # the value cannot be had: nothing more to say
        return None


class _Size(tuple):
    """A shape that notes every index read past its end (and then fails as a shape would)."""

    past: list[int] = []

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, int) and not -len(self) <= i < len(self):
            _Size.past.append(i)
        return tuple.__getitem__(self, i)


class _ShapeSpy(Tensor):
    """A tensor whose .shape notes the indexes read past its end."""

    @property
    def shape(self) -> _Size:
        return _Size(super().shape)


def _shape_indexes_past_the_end(fn: Callable[..., Any], tokens: Tensor, pad_id: int) -> list[int]:
    """The indexes of tokens.shape past its end that ``fn`` reads (its error is not the point here)."""
    _Size.past = []
    with contextlib.suppress(Exception):
        fn(tokens.as_subclass(_ShapeSpy), pad_id)
    past, _Size.past = list(_Size.past), []
    return past


@check
def check_target_mask(fn: Callable[..., Any], seed: int = 0) -> None:
    """Causal and padding together: (batch, 1, tgt_len, tgt_len), True where query i may read key j <= i, not a pad."""
    s = _sizes(seed)
    # The last case is one sentence: a batch of one catches a .squeeze() that drops the batch axis.
    for pad_id, batch in ((0, s["batch"]), (3, s["batch"]), (0, 1)):
        tokens = _tokens(s, pad_id, seed + pad_id)[:batch]
        sizes = {"batch": batch, "tgt_len": s["tgt_len"], "pad_id": pad_id}
        try:
            got = call(fn, tokens, pad_id)
        except CheckFailure as failure:
            alone, hint = _return_shape_hint(str(failure), s)
            if alone == "causal":
                # The signature refused the value: look at the value itself, without the signature's check.
                value = call(_unchecked, fn, tokens, pad_id)
                lower = torch.ones(s["tgt_len"], s["tgt_len"], dtype=torch.bool).tril()
                if type(value) is Tensor and value.shape == lower.shape and torch.equal(value, lower):
                    hint = "\n" + t("Your target_mask returns the causal mask alone, without the padding mask: the "
                                    "padding keys must be hidden too, padding_mask(tgt, pad_id) & causal_mask(...), "
                                    "which broadcast to (batch, 1, tgt_len, tgt_len).")
            if not hint and raised_error(failure) == "IndexError":
                past = call(_shape_indexes_past_the_end, fn, tokens, pad_id)
                if past:
                    hint = "\n" + t("Your target_mask reads tgt.shape[{index}], but tgt has two axes, (batch, "
                                    "tgt_len): its length is tgt.shape[1] (or tgt.shape[-1]).", index=past[0])
            raise CheckFailure(str(failure) + hint) from failure
        expected = _target_mask_by_definition(tokens, pad_id)
        if type(got) is not Tensor:
            raise CheckFailure(t("target_mask should return a torch.Tensor, got {kind}.", kind=kind(got)))
        if got.dtype != torch.bool:
            raise CheckFailure(t("target_mask should return a boolean mask (True = may attend), got {dtype}.",
                                 dtype=got.dtype))
        variants = _target_mask_variants(tokens, pad_id)
        try:  # a mask of another shape that broadcasts (padding only, causal only) is named by its content
            spread = got.expand(expected.shape)
        except RuntimeError:
            spread = None
        if spread is not None and not torch.equal(spread, expected):
            hint = next((h for h, v in variants.items() if torch.equal(spread, v)), None)
            if hint is not None:
                raise CheckFailure(t("Your mask differs from the expected one ({difference}). {hint}",
                                     difference=difference(spread.int(), expected.int(), sizes), hint=hint))
        if tuple(got.shape) != tuple(expected.shape):
            raise CheckFailure(t(
                "target_mask should have shape (batch, 1, tgt_len, tgt_len): {difference}. "
                "The padding mask is (batch, 1, 1, tgt_len) and the causal mask (tgt_len, tgt_len): combined with &, "
                "they broadcast to (batch, 1, tgt_len, tgt_len).", difference=difference(got, expected, sizes)))
        if torch.equal(got, expected):
            continue
        hint = next((h for h, v in variants.items() if torch.equal(got, v)),
                    t("Entry [b, 0, i, j] is True exactly when j <= i and tokens[b, j] != pad_id."))
        raise CheckFailure(t("Your mask differs from the expected one ({difference}). {hint}",
                             difference=difference(got.int(), expected.int(), sizes), hint=hint))
    passed(t("target_mask: causal and padding together, (batch, 1, tgt_len, tgt_len), pad_id 0 and 3, batch=1"))


# -- exercise 2: the decoder layer -------------------------------------------------------------

def _attention(state: dict[str, Tensor], prefix: str, heads: int, query: Tensor, source: Tensor,
               mask: Tensor | None) -> Tensor:
    def project(name: str, t: Tensor) -> Tensor:
        return t @ state[f"{prefix}.{name}.weight"].T + state[f"{prefix}.{name}.bias"]

    q = rearrange(project("w_q", query), "batch q_len (heads d_head) -> batch heads q_len d_head", heads=heads)
    k = rearrange(project("w_k", source), "batch k_len (heads d_head) -> batch heads k_len d_head", heads=heads)
    v = rearrange(project("w_v", source), "batch k_len (heads d_head) -> batch heads k_len d_head", heads=heads)
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len")
    scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    out = einsum(scores.softmax(-1), v, "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
    return project("w_o", rearrange(out, "batch heads q_len d_head -> batch q_len (heads d_head)"))


def _ffn(state: dict[str, Tensor], x: Tensor, activation: str = "relu") -> Tensor:
    pre = x @ state["ffn.linear1.weight"].T + state["ffn.linear1.bias"]
    hidden = F.gelu(pre) if activation == "gelu" else torch.relu(pre)  # exact GELU, as PyTorch's "gelu"
    return hidden @ state["ffn.linear2.weight"].T + state["ffn.linear2.bias"]


def _reference_layer(state: dict[str, Tensor], heads: int, x: Tensor, memory: Tensor, src_mask: Tensor | None,
                     tgt_mask: Tensor | None, norm_first: bool, mistake: str = "", activation: str = "relu") -> Tensor:
    """One decoder layer from the weights in ``state``, or a named mistake of it."""
    norm_first = not norm_first if mistake == "swapped placement" else norm_first
    tgt_mask = None if mistake == "no target mask" else tgt_mask
    src_mask = None if mistake == "no source mask" else src_mask

    def sublayer(h: Tensor, f: Callable[[Tensor], Tensor], norm: str) -> Tensor:
        if mistake == "no residual":
            return _layer_norm(state, norm, f(h)) if not norm_first else f(_layer_norm(state, norm, h))
        if norm_first:
            return h + f(_layer_norm(state, norm, h))
        return _layer_norm(state, norm, h + f(h))

    def cross(t: Tensor) -> Tensor:
        source = memory
        if mistake == "cross reads the decoder":
            source = t
        elif mistake == "normed memory":
            source = _layer_norm(state, "norm2", memory)
        return _attention(state, "cross_attn", heads, t, source, src_mask)

    def self_attention(h: Tensor) -> Tensor:
        return sublayer(h, lambda t: _attention(state, "self_attn", heads, t, t, tgt_mask), "norm1")

    if mistake == "cross first":
        h = self_attention(sublayer(x, cross, "norm2"))
    else:
        h = self_attention(x)
        if mistake != "no cross-attention":
            h = sublayer(h, cross, "norm2")
    return sublayer(h, lambda t: _ffn(state, t, activation), "norm3")


def _mistaken(state: dict[str, Tensor], heads: int, x: Tensor, memory: Tensor, src_mask: Tensor | None,
              tgt_mask: Tensor | None, norm_first: bool, mistake: str, activation: str = "relu") -> Tensor:
    """The mistaken layer's output, or NaN where that mistake cannot even run on these inputs."""
    try:
        return _reference_layer(state, heads, x, memory, src_mask, tgt_mask, norm_first, mistake, activation)
    except RuntimeError:  # e.g. the source's mask on keys read from the target: the shapes do not fit
        return torch.full_like(x, math.nan)


def _layer_mistakes(norm_first: bool, masked_source: bool) -> dict[str, str]:
    hints = {
        "cross reads the decoder": t(
            "Your cross-attention reads its keys and values from the decoder, not from the encoder's memory: it is "
            "self.cross_attn(h, memory, memory, src_mask), queries from the target, keys and values from the source."),
        "no target mask": t(
            "Your self-attention ignores tgt_mask, so every target position reads the positions after it (and the "
            "padding): pass tgt_mask to self.self_attn(h, h, h, tgt_mask)."),
        "no cross-attention": t("Your layer leaves out cross-attention: between self-attention and the FFN comes "
                                "AddNorm_2 with self.cross_attn(h, memory, memory, src_mask)."),
        "cross first": t("Your layer runs cross-attention before self-attention: the order is masked self-attention, "
                         "then cross-attention, then the feed-forward network."),
        "no residual": t("Your sublayers have no residual connection: add_and_norm adds the sublayer's input back."),
        "swapped placement": t(
            "Your layer computes the other norm placement: pass self.norm_first to add_and_norm in every sublayer "
            "(post-norm: norm(x + dropout(f(x))); pre-norm: x + dropout(f(norm(x))))."),
    }
    if norm_first:
        hints["normed memory"] = t("You normalised the encoder's memory with norm2: in pre-norm only the sublayer's "
                                   "input (the target stream) is normalised; memory is read as it is.")
    if masked_source:
        hints["no source mask"] = t(
            "Your cross-attention ignores src_mask, so the target reads the source's padding: pass src_mask to "
            "self.cross_attn(h, memory, memory, src_mask).")
    return hints


def _torch_layer(s: dict[str, int], norm_first: bool, dtype: torch.dtype, seed: int,
                 activation: str = "relu") -> nn.TransformerDecoderLayer:
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        layer = nn.TransformerDecoderLayer(s["d_model"], s["heads"], s["d_ff"], dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm_first, dtype=dtype)
    _randomise(layer, torch.Generator().manual_seed(seed + 13))
    return layer.eval()


def _layer_state(layer: nn.TransformerDecoderLayer) -> dict[str, Tensor]:
    """The layer's weights under this course's names (PyTorch packs W_Q, W_K, W_V in this order)."""
    state = {}
    for ours, attn in (("self_attn", layer.self_attn), ("cross_attn", layer.multihead_attn)):
        weights = rearrange(attn.in_proj_weight.detach(), "(qkv d_out) d_in -> qkv d_out d_in", qkv=3)
        biases = rearrange(attn.in_proj_bias.detach(), "(qkv d_out) -> qkv d_out", qkv=3)
        for i, name in enumerate(("w_q", "w_k", "w_v")):
            state[f"{ours}.{name}.weight"], state[f"{ours}.{name}.bias"] = weights[i].clone(), biases[i].clone()
        state[f"{ours}.w_o.weight"] = attn.out_proj.weight.detach().clone()
        state[f"{ours}.w_o.bias"] = attn.out_proj.bias.detach().clone()
    pairs = {"ffn.linear1": layer.linear1, "ffn.linear2": layer.linear2, "norm1": layer.norm1,
             "norm2": layer.norm2, "norm3": layer.norm3}
    for ours, theirs in pairs.items():
        state[f"{ours}.weight"] = theirs.weight.detach().clone()
        state[f"{ours}.bias"] = theirs.bias.detach().clone()
    return state


def _layer_shapes(s: dict[str, int], cross_attention: bool = True) -> dict[str, list[int]]:
    d, d_ff = s["d_model"], s["d_ff"]
    shapes = {}
    for attn in ("self_attn", "cross_attn") if cross_attention else ("self_attn",):
        shapes |= {f"{attn}.{p}.weight": [d, d] for p in ("w_q", "w_k", "w_v", "w_o")}
        shapes |= {f"{attn}.{p}.bias": [d] for p in ("w_q", "w_k", "w_v", "w_o")}
    shapes |= {"ffn.linear1.weight": [d_ff, d], "ffn.linear1.bias": [d_ff], "ffn.linear2.weight": [d, d_ff],
               "ffn.linear2.bias": [d]}
    for norm in ("norm1", "norm2", "norm3") if cross_attention else ("norm1", "norm3"):
        shapes |= {f"{norm}.weight": [d], f"{norm}.bias": [d]}
    return shapes


LAYER_HINT = marked("Keep the attribute names of torch.nn.TransformerDecoderLayer, with cross_attn for its "
                    "multihead_attn: store the given parts as self.self_attn, self.cross_attn, self.ffn, self.norm1, "
                    "self.norm2 and self.norm3.")
BUILD_HINT = marked("build_decoder_layer gives DecoderLayer two MultiHeadAttention(d_model, heads, dropout=dropout), "
                    "one FeedForward(d_model, d_ff, activation, dropout) and three LayerNorm(d_model).")
PART_NAMES = ("self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3")


def _signature(parts: dict[str, Any], dropout: float, norm_first: bool) -> str:
    """How a message writes the call that built a layer from ``parts`` (None where a part is left out)."""
    given = ", ".join(name if parts[name] is not None else "None" for name in PART_NAMES)
    return f"DecoderLayer({given}, dropout={dropout}, norm_first={norm_first})"


def _layer_from_parts(cls: Callable[..., Any], parts: dict[str, Any], dropout: float, norm_first: bool) -> Any:
    """The student's layer, given ``parts`` in the order of its signature; a failure names the call by its parts."""
    try:
        return call(cls, *(parts[name] for name in PART_NAMES), dropout=dropout, norm_first=norm_first)
    except CodeRaised as failure:  # its own message would print every part's repr
        raise CodeRaised(t("{call} raised {error}: {text}", call=_signature(parts, dropout, norm_first),
                           error=failure.error, text=failure.text), failure.error, failure.text) from None


class _Attention(nn.Module):
    """The check's own multi-head attention, as a layer is given it: ``w_q``, ``w_k``, ``w_v``, ``w_o`` and dropout
    on the attention weights, called as ``attention(query, key, value, mask, cache=None)``; a query row without any
    key left reads nothing (zeros), as in the course's attention."""

    def __init__(self, d_model: int, heads: int, dropout: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model, dtype=dtype) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                cache: Any = None) -> Tensor:
        def split(t: Tensor) -> Tensor:
            return rearrange(t, "batch seq (heads d_head) -> batch heads seq d_head", heads=self.heads)

        q, k, v = split(self.w_q(query)), split(self.w_k(key)), split(self.w_v(value))
        scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len")
        scores = scores / math.sqrt(q.shape[-1])
        if mask is not None:
            has_key = mask.any(dim=-1, keepdim=True)
            scores = scores.masked_fill(~mask, -math.inf).masked_fill(~has_key, 0.0)
        weights = scores.softmax(-1)
        if mask is not None:
            weights = weights.masked_fill(~has_key, 0.0)
        out = einsum(self.dropout(weights), v,
                     "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
        return self.w_o(rearrange(out, "batch heads q_len d_head -> batch q_len (heads d_head)"))


class _FeedForward(nn.Module):
    """The check's own FFN, as a layer is given it: linear2(dropout(activation(linear1(x))))."""

    def __init__(self, d_model: int, d_ff: int, activation: str, dropout: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, dtype=dtype)
        self.linear2 = nn.Linear(d_ff, d_model, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        self.gelu = activation == "gelu"

    def forward(self, x: Tensor) -> Tensor:
        pre = self.linear1(x)
        return self.linear2(self.dropout(F.gelu(pre) if self.gelu else torch.relu(pre)))  # exact GELU, as PyTorch's


def _parts(s: dict[str, int], dropout: float = 0.0, activation: str = "relu", cross_attention: bool = True,
           dtype: torch.dtype = torch.float32) -> dict[str, nn.Module | None]:
    """The parts of the check's own that a layer is given, one object each, the norms PyTorch's LayerNorm: the
    student's wiring is checked alone, whatever the notebook's parts and builder do."""
    d = s["d_model"]
    with torch.random.fork_rng(devices=[]):  # their initialisation would move the student's RNG
        return {"self_attn": _Attention(d, s["heads"], dropout, dtype),
                "cross_attn": _Attention(d, s["heads"], dropout, dtype) if cross_attention else None,
                "ffn": _FeedForward(d, s["d_ff"], activation, dropout, dtype),
                "norm1": nn.LayerNorm(d, dtype=dtype),
                "norm2": nn.LayerNorm(d, dtype=dtype) if cross_attention else None,
                "norm3": nn.LayerNorm(d, dtype=dtype)}


def _build_layer(cls: Callable[..., Any], s: dict[str, int], dropout: float, norm_first: bool,
                 activation: str = "relu", cross_attention: bool = True, dtype: torch.dtype = torch.float32) -> Any:
    """The student's DecoderLayer given the check's own parts."""
    return _layer_from_parts(cls, _parts(s, dropout, activation, cross_attention, dtype), dropout, norm_first)


def _check_stores_parts(cls: Callable[..., Any], s: dict[str, int], cross_attention: bool) -> None:
    """Built from the check's own parts: each stored under its name, dropout1-dropout3 (no dropout2 without
    cross-attention) with the given p."""
    parts = _parts(s, cross_attention=cross_attention)
    built = _signature(parts, 0.25, False)
    module = _layer_from_parts(cls, parts, 0.25, False)
    stored = call(_stored, module, parts)
    for name in PART_NAMES:
        expected = name if parts[name] is not None else "None"
        got = stored[name]
        if got == expected:
            continue
        if got == "missing":
            raise CheckFailure(t("{built} gives a layer without self.{name}. {hint}", built=built, name=name,
                                 hint=tr(LAYER_HINT)))
        if expected == "None":
            raise CheckFailure(t("{built} gives a layer whose self.{name} is not None: without cross-attention the "
                                 "layer keeps {name} None as it is given.", built=built, name=name))
        if got == "other":
            raise CheckFailure(t("{built} gives a layer whose self.{name} is not the module given as {name}: store "
                                 "the given part itself (self.{name} = {name}); the layer is its wiring, and "
                                 "build_decoder_layer chooses its parts.", built=built, name=name))
        if got == "None":
            raise CheckFailure(t("{built} gives a layer whose self.{name} holds None: the parameters come in the order "
                                 "(self_attn, cross_attn, ffn, norm1, norm2, norm3, dropout, norm_first), and each "
                                 "part is stored under its own name.", built=built, name=name))
        raise CheckFailure(t("{built} gives a layer whose self.{name} holds the module given as {got}: the parameters "
                             "come in the order (self_attn, cross_attn, ffn, norm1, norm2, norm3, dropout, "
                             "norm_first), and each part is stored under its own name.", built=built, name=name,
                             got=got))
    dropouts = call(_layout, module)["dropouts"]
    for name in ("dropout1", "dropout2", "dropout3") if cross_attention else ("dropout1", "dropout3"):
        p = dropouts.get(name)
        if p is None:
            raise CheckFailure(t("{built} gives a layer without {name}: each sublayer's output gets its own "
                                 "nn.Dropout(dropout), named dropout1, dropout2 and dropout3 as in PyTorch.",
                                 built=built, name=name))
        if p != 0.25:
            raise CheckFailure(t("{built} gives a layer whose {name}.p is {p}: pass dropout on to "
                                 "nn.Dropout(dropout).", built=built, name=name, p=p))
    if not cross_attention and "dropout2" in dropouts:
        raise CheckFailure(t("{built} gives a layer with a dropout2: a decoder-only block has no middle sublayer, so "
                             "it has neither norm2 nor dropout2 (self.dropout2 = None), one layout for every such "
                             "block.", built=built))


def _check_refuses(cls: Callable[..., Any], s: dict[str, int]) -> None:
    """ValueError for a cross-attention without its norm2 (or the other way round) and for one norm in two places."""
    parts = _parts(s)
    pairing = t("norm2 belongs to the cross-attention sublayer: a layer gets cross_attn and norm2, or neither")
    sharing = t("one norm in two sublayers would give both the same weight and bias: each sublayer needs its own")
    cases = [
        ({**parts, "norm2": None}, "DecoderLayer(self_attn, cross_attn, ffn, norm1, None, norm3)", pairing),
        ({**parts, "cross_attn": None}, "DecoderLayer(self_attn, None, ffn, norm1, norm2, norm3)", pairing),
        ({**parts, "norm3": parts["norm1"]}, "DecoderLayer(self_attn, cross_attn, ffn, norm, norm2, norm)", sharing),
        ({**parts, "cross_attn": None, "norm2": None, "norm3": parts["norm1"]},
         "DecoderLayer(self_attn, None, ffn, norm, None, norm)", sharing),
    ]
    for given, written, why in cases:
        error = call(_error_of, cls, *(given[name] for name in PART_NAMES), dropout=0.25, norm_first=False)
        if error is None:
            raise CheckFailure(t("{call} should raise a ValueError ({why}); it raised no error.", call=written,
                                 why=why))
        if error != "ValueError":
            raise CheckFailure(t("{call} should raise a ValueError ({why}); it raised a {error}.", call=written,
                                 why=why, error=error))


def _ffn_activation(module: nn.Module, x: Tensor) -> str:
    """Which activation the layer's FFN computes: "relu", "gelu", or "" (neither, or not the given FeedForward)."""
    try:
        ffn = module.ffn
        pre = x @ ffn.linear1.weight.T + ffn.linear1.bias
        out = ffn(x)
        for name, activation in (("gelu", F.gelu), ("relu", torch.relu)):
            if torch.allclose(out, activation(pre) @ ffn.linear2.weight.T + ffn.linear2.bias, atol=1e-5):
                return name
    except Exception:  # another FFN than the given one: nothing to say about it here
        pass
    return ""


def _placement(module: nn.Module, x: Tensor, memory: Tensor) -> str:
    """Which placement the built layer computes: its output against its own class rebuilt from its parts with
    norm_first True and False ("pre", "post", or "" when neither or both)."""
    try:
        cls = type(module)
        parts = [getattr(module, name) for name in PART_NAMES]
        module.eval()
        with torch.no_grad():
            out = module(x, memory)
            same = {name: torch.allclose(out, cls(*parts, dropout=0.0, norm_first=first).eval()(x, memory), atol=1e-5)
                    for name, first in (("pre", True), ("post", False))}
    except Exception:  # a layer that cannot be rebuilt from its parts: nothing to say about it here
        return ""
    return next(iter(name for name, equal in same.items() if equal)) if sum(same.values()) == 1 else ""


def _inputs(s: dict[str, int], dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Target stream, memory, source padding mask (batch, 1, 1, src_len), target mask (batch, 1, tgt_len, tgt_len)."""
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(s["batch"], s["tgt_len"], s["d_model"], generator=g, dtype=dtype)
    memory = torch.randn(s["batch"], s["src_len"], s["d_model"], generator=g, dtype=dtype)
    src_real = torch.arange(s["src_len"])[None, :] < _lengths(s["batch"], s["src_len"], g)[:, None]
    tgt_real = torch.arange(s["tgt_len"])[None, :] < _lengths(s["batch"], s["tgt_len"], g).flip(0)[:, None]
    lower = torch.ones(s["tgt_len"], s["tgt_len"], dtype=torch.bool).tril()
    return x, memory, src_real[:, None, None, :], tgt_real[:, None, None, :] & lower


def _run_torch(layer: nn.TransformerDecoderLayer, x: Tensor, memory: Tensor, src_mask: Tensor | None,
               tgt_mask: Tensor | None) -> Tensor:
    # PyTorch's masks mean the opposite of ours (True = "ignore"); its tgt_mask has no batch axis, so our
    # (batch, 1, tgt_len, tgt_len) causal and padding mask goes in as its causal part (tgt_mask) and the
    # target's padding (tgt_key_padding_mask); a (tgt_len, tgt_len) mask is its tgt_mask as it is.
    src_padding = None if src_mask is None else ~src_mask[:, 0, 0, :]
    causal = tgt_padding = None
    if tgt_mask is not None and tgt_mask.dim() == 2:
        causal = ~tgt_mask
    elif tgt_mask is not None:
        tgt_len = x.shape[1]
        causal = ~torch.ones(tgt_len, tgt_len, dtype=torch.bool).tril()
        tgt_padding = ~tgt_mask[:, 0, -1, :]  # the last query may read every real key
    return _quiet(layer, x, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_padding,
                  memory_key_padding_mask=src_padding)


def _layer_sizes(s: dict[str, int], x: Tensor, memory: Tensor | None) -> dict[str, int]:
    """The sizes a failure message names: those of these inputs (one sentence, one position) and of the layer."""
    src_len = {} if memory is None else {"src_len": memory.shape[1]}
    return {"batch": x.shape[0], "tgt_len": x.shape[1], **src_len, "d_model": s["d_model"], "heads": s["heads"],
            "d_ff": s["d_ff"]}


def _is_none(module: nn.Module, name: str) -> bool:
    return getattr(module, name, None) is None


def _set_to_none(module: nn.Module, name: str) -> bool:
    """Whether the attribute is there and holds None (not merely missing)."""
    return hasattr(module, name) and getattr(module, name) is None


def _run_with_memory(module: nn.Module, x: Tensor, memory: Tensor, cache: Any = None) -> dict[str, Any]:
    """Call the layer with a memory: the error it raises (or ""), and how often its cross_attn ran."""
    calls = []
    hook = None
    if isinstance(getattr(module, "cross_attn", None), nn.Module):
        hook = module.cross_attn.register_forward_hook(lambda *_: calls.append(1))
    try:
        extra = {} if cache is None else {"cache": cache}
        module(x, memory, None, None, **extra)
        error = ""
    except Exception as raised:  # the error is what we report
        error = f"{type(raised).__name__}: {raised}"
    finally:
        if hook is not None:
            hook.remove()
    return {"error": error, "cross_calls": len(calls)}


def _check_runs_with_memory(module: Any, x: Tensor, memory: Tensor) -> None:
    """Before blaming the memory=None case: the layer must run, cross-attention included, with a memory."""
    run = call(_run_with_memory, module, x, memory)
    if run["error"]:
        hint = ""
        read = re.search(r"'NoneType' object has no attribute '(self_attn|cross_attn)'", run["error"])
        if read:
            # The same call with a cache object that has those attributes: the error must go away (or change).
            parts = types.SimpleNamespace(self_attn=None, cross_attn=None)
            with_cache = call(_run_with_memory, module, x, memory, parts)
            if read.group(0) not in with_cache["error"]:
                hint = t(" That error reads .{part} of None, and it goes away when a cache object is passed: without "
                         "a cache (cache=None, as in every call of this chapter) your forward still reads "
                         "cache.{part}. Read the cache's parts only when cache is not None.", part=read.group(1))
        raise CheckFailure(t("Called with a memory, your layer(x, memory, None, None) raised {error}.{hint}",
                             error=run["error"], hint=hint))
    if run["cross_calls"] == 0:
        raise CheckFailure(t("Called with a memory, your layer (built with cross-attention) never calls "
                             "self.cross_attn: the cross-attention sublayer must run whenever self.cross_attn is not "
                             "None, and there a missing memory raises a ValueError."))


def _build(build: Callable[..., Any], s: dict[str, int], **options: Any) -> Any:
    return call(build, s["d_model"], s["heads"], s["d_ff"], **options)


@check(forbid=BUILT_IN_DECODER)
def check_build_decoder_layer(build: Callable[..., Any], seed: int = 0) -> None:
    """torch.nn.TransformerDecoderLayer's parts: two MultiHeadAttention, a FeedForward, three separate LayerNorms,
    given dropout, activation and norm_first; cross_attention=False leaves out cross_attn and norm2."""
    s = _sizes(seed)
    module = _build(build, s, dropout=0.25, cross_attention=True)  # named: a message shows the call
    if call(_set_to_none, module, "cross_attn"):
        other = _build(build, s, dropout=0.25, cross_attention=False)
        if any(name.startswith("cross_attn.") for name in call(_layout, other)["shapes"]):
            raise CheckFailure(t("Your build_decoder_layer with cross_attention=True (the default) gives the layer no "
                                 "cross-attention, and with cross_attention=False it gives it one: the condition is "
                                 "inverted. Give it a cross_attn (and a norm2) when cross_attention is True."))
        raise CheckFailure(t("Your build_decoder_layer with cross_attention=True (the default) gives the layer no "
                             "cross-attention (self.cross_attn is None): create it, a MultiHeadAttention(d_model, "
                             "heads, dropout=dropout), when cross_attention is True, with its own norm2."))
    if ["self_attn", "cross_attn"] in call(_layout, module)["aliases"]:  # before the shapes: one set of weights
        raise CheckFailure(t("The layer that your build_decoder_layer builds has self_attn and cross_attn one and the "
                             "same module: create two MultiHeadAttention objects, one for each sublayer."))
    layout = _expect_parameters(module, _layer_shapes(s), t("The layer that your build_decoder_layer builds"),
                                t("{build_hint} {layer_hint}", build_hint=tr(BUILD_HINT), layer_hint=tr(LAYER_HINT)))
    for name in ("dropout1", "dropout2", "dropout3"):
        if layout["dropouts"].get(name) != 0.25:
            raise CheckFailure(t("With dropout=0.25, the layer that your build_decoder_layer builds has {name}.p {p}: "
                                 "pass dropout on to DecoderLayer(..., dropout, norm_first).", name=name,
                                 p=layout["dropouts"].get(name)))
    for name in ("self_attn.dropout", "cross_attn.dropout", "ffn.dropout"):
        if layout["dropouts"].get(name) != 0.25:
            raise CheckFailure(t("With dropout=0.25, {name} should drop with p=0.25 too (as in PyTorch): pass "
                                 "dropout to both MultiHeadAttention(..., dropout=dropout) and to FeedForward(d_model, "
                                 "d_ff, activation, dropout).", name=name))
    g = torch.Generator().manual_seed(seed + 23)
    x = torch.randn(2, 3, s["d_model"], generator=g)
    memory = torch.randn(2, 4, s["d_model"], generator=g)
    gelu = _build(build, s, dropout=0.0, activation="gelu")
    if call(_ffn_activation, gelu, x) == "relu":
        raise CheckFailure(t("Built with activation='gelu', the FFN of your build_decoder_layer's layer computes "
                             "ReLU: pass activation on to FeedForward(d_model, d_ff, activation, dropout) instead of "
                             "leaving it at its default."))
    placement = call(_placement, _build(build, s, dropout=0.0, norm_first=True), x, memory)
    if placement == "post":
        raise CheckFailure(t("Built with norm_first=True, the layer of your build_decoder_layer computes what your "
                             "DecoderLayer computes with norm_first=False, from the same parts: pass norm_first on to "
                             "DecoderLayer(..., dropout, norm_first)."))
    decoder_only = _build(build, s, dropout=0.25, cross_attention=False)
    shapes = call(_layout, decoder_only)["shapes"]
    cross = sorted(name for name in shapes if name.startswith("cross_attn."))
    if cross:
        raise CheckFailure(t("With cross_attention=False (a decoder-only block) self.cross_attn should be None; it "
                             "has parameters {parameters} ... create the cross-attention only when cross_attention "
                             "is True.", parameters=cross[:2]))
    if not call(_is_none, decoder_only, "cross_attn"):
        raise CheckFailure(t("With cross_attention=False (a decoder-only block) self.cross_attn should be None; "
                             "create the cross-attention only when cross_attention is True."))
    if any(name.startswith("norm2.") for name in shapes):
        raise CheckFailure(t("With cross_attention=False (a decoder-only block) your build_decoder_layer still gives "
                             "the layer a norm2: norm2 belongs to the cross-attention sublayer, so pass None for both "
                             "cross_attn and norm2."))
    _expect_parameters(decoder_only, _layer_shapes(s, cross_attention=False),
                       t("With cross_attention=False, the layer that your build_decoder_layer builds"), tr(LAYER_HINT))
    passed(t("build_decoder_layer: torch.nn.TransformerDecoderLayer's parts, separate norms, with the given dropout, "
             "activation and norm_first; no cross_attn or norm2 with cross_attention=False"))


@check(forbid=BUILT_IN_DECODER)
def check_decoder_layer_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """DecoderLayer keeps its given parts, makes dropout1-dropout3 (no dropout2 without cross-attention), refuses a
    norm in two places or a cross_attn without its norm2, and raises a ValueError for a missing memory."""
    s = _sizes(seed)
    _check_stores_parts(cls, s, cross_attention=True)
    _check_stores_parts(cls, s, cross_attention=False)
    _check_refuses(cls, s)
    module = _build_layer(cls, s, 0.0, False)
    x = torch.randn(2, 3, s["d_model"], generator=torch.Generator().manual_seed(seed))
    error = call(_error_of, module, x, None, None, None)
    if error != "ValueError":
        memory = torch.randn(2, 4, s["d_model"], generator=torch.Generator().manual_seed(seed + 1))
        _check_runs_with_memory(module, x, memory)
        if error is None:
            raise CheckFailure(t("A layer with cross-attention called with memory=None should raise a ValueError (it "
                                 "has nothing to attend to); it raised no error. Check `memory is None` before the "
                                 "cross-attention sublayer."))
        raise CheckFailure(t("A layer with cross-attention called with memory=None should raise a ValueError (it has "
                             "nothing to attend to); it raised a {error}. Check `memory is None` before the "
                             "cross-attention sublayer.", error=error))
    passed(t("DecoderLayer keeps its given parts, has dropout1-dropout3 (no dropout2 without cross-attention), "
             "refuses a shared norm or a cross_attn without norm2, and raises a ValueError for memory=None"))


def _compare(module: Any, oracle: nn.Module, state: dict[str, Tensor], s: dict[str, int], norm_first: bool,
             dtype: torch.dtype, x: Tensor, memory: Tensor, src_mask: Tensor | None, tgt_mask: Tensor | None,
             what: str, activation: str = "relu") -> None:
    name = _placement_name(norm_first)
    try:
        got = call(module, x, memory, src_mask, tgt_mask)
    except CheckFailure as failure:  # say which case broke it (one position without a mask, say)
        raise CheckFailure(t("For a {name} layer {what}: {failure}", name=name, what=what, failure=failure)) \
            from failure
    got = expect_tensor(got, t("the decoder layer's output"), tuple(x.shape), "batch tgt_len d_model", x.dtype)
    expected = _run_torch(oracle, x, memory, src_mask, tgt_mask)
    if close(got, expected, dtype):
        return
    if torch.isnan(got).any():
        hint = t("Your output contains NaN: did a mask reach the softmax inverted (True means 'may attend')?")
    else:
        hint = next((h for mistake, h in _layer_mistakes(norm_first, src_mask is not None).items()
                     if close(got, _mistaken(state, s["heads"], x, memory, src_mask, tgt_mask, norm_first, mistake,
                                             activation), dtype)),
                    t("Compare each sublayer with torch.nn.TransformerDecoderLayer's on a small example: masked "
                      "self-attention, cross-attention to memory, then the FFN, each wrapped by add_and_norm."))
    raise CheckFailure(t(
        "For a {name} layer {what}, your output differs from torch.nn.TransformerDecoderLayer's with the same "
        "weights ({difference}). {hint}", name=name, what=what,
        difference=difference(got, expected, _layer_sizes(s, x, memory)), hint=hint))


def _placement_name(norm_first: bool) -> str:
    """"pre-norm" or "post-norm", as a message names the layer."""
    return t("pre-norm") if norm_first else t("post-norm")


@jaxtyped(typechecker=beartype)
def _dropped(state: dict[str, Tensor], x: Float[Tensor, "batch tgt_len d_model"], norm_first: bool,
             undropped: tuple[int, ...] = ()) -> Float[Tensor, "batch tgt_len d_model"]:
    """The layer's output in training with p = 1 when only the sublayers in ``undropped`` skip their dropout1-3.

    Dropping every attention weight leaves an attention's output w_o's bias alone, dropping every hidden unit
    leaves the FFN's output linear2's bias alone; dropout1-3 then make them zero.
    """
    biases = (state["self_attn.w_o.bias"], state["cross_attn.w_o.bias"], state["ffn.linear2.bias"])
    h = x
    for i, (bias, norm) in enumerate(zip(biases, ("norm1", "norm2", "norm3"), strict=True), start=1):
        f = bias if i in undropped else torch.zeros_like(bias)
        h = h + f if norm_first else _layer_norm(state, norm, h + f)
    return h


DROPOUT_MISTAKES = {
    (1, 2, 3): marked("your layer ignores dropout1, dropout2 and dropout3: apply each to its sublayer's output, "
                      "before the residual add."),
    (1,): marked("your self-attention sublayer skips dropout1: apply it to the sublayer's output, before the residual "
                 "add."),
    (2,): marked("your cross-attention sublayer skips dropout2: apply it to the sublayer's output, before the "
                 "residual add."),
    (3,): marked("your feed-forward sublayer skips dropout3: apply it to the sublayer's output, before the residual "
                 "add."),
}


def _check_dropout_and_activation(cls: Callable[..., Any], s: dict[str, int], norm_first: bool, dtype: torch.dtype,
                                  seed: int, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> None:
    """Given GELU parts and dropout=1.0: PyTorch's GELU layer in eval(); in training every sublayer's output is
    dropped, which leaves x (pre-norm) or norm3(norm2(norm1(x))) (post-norm)."""
    module = _build_layer(cls, s, 1.0, norm_first, activation="gelu", dtype=dtype)
    _expect_parameters(module, _layer_shapes(s), t("Your DecoderLayer"), tr(LAYER_HINT))
    oracle = _torch_layer(s, norm_first, dtype, seed + 1, activation="gelu")
    state = _layer_state(oracle)
    call(_load, module, state)
    _compare(module, oracle, state, s, norm_first, dtype, x, memory, src_mask, tgt_mask,
             t("given a GELU FeedForward and dropout=1.0, in eval() mode (where dropout does nothing)"), "gelu")
    call(_set_training, module, True)
    got = expect_tensor(call(module, x, memory, src_mask, tgt_mask), t("the output in training"), tuple(x.shape),
                        "batch tgt_len d_model", dtype)
    expected = _dropped(state, x, norm_first)
    if not close(got, expected, dtype):
        hint = next((tr(h) for undropped, h in DROPOUT_MISTAKES.items()
                     if close(got, _dropped(state, x, norm_first, undropped), dtype)),
                    t("dropout1, dropout2 and dropout3 act on each sublayer's output, before the residual add, never "
                      "on the residual stream x."))
        found = difference(got, expected, _layer_sizes(s, x, memory))
        if norm_first:
            raise CheckFailure(t("With dropout=1.0 in training mode, a pre-norm layer drops all three sublayers' "
                                 "outputs and should return x itself ({difference}); {hint}", difference=found,
                                 hint=hint))
        raise CheckFailure(t("With dropout=1.0 in training mode, a post-norm layer drops all three sublayers' outputs "
                             "and should return norm3(norm2(norm1(x))) ({difference}); {hint}", difference=found,
                             hint=hint))


def _check_decoder_only(cls: Callable[..., Any], s: dict[str, int], norm_first: bool, dtype: torch.dtype, seed: int,
                        x: Tensor) -> None:
    """cross_attn=None, norm2=None is a decoder-only (GPT) block: PyTorch's encoder layer under a causal mask, whose
    norm2 is our norm3."""
    what = t("a {name} layer given cross_attn=None and norm2=None (a decoder-only block), memory=None and a causal "
             "mask", name=_placement_name(norm_first))
    module = _build_layer(cls, s, 0.0, norm_first, cross_attention=False, dtype=dtype)
    oracle = _torch_encoder_layer(s, norm_first, dtype, seed + 2)
    state = {key.replace("norm2.", "norm3."): value for key, value in _encoder_layer_state(oracle).items()}
    if "norm2.weight" in call(_layout, module)["shapes"]:  # unused here: its own values, so that using it shows
        g = torch.Generator().manual_seed(seed + 19)
        state["norm2.weight"] = 1 + 0.3 * torch.randn(s["d_model"], generator=g, dtype=dtype)
        state["norm2.bias"] = 0.3 * torch.randn(s["d_model"], generator=g, dtype=dtype)
    call(_load, module, state)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    try:
        got = call(module, x, None, None, causal)
    except CheckFailure as failure:
        raise CheckFailure(t("For {what}: {failure}\nWithout cross-attention the layer needs no memory: skip the "
                             "middle sublayer when self.cross_attn is None.", what=what, failure=failure)) \
            from failure
    got = expect_tensor(got, t("the decoder-only block's output"), tuple(x.shape), "batch tgt_len d_model", dtype)
    expected = _run_encoder_layer(oracle, x, causal)
    if close(got, expected, dtype):
        return
    if "norm2.weight" in state and close(got, _norm2_for_ffn(state, s, x, causal, norm_first), dtype):
        hint = t("Your feed-forward sublayer is normalised by norm2, which belongs to the missing cross-attention: "
                 "the FFN always has norm3.")
    else:
        hint = t("Masked self-attention (with tgt_mask) and the FFN, each in add_and_norm with norm1 and norm3.")
    raise CheckFailure(t("For {what}, your output differs from torch.nn.TransformerEncoderLayer's under the same "
                         "causal mask ({difference}). {hint}", what=what,
                         difference=difference(got, expected, _layer_sizes(s, x, None)), hint=hint))


@jaxtyped(typechecker=beartype)
def _norm2_for_ffn(state: dict[str, Tensor], s: dict[str, int], x: Float[Tensor, "batch tgt_len d_model"],
                   mask: Bool[Tensor, "tgt_len tgt_len"], norm_first: bool) -> Float[Tensor, "batch tgt_len d_model"]:
    """Self-attention, then the FFN normalised by norm2: the decoder-only block that borrows the idle norm."""
    def sublayer(h: Tensor, f: Callable[[Tensor], Tensor], norm: str) -> Tensor:
        return h + f(_layer_norm(state, norm, h)) if norm_first else _layer_norm(state, norm, h + f(h))

    h = sublayer(x, lambda t: _attention(state, "self_attn", s["heads"], t, t, mask), "norm1")
    return sublayer(h, lambda t: _ffn(state, t), "norm2")


# -- the cache path (chapter 09): the check's own cache-aware attention in the student's layer ------------

class _StepCache:
    """The check's own KV-cache: a growing one (self-attention) or a fixed one (cross-attention)."""

    def __init__(self, fixed: bool) -> None:
        self.fixed = fixed
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]


class _CacheAttention(nn.Module):
    """Multi-head attention with the oracle's weights that reads and writes a :class:`_StepCache`, as chapter 09's
    attention does, and notes which cache each call got (``names`` maps a cache's id to its name)."""

    def __init__(self, state: dict[str, Tensor], prefix: str, heads: int, names: dict[int, str],
                 log: list[str]) -> None:
        super().__init__()
        self.weights = {key.removeprefix(prefix + "."): value for key, value in state.items()
                        if key.startswith(prefix + ".")}
        self.prefix, self.heads, self.names, self.log = prefix, heads, names, log

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                cache: Any = None) -> Tensor:
        self.log.append(f"{self.prefix}:{'none' if cache is None else self.names.get(id(cache), 'other')}")

        def project(name: str, t: Tensor) -> Tensor:
            y = t @ self.weights[f"{name}.weight"].T + self.weights[f"{name}.bias"]
            return rearrange(y, "batch seq (heads d_head) -> batch heads seq d_head", heads=self.heads)

        q, k, v = project("w_q", query), project("w_k", key), project("w_v", value)
        if isinstance(cache, _StepCache) and cache.fixed:
            if cache.keys is None:
                cache.keys, cache.values = k, v
            k, v = cache.keys, cache.values
        elif isinstance(cache, _StepCache):
            cache.keys = k if cache.keys is None else torch.cat([cache.keys, k], dim=-2)
            cache.values = v if cache.values is None else torch.cat([cache.values, v], dim=-2)
            k, v = cache.keys, cache.values
        scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len")
        scores = scores / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        out = einsum(scores.softmax(-1), v,
                     "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
        out = rearrange(out, "batch heads q_len d_head -> batch q_len (heads d_head)")
        return out @ self.weights["w_o.weight"].T + self.weights["w_o.bias"]


def _decode_step_by_step(module: nn.Module, state: dict[str, Tensor], heads: int, x: Tensor, memory: Tensor,
                         src_mask: Tensor) -> dict[str, Any]:
    """Swap the check's cache-aware attention into the student's layer and feed it one target position at a time,
    ``tgt_mask=None`` (a single new position may read everything before it)."""
    log: list[str] = []
    self_cache, cross_cache = _StepCache(fixed=False), _StepCache(fixed=True)
    names = {id(self_cache): "self", id(cross_cache): "cross"}
    module.self_attn = _CacheAttention(state, "self_attn", heads, names, log)
    module.cross_attn = _CacheAttention(state, "cross_attn", heads, names, log)
    cache = types.SimpleNamespace(self_attn=self_cache, cross_attn=cross_cache)  # a LayerCache: its two fields
    try:
        steps = [module(x[:, t:t + 1], memory, src_mask, tgt_mask=None, cache=cache) for t in range(x.shape[1])]
    except Exception as error:  # a cache in the wrong place can break a step: the log says which was wrong
        return {"steps": [], "log": log, "error": f"{type(error).__name__}: {error}"}
    return {"steps": [step if type(step) is Tensor else kind(step) for step in steps], "log": log, "error": ""}


class _Weights(dict):
    """The oracle's weights handed to a helper run through call(): a short repr, should a message show it."""

    def __repr__(self) -> str:
        return t("<the check's weights>")


CACHE_ROUTES = {
    "self": marked("{what}, your {prefix} got {got} as its cache at some steps: pass cache.self_attn to "
                   "self-attention at every step (and only that)."),
    "cross": marked("{what}, your {prefix} got {got} as its cache at some steps: pass cache.cross_attn to "
                    "cross-attention at every step (and only that)."),
}


def _check_cache_path(module: Any, oracle: nn.Module, state: dict[str, Tensor], s: dict[str, int], norm_first: bool,
                      dtype: torch.dtype, x: Tensor, memory: Tensor, src_mask: Tensor) -> None:
    """Decoding one target position at a time with a LayerCache must give the rows of one causal pass (the
    defining property of a KV-cache)."""
    result = call(_decode_step_by_step, module, _Weights(state), s["heads"], x, memory, src_mask)
    routes = {entry.split(":")[1] for entry in result["log"]}
    got_by = {prefix: {e.split(":")[1] for e in result["log"] if e.startswith(prefix)}
              for prefix in ("self_attn", "cross_attn")}
    what = t("Decoding a {name} layer one target position at a time with a LayerCache",
             name=_placement_name(norm_first))
    if routes == {"none"} and not result["error"]:
        raise CheckFailure(t("{what}, your attention modules got cache=None at every "
                             "step: pass cache.self_attn to self-attention and cache.cross_attn to cross-attention, "
                             "as the keyword cache.", what=what))
    if "other" in routes:
        raise CheckFailure(t("{what}, your attention modules got an object other than the two caches: "
                             "pass cache.self_attn to self-attention and cache.cross_attn to cross-attention, not the "
                             "LayerCache itself.", what=what))
    if got_by["self_attn"] == {"cross"} and got_by["cross_attn"] == {"self"}:
        raise CheckFailure(t("{what}, your self-attention got the cross-attention cache and the other way round: "
                             "self-attention reads the growing cache.self_attn, cross-attention the fixed "
                             "cache.cross_attn.", what=what))
    for prefix, expected_route in (("self_attn", "self"), ("cross_attn", "cross")):
        if got_by[prefix] != {expected_route}:
            got = ", ".join(sorted(got_by[prefix]))
            raise CheckFailure(tr(CACHE_ROUTES[expected_route], what=what, prefix=prefix, got=got))
    if result["error"]:
        raise CheckFailure(t("{what}, your layer raised {error}", what=what, error=result["error"]))
    steps = result["steps"]
    bad = next((step for step in steps if type(step) is not Tensor), None)
    if bad is not None:
        raise CheckFailure(t("{what}, your layer returned {kind} instead of a tensor.", what=what, kind=bad))
    got = expect_tensor(torch.cat(steps, dim=1), t("the outputs decoded one position at a time"), tuple(x.shape),
                        "batch tgt_len d_model", dtype)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    expected = _run_torch(oracle, x, memory, src_mask, causal)
    if not close(got, expected, dtype):
        raise CheckFailure(t(
            "{what} gives other outputs than torch.nn.TransformerDecoderLayer's one pass under a causal mask "
            "({difference}). With a cache, x holds only the new position "
            "and tgt_mask is None: hand the caches to the attention and let it read the cached positions.",
            what=what, difference=difference(got, expected, _layer_sizes(s, x, memory))))


def _check_layer(cls: Callable[..., Any], seed: int, dtype: torch.dtype, norm_first: bool) -> None:
    """Every case of one norm placement, the layer given the check's own parts, the cache path included."""
    s = _sizes(seed)
    module = _build_layer(cls, s, 0.0, norm_first, dtype=dtype)
    _expect_parameters(module, _layer_shapes(s), t("Your DecoderLayer"), tr(LAYER_HINT))
    oracle = _torch_layer(s, norm_first, dtype, seed)
    state = _layer_state(oracle)
    call(_load, module, state)
    x, memory, src_mask, tgt_mask = _inputs(s, dtype, seed)
    causal = torch.ones(s["tgt_len"], s["tgt_len"], dtype=torch.bool).tril()
    # Without the source mask first: a layer whose cross-attention reads the decoder then runs (the
    # source's padding mask has the source's length) and its mistake can be named.
    cases = [
        (x, memory, None, tgt_mask, t("with the target mask only")),
        (x, memory, src_mask, tgt_mask, t("with the target mask and the source's padding mask")),
        (x, memory, src_mask, causal, t("with a (tgt_len, tgt_len) causal target mask and the source's padding "
                                        "mask")),
        (x[:1], memory[:1], src_mask[:1], tgt_mask[:1], t("on one sentence pair (batch=1), with both masks")),
        (x[:, :1], memory, src_mask, None, t("for a single target position (tgt_len=1) and tgt_mask=None")),
    ]
    for x_case, memory_case, src_case, tgt_case, what in cases:
        _compare(module, oracle, state, s, norm_first, dtype, x_case, memory_case, src_case, tgt_case, what)
    _check_dropout_and_activation(cls, s, norm_first, dtype, seed, x, memory, src_mask, tgt_mask)
    _check_decoder_only(cls, s, norm_first, dtype, seed, x)
    _check_cache_path(module, oracle, state, s, norm_first, dtype, x, memory, src_mask)


@check(forbid=BUILT_IN_DECODER)
def check_decoder_layer_post_norm(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Given parts with copied weights: equal to torch.nn.TransformerDecoderLayer(norm_first=False), causal and
    padding masks."""
    _check_layer(cls, seed, dtype, norm_first=False)
    passed(t("post-norm DecoderLayer equal to torch.nn.TransformerDecoderLayer with causal and padding masks, for one "
             "sentence and one position, with a GELU FFN, dropout only in training, and as a decoder-only block"
             "; decoding with a LayerCache equals the causal pass ({dtype})", dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_DECODER)
def check_decoder_layer_pre_norm(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Given parts with copied weights: equal to torch.nn.TransformerDecoderLayer(norm_first=True), causal and
    padding masks."""
    _check_layer(cls, seed, dtype, norm_first=True)
    passed(t("pre-norm DecoderLayer equal to torch.nn.TransformerDecoderLayer with causal and padding masks, for one "
             "sentence and one position, with a GELU FFN, dropout only in training, and as a decoder-only block"
             "; decoding with a LayerCache equals the causal pass ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 3: greedy generation for a batch -------------------------------------------------

PAD, BOS, EOS = 0, 1, 2
# Other ids for one case, so that ids written into the loop instead of read from its arguments show.
OTHER_IDS = {"pad_id": 5, "bos_id": 3, "eos_id": 4}


class ToyModel(nn.Module):
    """A small seeded model for the greedy loop: the first source token says at which step a sentence ends.

    ``encode`` gives one-hot rows of the real source tokens; :meth:`next_logits` mixes the source's
    bag of tokens with the last target token (seeded tables), never proposes padding, and proposes
    ``eos_id`` exactly at step ``src[b, 0] - 2`` (1 = the first new token): a first token of 3 ends at
    once, a large one never. After its EOS a sentence would go on with other tokens, if it were asked.
    """

    def __init__(self, vocab: int, seed: int, pad_id: int = PAD, eos_id: int = EOS) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 29)
        self.pad_id, self.eos_id, self.vocab = pad_id, eos_id, vocab
        self.source = nn.Parameter(torch.randn(vocab, vocab, generator=g), requires_grad=False)
        self.bigram = nn.Parameter(torch.randn(vocab, vocab, generator=g), requires_grad=False)

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        real = rearrange(src_mask, "batch 1 1 src_len -> batch src_len 1")
        return F.one_hot(src, self.vocab).to(self.source.dtype) * real

    def next_logits(self, tokens: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        bag = memory.sum(dim=1)
        logits = bag @ self.source + F.one_hot(tokens[:, -1], self.vocab).to(bag.dtype) @ self.bigram
        stop = memory[:, 0].argmax(dim=-1) - 2  # the step at which each sentence ends
        logits[:, self.pad_id] = -1e4
        logits[:, self.eos_id] = torch.where(stop == tokens.shape[1], 1e4, -1e4)
        return logits


class _Shifted:
    """``next_logits`` that differs from ``model.next_logits`` by a fixed seeded bias (pad and EOS untouched):
    a loop that calls ``model.next_logits`` instead of its argument gives other tokens."""

    def __init__(self, model: ToyModel, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 43)
        self.model, self.bias = model, 3 * torch.randn(model.vocab, generator=g)
        self.bias[[model.pad_id, model.eos_id]] = 0.0

    def __call__(self, tokens: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        return self.model.next_logits(tokens, memory, src_mask) + self.bias.to(memory.dtype)


def _reference_greedy(model: ToyModel, src: Tensor, max_new_tokens: int, bos_id: int = BOS,
                      next_logits: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The greedy loop written out: one sentence at a time, each stopping at its own EOS."""
    next_logits = model.next_logits if next_logits is None else next_logits
    pad, eos = model.pad_id, model.eos_id
    src_mask = (src != pad)[:, None, None, :]
    memory = model.encode(src, src_mask)
    rows = []
    steps = 0
    for b in range(src.shape[0]):
        tokens, done = [bos_id], False
        for _ in range(max_new_tokens):
            logits = next_logits(torch.tensor([tokens]), memory[b:b + 1], src_mask[b:b + 1])[0]
            token = pad if done else int(logits.argmax())
            done = done or token == eos
            tokens.append(token)
            if done:
                break
        rows.append(tokens)
        steps = max(steps, len(tokens) - 1)
    # The batch runs until its longest sentence is done: finished sentences get pad_id and are still fed.
    tokens = torch.full((src.shape[0], steps + 1), pad)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = torch.tensor(row)
    all_logits = [next_logits(tokens[:, :step + 1], memory, src_mask) for step in range(steps)]
    return tokens, torch.stack(all_logits, dim=1)


def _sources(stops: list[int], src_len: int, seed: int, pad_id: int = PAD) -> Tensor:
    """Source sentences whose first token makes sentence b end at step stops[b] (0 = never), with padding."""
    g = torch.Generator().manual_seed(seed + 31)
    src = torch.randint(3, 9, (len(stops), src_len), generator=g)
    src[src == pad_id] = 9  # no padding inside a sentence
    src[:, 0] = torch.tensor([stop + 2 if stop else 15 for stop in stops])
    for b, n in enumerate(_lengths(len(stops), src_len, g).tolist()):
        src[b, n:] = pad_id
    return src


def _greedy_variants(model: ToyModel, src: Tensor, max_new_tokens: int, tokens: Tensor, bos_id: int,
                     next_logits: Callable[[Tensor, Tensor, Tensor], Tensor]) -> dict[str, Tensor]:
    """Token tensors that the usual mistakes give."""
    eos, pad = model.eos_id, model.pad_id
    ends = (tokens == eos).any(dim=1)
    variants = {}
    if ends.any():
        first_stop = int((tokens == eos).int().argmax(dim=1)[ends].min())
        variants[t("Your loop stops every sentence at the first EOS of the batch: each sentence stops at its own EOS "
                   "(keep a boolean `finished` per sentence), and the loop ends only when all are finished.")] = \
            tokens[:, :first_stop + 1]
    variants |= {
        t("After a sentence's EOS, your loop keeps writing its argmax tokens: a finished sentence gets pad_id in every "
          "later place (masked_fill the next token where finished)."): _unpadded(model, src, max_new_tokens, bos_id,
                                                                                next_logits),
        t("Your loop always runs max_new_tokens steps: stop as soon as every sentence has produced its EOS."):
            torch.cat([tokens, torch.full((src.shape[0], max_new_tokens + 1 - tokens.shape[1]), pad)], dim=1),
        t("Your loop marks a sentence finished when its new token is not eos_id: the comparison is inverted, a "
          "sentence is finished once it has produced eos_id (finished |= next_token == eos_id)."):
            _unpadded(model, src, max_new_tokens, bos_id, next_logits, "not eos"),
        t("Your loop forgets the sentences that finished at earlier steps: finished is set from the last token alone, "
          "so a sentence after its EOS (given pad_id) counts as unfinished again. Keep them: finished |= next_token "
          "== eos_id."): _unpadded(model, src, max_new_tokens, bos_id, next_logits, "reset"),
    }
    if next_logits != model.next_logits:  # a bound method is made anew at each access: compare, not `is`
        variants[t("Your loop calls model.next_logits: use the next_logits argument, which may be another function "
                   "(chapter 09 passes a cached one).")] = _reference_greedy(model, src, max_new_tokens, bos_id)[0]
    if pad != PAD:
        zero = copy.copy(model)
        zero.pad_id = PAD
        variants[t("Your loop uses pad_id {default}: take model.pad_id ({pad} here), for the source's padding mask "
                   "and for the places after a sentence's EOS.", default=PAD, pad=pad)] = \
            _reference_greedy(zero, src, max_new_tokens, bos_id, next_logits)[0]
    return variants


def _unpadded(model: ToyModel, src: Tensor, max_new_tokens: int, bos_id: int,
              next_logits: Callable[[Tensor, Tensor, Tensor], Tensor], mistake: str = "unpadded") -> Tensor:
    """The batch loop with one mistake: no pad_id after EOS ("unpadded"), finished when the token is not EOS
    ("not eos"), or finished set from the last token alone ("reset")."""
    src_mask = (src != model.pad_id)[:, None, None, :]
    memory = model.encode(src, src_mask)
    tokens = torch.full((src.shape[0], 1), bos_id)
    finished = torch.zeros(src.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        token = next_logits(tokens, memory, src_mask).argmax(dim=-1)
        if mistake != "unpadded":
            token = token.masked_fill(finished, model.pad_id)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if mistake == "not eos":
            finished |= token != model.eos_id
        elif mistake == "reset":
            finished = token == model.eos_id
        else:
            finished |= token == model.eos_id
        if finished.all():
            break
    return tokens


class _Recording:
    """A next_logits that keeps a copy of the tokens each call is given and of the logits it gives back."""

    def __init__(self, next_logits: Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
        self.next_logits = next_logits
        self.tokens: list[Tensor | None] = []
        self.logits: list[Tensor] = []

    def __call__(self, tokens: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        self.tokens.append(tokens.detach().clone() if type(tokens) is Tensor else None)
        logits = self.next_logits(tokens, memory, src_mask)
        self.logits.append(logits.detach().clone())
        return logits


def _recorded_greedy(fn: Callable[..., Any], model: ToyModel, src: Tensor, max_new_tokens: int, bos_id: int,
                     eos_id: int, next_logits: Callable[[Tensor, Tensor, Tensor], Tensor]) -> dict[str, Any]:
    """The student's loop run with a recording next_logits: what each call was given, the error, the tokens."""
    recording = _Recording(next_logits)
    try:
        result = fn(model, src, max_new_tokens, bos_id, eos_id, recording)
        error = ""
    except Exception as raised:  # what it raised is part of the record
        result, error = None, f"{type(raised).__name__}: {raised}"
    tokens = result[0] if type(result) is tuple and len(result) == 2 and type(result[0]) is Tensor else None
    return {"tokens": recording.tokens, "logits": recording.logits, "result": tokens, "error": error}


def _trace_hint(run: dict[str, Any], batch: int) -> str:
    """Name a mistake from what the loop handed next_logits: no start token, tokens appended as rows, or the
    argmax of all the logits at once."""
    seen, logits = run["tokens"], run["logits"]
    if not seen or type(seen[0]) is not Tensor or seen[0].dim() != 2:
        return ""
    first = seen[0]
    if first.shape == (batch, 0):
        return t("The first call of next_logits got tokens of shape {shape}, one short: it gets the "
                 "start token of each sentence alone, (batch, 1) filled with bos_id.", shape=tuple(first.shape))
    if len(seen) < 2 or type(seen[1]) is not Tensor or not logits:
        return ""
    second, step = seen[1], logits[0].argmax(dim=-1)
    if second.shape == (2 * batch, first.shape[1]) and torch.equal(second, torch.cat([first, step[:, None]], dim=0)):
        return t("At its second call next_logits got tokens of shape {shape}: your loop appended the "
                 "new tokens as new rows, along dim 0 (the batch axis). Append them as a new column, along the length "
                 "axis: torch.cat([tokens, next_token[:, None]], dim=1).", shape=tuple(second.shape))
    flat = int(logits[0].flatten().argmax())
    if second.shape == (batch, first.shape[1] + 1) and bool((second[:, -1] == flat).all()) \
            and not torch.equal(second[:, -1], step):
        return t("The token your loop appended at step 1 is {token} for every sentence: the argmax of the whole "
                 "(batch, vocab) logits flattened into one row. Take the argmax over the vocab axis, "
                 "logits.argmax(dim=-1), one token per sentence.", token=flat)
    return ""


def _error_hint(error: str) -> str:
    """What some errors say for themselves about the loop."""
    if "masked_fill() received an invalid combination of arguments - got (Tensor)," in error:
        return t("masked_fill was called with the mask alone: it needs the value to fill in too, model.pad_id for the "
                 "finished sentences.")
    found = re.search(r"Dimension out of range \(expected to be in range of \[-2, 1\], but got (-?\d+)\)", error)
    if found:
        return t("An operation in your loop was asked for dim={dim} of a tensor with two axes: tokens are "
                 "(batch, length) and each step's logits (batch, vocab); a new token goes along dim=1 of tokens.",
                 dim=found.group(1))
    return ""


def _square_hint(fn: Callable[..., Any], s: dict[str, int], seed: int, dtype: torch.dtype) -> str:
    """Rerun the loop where two sizes coincide: right when batch == src_len (a batch size taken from the source's
    length), or the argmax over the batch axis when batch == vocab."""
    src_len, vocab, max_new_tokens = s["src_len"], s["vocab"], 7
    model = ToyModel(vocab, seed).to(dtype)

    def right_for(batch: int) -> bool:
        src = _sources([1 + i % 5 for i in range(batch)], src_len, seed)
        expected, _ = _reference_greedy(model, src, max_new_tokens)
        got = call(_recorded_greedy, fn, model, src, max_new_tokens, BOS, EOS, model.next_logits)["result"]
        return got is not None and got.shape == expected.shape and torch.equal(got, expected)

    # The same ids and next_logits on both: only whether batch == src_len differs.
    if right_for(src_len) and not right_for(src_len - 2):
        return t("With as many sentences as source positions (batch = src_len = {src_len}) your loop gives the right "
                 "tokens, and with batch={other} it does not: a size that your loop uses for the batch (of the "
                 "start tokens, or of finished) is read from the source's length axis, src.shape[1]; the batch is "
                 "src.shape[0].", src_len=src_len, other=src_len - 2)
    src = _sources([1 + i % 5 for i in range(vocab)], src_len, seed)
    run = call(_recorded_greedy, fn, model, src, max_new_tokens, BOS, EOS, model.next_logits)
    seen, logits = run["tokens"], run["logits"]
    if len(seen) >= 2 and type(seen[1]) is Tensor and seen[1].shape == (vocab, 2) and logits:
        across = logits[0].argmax(dim=0)
        if torch.equal(seen[1][:, -1], across) and not torch.equal(across, logits[0].argmax(dim=-1)):
            return t("With a batch of {vocab} sentences, as many as vocab ids, your loop runs, and the token it "
                     "appends to sentence b at step 1 is the argmax of column b over the batch axis "
                     "(logits.argmax(dim=0)): take the argmax over the vocab axis, dim=-1.", vocab=vocab)
    return ""


def _loop_hint(fn: Callable[..., Any], model: ToyModel, src: Tensor, max_new_tokens: int, bos_id: int, eos_id: int,
               next_logits: Callable[[Tensor, Tensor, Tensor], Tensor], error: str, seed: int,
               dtype: torch.dtype) -> str:
    """A verified name for a loop that failed (raised ``error``, or gave other tokens), or ""."""
    run = call(_recorded_greedy, fn, model, src, max_new_tokens, bos_id, eos_id, next_logits)
    hint = _trace_hint(run, src.shape[0]) or _error_hint(error or run["error"])
    if not hint and src.shape[0] > 1:
        sizes = {"batch": src.shape[0], "src_len": src.shape[1], "vocab": model.vocab}
        hint = _square_hint(fn, sizes, seed, dtype)
    return hint


@check
def check_greedy(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Greedy decoding for a batch: each sentence stops at its own EOS, pad_id after it, the loop ends when all have."""
    g = torch.Generator().manual_seed(seed + 37)
    src_len, vocab = 6 + seed % 3, 16
    # (stops, max_new_tokens, ids, what): the ids differ in the third case and next_logits is not
    # model.next_logits there; the last is a batch of one sentence.
    cases = [([2, 5, 1, 3], 7, {}, t("every sentence ends, at different steps")),
             ([4, 0, 2], 6, {}, t("one sentence never ends")),
             ([4, 1, 0, 2], 6, OTHER_IDS, t("pad_id=5, bos_id=3, eos_id=4 and a next_logits other than "
                                            "model.next_logits")),
             ([3], 5, {}, t("one sentence (batch=1)"))]
    for stops, max_new_tokens, ids, what in cases:
        pad_id, bos_id, eos_id = ids.get("pad_id", PAD), ids.get("bos_id", BOS), ids.get("eos_id", EOS)
        model = ToyModel(vocab, seed, pad_id, eos_id).to(dtype)
        next_logits = _Shifted(model, seed) if ids else model.next_logits
        order = torch.randperm(len(stops), generator=g).tolist()
        src = _sources([stops[i] for i in order], src_len, seed, pad_id)
        sizes = {"batch": src.shape[0], "src_len": src_len, "max_new_tokens": max_new_tokens, "vocab": vocab}
        where = t("With {what} ({sizes})", what=what, sizes=", ".join(f"{k}={v}" for k, v in sizes.items()))
        try:
            result = call(fn, model, src, max_new_tokens, bos_id, eos_id, next_logits)
        except CheckFailure as failure:
            hint = _loop_hint(fn, model, src, max_new_tokens, bos_id, eos_id, next_logits, str(failure), seed, dtype)
            raise CheckFailure(t("{failure}\n{where}. {hint}", failure=failure, where=where, hint=hint) if hint
                               else str(failure)) from None
        expected_tokens, expected_logits = _reference_greedy(model, src, max_new_tokens, bos_id, next_logits)
        if type(result) is not tuple or len(result) != 2:
            raise CheckFailure(t("greedy should return a tuple (tokens, logits), got {kind}.", kind=kind(result)))
        tokens, logits = result
        if type(tokens) is not Tensor:
            raise CheckFailure(t("{where}: tokens should be a (batch, length) tensor of torch.long token ids, got "
                                 "{kind}.", where=where, kind=kind(tokens)))
        if tokens.dtype != torch.long or tokens.dim() != 2:
            raise CheckFailure(t("{where}: tokens should be a (batch, length) tensor of torch.long token ids, got "
                                 "shape {shape}, {dtype}.", where=where, shape=tuple(tokens.shape),
                                 dtype=tokens.dtype))
        if tokens.shape[1] >= 1 and not bool((tokens[:, 0] == bos_id).all()):
            raise CheckFailure(t("{where}: every sentence's tokens start with bos_id ({bos_id}): the first place is "
                                 "the start token, the generated ones follow.", where=where, bos_id=bos_id))
        if not torch.equal(tokens, expected_tokens):
            variants = _greedy_variants(model, src, max_new_tokens, expected_tokens, bos_id, next_logits)
            hint = next((h for h, v in variants.items() if tokens.shape == v.shape and torch.equal(tokens, v)),
                        None) or _loop_hint(fn, model, src, max_new_tokens, bos_id, eos_id, next_logits, "", seed,
                                            dtype) or t(
                        "Each step: logits = next_logits(tokens, memory, src_mask), the argmax is the next token "
                        "(pad_id where the sentence is finished), appended to tokens.")
            raise CheckFailure(t("{where}, your tokens\n{tokens}\ndiffer from the expected\n{expected}.\n{hint}",
                                 where=where, tokens=tokens.tolist(), expected=expected_tokens.tolist(), hint=hint))
        if type(logits) is Tensor and logits.shape == expected_logits.transpose(0, 1).shape \
                and logits.shape != expected_logits.shape and close(logits.transpose(0, 1), expected_logits, dtype):
            raise CheckFailure(t("{where}, your tokens are right and your logits have shape {shape}, "
                                 "(steps, batch, vocab): the steps are stacked along dim 0. Stack them along dim=1, "
                                 "torch.stack(steps, dim=1), for (batch, steps, vocab).", where=where,
                                 shape=tuple(logits.shape)))
        logits = expect_tensor(logits, "logits", tuple(expected_logits.shape), "batch steps vocab", dtype)
        if not close(logits, expected_logits, dtype):
            raise CheckFailure(t("{where}, your tokens are right but your logits differ "
                                 "({difference}): return torch.stack of each step's "
                                 "next_logits output along dim=1, (batch, steps, vocab).", where=where,
                                 difference=difference(logits, expected_logits)))
    model = ToyModel(vocab, seed).to(dtype)
    src = _sources([2, 1], src_len, seed)
    error = call(_error_of, fn, model, src, 0, BOS, EOS, model.next_logits)
    if error is None:
        raise CheckFailure(t("greedy(..., max_new_tokens=0, ...) should raise a ValueError (there must be at least "
                             "one step); it raised no error."))
    if error != "ValueError":
        raise CheckFailure(t("greedy(..., max_new_tokens=0, ...) should raise a ValueError (there must be at least "
                             "one step); it raised a {error}.", error=error))
    passed(t("greedy: each sentence stops at its own EOS, pad_id after it, the loop ends when all have; the ids and "
             "next_logits come from the arguments; batch=1; ValueError for max_new_tokens < 1 ({dtype})",
             dtype=dtype_name(dtype)))


# -- exercise 4: predict, then measure ---------------------------------------------------------

class TinySeq2Seq(nn.Module):
    """PyTorch's own encoder-decoder with embeddings and a generator: ``model(src, tgt)`` gives the logits.

    ``causal=False`` leaves the decoder's causal mask out, as a broken model would.
    """

    def __init__(self, vocab: int, d_model: int, heads: int, causal: bool, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nbgrader scores any stderr output (a UserWarning) as a failure
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, d_model, dtype=dtype)
            self.positions = nn.Parameter(torch.randn(32, d_model, dtype=dtype))
            self.transformer = nn.Transformer(d_model, heads, 1, 2, 2 * d_model, dropout=0.0, batch_first=True,
                                              dtype=dtype)
            self.generator = nn.Linear(d_model, vocab, dtype=dtype)
        self.causal = causal
        self.eval()

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        mask = None
        if self.causal:
            mask = ~torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).tril()
        x = self.embed(src) + self.positions[: src.shape[1]]
        y = self.embed(tgt) + self.positions[: tgt.shape[1]]
        with torch.no_grad():
            return self.generator(self.transformer(x, y, tgt_mask=mask))


def _measure(fn: Callable[..., Any], model: nn.Module, src: Tensor, tgt: Tensor, position: int, token: int,
             tol: float | None = None) -> tuple[Any, Tensor]:
    """The student's answer, and the targets as they are after the call (to see whether it changed them)."""
    options = {} if tol is None else {"tol": tol}
    return fn(model, src, tgt, position, token, **options), tgt.clone()


@jaxtyped(typechecker=beartype)
def _largest_changes(model: nn.Module, src: Int[Tensor, "batch src_len"], tgt: Int[Tensor, "batch tgt_len"],
                     position: int, token: int) -> Float[Tensor, "batch tgt_len"]:
    """(batch, tgt_len): how far the logits of each sentence and position move at most."""
    changed = tgt.clone()
    changed[:, position] = token
    return (model(src, changed) - model(src, tgt)).abs().amax(dim=-1)


@jaxtyped(typechecker=beartype)
def _between(changes: Float[Tensor, "batch tgt_len"]) -> float:
    """A tol that splits the positions that move into two groups: halfway (in log) between two middle values."""
    moved = changes[changes > 1e-6].unique().sort().values
    if len(moved) < 2:
        return 2 * moved.max().item() if len(moved) else 1.0
    i = len(moved) // 2
    return math.sqrt(moved[i - 1].item() * moved[i].item())


PROBE_TOLS = (1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def _measure_variants(model: nn.Module, src: Tensor, tgt: Tensor, position: int, token: int,
                      tol: float | None) -> dict[str, Tensor]:
    """The answers that the usual mistakes give, by the hint that names each."""
    tol = 1e-6 if tol is None else tol
    changed = tgt.clone()
    changed[:, position] = token
    after, before = model(src, changed), model(src, tgt)
    change = after - before
    return {
        t("Your answer is True where a logit of the changed run itself exceeds tol in size, whether it changed or not: "
          "subtract the original run, model(src, tgt), before taking .abs()."): after.abs().amax(dim=-1) > tol,
        t("Your answer is True where a logit of the changed run itself exceeds tol, whether it changed or not: "
          "subtract the original run, model(src, tgt), and take .abs() of the difference."): after.amax(dim=-1) > tol,
        t("Your answer takes the largest signed change: a logit that went down by more than tol does not count in "
          "it. Take .abs() of the difference before the max over vocab."): change.amax(dim=-1) > tol,
        t("Your answer takes the largest signed change of model(src, tgt) - model(src, changed): a logit that went up "
          "by more than tol does not count in it. Take .abs() of the difference before the max over vocab."):
            (-change).amax(dim=-1) > tol,
        t("Your answer takes the smallest change over vocab (min): an entry is True when any logit moves by more than "
          "tol, which is the largest change, the max over vocab."): change.abs().amin(dim=-1) > tol,
        t("Your answer takes the mean change over vocab: an entry is True when any logit moves by more than tol, "
          "which is the largest change, the max over vocab."): change.abs().mean(dim=-1) > tol,
        t("Your answer takes the summed change over vocab: an entry is True when any logit moves by more than tol, "
          "which is the largest change, the max over vocab."): change.abs().sum(dim=-1) > tol,
    }


@check
def check_logits_that_change(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Measured, not assumed: on a causal model positions >= position change; on a model without the mask, all do."""
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed + 41)
    vocab = 9
    src = torch.randint(1, vocab, (s["batch"], s["src_len"]), generator=g)
    tgt = torch.randint(1, vocab, (s["batch"], s["tgt_len"]), generator=g)
    sizes = {"batch": s["batch"], "src_len": s["src_len"], "tgt_len": s["tgt_len"], "vocab": vocab}
    models = {causal: TinySeq2Seq(vocab, s["d_model"], s["heads"], causal, seed, dtype) for causal in (True, False)}
    # The last case passes a tol between the changes measured, so that only some positions count as changed.
    changes = _largest_changes(models[True], src, tgt, s["tgt_len"] // 2, int((tgt[0, s["tgt_len"] // 2] + 1) % vocab))
    for causal, position, tol in ((True, s["tgt_len"] // 2, None), (True, 0, None), (False, s["tgt_len"] - 2, None),
                                  (True, s["tgt_len"] // 2, _between(changes))):
        model = models[causal]
        token = int((tgt[0, position] + 1) % vocab)
        # A copy of tgt: ours must stay as it is.
        result = call(_measure, fn, model, src, tgt.clone(), position, token, tol)
        got, after = result if type(result) is tuple and len(result) == 2 else (result, tgt)
        if not torch.equal(after, tgt):
            raise CheckFailure(t("Your function changed the caller's tgt in place: change a copy (tgt.clone()), or "
                                 "the second run compares the changed targets with themselves."))
        measured = _largest_changes(model, src, tgt, position, token)
        expected = measured > (1e-6 if tol is None else tol)
        if type(got) is not Tensor:
            raise CheckFailure(t("logits_that_change should return a boolean torch.Tensor, got {kind}.",
                                 kind=kind(got)))
        if got.dtype != torch.bool:
            raise CheckFailure(t("logits_that_change should return a boolean torch.Tensor, got {kind} of dtype "
                                 "{dtype}.", kind=kind(got), dtype=got.dtype))
        if tuple(got.shape) != tuple(expected.shape):
            raise CheckFailure(t("The answer should have shape (batch, tgt_len) = {expected}, one entry "
                                 "per sentence and position, got {shape}: reduce over vocab only.",
                                 expected=tuple(expected.shape), shape=tuple(got.shape)))
        if torch.equal(got, expected):
            continue
        steps = torch.arange(s["tgt_len"]).expand_as(expected)
        if tol is None:
            what = t("a causal model") if causal else t("a model whose decoder has no causal mask")
        else:
            what = t("a causal model with tol={tol:.3g}", tol=tol) if causal else \
                t("a model whose decoder has no causal mask with tol={tol:.3g}", tol=tol)
        mistaken = [h for h, v in _measure_variants(model, src, tgt, position, token, tol).items()
                    if torch.equal(got, v) and not torch.equal(v, expected)]
        for probe in PROBE_TOLS if len(mistaken) > 1 else ():
            # Several mistakes give this answer: ask again with other tols, where they differ.
            again = call(_measure, fn, model, src, tgt.clone(), position, token, probe)
            answer = again[0] if type(again) is tuple and len(again) == 2 else again
            variants = _measure_variants(model, src, tgt, position, token, probe)
            mistaken = [h for h in mistaken if type(answer) is Tensor and answer.shape == variants[h].shape
                        and torch.equal(answer, variants[h])]
        if tol is not None and torch.equal(got, measured > 1e-6):
            hint = t("Your answer ignores tol: an entry is True only where the largest change of a logit exceeds the "
                     "tol passed in (its default is 1e-6).")
        elif torch.equal(got, steps >= position) or torch.equal(got, steps > position):
            hint = t("Your answer is the causal pattern, not a measurement: on a model without the causal mask every "
                     "position reads the changed token. Run the model twice and compare the logits.")
        elif len(mistaken) == 1:
            hint = mistaken[0]
        elif torch.equal(got, torch.ones_like(got)):
            hint = t("Every entry is True, also where the change cannot reach on a causal model: an entry compares "
                     "the changed run with the original, at one position, reduced over vocab only.")
        else:
            hint = t("Entry [b, i] is True when any logit of sentence b at position i differs by more than tol "
                     "between model(src, tgt) and model(src, changed).")
        raise CheckFailure(t("On {what}, changing the target token at position {position}, your answer\n"
                             "{got}\ndiffers from the measured\n{expected}\n({difference}).\n{hint}", what=what,
                             position=position, got=got.int().tolist(), expected=expected.int().tolist(),
                             difference=difference(got.int(), expected.int(), sizes), hint=hint))
    passed(t("logits_that_change: measured on a causal model and on one without the mask, with the default tol and "
             "another ({dtype})", dtype=dtype_name(dtype)))
