"""stepformer.norms against torch.nn.LayerNorm / RMSNorm, and the chapter 05 checks on right and wrong code."""

import re

import pytest
import torch
import torch.nn.functional as F
from beartype import beartype
from einops import reduce
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jaxtyping import Float, TypeCheckError, jaxtyped
from torch import Tensor, nn

import stepformer.norms
from stepformer.checks._core import CheckFailure
from stepformer.checks.norms import (
    _sizes,
    check_gradient_measurement,
    check_layer_norm_gradients,
    check_layer_norm_parameters,
    check_layer_norm_values,
    check_residual,
    check_residual_dropout,
    check_rms_norm_gradients,
    check_rms_norm_values,
)
from stepformer.norms import LayerNorm, Residual, RMSNorm, parameter_gradient_norms
from tests.fixtures.student import student_copy

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-6}

shapes = st.fixed_dictionaries({
    "batch": st.lists(st.integers(1, 4), min_size=0, max_size=2),
    "d_model": st.integers(2, 24),
    "seed": st.integers(0, 2**31 - 1),
    "dtype": st.sampled_from([torch.float32, torch.float64]),
    "scale": st.sampled_from([1e-3, 1.0, 1e3]),
    "offset": st.sampled_from([0.0, 100.0]),
})


def _input(s, requires_grad=False):
    # x · 1e-3 + 100 is below float32's resolution at 100: no implementation can get it right.
    assume(not (s["offset"] and s["scale"] < 1 and s["dtype"] == torch.float32))
    g = torch.Generator().manual_seed(s["seed"])
    x = torch.randn(*s["batch"], s["d_model"], generator=g, dtype=s["dtype"]) * s["scale"] + s["offset"]
    upstream = torch.randn(x.shape, generator=g, dtype=s["dtype"])
    return g, x.requires_grad_(requires_grad), upstream


def _pair(ours_cls, theirs, g, dtype):
    """Our module and PyTorch's with the same random weights."""
    theirs = theirs.to(dtype)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    ours = ours_cls(theirs.normalized_shape[0]).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _grads(module, x, upstream):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    return y, torch.autograd.grad(y, [x, *module.parameters()], upstream)


def _tolerance(s):
    # float32 x + 100: the rounding of x itself (~1e-5 at 100) reaches the output.
    return TOLERANCE[s["dtype"]] * (1 + s["offset"] if s["dtype"] == torch.float32 else 1)


@settings(max_examples=80, deadline=None)
@given(shapes)
def test_layer_norm_matches_pytorch_values_and_gradients(s):
    g, x, upstream = _input(s)
    ours, theirs = _pair(LayerNorm, nn.LayerNorm(s["d_model"]), g, s["dtype"])
    (y, grads), (y_ref, grads_ref) = _grads(ours, x, upstream), _grads(theirs, x, upstream)
    tol = _tolerance(s)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(y, F.layer_norm(x, (s["d_model"],), theirs.weight, theirs.bias), rtol=tol, atol=tol)
    for a, b in zip(grads, grads_ref, strict=True):
        # Gradients scale like 1/std: compare relative to their size.
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol * 10 * (1 + b.abs().max().item()))


@settings(max_examples=80, deadline=None)
@given(shapes)
def test_rms_norm_matches_pytorch_values_and_gradients(s):
    g, x, upstream = _input(s)
    ours, theirs = _pair(RMSNorm, nn.RMSNorm(s["d_model"], eps=1e-6), g, s["dtype"])
    (y, grads), (y_ref, grads_ref) = _grads(ours, x, upstream), _grads(theirs, x, upstream)
    tol = TOLERANCE[s["dtype"]]
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(y, F.rms_norm(x, (s["d_model"],), theirs.weight, eps=1e-6), rtol=tol, atol=tol)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol * 10 * (1 + b.abs().max().item()))


def test_float64_agrees_to_1e6_including_overflow_cases():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        batch, seq, d_model = torch.randint(1, 9, (3,), generator=g).tolist()
        d_model += 1
        for scale, offset in ((1.0, 0.0), (1.0, 100.0), (1e3, 0.0), (1e-3, 0.0), (1.0, 1e4)):
            x = torch.randn(batch, seq, d_model, generator=g, dtype=torch.float64) * scale + offset
            ln, ln_ref = _pair(LayerNorm, nn.LayerNorm(d_model), g, torch.float64)
            rms, rms_ref = _pair(RMSNorm, nn.RMSNorm(d_model, eps=1e-6), g, torch.float64)
            with torch.no_grad():
                assert (ln(x) - ln_ref(x)).abs().max() <= 1e-6
                assert (rms(x) - rms_ref(x)).abs().max() <= 1e-6


