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
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import load_state as _load
from stepformer.checks._modules import set_training as _set_training

AXES = ("batch", "seq", "heads", "d_head", "d_ff", "vocab", "start")
# What this chapter asks students to write themselves. (Not MultiHeadAttention, FeedForward or
# LayerNorm: the notebook hands students the earlier chapters' pieces under those names.)
BUILT_IN_ENCODER = {
    "torch.nn.TransformerEncoderLayer": "PyTorch's built-in encoder layer",
    "torch.nn.TransformerEncoder": "PyTorch's built-in encoder",
    "torch.nn.Transformer": "PyTorch's built-in Transformer",
    "torch.nn.MultiheadAttention": "PyTorch's built-in multi-head attention",
    "torch.nn.functional.multi_head_attention_forward": "PyTorch's built-in multi-head attention",
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
        a, b = repeated[0]
        raise CheckFailure(
            f"{what}: {a} and {b} are one and the same layer object, so every layer of the stack shares one set of "
            f"weights ([layer] * n lists one layer n times). Build a new layer for each place in the stack: call the "
            f"layer's builder once per layer, in a list comprehension or a generator."
        )
    norms = [pair for pair in layout["aliases"] if any("norm" in name for name in pair)]
    if norms:
        a, b = norms[0]
        raise CheckFailure(
            f"{what}: {a} and {b} are one and the same module, so both sublayers share one LayerNorm's weight and "
            f"bias. Each sublayer needs its own: create two LayerNorm(d_model) objects."
        )
    shapes = layout["shapes"]
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckFailure(f"{what} has no parameter {name}. {hint}")
        if shapes[name] != shape:
            raise CheckFailure(f"{what}: {name} has shape {tuple(shapes[name])}; it should be {tuple(shape)}. {hint}")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise CheckFailure(f"{what} has unexpected parameters {extra}. {hint}")
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
    return "the causal mask (seq, seq)" if mask is not None and mask.dim() == 2 else "the padding mask"


def _layer_mistakes(norm_first: bool, mask: Tensor | None, activation: str = "relu") -> dict[str, str]:
    hints = {
        "swapped placement": (
            "Your layer computes the other norm placement: with norm_first=False (post-norm) each sublayer is "
            "norm(x + dropout(f(x))), with norm_first=True (pre-norm) it is x + dropout(f(norm(x)))."
            if not norm_first else
            "Your layer ignores norm_first=True: a pre-norm sublayer is x + dropout(f(norm(x))), the norm on the "
            "sublayer's input and the residual x left untouched."
        ),
        "norm1 twice": "You normalise both sublayers with norm1: the feed-forward sublayer has its own norm2.",
        "ffn reads x": (
            "Your feed-forward sublayer reads the layer's input x instead of the attention sublayer's output, so the "
            "attention is thrown away: feed the result of the first sublayer into the second."
        ),
        "no residual": "Your sublayers have no residual connection: add the sublayer's input back (x + ...).",
    }
    if not norm_first:
        hints["norm before add"] = (
            "In post-norm the norm comes after the residual add: norm(x + dropout(f(x))), not x + norm(f(x)).")
    else:
        hints["normed residual"] = (
            "You normalised the residual stream itself (x = norm(x); x = x + f(x)): in pre-norm only the sublayer's "
            "input is normalised, x + dropout(f(norm(x))), and x flows on untouched.")
    if mask is not None:
        hints["no mask"] = (f"Your output ignores {_mask_name(mask)}: pass mask on to self.self_attn(x, x, x, mask) "
                            "in every layer, or the real positions read the padding (or the future).")
    if activation == "gelu":
        hints["relu for gelu"] = (
            "Your layer computes ReLU although it was built with activation='gelu': in build_encoder_layer, pass "
            "activation on to FeedForward(d_model, d_ff, activation, dropout) instead of leaving it at its default.")
    return hints


def _diagnose_layer(state: dict[str, Tensor], heads: int, x: Tensor, mask: Tensor | None, norm_first: bool,
                    output: Tensor, fallback: str, activation: str = "relu") -> str:
    if torch.isnan(output).any():
        return "Your output contains NaN: is a fully padded row masked, or did the mask reach the softmax inverted?"
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


LAYER_HINT = ("build_encoder_layer hands EncoderLayer its parts, which it keeps under "
              "torch.nn.TransformerEncoderLayer's names: self_attn (MultiHeadAttention(d_model, heads, "
              "dropout=dropout)), ffn (FeedForward(d_model, d_ff, activation, dropout), holding linear1 and linear2), "
              "norm1 and norm2 (two LayerNorm(d_model)).")


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
        variants[f"Past max_len your positions stop: every token got the row of position start = {start}, the last "
                 f"row of a table of max_len = {max_len} rows. Only the learned table ends at max_len; the "
                 "sinusoidal code is defined for every position, so when start + seq > max_len compute it for "
                 "start + seq positions (sinusoidal_encoding(start + seq, d_model))."] = rows * root + positions[start]
    return {
        "": rows * root + here,
        "You did not scale the token vectors: multiply them by sqrt(d_model) before adding the positions.":
            rows + here,
        "You scaled the token vectors by d_model; the scale is sqrt(d_model).": rows * d_model + here,
        "You divided the token vectors by sqrt(d_model); they are multiplied by it.": rows / root + here,
        "You scaled the positions too: only the token vectors are multiplied by sqrt(d_model), then the positions "
        "are added as they are.": (rows + here) * root,
        "Your positions start at 0 whatever `start` is: the tokens sit at positions start ... start + seq - 1 "
        "(a decoder with a cache embeds one new token at a time, at position start).": rows * root + first,
        "Your embedding adds no positions: add the positional code of each position.": rows * root,
        "You subtracted the positions (the sign is minus): add them, tokens · sqrt(d_model) + positions.":
            rows * root - here,
    } | variants


SEQ_MISMATCH = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton "
                          r"dimension 1\b")


