"""Checks for chapter 08: the target mask, the decoder layer, greedy generation, and a measurement of teacher forcing.

The decoder layer's oracle is PyTorch's own ``torch.nn.TransformerDecoderLayer`` (``batch_first=True``)
with seeded weights copied into the student's module, run with a causal and padding target mask and a
padding mask of the source. To name a mistake, a check compares the student's output with this module's
written-out decoder layer, run with that mistake switched on. Greedy generation is compared with a loop
written out here, on a small seeded model whose sentences end at different steps. Every touch of a
student object goes through :func:`call`.
"""

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor, nn

from stepformer.checks._core import CheckFailure, call, check, close, expect_tensor, kind, passed
from stepformer.checks.encoder import _expect_parameters, _layer_norm, _load, _quiet, _randomise

AXES = ("batch", "tgt_len", "src_len", "heads", "d_head", "d_ff")
# What this chapter asks students to write themselves. (Not MultiHeadAttention, FeedForward, LayerNorm or
# add_and_norm: the notebook hands students the earlier chapters' pieces under those names.)
BUILT_IN_DECODER = {
    "torch.nn.TransformerDecoderLayer": "PyTorch's built-in decoder layer",
    "torch.nn.TransformerDecoder": "PyTorch's built-in decoder",
    "torch.nn.Transformer": "PyTorch's built-in Transformer",
    "torch.nn.MultiheadAttention": "PyTorch's built-in multi-head attention",
    "torch.nn.functional.multi_head_attention_forward": "PyTorch's built-in multi-head attention",
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, d_model = heads * d_head included."""
    if seed == 0:
        sizes = dict(zip(AXES, (3, 5, 7, 2, 4, 11), strict=True))
    else:
        g = torch.Generator().manual_seed(seed)
        while True:
            picks = (torch.randperm(12, generator=g)[: len(AXES)] + 2).tolist()
            sizes = dict(zip(AXES, picks, strict=True))
            d_model = sizes["heads"] * sizes["d_head"]
            if d_model not in picks and sizes["heads"] <= 5 and sizes["batch"] <= 5:
                break
    return {**sizes, "d_model": sizes["heads"] * sizes["d_head"]}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
        "Your mask is only the padding mask: the decoder's self-attention also needs the causal mask, so that "
        "position i cannot read the tokens after it (combine them with &).": keys & torch.ones_like(lower),
        "Your mask is only the causal mask: the padding keys must be hidden too (combine the two with &).":
            lower.expand_as(keys & lower),
        "You combined the two masks with | (or): a key may be read only when it is both not ahead and not padding, "
        "which is &.": keys | lower,
        "Your causal part is the upper triangle: query i may read keys 0 ... i, on and below the diagonal "
        "(tril, not triu).": keys & lower.T,
        "Your causal part leaves out the diagonal: position i may read itself (tril with diagonal 0).":
            keys & lower.tril(-1),
        "Your padding mask lies along the query axis: padding hides keys, the last axis (batch, 1, 1, k_len).":
            queries & lower,
    }


def _return_shape_hint(message: str, s: dict[str, int]) -> str:
    """Name the mistake behind a return value that the signature's shape refused (only one of the two masks)."""
    batch, length = s["batch"], s["tgt_len"]
    if f"bool[{batch},1,1,{length}]" in message:
        return ("\nThat is the shape of the padding mask alone: the decoder's self-attention also needs the causal "
                "mask, so that position i cannot read the tokens after it (combine them with &).")
    if f"bool[{length},{length}]" in message:
        return ("\nThat is the shape of the causal mask alone: the padding keys must be hidden too (combine the two "
                "with &).")
    return ""


@check
def check_target_mask(fn: Callable[..., Any], seed: int = 0) -> None:
    """Causal and padding together: (batch, 1, tgt_len, tgt_len), True where query i may read key j <= i, not a pad."""
    s = _sizes(seed)
    for pad_id in (0, 3):
        tokens = _tokens(s, pad_id, seed + pad_id)
        try:
            got = call(fn, tokens, pad_id)
        except CheckFailure as failure:
            raise CheckFailure(f"{failure}{_return_shape_hint(str(failure), s)}") from failure
        expected = _target_mask_by_definition(tokens, pad_id)
        if type(got) is not Tensor:
            raise CheckFailure(f"target_mask should return a torch.Tensor, got {kind(got)}.")
        if got.dtype != torch.bool:
            raise CheckFailure(f"target_mask should return a boolean mask (True = may attend), got {got.dtype}.")
        variants = _target_mask_variants(tokens, pad_id)
        try:  # a mask of another shape that broadcasts (padding only, causal only) is named by its content
            spread = got.expand(expected.shape)
        except RuntimeError:
            spread = None
        if spread is not None and not torch.equal(spread, expected):
            hint = next((h for h, v in variants.items() if torch.equal(spread, v)), None)
            if hint is not None:
                raise CheckFailure(f"With pad_id={pad_id}, your mask differs from the expected one. {hint}")
        if tuple(got.shape) != tuple(expected.shape):
            raise CheckFailure(
                f"target_mask should have shape (batch, 1, tgt_len, tgt_len) = {tuple(expected.shape)}, got "
                f"{tuple(got.shape)}. The padding mask is (batch, 1, 1, tgt_len) and the causal mask (tgt_len, "
                "tgt_len): combined with &, they broadcast to (batch, 1, tgt_len, tgt_len).")
        if torch.equal(got, expected):
            continue
        hint = next((h for h, v in variants.items() if torch.equal(got, v)),
                    "Entry [b, 0, i, j] is True exactly when j <= i and tokens[b, j] != pad_id.")
        raise CheckFailure(f"With pad_id={pad_id}, your mask differs from the expected one. {hint}")
    passed("target_mask: causal and padding together, (batch, 1, tgt_len, tgt_len)")


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


def _ffn(state: dict[str, Tensor], x: Tensor) -> Tensor:
    hidden = torch.relu(x @ state["ffn.linear1.weight"].T + state["ffn.linear1.bias"])
    return hidden @ state["ffn.linear2.weight"].T + state["ffn.linear2.bias"]


def _reference_layer(state: dict[str, Tensor], heads: int, x: Tensor, memory: Tensor, src_mask: Tensor | None,
                     tgt_mask: Tensor | None, norm_first: bool, mistake: str = "") -> Tensor:
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
    return sublayer(h, lambda t: _ffn(state, t), "norm3")


def _mistaken(state: dict[str, Tensor], heads: int, x: Tensor, memory: Tensor, src_mask: Tensor | None,
              tgt_mask: Tensor, norm_first: bool, mistake: str) -> Tensor:
    """The mistaken layer's output, or NaN where that mistake cannot even run on these inputs."""
    try:
        return _reference_layer(state, heads, x, memory, src_mask, tgt_mask, norm_first, mistake)
    except RuntimeError:  # e.g. the source's mask on keys read from the target: the shapes do not fit
        return torch.full_like(x, math.nan)


def _layer_mistakes(norm_first: bool, masked_source: bool) -> dict[str, str]:
    hints = {
        "cross reads the decoder": (
            "Your cross-attention reads its keys and values from the decoder, not from the encoder's memory: it is "
            "self.cross_attn(h, memory, memory, src_mask), queries from the target, keys and values from the source."),
        "no target mask": (
            "Your self-attention ignores tgt_mask, so every target position reads the positions after it (and the "
            "padding): pass tgt_mask to self.self_attn(h, h, h, tgt_mask)."),
        "no cross-attention": "Your layer leaves out cross-attention: between self-attention and the FFN comes "
                              "AddNorm_2 with self.cross_attn(h, memory, memory, src_mask).",
        "cross first": "Your layer runs cross-attention before self-attention: the order is masked self-attention, "
                       "then cross-attention, then the feed-forward network.",
        "no residual": "Your sublayers have no residual connection: add_and_norm adds the sublayer's input back.",
        "swapped placement": (
            "Your layer computes the other norm placement: pass self.norm_first to add_and_norm in every sublayer "
            "(post-norm: norm(x + dropout(f(x))); pre-norm: x + dropout(f(norm(x))))."),
    }
    if norm_first:
        hints["normed memory"] = ("You normalised the encoder's memory with norm2: in pre-norm only the sublayer's "
                                  "input (the target stream) is normalised; memory is read as it is.")
    if masked_source:
        hints["no source mask"] = (
            "Your cross-attention ignores src_mask, so the target reads the source's padding: pass src_mask to "
            "self.cross_attn(h, memory, memory, src_mask).")
    return hints


def _torch_layer(s: dict[str, int], norm_first: bool, dtype: torch.dtype, seed: int) -> nn.TransformerDecoderLayer:
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        layer = nn.TransformerDecoderLayer(s["d_model"], s["heads"], s["d_ff"], dropout=0.0, batch_first=True,
                                           norm_first=norm_first, dtype=dtype)
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


def _layer_shapes(s: dict[str, int]) -> dict[str, list[int]]:
    d, d_ff = s["d_model"], s["d_ff"]
    shapes = {}
    for attn in ("self_attn", "cross_attn"):
        shapes |= {f"{attn}.{p}.weight": [d, d] for p in ("w_q", "w_k", "w_v", "w_o")}
        shapes |= {f"{attn}.{p}.bias": [d] for p in ("w_q", "w_k", "w_v", "w_o")}
    shapes |= {"ffn.linear1.weight": [d_ff, d], "ffn.linear1.bias": [d_ff], "ffn.linear2.weight": [d, d_ff],
               "ffn.linear2.bias": [d]}
    for norm in ("norm1", "norm2", "norm3"):
        shapes |= {f"{norm}.weight": [d], f"{norm}.bias": [d]}
    return shapes


LAYER_HINT = ("Keep the attribute names of torch.nn.TransformerDecoderLayer, with cross_attn for its multihead_attn: "
              "self_attn and cross_attn (two given MultiHeadAttention), ffn (the given FeedForward), norm1, norm2 and "
              "norm3 (three LayerNorm(d_model)).")


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
               tgt_mask: Tensor) -> Tensor:
    # PyTorch's masks mean the opposite of ours (True = "ignore"); its tgt_mask has no batch axis, so the
    # target's padding goes in as tgt_key_padding_mask, and the causal part as tgt_mask.
    tgt_len = x.shape[1]
    causal = ~torch.ones(tgt_len, tgt_len, dtype=torch.bool).tril()
    tgt_padding = ~tgt_mask[:, 0, -1, :]  # the last query may read every real key
    src_padding = None if src_mask is None else ~src_mask[:, 0, 0, :]
    return _quiet(layer, x, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_padding,
                  memory_key_padding_mask=src_padding)