def test_defaults_match_pytorch_and_state_dicts_load_both_ways():
    ln, rms = LayerNorm(7), RMSNorm(7)
    assert ln.eps == nn.LayerNorm(7).eps == 1e-5 and rms.eps == 1e-6
    # Compare the defaults by their outputs on small-scale inputs, where eps matters.
    x = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(3)) * 1e-3
    with torch.no_grad():
        torch.testing.assert_close(ln(x), nn.LayerNorm(7)(x))
        # The course's RMSNorm default is LLaMA's eps=1e-6, as its docstring and chapter 05 say;
        # nn.RMSNorm's default eps=None is finfo(float32).eps, which gives other numbers here.
        torch.testing.assert_close(rms(x), nn.RMSNorm(7, eps=1e-6)(x))
        assert nn.RMSNorm(7).eps is None
        assert (rms(x) - nn.RMSNorm(7)(x)).abs().max() > 0.1
    assert "eps=1e-6" in RMSNorm.__doc__ and "finfo" in RMSNorm.__doc__
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in rms.named_parameters()] == ["weight"]
    assert (ln.weight == 1).all() and (ln.bias == 0).all() and (rms.weight == 1).all()
    nn.LayerNorm(7).load_state_dict(ln.state_dict())
    nn.RMSNorm(7).load_state_dict(rms.state_dict())


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for module in (LayerNorm(5).double(), RMSNorm(5).double()):
        assert torch.autograd.gradcheck(module, (x,))


def test_layer_norm_output_has_zero_mean_and_unit_variance():
    x = torch.randn(4, 6, 9, dtype=torch.float64) * 3 + 5
    y = LayerNorm(9, eps=0.0).double()(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4, 6, dtype=torch.float64))
    torch.testing.assert_close(y.var(-1, correction=0), torch.ones(4, 6, dtype=torch.float64))


# -- the residual sublayer -----------------------------------------------------------------------

def _mlp(d_model):
    return nn.Sequential(nn.Linear(d_model, 3 * d_model), nn.GELU(), nn.Linear(3 * d_model, d_model)).double()


@pytest.mark.parametrize("seed", range(5))
def test_residual_matches_its_definition(seed):
    torch.manual_seed(seed)
    d_model = 4 + seed
    x = torch.randn(3, 5, d_model, dtype=torch.float64)
    for norm_first in (False, True):
        block = Residual(d_model, _mlp(d_model), norm_first=norm_first).double()
        with torch.no_grad():
            block.norm.weight.normal_()
            block.norm.bias.normal_()
            norm = nn.LayerNorm(d_model).double()
            norm.load_state_dict(block.norm.state_dict())
            expected = x + block.sublayer(norm(x)) if norm_first else norm(x + block.sublayer(x))
            torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


def test_residual_agrees_with_pytorch_encoder_layer_structure():
    """A post-norm Residual(feed-forward) equals the feed-forward half of nn.TransformerEncoderLayer."""
    torch.manual_seed(0)
    d_model, d_ff = 8, 16
    layer = nn.TransformerEncoderLayer(d_model, 2, d_ff, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(2, 5, d_model, dtype=torch.float64)
    for norm_first in (False, True):
        layer.norm_first = norm_first
        ff = nn.Sequential(layer.linear1, nn.ReLU(), layer.linear2)
        block = Residual(d_model, ff, norm_first=norm_first).double()
        block.norm.load_state_dict(layer.norm2.state_dict())
        with torch.no_grad():
            expected = x + layer._ff_block(layer.norm2(x)) if norm_first else layer.norm2(x + layer._ff_block(x))
            torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


def test_residual_dropout_only_on_the_sublayer_and_only_in_training():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 10, dtype=torch.float64)
    block = Residual(10, _mlp(10), norm_first=True, dropout=0.5).double()
    with torch.no_grad():
        clean = block.sublayer(block.norm(x))
        block.eval()
        torch.testing.assert_close(block(x), x + clean)
        block.train()
        delta = block(x) - x
    assert ((delta.abs() < 1e-12) | ((delta - 2 * clean).abs() < 1e-10)).all()
    assert 0.3 < (delta.abs() < 1e-12).double().mean() < 0.7


def test_parameter_gradient_norms_match_backward():
    torch.manual_seed(0)
    blocks = nn.ModuleList([Residual(6, _mlp(6), norm_first=True) for _ in range(4)]).double()
    x, upstream = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    got = parameter_gradient_norms(blocks, x, upstream)
    out = x
    for block in blocks:
        out = block(out)
    (out * upstream).sum().backward()
    expected = torch.stack([torch.cat([p.grad.flatten() for p in b.parameters()]).norm() for b in blocks])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parameter_gradient_norms(blocks, x, upstream), got)  # .grad is left alone


def test_wrong_shapes_and_dtypes_fail_naming_the_axis():
    with pytest.raises(TypeCheckError, match="d_model"):
        LayerNorm(4)(torch.randn(3, 1))  # a width of 1 broadcasts to d_model: the return annotation catches it
    with pytest.raises(TypeCheckError, match="x"):
        RMSNorm(4)(torch.ones(3, 4, dtype=torch.long))