def _rows_added(failure: str, seq: int) -> int | None:
    """How many rows of positions met ``seq`` token vectors, read off a broadcasting error along the seq axis."""
    found = SEQ_MISMATCH.search(failure)
    if not found:
        return None
    sizes = [int(n) for n in found.groups()]
    others = [n for n in sizes if n != seq]
    return others[0] if len(others) == 1 else None


def _embedding_error_hint(module: Any, tokens: Tensor, start: int, failure: str, s: dict[str, int], max_len: int,
                          positional: str) -> str:
    """What a raised error shows about the positions' rows; a count is named only where a second start agrees."""
    seq = tokens.shape[1]
    if "IndexError: tuple index out of range" in failure:
        return ("An index ran past the end of a tuple: if it is a shape, tokens has two axes, (batch, seq), so the "
                "number of tokens is tokens.shape[1] (or shape[-1]); there is no axis 2.")
    rows = _rows_added(failure, seq)
    if rows is None:
        return ""
    where = f"{rows} rows of positions met seq = {seq} token vectors at start = {start} (max_len = {max_len})"
    if positional == "sinusoidal" and start + seq > max_len and rows == max_len - start:
        return (f"Past max_len your positions stop: {where}, so your rows end at position max_len. Only the learned "
                "table ends at max_len; the sinusoidal code is defined for every position, so when start + seq > "
                "max_len compute it for start + seq positions (sinusoidal_encoding(start + seq, d_model)).")
    if positional == "sinusoidal" and start + seq > max_len and rows == 0:
        return (f"Past max_len your positions are empty: {where}, so the table you take rows start ... start + seq - 1 "
                f"from has at most start = {start} rows; it needs start + seq = {start + seq}.")
    # A second start tells a count that follows start (torch.arange(start) has start entries) from a fixed one.
    other = s["start"] if start == 0 else 0
    try:
        call(module, tokens, other)
        again = None
    except CheckFailure as second:
        again = _rows_added(str(second), seq)
    counts = {start: rows, other: again}
    hypotheses = {
        "one fewer than the tokens": lambda b: seq - 1,
        "one more than the tokens": lambda b: seq + 1,
        "start (what torch.arange(start) gives: positions 0 ... start - 1; it needs the end too, "
        "torch.arange(start, start + seq))": lambda b: b,
        "none at any start (a range from start to start is empty)": lambda b: 0,
    }
    named = [what for what, count in hypotheses.items() if all(counts[b] == count(b) for b in counts)]
    if len(named) == 1:
        return (f"Your positions have the wrong number of rows: {where}, and {again} at start = {other}: always "
                f"{named[0]}. Add the rows of positions start ... start + seq - 1, seq of them.")
    return (f"Your positions have the wrong number of rows: {where}. Add the rows of positions start ... "
            "start + seq - 1.")


