"""Checks for chapter 04: the position-wise feed-forward network, SwiGLU, and matching parameter counts."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stepformer.checks._core import CheckFailure, call, check, close, expect_tensor, kind, passed

AXES = ("batch", "seq", "d_model", "d_ff")
# What exercise 1 asks students to write themselves: the feed-forward half of a Transformer layer.
BUILT_IN_LAYERS = {
    "torch.nn.TransformerEncoderLayer": "PyTorch's Transformer encoder layer",
    "torch.nn.TransformerDecoderLayer": "PyTorch's Transformer decoder layer",
}
FFN_AXES = "batch seq d_model"


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis changes a shape; d_ff is the larger width."""
    if seed == 0:
        return dict(zip(AXES, (2, 3, 5, 7), strict=True))
    picks = (torch.randperm(10, generator=torch.Generator().manual_seed(seed))[:4] + 2).tolist()
    batch, seq, *widths = picks
    return {"batch": batch, "seq": seq, "d_model": min(widths), "d_ff": max(widths)}


def _input(s: dict[str, int], seed: int, dtype: torch.dtype) -> Tensor:
    # Spread 3: the hidden pre-activations then reach |z| ≈ 2, where GELU's tanh approximation
    # and ReLU both differ clearly from the exact GELU.
    g = torch.Generator().manual_seed(seed + 1000)
    return 3 * torch.randn(s["batch"], s["seq"], s["d_model"], generator=g, dtype=dtype)


# -- helpers that touch the student's module; each runs through call() -------------------------

def _parameter_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _prepare(module: nn.Module, state: dict[str, Tensor], training: bool) -> None:
    """Load ``state`` (in its dtype), switch train/eval, and stop autograd from tracking the weights."""
    module.to(next(iter(state.values())).dtype)
    module.load_state_dict(state, strict=True)
    module.train(training)
    module.requires_grad_(False)


def _expect_parameters(module: Any, expected: dict[str, tuple[int, ...]], cls: str, bias_hint: str) -> None:
    shapes = call(_parameter_shapes, module)
    if shapes == expected:
        return
    missing = [n for n in expected if n not in shapes]
    extra = [n for n in shapes if n not in expected]
    if missing and all(n.endswith(".bias") for n in missing) and not extra:
        raise CheckFailure(f"{cls} has no {', '.join(missing)}: {bias_hint}")
    if extra and all(n.endswith(".bias") for n in extra) and not missing:
        raise CheckFailure(f"{cls} has {', '.join(extra)}, which it should not have: {bias_hint}")
    if missing or extra:
        raise CheckFailure(
            f"{cls}'s parameters should be named {sorted(expected)}, got {sorted(shapes)}. "
            "Name the layers exactly as the docstring says (the checks copy weights in by name)."
        )
    wrong = {n: shapes[n] for n in expected if shapes[n] != expected[n]}
    name, got = next(iter(wrong.items()))
    raise CheckFailure(
        f"{cls}.{name} should have shape {expected[name]}, got {got}. nn.Linear(in_features, out_features) "
        "stores its weight as (out_features, in_features): check the order of d_model and d_ff."
    )


def _output(module: Any, x: Tensor, what: str) -> Tensor:
    b, seq, d_model = x.shape
    return expect_tensor(call(module, x), what, (b, seq, d_model), FFN_AXES, x.dtype)


# -- FeedForward -------------------------------------------------------------------------------

def _ffn_expected(s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d_model, d_ff = s["d_model"], s["d_ff"]
    return {"linear1.weight": (d_ff, d_model), "linear1.bias": (d_ff,),
            "linear2.weight": (d_model, d_ff), "linear2.bias": (d_model,)}


FFN_BIAS_HINT = "nn.Linear has a bias by default, and the Transformer's FFN uses it (max(0, xW₁ + b₁)W₂ + b₂)."


def _oracle_layer(s: dict[str, int], activation: str, seed: int, dtype: torch.dtype) -> nn.TransformerEncoderLayer:
    # The oracle's weights are part of the check's fixed input; fork_rng leaves the student's
    # global RNG where it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2000)
        layer = nn.TransformerEncoderLayer(s["d_model"], 1, s["d_ff"], dropout=0.0, activation=activation,
                                           batch_first=True, dtype=dtype)
    return layer.eval().requires_grad_(False)


def _ffn_state(layer: nn.TransformerEncoderLayer) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in layer.named_parameters() if name.startswith("linear")}


