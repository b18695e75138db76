"""Checks for chapter 07: the embedding, Add & Norm, the encoder layer, the stack, the residual stream's size.

The oracles are PyTorch's own ``torch.nn.TransformerEncoderLayer`` and ``torch.nn.TransformerEncoder``
(``batch_first=True``) with seeded weights, biases and norm parameters that are copied into the
student's module; the embedding is checked against its definition, token rows times sqrt(d_model)
plus the positions' rows. Every touch of a student object (building it, loading weights into it,
switching train/eval, running it) goes through :func:`call`, with the small helpers below. To name a
mistake, a check compares the student's output with this module's own written-out encoder layer,
run with that mistake switched on.
"""

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
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
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import set_training as _set_training

AXES = ("batch", "seq", "heads", "d_head", "d_ff", "vocab", "start")
# What this chapter asks students to write themselves. (Not MultiHeadAttention, FeedForward or
# LayerNorm: the notebook hands students the earlier chapters' pieces under those names.)
BUILT_IN_ENCODER = {
    "torch.nn.TransformerEncoderLayer": marked("PyTorch's built-in encoder layer"),
    "torch.nn.TransformerEncoder": marked("PyTorch's built-in encoder"),
    "torch.nn.Transformer": marked("PyTorch's built-in Transformer"),
    "torch.nn.MultiheadAttention": marked("PyTorch's built-in multi-head attention"),
    "torch.nn.functional.multi_head_attention_forward": marked("PyTorch's built-in multi-head attention"),
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, d_model = heads * d_head included (d_head even: the sinusoidal code pairs channels)."""
    return distinct_sizes(seed, AXES, span=12, fixed=(2, 5, 3, 4, 9, 13, 6), products={"d_model": ("heads", "d_head")},
                          accept=lambda s: s["d_head"] % 2 == 0 and s["heads"] <= 5 and s["batch"] <= 5)


def _quiet(fn: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
    """Run an oracle without gradients or warnings (nbgrader scores any stderr output as a failure)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# -- helpers that touch the student's module, always through call() -------------------------

def _layout(module: nn.Module) -> dict[str, Any]:
    """Parameter shapes, modules stored under two names, dropout probabilities."""
    first: dict[int, str] = {}
    aliases = []
    for name, child in module.named_modules(remove_duplicate=False):
        if id(child) in first and name:
            aliases.append([first[id(child)], name])
        first.setdefault(id(child), name)
    return {
        "shapes": {name: list(p.shape) for name, p in module.named_parameters()},
        "aliases": aliases,
        "dropouts": {name: float(m.p) for name, m in module.named_modules() if isinstance(m, nn.Dropout)},
    }


def _expect_parameters(module: Any, expected: dict[str, list[int]], what: str, hint: str) -> dict[str, Any]:
    layout = call(_layout, module)
    # One layer listed twice (``[layer] * n``) shares every submodule: name the layers, not their norms.
    repeated = [pair for pair in layout["aliases"] if all(re.fullmatch(r"layers\.\d+", name) for name in pair)]
    if repeated:
        first, second = repeated[0]
        raise CheckFailure(t(
            "{what}: {first} and {second} are one and the same layer object, so every layer of the stack shares one "
            "set of weights ([layer] * n lists one layer n times). Build a new layer for each place in the stack: "
            "call the layer's builder once per layer, in a list comprehension or a generator.",
            what=what, first=first, second=second))
    norms = [pair for pair in layout["aliases"] if any("norm" in name for name in pair)]
    if norms:
        first, second = norms[0]
        raise CheckFailure(t(
            "{what}: {first} and {second} are one and the same module, so both sublayers share one LayerNorm's "
            "weight and bias. Each sublayer needs its own: create two LayerNorm(d_model) objects.",
            what=what, first=first, second=second))
    shapes = layout["shapes"]
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckFailure(t("{what} has no parameter {name}. {hint}", what=what, name=name, hint=hint))
        if shapes[name] != shape:
            raise CheckFailure(t("{what}: {name} has shape {shape}; it should be {expected}. {hint}", what=what,
                                 name=name, shape=tuple(shapes[name]), expected=tuple(shape), hint=hint))
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise CheckFailure(t("{what} has unexpected parameters {extra}. {hint}", what=what, extra=extra, hint=hint))
    return layout


# -- a written-out encoder layer, with switches for the usual mistakes (to name them) -----------

def _layer_norm(state: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], state[f"{name}.weight"], state[f"{name}.bias"], 1e-5)


def _attention(state: dict[str, Tensor], prefix: str, heads: int, x: Tensor, mask: Tensor | None) -> Tensor:
    def project(name: str, t: Tensor) -> Tensor:
        return t @ state[f"{prefix}.{name}.weight"].T + state[f"{prefix}.{name}.bias"]

    q, k, v = (rearrange(project(n, x), "batch seq (heads d_head) -> batch heads seq d_head", heads=heads)
               for n in ("w_q", "w_k", "w_v"))
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len")
    scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    out = einsum(scores.softmax(-1), v, "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")
    return project("w_o", rearrange(out, "batch heads seq d_head -> batch seq (heads d_head)"))


def _ffn(state: dict[str, Tensor], prefix: str, x: Tensor, activation: str = "relu") -> Tensor:
    pre = x @ state[f"{prefix}.linear1.weight"].T + state[f"{prefix}.linear1.bias"]
    hidden = F.gelu(pre) if activation == "gelu" else torch.relu(pre)  # exact GELU, as PyTorch's "gelu"
    return hidden @ state[f"{prefix}.linear2.weight"].T + state[f"{prefix}.linear2.bias"]


def _reference_layer(state: dict[str, Tensor], prefix: str, heads: int, x: Tensor, mask: Tensor | None,
                     norm_first: bool, mistake: str = "", activation: str = "relu") -> Tensor:
    """One encoder layer from the weights in ``state`` (names under ``prefix``), or a named mistake of it."""
    norm1, norm2 = f"{prefix}norm1", f"{prefix}norm2" if mistake != "norm1 twice" else f"{prefix}norm1"
    mask = None if mistake == "no mask" else mask
    norm_first = not norm_first if mistake == "swapped placement" else norm_first
    activation = "relu" if mistake == "relu for gelu" else activation

    def sublayer(h: Tensor, f: Callable[[Tensor], Tensor], norm: str) -> Tensor:
        if mistake == "no residual":
            return _layer_norm(state, norm, f(h)) if not norm_first else f(_layer_norm(state, norm, h))
        if mistake == "norm before add" and not norm_first:
            return h + _layer_norm(state, norm, f(h))
        if mistake == "normed residual" and norm_first:
            h = _layer_norm(state, norm, h)
            return h + f(h)
        if norm_first:
            return h + f(_layer_norm(state, norm, h))
        return _layer_norm(state, norm, h + f(h))

    h = sublayer(x, lambda t: _attention(state, f"{prefix}self_attn", heads, t, mask), norm1)
    if mistake == "ffn reads x":
        h = x
    return sublayer(h, lambda t: _ffn(state, f"{prefix}ffn", t, activation), norm2)


def _mask_name(mask: Tensor | None) -> str:
    return t("the causal mask (seq, seq)") if mask is not None and mask.dim() == 2 else t("the padding mask")