def _check_embedding_output(module: Any, table: Tensor, positions: Tensor, s: dict[str, int], dtype: torch.dtype,
                            seed: int, positional: str, max_len: int) -> None:
    """For the sinusoidal code, one more case whose positions run past max_len (it is defined for any position)."""
    g = torch.Generator().manual_seed(seed + 5)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    what = f"positional={positional!r}" + (" (no positions are added)" if positional == "rope" else "")
    past = positional == "sinusoidal"
    # The last case is one sentence: a batch of one catches a .squeeze() that drops the batch axis.
    cases = [(s["batch"], 0), (s["batch"], s["start"]), (1, 0)] + ([(s["batch"], max_len - 1)] if past else [])
    for batch, start in cases:
        args = (tokens[:batch],) if start == 0 else (tokens[:batch], start)
        try:
            result = call(module, *args)
        except CheckFailure as failure:
            hint = _embedding_error_hint(module, tokens[:batch], start, str(failure), s, max_len, positional)
            raise CheckFailure(f"{failure} {hint}".strip()) from None
        got = expect_tensor(result, f"the embedding of {what}", (batch, s["seq"], s["d_model"]),
                            "batch seq d_model", dtype)
        variants = _embedding_variants(table, positions, tokens[:batch], start, s["d_model"], max_len)
        if close(got, variants[""], dtype):
            continue
        hint = next((h for h, v in list(variants.items())[1:] if close(got, v, dtype)),
                    "Compute self.tokens(tokens) * sqrt(d_model), then add the positions' rows.")
        where = "" if start == 0 else f" with start={start}"
        if start + s["seq"] > max_len:
            where += f" (past max_len={max_len}: the sinusoidal code is defined for every position)"
        sizes = {"batch": batch, "seq": s["seq"], "d_model": s["d_model"], "vocab": s["vocab"], "start": start}
        raise CheckFailure(f"The embedding of {what}{where} differs from tokens · sqrt(d_model) + positions "
                           f"({difference(got, variants[''], sizes)}). {hint}")


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
    how = ('register it with self.register_buffer("sinusoids", sinusoidal_encoding(max_len, d_model), '
           "persistent=False)")
    what = f"Embedding(positional='sinusoidal', d_model={d_model}, max_len={max_len})"
    if kept["plain"] is not None:
        raise CheckFailure(f"{what}: self.sinusoids is a plain attribute (a {kept['plain']}), not a buffer, so "
                           f"model.to(device) leaves it behind: {how}.")
    if "sinusoids" not in kept["buffers"]:
        raise CheckFailure(f"{what} has no buffer sinusoids: {how}.")
    table = kept["buffers"]["sinusoids"]
    if list(table.shape) != [max_len, d_model]:
        raise CheckFailure(f"{what}: the buffer sinusoids has shape {tuple(table.shape)}; it holds the code of the "
                           f"first max_len positions, ({max_len}, {d_model}) here (max_len={max_len}, "
                           f"d_model={d_model}).")
    expected = _sinusoidal(max_len, d_model)
    if not close(table.float(), expected, torch.float32):
        raise CheckFailure(f"{what}: the buffer sinusoids differs from sinusoidal_encoding(max_len, d_model) "
                           f"({difference(table.float(), expected, {'max_len': max_len, 'd_model': d_model})}).")
    extra = sorted(set(kept["state"]) - set(parameters)) if parameters else []
    if "sinusoids" in extra:  # only a persistent buffer is in state_dict()
        raise CheckFailure(f"{what}: state_dict() holds 'sinusoids', so the buffer was registered as persistent (the "
                           "default) and every checkpoint would save a table that is a function of the shape: pass "
                           "persistent=False to register_buffer.")
    if extra:
        raise CheckFailure(f"{what}: state_dict() holds {extra} besides the parameters; the sinusoidal code is "
                           "the only buffer, and it is not saved.")


