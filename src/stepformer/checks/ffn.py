"""Checks for chapter 04: the position-wise feed-forward network, SwiGLU, and matching parameter counts."""

from collections.abc import Callable
from functools import partial, reduce
from typing import Any

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import rearrange
from jaxtyping import Float, jaxtyped
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    call,
    check,
    close,
    difference,
    distinct_sizes,
    dtype_name,
    kind,
    passed,
    raised_error,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._noise import binomial_bounds, dropped_count_problem
from stepformer.checks.attention import _expect_kept

AXES = ("batch", "seq", "d_model", "d_ff")
# What exercise 1 asks students to write themselves: the feed-forward half of a Transformer layer.
BUILT_IN_LAYERS = {
    "torch.nn.TransformerEncoderLayer": marked("PyTorch's Transformer encoder layer"),
    "torch.nn.TransformerDecoderLayer": marked("PyTorch's Transformer decoder layer"),
}
FFN_AXES = "batch seq d_model"
# The activations FeedForward takes, each with PyTorch's own function as its oracle and the words a message uses.
ACTIVATIONS = {
    "relu": (F.relu, marked("ReLU")),
    "gelu": (F.gelu, marked("the exact GELU (erf)")),
    "gelu_tanh": (partial(F.gelu, approximate="tanh"), marked("GELU's tanh approximation")),
}
ALLOWED = marked("'relu', 'gelu' and 'gelu_tanh'")


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis changes a shape; d_ff is the larger width."""
    s = distinct_sizes(seed, AXES, span=10, fixed=(2, 3, 5, 7))
    s["d_model"], s["d_ff"] = sorted((s["d_model"], s["d_ff"]))
    return s


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
        raise CheckFailure(t("{cls} has no {missing}: {hint}", cls=cls, missing=", ".join(missing),
                             hint=tr(bias_hint)))
    if extra and all(n.endswith(".bias") for n in extra) and not missing:
        raise CheckFailure(t("{cls} has {extra}, which it should not have: {hint}", cls=cls, extra=", ".join(extra),
                             hint=tr(bias_hint)))
    if missing or extra:
        raise CheckFailure(t(
            "{cls}'s parameters should be named {expected}, got {got}. "
            "Name the layers exactly as the docstring says (the checks copy weights in by name).",
            cls=cls, expected=sorted(expected), got=sorted(shapes)
        ))
    wrong = {n: shapes[n] for n in expected if shapes[n] != expected[n]}
    name, got = next(iter(wrong.items()))
    raise CheckFailure(t(
        "{cls}.{name} should have shape {expected}, got {got}. nn.Linear(in_features, out_features) "
        "stores its weight as (out_features, in_features): check the order of d_model and d_ff.",
        cls=cls, name=name, expected=expected[name], got=got
    ))


def _seeded(module: nn.Module, x: Float[Tensor, "batch seq d_model"], seed: int) -> Any:
    """The module's output with the global RNG seeded here and restored afterwards: a reproducible dropout draw."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return module(x)


def _output(module: Any, x: Tensor, what: str, seed: int | None = None) -> Tensor:
    b, seq, d_model = x.shape
    got = call(module, x) if seed is None else call(_seeded, module, x, seed)
    return _expect_kept(got, what, (b, seq, d_model), FFN_AXES, x.dtype)


def _named(s: dict[str, int]) -> dict[str, int]:
    """The sizes that a message reports."""
    return {a: s[a] for a in AXES}


def _listed(before: str, after: str) -> str:
    """Two items of a list in a message, joined as the reader's language joins them."""
    return t("{before}, {after}", before=before, after=after)


# -- FeedForward -------------------------------------------------------------------------------