def _layer_mistakes(norm_first: bool, mask: Tensor | None, activation: str = "relu") -> dict[str, str]:
    hints = {
        "swapped placement": t(
            "Your layer computes the other norm placement: with norm_first=False (post-norm) each sublayer is "
            "norm(x + dropout(f(x))), with norm_first=True (pre-norm) it is x + dropout(f(norm(x)))."
        ) if not norm_first else t(
            "Your layer ignores norm_first=True: a pre-norm sublayer is x + dropout(f(norm(x))), the norm on the "
            "sublayer's input and the residual x left untouched."
        ),
        "norm1 twice": t("You normalise both sublayers with norm1: the feed-forward sublayer has its own norm2."),
        "ffn reads x": t(
            "Your feed-forward sublayer reads the layer's input x instead of the attention sublayer's output, so the "
            "attention is thrown away: feed the result of the first sublayer into the second."
        ),
        "no residual": t("Your sublayers have no residual connection: add the sublayer's input back (x + ...)."),
    }
    if not norm_first:
        hints["norm before add"] = t(
            "In post-norm the norm comes after the residual add: norm(x + dropout(f(x))), not x + norm(f(x)).")
    else:
        hints["normed residual"] = t(
            "You normalised the residual stream itself (x = norm(x); x = x + f(x)): in pre-norm only the sublayer's "
            "input is normalised, x + dropout(f(norm(x))), and x flows on untouched.")
    if mask is not None:
        hints["no mask"] = t("Your output ignores {mask}: pass mask on to self.self_attn(x, x, x, mask) in every "
                             "layer, or the real positions read the padding (or the future).", mask=_mask_name(mask))
    if activation == "gelu":
        hints["relu for gelu"] = t(
            "Your layer computes ReLU although it was built with activation='gelu': in build_encoder_layer, pass "
            "activation on to FeedForward(d_model, d_ff, activation, dropout) instead of leaving it at its default.")
    return hints


def _diagnose_layer(state: dict[str, Tensor], heads: int, x: Tensor, mask: Tensor | None, norm_first: bool,
                    output: Tensor, fallback: str, activation: str = "relu") -> str:
    if torch.isnan(output).any():
        return t("Your output contains NaN: is a fully padded row masked, or did the mask reach the softmax inverted?")
    for mistake, hint in _layer_mistakes(norm_first, mask, activation).items():
        if close(output, _reference_layer(state, "", heads, x, mask, norm_first, mistake, activation), output.dtype):
            return hint
    return fallback


# -- the oracles: PyTorch's modules with seeded weights, and those weights by our names --------

