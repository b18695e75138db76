"""Checks for chapter 05: LayerNorm, RMSNorm, the residual sublayer, and a gradient measurement.

Student modules are only ever touched through ``call``: constructing them, running them, and
the small helpers below (reading parameters, loading a state dict, running a backward pass),
so that the grader can replay every result without the student's code.
"""

from collections.abc import Callable
from typing import Any

import jaxtyping
import torch
import torch.nn.functional as F
from beartype import beartype
from jaxtyping import Float, jaxtyped
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    call,
    check,
    difference,
    draw_sizes,
    dtype_name,
    expect_tensor,
    kind,
    passed,
    show,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import parameters_of as _parameters
from stepformer.checks._modules import set_training as _set_training
from stepformer.checks._noise import binomial_bounds, dropped_count_problem
from stepformer.checks.attention import _first_line

AXES = ("batch", "seq", "d_model")
# What exercises 1-3 ask students to write themselves (and to use in their Residual).
BUILT_IN_NORMS = {
    "torch.nn.functional.layer_norm": marked("PyTorch's layer norm"),
    "torch.layer_norm": marked("PyTorch's layer norm"),
    "torch.native_layer_norm": marked("PyTorch's layer norm"),
    "torch.nn.LayerNorm": marked("PyTorch's LayerNorm module"),
    "torch.nn.functional.rms_norm": marked("PyTorch's RMS norm"),
    "torch.rms_norm": marked("PyTorch's RMS norm"),
    "torch.nn.RMSNorm": marked("PyTorch's RMSNorm module"),
}
# The residual's checks forbid the functions only: the own-work scan matches names, and a
# Residual that builds the student's own `LayerNorm` while `nn` is imported would read as
# torch.nn.LayerNorm. Its norm is swapped out in the check anyway.
NORM_FUNCTIONS = {name: label for name, label in BUILT_IN_NORMS.items() if not name.startswith("torch.nn.")
                  or name.startswith("torch.nn.functional.")}
LAYER_NORM_EPS, RMS_NORM_EPS = 1e-5, 1e-6
FUNCTIONAL = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm"}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes (d_model wider than the others), so a wrong axis changes a shape."""
    if seed == 0:
        return {"batch": 2, "seq": 5, "d_model": 12}
    g = torch.Generator().manual_seed(seed)
    # d_model from its own range, 8 to 16, above batch and seq (at most 7): distinct from both without a permutation.
    return {**draw_sizes(g, ("batch", "seq"), span=6), "d_model": int(torch.randint(8, 17, (1,), generator=g))}


def _tolerance(dtype: torch.dtype, offset: float = 0.0) -> float:
    # The rounding of x + offset itself reaches the output. Measured over 60 seeds: correct float32 layer norms
    # of x + 100 differ from F.layer_norm by up to 1.1e-4, the variance taken as E[x²] - E[x]² by 1.6e-3 or
    # more; in float64 at x + 1e6, 1.2e-9 against 3e-4.
    if dtype == torch.float64:
        return 1e-10 + 1e-14 * abs(offset)
    return 1e-5 + 2e-6 * abs(offset)


def _near(actual: Tensor, expected: Tensor, tolerance: float) -> bool:
    return actual.shape == expected.shape and bool(
        torch.allclose(actual.to(expected.dtype), expected, rtol=tolerance, atol=tolerance)
    )


# -- helpers that run inside ``call`` (never reference PyTorch's norms here) -----------------


def _load(module: nn.Module, state: dict[str, Tensor]) -> None:
    module.to(next(iter(state.values())).dtype)
    module.load_state_dict(state)


def _forward_backward(module: nn.Module, x: Tensor, upstream: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    x = x.clone().requires_grad_()
    y = module(x)
    named = dict(module.named_parameters())
    grads = torch.autograd.grad(y, [x, *named.values()], upstream, allow_unused=True)
    found = {"x": grads[0]}
    found.update({name: g for name, g in zip(named, grads[1:], strict=True) if g is not None})
    return y.detach(), found


def _set_norm(module: nn.Module, norm: nn.Module) -> str:
    if not isinstance(getattr(module, "norm", None), nn.Module):
        return "missing"
    module.norm = norm
    return "ok"


class _ReferenceNorm(nn.Module):
    """A layer norm with a random affine part, put in the student's Residual in place of theirs.

    So that exercise 3 checks how the sublayer, the norm and the residual are put together,
    whatever exercise 1 gave.
    """

    def __init__(self, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())

    def forward(self, x: Tensor) -> Tensor:
        variance, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        return (x - mean) / torch.sqrt(variance + LAYER_NORM_EPS) * self.weight + self.bias


class _Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


# -- inputs and oracles ------------------------------------------------------------------------

CASES = (
    # (label, scale, offset): the last three are where a formula that is "nearly right" breaks. Labels are shown
    # through tr().
    (marked("random inputs"), 1.0, 0.0),
    (marked("inputs of tiny variance (x · 1e-3, where eps matters)"), 1e-3, 0.0),
    (marked("inputs with a large mean (x + 100)"), 1.0, 100.0),
    (marked("inputs of large scale (x · 1e3)"), 1e3, 0.0),
)


# Only float64 can hold x + 1e6 finely enough; there E[x²] - E[x]² loses about 4 of its 16 digits.
HUGE_MEAN = (marked("inputs with a huge mean (x + 1e6)"), 1.0, 1e6)
# eps values far from the defaults, on inputs whose variance (1e-6) is far below them: the result is eps's.
CUSTOM_EPS = {"LayerNorm": 1e-2, "RMSNorm": 1e-3}


def _input(seed: int, dtype: torch.dtype, scale: float = 1.0, offset: float = 0.0) -> Tensor:
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s["batch"], s["seq"], s["d_model"], generator=g, dtype=dtype) * scale + offset


def _leading_axes(seed: int, dtype: torch.dtype) -> list[tuple[str, Float[Tensor, "*batch d_model"]]]:
    """Inputs with other leading axes than (batch, seq): the norms act on the last axis, whatever comes before."""
    s = _sizes(seed)
    x = _input(seed, dtype)
    extra = next(n for n in (3, 4, 6, 7, 2) if n not in (s["batch"], s["seq"]))
    g = torch.Generator().manual_seed(seed + 4)
    four = torch.randn(extra, s["batch"], s["seq"], s["d_model"], generator=g, dtype=dtype)
    return [(t("a 2-D input (seq, d_model)"), x[0]), (t("a 4-D input (heads, batch, seq, d_model)"), four),
            (t("batch=1"), x[:1])]