def _embedding_module(cls: Any, s: dict[str, int], dtype: torch.dtype, seed: int, positional: str,
                      max_len: int) -> tuple[Any, Tensor, Tensor | None]:
    d_model, vocab = s["d_model"], s["vocab"]
    module = call(cls, vocab, d_model, positional, max_len)
    expected = {"tokens.weight": [vocab, d_model]}
    if positional == "learned":
        expected["positions.embedding.weight"] = [max_len, d_model]
    hint = ("Store the token table as self.tokens = nn.Embedding(vocab, d_model) and, for positional='learned' only, "
            "the given LearnedPositionalEmbedding(max_len, d_model) as self.positions; the sinusoidal code is fixed, "
            "so it has no parameters.")
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
    passed(f"Embedding: tokens · sqrt(d_model) + the sinusoidal code, from position 0 or start, past max_len too "
           f"({dtype_name(dtype)})")


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
    if error != "ValueError":
        got = "no error" if error is None else f"a {error}"
        raise CheckFailure(f"Embedding(..., positional='absolute') should raise a ValueError (only 'sinusoidal', "
                           f"'learned' and 'rope' exist); it raised {got}.")
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
        what = f"With positional={positional!r} and dropout=1.0"
        if not close(kept, expected, dtype):
            raise CheckFailure(f"{what} in eval() mode the embedding must be unchanged "
                               f"({difference(kept, expected, sizes)}): dropout acts only while training (use "
                               "self.dropout = nn.Dropout(dropout)).")
        if not close(dropped, torch.zeros_like(expected), dtype):
            raise CheckFailure(f"{what} in training mode every entry is dropped, so the embedding should be all "
                               f"zeros ({difference(dropped, torch.zeros_like(expected), sizes)}): apply self.dropout "
                               "to the sum of the token vectors and the positions, whatever the kind of positions.")
    passed(f"Embedding: learned positions from start, nothing added for rope, dropout only in training "
           f"({dtype_name(dtype)})")


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

    cases = [
        (False, keep, n(x + f(x)), {
            "You normalised before the residual add: post-norm is norm(x + f(x)), not x + norm(f(x)).":
                x + n(f(x)),
            "You computed the pre-norm form x + f(norm(x)) for norm_first=False: post-norm is norm(x + f(x)).":
                x + f(n(x)),
            "You left out the residual: post-norm is norm(x + f(x)).": n(f(x)),
        }),
        (True, keep, x + f(n(x)), {
            "You computed the post-norm form norm(x + f(x)) for norm_first=True: pre-norm is x + f(norm(x)).":
                n(x + f(x)),
            "You added the normalised x back: pre-norm is x + f(norm(x)), with the original x, untouched.":
                n(x) + f(n(x)),
            "You normalised the sublayer's output: pre-norm normalises its input, x + f(norm(x)).": x + n(f(x)),
            "You left out the residual: pre-norm is x + f(norm(x)).": f(n(x)),
        }),
        (False, drop_all, n(x), {
            "You did not apply the dropout: post-norm is norm(x + dropout(f(x))), so with p = 1 it gives norm(x).":
                n(x + f(x)),
            "Dropout must act on the sublayer's output only, before the add: with p = 1, post-norm gives norm(x).":
                n(torch.zeros_like(x)),
            "Dropout must act on the sublayer's output only, not on the whole result: with p = 1, post-norm gives "
            "norm(x).": torch.zeros_like(x),
        }),
        (True, drop_all, x, {
            "You did not apply the dropout: pre-norm is x + dropout(f(norm(x))), so with p = 1 it gives x back.":
                x + f(n(x)),
            "Dropout must act on the sublayer's output only, before the add: with p = 1, pre-norm gives x back.":
                torch.zeros_like(x),
        }),
    ]
    for norm_first, dropout, expected, variants in cases:
        dropout.train()
        got = call(fn, x, f, norm, dropout, norm_first)
        what = f"add_and_norm(x, f, norm, dropout, norm_first={norm_first}) with dropout p={dropout.p}"
        got = expect_tensor(got, what, tuple(x.shape), "batch seq d_model", dtype)
        if not close(got, expected, dtype):
            hint = next((h for h, v in variants.items() if close(got, v, dtype)),
                        "Post-norm: norm(x + dropout(f(x))); pre-norm: x + dropout(f(norm(x))).")
            sizes = {"batch": x.shape[0], "seq": x.shape[1], "d_model": x.shape[2]}
            raise CheckFailure(f"{what} differs from the expected sublayer ({difference(got, expected, sizes)}). "
                               f"{hint}")
    passed(f"add_and_norm: post-norm norm(x + dropout(f(x))), pre-norm x + dropout(f(norm(x))) ({dtype_name(dtype)})")


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
    _expect_parameters(module, _layer_shapes(s), "The layer that your build_encoder_layer builds", LAYER_HINT)
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
        hint = ("\nA mask may be a (batch, 1, 1, seq) padding mask or a (seq, seq) causal mask: pass it on to the "
                "attention as it is, where both broadcast against the scores (batch, heads, seq, seq)."
                if mask is not None and mask.dim() == 2 else "")
        raise CheckFailure(f"For {what}: {failure}{hint}") from failure
    output = expect_tensor(output, "the output", tuple(x.shape), "batch seq d_model", dtype)
    expected = _run_torch(oracle, x, mask)
    if not close(output, expected, dtype):
        fallback = ("Compare each sublayer on one small example with torch.nn.TransformerEncoderLayer's: "
                    "self-attention first, then the feed-forward network, each wrapped by add_and_norm.")
        raise CheckFailure(
            f"For {what}, your output differs from torch.nn.TransformerEncoderLayer's with the same weights "
            f"({difference(output, expected, _layer_sizes(s, x))}). "
            f"{_diagnose_layer(state, s['heads'], x, mask, norm_first, output, fallback, activation)}"
        )


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
        if how != name:
            held = "has no attribute" if how in ("missing", "None") else "holds another object as"
            raise CheckFailure(f"EncoderLayer(self_attn, ffn, norm1, norm2) {held} self.{name}: keep each part it is "
                               f"given under its own name (PyTorch's), self.{name} = {name}.")
    layout = call(_layout, module)
    for name in ("dropout1", "dropout2"):
        p = layout["dropouts"].get(name)
        if p is None:
            raise CheckFailure(f"Your EncoderLayer has no {name}: each sublayer's output gets its own "
                               f"nn.Dropout(dropout), named dropout1 and dropout2 as in PyTorch.")
        if p != 0.25:
            raise CheckFailure(f"EncoderLayer(..., dropout=0.25) has {name}.p = {p}: pass dropout on to "
                               f"nn.Dropout(dropout).")
    error = call(_error_of, cls, parts["self_attn"], parts["ffn"], parts["norm1"], parts["norm1"])
    if error != "ValueError":
        got = "no error" if error is None else f"a {error}"
        raise CheckFailure(f"EncoderLayer(self_attn, ffn, norm, norm), one norm object handed in for both sublayers, "
                           f"should raise a ValueError (each sublayer needs a norm of its own: if norm1 is norm2, "
                           f"raise ValueError(...)); it raised {got}.")
    # Then the builder: fresh parts of the right sizes, and the options handed on.
    module = call(build, d_model, s["heads"], s["d_ff"], dropout=0.25)
    layout = _expect_parameters(module, _layer_shapes(s), "The layer that your build_encoder_layer builds", LAYER_HINT)
    for name in ("dropout1", "dropout2"):
        p = layout["dropouts"].get(name)
        if p != 0.25:
            # EncoderLayer(..., dropout=0.25) was seen above to make both with p = 0.25.
            raise CheckFailure(f"build_encoder_layer(..., dropout=0.25) gives a layer whose {name}.p is {p}, "
                               f"although your EncoderLayer(..., dropout=0.25) sets 0.25: in build_encoder_layer, pass "
                               f"dropout on to EncoderLayer(self_attn, ffn, norm1, norm2, dropout, norm_first).")
    for name in ("self_attn.dropout", "ffn.dropout"):
        if layout["dropouts"].get(name) != 0.25:
            raise CheckFailure(f"build_encoder_layer(..., dropout=0.25): {name} should drop with p=0.25 too (as in "
                               "PyTorch): pass dropout to MultiHeadAttention(d_model, heads, dropout=dropout) and "
                               "FeedForward(d_model, d_ff, activation, dropout).")
    passed("EncoderLayer keeps self_attn, ffn, norm1, norm2 (refusing one norm for both) and makes dropout1, dropout2; "
           "build_encoder_layer passes the sizes and the dropout on")