def _randomise(module: nn.Module, g: torch.Generator) -> None:
    """Seeded weights for every parameter: norms get weights far from 1 and biases far from 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * noise)
            elif p.dim() == 1:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def _torch_layer(s: dict[str, int], norm_first: bool, dtype: torch.dtype, seed: int,
                 activation: str = "relu") -> nn.TransformerEncoderLayer:
    with torch.random.fork_rng(devices=[]):  # PyTorch's initialisation would move the student's RNG
        layer = nn.TransformerEncoderLayer(s["d_model"], s["heads"], s["d_ff"], dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm_first, dtype=dtype)
    _randomise(layer, torch.Generator().manual_seed(seed + 11))
    return layer.eval()


def _layer_state(layer: nn.TransformerEncoderLayer, prefix: str = "") -> dict[str, Tensor]:
    """The layer's weights under this course's names (PyTorch packs W_Q, W_K, W_V in this order)."""
    attn = layer.self_attn
    weights = rearrange(attn.in_proj_weight.detach(), "(qkv d_out) d_in -> qkv d_out d_in", qkv=3)
    biases = rearrange(attn.in_proj_bias.detach(), "(qkv d_out) -> qkv d_out", qkv=3)
    state = {}
    for i, name in enumerate(("w_q", "w_k", "w_v")):
        state[f"{prefix}self_attn.{name}.weight"] = weights[i].clone()
        state[f"{prefix}self_attn.{name}.bias"] = biases[i].clone()
    pairs = {"self_attn.w_o": attn.out_proj, "ffn.linear1": layer.linear1, "ffn.linear2": layer.linear2,
             "norm1": layer.norm1, "norm2": layer.norm2}
    for ours, theirs in pairs.items():
        state[f"{prefix}{ours}.weight"] = theirs.weight.detach().clone()
        state[f"{prefix}{ours}.bias"] = theirs.bias.detach().clone()
    return state


def _layer_shapes(s: dict[str, int], prefix: str = "") -> dict[str, list[int]]:
    d, d_ff = s["d_model"], s["d_ff"]
    shapes = {f"self_attn.{p}.weight": [d, d] for p in ("w_q", "w_k", "w_v", "w_o")}
    shapes |= {f"self_attn.{p}.bias": [d] for p in ("w_q", "w_k", "w_v", "w_o")}
    shapes |= {"ffn.linear1.weight": [d_ff, d], "ffn.linear1.bias": [d_ff], "ffn.linear2.weight": [d, d_ff],
               "ffn.linear2.bias": [d], "norm1.weight": [d], "norm1.bias": [d], "norm2.weight": [d], "norm2.bias": [d]}
    return {prefix + name: shape for name, shape in shapes.items()}


LAYER_HINT = marked("build_encoder_layer hands EncoderLayer its parts, which it keeps under "
                    "torch.nn.TransformerEncoderLayer's names: self_attn (MultiHeadAttention(d_model, heads, "
                    "dropout=dropout)), ffn (FeedForward(d_model, d_ff, activation, dropout), holding linear1 and "
                    "linear2), norm1 and norm2 (two LayerNorm(d_model)).")


def _inputs(s: dict[str, int], dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    """A batch of inputs and its padding mask (batch, 1, 1, seq), True = a real token, every sentence >= 1 token."""
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(s["batch"], s["seq"], s["d_model"], generator=g, dtype=dtype)
    lengths = torch.randint(1, s["seq"] + 1, (s["batch"],), generator=g)
    lengths[0], lengths[-1] = s["seq"], max(1, s["seq"] - 2)
    mask = rearrange(torch.arange(s["seq"]), "seq -> 1 1 1 seq") < rearrange(lengths, "batch -> batch 1 1 1")
    return x, mask


def _run_torch(module: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    # PyTorch's masks mean the opposite of ours: True = "ignore this key". A (seq, seq) mask is its
    # attention mask (the second argument of both the layer and the stack), a padding mask its key padding mask.
    if mask is not None and mask.dim() == 2:
        return _quiet(module, x, ~mask)
    return _quiet(module, x, src_key_padding_mask=None if mask is None else ~mask[:, 0, 0, :])


def _layer_sizes(s: dict[str, int], x: Tensor) -> dict[str, int]:
    """The sizes a failure message names: those of this input (a batch of one, say) and of the layer."""
    return {"batch": x.shape[0], "seq": x.shape[1], "d_model": s["d_model"], "heads": s["heads"], "d_ff": s["d_ff"]}


# -- exercise 1: the embedding ---------------------------------------------------------------

def _sinusoidal(seq_len: int, d_model: int) -> Tensor:
    """The code of section 3.5 of the paper, written out again: (sin, cos) pairs, frequency 10000^(-2i/d)."""
    pos = torch.arange(seq_len, dtype=torch.float64)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(seq_len, d_model, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * frequency), torch.cos(pos * frequency)
    return pe.float()


def _embedding_variants(table: Tensor, positions: Tensor, tokens: Tensor, start: int, d_model: int,
                        max_len: int) -> dict[str, Tensor]:
    """What the usual mistakes give; positions holds the rows of every position 0 ... start + seq - 1."""
    rows, seq = table[tokens], tokens.shape[1]
    here, first = positions[start:start + seq].to(table), positions[:seq].to(table)
    root = math.sqrt(d_model)
    variants = {}
    if start + seq > max_len == start + 1:
        # A table of max_len rows, not extended: its one row left at start broadcasts over every token.
        variants[t("Past max_len your positions stop: every token got the row of position start = {start}, the last "
                   "row of a table of max_len = {max_len} rows. Only the learned table ends at max_len; the "
                   "sinusoidal code is defined for every position, so when start + seq > max_len compute it for "
                   "start + seq positions (sinusoidal_encoding(start + seq, d_model)).", start=start,
                   max_len=max_len)] = rows * root + positions[start]
    # The keys are the hints (translated), "" the right answer; the order is the order they are tried in.
    return {
        "": rows * root + here,
        t("You did not scale the token vectors: multiply them by sqrt(d_model) before adding the positions."):
            rows + here,
        t("You scaled the token vectors by d_model; the scale is sqrt(d_model)."): rows * d_model + here,
        t("You divided the token vectors by sqrt(d_model); they are multiplied by it."): rows / root + here,
        t("You scaled the positions too: only the token vectors are multiplied by sqrt(d_model), then the positions "
          "are added as they are."): (rows + here) * root,
        t("Your positions start at 0 whatever `start` is: the tokens sit at positions start ... start + seq - 1 "
          "(a decoder with a cache embeds one new token at a time, at position start)."): rows * root + first,
        t("Your embedding adds no positions: add the positional code of each position."): rows * root,
        t("You subtracted the positions (the sign is minus): add them, tokens · sqrt(d_model) + positions."):
            rows * root - here,
    } | variants


SEQ_MISMATCH = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton "
                          r"dimension 1\b")


def _raised(failure: CheckFailure) -> str:
    """``"RuntimeError: ..."``: what the student's code raised, where ``failure`` reports it (else ""). Its text is
    PyTorch's or the student's, the same in either language of the checks: the only text a hint may read."""
    return failure.raised if isinstance(failure, CodeRaised) else ""


def _rows_added(raised: str, seq: int) -> int | None:
    """How many rows of positions met ``seq`` token vectors, read off a broadcasting error along the seq axis."""
    found = SEQ_MISMATCH.search(raised)
    if not found:
        return None
    sizes = [int(n) for n in found.groups()]
    others = [n for n in sizes if n != seq]
    return others[0] if len(others) == 1 else None


def _embedding_error_hint(module: Any, tokens: Tensor, start: int, raised: str, s: dict[str, int], max_len: int,
                          positional: str) -> str:
    """What a raised error (``raised``: see :func:`_raised`) shows about the positions' rows; a count is named only
    where a second start agrees."""
    seq = tokens.shape[1]
    if "IndexError: tuple index out of range" in raised:
        return t("An index ran past the end of a tuple: if it is a shape, tokens has two axes, (batch, seq), so the "
                 "number of tokens is tokens.shape[1] (or shape[-1]); there is no axis 2.")
    rows = _rows_added(raised, seq)
    if rows is None:
        return ""
    where = t("{rows} rows of positions met seq = {seq} token vectors at start = {start} (max_len = {max_len})",
              rows=rows, seq=seq, start=start, max_len=max_len)
    if positional == "sinusoidal" and start + seq > max_len and rows == max_len - start:
        return t("Past max_len your positions stop: {where}, so your rows end at position max_len. Only the learned "
                 "table ends at max_len; the sinusoidal code is defined for every position, so when start + seq > "
                 "max_len compute it for start + seq positions (sinusoidal_encoding(start + seq, d_model)).",
                 where=where)
    if positional == "sinusoidal" and start + seq > max_len and rows == 0:
        return t("Past max_len your positions are empty: {where}, so the table you take rows start ... "
                 "start + seq - 1 from has at most start = {start} rows; it needs start + seq = {needed}.",
                 where=where, start=start, needed=start + seq)
    # A second start tells a count that follows start (torch.arange(start) has start entries) from a fixed one.
    other = s["start"] if start == 0 else 0
    try:
        call(module, tokens, other)
        again = None
    except CheckFailure as second:
        again = _rows_added(_raised(second), seq)
    counts = {start: rows, other: again}
    hypotheses = {
        t("one fewer than the tokens"): lambda b: seq - 1,
        t("one more than the tokens"): lambda b: seq + 1,
        t("start (what torch.arange(start) gives: positions 0 ... start - 1; it needs the end too, "
          "torch.arange(start, start + seq))"): lambda b: b,
        t("none at any start (a range from start to start is empty)"): lambda b: 0,
    }
    named = [what for what, count in hypotheses.items() if all(counts[b] == count(b) for b in counts)]
    if len(named) == 1:
        return t("Your positions have the wrong number of rows: {where}, and {again} at start = {other}: always "
                 "{count}. Add the rows of positions start ... start + seq - 1, seq of them.", where=where,
                 again=again, other=other, count=named[0])
    return t("Your positions have the wrong number of rows: {where}. Add the rows of positions start ... "
             "start + seq - 1.", where=where)


def _check_embedding_output(module: Any, table: Tensor, positions: Tensor, s: dict[str, int], dtype: torch.dtype,
                            seed: int, positional: str, max_len: int) -> None:
    """For the sinusoidal code, one more case whose positions run past max_len (it is defined for any position)."""
    g = torch.Generator().manual_seed(seed + 5)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    what = (t("positional={positional!r} (no positions are added)", positional=positional) if positional == "rope"
            else f"positional={positional!r}")
    past = positional == "sinusoidal"
    # The last case is one sentence: a batch of one catches a .squeeze() that drops the batch axis.
    cases = [(s["batch"], 0), (s["batch"], s["start"]), (1, 0)] + ([(s["batch"], max_len - 1)] if past else [])
    for batch, start in cases:
        args = (tokens[:batch],) if start == 0 else (tokens[:batch], start)
        try:
            result = call(module, *args)
        except CheckFailure as failure:
            hint = _embedding_error_hint(module, tokens[:batch], start, _raised(failure), s, max_len, positional)
            raise CheckFailure(t("{failure} {hint}", failure=failure, hint=hint).strip()) from None
        got = expect_tensor(result, t("the embedding of {what}", what=what), (batch, s["seq"], s["d_model"]),
                            "batch seq d_model", dtype)
        variants = _embedding_variants(table, positions, tokens[:batch], start, s["d_model"], max_len)
        if close(got, variants[""], dtype):
            continue
        hint = next((h for h, v in list(variants.items())[1:] if close(got, v, dtype)),
                    t("Compute self.tokens(tokens) * sqrt(d_model), then add the positions' rows."))
        sizes = {"batch": batch, "seq": s["seq"], "d_model": s["d_model"], "vocab": s["vocab"], "start": start}
        fields = dict(what=what, start=start, max_len=max_len, difference=difference(got, variants[""], sizes),
                      hint=hint)
        past_max_len = start + s["seq"] > max_len
        if start == 0 and not past_max_len:
            message = t("The embedding of {what} differs from tokens · sqrt(d_model) + positions ({difference}). "
                        "{hint}", **fields)
        elif start == 0:
            message = t("The embedding of {what} (past max_len={max_len}: the sinusoidal code is defined for every "
                        "position) differs from tokens · sqrt(d_model) + positions ({difference}). {hint}", **fields)
        elif not past_max_len:
            message = t("The embedding of {what} with start={start} differs from tokens · sqrt(d_model) + positions "
                        "({difference}). {hint}", **fields)
        else:
            message = t("The embedding of {what} with start={start} (past max_len={max_len}: the sinusoidal code is "
                        "defined for every position) differs from tokens · sqrt(d_model) + positions ({difference}). "
                        "{hint}", **fields)
        raise CheckFailure(message)


def _buffers(module: nn.Module) -> dict[str, Any]:
    """What the module keeps besides its parameters: its buffers, its state_dict's keys, and a ``sinusoids``
    attribute that is not a buffer (``None`` where there is none)."""
    buffers = dict(module.named_buffers())
    attribute = getattr(module, "sinusoids", None)
    return {"buffers": {name: b.detach().clone() for name, b in buffers.items()},
            "state": sorted(module.state_dict()),
            "plain": None if "sinusoids" in buffers or attribute is None else type(attribute).__name__}


def _check_sinusoids_buffers(cls: Any, module: Any, parameters: list[str], s: dict[str, int], max_len: int) -> None:
    """The buffer of ``module``, and of one built two rows longer and two features wider: its shape follows both."""
    _check_sinusoids_buffer(module, parameters, s["d_model"], max_len)
    wider = call(cls, s["vocab"], s["d_model"] + 2, "sinusoidal", max_len + 2)
    _check_sinusoids_buffer(wider, [], s["d_model"] + 2, max_len + 2)


def _check_sinusoids_buffer(module: Any, parameters: list[str], d_model: int, max_len: int) -> None:
    """``self.sinusoids``: the code of the first max_len positions, a buffer, and not in ``state_dict()``
    (``parameters``: the state_dict's other keys; empty to skip that part)."""
    kept = call(_buffers, module)
    how = t('register it with self.register_buffer("sinusoids", sinusoidal_encoding(max_len, d_model), '
            "persistent=False)")
    what = f"Embedding(positional='sinusoidal', d_model={d_model}, max_len={max_len})"
    if kept["plain"] is not None:
        raise CheckFailure(t("{what}: self.sinusoids is a plain attribute (a {kind}), not a buffer, so "
                             "model.to(device) leaves it behind: {how}.", what=what, kind=kept["plain"], how=how))
    if "sinusoids" not in kept["buffers"]:
        raise CheckFailure(t("{what} has no buffer sinusoids: {how}.", what=what, how=how))
    table = kept["buffers"]["sinusoids"]
    if list(table.shape) != [max_len, d_model]:
        raise CheckFailure(t("{what}: the buffer sinusoids has shape {shape}; it holds the code of the "
                             "first max_len positions, ({max_len}, {d_model}) here (max_len={max_len}, "
                             "d_model={d_model}).", what=what, shape=tuple(table.shape), max_len=max_len,
                             d_model=d_model))
    expected = _sinusoidal(max_len, d_model)
    if not close(table.float(), expected, torch.float32):
        raise CheckFailure(t("{what}: the buffer sinusoids differs from sinusoidal_encoding(max_len, d_model) "
                             "({difference}).", what=what,
                             difference=difference(table.float(), expected, {"max_len": max_len, "d_model": d_model})))
    extra = sorted(set(kept["state"]) - set(parameters)) if parameters else []
    if "sinusoids" in extra:  # only a persistent buffer is in state_dict()
        raise CheckFailure(t("{what}: state_dict() holds 'sinusoids', so the buffer was registered as persistent (the "
                             "default) and every checkpoint would save a table that is a function of the shape: pass "
                             "persistent=False to register_buffer.", what=what))
    if extra:
        raise CheckFailure(t("{what}: state_dict() holds {extra} besides the parameters; the sinusoidal code is "
                             "the only buffer, and it is not saved.", what=what, extra=extra))


def _embedding_module(cls: Any, s: dict[str, int], dtype: torch.dtype, seed: int, positional: str,
                      max_len: int) -> tuple[Any, Tensor, Tensor | None]:
    d_model, vocab = s["d_model"], s["vocab"]
    module = call(cls, vocab, d_model, positional, max_len)
    expected = {"tokens.weight": [vocab, d_model]}
    if positional == "learned":
        expected["positions.embedding.weight"] = [max_len, d_model]
    hint = t("Store the token table as self.tokens = nn.Embedding(vocab, d_model) and, for positional='learned' "
             "only, the given LearnedPositionalEmbedding(max_len, d_model) as self.positions; the sinusoidal code is "
             "fixed, so it has no parameters.")
    _expect_parameters(module, expected, f"Embedding(positional={positional!r})", hint)
    if positional == "sinusoidal":
        _check_sinusoids_buffers(cls, module, list(expected), s, max_len)
    g = torch.Generator().manual_seed(seed + 7)
    # Small token vectors, as the full model's Glorot initialisation gives them.
    table = torch.randn(vocab, d_model, generator=g, dtype=dtype) / math.sqrt(d_model)
    state = {"tokens.weight": table}
    learned = None
    if positional == "learned":
        learned = torch.randn(max_len, d_model, generator=g, dtype=dtype)
        state["positions.embedding.weight"] = learned
    call(_load, module, state)
    return module, table, learned


@check(forbid=BUILT_IN_ENCODER)
def check_embedding_sinusoidal(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Token vectors times sqrt(d_model) plus the sinusoidal code of positions start ... start + seq - 1."""
    s = _sizes(seed)
    max_len = s["start"] + s["seq"] + 3
    module, table, _ = _embedding_module(cls, s, dtype, seed, "sinusoidal", max_len)
    positions = _sinusoidal(max_len + s["seq"], s["d_model"])
    _check_embedding_output(module, table, positions, s, dtype, seed, "sinusoidal", max_len)
    passed(t("Embedding: tokens · sqrt(d_model) + the sinusoidal code, from position 0 or start, past max_len too "
             "({dtype})", dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_ENCODER)
def check_embedding_learned(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Learned positions (a table of max_len rows), rope (no positions added), dropout only in training."""
    s = _sizes(seed)
    max_len = s["start"] + s["seq"] + 3
    module, table, learned = _embedding_module(cls, s, dtype, seed, "learned", max_len)
    _check_embedding_output(module, table, learned, s, dtype, seed, "learned", max_len)
    module, table, _ = _embedding_module(cls, s, dtype, seed, "rope", max_len)
    zeros = torch.zeros(max_len, s["d_model"], dtype=dtype)
    _check_embedding_output(module, table, zeros, s, dtype, seed, "rope", max_len)
    error = call(_error_of, cls, s["vocab"], s["d_model"], "absolute", max_len)
    if error is None:
        raise CheckFailure(t("Embedding(..., positional='absolute') should raise a ValueError (only 'sinusoidal', "
                             "'learned' and 'rope' exist); it raised no error."))
    if error != "ValueError":
        raise CheckFailure(t("Embedding(..., positional='absolute') should raise a ValueError (only 'sinusoidal', "
                             "'learned' and 'rope' exist); it raised a {error}.", error=error))
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=torch.Generator().manual_seed(seed))
    sizes = {"batch": s["batch"], "seq": s["seq"], "d_model": s["d_model"], "vocab": s["vocab"]}
    rows = {"sinusoidal": _sinusoidal(s["seq"], s["d_model"]).to(dtype), "learned": learned[: s["seq"]],
            "rope": torch.zeros(s["seq"], s["d_model"], dtype=dtype)}
    for positional, positions in rows.items():  # each kind of position has its own branch in forward
        dropping = call(cls, s["vocab"], s["d_model"], positional, max_len, 1.0)
        weights = {"tokens.weight": table}
        if positional == "learned":
            weights["positions.embedding.weight"] = learned
        call(_load, dropping, weights)
        kept = call(dropping, tokens)
        call(_set_training, dropping, True)
        dropped = call(dropping, tokens)
        expected = table[tokens] * math.sqrt(s["d_model"]) + positions
        if not close(kept, expected, dtype):
            raise CheckFailure(t("With positional={positional!r} and dropout=1.0 in eval() mode the embedding must be "
                                 "unchanged ({difference}): dropout acts only while training (use "
                                 "self.dropout = nn.Dropout(dropout)).", positional=positional,
                                 difference=difference(kept, expected, sizes)))
        if not close(dropped, torch.zeros_like(expected), dtype):
            raise CheckFailure(t("With positional={positional!r} and dropout=1.0 in training mode every entry is "
                                 "dropped, so the embedding should be all zeros ({difference}): apply self.dropout "
                                 "to the sum of the token vectors and the positions, whatever the kind of positions.",
                                 positional=positional,
                                 difference=difference(dropped, torch.zeros_like(expected), sizes)))
    passed(t("Embedding: learned positions from start, nothing added for rope, dropout only in training ({dtype})",
             dtype=dtype_name(dtype)))


# -- exercise 2: add_and_norm ----------------------------------------------------------------

class _Scale(nn.Module):
    """A stand-in sublayer, f(x) = 2·tanh(x) + 1: its output is not centred, so a misplaced norm shows."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) * 2 + 1


@check(forbid=BUILT_IN_ENCODER)
def check_add_and_norm(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Post-norm norm(x + dropout(f(x))) and pre-norm x + dropout(f(norm(x))), dropout on f's output only."""
    s = _sizes(seed)
    x, _ = _inputs(s, dtype, seed)
    g = torch.Generator().manual_seed(seed + 13)
    with torch.random.fork_rng(devices=[]):
        norm = nn.LayerNorm(s["d_model"], dtype=dtype)
    _randomise(nn.ModuleDict({"norm": norm}), g)
    f, keep, drop_all = _Scale(), nn.Dropout(0.0), nn.Dropout(1.0)

    def n(t: Tensor) -> Tensor:
        return _quiet(norm, t)

    cases = [  # (norm_first, dropout, expected, {hint: what that mistake gives})
        (False, keep, n(x + f(x)), {
            t("You normalised before the residual add: post-norm is norm(x + f(x)), not x + norm(f(x))."):
                x + n(f(x)),
            t("You computed the pre-norm form x + f(norm(x)) for norm_first=False: post-norm is norm(x + f(x))."):
                x + f(n(x)),
            t("You left out the residual: post-norm is norm(x + f(x))."): n(f(x)),
        }),
        (True, keep, x + f(n(x)), {
            t("You computed the post-norm form norm(x + f(x)) for norm_first=True: pre-norm is x + f(norm(x))."):
                n(x + f(x)),
            t("You added the normalised x back: pre-norm is x + f(norm(x)), with the original x, untouched."):
                n(x) + f(n(x)),
            t("You normalised the sublayer's output: pre-norm normalises its input, x + f(norm(x))."): x + n(f(x)),
            t("You left out the residual: pre-norm is x + f(norm(x))."): f(n(x)),
        }),
        (False, drop_all, n(x), {
            t("You did not apply the dropout: post-norm is norm(x + dropout(f(x))), so with p = 1 it gives "
              "norm(x)."): n(x + f(x)),
            t("Dropout must act on the sublayer's output only, before the add: with p = 1, post-norm gives "
              "norm(x)."): n(torch.zeros_like(x)),
            t("Dropout must act on the sublayer's output only, not on the whole result: with p = 1, post-norm gives "
              "norm(x)."): torch.zeros_like(x),
        }),
        (True, drop_all, x, {
            t("You did not apply the dropout: pre-norm is x + dropout(f(norm(x))), so with p = 1 it gives x back."):
                x + f(n(x)),
            t("Dropout must act on the sublayer's output only, before the add: with p = 1, pre-norm gives x back."):
                torch.zeros_like(x),
        }),
    ]
    for norm_first, dropout, expected, variants in cases:
        dropout.train()
        got = call(fn, x, f, norm, dropout, norm_first)
        what = t("add_and_norm(x, f, norm, dropout, norm_first={norm_first}) with dropout p={p}",
                 norm_first=norm_first, p=dropout.p)
        got = expect_tensor(got, what, tuple(x.shape), "batch seq d_model", dtype)
        if not close(got, expected, dtype):
            hint = next((h for h, v in variants.items() if close(got, v, dtype)),
                        t("Post-norm: norm(x + dropout(f(x))); pre-norm: x + dropout(f(norm(x)))."))
            sizes = {"batch": x.shape[0], "seq": x.shape[1], "d_model": x.shape[2]}
            raise CheckFailure(t("{what} differs from the expected sublayer ({difference}). {hint}", what=what,
                                 difference=difference(got, expected, sizes), hint=hint))
    passed(t("add_and_norm: post-norm norm(x + dropout(f(x))), pre-norm x + dropout(f(norm(x))) ({dtype})",
             dtype=dtype_name(dtype)))


# -- exercise 3: the encoder layer and its builder -------------------------------------------

class _Part(nn.Module):
    """A stand-in for a part handed to the student's EncoderLayer, to see where it is kept; never called."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _stored(module: nn.Module, parts: dict[str, Any]) -> dict[str, str]:
    """For each part's attribute: the name of the given part it holds, "None", "missing" or "other" (chapter 08's
    decoder layer too, whose absent parts are given as None)."""
    found = {}
    for name in parts:
        if not hasattr(module, name):
            found[name] = "missing"
            continue
        value = getattr(module, name)
        held = next((given for given, part in parts.items() if part is not None and part is value), "other")
        found[name] = "None" if value is None else held
    return found


def _build_layer(build: Any, s: dict[str, int], norm_first: bool, dtype: torch.dtype, seed: int,
                 dropout: float = 0.0, activation: str = "relu") -> tuple[Any, nn.TransformerEncoderLayer,
                                                                         dict[str, Tensor]]:
    options = {"activation": activation} if activation != "relu" else {}
    module = call(build, s["d_model"], s["heads"], s["d_ff"], dropout=dropout, norm_first=norm_first, **options)
    _expect_parameters(module, _layer_shapes(s), t("The layer that your build_encoder_layer builds"), tr(LAYER_HINT))
    oracle = _torch_layer(s, norm_first, dtype, seed, activation)
    state = _layer_state(oracle)
    call(_load, module, state)
    return module, oracle, state


def _compare_layer(module: Any, oracle: nn.Module, state: dict[str, Tensor], s: dict[str, int], norm_first: bool,
                   dtype: torch.dtype, x: Tensor, mask: Tensor | None, what: str, activation: str = "relu") -> None:
    args = (x,) if mask is None else (x, mask)
    try:
        output = call(module, *args)
    except CheckFailure as failure:  # say which case broke it
        # A layer that reads every mask as a padding mask (mask[:, 0, 0, :], say) breaks on a 2-D one.
        hint = ("\n" + t("A mask may be a (batch, 1, 1, seq) padding mask or a (seq, seq) causal mask: pass it on to "
                         "the attention as it is, where both broadcast against the scores (batch, heads, seq, seq).")
                if mask is not None and mask.dim() == 2 else "")
        raise CheckFailure(t("For {what}: {failure}{hint}", what=what, failure=failure, hint=hint)) from failure
    output = expect_tensor(output, t("the output"), tuple(x.shape), "batch seq d_model", dtype)
    expected = _run_torch(oracle, x, mask)
    if not close(output, expected, dtype):
        fallback = t("Compare each sublayer on one small example with torch.nn.TransformerEncoderLayer's: "
                     "self-attention first, then the feed-forward network, each wrapped by add_and_norm.")
        raise CheckFailure(t(
            "For {what}, your output differs from torch.nn.TransformerEncoderLayer's with the same weights "
            "({difference}). {hint}", what=what, difference=difference(output, expected, _layer_sizes(s, x)),
            hint=_diagnose_layer(state, s["heads"], x, mask, norm_first, output, fallback, activation)))


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_init(answers: tuple[Callable[..., Any], Callable[..., Any]], seed: int = 0) -> None:
    """EncoderLayer keeps its parts (two separate norms) and makes dropout1, dropout2; build_encoder_layer passes
    the sizes and the dropout on to fresh parts.

    ``answers`` is ``(EncoderLayer, build_encoder_layer)``: both the student's, so they travel together.
    """
    cls, build = answers
    s = _sizes(seed)
    d_model = s["d_model"]
    # The class first, with the check's own parts: what it keeps, what it makes, what it refuses.
    with torch.random.fork_rng(devices=[]):
        parts = {"self_attn": _Part("self_attn"), "ffn": _Part("ffn"), "norm1": nn.LayerNorm(d_model),
                 "norm2": nn.LayerNorm(d_model)}
    module = call(cls, *parts.values(), dropout=0.25)
    stored = call(_stored, module, parts)
    for name, how in stored.items():
        if how in ("missing", "None"):
            raise CheckFailure(t("EncoderLayer(self_attn, ffn, norm1, norm2) has no attribute self.{name}: keep each "
                                 "part it is given under its own name (PyTorch's), self.{name} = {name}.", name=name))
        if how != name:
            raise CheckFailure(t("EncoderLayer(self_attn, ffn, norm1, norm2) holds another object as self.{name}: "
                                 "keep each part it is given under its own name (PyTorch's), self.{name} = {name}.",
                                 name=name))
    layout = call(_layout, module)
    for name in ("dropout1", "dropout2"):
        p = layout["dropouts"].get(name)
        if p is None:
            raise CheckFailure(t("Your EncoderLayer has no {name}: each sublayer's output gets its own "
                                 "nn.Dropout(dropout), named dropout1 and dropout2 as in PyTorch.", name=name))
        if p != 0.25:
            raise CheckFailure(t("EncoderLayer(..., dropout=0.25) has {name}.p = {p}: pass dropout on to "
                                 "nn.Dropout(dropout).", name=name, p=p))
    error = call(_error_of, cls, parts["self_attn"], parts["ffn"], parts["norm1"], parts["norm1"])
    if error is None:
        raise CheckFailure(t("EncoderLayer(self_attn, ffn, norm, norm), one norm object handed in for both sublayers, "
                             "should raise a ValueError (each sublayer needs a norm of its own: if norm1 is norm2, "
                             "raise ValueError(...)); it raised no error."))
    if error != "ValueError":
        raise CheckFailure(t("EncoderLayer(self_attn, ffn, norm, norm), one norm object handed in for both sublayers, "
                             "should raise a ValueError (each sublayer needs a norm of its own: if norm1 is norm2, "
                             "raise ValueError(...)); it raised a {error}.", error=error))
    # Then the builder: fresh parts of the right sizes, and the options handed on.
    module = call(build, d_model, s["heads"], s["d_ff"], dropout=0.25)
    layout = _expect_parameters(module, _layer_shapes(s), t("The layer that your build_encoder_layer builds"),
                                tr(LAYER_HINT))
    for name in ("dropout1", "dropout2"):
        p = layout["dropouts"].get(name)
        if p != 0.25:
            # EncoderLayer(..., dropout=0.25) was seen above to make both with p = 0.25.
            raise CheckFailure(t("build_encoder_layer(..., dropout=0.25) gives a layer whose {name}.p is {p}, "
                                 "although your EncoderLayer(..., dropout=0.25) sets 0.25: in build_encoder_layer, "
                                 "pass dropout on to EncoderLayer(self_attn, ffn, norm1, norm2, dropout, norm_first).",
                                 name=name, p=p))
    for name in ("self_attn.dropout", "ffn.dropout"):
        if layout["dropouts"].get(name) != 0.25:
            raise CheckFailure(t("build_encoder_layer(..., dropout=0.25): {name} should drop with p=0.25 too (as in "
                                 "PyTorch): pass dropout to MultiHeadAttention(d_model, heads, dropout=dropout) and "
                                 "FeedForward(d_model, d_ff, activation, dropout).", name=name))
    passed(t("EncoderLayer keeps self_attn, ffn, norm1, norm2 (refusing one norm for both) and makes dropout1, "
             "dropout2; build_encoder_layer passes the sizes and the dropout on"))


def _check_layer(build: Callable[..., Any], seed: int, dtype: torch.dtype, norm_first: bool) -> None:
    s = _sizes(seed)
    module, oracle, state = _build_layer(build, s, norm_first, dtype, seed)
    x, mask = _inputs(s, dtype, seed)
    causal = torch.ones(s["seq"], s["seq"], dtype=torch.bool).tril()
    norm = t("pre-norm") if norm_first else t("post-norm")
    for x_case, m, what in ((x, None, t("a {norm} layer without a mask", norm=norm)),
                            (x, mask, t("a {norm} layer with a padding mask (batch, 1, 1, seq)", norm=norm)),
                            (x, causal, t("a {norm} layer with a causal mask (seq, seq)", norm=norm)),
                            (x[:1], mask[:1], t("a {norm} layer on a batch of one sentence (batch=1), with its "
                                                "padding mask", norm=norm))):
        _compare_layer(module, oracle, state, s, norm_first, dtype, x_case, m, what)
    module, oracle, state = _build_layer(build, s, norm_first, dtype, seed + 1, activation="gelu")
    _compare_layer(module, oracle, state, s, norm_first, dtype, x, mask,
                   t("a {norm} layer built with activation='gelu', with a padding mask", norm=norm),
                   activation="gelu")


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_post_norm(build: Callable[..., Any], seed: int = 0,
                                  dtype: torch.dtype = torch.float32) -> None:
    """build_encoder_layer(norm_first=False) equal to torch.nn.TransformerEncoderLayer with copied weights."""
    _check_layer(build, seed, dtype, norm_first=False)
    passed(t("post-norm EncoderLayer equal to torch.nn.TransformerEncoderLayer without a mask, with a padding mask, "
             "with a causal (seq, seq) mask, for one sentence, and with activation='gelu' ({dtype})",
             dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_pre_norm(build: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """build_encoder_layer(norm_first=True) equal to torch.nn.TransformerEncoderLayer with copied weights."""
    _check_layer(build, seed, dtype, norm_first=True)
    passed(t("pre-norm EncoderLayer equal to torch.nn.TransformerEncoderLayer without a mask, with a padding mask, "
             "with a causal (seq, seq) mask, for one sentence, and with activation='gelu' ({dtype})",
             dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_dropout(build: Callable[..., Any], seed: int = 0) -> None:
    """Dropout only in training; with p = 1 each sublayer's output is dropped before the residual add."""
    s = _sizes(seed)
    dtype = torch.float32
    x, mask = _inputs(s, dtype, seed)
    for norm_first in (False, True):
        module, oracle, state = _build_layer(build, s, norm_first, dtype, seed, dropout=1.0)
        norm = t("pre-norm") if norm_first else t("post-norm")
        _compare_layer(module, oracle, state, s, norm_first, dtype, x, mask,
                       t("a {norm} layer built with dropout=1.0, in eval() mode (where dropout does nothing)",
                         norm=norm))
        call(_set_training, module, True)
        got = expect_tensor(call(module, x, mask), t("the output in training"), tuple(x.shape), "batch seq d_model",
                            dtype)
        if norm_first:
            expected = x
        else:
            expected = _layer_norm(state, "norm2", _layer_norm(state, "norm1", x))
        if not close(got, expected, dtype):
            # Without dropout1 and dropout2, only the attention weights and the FFN's hidden units are dropped:
            # each sublayer then gives its output bias alone.
            b_o, b_2 = state["self_attn.w_o.bias"], state["ffn.linear2.bias"]
            if norm_first:
                undropped = x + b_o + b_2
            else:
                undropped = _layer_norm(state, "norm2", _layer_norm(state, "norm1", x + b_o) + b_2)
            dropouts = call(_layout, module)["dropouts"]
            low = sorted(n for n in ("dropout1", "dropout2") if dropouts.get(n, 1.0) != 1.0)
            if low:
                hint = t("the layer that build_encoder_layer(..., dropout=1.0) builds has {name}.p = {p}: pass "
                         "dropout on from build_encoder_layer to EncoderLayer(self_attn, ffn, norm1, norm2, dropout, "
                         "norm_first), and there to nn.Dropout(dropout).", name=low[0], p=dropouts[low[0]])
            elif close(got, _run_torch(oracle, x, mask), dtype) or close(got, undropped, dtype):
                hint = t("your layer ignores dropout1 and dropout2: apply them to the sublayers' outputs, "
                         "before the residual add.")
            else:
                hint = t("dropout1 and dropout2 act on each sublayer's output, before the residual add, never on the "
                         "residual stream x.")
            fields = dict(difference=difference(got, expected, _layer_sizes(s, x)), hint=hint)
            if norm_first:
                raise CheckFailure(t("With dropout=1.0 in training mode, a pre-norm layer drops both sublayers' "
                                     "outputs entirely and should return x itself ({difference}); {hint}", **fields))
            raise CheckFailure(t("With dropout=1.0 in training mode, a post-norm layer drops both sublayers' outputs "
                                 "entirely and should return norm2(norm1(x)) ({difference}); {hint}", **fields))
    passed(t("EncoderLayer: dropout only in training, on each sublayer's output before the residual add"))