# -- the checks ------------------------------------------------------------------------------------

student = student_copy(stepformer.norms)


class Stub(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError()


def stub(*args, **kwargs):
    raise NotImplementedError()


def test_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(50):
        sizes = list(_sizes(seed).values())
        assert len(set(sizes)) == len(sizes)


class Norm(nn.Module):
    """A standalone LayerNorm/RMSNorm with switches for the usual mistakes (not the library's code)."""

    def __init__(self, d_model, eps=None, *, rms=False, unbiased=False, eps_outside=False, dim=-1, centre=None,
                 affine=True, bias_first=False, cancel=False, detach=False, names=("weight", "bias"), init=1.0):
        super().__init__()
        self.rms, self.eps = rms, (1e-6 if rms else 1e-5) if eps is None else eps
        self.unbiased, self.eps_outside, self.dim = unbiased, eps_outside, dim
        self.centre = (not rms) if centre is None else centre
        self.affine, self.bias_first, self.cancel, self.detach = affine, bias_first, cancel, detach
        self.names = names
        setattr(self, names[0], nn.Parameter(torch.full((d_model,), init)))
        if not rms:
            setattr(self, names[1], nn.Parameter(torch.zeros(d_model)))

    def forward(self, x):
        mean = x.mean(self.dim, keepdim=True)
        if self.detach:
            mean = mean.detach()
        if self.centre:
            if self.cancel:
                var = (x**2).mean(self.dim, keepdim=True) - mean**2
            else:
                var = x.var(self.dim, keepdim=True, correction=1 if self.unbiased else 0)
            x = x - mean
        else:
            var = (x**2).mean(self.dim, keepdim=True)
        y = x / (var.sqrt() + self.eps) if self.eps_outside else x / (var + self.eps).sqrt()
        if not self.affine:
            return y
        weight = getattr(self, self.names[0])
        bias = 0.0 if self.rms else getattr(self, self.names[1])
        return (y + bias) * weight if self.bias_first else y * weight + bias


def layer_norm(**switches):
    # A switch wins over the constructor's eps: it is the student's hard-coded value.
    return lambda d_model, eps=None: Norm(d_model, **({"eps": eps} if eps is not None else {}) | switches)


def rms_norm(**switches):
    return lambda d_model, eps=None: Norm(d_model, rms=True, **({"eps": eps} if eps is not None else {}) | switches)


LAYER_NORM_CHECKS = [check_layer_norm_parameters, check_layer_norm_values, check_layer_norm_gradients]
RMS_NORM_CHECKS = [check_rms_norm_values, check_rms_norm_gradients]


@pytest.mark.parametrize("check", LAYER_NORM_CHECKS)
def test_layer_norm_checks_pass_on_the_solution_and_fail_on_the_stub(check, capsys):
    check(student.LayerNorm)
    check(student.LayerNorm, seed=17)
    check(Norm, seed=5)
    assert "✔" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(Stub)


@pytest.mark.parametrize("check", RMS_NORM_CHECKS)
def test_rms_norm_checks_pass_on_the_solution_and_fail_on_the_stub(check, capsys):
    check(student.RMSNorm)
    check(student.RMSNorm, seed=23)
    check(rms_norm(), seed=5)
    assert "✔" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(Stub)


@pytest.mark.parametrize(("check", "kwargs"), [
    (check_layer_norm_values, {}), (check_layer_norm_values, {"dtype": torch.float64, "seed": 3}),
])
@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (layer_norm(unbiased=True), "unbiased variance"),
        (layer_norm(eps_outside=True), "epsilon is outside the square root"),
        (layer_norm(eps=0.0), "left out epsilon"),
        (layer_norm(dim=0), "over the batch axis"),
        (layer_norm(dim=1), "over the seq axis"),
        (layer_norm(centre=False), "did not subtract the mean"),
        (layer_norm(bias_first=True), "bias before multiplying"),
        (layer_norm(affine=False), "left out the learned weight and bias"),
        # Section 3: the sizes and the largest difference with the named mistake.
        (layer_norm(unbiased=True), r"\(largest difference .* on sizes batch=\d+, seq=\d+, d_model=\d+\)\. You used "
                                    "the unbiased variance"),
    ],
)
def test_layer_norm_checks_name_the_mistake(check, kwargs, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake, **kwargs)


def test_layer_norm_checks_name_the_subtler_mistakes():
    with pytest.raises(CheckFailure, match="large mean"):
        check_layer_norm_values(layer_norm(cancel=True))
    with pytest.raises(CheckFailure, match=r"gradient with respect to x is not \(largest difference"):
        check_layer_norm_gradients(layer_norm(detach=True))
    # A wrong output is never called right by the gradient check: it says the output differs, and where.
    for wrong in (layer_norm(unbiased=True), layer_norm(eps_outside=True), layer_norm(centre=False)):
        with pytest.raises(CheckFailure, match=r"output differs from torch.nn.LayerNorm's in float64 \(largest "
                                               r"difference .* on sizes batch=2, seq=5, d_model=12\)") as failure:
            check_layer_norm_gradients(wrong)
        assert "output is right" not in str(failure.value)
    with pytest.raises(CheckFailure, match="parameters \\['bias', 'weight'\\]"):
        check_layer_norm_parameters(layer_norm(names=("gamma", "beta")))
    with pytest.raises(CheckFailure, match="should start as ones"):
        check_layer_norm_parameters(layer_norm(init=0.5))