def _check_layer(build: Callable[..., Any], seed: int, dtype: torch.dtype, norm_first: bool) -> None:
    s = _sizes(seed)
    module, oracle, state = _build_layer(build, s, norm_first, dtype, seed)
    x, mask = _inputs(s, dtype, seed)
    causal = torch.ones(s["seq"], s["seq"], dtype=torch.bool).tril()
    name = "pre-norm" if norm_first else "post-norm"
    for x_case, m, what in ((x, None, "without a mask"), (x, mask, "with a padding mask (batch, 1, 1, seq)"),
                            (x, causal, "with a causal mask (seq, seq)"),
                            (x[:1], mask[:1], "on a batch of one sentence (batch=1), with its padding mask")):
        _compare_layer(module, oracle, state, s, norm_first, dtype, x_case, m, f"a {name} layer {what}")
    module, oracle, state = _build_layer(build, s, norm_first, dtype, seed + 1, activation="gelu")
    _compare_layer(module, oracle, state, s, norm_first, dtype, x, mask,
                   f"a {name} layer built with activation='gelu', with a padding mask", activation="gelu")


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_post_norm(build: Callable[..., Any], seed: int = 0,
                                  dtype: torch.dtype = torch.float32) -> None:
    """build_encoder_layer(norm_first=False) equal to torch.nn.TransformerEncoderLayer with copied weights."""
    _check_layer(build, seed, dtype, norm_first=False)
    passed(f"post-norm EncoderLayer equal to torch.nn.TransformerEncoderLayer without a mask, with a padding mask, "
           f"with a causal (seq, seq) mask, for one sentence, and with activation='gelu' ({dtype_name(dtype)})")


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_pre_norm(build: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """build_encoder_layer(norm_first=True) equal to torch.nn.TransformerEncoderLayer with copied weights."""
    _check_layer(build, seed, dtype, norm_first=True)
    passed(f"pre-norm EncoderLayer equal to torch.nn.TransformerEncoderLayer without a mask, with a padding mask, "
           f"with a causal (seq, seq) mask, for one sentence, and with activation='gelu' ({dtype_name(dtype)})")


@check(forbid=BUILT_IN_ENCODER)
def check_encoder_layer_dropout(build: Callable[..., Any], seed: int = 0) -> None:
    """Dropout only in training; with p = 1 each sublayer's output is dropped before the residual add."""
    s = _sizes(seed)
    dtype = torch.float32
    x, mask = _inputs(s, dtype, seed)
    for norm_first in (False, True):
        module, oracle, state = _build_layer(build, s, norm_first, dtype, seed, dropout=1.0)
        name = "pre-norm" if norm_first else "post-norm"
        _compare_layer(module, oracle, state, s, norm_first, dtype, x, mask,
                       f"a {name} layer built with dropout=1.0, in eval() mode (where dropout does nothing)")
        call(_set_training, module, True)
        got = expect_tensor(call(module, x, mask), "the output in training", tuple(x.shape), "batch seq d_model",
                            dtype)
        if norm_first:
            expected, form = x, "x itself"
        else:
            expected, form = _layer_norm(state, "norm2", _layer_norm(state, "norm1", x)), "norm2(norm1(x))"
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
                hint = (f"the layer that build_encoder_layer(..., dropout=1.0) builds has {low[0]}.p = "
                        f"{dropouts[low[0]]}: pass dropout on from build_encoder_layer to EncoderLayer(self_attn, ffn, "
                        f"norm1, norm2, dropout, norm_first), and there to nn.Dropout(dropout).")
            elif close(got, _run_torch(oracle, x, mask), dtype) or close(got, undropped, dtype):
                hint = ("your layer ignores dropout1 and dropout2: apply them to the sublayers' outputs, "
                        "before the residual add.")
            else:
                hint = ("dropout1 and dropout2 act on each sublayer's output, before the residual add, never on the "
                        "residual stream x.")
            raise CheckFailure(f"With dropout=1.0 in training mode, a {name} layer drops both sublayers' outputs "
                               f"entirely and should return {form} ({difference(got, expected, _layer_sizes(s, x))}); "
                               f"{hint}")
    passed("EncoderLayer: dropout only in training, on each sublayer's output before the residual add")


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
STACK_MISTAKES = {
    "no final norm": "Your stack leaves out the final LayerNorm: apply self.norm to the last layer's output.",
    "norm every layer": "You apply the final norm after every layer: it comes once, after the last layer.",
    "no mask": "Your stack ignores {mask}: pass mask on to every layer.",
    "mask only first": "Only your first layer gets {mask}: every layer must read it, layer(x, mask).",
}
# ... and what the built stack may get wrong once the stack itself is right: its layers, or what the builders pass on.
BUILT_MISTAKES = {
    "no mask": "Your Encoder hands {mask} to its layers (it does with the check's own layers), but the layers that "
               "build_encoder makes ignore it: is the mask passed on to self_attn in EncoderLayer (exercise 3)?",
    "relu for gelu": "Your layers compute ReLU although the encoder was built with activation='gelu': build_encoder "
                     "must pass activation on to build_encoder_layer for every layer, and build_encoder_layer on to "
                     "FeedForward(d_model, d_ff, activation, dropout).",
}


class _WrittenLayer(nn.Module):
    """One encoder layer written out by this module from PyTorch's weights: the check's own layer, layer(x, mask)."""

    def __init__(self, state: dict[str, Tensor], index: int, heads: int, norm_first: bool) -> None:
        super().__init__()
        self.state, self.prefix, self.heads, self.norm_first = state, f"layers.{index}.", heads, norm_first

    def __repr__(self) -> str:
        return f"<the check's layer {self.prefix[:-1]}>"

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return _reference_layer(self.state, self.prefix, self.heads, x, mask, self.norm_first)


class _WrittenNorm(nn.Module):
    """The stack's final LayerNorm from PyTorch's weights: the check's own norm."""

    def __init__(self, state: dict[str, Tensor]) -> None:
        super().__init__()
        self.state = state

    def __repr__(self) -> str:
        return "<the check's final norm>"

    def forward(self, x: Tensor) -> Tensor:
        return _layer_norm(self.state, "norm", x)


def _stack_shapes(s: dict[str, int], layers: int, final_norm: bool) -> dict[str, list[int]]:
    shapes = {}
    for i in range(layers):
        shapes |= _layer_shapes(s, f"layers.{i}.")
    if final_norm:
        shapes |= {"norm.weight": [s["d_model"]], "norm.bias": [s["d_model"]]}
    return shapes


STACK_HINT = ("Encoder keeps its layers in an nn.ModuleList named layers and its final norm as self.norm "
              "(nn.Identity() when it is given none); build_encoder hands it `layers` layers from build_encoder_layer "
              "and, when final_norm is True, a LayerNorm(d_model), otherwise None.")


def _compare_stack(module: Any, state: dict[str, Tensor], oracle: nn.TransformerEncoder, s: dict[str, int],
                   layers: int, norm_first: bool, final_norm: bool, dtype: torch.dtype, x: Tensor, mask: Tensor | None,
                   what: str, activation: str = "relu", built: bool = True) -> None:
    got = call(module, x) if mask is None else call(module, x, mask)
    got = expect_tensor(got, "the encoder's output", tuple(x.shape), "batch seq d_model", dtype)
    expected = _run_torch(oracle, x, mask)
    if close(got, expected, dtype):
        return
    if built:
        mistakes = {m: h for m, h in BUILT_MISTAKES.items() if m != "relu for gelu" or activation == "gelu"}
        fallback = ("Your Encoder is right with the check's own layers, so look at what build_encoder hands it: its "
                    "layers (do your EncoderLayer checks pass?) and its final norm.")
    else:
        mistakes = STACK_MISTAKES
        fallback = "Run x through each layer in order, layer(x, mask), then self.norm."
    hint = next((h.format(mask=_mask_name(mask)) for mistake, h in mistakes.items()
                 if close(got, _reference_stack(state, s["heads"], layers, x, mask, norm_first, final_norm, mistake,
                                                activation), dtype)),
                fallback)
    norm = f"final_norm={final_norm}" if built else ("a final norm" if final_norm else "norm=None")
    source = f"built by build_encoder with {norm}" if built else f"Encoder(the check's layers, {norm})"
    where = f"{layers} {'pre' if norm_first else 'post'}-norm layers, {source}, {what}"
    sizes = _layer_sizes(s, x) | {"layers": layers}
    raise CheckFailure(f"For {where}, your output differs from torch.nn.TransformerEncoder's with the same weights "
                       f"({difference(got, expected, sizes)}). {hint}")


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
        found = [(x, mask, "with a padding mask")]
        if final_norm:
            found.append((x, None, "without a mask"))
        if not norm_first and final_norm:  # the mask's other shape and a batch of one, once
            found.append((x[:1], causal, "on one sentence (batch=1) with a causal mask (seq, seq)"))
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
                           f"The encoder that your build_encoder(final_norm={final_norm}) builds", STACK_HINT)
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
                                "The encoder that your build_encoder(final_norm=False) builds", STACK_HINT)
    oracle = _torch_encoder(s, layers, True, False, dtype, seed + 1, activation="gelu")
    state = _encoder_state(oracle)
    call(_load, module, state)
    _compare_stack(module, state, oracle, s, layers, True, False, dtype, x, mask,
                   "with activation='gelu' and dropout=1.0, in eval() mode, with a padding mask", "gelu")
    call(_set_training, module, True)
    got = expect_tensor(call(module, x, mask), "the encoder's output in training", tuple(x.shape), "batch seq d_model",
                        dtype)
    if not close(got, x, dtype):
        wrong = sorted(name for name, p in layout["dropouts"].items()
                       if name.startswith("layers.") and name.endswith(("dropout1", "dropout2")) and p != 1.0)
        hint = (f"{wrong[0]} has p={layout['dropouts'][wrong[0]]}: build_encoder must pass dropout on to "
                f"build_encoder_layer for every layer, and build_encoder_layer on to EncoderLayer."
                if wrong else "Each layer's dropout1 and dropout2 act on its sublayers' outputs only.")
        raise CheckFailure(
            f"With dropout=1.0 in training mode, a pre-norm encoder without a final norm (build_encoder(..., "
            f"final_norm=False)) drops every sublayer's output and should return x itself "
            f"({difference(got, x, _layer_sizes(s, x) | {'layers': layers})}). {hint}")
    passed(f"Encoder equal to torch.nn.TransformerEncoder, with the check's layers and with build_encoder's: post-norm "
           f"and pre-norm, with and without the final norm, with padding and causal masks, for one sentence; "
           f"activation and dropout passed on to the layers ({dtype_name(dtype)})")


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
            raise CheckFailure(f"residual_norms should return a torch.Tensor of {len(layers) + 1} numbers, got "
                               f"{kind(got)}: torch.stack the lengths.")
        if got.shape == (len(layers),) and close(got, expected[1:], dtype):
            raise CheckFailure("You measured after each layer only: entry 0 is the length of x itself, before the "
                               f"first layer, so {len(layers)} layers give {len(layers) + 1} numbers.")
        got = expect_tensor(got, "residual_norms(layers, x, mask)", (len(layers) + 1,), "depth", dtype)
        if close(got, expected, dtype):
            continue
        variants = {
            "You averaged the squared lengths: take the L2 norm over d_model (the square root of the sum of "
            "squares), then the mean.": [(h**2).sum(-1).mean() for h in stream],
            "You took the norm of the whole tensor: the length is per position (over d_model), averaged over batch "
            "and seq.": [torch.linalg.vector_norm(h) for h in stream],
            "You took the norm over the wrong axis: the length of a position's vector is over d_model, the last "
            "axis.": [torch.linalg.vector_norm(h, dim=1).mean() for h in stream],
            "You added the lengths up: average them over batch and seq.": [
                torch.linalg.vector_norm(h, dim=-1).sum() for h in stream],
        }
        if m is not None:
            variants["You did not pass the mask on to the layers: call each as layer(x, mask)."] = [
                torch.linalg.vector_norm(h, dim=-1).mean() for h in lengths(None)]
        hint = next((h for h, v in variants.items() if close(got, torch.stack(v), dtype)),
                    "Entry i is torch.linalg.vector_norm(x, dim=-1).mean() after i layers (entry 0: before any).")
        sizes = {"batch": s["batch"], "seq": s["seq"], "d_model": s["d_model"], "layers": len(layers)}
        raise CheckFailure(f"Your lengths {[round(v, 3) for v in got.tolist()]} differ from the expected "
                           f"{[round(v, 3) for v in expected.tolist()]} ({difference(got, expected, sizes)}). {hint}")
    passed(f"residual_norms: the mean length of a position's vector before and after each layer ({dtype_name(dtype)})")