# -- exercise 4: the stack and its builder ----------------------------------------------------

def _torch_encoder(s: dict[str, int], layers: int, norm_first: bool, final_norm: bool, dtype: torch.dtype,
                   seed: int, activation: str = "relu") -> nn.TransformerEncoder:
    layer = _torch_layer(s, norm_first, dtype, seed, activation)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norm = nn.LayerNorm(s["d_model"], dtype=dtype) if final_norm else None
        # No nested tensors: PyTorch would then return zeros at padded positions.
        encoder = nn.TransformerEncoder(layer, layers, norm=norm, enable_nested_tensor=False)
    _randomise(encoder, torch.Generator().manual_seed(seed + 17))
    return encoder.eval()


def _encoder_state(encoder: nn.TransformerEncoder) -> dict[str, Tensor]:
    state = {}
    for i, layer in enumerate(encoder.layers):
        state |= _layer_state(layer, f"layers.{i}.")
    if encoder.norm is not None:
        state["norm.weight"] = encoder.norm.weight.detach().clone()
        state["norm.bias"] = encoder.norm.bias.detach().clone()
    return state


def _reference_stack(state: dict[str, Tensor], heads: int, layers: int, x: Tensor, mask: Tensor | None,
                     norm_first: bool, final_norm: bool, mistake: str, activation: str = "relu") -> Tensor:
    for i in range(layers):
        layer_mask = None if mistake == "no mask" or (mistake == "mask only first" and i) else mask
        x = _reference_layer(state, f"layers.{i}.", heads, x, layer_mask, norm_first,
                             activation="relu" if mistake == "relu for gelu" else activation)
        if mistake == "norm every layer" and final_norm:
            x = _layer_norm(state, "norm", x)
    if final_norm and mistake not in ("no final norm", "norm every layer"):
        x = _layer_norm(state, "norm", x)
    return x