def test_a_variance_that_cancels_fails_in_float64_and_float32():
    """Gap 14: E[x²] - E[x]² passed every float64 run (x + 100 loses no digit that shows at 1e-10) and some
    float32 ones (the tolerance at x + 100 was 1e-3)."""
    for seed, dtype in ((202, torch.float64), (2, torch.float32), (10, torch.float32)):
        with pytest.raises(CheckFailure, match=r"With inputs with a (huge|large) mean .*large mean go wrong"):
            check_layer_norm_values(layer_norm(cancel=True), seed=seed, dtype=dtype)


def test_a_hard_coded_eps_fails():
    """Gap 12: eps was never passed, so a hard-coded default passed."""
    with pytest.raises(CheckFailure, match=r"With eps=0.01 on inputs of tiny variance .*\(largest difference .* on "
                                           r"sizes batch=2, seq=5, d_model=12\)\. You ignored the eps argument"):
        check_layer_norm_values(layer_norm(eps=1e-5))
    with pytest.raises(CheckFailure, match=r"With eps=0.001 .*You ignored the eps argument: RMSNorm"):
        check_rms_norm_values(rms_norm(eps=1e-6))


class NamedAxes(Norm):
    def forward(self, x):  # statistics over d_model, but the pattern names exactly two leading axes
        mean = reduce(x, "batch seq d_model -> batch seq 1", "mean")
        variance = reduce((x - mean) ** 2, "batch seq d_model -> batch seq 1", "mean")
        return (x - mean) / torch.sqrt(variance + self.eps) * self.weight + self.bias


def test_norms_on_other_leading_axes():
    """Gap 13: only (batch, seq, d_model) inputs, so a fixed axis number or named leading axes passed."""
    for check, mistake, name in ((check_layer_norm_values, layer_norm(dim=2), "LayerNorm"),
                                 (check_rms_norm_values, rms_norm(dim=2), "RMSNorm")):
        with pytest.raises(CheckFailure, match=rf"On a 2-D input \(seq, d_model\) your {name} raised: .*IndexError.*"
                                               r"take the statistics over dim=-1"):
            check(mistake)
    with pytest.raises(CheckFailure, match=r"On a 2-D input .* raised: .*EinopsError"):
        check_layer_norm_values(NamedAxes)


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (rms_norm(centre=True), "You subtracted the mean"),
        (rms_norm(eps_outside=True), "epsilon is outside the square root"),
        (rms_norm(eps=1e-5), "Your epsilon is 1e-5"),
        (rms_norm(dim=1), "over the seq axis"),
        (rms_norm(affine=False), "left out the learned weight"),
        (layer_norm(), "should have the parameters \\['weight'\\]"),
    ],
)
def test_rms_norm_checks_name_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_rms_norm_values(mistake)


class Res(nn.Module):
    """A standalone residual sublayer with switches for the usual mistakes."""

    def __init__(self, d_model, sublayer, norm_first=False, dropout=0.0, *, swap=False, skip=True,
                 residual_of_norm=False, dropout_on_sum=False, norm_name="norm", broken_norm=False, post_dropout=True):
        super().__init__()
        self.sublayer, self.drop, self.norm_first = sublayer, nn.Dropout(dropout), norm_first != swap
        self.post_dropout = post_dropout
        self.skip, self.residual_of_norm, self.dropout_on_sum = skip, residual_of_norm, dropout_on_sum
        self.norm_name = norm_name
        setattr(self, norm_name, Norm(d_model, unbiased=broken_norm, eps_outside=broken_norm))

    def forward(self, x):
        norm = getattr(self, self.norm_name)
        if self.norm_first:
            base = norm(x) if self.residual_of_norm else x
            inner = self.sublayer(norm(x))
            if self.dropout_on_sum:
                return self.drop(base + inner)
            return base + self.drop(inner) if self.skip else self.drop(inner)
        inner = self.drop(self.sublayer(x)) if self.post_dropout else self.sublayer(x)
        return norm(x + inner if self.skip else inner)


def residual(**switches):
    return lambda *args, **kwargs: Res(*args, **kwargs, **switches)


def test_residual_checks_pass_on_the_solution_and_fail_on_the_stub(capsys):
    for norm_first in (False, True):
        check_residual(student.Residual, norm_first=norm_first)
        check_residual(Res, norm_first=norm_first, seed=9)
        with pytest.raises(CheckFailure, match="not implemented yet"):
            check_residual(Stub, norm_first=norm_first)
    check_residual_dropout(student.Residual)
    check_residual_dropout(Res, seed=4)
    assert "✔" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_residual_dropout(Stub)