@check(forbid=BUILT_IN_DECODER)
def check_decoder_layer_init(cls: Callable[..., Any], seed: int = 0) -> None:
    """self_attn, cross_attn, ffn, three separate LayerNorms norm1-norm3, and dropout1-dropout3."""
    s = _sizes(seed)
    module = call(cls, s["d_model"], s["heads"], s["d_ff"], dropout=0.25)
    layout = _expect_parameters(module, _layer_shapes(s), "Your DecoderLayer", LAYER_HINT)
    if ["self_attn", "cross_attn"] in layout["aliases"]:
        raise CheckFailure("Your self_attn and cross_attn are one and the same module: create two "
                           "MultiHeadAttention objects, one for each sublayer.")
    for name in ("dropout1", "dropout2", "dropout3"):
        p = layout["dropouts"].get(name)
        if p is None:
            raise CheckFailure(f"Your DecoderLayer has no {name}: each of the three sublayers' outputs gets its own "
                               "nn.Dropout(dropout), named dropout1, dropout2 and dropout3 as in PyTorch.")
        if p != 0.25:
            raise CheckFailure(f"With dropout=0.25, {name}.p is {p}: pass dropout on to nn.Dropout(dropout).")
    for name in ("self_attn.dropout", "cross_attn.dropout", "ffn.dropout"):
        if layout["dropouts"].get(name) != 0.25:
            raise CheckFailure(f"With dropout=0.25, {name} should drop with p=0.25 too (as in PyTorch): pass dropout "
                               "to both MultiHeadAttention(..., dropout=dropout) and to FeedForward(d_model, d_ff, "
                               "activation, dropout).")
    passed("DecoderLayer: self_attn, cross_attn, ffn, separate norm1-norm3, dropout1-dropout3")