# What the stack itself may get wrong (seen on the check's own layers) ...
STACK_MISTAKES = {  # mistake -> hint, shown with tr(hint, mask=...)
    "no final norm": marked("Your stack leaves out the final LayerNorm: apply self.norm to the last layer's output."),
    "norm every layer": marked("You apply the final norm after every layer: it comes once, after the last layer."),
    "no mask": marked("Your stack ignores {mask}: pass mask on to every layer."),
    "mask only first": marked("Only your first layer gets {mask}: every layer must read it, layer(x, mask)."),
}
# ... and what the built stack may get wrong once the stack itself is right: its layers, or what the builders pass on.
BUILT_MISTAKES = {
    "no mask": marked("Your Encoder hands {mask} to its layers (it does with the check's own layers), but the layers "
                      "that build_encoder makes ignore it: is the mask passed on to self_attn in EncoderLayer "
                      "(exercise 3)?"),
    "relu for gelu": marked("Your layers compute ReLU although the encoder was built with activation='gelu': "
                            "build_encoder must pass activation on to build_encoder_layer for every layer, and "
                            "build_encoder_layer on to FeedForward(d_model, d_ff, activation, dropout)."),
}


class _WrittenLayer(nn.Module):
    """One encoder layer written out by this module from PyTorch's weights: the check's own layer, layer(x, mask)."""

    def __init__(self, state: dict[str, Tensor], index: int, heads: int, norm_first: bool) -> None:
        super().__init__()
        self.state, self.prefix, self.heads, self.norm_first = state, f"layers.{index}.", heads, norm_first

    def __repr__(self) -> str:
        return t("<the check's layer {name}>", name=self.prefix[:-1])

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return _reference_layer(self.state, self.prefix, self.heads, x, mask, self.norm_first)