def _ffn_diagnose(layer: nn.TransformerEncoderLayer, activation: str, x: Tensor, got: Tensor, alone: Tensor) -> str:
    """Name the likely mistake by comparing with the oracle under each common error.

    ``alone`` is the output for the last position given on its own (a sequence of length 1).
    """
    dtype = x.dtype
    if not close(alone, got[:, -1:], dtype):
        return ("the output at one position depends on the other positions. The FFN acts on each position "
                "alone: apply nn.Linear to the last axis (d_model) and never mix the seq axis.")
    lin1, lin2 = layer.linear1, layer.linear2
    act = {"relu": F.relu, "gelu": F.gelu}[activation]
    other = "gelu" if activation == "relu" else "relu"
    variants = {
        "you applied the activation after linear2; it goes between the two layers: "
        "linear2(activation(linear1(x))).": lambda: act(lin2(lin1(x))),
        "you applied the activation after both layers; it goes between them only.": lambda: act(lin2(act(lin1(x)))),
        "there is no activation: without it the two layers collapse into one linear map.": lambda: lin2(lin1(x)),
        f"activation={activation!r} gave {other.upper()}: pick the activation from the argument.":
            lambda: lin2({"relu": F.relu, "gelu": F.gelu}[other](lin1(x))),
    }
    if activation == "gelu":
        variants = {
            "you used GELU's tanh approximation (approximate='tanh'); this course's GELU is the exact one, "
            "x·Φ(x) with the erf (nn.GELU() or F.gelu(x)), as in torch.nn.TransformerEncoderLayer.":
                lambda: lin2(F.gelu(lin1(x), approximate="tanh")),
            **variants,
        }
    for hint, variant in variants.items():
        if close(got, variant(), dtype):
            return hint
    return "compare linear1, the activation and linear2 step by step with the formula on a small input."


@check(forbid=BUILT_IN_LAYERS)
def check_feedforward_structure(cls: Callable[..., Any], seed: int = 0) -> None:
    """linear1 (d_model → d_ff) and linear2 (d_ff → d_model) with biases; shapes kept; bad activations refused."""
    s = _sizes(seed)
    for activation in ("relu", "gelu"):
        module = call(cls, s["d_model"], s["d_ff"], activation=activation)
        _expect_parameters(module, _ffn_expected(s), "FeedForward", FFN_BIAS_HINT)
        for dtype in (torch.float32, torch.float64):
            state = _ffn_state(_oracle_layer(s, activation, seed, dtype))
            call(_prepare, module, state, False)
            _output(module, _input(s, seed, dtype), "FeedForward's output")
    try:
        call(cls, s["d_model"], s["d_ff"], activation="swish")
    except CheckFailure as failure:
        if "ValueError" not in str(failure):
            raise CheckFailure(f"An unknown activation should raise a ValueError, got: {failure}") from None
    else:
        raise CheckFailure("FeedForward(..., activation='swish') should raise a ValueError that names the "
                           "allowed activations ('relu', 'gelu'); it was accepted.")
    passed("FeedForward has linear1 (d_model → d_ff) and linear2 (d_ff → d_model) with biases, keeps shapes "
           "and dtypes, and refuses unknown activations")