def _check_layer(cls: Callable[..., Any], seed: int, dtype: torch.dtype, norm_first: bool) -> None:
    s = _sizes(seed)
    module = call(cls, s["d_model"], s["heads"], s["d_ff"], dropout=0.0, norm_first=norm_first)
    _expect_parameters(module, _layer_shapes(s), "Your DecoderLayer", LAYER_HINT)
    oracle = _torch_layer(s, norm_first, dtype, seed)
    state = _layer_state(oracle)
    call(_load, module, state)
    x, memory, src_mask, tgt_mask = _inputs(s, dtype, seed)
    name = "pre-norm" if norm_first else "post-norm"
    # Without the source mask first: a layer whose cross-attention reads the decoder then runs (the
    # source's padding mask has the source's length) and its mistake can be named.
    for m, what in ((None, "the target mask only"), (src_mask, "the target mask and the source's padding mask")):
        got = call(module, x, memory, m, tgt_mask)
        got = expect_tensor(got, "the decoder layer's output", tuple(x.shape), "batch tgt_len d_model", dtype)
        expected = _run_torch(oracle, x, memory, m, tgt_mask)
        if close(got, expected, dtype):
            continue
        if torch.isnan(got).any():
            hint = "Your output contains NaN: did a mask reach the softmax inverted (True means 'may attend')?"
        else:
            hint = next((h for mistake, h in _layer_mistakes(norm_first, m is not None).items()
                         if close(got, _mistaken(state, s["heads"], x, memory, m, tgt_mask, norm_first, mistake),
                                  dtype)),
                        "Compare each sublayer with torch.nn.TransformerDecoderLayer's on a small example: masked "
                        "self-attention, cross-attention to memory, then the FFN, each wrapped by add_and_norm.")
        raise CheckFailure(
            f"For a {name} layer with {what}, your output differs from torch.nn.TransformerDecoderLayer's with the "
            f"same weights (largest difference {(got - expected).abs().max().item():.3g}). {hint}")