class _WrittenNorm(nn.Module):
    """The stack's final LayerNorm from PyTorch's weights: the check's own norm."""

    def __init__(self, state: dict[str, Tensor]) -> None:
        super().__init__()
        self.state = state

    def __repr__(self) -> str:
        return t("<the check's final norm>")

    def forward(self, x: Tensor) -> Tensor:
        return _layer_norm(self.state, "norm", x)


def _stack_shapes(s: dict[str, int], layers: int, final_norm: bool) -> dict[str, list[int]]:
    shapes = {}
    for i in range(layers):
        shapes |= _layer_shapes(s, f"layers.{i}.")
    if final_norm:
        shapes |= {"norm.weight": [s["d_model"]], "norm.bias": [s["d_model"]]}
    return shapes


STACK_HINT = marked("Encoder keeps its layers in an nn.ModuleList named layers and its final norm as self.norm "
                    "(nn.Identity() when it is given none); build_encoder hands it `layers` layers from "
                    "build_encoder_layer and, when final_norm is True, a LayerNorm(d_model), otherwise None.")


def _compare_stack(module: Any, state: dict[str, Tensor], oracle: nn.TransformerEncoder, s: dict[str, int],
                   layers: int, norm_first: bool, final_norm: bool, dtype: torch.dtype, x: Tensor, mask: Tensor | None,
                   what: str, activation: str = "relu", built: bool = True) -> None:
    got = call(module, x) if mask is None else call(module, x, mask)
    got = expect_tensor(got, t("the encoder's output"), tuple(x.shape), "batch seq d_model", dtype)
    expected = _run_torch(oracle, x, mask)
    if close(got, expected, dtype):
        return
    if built:
        mistakes = {m: h for m, h in BUILT_MISTAKES.items() if m != "relu for gelu" or activation == "gelu"}
        fallback = t("Your Encoder is right with the check's own layers, so look at what build_encoder hands it: its "
                     "layers (do your EncoderLayer checks pass?) and its final norm.")
    else:
        mistakes = STACK_MISTAKES
        fallback = t("Run x through each layer in order, layer(x, mask), then self.norm.")
    hint = next((tr(h, mask=_mask_name(mask)) for mistake, h in mistakes.items()
                 if close(got, _reference_stack(state, s["heads"], layers, x, mask, norm_first, final_norm, mistake,
                                                activation), dtype)),
                fallback)
    if built:
        source = t("built by build_encoder with final_norm={final_norm}", final_norm=final_norm)
    elif final_norm:
        source = t("Encoder(the check's layers, a final norm)")
    else:
        source = t("Encoder(the check's layers, norm=None)")
    if norm_first:
        where = t("{layers} pre-norm layers, {source}, {what}", layers=layers, source=source, what=what)
    else:
        where = t("{layers} post-norm layers, {source}, {what}", layers=layers, source=source, what=what)
    sizes = _layer_sizes(s, x) | {"layers": layers}
    raise CheckFailure(t("For {where}, your output differs from torch.nn.TransformerEncoder's with the same weights "
                         "({difference}). {hint}", where=where, difference=difference(got, expected, sizes),
                         hint=hint))