@pytest.mark.parametrize(
    ("check", "kwargs", "mistake", "message"),
    [
        (check_residual, {"norm_first": False}, residual(swap=True), "You computed pre-norm.*swapped"),
        (check_residual, {"norm_first": True}, residual(swap=True), "You computed post-norm.*swapped"),
        (check_residual, {"norm_first": True}, residual(skip=False), "left out the residual"),
        (check_residual, {"norm_first": False}, residual(skip=False), "left out the residual"),
        (check_residual, {"norm_first": True}, residual(residual_of_norm=True), "added the normalised x"),
        (check_residual, {"norm_first": True}, residual(norm_name="ln"), "attribute `norm`"),
        (check_residual_dropout, {}, residual(dropout_on_sum=True), "more than the sublayer's output"),
        (check_residual_dropout, {}, lambda d, s, norm_first=False, dropout=0.0: Res(d, s, norm_first),
         "no dropout at all"),
        # Gap 1: only pre-norm was run with dropout, so a post-norm branch without it passed.
        (check_residual_dropout, {}, residual(post_dropout=False),
         r"your post-norm \(norm_first=False\) output has no dropout at all .*largest difference 0 .* in both "
         r"branches of `if self.norm_first`"),
        # Section 3: the sizes and the largest difference.
        (check_residual, {"norm_first": False}, residual(swap=True),
         r"\(largest difference .* on sizes batch=2, seq=5, d_model=12\)\. You computed pre-norm"),
        (check_residual_dropout, {}, residual(dropout_on_sum=True), r"pre-norm.*largest difference .* from the nearer"),
        # Issue 27: at p = 0.5 nn.Dropout(1 - dropout) was nn.Dropout(dropout); the check now drops with p = 0.25.
        (check_residual_dropout, {}, lambda d, s, norm_first=False, dropout=0.0: Res(d, s, norm_first, 1 - dropout),
         r"scaled by 1/0\.25 and \d+ of \d+ \(\d+%\) were dropped: you dropped with probability 1 - p"),
        (check_residual_dropout, {}, lambda d, s, norm_first=False, dropout=0.0: Res(d, s, norm_first, 0.5),
         r"scaled by 2, not by 1/\(1 - p\) = 1\.333"),
    ],
)
def test_residual_checks_name_the_mistake(check, kwargs, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake, **kwargs)


def test_residual_checks_ignore_a_broken_layer_norm():
    """Exercise 3 is graded on the composition: the check swaps the student's norm for its own."""
    for norm_first in (False, True):
        check_residual(residual(broken_norm=True), norm_first=norm_first)


def gradient_norms(blocks, x, upstream, *, accumulate=False, squared=False, per_parameter=False, reverse=False):
    """A standalone measurement with switches for the usual mistakes."""
    out = x
    for block in blocks:
        out = block(out)
    if accumulate:
        (out * upstream).sum().backward()
        grads = [[p.grad for p in b.parameters()] for b in blocks]
    else:
        flat = torch.autograd.grad(out, list(blocks.parameters()), upstream)
        sizes = [len(list(b.parameters())) for b in blocks]
        grads = [list(flat[sum(sizes[:i]):sum(sizes[:i + 1])]) for i in range(len(blocks))]
    if per_parameter:
        norms = torch.stack([sum(g.norm() for g in gs) for gs in grads])
    else:
        norms = torch.stack([sum((g**2).sum() for g in gs) for gs in grads])
        norms = norms if squared else norms.sqrt()
    return (norms.flip(0) if reverse else norms).detach()


def test_measurement_check(capsys):
    check_gradient_measurement(student.parameter_gradient_norms)
    check_gradient_measurement(gradient_norms, seed=6)
    assert "✔" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_gradient_measurement(stub)
    for switch, message in (("accumulate", "twice the gradients"), ("squared", "squared norms"),
                            ("per_parameter", "not the sum of each parameter's norm"),
                            ("reverse", "the first block first")):
        with pytest.raises(CheckFailure, match=message):
            check_gradient_measurement(lambda *args, s=switch: gradient_norms(*args, **{s: True}))


# -- own work ---------------------------------------------------------------------------------------