@check(forbid=BUILT_IN_LAYERS)
def check_feedforward_values(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.TransformerEncoderLayer's linear2(activation(linear1(x))), ReLU and GELU, weights copied."""
    s = _sizes(seed)
    x = _input(s, seed, dtype)
    for activation in ("relu", "gelu"):
        layer = _oracle_layer(s, activation, seed, dtype)
        module = call(cls, s["d_model"], s["d_ff"], activation=activation)
        _expect_parameters(module, _ffn_expected(s), "FeedForward", FFN_BIAS_HINT)
        call(_prepare, module, _ffn_state(layer), False)
        got = _output(module, x, "FeedForward's output")
        with torch.no_grad():
            expected = layer.linear2(layer.activation(layer.linear1(x)))
        if not close(got, expected, dtype):
            alone = _output(module, x[:, -1:], "FeedForward's output")
            raise CheckFailure(
                f"With activation={activation!r}, your output differs from PyTorch's TransformerEncoderLayer "
                f"(same weights): {_ffn_diagnose(layer, activation, x, got, alone)}"
            )
    passed(f"equal to nn.TransformerEncoderLayer's feed-forward, ReLU and GELU ({str(dtype).removeprefix('torch.')})")


@check(forbid=BUILT_IN_LAYERS)
def check_feedforward_dropout(cls: Callable[..., Any], seed: int = 0) -> None:
    """Dropout acts on the hidden activations in training and does nothing in eval mode."""
    s = dict(_sizes(seed), batch=8, seq=16)  # enough hidden units to see dropout at work
    p = 0.25
    x = _input(s, seed, torch.float64)
    state = _ffn_state(_oracle_layer(s, "relu", seed, torch.float64))
    plain = call(cls, s["d_model"], s["d_ff"], activation="relu", dropout=0.0)
    dropping = call(cls, s["d_model"], s["d_ff"], activation="relu", dropout=p)
    _expect_parameters(dropping, _ffn_expected(s), "FeedForward", FFN_BIAS_HINT)
    call(_prepare, plain, state, False)
    call(_prepare, dropping, state, False)
    reference = _output(plain, x, "FeedForward's output")
    evaluated = _output(dropping, x, "FeedForward's output in eval mode")
    if not close(evaluated, reference, torch.float64):
        raise CheckFailure(
            f"With dropout={p} in eval mode the output changed: dropout must do nothing after module.eval(). "
            "Use an nn.Dropout layer (it follows train()/eval()), not F.dropout(x, p), whose training=True "
            "by default."
        )
    call(_prepare, dropping, state, True)
    trained = _output(dropping, x, "FeedForward's output in training mode")
    if close(trained, reference, torch.float64):
        raise CheckFailure(
            f"With dropout={p} in training mode nothing was dropped: pass `dropout` to nn.Dropout and apply it "
            "to the hidden activations in forward."
        )
    zeros = trained == 0
    if zeros.any() and close(trained[~zeros], reference[~zeros] / (1 - p), torch.float64):
        raise CheckFailure(
            "Dropout zeroes whole outputs: you applied it after linear2. It belongs to the hidden "
            "activations, between the activation and linear2."
        )
    passed("dropout drops hidden activations in training and is off in eval mode")


# -- SwiGLU ------------------------------------------------------------------------------------

def _swiglu_expected(s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d_model, d_ff = s["d_model"], s["d_ff"]
    return {"w_gate.weight": (d_ff, d_model), "w_up.weight": (d_ff, d_model), "w_down.weight": (d_model, d_ff)}


SWIGLU_BIAS_HINT = "SwiGLU's three layers have no bias (nn.Linear(..., bias=False)), as in Shazeer 2020."


def _swiglu_state(s: dict[str, int], seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed + 4000)
    d_model, d_ff = s["d_model"], s["d_ff"]
    return {
        "w_gate.weight": torch.randn(d_ff, d_model, generator=g, dtype=torch.float64) / d_model**0.5,
        "w_up.weight": torch.randn(d_ff, d_model, generator=g, dtype=torch.float64) / d_model**0.5,
        "w_down.weight": torch.randn(d_model, d_ff, generator=g, dtype=torch.float64) / d_ff**0.5,
    }


def _glu(state: dict[str, Tensor], x: Tensor, gate_fn: Callable[[Tensor], Tensor], swap: bool = False) -> Tensor:
    """w_down(gate_fn(a) * b) in float64 from the raw weights, with a = x W_gateᵀ, b = x W_upᵀ (or swapped)."""
    x64 = x.double()
    a = x64 @ state["w_gate.weight"].T
    b = x64 @ state["w_up.weight"].T
    if swap:
        a, b = b, a
    return (gate_fn(a) * b) @ state["w_down.weight"].T


def _swish(z: Tensor) -> Tensor:
    return z * torch.sigmoid(z)  # silu(z) = z · σ(z), written out: an oracle independent of F.silu


@check
def check_swiglu_structure(cls: Callable[..., Any], seed: int = 0) -> None:
    """w_gate, w_up (d_model → d_ff) and w_down (d_ff → d_model) without bias; shapes and dtypes kept."""
    s = _sizes(seed)
    module = call(cls, s["d_model"], s["d_ff"])
    _expect_parameters(module, _swiglu_expected(s), "SwiGLU", SWIGLU_BIAS_HINT)
    for dtype in (torch.float32, torch.float64):
        state = {k: v.to(dtype) for k, v in _swiglu_state(s, seed).items()}
        call(_prepare, module, state, False)
        _output(module, _input(s, seed, dtype), "SwiGLU's output")
    passed("SwiGLU has w_gate, w_up (d_model → d_ff) and w_down (d_ff → d_model) without bias, and keeps shapes")


@check
def check_swiglu_values(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to w_down(silu(x W_gateᵀ) ⊙ x W_upᵀ), computed independently in float64."""
    s = _sizes(seed)
    state64 = _swiglu_state(s, seed)
    state = {k: v.to(dtype) for k, v in state64.items()}
    x = _input(s, seed, dtype)
    module = call(cls, s["d_model"], s["d_ff"])
    _expect_parameters(module, _swiglu_expected(s), "SwiGLU", SWIGLU_BIAS_HINT)
    call(_prepare, module, state, False)
    got = _output(module, x, "SwiGLU's output")
    expected = _glu(state64, x, _swish).to(dtype)
    if not close(got, expected, dtype):
        variants = {
            "w_gate and w_up are swapped: the silu goes on w_gate(x), and w_up(x) is the value it gates.":
                dict(gate_fn=_swish, swap=True),
            "you used sigmoid as the gate (that is GLU); SwiGLU uses silu(z) = z·sigmoid(z) (F.silu).":
                dict(gate_fn=torch.sigmoid),
            "you used sigmoid instead of silu, and on w_up(x) instead of w_gate(x): the gate is silu(w_gate(x)).":
                dict(gate_fn=torch.sigmoid, swap=True),
            "you used GELU (that is GeGLU); SwiGLU uses silu (F.silu).": dict(gate_fn=F.gelu),
            "you used ReLU (that is ReGLU); SwiGLU uses silu (F.silu).": dict(gate_fn=F.relu),
            "the silu is missing: the gate is silu(w_gate(x)), not w_gate(x) (that is the 'bilinear' variant).":
                dict(gate_fn=lambda z: z),
        }
        for hint, kwargs in variants.items():
            if close(got, _glu(state64, x, **kwargs).to(dtype), dtype):
                raise CheckFailure(f"Your SwiGLU differs from w_down(silu(w_gate(x)) * w_up(x)): {hint}")
        raise CheckFailure(
            "Your SwiGLU differs from w_down(silu(w_gate(x)) * w_up(x)): multiply the gate and w_up(x) "
            "elementwise (over d_ff), then apply w_down."
        )
    passed(f"equal to w_down(silu(w_gate(x)) ⊙ w_up(x)) computed in float64 ({str(dtype).removeprefix('torch.')})")


# -- matching the parameter count --------------------------------------------------------------

def _pairs(seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed + 5000)
    d_model = int(torch.randint(3, 40, (1,), generator=g)) * 8
    d_ff = int(torch.randint(d_model + 1, 6 * d_model, (1,), generator=g))
    return [(512, 2048), (d_model, 4 * d_model), (d_model, d_ff), (6, 10)]


@check
def check_matching_swiglu_hidden(fn: Callable[..., Any], seed: int = 0) -> None:
    """The SwiGLU hidden size closest in parameters to FeedForward(d_model, d_ff), against PyTorch's own counts."""
    ratios = []
    for d_model, d_ff in _pairs(seed):
        value = call(fn, d_model, d_ff)
        if type(value) is not int:
            raise CheckFailure(f"matching_swiglu_hidden should return a Python int (use round()), got {kind(value)}.")
        # The FFN's parameters are those of nn.Linear(d_model, d_ff) and nn.Linear(d_ff, d_model), biases included;
        # one SwiGLU hidden unit costs three bias-free weight vectors of length d_model.
        with torch.device("meta"):  # shapes only: nothing is allocated
            target = sum(p.numel() for layer in (nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model))
                         for p in layer.parameters())
        per_unit = 3 * d_model
        best = min(abs(per_unit * h - target) for h in (target // per_unit, target // per_unit + 1))
        if abs(per_unit * value - target) != best:
            right = [h for h in (target // per_unit, target // per_unit + 1) if abs(per_unit * h - target) == best]
            hints = {
                round(2 * d_model * d_ff / per_unit): "you left out linear1's and linear2's biases "
                                                      "(d_ff + d_model parameters).",
                d_ff: "the same hidden size gives SwiGLU 1.5 times the parameters: it has three matrices, not two.",
                round(target / (2 * d_model)): "SwiGLU has three weight matrices (w_gate, w_up, w_down), not two.",
            }
            hint = hints.get(value, "count both modules' parameters with sum(p.numel() for p in m.parameters()).")
            raise CheckFailure(
                f"For d_model={d_model}, d_ff={d_ff}: FeedForward has {target:,} parameters, so the closest "
                f"SwiGLU has hidden size {right[0]} ({per_unit * right[0]:,} parameters); you returned {value} "
                f"({per_unit * value:,}). Probably {hint}"
            )
        ratios.append(value / d_ff)
    passed(f"matching SwiGLU hidden sizes found; for d_ff = 4·d_model they are {ratios[0]:.3f}·d_ff (about 2/3)")