@check(forbid=BUILT_IN_ENCODER)
def check_encoder(answers: tuple[Callable[..., Any], Callable[..., Any]], seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> None:
    """Encoder of given layers, and build_encoder's stack, equal to torch.nn.TransformerEncoder (final norm or none).

    ``answers`` is ``(Encoder, build_encoder)``: both the student's, so they travel together.
    """
    cls, build = answers
    s = _sizes(seed)
    layers = 2 + seed % 2
    x, mask = _inputs(s, dtype, seed + 1)
    causal = torch.ones(s["seq"], s["seq"], dtype=torch.bool).tril()
    configurations = ((False, True), (True, True), (True, False), (False, False))

    def cases(norm_first: bool, final_norm: bool) -> list[tuple[Tensor, Tensor | None, str]]:
        found = [(x, mask, t("with a padding mask"))]
        if final_norm:
            found.append((x, None, t("without a mask")))
        if not norm_first and final_norm:  # the mask's other shape and a batch of one, once
            found.append((x[:1], causal, t("on one sentence (batch=1) with a causal mask (seq, seq)")))
        return found

    # The class first, stacking the check's own layers: the wiring alone.
    for norm_first, final_norm in configurations:
        oracle = _torch_encoder(s, layers, norm_first, final_norm, dtype, seed)
        state = _encoder_state(oracle)
        own = [_WrittenLayer(state, i, s["heads"], norm_first) for i in range(layers)]
        module = call(cls, own, _WrittenNorm(state) if final_norm else None)
        for x_case, m, what in cases(norm_first, final_norm):
            _compare_stack(module, state, oracle, s, layers, norm_first, final_norm, dtype, x_case, m, what,
                           built=False)
    # Then the builder: fresh layers of the right sizes, one per place, with the options handed on.
    for norm_first, final_norm in configurations:
        module = call(build, s["d_model"], s["heads"], s["d_ff"], layers, dropout=0.0, norm_first=norm_first,
                      final_norm=final_norm)
        _expect_parameters(module, _stack_shapes(s, layers, final_norm),
                           t("The encoder that your build_encoder(final_norm={final_norm}) builds",
                             final_norm=final_norm), tr(STACK_HINT))
        oracle = _torch_encoder(s, layers, norm_first, final_norm, dtype, seed)
        state = _encoder_state(oracle)
        call(_load, module, state)
        for x_case, m, what in cases(norm_first, final_norm):
            _compare_stack(module, state, oracle, s, layers, norm_first, final_norm, dtype, x_case, m, what)
    # Built with dropout=1.0 and activation="gelu": the builders must hand both on to every layer. In eval() it
    # is PyTorch's GELU encoder; in training, pre-norm without a final norm, every sublayer's output is
    # dropped and x comes back unchanged.
    module = call(build, s["d_model"], s["heads"], s["d_ff"], layers, dropout=1.0, norm_first=True,
                  activation="gelu", final_norm=False)
    layout = _expect_parameters(module, _stack_shapes(s, layers, False),
                                t("The encoder that your build_encoder(final_norm={final_norm}) builds",
                                  final_norm=False), tr(STACK_HINT))
    oracle = _torch_encoder(s, layers, True, False, dtype, seed + 1, activation="gelu")
    state = _encoder_state(oracle)
    call(_load, module, state)
    _compare_stack(module, state, oracle, s, layers, True, False, dtype, x, mask,
                   t("with activation='gelu' and dropout=1.0, in eval() mode, with a padding mask"), "gelu")
    call(_set_training, module, True)
    got = expect_tensor(call(module, x, mask), t("the encoder's output in training"), tuple(x.shape),
                        "batch seq d_model", dtype)
    if not close(got, x, dtype):
        wrong = sorted(name for name, p in layout["dropouts"].items()
                       if name.startswith("layers.") and name.endswith(("dropout1", "dropout2")) and p != 1.0)
        hint = (t("{name} has p={p}: build_encoder must pass dropout on to build_encoder_layer for every layer, and "
                  "build_encoder_layer on to EncoderLayer.", name=wrong[0], p=layout["dropouts"][wrong[0]])
                if wrong else t("Each layer's dropout1 and dropout2 act on its sublayers' outputs only."))
        raise CheckFailure(t(
            "With dropout=1.0 in training mode, a pre-norm encoder without a final norm (build_encoder(..., "
            "final_norm=False)) drops every sublayer's output and should return x itself ({difference}). {hint}",
            difference=difference(got, x, _layer_sizes(s, x) | {"layers": layers}), hint=hint))
    passed(t("Encoder equal to torch.nn.TransformerEncoder, with the check's layers and with build_encoder's: "
             "post-norm and pre-norm, with and without the final norm, with padding and causal masks, for one "
             "sentence; activation and dropout passed on to the layers ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 5: predict, then measure -------------------------------------------------------

class _Layer(nn.Module):
    """PyTorch's encoder layer behind this course's calling convention, layer(x, mask) with True = real token."""

    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return _run_torch(self.layer, x, mask)


@check  # the layers handed in are PyTorch's, so its attention may run here
def check_residual_norms(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """The mean length of a position's vector before the first layer and after each, the mask passed to every layer."""
    s = _sizes(seed)
    x, mask = _inputs(s, dtype, seed + 2)
    layers = nn.ModuleList(_Layer(_torch_layer(s, norm_first=i % 2 == 1, dtype=dtype, seed=seed + 100 * i))
                           for i in range(4))

    def lengths(masked: Tensor | None) -> list[Tensor]:
        h, out = x, [x]
        for layer in layers:
            h = layer(h, masked)
            out.append(h)
        return out

    for m in (mask, None):
        got = call(fn, layers, x, m) if m is not None else call(fn, layers, x)
        stream = lengths(m)
        expected = torch.stack([torch.linalg.vector_norm(h, dim=-1).mean() for h in stream])
        if type(got) is not Tensor:
            raise CheckFailure(t("residual_norms should return a torch.Tensor of {count} numbers, got {kind}: "
                                 "torch.stack the lengths.", count=len(layers) + 1, kind=kind(got)))
        if got.shape == (len(layers),) and close(got, expected[1:], dtype):
            raise CheckFailure(t("You measured after each layer only: entry 0 is the length of x itself, before the "
                                 "first layer, so {layers} layers give {count} numbers.", layers=len(layers),
                                 count=len(layers) + 1))
        got = expect_tensor(got, "residual_norms(layers, x, mask)", (len(layers) + 1,), "depth", dtype)
        if close(got, expected, dtype):
            continue
        variants = {  # hint -> what that mistake gives
            t("You averaged the squared lengths: take the L2 norm over d_model (the square root of the sum of "
              "squares), then the mean."): [(h**2).sum(-1).mean() for h in stream],
            t("You took the norm of the whole tensor: the length is per position (over d_model), averaged over batch "
              "and seq."): [torch.linalg.vector_norm(h) for h in stream],
            t("You took the norm over the wrong axis: the length of a position's vector is over d_model, the last "
              "axis."): [torch.linalg.vector_norm(h, dim=1).mean() for h in stream],
            t("You added the lengths up: average them over batch and seq."): [
                torch.linalg.vector_norm(h, dim=-1).sum() for h in stream],
        }
        if m is not None:
            variants[t("You did not pass the mask on to the layers: call each as layer(x, mask).")] = [
                torch.linalg.vector_norm(h, dim=-1).mean() for h in lengths(None)]
        hint = next((h for h, v in variants.items() if close(got, torch.stack(v), dtype)),
                    t("Entry i is torch.linalg.vector_norm(x, dim=-1).mean() after i layers (entry 0: before any)."))
        sizes = {"batch": s["batch"], "seq": s["seq"], "d_model": s["d_model"], "layers": len(layers)}
        raise CheckFailure(t("Your lengths {got} differ from the expected {expected} ({difference}). {hint}",
                             got=[round(v, 3) for v in got.tolist()], expected=[round(v, 3) for v in expected.tolist()],
                             difference=difference(got, expected, sizes), hint=hint))
    passed(t("residual_norms: the mean length of a position's vector before and after each layer ({dtype})",
             dtype=dtype_name(dtype)))