def _ffn_expected(s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d_model, d_ff = s["d_model"], s["d_ff"]
    return {"linear1.weight": (d_ff, d_model), "linear1.bias": (d_ff,),
            "linear2.weight": (d_model, d_ff), "linear2.bias": (d_model,)}


FFN_BIAS_HINT = marked("nn.Linear has a bias by default, and the Transformer's FFN uses it (max(0, xW₁ + b₁)W₂ + b₂).")


def _oracle_layer(s: dict[str, int], activation: str, seed: int, dtype: torch.dtype) -> nn.TransformerEncoderLayer:
    # The oracle's weights are part of the check's fixed input; fork_rng leaves the student's
    # global RNG where it was. The layer takes its activation as a function (its names "relu" and
    # "gelu" stand for F.relu and F.gelu), so the tanh approximation is given the same way.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2000)
        layer = nn.TransformerEncoderLayer(s["d_model"], 1, s["d_ff"], dropout=0.0,
                                           activation=ACTIVATIONS[activation][0], batch_first=True, dtype=dtype)
    return layer.eval().requires_grad_(False)


def _build(cls: Callable[..., Any], s: dict[str, int], activation: str, **kwargs: Any) -> Any:
    """The student's FeedForward for one of the three activations; a refusal says which name it refused."""
    try:
        return call(cls, s["d_model"], s["d_ff"], activation=activation, **kwargs)
    except CheckFailure as failure:
        if raised_error(failure) != "ValueError":
            raise
        if activation == "gelu_tanh":
            raise failure.reworded(t(
                "{raised}. FeedForward takes three activations, {allowed}, and refused {activation!r}: 'gelu_tanh' is "
                "GELU's tanh approximation, nn.GELU(approximate='tanh').",
                raised=str(failure).rstrip("."), allowed=tr(ALLOWED), activation=activation
            )) from None
        raise failure.reworded(t(
            "{raised}. FeedForward takes three activations, {allowed}, and refused {activation!r}.",
            raised=str(failure).rstrip("."), allowed=tr(ALLOWED), activation=activation
        )) from None


def _ffn_state(layer: nn.TransformerEncoderLayer) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in layer.named_parameters() if name.startswith("linear")}


def _ffn_diagnose(layer: nn.TransformerEncoderLayer, activation: str, x: Tensor, got: Tensor, alone: Tensor) -> str:
    """Name the likely mistake by comparing with the oracle under each common error.

    ``alone`` is the output for the last position given on its own (a sequence of length 1).
    """
    dtype = x.dtype
    if not close(alone, got[:, -1:], dtype):
        return t("the output at one position depends on the other positions. The FFN acts on each position "
                 "alone: apply nn.Linear to the last axis (d_model) and never mix the seq axis.")
    lin1, lin2 = layer.linear1, layer.linear2
    act = ACTIVATIONS[activation][0]
    variants: list[tuple[str, Callable[[], Tensor]]] = [
        (t("you applied the activation after linear2; it goes between the two layers: "
           "linear2(activation(linear1(x)))."), lambda: act(lin2(lin1(x)))),
        (t("you applied the activation after both layers; it goes between them only."),
         lambda: act(lin2(act(lin1(x))))),
        (t("there is no activation: without it the two layers collapse into one linear map."), lambda: lin2(lin1(x))),
    ]
    # Each other activation, tried in its place; the hint names what the output equals.
    for other, (fn, words) in ACTIVATIONS.items():
        if other == activation:
            continue
        if (activation, other) == ("gelu", "gelu_tanh"):
            hint = t("you used GELU's tanh approximation (approximate='tanh'); 'gelu' is the exact one, x·Φ(x) with "
                     "the erf (nn.GELU() or F.gelu(x)), as in torch.nn.TransformerEncoderLayer.")
        elif (activation, other) == ("gelu_tanh", "gelu"):
            hint = t("activation='gelu_tanh' gave the exact GELU (nn.GELU()'s default, approximate='none'); "
                     "'gelu_tanh' is its tanh approximation, nn.GELU(approximate='tanh') (GPT-2's).")
        else:
            hint = t("activation={activation!r} gave {words}: each of {allowed} needs its own activation; pick it "
                     "from the argument.", activation=activation, words=tr(words), allowed=tr(ALLOWED))
        variants.append((hint, lambda fn=fn: lin2(fn(lin1(x)))))
    for hint, variant in variants:
        if close(got, variant(), dtype):
            return hint
    return t("compare linear1, the activation and linear2 step by step with the formula on a small input.")