def _axes(x: Tensor) -> tuple[str, ...]:
    """The names of x's axes: the last is d_model, the ones before are the leading axes of the samples above."""
    return (("heads", "batch", "seq")[3 - (x.dim() - 1):] if x.dim() > 1 else ()) + ("d_model",)


def _sizes_of(x: Tensor) -> dict[str, int]:
    return dict(zip(_axes(x), x.shape, strict=True))


def _affine(seed: int, d_model: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    weight = 1.0 + 0.5 * torch.randn(d_model, generator=g, dtype=dtype)
    bias = 0.5 * torch.randn(d_model, generator=g, dtype=dtype)
    return weight, bias


@jaxtyped(typechecker=beartype)
def _over_axes(x: Float[Tensor, "*batch d_model"],
               normalise: Callable[[int], Tensor]) -> dict[str, Float[Tensor, "*batch d_model"]]:
    """One variant per leading axis, keyed by the axis's name: the statistics taken over that axis instead of
    d_model."""
    names = _axes(x)[:-1]
    return {name: normalise(dim) for dim, name in enumerate(names) if x.shape[dim] > 1}


def _over_axes_hints(x: Tensor, normalise: Callable[[int], Tensor], norm: str) -> dict[str, Tensor]:
    return {t("You normalised over the {axis} axis: {norm} normalises each position over d_model (the last axis).",
              axis=axis, norm=norm): value for axis, value in _over_axes(x, normalise).items()}


def _ignored_eps(name: str, eps: float, default: float) -> str:
    return t("You ignored the eps argument: {name}(d_model, eps={eps}) must use eps={eps}, not the default "
             "{default}. Store it (self.eps = eps) and use it in forward.", name=name, eps=eps, default=default)


# The LayerNorm slips of eps that inputs of tiny variance confirm (see _confirm_eps).
EPS_OUTSIDE = marked("Your epsilon is outside the square root: divide by sqrt(variance + eps), not sqrt(variance) + "
                     "eps.")
EPS_LEFT_OUT = marked("You left out epsilon: divide by sqrt(variance + eps) (eps defaults to 1e-5).")


def _layer_norm_variants(x: Tensor, weight: Tensor, bias: Tensor, eps: float = LAYER_NORM_EPS) -> dict[str, Tensor]:
    """What a LayerNorm gives under each usual mistake (in float64), keyed by the hint."""
    x = x.double()
    weight, bias = weight.double(), bias.double()

    def over(dim: int) -> Tensor:
        var, mean = torch.var_mean(x, dim=dim, keepdim=True, correction=0)
        return (x - mean) / torch.sqrt(var + eps) * weight + bias

    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    centred = x - mean
    variants = {
        t("You used the unbiased variance (dividing by d_model - 1, torch.var's default): LayerNorm divides "
          "by d_model (unbiased=False / correction=0)."):
            centred / torch.sqrt(x.var(-1, keepdim=True, correction=1) + eps) * weight + bias,
        tr(EPS_OUTSIDE): centred / (torch.sqrt(var) + eps) * weight + bias,
        tr(EPS_LEFT_OUT): centred / torch.sqrt(var) * weight + bias,
    }
    if eps != LAYER_NORM_EPS:
        variants[_ignored_eps("LayerNorm", eps, LAYER_NORM_EPS)] = (
            centred / torch.sqrt(var + LAYER_NORM_EPS) * weight + bias)
    variants |= _over_axes_hints(x, over, "LayerNorm")
    normalised = centred / torch.sqrt(var + eps)
    summed = x - x.sum(-1, keepdim=True)  # the "mean" taken as a sum
    added = x + mean
    return variants | {
        t("You did not subtract the mean: that is RMSNorm; LayerNorm centres first."):
            x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight + bias,
        t("You added the bias before multiplying by the weight: it is normalised · weight + bias."):
            (normalised + bias) * weight,
        t("You left out the learned weight and bias: multiply by self.weight, then add self.bias."): normalised,
        t("You left out the learned weight: multiply by self.weight before adding self.bias."): normalised + bias,
        t("You left out the learned bias: add self.bias after multiplying by self.weight."): normalised * weight,
        t("You subtracted the bias: add self.bias (normalised · weight + bias)."): normalised * weight - bias,
        t("You divided by the weight: multiply by self.weight (normalised · weight + bias)."):
            normalised / weight + bias,
        t("Your mean is a sum: reduce x with 'mean' (divide the sum by d_model), not 'sum'."):
            summed / torch.sqrt((summed**2).mean(-1, keepdim=True) + eps) * weight + bias,
        t("Your variance is a sum of squared deviations: average them (reduce with 'mean', not 'sum')."):
            centred / torch.sqrt((centred**2).sum(-1, keepdim=True) + eps) * weight + bias,
        t("You added the mean instead of subtracting it: centre with x - mean."):
            added / torch.sqrt((added**2).mean(-1, keepdim=True) + eps) * weight + bias,
        t("You did not divide by the standard deviation: divide x - mean by sqrt(variance + eps)."):
            centred * weight + bias,
        t("You multiplied by sqrt(variance + eps) instead of dividing by it."):
            centred * torch.sqrt(var + eps) * weight + bias,
        t("You divided by the variance, not by its square root: divide by sqrt(variance + eps)."):
            centred / (var + eps) * weight + bias,
        t("Your variance is the mean of the cubed deviations, negative at some positions (NaN there): square them, "
          "reduce((x - mean)**2, '... d_model -> ... 1', 'mean')."):
            centred / torch.sqrt((centred**3).mean(-1, keepdim=True) + eps) * weight + bias,
    }


def _rms_norm_variants(x: Tensor, weight: Tensor, eps: float = RMS_NORM_EPS) -> dict[str, Tensor]:
    x, weight = x.double(), weight.double()
    mean_square = (x**2).mean(-1, keepdim=True)

    def over(dim: int) -> Tensor:
        return x / torch.sqrt((x**2).mean(dim, keepdim=True) + eps) * weight

    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    variants = {
        t("You subtracted the mean: RMSNorm divides x itself by its root mean square, without centring."):
            (x - mean) / torch.sqrt(var + eps) * weight,
        t("Your epsilon is outside the square root: divide by sqrt(mean(x²) + eps), not sqrt(mean(x²)) + eps."):
            x / (torch.sqrt(mean_square) + eps) * weight,
        t("You left out epsilon: divide by sqrt(mean(x²) + eps) (eps defaults to 1e-6)."):
            x / torch.sqrt(mean_square) * weight,
    }
    if eps == RMS_NORM_EPS:
        variants[t("Your epsilon is 1e-5: RMSNorm's default here is 1e-6, as in the signature.")] = (
            x / torch.sqrt(mean_square + 1e-5) * weight)
    else:
        variants[_ignored_eps("RMSNorm", eps, RMS_NORM_EPS)] = x / torch.sqrt(mean_square + RMS_NORM_EPS) * weight
    variants[t("You divided by the mean square, not by its square root.")] = x / (mean_square + eps) * weight
    variants |= _over_axes_hints(x, over, "RMSNorm")
    variants[t("You left out the learned weight: multiply by self.weight.")] = x / torch.sqrt(mean_square + eps)
    variants |= {
        t("You divided by the weight: multiply by self.weight."): x / torch.sqrt(mean_square + eps) / weight,
        t("Your mean square is a sum: reduce x² with 'mean' (divide the sum by d_model), not 'sum'."):
            x / torch.sqrt((x**2).sum(-1, keepdim=True) + eps) * weight,
        t("You did not divide by the root mean square: divide x by sqrt(mean(x²) + eps)."): x * weight,
        t("You multiplied by sqrt(mean(x²) + eps) instead of dividing by it."):
            x * torch.sqrt(mean_square + eps) * weight,
        t("Your mean square is the mean of x cubed, negative at some positions (NaN there): square x, "
          "reduce(x**2, '... d_model -> ... 1', 'mean')."):
            x / torch.sqrt((x**3).mean(-1, keepdim=True) + eps) * weight,
    }
    return variants


def _same_nans(actual: Tensor, expected: Tensor, tolerance: float) -> bool:
    """Equal to tolerance, NaN where ``expected`` is NaN; never for an ``expected`` that holds no number at all."""
    return actual.shape == expected.shape and bool(expected.isfinite().any()) and bool(
        torch.allclose(actual.to(expected.dtype), expected, rtol=tolerance, atol=tolerance, equal_nan=True))


def _diagnose(got: Tensor, variants: dict[str, Tensor], tolerance: float, fallback: str) -> str:
    for hint, expected in variants.items():
        if _same_nans(got, expected, max(tolerance, 1e-6)):
            return hint
    if torch.isnan(got).any() or torch.isinf(got).any():
        return t("Your output contains NaN or inf: is eps added inside the square root?")
    return fallback


# -- exercise 1: LayerNorm ---------------------------------------------------------------------

def _check_parameters(cls: Any, d_model: int, expected: dict[str, float], name: str, oracle: nn.Module) -> Any:
    """Construct the student's module, compare its parameters with PyTorch's, load PyTorch's weights."""
    module = call(cls, d_model)
    params = call(_parameters, module)
    if type(params) is not dict or sorted(params) != sorted(expected):
        found = sorted(params) if type(params) is dict else kind(params)
        if "bias" in expected:
            raise CheckFailure(t("{name}({d_model}) should have the parameters {expected} (nn.Parameter, named as in "
                                 "torch.nn.{name}), got {found}. Store them as self.weight and self.bias.",
                                 name=name, d_model=d_model, expected=sorted(expected), found=found))
        raise CheckFailure(t("{name}({d_model}) should have the parameters {expected} (nn.Parameter, named as in "
                             "torch.nn.{name}), got {found}. Store them as self.weight.",
                             name=name, d_model=d_model, expected=sorted(expected), found=found))
    for param, fill in expected.items():
        value = expect_tensor(params[param], f"{name}.{param}", (d_model,), "d_model", torch.float32)
        if not torch.equal(value, torch.full_like(value, fill)):
            if fill:
                raise CheckFailure(t("{name}.{param} should start as ones (torch.ones(d_model)), so that a fresh layer "
                                     "only normalises; got {got}.", name=name, param=param, got=show(value)))
            raise CheckFailure(t("{name}.{param} should start as zeros (torch.zeros(d_model)), so that a fresh layer "
                                 "only normalises; got {got}.", name=name, param=param, got=show(value)))
    call(_load, module, {k: v.detach().clone() for k, v in oracle.state_dict().items()})
    return module


@check(forbid=BUILT_IN_NORMS)
def check_layer_norm_parameters(cls: Any, seed: int = 0) -> None:
    """LayerNorm(d_model) has `weight` (ones) and `bias` (zeros), and loads torch.nn.LayerNorm's state dict."""
    d_model = _sizes(seed)["d_model"]
    _check_parameters(cls, d_model, {"weight": 1.0, "bias": 0.0}, "LayerNorm", nn.LayerNorm(d_model))
    passed(t("parameters `weight` and `bias` of shape (d_model,), initialised like torch.nn.LayerNorm"))


def _load_random(cls: Any, seed: int, dtype: torch.dtype, with_bias: bool) -> tuple[Any, Tensor, Tensor]:
    d_model = _sizes(seed)["d_model"]
    weight, bias = _affine(seed, d_model, dtype)
    module = call(cls, d_model)
    call(_load, module, {"weight": weight, "bias": bias} if with_bias else {"weight": weight})
    return module, weight, bias


def _unchecked(module: nn.Module, x: Tensor) -> Any:
    """The module's output with jaxtyping's run-time checks switched off for this one call: what forward returned."""
    disabled = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        out = module(x)
        return out.detach().clone() if isinstance(out, Tensor) else out
    finally:
        jaxtyping.config.update("jaxtyping_disable", disabled)


def _statistic(t: Tensor, front: bool) -> Tensor:
    """The mean over d_model, its axis of size 1 last (batch, seq, 1), or in front (1, batch, seq) when ``front``."""
    return t.mean(-1)[None] if front else t.mean(-1, keepdim=True)


def _misplaced_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> dict[str, Tensor]:
    """On an input whose axes all have d_model's size, where a statistic of shape (1, batch, seq) broadcasts
    against x: a layer norm with its mean, its variance or both so placed, keyed by the hint."""
    x, weight, bias = x.double(), weight.double(), bias.double()
    found = {}
    for what, mean_front, var_front in (("mean", True, False), ("variance", False, True),
                                        ("mean and variance", True, True)):
        centred = x - _statistic(x, mean_front)
        found[what] = centred / torch.sqrt(_statistic(centred**2, var_front) + eps) * weight + bias
    return found


def _misplaced_rms_norm(x: Tensor, weight: Tensor, eps: float) -> dict[str, Tensor]:
    x, weight = x.double(), weight.double()
    return {"mean square": x / torch.sqrt(_statistic(x**2, True) + eps) * weight}


# What a norm with a misplaced statistic (the keys of _misplaced_layer_norm and _misplaced_rms_norm) is told.
MISPLACED = {
    "mean": marked(
        "On an input of shape {shape}, where every axis is d_model long, your {name} runs and equals the {name} whose "
        "mean has its axis of size 1 in front, (1, batch, seq), instead of last, (batch, seq, 1): so placed, it "
        "broadcasts against the wrong axes of x. Keep the reduced axis last: the pattern '... d_model -> ... 1' (or "
        "dim=-1 with keepdim=True)."),
    "variance": marked(
        "On an input of shape {shape}, where every axis is d_model long, your {name} runs and equals the {name} whose "
        "variance has its axis of size 1 in front, (1, batch, seq), instead of last, (batch, seq, 1): so placed, it "
        "broadcasts against the wrong axes of x. Keep the reduced axis last: the pattern '... d_model -> ... 1' (or "
        "dim=-1 with keepdim=True)."),
    "mean and variance": marked(
        "On an input of shape {shape}, where every axis is d_model long, your {name} runs and equals the {name} whose "
        "mean and variance have their axis of size 1 in front, (1, batch, seq), instead of last, (batch, seq, 1): so "
        "placed, it broadcasts against the wrong axes of x. Keep the reduced axis last: the pattern '... d_model -> "
        "... 1' (or dim=-1 with keepdim=True)."),
    "mean square": marked(
        "On an input of shape {shape}, where every axis is d_model long, your {name} runs and equals the {name} whose "
        "mean square has its axis of size 1 in front, (1, batch, seq), instead of last, (batch, seq, 1): so placed, "
        "it broadcasts against the wrong axes of x. Keep the reduced axis last: the pattern '... d_model -> ... 1' "
        "(or dim=-1 with keepdim=True)."),
}


def _crash_diagnosis(module: Any, x: Tensor, name: str, failure: CodeRaised,
                     misplaced: Callable[[Tensor], dict[str, Tensor]] | None) -> str | None:
    """After the norm raised on a (batch, seq, d_model) input: a cause confirmed by running it again, or None.

    A shape error: on a cube input (every axis d_model long) a statistic whose axis of size 1 stands in front
    broadcasts without error, and the output then equals the norm with that statistic misplaced. A jaxtyping error
    on the return value: forward runs again with the run-time checks off, and what it returned is compared with
    the module's own parameters.
    """
    if failure.error == "TypeCheckError" and "checking the return value" in failure.text:
        another = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
        try:
            returned, other = call(_unchecked, module, x), call(_unchecked, module, another)
            params = call(_parameters, module)
        except CheckFailure:
            return None  # what the first call raised is then all that is known
        if type(returned) is not Tensor or type(other) is not Tensor or type(params) is not dict:
            return None
        same = [p for p, value in params.items() if type(value) is Tensor and value.shape == returned.shape
                and torch.equal(returned, value)]
        if len(same) == 1:
            return t("Your forward returns self.{param} itself, shape {shape}: the normalised x is missing from what "
                     "it returns (x's shape {x_shape} must be kept).", param=same[0], shape=tuple(returned.shape),
                     x_shape=tuple(x.shape))
        if returned.shape == other.shape and torch.equal(returned, other):
            return t("Your forward returns the same tensor of shape {shape} whatever x is: x is missing from what it "
                     "returns (an output of x's shape, {x_shape}, normalised).", shape=tuple(returned.shape),
                     x_shape=tuple(x.shape))
        return None
    if misplaced is None or failure.error != "RuntimeError":
        return None
    n = x.shape[-1]
    cube = torch.randn(n, n, n, generator=torch.Generator().manual_seed(n), dtype=x.dtype)
    try:
        got = call(module, cube)
    except CheckFailure:
        return None
    if type(got) is not Tensor or got.shape != cube.shape:
        return None
    matches = [what for what, value in misplaced(cube).items() if _near(got, value, max(_tolerance(x.dtype), 1e-6))]
    if len(matches) != 1:
        return None
    return tr(MISPLACED[matches[0]], shape=tuple(cube.shape), name=name)


def _norm_output(module: Any, x: Tensor, name: str, label: str,
                 misplaced: Callable[[Tensor], dict[str, Tensor]] | None = None) -> Tensor:
    """The student's norm applied to x; a crash on an input with other leading axes says so, and a crash on a
    (batch, seq, d_model) input is followed by a cause where running the norm again confirms one."""
    try:
        got = call(module, x)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        if x.dim() == 3:
            hint = _crash_diagnosis(module, x, name, failure, misplaced)
            if hint is None:
                raise
            raise CheckFailure(t("{failure} {hint}", failure=_first_line(failure), hint=hint)) from None
        raise CheckFailure(t(
            "On {label} your {name} raised: {failure} A norm acts on the last axis whatever "
            "the leading axes are (*batch: none, one, or several): take the statistics over dim=-1 (or with "
            "einops' '... d_model -> ... 1'), never over a fixed axis number or a pattern with named leading axes.",
            label=label, name=name, failure=_first_line(failure))) from None
    return expect_tensor(got, t("{name}'s output on {label}", name=name, label=label), tuple(x.shape),
                         " ".join(_axes(x)), x.dtype)


def _confirm_eps(module: Any, seed: int, dtype: torch.dtype, hint: str,
                 variants: Callable[[Tensor], dict[str, Tensor]], name: str) -> str:
    """An eps slip of a LayerNorm named on inputs where eps hardly matters, confirmed on inputs of tiny variance,
    where it does: the same variant must match there too (a subtracted eps, say, is near "no eps" only where eps is
    negligible)."""
    label, scale, offset = CASES[1]
    label = tr(label)
    tiny = _input(seed, dtype, scale, offset)
    if _diagnose(_norm_output(module, tiny, name, label), variants(tiny), _tolerance(dtype), "") == hint:
        return hint
    return t("Here your output is within rounding of a {name} whose eps is left out or misplaced, but on {label} it "
             "is not: look at how eps enters the square root, sqrt(variance + eps).", name=name, label=label)


def _compare_norm(name: str, label: str, got: Tensor, expected: Tensor, variants: dict[str, Tensor],
                  tolerance: float, fallback: str, x: Tensor) -> None:
    if _near(got, expected, tolerance):
        return
    hint = _diagnose(got, variants, tolerance, fallback)
    raise CheckFailure(_differs(label, name, difference(got, expected, _sizes_of(x)), hint))


def _differs(label: str, name: str, found: str, hint: str) -> str:
    return t("With {label}, your {name} differs from torch.nn.functional.{function} ({found}). {hint}",
             label=label, name=name, function=FUNCTIONAL[name], found=found, hint=hint)


@check(forbid=BUILT_IN_NORMS)
def check_layer_norm_values(cls: Any, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to torch.nn.functional.layer_norm with the same weights, on random, tiny, offset and large inputs,
    with any leading axes and with another eps."""
    module, weight, bias = _load_random(cls, seed, dtype, with_bias=True)
    d_model = _sizes(seed)["d_model"]
    fallback = t("Compare with (x - mean) / sqrt(variance + eps) · weight + bias, over d_model.")
    cases = [*CASES, HUGE_MEAN] if dtype == torch.float64 else CASES
    # (label, input, offset, whether eps matters there: the inputs of tiny variance)
    samples = [(tr(label), _input(seed, dtype, scale, offset), offset, label == CASES[1][0])
               for label, scale, offset in cases]
    samples += [(label, x, 0.0, False) for label, x in _leading_axes(seed, dtype)]
    for label, x, offset, tiny in samples:
        got = _norm_output(module, x, "LayerNorm", label,
                           lambda cube: _misplaced_layer_norm(cube, weight, bias, LAYER_NORM_EPS))
        expected = F.layer_norm(x, (d_model,), weight, bias, eps=LAYER_NORM_EPS)
        tolerance = _tolerance(dtype, offset)
        if not _near(got, expected, tolerance):
            hint = _diagnose(got, _layer_norm_variants(x, weight, bias), tolerance, fallback)
            if hint in (tr(EPS_OUTSIDE), tr(EPS_LEFT_OUT)) and not tiny:
                hint = _confirm_eps(module, seed, dtype, hint,
                                    lambda tiny_x: _layer_norm_variants(tiny_x, weight, bias), "LayerNorm")
            if offset and hint == fallback:
                hint = t("Only inputs with a large mean go wrong: compute the variance from the centred values, "
                         "mean((x - mean)²), not as mean(x²) - mean²: the subtraction of two large numbers "
                         "loses the digits that matter.")
            raise CheckFailure(_differs(label, "LayerNorm", difference(got, expected, _sizes_of(x)), hint))
    eps = CUSTOM_EPS["LayerNorm"]
    custom = call(cls, d_model, eps=eps)
    call(_load, custom, {"weight": weight, "bias": bias})
    label = t("eps={eps} on inputs of tiny variance (x · 1e-3)", eps=eps)
    x = _input(seed, dtype, 1e-3)
    _compare_norm("LayerNorm", label, _norm_output(custom, x, "LayerNorm", label),
                  F.layer_norm(x, (d_model,), weight, bias, eps=eps), _layer_norm_variants(x, weight, bias, eps),
                  _tolerance(dtype), fallback, x)
    passed(t("equal to torch.nn.functional.layer_norm, offset and large inputs, any leading axes and another eps "
             "included ({dtype})", dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_NORMS)
def check_layer_norm_gradients(cls: Any, seed: int = 0) -> None:
    """Gradients with respect to the input, `weight` and `bias` equal torch.nn.LayerNorm's (float64)."""
    dtype = torch.float64
    d_model = _sizes(seed)["d_model"]
    module, weight, bias = _load_random(cls, seed, dtype, with_bias=True)
    oracle = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS, dtype=dtype)
    oracle.load_state_dict({"weight": weight, "bias": bias})
    _compare_gradients(module, oracle, seed, "LayerNorm", ("x", "weight", "bias"))
    passed(t("gradients with respect to x, weight and bias equal torch.nn.LayerNorm's"))


def _compare_gradients(module: Any, oracle: nn.Module, seed: int, name: str, wanted: tuple[str, ...]) -> None:
    x = _input(seed, torch.float64)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    result = call(_forward_backward, module, x, upstream)
    if not isinstance(result, tuple) or len(result) != 2 or type(result[1]) is not dict:
        raise CheckFailure(t("Could not run a backward pass through your {name}: got {got}.", name=name,
                             got=kind(result)))
    output, grads = result
    x_ref = x.clone().requires_grad_()
    reference_output = oracle(x_ref)
    expected = torch.autograd.grad(reference_output, [x_ref, *oracle.parameters()], upstream)
    sizes = _sizes(seed)
    if not isinstance(output, Tensor) or not _near(output, reference_output.detach(), 1e-8):
        # A gradient is only worth comparing once the output is right; never call a wrong output right.
        found = difference(output, reference_output.detach(), sizes) if isinstance(output, Tensor) else kind(output)
        raise CheckFailure(t(
            "Your {name}'s output differs from torch.nn.{name}'s in float64 ({found}), so its gradients cannot be "
            "right either: make the values check pass first; it names the likely mistake.", name=name, found=found))
    for what, reference in zip(wanted, expected, strict=True):
        if what not in grads:
            raise CheckFailure(t(
                "{name}'s output does not depend on {what}: is self.{what} used in forward, and is it an "
                "nn.Parameter?", name=name, what=what))
        got = expect_tensor(grads[what], t("the gradient with respect to {what}", what=what), tuple(reference.shape),
                            "batch seq d_model" if what == "x" else "d_model", torch.float64)
        if not _near(got, reference, 1e-8):
            raise CheckFailure(t(
                "Your {name}'s output is right, but its gradient with respect to {what} is not "
                "({found}). Does forward detach something (.detach(), .item(), "
                ".data, torch.no_grad()) or compute a statistic outside autograd?", name=name, what=what,
                found=difference(got, reference, sizes)))


# -- exercise 2: RMSNorm -----------------------------------------------------------------------

@check(forbid=BUILT_IN_NORMS)
def check_rms_norm_values(cls: Any, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """RMSNorm has one parameter `weight` (ones) and equals torch.nn.functional.rms_norm, on four kinds of input,
    with any leading axes and with another eps."""
    d_model = _sizes(seed)["d_model"]
    _check_parameters(cls, d_model, {"weight": 1.0}, "RMSNorm", nn.RMSNorm(d_model, eps=RMS_NORM_EPS))
    module, weight, _ = _load_random(cls, seed, dtype, with_bias=False)
    fallback = t("Compare with x / sqrt(mean(x²) + eps) · weight, the mean taken over d_model.")
    samples = [(tr(label), _input(seed, dtype, scale, offset)) for label, scale, offset in CASES]
    for label, x in [*samples, *_leading_axes(seed, dtype)]:
        got = _norm_output(module, x, "RMSNorm", label, lambda cube: _misplaced_rms_norm(cube, weight, RMS_NORM_EPS))
        _compare_norm("RMSNorm", label, got, F.rms_norm(x, (d_model,), weight, eps=RMS_NORM_EPS),
                      _rms_norm_variants(x, weight), _tolerance(dtype), fallback, x)
    eps = CUSTOM_EPS["RMSNorm"]
    custom = call(cls, d_model, eps=eps)
    call(_load, custom, {"weight": weight})
    label = t("eps={eps} on inputs of tiny variance (x · 1e-3)", eps=eps)
    x = _input(seed, dtype, 1e-3)
    _compare_norm("RMSNorm", label, _norm_output(custom, x, "RMSNorm", label),
                  F.rms_norm(x, (d_model,), weight, eps=eps), _rms_norm_variants(x, weight, eps), _tolerance(dtype),
                  fallback, x)
    passed(t("equal to torch.nn.functional.rms_norm with a `weight` only, any leading axes and another eps included "
             "({dtype})", dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_NORMS)
def check_rms_norm_gradients(cls: Any, seed: int = 0) -> None:
    """Gradients with respect to the input and `weight` equal torch.nn.RMSNorm's (float64)."""
    d_model = _sizes(seed)["d_model"]
    module, weight, _ = _load_random(cls, seed, torch.float64, with_bias=False)
    oracle = nn.RMSNorm(d_model, eps=RMS_NORM_EPS, dtype=torch.float64)
    oracle.load_state_dict({"weight": weight})
    _compare_gradients(module, oracle, seed, "RMSNorm", ("x", "weight"))
    passed(t("gradients with respect to x and weight equal torch.nn.RMSNorm's"))


# -- exercise 3: the residual sublayer ---------------------------------------------------------

def _mlp(d_model: int, seed: int) -> nn.Module:
    # The sublayer's weights are part of the check's fixed input; fork_rng leaves the
    # notebook's random state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hidden = 2 * d_model + 1
        return nn.Sequential(nn.Linear(d_model, hidden), nn.Tanh(), nn.Linear(hidden, d_model)).double()


def _residual(cls: Any, seed: int, norm_first: bool, **kwargs: Any) -> tuple[Any, nn.Module]:
    d_model = _sizes(seed)["d_model"]
    sublayer = _mlp(d_model, seed + 3)
    module = call(cls, d_model, sublayer, norm_first=norm_first, **kwargs)
    return module, sublayer


def _put_norm(module: Any, norm: nn.Module) -> None:
    if call(_set_norm, module, norm) != "ok":
        raise CheckFailure(t(
            "Residual should keep its LayerNorm in the attribute `norm` (self.norm = LayerNorm(d_model)), "
            "as its docstring says; the check could not find it."))


@check(forbid=NORM_FUNCTIONS)
def check_residual(cls: Any, norm_first: bool = False, seed: int = 0) -> None:
    """Post-norm is norm(x + sublayer(x)); pre-norm is x + sublayer(norm(x))."""
    module, sublayer = _residual(cls, seed, norm_first)
    d_model = _sizes(seed)["d_model"]
    weight, bias = _affine(seed, d_model, torch.float64)
    _put_norm(module, _ReferenceNorm(weight, bias))
    x = _input(seed, torch.float64)
    got = expect_tensor(call(module, x), t("Residual's output"), tuple(x.shape), "batch seq d_model", torch.float64)

    def norm(values: Tensor) -> Tensor:
        return F.layer_norm(values, (d_model,), weight, bias, eps=LAYER_NORM_EPS)

    with torch.no_grad():
        post, pre = norm(x + sublayer(x)), x + sublayer(norm(x))
        expected = pre if norm_first else post
        name = _branch_name(norm_first)
        if not _near(got, expected, 1e-10):
            if norm_first:
                swapped = t("You computed post-norm, norm(x + sublayer(x)): with norm_first=True it is "
                            "x + sublayer(norm(x)). Are the two branches of `if self.norm_first` swapped?")
            else:
                swapped = t("You computed pre-norm, x + sublayer(norm(x)): with norm_first=False it is "
                            "norm(x + sublayer(x)). Are the two branches of `if self.norm_first` swapped?")
            variants = {
                swapped: post if norm_first else pre,
                t("You left out the residual: add x (the input itself) to the sublayer's output."):
                    sublayer(norm(x)) if norm_first else norm(sublayer(x)),
                t("You added the normalised x: the residual path carries x itself, x + sublayer(norm(x))."):
                    norm(x) + sublayer(norm(x)),
            }
            if norm_first:
                variants[t("You normalised the sublayer's output instead of its input: pre-norm is "
                           "x + sublayer(norm(x)).")] = x + norm(sublayer(x))
            variants |= {
                t("You left out the norm: use self.norm."): x + sublayer(x),
                t("You subtracted the sublayer's output: the residual connection adds it to x."):
                    x - sublayer(norm(x)) if norm_first else norm(x - sublayer(x)),
            }
            if norm_first:
                variants[t("Your pre-norm output is x itself: the sublayer's branch, dropout(sublayer(norm(x))), is "
                           "missing from the sum.")] = x
            else:
                variants[t("Your post-norm output is norm(x): the sublayer's output is missing from the sum inside "
                           "the norm, norm(x + dropout(sublayer(x))).")] = norm(x)
                variants[t("You normalised the sublayer's output instead of the sum: post-norm is "
                           "norm(x + sublayer(x)).")] = x + norm(sublayer(x))
            hints = [h for h, v in variants.items() if _near(got, v, 1e-8)]
            hint = hints[0] if hints else t("Compare with the formula in the docstring, step by step.")
            raise CheckFailure(t("Your Residual's {name} output differs from the expected one ({found}). {hint}",
                                 name=name, found=difference(got, expected, _sizes(seed)), hint=hint))
    passed(t("pre-norm: x + sublayer(norm(x))") if norm_first else t("post-norm: norm(x + sublayer(x))"))


def _branch_name(norm_first: bool) -> str:
    return t("pre-norm (norm_first=True)") if norm_first else t("post-norm (norm_first=False)")


# Not 0.5: there nn.Dropout(1 - dropout) drops as often, and scales what it keeps as much, as nn.Dropout(dropout).
DROPOUT_P = 0.25
# The share of the sublayer's outputs dropped is a Binomial(n, p) count over the n = 16 · seq · d_model entries of a
# batch of 16 sentences: allowed is the exact binomial interval whose tails hold at most 1e-6 / 2 each
# (_noise.binomial_bounds; two comparisons a call, post- and pre-norm), 175 ... 309 of the 960 entries at seed 0
# (0.182 ... 0.322) and 161 ... 291 of 896 at seed 808 (0.180 ... 0.325). Measured by benchmarks/check_noise.py,
# part "residual_dropout", over 1000 dropout seeds with nn.Dropout(0.25): share 0.250 ± 0.014 at seed 0 (binomial
# 0.014; range 0.205 ... 0.295) and 0.250 ± 0.015 at seed 808 (range 0.204 ... 0.291). A drop rate of 1 - p with the
# kept entries scaled by 1/(1 - p) (a hand-made keep mask inverted) lies 31 (seed 0) and 29 (seed 808) of its own
# binomial standard deviations beyond the interval, 2p 11 and 10.5, p / 2 5.4 and 4.9; nn.Dropout(1 - dropout)
# keeps scaled by 1/p, which the kept entries already show (_scale_hint).


def _seeded(module: nn.Module, x: Tensor, seed: int) -> Tensor:
    """The module's output with the global RNG seeded here and restored afterwards: a reproducible dropout draw."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return module(x)


def _scale_hint(delta: Tensor, clean: Tensor, dropped: Tensor, p: float) -> str | None:
    """What the kept entries were scaled by, when it is one number other than 1/(1 - p)."""
    live = ~dropped & (clean.abs() > 1e-6)
    if not live.any():
        return None
    ratios = delta[live] / clean[live]
    factor = ratios.median().item()
    if not ((ratios - factor).abs() <= 1e-8 * (1 + abs(factor))).all():
        return None
    if abs(factor - 1 / p) <= 1e-8:
        count, n = int(dropped.sum()), dropped.numel()
        low, high = binomial_bounds(n, 1 - p)
        if low <= count <= high:  # the rate of 1 - p as well as its scale: nn.Dropout(1 - dropout), tested
            return t("the kept outputs are scaled by 1/{p} and {count} of {n} ({share:.0%}) were dropped: you "
                     "dropped with probability 1 - p (nn.Dropout(1 - dropout)); nn.Dropout's p is the probability of "
                     "dropping, so pass dropout itself.", p=p, count=count, n=n, share=count / n)
    return t("the kept outputs are scaled by {factor:.4g}, not by 1/(1 - p) = {scale:.4g}: look at the p "
             "your nn.Dropout gets (the module's dropout, the probability of dropping).", factor=factor,
             scale=1 / (1 - p))


@check(forbid=NORM_FUNCTIONS)
def check_residual_dropout(cls: Any, seed: int = 0) -> None:
    """Dropout hits the sublayer's output only, in training mode only, with the p given, in post-norm and pre-norm
    alike."""
    sizes = _sizes(seed)
    p = DROPOUT_P
    shares = []
    for norm_first in (False, True):
        name = _branch_name(norm_first)
        module, sublayer = _residual(cls, seed, norm_first=norm_first, dropout=p)
        # With the norm made the identity, pre- and post-norm both read x + dropout(sublayer(x)):
        # what is measured here is where the dropout goes, whatever the order.
        _put_norm(module, _Identity())
        x = _input(seed, torch.float64)
        with torch.no_grad():
            clean = sublayer(x)
        call(_set_training, module, False)
        got = expect_tensor(call(module, x), t("Residual's output"), tuple(x.shape), "batch seq d_model",
                            torch.float64)
        if not _near(got, x + clean, 1e-10):
            raise CheckFailure(t(
                "In eval mode (module.eval()) dropout must do nothing, but your {name} output is not x + sublayer(x) "
                "with the norm taken out ({found}). Use nn.Dropout (it switches off in "
                "eval mode) rather than a hand-made mask.", name=name, found=difference(got, x + clean, sizes)))
        # In training, on a batch of 16 sentences: the share dropped is then a count over 16 · seq · d_model entries,
        # narrow enough that a rate far from p shows (see DROPOUT_P).
        x = torch.randn(16, *x.shape[1:], generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64)
        with torch.no_grad():
            clean = sublayer(x)
        sizes = {**sizes, "batch": 16}
        call(_set_training, module, True)
        got = expect_tensor(call(_seeded, module, x, seed + 6000 + norm_first), t("Residual's output"),
                            tuple(x.shape), "batch seq d_model", torch.float64)
        delta = got - x
        dropped = delta.abs() <= 1e-12
        kept = (delta - clean / (1 - p)).abs() <= 1e-10  # nn.Dropout scales what it keeps by 1 / (1 - p)
        if _near(got, x + clean, 1e-10):
            raise CheckFailure(t(
                "With dropout={p} in training mode your {name} output has no dropout at all (the norm taken out, "
                "it is x + sublayer(x); {found}): store nn.Dropout(dropout) as "
                "self.dropout and apply it to the sublayer's output, in both branches of `if self.norm_first`.",
                p=p, name=name, found=difference(got, x + clean, sizes)))
        if not (dropped | kept).all():
            hint = _scale_hint(delta, clean, dropped, p)
            if hint is not None:
                raise CheckFailure(t("With dropout={p} in training mode, in {name}: {hint}", p=p, name=name,
                                     hint=hint))
            worst = torch.minimum(delta.abs(), (delta - clean / (1 - p)).abs())
            raise CheckFailure(t(
                "Dropout seems to hit more than the sublayer's output in {name}: each entry of output - x should be "
                "either 0 (dropped) or sublayer(x) / (1 - p) (kept, scaled by 1/(1-p) = {scale:.4g}); "
                "{found} from the nearer of the two. Apply self.dropout "
                "to the sublayer's output only, never to x or to the residual sum.", name=name, scale=1 / (1 - p),
                found=difference(worst, torch.zeros_like(worst), sizes)))
        count, n = int(dropped.sum()), dropped.numel()
        shares.append(count / n)
        problem = dropped_count_problem(count, n, p)  # two comparisons per call
        if problem is not None:
            raise CheckFailure(t("With dropout={p}, {count} of the sublayer's {n} outputs ({share:.0%}) were "
                                 "dropped in {name} (sizes {sizes}); {problem}", p=p, count=count, n=n,
                                 share=count / n, name=name, sizes=", ".join(f"{a}={v}" for a, v in sizes.items()),
                                 problem=problem))
    passed(t("dropout hits the sublayer's output only ({post:.0%} and {pre:.0%} dropped at p={p}, post- "
             "and pre-norm), and only in training mode", post=shares[0], pre=shares[1], p=p))


# -- exercise 4: measure gradient norms per layer ----------------------------------------------

class _Block(nn.Module):
    """A pre- or post-norm MLP block written independently of the student's and the library's."""

    def __init__(self, d_model: int, norm_first: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Linear(4 * d_model, d_model))
        self.ln = nn.LayerNorm(d_model)
        self.norm_first = norm_first

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.ln(x)) if self.norm_first else self.ln(x + self.mlp(x))


def _stack(seed: int, norm_first: bool, depth: int) -> tuple[nn.ModuleList, Tensor, Tensor]:
    s = _sizes(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 5)
        blocks = nn.ModuleList([_Block(s["d_model"], norm_first) for _ in range(depth)]).double()
    g = torch.Generator().manual_seed(seed + 6)
    x = torch.randn(s["batch"], s["seq"], s["d_model"], generator=g, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)
    return blocks, x, upstream


def _reference_gradient_norms(blocks: nn.ModuleList, x: Tensor, upstream: Tensor) -> tuple[Tensor, list[list[Tensor]]]:
    out = x
    for block in blocks:
        out = block(out)
    params = [list(b.parameters()) for b in blocks]
    grads = torch.autograd.grad(out, [p for ps in params for p in ps], upstream)
    per_block, i = [], 0
    for ps in params:
        per_block.append(list(grads[i:i + len(ps)]))
        i += len(ps)
    flat = [torch.cat([g.flatten() for g in gs]) for gs in per_block]
    return torch.stack([torch.linalg.vector_norm(f) for f in flat]), per_block


def _slicing_variants(per_block: list[list[Tensor]]) -> dict[str, Tensor]:
    """The norms that slicing the flat list of gradients per block gives when the slice or the running index is
    off, keyed by the hint: each slice taken with Python's own rules (an empty one gives 0)."""
    flat = [g for gs in per_block for g in gs]
    lengths = [len(gs) for gs in per_block]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def norms(bounds: Callable[[int, int, int], tuple[int, int]]) -> Tensor:
        found = []
        for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            kept = flat[slice(*bounds(i, start, n))]
            found.append(torch.stack([(g**2).sum() for g in kept]).sum().sqrt() if kept else flat[0].new_zeros(()))
        return torch.stack(found)

    return {
        t("Each block's slice of the gradient list is shifted by one parameter: the running start index should "
          "begin at 0."): norms(lambda i, start, n: (start + 1, start + 1 + n)),
        t("Each block's slice leaves out its first parameter: take grads[start:start + len(ps)]."):
            norms(lambda i, start, n: (start + 1, start + n)),
        t("Each block's slice leaves out its last parameter: take grads[start:start + len(ps)]."):
            norms(lambda i, start, n: (start, start + n - 1)),
        t("Each block's slice takes one parameter of the next block too: take grads[start:start + len(ps)]."):
            norms(lambda i, start, n: (start, start + n + 1)),
        t("Each block's slice ends at len(ps) instead of start + len(ps)."):
            norms(lambda i, start, n: (start, n)),
        t("Each block's slice ends at start - len(ps) instead of start + len(ps)."):
            norms(lambda i, start, n: (start, start - n)),
        t("Your running start index goes down by each block's parameter count: after each block it should grow "
          "(start += len(ps))."): norms(lambda i, start, n: (-start, -start + n)),
    }


@check
def check_gradient_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """Per-block parameter gradient norms equal an independent autograd computation, also when called twice."""
    depth = 8
    ratios = {}
    for norm_first in (False, True):
        blocks, x, upstream = _stack(seed, norm_first, depth)
        expected, per_block = _reference_gradient_norms(blocks, x, upstream)
        for attempt in ("first", "second"):
            got = expect_tensor(call(fn, blocks, x, upstream), t("the gradient norms"), (depth,), "layer",
                                torch.float64)
            if _near(got, expected, 1e-8):
                continue
            twice = t("Your second call gives twice the gradients: .grad accumulates across backward passes. Zero "
                      "the gradients first (blocks.zero_grad()) or use torch.autograd.grad.")
            variants = {
                twice: 2 * expected,
                t("You returned squared norms. The square root is missing: take the square root of the sum of "
                  "squares."): expected**2,
                **_slicing_variants(per_block),
                t("Entry i should belong to blocks[i]: the first block first."): expected.flip(0),
                t("Combine all parameters of a block into one norm, sqrt(Σ g²) over every entry, not the sum of "
                  "each parameter's norm."): torch.stack([sum(g.norm() for g in gs) for gs in per_block]),
                t("Use every parameter of the block (both Linear layers, weights and biases, and the norm)."):
                    torch.stack([gs[0].norm() for gs in per_block]),
                t("You took the mean of each parameter's squared gradients instead of their sum: sqrt(Σ g²) adds "
                  "up every entry."): torch.stack([sum((g**2).mean() for g in gs).sqrt() for gs in per_block]),
                t("You took the mean of the block's per-parameter sums of squares instead of their sum: sqrt(Σ g²) "
                  "adds up every parameter's."): torch.stack([torch.stack([(g**2).sum() for g in gs]).mean().sqrt()
                                                             for gs in per_block]),
            }
            # A hint is given only when the output equals that one variant; every block's gradient is nonzero, so
            # none of them equals the right answer.
            named = [h for h, v in variants.items() if _near(got, v, 1e-8)]
            if len(named) == 1:
                hint = named[0]
            elif torch.equal(got, torch.zeros_like(got)):
                hint = t("Every norm is 0, although every block's parameters get a nonzero gradient here: no gradient "
                         "reached the sums of squares. Look at which gradients each block's sum keeps: its slice of "
                         "the gradient list, and any test on the gradients.")
            elif torch.isnan(got).any():
                hint = t("Some norms are NaN, although a sum of squared gradients is never negative: look at what "
                         "each block's square root is taken of.")
            else:
                hint = t("Run x through the blocks in order, then take the gradient of (output · upstream).sum() "
                         "with respect to each block's parameters.")
            # The doubled gradients are the one hint about the second call already.
            if attempt == "second" and hint != twice:
                hint = t("Your first call was right but the second differs: does it depend on old .grad values? "
                         "{hint}", hint=hint)
            found = difference(got, expected, {"layer": depth, **_sizes(seed)})
            raise CheckFailure(tr(GRADIENT_STACK[norm_first, attempt], depth=depth, got=show(got),
                                  expected=show(expected), found=found, hint=hint))
        ratios[norm_first] = (got[0] / got[-1]).item()
    passed(t("first/last gradient norm over {depth} blocks: post-norm {post:.2f}, pre-norm {pre:.2f}", depth=depth,
             post=ratios[False], pre=ratios[True]))


# What check_gradient_measurement says, by (norm_first, which call).
GRADIENT_STACK = {
    (False, "first"): marked("On a {depth}-block post-norm stack (first call), your gradient norms {got} differ from "
                             "{expected} ({found}). {hint}"),
    (False, "second"): marked("On a {depth}-block post-norm stack (second call), your gradient norms {got} differ "
                              "from {expected} ({found}). {hint}"),
    (True, "first"): marked("On a {depth}-block pre-norm stack (first call), your gradient norms {got} differ from "
                            "{expected} ({found}). {hint}"),
    (True, "second"): marked("On a {depth}-block pre-norm stack (second call), your gradient norms {got} differ "
                             "from {expected} ({found}). {hint}"),
}