@check(forbid=BUILT_IN_DECODER)
def check_decoder_layer_post_norm(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.TransformerDecoderLayer(norm_first=False) with copied weights, causal and padding masks."""
    _check_layer(cls, seed, dtype, norm_first=False)
    passed(f"post-norm DecoderLayer equal to torch.nn.TransformerDecoderLayer with causal and padding masks "
           f"({_dtype_name(dtype)})")


@check(forbid=BUILT_IN_DECODER)
def check_decoder_layer_pre_norm(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.TransformerDecoderLayer(norm_first=True) with copied weights, causal and padding masks."""
    _check_layer(cls, seed, dtype, norm_first=True)
    passed(f"pre-norm DecoderLayer equal to torch.nn.TransformerDecoderLayer with causal and padding masks "
           f"({_dtype_name(dtype)})")


# -- exercise 3: greedy generation for a batch -------------------------------------------------

PAD, BOS, EOS = 0, 1, 2


class ToyModel(nn.Module):
    """A small seeded model for the greedy loop: the first source token says at which step a sentence ends.

    ``encode`` gives one-hot rows of the real source tokens; :meth:`next_logits` mixes the source's
    bag of tokens with the last target token (seeded tables), never proposes padding, and proposes
    EOS exactly at step ``src[b, 0] - 2`` (1 = the first new token): a first token of 3 ends at once,
    a large one never. After its EOS a sentence would go on with other tokens, if it were asked.
    """

    def __init__(self, vocab: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 29)
        self.pad_id, self.vocab = PAD, vocab
        self.source = nn.Parameter(torch.randn(vocab, vocab, generator=g), requires_grad=False)
        self.bigram = nn.Parameter(torch.randn(vocab, vocab, generator=g), requires_grad=False)

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        real = rearrange(src_mask, "batch 1 1 src_len -> batch src_len 1")
        return F.one_hot(src, self.vocab).to(self.source.dtype) * real

    def next_logits(self, tokens: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        bag = memory.sum(dim=1)
        logits = bag @ self.source + F.one_hot(tokens[:, -1], self.vocab).to(bag.dtype) @ self.bigram
        stop = memory[:, 0].argmax(dim=-1) - 2  # the step at which each sentence ends
        logits[:, PAD] = -1e4
        logits[:, EOS] = torch.where(stop == tokens.shape[1], 1e4, -1e4)
        return logits


def _reference_greedy(model: ToyModel, src: Tensor, max_new_tokens: int) -> tuple[Tensor, Tensor]:
    """The greedy loop written out: one sentence at a time, each stopping at its own EOS."""
    src_mask = (src != PAD)[:, None, None, :]
    memory = model.encode(src, src_mask)
    rows, logits_rows = [], []
    steps = 0
    for b in range(src.shape[0]):
        tokens, row_logits, done = [BOS], [], False
        for _ in range(max_new_tokens):
            logits = model.next_logits(torch.tensor([tokens]), memory[b:b + 1], src_mask[b:b + 1])[0]
            row_logits.append(logits)
            token = PAD if done else int(logits.argmax())
            done = done or token == EOS
            tokens.append(token)
            if done:
                break
        rows.append(tokens)
        logits_rows.append(row_logits)
        steps = max(steps, len(tokens) - 1)
    # The batch runs until its longest sentence is done: finished sentences get PAD and are still fed.
    tokens = torch.full((src.shape[0], steps + 1), PAD)
    all_logits = []
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = torch.tensor(row)
    for step in range(steps):
        all_logits.append(model.next_logits(tokens[:, :step + 1], memory, src_mask))
    return tokens, torch.stack(all_logits, dim=1)


def _sources(stops: list[int], src_len: int, seed: int) -> Tensor:
    """Source sentences whose first token makes sentence b end at step stops[b] (0 = never), with padding."""
    g = torch.Generator().manual_seed(seed + 31)
    src = torch.randint(3, 9, (len(stops), src_len), generator=g)
    src[:, 0] = torch.tensor([stop + 2 if stop else 15 for stop in stops])
    for b, n in enumerate(_lengths(len(stops), src_len, g).tolist()):
        src[b, n:] = PAD
    return src


def _greedy_variants(model: ToyModel, src: Tensor, max_new_tokens: int, tokens: Tensor) -> dict[str, Tensor]:
    """Token tensors that the usual mistakes give."""
    first_stop = int((tokens == EOS).int().argmax(dim=1)[(tokens == EOS).any(dim=1)].min())
    no_padding = _unpadded(model, src, max_new_tokens)
    return {
        "Your loop stops every sentence at the first EOS of the batch: each sentence stops at its own EOS (keep a "
        "boolean `finished` per sentence), and the loop ends only when all are finished.": tokens[:, :first_stop + 1],
        "After a sentence's EOS, your loop keeps writing its argmax tokens: a finished sentence gets pad_id in every "
        "later place (masked_fill the next token where finished).": no_padding,
        "Your loop always runs max_new_tokens steps: stop as soon as every sentence has produced its EOS.":
            torch.cat([tokens, torch.full((src.shape[0], max_new_tokens + 1 - tokens.shape[1]), PAD)], dim=1),
    }


def _unpadded(model: ToyModel, src: Tensor, max_new_tokens: int) -> Tensor:
    src_mask = (src != PAD)[:, None, None, :]
    memory = model.encode(src, src_mask)
    tokens = torch.full((src.shape[0], 1), BOS)
    finished = torch.zeros(src.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        token = model.next_logits(tokens, memory, src_mask).argmax(dim=-1)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        finished |= token == EOS
        if finished.all():
            break
    return tokens


@check
def check_greedy(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Greedy decoding for a batch: each sentence stops at its own EOS, pad_id after it, the loop ends when all have."""
    g = torch.Generator().manual_seed(seed + 37)
    src_len, vocab = 6 + seed % 3, 16
    model = ToyModel(vocab, seed).to(dtype)
    cases = [([2, 5, 1, 3], 7, "every sentence ends, at different steps"),
             ([4, 0, 2], 6, "one sentence never ends")]
    for stops, max_new_tokens, what in cases:
        order = torch.randperm(len(stops), generator=g).tolist()
        src = _sources([stops[i] for i in order], src_len, seed)
        result = call(fn, model, src, max_new_tokens, BOS, EOS, model.next_logits)
        expected_tokens, expected_logits = _reference_greedy(model, src, max_new_tokens)
        if type(result) is not tuple or len(result) != 2:
            raise CheckFailure(f"greedy should return a tuple (tokens, logits), got {kind(result)}.")
        tokens, logits = result
        if type(tokens) is not Tensor or tokens.dtype != torch.long or tokens.dim() != 2:
            shown = kind(tokens) if type(tokens) is not Tensor else f"shape {tuple(tokens.shape)}, {tokens.dtype}"
            raise CheckFailure(f"tokens should be a (batch, length) tensor of torch.long token ids, got {shown}.")
        if tokens.shape[1] >= 1 and not bool((tokens[:, 0] == BOS).all()):
            raise CheckFailure("Every sentence's tokens start with bos_id: the first place is the start token, "
                               "the generated ones follow.")
        if not torch.equal(tokens, expected_tokens):
            hint = next((h for h, v in _greedy_variants(model, src, max_new_tokens, expected_tokens).items()
                         if tokens.shape == v.shape and torch.equal(tokens, v)),
                        "Each step: logits = next_logits(tokens, memory, src_mask), the argmax is the next token "
                        "(pad_id where the sentence is finished), appended to tokens.")
            raise CheckFailure(f"With {what} (max_new_tokens={max_new_tokens}), your tokens\n{tokens.tolist()}\n"
                               f"differ from the expected\n{expected_tokens.tolist()}.\n{hint}")
        logits = expect_tensor(logits, "logits", tuple(expected_logits.shape), "batch steps vocab", dtype)
        if not close(logits, expected_logits, dtype):
            raise CheckFailure(f"With {what}, your tokens are right but your logits differ: return "
                               "torch.stack of each step's next_logits output along dim=1, (batch, steps, vocab).")
    passed(f"greedy: each sentence stops at its own EOS, pad_id after it, the loop ends when all have "
           f"({_dtype_name(dtype)})")


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


def _measure(fn: Callable[..., Any], model: nn.Module, src: Tensor, tgt: Tensor, position: int,
             token: int) -> tuple[Any, Tensor]:
    """The student's answer, and the targets as they are after the call (to see whether it changed them)."""
    return fn(model, src, tgt, position, token), tgt.clone()


def _changes(model: nn.Module, src: Tensor, tgt: Tensor, position: int, token: int) -> Tensor:
    changed = tgt.clone()
    changed[:, position] = token
    return (model(src, changed) - model(src, tgt)).abs().amax(dim=-1) > 1e-6


@check
def check_logits_that_change(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Measured, not assumed: on a causal model positions >= position change; on a model without the mask, all do."""
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed + 41)
    vocab = 9
    src = torch.randint(1, vocab, (s["batch"], s["src_len"]), generator=g)
    tgt = torch.randint(1, vocab, (s["batch"], s["tgt_len"]), generator=g)
    for causal, position in ((True, s["tgt_len"] // 2), (True, 0), (False, s["tgt_len"] - 2)):
        model = TinySeq2Seq(vocab, s["d_model"], s["heads"], causal, seed, dtype)
        token = int((tgt[0, position] + 1) % vocab)
        result = call(_measure, fn, model, src, tgt.clone(), position, token)  # a copy: ours must stay as it is
        got, after = result if type(result) is tuple and len(result) == 2 else (result, tgt)
        if not torch.equal(after, tgt):
            raise CheckFailure("Your function changed the caller's tgt in place: change a copy (tgt.clone()), or the "
                               "second run compares the changed targets with themselves.")
        expected = _changes(model, src, tgt, position, token)
        if type(got) is not Tensor or got.dtype != torch.bool:
            raise CheckFailure(f"logits_that_change should return a boolean torch.Tensor, got {kind(got)}"
                               f"{f' of dtype {got.dtype}' if type(got) is Tensor else ''}.")
        if tuple(got.shape) != tuple(expected.shape):
            raise CheckFailure(f"The answer should have shape (batch, tgt_len) = {tuple(expected.shape)}, one entry "
                               f"per sentence and position, got {tuple(got.shape)}: reduce over vocab only.")
        if torch.equal(got, expected):
            continue
        steps = torch.arange(s["tgt_len"]).expand_as(expected)
        what = "a causal model" if causal else "a model whose decoder has no causal mask"
        if torch.equal(got, steps >= position) or torch.equal(got, steps > position):
            hint = ("Your answer is the causal pattern, not a measurement: on a model without the causal mask every "
                    "position reads the changed token. Run the model twice and compare the logits.")
        elif torch.equal(got, torch.ones_like(got)):
            hint = ("Every position changed in your measurement: did you compare the changed run with the original, "
                    "and compare per position (reduce over vocab only)?")
        else:
            hint = ("Entry [b, i] is True when any logit of sentence b at position i differs by more than tol "
                    "between model(src, tgt) and model(src, changed).")
        raise CheckFailure(f"On {what}, changing the target token at position {position}, your answer\n"
                           f"{got.int().tolist()}\ndiffers from the measured\n{expected.int().tolist()}.\n{hint}")
    passed(f"logits_that_change: measured on a causal model and on one without the mask ({_dtype_name(dtype)})")