@check(forbid=BUILT_IN_LAYERS)
def check_feedforward_structure(cls: Callable[..., Any], seed: int = 0) -> None:
    """linear1 (d_model → d_ff) and linear2 (d_ff → d_model) with biases; shapes kept; bad activations refused."""
    s = _sizes(seed)
    for activation in ACTIVATIONS:
        module = _build(cls, s, activation)
        _expect_parameters(module, _ffn_expected(s), "FeedForward", FFN_BIAS_HINT)
        for dtype in (torch.float32, torch.float64):
            state = _ffn_state(_oracle_layer(s, activation, seed, dtype))
            call(_prepare, module, state, False)
            _output(module, _input(s, seed, dtype), t("FeedForward's output"))
    try:
        call(cls, s["d_model"], s["d_ff"], activation="swish")
    except CheckFailure as failure:
        if raised_error(failure) != "ValueError":
            raise CheckFailure(t("An unknown activation should raise a ValueError, got: {failure}",
                                 failure=failure)) from None
    else:
        raise CheckFailure(t("FeedForward(..., activation='swish') should raise a ValueError that names the "
                             "allowed activations ({allowed}); it was accepted.", allowed=tr(ALLOWED)))
    passed(t("FeedForward has linear1 (d_model → d_ff) and linear2 (d_ff → d_model) with biases, keeps shapes "
             "and dtypes for relu, gelu and gelu_tanh, and refuses unknown activations"))