class CallsPyTorch(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class WrapsPyTorch(nn.Module):
    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.inner = nn.RMSNorm(d_model, eps=eps)

    def forward(self, x):
        return self.inner(x)


class CallsTheLibrary(stepformer.norms.LayerNorm):
    pass


def test_own_work_is_enforced():
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_layer_norm_values(CallsPyTorch)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_rms_norm_gradients(WrapsPyTorch)
    with pytest.raises(CheckFailure, match="reference library"):
        check_gradient_measurement(lambda *args: stepformer.norms.parameter_gradient_norms(*args))


# -- issue 27: verified diagnoses of the usual slips ------------------------------------------------

class Written(nn.Module):
    """A LayerNorm (or, with rms, an RMSNorm) whose forward is a given formula: one slip each. Its forward is
    annotated and checked at run time like the notebook's."""

    rms = False

    def __init__(self, d_model, eps=None):
        super().__init__()
        self.eps = (1e-6 if self.rms else 1e-5) if eps is None else eps
        self.weight = nn.Parameter(torch.ones(d_model))
        if not self.rms:
            self.bias = nn.Parameter(torch.zeros(d_model))

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        return self.formula(x)


def written(formula, rms=False):
    return type("Written", (Written,), {"rms": rms, "formula": lambda self, x: formula(self, x)})


def _layer_norm(m, x, *, mean_of=None, var_of=None, centre=lambda x, mean: x - mean, scale=None, affine=None):
    """A layer norm built from parts, each replaceable by a slip."""
    mean = (mean_of or (lambda t: t.mean(-1, keepdim=True)))(x)
    centred = centre(x, mean)
    variance = (var_of or (lambda t: t.mean(-1, keepdim=True)))(centred**2)
    normalised = (scale or (lambda c, v: c / torch.sqrt(v + m.eps)))(centred, variance)
    return (affine or (lambda n: n * m.weight + m.bias))(normalised)


def _front(t):
    return reduce(t, "... d_model -> 1 ...", "mean")


LAYER_NORM_SLIPS = {
    "no_weight": (lambda m, x: _layer_norm(m, x, affine=lambda n: n + m.bias), "left out the learned weight: "),
    "no_bias": (lambda m, x: _layer_norm(m, x, affine=lambda n: n * m.weight), "left out the learned bias"),
    "minus_bias": (lambda m, x: _layer_norm(m, x, affine=lambda n: n * m.weight - m.bias), "subtracted the bias"),
    "over_weight": (lambda m, x: _layer_norm(m, x, affine=lambda n: n / m.weight + m.bias), "divided by the weight"),
    "sum_mean": (lambda m, x: _layer_norm(m, x, mean_of=lambda t: t.sum(-1, keepdim=True)), "Your mean is a sum"),
    "sum_variance": (lambda m, x: _layer_norm(m, x, var_of=lambda t: t.sum(-1, keepdim=True)),
                     "Your variance is a sum"),
    "plus_mean": (lambda m, x: _layer_norm(m, x, centre=lambda x, mean: x + mean), "added the mean instead"),
    "no_division": (lambda m, x: _layer_norm(m, x, scale=lambda c, v: c), "did not divide by the standard deviation"),
    "times_std": (lambda m, x: _layer_norm(m, x, scale=lambda c, v: c * torch.sqrt(v + m.eps)),
                  r"multiplied by sqrt\(variance \+ eps\)"),
    "over_variance": (lambda m, x: _layer_norm(m, x, scale=lambda c, v: c / (v + m.eps)),
                      "divided by the variance, not by its square root"),
    "mean_in_front": (lambda m, x: _layer_norm(m, x, mean_of=_front),
                      r"raised RuntimeError.*On an input of shape \((\d+), \1, \1\).*whose mean has its axis of size 1 "
                      r"in front"),
    "variance_in_front": (lambda m, x: _layer_norm(m, x, var_of=_front), "whose variance has its axis of size 1"),
    "both_in_front": (lambda m, x: _layer_norm(m, x, mean_of=_front, var_of=_front),
                      "whose mean and variance have their axis of size 1"),
    "returns_bias": (lambda m, x: m.bias, r"raised TypeCheckError.*returns self\.bias itself, shape \(\d+,\)"),
    "returns_constant": (lambda m, x: m.weight + m.bias, r"returns the same tensor of shape \(\d+,\) whatever x is"),
}
# Each slip next to a similar one: the name of the one must never be given to the other.
NEIGHBOURS = [("no_weight", "no_bias"), ("minus_bias", "no_bias"), ("over_weight", "no_weight"),
              ("sum_mean", "sum_variance"), ("plus_mean", "sum_mean"), ("no_division", "over_variance"),
              ("times_std", "over_variance"), ("mean_in_front", "variance_in_front"),
              ("variance_in_front", "both_in_front"), ("returns_bias", "returns_constant")]


@pytest.mark.parametrize("slip", LAYER_NORM_SLIPS)
def test_layer_norm_values_name_each_slip(slip):
    formula, message = LAYER_NORM_SLIPS[slip]
    with pytest.raises(CheckFailure, match=message):
        check_layer_norm_values(written(formula))


@pytest.mark.parametrize(("slip", "other"), [*NEIGHBOURS, *((b, a) for a, b in NEIGHBOURS)])
def test_layer_norm_values_do_not_give_a_slip_its_neighbours_name(slip, other):
    with pytest.raises(CheckFailure) as failure:
        check_layer_norm_values(written(LAYER_NORM_SLIPS[slip][0]), seed=3, dtype=torch.float64)
    assert re.search(LAYER_NORM_SLIPS[slip][1], str(failure.value), re.S)
    assert not re.search(LAYER_NORM_SLIPS[other][1], str(failure.value), re.S)


def test_a_crash_without_a_confirmed_cause_says_only_what_was_raised():
    # A wrong shape returned that depends on x and is no parameter: nothing is added to what jaxtyping said.
    with pytest.raises(CheckFailure, match=r"raised TypeCheckError.*return value") as failure:
        check_layer_norm_values(written(lambda m, x: x.mean(-1)))
    assert "Your forward returns" not in str(failure.value)
    # An index error on every input: no cube input runs it, so no cause is added to what it raised.
    with pytest.raises(CheckFailure) as failure:
        check_layer_norm_values(written(lambda m, x: x[:, :, :, 0]))
    assert "raised IndexError" in str(failure.value) and "in front" not in str(failure.value)


def _rms(m, x, *, square_of=None, scale=None):
    mean_square = (square_of or (lambda t: t.mean(-1, keepdim=True)))(x**2)
    return (scale or (lambda x, ms: x / torch.sqrt(ms + m.eps)))(x, mean_square) * m.weight


RMS_NORM_SLIPS = {
    "sum_square": (lambda m, x: _rms(m, x, square_of=lambda t: t.sum(-1, keepdim=True)), "Your mean square is a sum"),
    "no_division": (lambda m, x: _rms(m, x, scale=lambda x, ms: x), "did not divide by the root mean square"),
    "times_rms": (lambda m, x: _rms(m, x, scale=lambda x, ms: x * torch.sqrt(ms + m.eps)),
                  r"multiplied by sqrt\(mean\(x²\) \+ eps\)"),
    "over_weight": (lambda m, x: _rms(m, x) / m.weight**2, "divided by the weight"),
    "over_mean_square": (lambda m, x: _rms(m, x, scale=lambda x, ms: x / (ms + m.eps)), "mean square, not by its"),
    "square_in_front": (lambda m, x: _rms(m, x, square_of=_front), "whose mean square has its axis of size 1 in front"),
    "returns_weight": (lambda m, x: m.weight * 1, r"returns self\.weight itself"),
}
RMS_NEIGHBOURS = [("sum_square", "over_mean_square"), ("no_division", "times_rms"), ("over_weight", "sum_square")]


@pytest.mark.parametrize("slip", RMS_NORM_SLIPS)
def test_rms_norm_values_name_each_slip(slip):
    formula, message = RMS_NORM_SLIPS[slip]
    with pytest.raises(CheckFailure, match=message):
        check_rms_norm_values(written(formula, rms=True))


@pytest.mark.parametrize(("slip", "other"), [*RMS_NEIGHBOURS, *((b, a) for a, b in RMS_NEIGHBOURS)])
def test_rms_norm_values_do_not_give_a_slip_its_neighbours_name(slip, other):
    with pytest.raises(CheckFailure) as failure:
        check_rms_norm_values(written(RMS_NORM_SLIPS[slip][0], rms=True), seed=404, dtype=torch.float64)
    assert re.search(RMS_NORM_SLIPS[slip][1], str(failure.value), re.S)
    assert not re.search(RMS_NORM_SLIPS[other][1], str(failure.value), re.S)


class ResidualWritten(nn.Module):
    def __init__(self, d_model, sublayer, norm_first=False, dropout=0.0):
        super().__init__()
        self.sublayer, self.norm, self.norm_first = sublayer, Norm(d_model), norm_first
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.formula(x)


def residual_written(pre, post):
    return type("ResidualWritten", (ResidualWritten,),
                {"formula": lambda self, x: pre(self, x) if self.norm_first else post(self, x)})


@pytest.mark.parametrize(("norm_first", "mistake", "message", "not_said"), [
    (True, residual_written(lambda m, x: x, None), "Your pre-norm output is x itself", "left out the residual"),
    (True, residual(skip=False), "left out the residual", "is x itself"),
    (False, residual_written(None, lambda m, x: m.norm(x)), r"Your post-norm output is norm\(x\)",
     "left out the residual"),
    (False, residual(skip=False), "left out the residual", r"output is norm\(x\)"),
    (True, residual_written(lambda m, x: x - m.sublayer(m.norm(x)), None), "subtracted the sublayer's output",
     "left out"),
    (False, residual_written(None, lambda m, x: m.norm(x - m.sublayer(x))), "subtracted the sublayer's output",
     "left out"),
    (False, residual(swap=True), "You computed pre-norm", "subtracted"),
])
def test_residual_names_the_missing_or_subtracted_branch(norm_first, mistake, message, not_said):
    with pytest.raises(CheckFailure, match=message) as failure:
        check_residual(mistake, norm_first=norm_first)
    assert not re.search(not_said, str(failure.value))


def sliced_norms(blocks, x, upstream, *, first=0, step=1, lo=lambda s, n: s, hi=lambda s, n: s + n,
                 keep=lambda g: g is not None, power=2, mean_each=False, mean_blocks=False):
    """The solution's slicing of the flat gradient list, with each of its parts replaceable by a slip."""
    out = x
    for block in blocks:
        out = block(out)
    params = [list(block.parameters()) for block in blocks]
    grads = torch.autograd.grad(out, [p for ps in params for p in ps], upstream)
    norms, start = [], first
    for ps in params:
        squares = [(g**power).mean() if mean_each else (g**power).sum()
                   for g in grads[lo(start, len(ps)):hi(start, len(ps))] if keep(g)]
        total = torch.stack(squares).mean() if mean_blocks else torch.stack(squares).sum() if squares else None
        norms.append(total.sqrt() if total is not None else x.new_zeros(()))
        start += step * len(ps)
    return torch.stack(norms).detach()


GRADIENT_SLIPS = {
    "starts_at_one": ({"first": 1}, "shifted by one parameter"),
    "skips_first": ({"lo": lambda s, n: s + 1}, "leaves out its first parameter"),
    "skips_last": ({"hi": lambda s, n: s + n - 1}, "leaves out its last parameter"),
    "one_too_many": ({"hi": lambda s, n: s + n + 1}, "one parameter of the next block too"),
    "ends_at_length": ({"hi": lambda s, n: n}, r"ends at len\(ps\) instead"),
    "ends_before_start": ({"hi": lambda s, n: s - n}, r"ends at start - len\(ps\)"),
    "start_goes_down": ({"step": -1}, "running start index goes down"),
    "mean_per_parameter": ({"mean_each": True}, "the mean of each parameter's squared gradients"),
    "mean_over_parameters": ({"mean_blocks": True}, "the mean of the block's per-parameter sums"),
    "keeps_none": ({"keep": lambda g: g is None}, "Every norm is 0"),
    "cubes": ({"power": 3}, "Some norms are NaN"),
}


@pytest.mark.parametrize("slip", GRADIENT_SLIPS)
def test_measurement_names_each_slicing_slip(slip):
    switches, message = GRADIENT_SLIPS[slip]
    with pytest.raises(CheckFailure, match=message) as failure:
        check_gradient_measurement(lambda *args: sliced_norms(*args, **switches))
    # One name at most: no other slip's words in the message.
    others = [m for s, (_, m) in GRADIENT_SLIPS.items() if s != slip and re.search(m, str(failure.value))]
    assert not others


def test_measurement_says_only_what_it_saw_when_all_norms_are_zero():
    # Empty slices, a filter that keeps nothing, an inverted test on the list: all give zeros, and none is named.
    for switches in ({"hi": lambda s, n: s}, {"keep": lambda g: g is None}):
        with pytest.raises(CheckFailure, match="Every norm is 0") as failure:
            check_gradient_measurement(lambda *args, k=switches: sliced_norms(*args, **k))
        assert "You " not in str(failure.value).split("Every norm is 0")[1]


def test_an_eps_slip_is_named_only_where_inputs_of_tiny_variance_confirm_it():
    # A subtracted eps is within rounding of "no eps" on random inputs, not on inputs of tiny variance (NaN there).
    minus = written(lambda m, x: _layer_norm(m, x, scale=lambda c, v: c / torch.sqrt(v - m.eps)))
    with pytest.raises(CheckFailure, match=r"eps is left out or misplaced, but on inputs of tiny variance .* it is "
                                           r"not: look at how eps enters") as failure:
        check_layer_norm_values(minus)
    assert "You left out epsilon" not in str(failure.value)
    # A left-out eps is confirmed there: named, wherever it shows first.
    for seed in (0, 1, 2, 3):
        with pytest.raises(CheckFailure, match="You left out epsilon"):
            check_layer_norm_values(layer_norm(eps=0.0), seed=seed)


def _cubed(m, x):
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt((centred**3).mean(-1, keepdim=True) + m.eps) * m.weight + m.bias


def test_cubed_deviations_are_named_by_where_they_give_nan():
    with pytest.raises(CheckFailure, match="Your variance is the mean of the cubed deviations"):
        check_layer_norm_values(written(_cubed))
    with pytest.raises(CheckFailure, match="Your mean square is the mean of x cubed"):
        check_rms_norm_values(written(lambda m, x: x / torch.sqrt((x**3).mean(-1, keepdim=True) + m.eps) * m.weight,
                                      rms=True))
    # A NaN everywhere (a square root of minus the variance) is no cube's pattern: the check names no cube.
    with pytest.raises(CheckFailure, match="contains NaN or inf") as failure:
        check_layer_norm_values(written(lambda m, x: _layer_norm(m, x, scale=lambda c, v: c / torch.sqrt(-v))))
    assert "cubed" not in str(failure.value)