@check(forbid=BUILT_IN_LAYERS)
def check_feedforward_values(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.TransformerEncoderLayer's linear2(activation(linear1(x))), ReLU and both GELUs, weights
    copied; batch=1 too."""
    s = _sizes(seed)
    x = _input(s, seed, dtype)
    for activation in ACTIVATIONS:
        layer = _oracle_layer(s, activation, seed, dtype)
        module = _build(cls, s, activation)
        _expect_parameters(module, _ffn_expected(s), "FeedForward", FFN_BIAS_HINT)
        call(_prepare, module, _ffn_state(layer), False)
        for sample in (x, x[:1]):
            got = _output(module, sample, t("FeedForward's output"))
            with torch.no_grad():
                expected = layer.linear2(layer.activation(layer.linear1(sample)))
            if not close(got, expected, dtype):
                alone = _output(module, sample[:, -1:], t("FeedForward's output"))
                found = difference(got, expected, dict(_named(s), batch=len(sample)))
                raise CheckFailure(t(
                    "With activation={activation!r}, your output differs from PyTorch's TransformerEncoderLayer "
                    "(same weights; {found}): {diagnosis}", activation=activation, found=found,
                    diagnosis=_ffn_diagnose(layer, activation, sample, got, alone)
                ))
    passed(t("equal to nn.TransformerEncoderLayer's feed-forward, ReLU, exact GELU and its tanh approximation, batch=1 "
             "too ({dtype})", dtype=dtype_name(dtype)))


@jaxtyped(typechecker=beartype)
def _reaching_linear2(layer: nn.TransformerEncoderLayer,
                      y: Float[Tensor, "batch seq d_model"]) -> tuple[Float[Tensor, "batch seq d_ff"], float]:
    """The hidden vector h with linear2(h) = y at every position, and how far y is from any such output.

    linear2 maps d_ff to more d_model features, so h is unique when it exists, and least squares in float64
    finds it; a forward that does not end in linear2 leaves a residual.
    """
    rhs = rearrange(y - layer.linear2.bias, "batch seq d_model -> d_model (batch seq)")
    solution = torch.linalg.lstsq(layer.linear2.weight, rhs).solution
    residual = (layer.linear2.weight @ solution - rhs).abs().max().item()
    return rearrange(solution, "d_ff (batch seq) -> batch seq d_ff", batch=y.shape[0]), residual


@jaxtyped(typechecker=beartype)
def _dropout_diagnose(layer: nn.TransformerEncoderLayer, x: Float[Tensor, "batch seq d_model"],
                      hidden: Float[Tensor, "batch seq d_ff"], reached: Float[Tensor, "batch seq d_ff"],
                      p: float) -> str | None:
    """Why what reached linear2 in training is not ``hidden`` (what reaches it in eval mode) with each unit
    dropped (0) or kept and scaled by 1/(1-p)."""
    scale = 1e-8 * (1.0 + hidden.abs().max().item())
    dropped = reached.abs() <= scale
    if ((reached - hidden / (1 - p)).abs() <= scale)[~dropped].all():
        return None
    live = ~dropped & (hidden.abs() > 1e-3)
    ratios = reached[live] / hidden[live]
    factor = ratios.median().item() if ratios.numel() else float("nan")
    if ratios.numel() and ((ratios - factor).abs() <= 1e-6).all():
        if abs(factor - 1.0) <= 1e-6:
            return t("the kept hidden activations are not scaled: dropout must divide what it keeps by 1 - p, so "
                     "that the expected output stays the same (nn.Dropout does; a hand-made mask must too).")
        count, n = int((dropped & (hidden.abs() > 1e-3)).sum()), int((hidden.abs() > 1e-3).sum())
        low, high = binomial_bounds(n, 1 - p)
        if abs(factor - 1 / p) <= 1e-6 and low <= count <= high:  # the scale and the rate of 1 - p, both tested
            return t("the kept hidden activations are scaled by 1/{p} and {count} of {n} ({share:.0%}) were "
                     "dropped: you dropped with probability 1 - p (nn.Dropout(1 - dropout)); nn.Dropout's p is the "
                     "probability of dropping.", p=p, count=count, n=n, share=count / n)
        return t("the kept hidden activations are scaled by {factor:.4g}, not by 1/(1-p) = {scale:.4g}: pass "
                 "the module's dropout probability to nn.Dropout.", factor=factor, scale=1 / (1 - p))
    before = layer.activation(layer.linear1(x) / (1 - p))
    if ((reached - before).abs() <= scale)[~dropped].all():
        return t("you applied dropout before the activation, to linear1's output: it belongs after it, on "
                 "activation(linear1(x)) (with GELU the two differ).")
    return t("what reaches linear2 is not the hidden activations with some of them dropped: apply dropout to "
             "activation(linear1(x)), not to x (the input) or to linear1's output.")


@check(forbid=BUILT_IN_LAYERS)
def check_feedforward_dropout(cls: Callable[..., Any], seed: int = 0) -> None:
    """In training, dropout sets each hidden activation to 0 or scales it by 1/(1-p), ReLU and both GELUs; in eval
    mode it does nothing."""
    base = _sizes(seed)
    # d_ff below d_model: linear2 is then one-to-one, so the hidden activations that reached it can be solved for
    # from the output, in eval mode and in training (the dropout draw itself is the student's). Compared with
    # the student's own eval-mode hidden layer, so that a wrong activation costs the values check only; an
    # activation the student's FeedForward refuses is left out here (the structure and values checks charge it),
    # as long as one is left to test dropout with.
    s = {"batch": 12, "seq": 10, "d_model": base["d_ff"], "d_ff": base["d_model"]}
    # The units dropped among the live ones (|hidden| > 1e-3) are a Binomial(n, p) count: allowed is the exact
    # binomial interval whose tails hold at most 1e-6 / 6 each (_noise.binomial_bounds; three comparisons a call, one
    # per activation, share the 1e-6). benchmarks/check_noise.py, part "ffn_dropout", over 1000 dropout seeds with
    # nn.Dropout(0.25): at seed 0, 282 live units with ReLU (share dropped 0.250 ± 0.026, binomial 0.026, range
    # 0.170 ... 0.333; allowed 36 ... 109, 0.128 ... 0.387), 590 with GELU (0.250 ± 0.018, range 0.195 ... 0.302;
    # allowed 96 ... 203, 0.163 ... 0.344) and 589 with its tanh approximation (the same spread; allowed 96 ... 203);
    # at seed 303, 283, 574 and 570 (allowed 0.127 ... 0.389, 0.162 ... 0.345 and 0.161 ... 0.346). A rate of 1 - p
    # lies 14 (ReLU) and 22 to 23 (either GELU) of its own binomial standard deviations beyond the interval, 2p 3.7
    # to 3.8 and 7.4 to 7.6 (caught by the GELUs' comparisons); p / 2 only 0.1 and 2.6 to 2.8 (not reliably caught:
    # the share check is for the rate only, and nn.Dropout(1 - dropout) shows in the scale first, _dropout_diagnose).
    p = 0.25
    x = _input(s, seed, torch.float64)
    shares: dict[str, float] = {}
    refused: dict[str, CheckFailure] = {}
    for activation in ACTIVATIONS:
        layer = _oracle_layer(s, activation, seed, torch.float64)
        state = _ffn_state(layer)
        try:
            plain = _build(cls, s, activation, dropout=0.0)
        except CheckFailure as failure:
            if raised_error(failure) != "ValueError":
                raise
            refused[activation] = failure
            continue
        dropping = _build(cls, s, activation, dropout=p)
        _expect_parameters(dropping, _ffn_expected(s), "FeedForward", FFN_BIAS_HINT)
        call(_prepare, plain, state, False)
        call(_prepare, dropping, state, False)
        reference = _output(plain, x, t("FeedForward's output"))
        evaluated = _output(dropping, x, t("FeedForward's output in eval mode"))
        if not close(evaluated, reference, torch.float64):
            raise CheckFailure(t(
                "With dropout={p} and activation={activation!r} in eval mode the output changed "
                "({found}): dropout must do nothing after module.eval(). "
                "Use an nn.Dropout layer (it follows train()/eval()), not F.dropout(x, p), whose training=True "
                "by default.", p=p, activation=activation, found=difference(evaluated, reference, _named(s))
            ))
        call(_prepare, dropping, state, True)
        trained = _output(dropping, x, t("FeedForward's output in training mode"), seed=seed + 6000)
        found = difference(trained, reference, _named(s))
        if close(trained, reference, torch.float64):
            raise CheckFailure(t(
                "With dropout={p} in training mode nothing was dropped ({found}): pass `dropout` to nn.Dropout and "
                "apply it to the hidden activations in forward.", p=p, found=found
            ))
        zeros = trained == 0
        if zeros.any() and close(trained[~zeros], reference[~zeros] / (1 - p), torch.float64):
            raise CheckFailure(t(
                "Dropout zeroes whole outputs ({found}): you applied it after linear2. It belongs to the hidden "
                "activations, between the activation and linear2.", found=found
            ))
        with torch.no_grad():
            hidden, residual = _reaching_linear2(layer, reference)
            if residual > 1e-8 * (1.0 + reference.abs().max().item()):
                continue  # the forward does not end in linear2: the values check says why; nothing to solve for
            reached, _ = _reaching_linear2(layer, trained)
            hint = _dropout_diagnose(layer, x, hidden, reached, p)
        if hint is not None:
            raise CheckFailure(t("With dropout={p} and activation={activation!r} in training mode ({found}): {hint}",
                                 p=p, activation=activation, found=found, hint=hint))
        live = hidden.abs() > 1e-3
        count, n = int((reached[live].abs() <= 1e-8 * (1 + hidden.abs().max())).sum()), int(live.sum())
        shares[activation] = count / n
        problem = dropped_count_problem(count, n, p, comparisons=len(ACTIVATIONS))
        if problem is not None:
            raise CheckFailure(t("With dropout={p}, {count} of {n} hidden activations ({share:.0%}) were dropped "
                                 "(activation={activation!r}, sizes {sizes}); {problem}", p=p, count=count, n=n,
                                 share=count / n, activation=activation, sizes=_named(s), problem=problem))
    if len(refused) == len(ACTIVATIONS):
        raise next(iter(refused.values()))
    left_out = (t("; not with {refused}, which your FeedForward refused (see the structure check)",
                  refused=", ".join(map(repr, refused))) if refused else "")
    if not shares:
        passed(t("dropout is on in training and off in eval mode; where it acts is checked once your forward ends in "
                 "linear2 (see the values check){left_out}", left_out=left_out))
        return
    measured = [t("{share:.0%} with {activation}", share=share, activation=activation)
                for activation, share in shares.items()]
    passed(t("dropout sets hidden activations to 0 ({measured}, at p={p}) or scales them by 1/(1-p), only in training "
             "mode{left_out}", measured=reduce(_listed, measured), p=p, left_out=left_out))


# -- SwiGLU ------------------------------------------------------------------------------------

def _swiglu_expected(s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d_model, d_ff = s["d_model"], s["d_ff"]
    return {"w_gate.weight": (d_ff, d_model), "w_up.weight": (d_ff, d_model), "w_down.weight": (d_model, d_ff)}


SWIGLU_BIAS_HINT = marked("SwiGLU's three layers have no bias (nn.Linear(..., bias=False)), as in Shazeer 2020.")


def _swiglu_state(s: dict[str, int], seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed + 4000)
    d_model, d_ff = s["d_model"], s["d_ff"]
    return {
        "w_gate.weight": torch.randn(d_ff, d_model, generator=g, dtype=torch.float64) / d_model**0.5,
        "w_up.weight": torch.randn(d_ff, d_model, generator=g, dtype=torch.float64) / d_model**0.5,
        "w_down.weight": torch.randn(d_model, d_ff, generator=g, dtype=torch.float64) / d_ff**0.5,
    }


def _glu(state: dict[str, Tensor], x: Tensor, gate_fn: Callable[[Tensor], Tensor], swap: bool = False,
         combine: Callable[[Tensor, Tensor], Tensor] = torch.mul) -> Tensor:
    """w_down(combine(gate_fn(a), b)) in float64 from the raw weights, with a = x W_gateᵀ, b = x W_upᵀ (or swapped);
    combine is the elementwise product unless a variant says otherwise."""
    x64 = x.double()
    a = x64 @ state["w_gate.weight"].T
    b = x64 @ state["w_up.weight"].T
    if swap:
        a, b = b, a
    return combine(gate_fn(a), b) @ state["w_down.weight"].T


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
        _output(module, _input(s, seed, dtype), t("SwiGLU's output"))
    passed(t("SwiGLU has w_gate, w_up (d_model → d_ff) and w_down (d_ff → d_model) without bias, and keeps shapes"))


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
    got = _output(module, x, t("SwiGLU's output"))
    expected = _glu(state64, x, _swish).to(dtype)
    if not close(got, expected, dtype):
        variants = [
            (t("w_gate and w_up are swapped: the silu goes on w_gate(x), and w_up(x) is the value it gates."),
             dict(gate_fn=_swish, swap=True)),
            (t("you used sigmoid as the gate (that is GLU); SwiGLU uses silu(z) = z·sigmoid(z) (F.silu)."),
             dict(gate_fn=torch.sigmoid)),
            (t("you used sigmoid instead of silu, and on w_up(x) instead of w_gate(x): the gate is silu(w_gate(x))."),
             dict(gate_fn=torch.sigmoid, swap=True)),
            (t("you used GELU (that is GeGLU); SwiGLU uses silu (F.silu)."), dict(gate_fn=F.gelu)),
            (t("you used ReLU (that is ReGLU); SwiGLU uses silu (F.silu)."), dict(gate_fn=F.relu)),
            (t("the silu is missing: the gate is silu(w_gate(x)), not w_gate(x) (that is the 'bilinear' variant)."),
             dict(gate_fn=lambda z: z)),
            (t("the gate is missing: your output is w_down(w_up(x)), without silu(w_gate(x)) multiplying w_up(x)."),
             dict(gate_fn=_swish, combine=lambda gate, up: up)),
            (t("w_up(x) is missing: your output is w_down(silu(w_gate(x))); the gate multiplies w_up(x) before "
               "w_down."), dict(gate_fn=_swish, combine=lambda gate, up: gate)),
            (t("you divided the gate by w_up(x): multiply them elementwise, silu(w_gate(x)) * w_up(x)."),
             dict(gate_fn=_swish, combine=torch.div)),
            (t("you added w_up(x) to the gate: multiply them elementwise, silu(w_gate(x)) * w_up(x)."),
             dict(gate_fn=_swish, combine=torch.add)),
        ]
        found = difference(got, expected, _named(s))
        # Each variant is computed on the same input and weights; one is named only when the output equals it
        # (to the dtype's tolerance), and the correct output differs from it (it does, or this branch is not taken).
        for hint, kwargs in variants:
            if close(got, _glu(state64, x, **kwargs).to(dtype), dtype):
                raise CheckFailure(t("Your SwiGLU differs from w_down(silu(w_gate(x)) * w_up(x)) ({found}); {hint}",
                                     found=found, hint=hint))
        raise CheckFailure(t(
            "Your SwiGLU differs from w_down(silu(w_gate(x)) * w_up(x)) ({found}) and matches none of the common "
            "mistakes. Multiply the gate and w_up(x) elementwise (over d_ff), then apply w_down.", found=found
        ))
    passed(t("equal to w_down(silu(w_gate(x)) ⊙ w_up(x)) computed in float64 ({dtype})", dtype=dtype_name(dtype)))


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
        try:
            value = call(fn, d_model, d_ff)
        except CheckFailure as failure:
            if raised_error(failure) != "ZeroDivisionError":
                raise
            # Python raises ZeroDivisionError only for a division (or modulo) by 0: that much is known.
            raise CheckFailure(t(
                "{raised}. What your function divides by is 0, but one SwiGLU hidden unit costs "
                "3·d_model = {per_unit:,} parameters here: divide FeedForward's count by the parameter count of "
                "SwiGLU(d_model, 1), a SwiGLU with one hidden unit.", raised=str(failure).rstrip("."),
                per_unit=3 * d_model
            )) from None
        if type(value) is not int:
            raise CheckFailure(t("matching_swiglu_hidden should return a Python int (use round()), got {kind}.",
                                 kind=kind(value)))
        # The FFN's parameters are those of nn.Linear(d_model, d_ff) and nn.Linear(d_ff, d_model), biases included;
        # one SwiGLU hidden unit costs three bias-free weight vectors of length d_model.
        with torch.device("meta"):  # shapes only: nothing is allocated
            target = sum(p.numel() for layer in (nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model))
                         for p in layer.parameters())
        per_unit = 3 * d_model
        best = min(abs(per_unit * h - target) for h in (target // per_unit, target // per_unit + 1))
        if abs(per_unit * value - target) != best:
            right = [h for h in (target // per_unit, target // per_unit + 1) if abs(per_unit * h - target) == best]
            # Each key is what one mistake returns on these sizes; a hint is given only when the value equals
            # exactly one key, which the correct answer (tested above) does not.
            candidates = [
                (round(2 * d_model * d_ff / per_unit), t("Probably you left out linear1's and linear2's biases "
                                                         "(d_ff + d_model parameters).")),
                (d_ff, t("Probably the same hidden size gives SwiGLU 1.5 times the parameters: it has three "
                         "matrices, not two.")),
                (round(target / (2 * d_model)), t("Probably SwiGLU has three weight matrices (w_gate, w_up, w_down), "
                                                  "not two.")),
                (target, t("Your answer is FeedForward's parameter count itself ({target:,}), without the division by "
                           "what one SwiGLU hidden unit costs (SwiGLU(d_model, 1): {per_unit:,} parameters).",
                           target=target, per_unit=per_unit)),
                (target * per_unit, t("Your answer is FeedForward's count ({target:,}) multiplied by what one SwiGLU "
                                      "hidden unit costs ({per_unit:,}): divide by it instead.",
                                      target=target, per_unit=per_unit)),
            ]
            named = [hint for key, hint in candidates if key == value]
            hint = named[0] if len(named) == 1 else t(
                "Your value matches none of the common mistakes. Count both modules' parameters with "
                "sum(p.numel() for p in m.parameters()) and divide FeedForward's count by SwiGLU(d_model, 1)'s.")
            raise CheckFailure(t(
                "For d_model={d_model}, d_ff={d_ff}: FeedForward has {target:,} parameters, so the closest "
                "SwiGLU has hidden size {closest} ({closest_count:,} parameters); you returned {value} "
                "({value_count:,}). {hint}", d_model=d_model, d_ff=d_ff, target=target, closest=right[0],
                closest_count=per_unit * right[0], value=value, value_count=per_unit * value, hint=hint
            ))
        ratios.append(value / d_ff)
    passed(t("matching SwiGLU hidden sizes found; for d_ff = 4·d_model they are {ratio:.3f}·d_ff (about 2/3)",
             ratio=ratios[0]))
