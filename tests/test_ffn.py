"""stepformer.ffn against torch.nn.TransformerEncoderLayer and independent formulas; its checks catch mistakes."""

import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from torch import nn

import stepformer.ffn
from stepformer.checks._core import CheckFailure
from stepformer.checks.ffn import (
    _sizes,
    check_feedforward_dropout,
    check_feedforward_structure,
    check_feedforward_values,
    check_matching_swiglu_hidden,
    check_swiglu_structure,
    check_swiglu_values,
)
from stepformer.ffn import FeedForward, SwiGLU, matching_swiglu_hidden
from tests.fixtures.student import student_copy

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-6}
# PyTorch's own function for each activation FeedForward takes; nn.TransformerEncoderLayer takes any of them.
TORCH_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh")}

shapes = st.fixed_dictionaries({
    "batch": st.integers(1, 3),
    "seq": st.integers(1, 7),
    "d_model": st.integers(1, 12),
    "d_ff": st.integers(1, 24),
    "seed": st.integers(0, 2**31 - 1),
    "dtype": st.sampled_from([torch.float32, torch.float64]),
})


def _x(s, scale=3.0):
    g = torch.Generator().manual_seed(s["seed"])
    return scale * torch.randn(s["batch"], s["seq"], s["d_model"], generator=g, dtype=s["dtype"])


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


# -- the library against its oracles -------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from(list(TORCH_ACTIVATIONS)))
def test_feedforward_matches_transformer_encoder_layer(s, activation):
    torch.manual_seed(s["seed"])
    layer = nn.TransformerEncoderLayer(s["d_model"], 1, s["d_ff"], dropout=0.0,
                                       activation=TORCH_ACTIVATIONS[activation], batch_first=True,
                                       dtype=s["dtype"]).eval()
    ffn = FeedForward(s["d_model"], s["d_ff"], activation=activation).to(s["dtype"]).eval()
    ffn.load_state_dict({k: v for k, v in layer.state_dict().items() if k.startswith("linear")})
    x = _x(s)
    with torch.no_grad():
        _assert_close(ffn(x), layer.linear2(layer.activation(layer.linear1(x))), s["dtype"])


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_swiglu_matches_the_float64_formula(s):
    torch.manual_seed(s["seed"])
    module = SwiGLU(s["d_model"], s["d_ff"]).to(s["dtype"])
    x = _x(s)
    wg, wu, wd = (m.weight.detach().double() for m in (module.w_gate, module.w_up, module.w_down))
    a, b = x.double() @ wg.T, x.double() @ wu.T
    expected = (a * torch.sigmoid(a) * b) @ wd.T
    with torch.no_grad():
        _assert_close(module(x), expected.to(s["dtype"]), s["dtype"])
        _assert_close(F.silu(a), a * torch.sigmoid(a), torch.float64)


def test_float64_agrees_to_1e6_on_seeded_shapes():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        batch, seq, d_model, d_ff = torch.randint(1, 12, (4,), generator=g).tolist()
        x = torch.randn(batch, seq, d_model, generator=g, dtype=torch.float64) * 3
        for activation, oracle in TORCH_ACTIVATIONS.items():
            torch.manual_seed(seed)
            ffn = FeedForward(d_model, d_ff, activation).double()
            w1, b1, w2, b2 = (t.detach() for t in (ffn.linear1.weight, ffn.linear1.bias,
                                                   ffn.linear2.weight, ffn.linear2.bias))
            expected = oracle(x @ w1.T + b1) @ w2.T + b2
            assert (ffn(x) - expected).abs().max() <= 1e-6


def test_gelu_is_the_exact_erf_form():
    ffn = FeedForward(4, 6, "gelu")
    z = torch.linspace(-4, 4, 101, dtype=torch.float64)
    torch.testing.assert_close(ffn.activation(z), 0.5 * z * (1 + torch.erf(z / 2**0.5)))
    assert (ffn.activation(z) - F.gelu(z, approximate="tanh")).abs().max() > 1e-4


def test_gelu_tanh_is_gpt2s_approximation_set_at_construction():
    ffn = FeedForward(4, 6, "gelu_tanh")
    assert isinstance(ffn.activation, nn.GELU) and ffn.activation.approximate == "tanh"
    z = torch.linspace(-6, 6, 12001, dtype=torch.float64)
    gelu_new = 0.5 * z * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (z + 0.044715 * z**3)))  # GPT-2's, written out
    torch.testing.assert_close(ffn.activation(z), gelu_new)
    # "Differs from the exact GELU by up to about 5e-4", as the docstring says.
    assert 4e-4 < (ffn.activation(z) - F.gelu(z)).abs().max() < 5e-4
    # Same parameters under the same names as the other two activations: weights copy across.
    assert {k: v.shape for k, v in ffn.state_dict().items()} == {
        k: v.shape for k, v in FeedForward(4, 6, "gelu").state_dict().items()}


def test_feedforward_is_position_wise():
    torch.manual_seed(0)
    ffn, glu = FeedForward(6, 10, "gelu").double(), SwiGLU(6, 10).double()
    x = torch.randn(3, 9, 6, dtype=torch.float64)
    perm = torch.randperm(9)
    for module in (ffn, glu):
        torch.testing.assert_close(module(x[:, perm]), module(x)[:, perm])
        # One position alone gives the same output as inside the sequence.
        torch.testing.assert_close(module(x[:, 4:5]), module(x)[:, 4:5])


def test_feedforward_equals_a_1x1_convolution():
    torch.manual_seed(1)
    ffn = FeedForward(5, 12, "relu").double()
    conv1 = nn.Conv1d(5, 12, kernel_size=1).double()
    conv2 = nn.Conv1d(12, 5, kernel_size=1).double()
    with torch.no_grad():
        for conv, linear in ((conv1, ffn.linear1), (conv2, ffn.linear2)):
            conv.weight.copy_(linear.weight.unsqueeze(-1))
            conv.bias.copy_(linear.bias)
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    by_conv = conv2(F.relu(conv1(x.transpose(1, 2)))).transpose(1, 2)
    torch.testing.assert_close(ffn(x), by_conv)


def test_dropout_is_on_hidden_units_in_training_only():
    torch.manual_seed(2)
    ffn = FeedForward(4, 64, "relu", dropout=0.5).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    ffn.eval()
    reference = ffn(x)
    torch.testing.assert_close(ffn(x), reference)
    ffn.train()
    seen = {}
    ffn.linear2.register_forward_hook(lambda module, inputs, output: seen.update(hidden=inputs[0], out=output))
    y = ffn(x)
    assert not torch.allclose(y, reference)
    hidden = F.relu(ffn.linear1(x))
    # What reaches linear2 is the hidden layer with each unit either dropped or scaled by 1/(1-p)...
    assert torch.all((seen["hidden"] == 0) | torch.isclose(seen["hidden"], hidden / 0.5))
    assert ((seen["hidden"] == 0) & (hidden > 0)).any(), "no live hidden unit was dropped"
    # ... and nothing acts after linear2 (dropout there would zero whole outputs).
    torch.testing.assert_close(y, seen["out"], rtol=0, atol=0)


def test_checks_leave_the_global_rng_alone():
    draws = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        check_feedforward_values(student.FeedForward)
        check_feedforward_dropout(student.FeedForward)
        draws.append(torch.rand(4))
    assert not torch.equal(*draws), "a check reset the global RNG to a fixed state"


def test_parameter_counts():
    for d_model, d_ff in ((512, 2048), (6, 10), (64, 100)):
        assert sum(p.numel() for p in FeedForward(d_model, d_ff).parameters()) == 2 * d_model * d_ff + d_ff + d_model
        assert sum(p.numel() for p in SwiGLU(d_model, d_ff).parameters()) == 3 * d_model * d_ff
    assert matching_swiglu_hidden(512, 2048) == 1367
    for d_model, d_ff in ((512, 2048), (6, 10), (64, 100), (1, 1)):
        target = 2 * d_model * d_ff + d_ff + d_model
        h = matching_swiglu_hidden(d_model, d_ff)
        assert abs(3 * d_model * h - target) <= min(abs(3 * d_model * k - target) for k in range(1, 4 * d_ff))


def test_unknown_activation_is_refused():
    for name in ("swish", "GELU", "gelu_new", "tanh"):
        with pytest.raises(ValueError, match="'relu', 'gelu' or 'gelu_tanh'"):
            FeedForward(4, 8, activation=name)


@pytest.mark.parametrize("module", [FeedForward(4, 8), SwiGLU(4, 8)], ids=["FeedForward", "SwiGLU"])
def test_wrong_shapes_fail_naming_the_axes(module):
    with pytest.raises(TypeCheckError, match="batch seq d_model"):
        module(torch.randn(5, 4))
    with pytest.raises(TypeCheckError, match="Float"):
        module(torch.ones(2, 5, 4, dtype=torch.int64))


# -- the checks: pass on the solution, fail on the stub, name the mistakes -----------------------

student = student_copy(stepformer.ffn)
FFN_CHECKS = [check_feedforward_structure, check_feedforward_values, check_feedforward_dropout]
SWIGLU_CHECKS = [check_swiglu_structure, check_swiglu_values]


class Stub(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError()


def stub(*args, **kwargs):
    raise NotImplementedError()


class Feed(nn.Module):
    """A standalone FFN with switches for the usual mistakes (not the library's code)."""

    mistake = None

    def __init__(self, d_model, d_ff, activation="relu", dropout=0.0):
        super().__init__()
        if activation not in ("relu", "gelu") + (() if self.mistake == "gelu_tanh_refused" else ("gelu_tanh",)):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        self.name = activation
        bias = self.mistake != "no_bias"
        shape = (d_model, d_ff) if self.mistake != "transposed" else (d_ff, d_model)
        self.linear1 = nn.Linear(shape[0], shape[1], bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.p = dropout

    def act(self, z):
        if self.name == "gelu":
            return F.gelu(z, approximate="tanh" if self.mistake == "gelu_tanh" else "none")
        if self.name == "gelu_tanh" and self.mistake != "gelu_tanh_is_relu":
            return F.gelu(z, approximate="none" if self.mistake == "exact_for_gelu_tanh" else "tanh")
        return F.relu(z)

    def forward(self, x):
        if self.mistake == "act_after_linear2":
            return self.act(self.linear2(F.dropout(self.linear1(x), self.p, self.training)))
        if self.mistake == "no_activation":
            return self.linear2(self.linear1(x))
        if self.mistake == "mixes_positions":
            x = x + x.mean(dim=1, keepdim=True)
        hidden = self.act(self.linear1(x))
        if self.mistake == "dropout_always":
            return self.linear2(F.dropout(hidden, self.p))
        if self.mistake == "dropout_on_output":
            return F.dropout(self.linear2(hidden), self.p, self.training)
        if self.mistake == "no_dropout":
            return self.linear2(hidden)
        if self.mistake == "dropout_on_input":
            return self.linear2(self.act(self.linear1(F.dropout(x, self.p, self.training))))
        if self.mistake == "dropout_before_activation":
            return self.linear2(self.act(F.dropout(self.linear1(x), self.p, self.training)))
        if self.mistake == "dropout_unscaled" and self.training:
            return self.linear2(hidden * (torch.rand_like(hidden) >= self.p))  # a hand-made mask, not rescaled
        if self.mistake == "dropout_keep_probability":
            return self.linear2(F.dropout(hidden, 1 - self.p, self.training))
        if self.mistake == "squeeze":
            return self.linear2(F.dropout(hidden, self.p, self.training)).squeeze()
        return self.linear2(F.dropout(hidden, self.p, self.training))


def feed(mistake):
    return type(f"Feed_{mistake}", (Feed,), {"mistake": mistake})


class Glu(nn.Module):
    mistake = None

    def __init__(self, d_model, d_ff):
        super().__init__()
        bias = self.mistake == "bias"
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.w_up = nn.Linear(d_model, d_ff, bias=bias)
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x):
        gate, up = self.w_gate(x), self.w_up(x)
        if self.mistake in ("swapped", "swapped_sigmoid"):
            gate, up = up, gate
        fn = torch.sigmoid if self.mistake in ("sigmoid", "swapped_sigmoid") else F.silu
        combine = {"no_gate": lambda g, u: u, "no_up": lambda g, u: g, "divided": torch.div, "added": torch.add}
        return self.w_down(combine.get(self.mistake, torch.mul)(fn(gate), up))


def glu(mistake):
    return type(f"Glu_{mistake}", (Glu,), {"mistake": mistake})


@pytest.mark.parametrize("check", FFN_CHECKS)
def test_feedforward_checks_pass_on_the_solution(check, capsys):
    check(student.FeedForward)
    check(student.FeedForward, seed=17)
    check(feed(None), seed=5)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("check", SWIGLU_CHECKS)
def test_swiglu_checks_pass_on_the_solution(check, capsys):
    check(student.SwiGLU)
    check(student.SwiGLU, seed=17)
    check(glu(None), seed=5)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("check", [*FFN_CHECKS, *SWIGLU_CHECKS, check_matching_swiglu_hidden])
def test_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(Stub if check is not check_matching_swiglu_hidden else stub)


@pytest.mark.parametrize(
    ("check", "mistake", "message"),
    [
        (check_feedforward_values, feed("act_after_linear2"), "activation after linear2"),
        (check_feedforward_values, feed("gelu_tanh"), "activation='gelu', .*you used GELU's tanh approximation"),
        # The third activation: the exact GELU given for it, ReLU given for it (a fall-through), refused.
        (check_feedforward_values, feed("exact_for_gelu_tanh"),
         r"With activation='gelu_tanh', .* \(same weights; largest difference .*\): activation='gelu_tanh' gave the "
         r"exact GELU .*nn\.GELU\(approximate='tanh'\)"),
        (check_feedforward_values, feed("gelu_tanh_is_relu"),
         r"With activation='gelu_tanh', .*: activation='gelu_tanh' gave ReLU: each of 'relu', 'gelu' and 'gelu_tanh' "
         "needs its own activation"),
        (check_feedforward_structure, feed("gelu_tanh_refused"),
         r"Feed_gelu_tanh_refused\(.*activation='gelu_tanh'\) raised ValueError: activation must be 'relu' or 'gelu', "
         r"got 'gelu_tanh'\. FeedForward takes three activations, .* and refused 'gelu_tanh': 'gelu_tanh' is GELU's "
         r"tanh approximation"),
        (check_feedforward_values, feed("gelu_tanh_refused"), "refused 'gelu_tanh'"),
        (check_feedforward_values, feed("no_activation"), "there is no activation"),
        (check_feedforward_values, feed("mixes_positions"), "depends on the other positions"),
        (check_feedforward_structure, feed("no_bias"), "linear1.bias"),
        (check_feedforward_values, feed("no_bias"), "bias by default"),
        (check_feedforward_structure, feed("transposed"), "linear1.weight should have shape"),
        (check_feedforward_dropout, feed("dropout_always"), "eval mode the output changed"),
        (check_feedforward_dropout, feed("dropout_on_output"), "after linear2"),
        (check_feedforward_dropout, feed("no_dropout"), "nothing was dropped"),
        # Gap 10: only "something changed, and not whole outputs" was checked, with ReLU only.
        (check_feedforward_dropout, feed("dropout_on_input"),
         r"\(largest difference .* on sizes batch=12, seq=10, d_model=7, d_ff=5\): what reaches linear2 is not the "
         r"hidden activations.*not to x"),
        (check_feedforward_dropout, feed("dropout_unscaled"), "the kept hidden activations are not scaled"),
        (check_feedforward_dropout, feed("dropout_keep_probability"),
         r"scaled by 1/0\.25 and \d+ of \d+ \(\d+%\) were dropped: you dropped with probability"),
        (check_feedforward_dropout, feed("dropout_before_activation"),
         r"activation='gelu' in training mode .* you applied dropout before the activation"),
        # Gap 19: batch=1.
        (check_feedforward_values, feed("squeeze"),
         r"should have shape \(batch=1, seq=3, d_model=5\), got \(3, 5\): the axes of size 1 are gone"),
        # Section 3: the sizes and the largest difference, a named mistake included.
        (check_feedforward_values, feed("act_after_linear2"),
         r"\(same weights; largest difference .* on sizes batch=2, seq=3, d_model=5, d_ff=7\): you applied the "
         r"activation after linear2"),
        (check_feedforward_dropout, feed("dropout_always"), r"eval mode the output changed \(largest difference"),
        (check_swiglu_values, glu("sigmoid"), r"\(largest difference .* on sizes batch=2, seq=3, d_model=5, d_ff=7\); "
                                              "you used sigmoid"),
        (check_swiglu_values, glu("swapped"), "w_gate and w_up are swapped"),
        (check_swiglu_values, glu("sigmoid"), "sigmoid as the gate"),
        (check_swiglu_values, glu("swapped_sigmoid"), "sigmoid instead of silu, and on w_up"),
        (check_swiglu_structure, glu("bias"), "should not have"),
    ],
)
def test_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake)


def test_dropout_check_does_not_charge_a_wrong_forward(capsys):
    # A wrong activation costs the values check only: dropout is compared with the student's own eval output.
    for slip in ("gelu_tanh", "exact_for_gelu_tanh", "gelu_tanh_is_relu"):
        check_feedforward_dropout(feed(slip))
        out = capsys.readouterr().out
        assert "scales them by 1/(1-p)" in out and "with relu, " in out and "with gelu_tanh, " in out
    # A refused activation costs the structure and values checks; dropout is checked with the other two, and says so.
    check_feedforward_dropout(feed("gelu_tanh_refused"))
    out = capsys.readouterr().out
    assert "with gelu, " in out and "with gelu_tanh" not in out
    assert "not with 'gelu_tanh', which your FeedForward refused" in out
    # A forward that does not end in linear2 leaves nothing to solve for: the check says what it did not verify.
    check_feedforward_dropout(feed("act_after_linear2"))
    assert "where it acts is checked once your forward ends in linear2" in capsys.readouterr().out


def test_feedforward_structure_wants_a_value_error():
    class Lenient(Feed):
        def __init__(self, d_model, d_ff, activation="relu", dropout=0.0):
            known = activation in ("relu", "gelu", "gelu_tanh")
            super().__init__(d_model, d_ff, activation if known else "relu", dropout)

    with pytest.raises(CheckFailure, match="should raise a ValueError .*'relu', 'gelu' and 'gelu_tanh'"):
        check_feedforward_structure(Lenient)


def test_dropout_check_needs_one_activation_it_can_build():
    class Refuses(Feed):
        def __init__(self, d_model, d_ff, activation="relu", dropout=0.0):
            raise ValueError("no activation")

    with pytest.raises(CheckFailure, match=r"raised ValueError: no activation\. .*refused 'relu'"):
        check_feedforward_dropout(Refuses)


@pytest.mark.parametrize("name", list(TORCH_ACTIVATIONS))
def test_each_activation_is_compared_with_its_own_oracle(name):
    """tanh in place of one of the three fails for that name, and the message names no mistake it did not see."""
    class Swapped(Feed):
        def act(self, z):
            return torch.tanh(z) if self.name == name else super().act(z)

    with pytest.raises(CheckFailure, match=f"With activation='{name}', your output differs .*step by step"):
        check_feedforward_values(Swapped)


def test_matching_check_names_the_mistake():
    check_matching_swiglu_hidden(student.matching_swiglu_hidden)
    cases = {
        lambda d_model, d_ff: round(2 * d_ff / 3): "biases",
        lambda d_model, d_ff: d_ff: "1.5 times",
        lambda d_model, d_ff: round((2 * d_model * d_ff + d_ff + d_model) / (2 * d_model)): "three weight matrices",
        lambda d_model, d_ff: (2 * d_model * d_ff + d_ff + d_model) / (3 * d_model): "Python int",
    }
    for wrong, message in cases.items():
        with pytest.raises(CheckFailure, match=message):
            check_matching_swiglu_hidden(wrong)


def test_using_pytorch_layers_is_not_own_work():
    class Borrowed(nn.Module):
        def __init__(self, d_model, d_ff, activation="relu", dropout=0.0):
            super().__init__()
            layer = nn.TransformerEncoderLayer(d_model, 1, d_ff, dropout, activation=activation, batch_first=True)
            self.linear1, self.linear2, self.act = layer.linear1, layer.linear2, layer.activation

        def forward(self, x):
            return self.linear2(self.act(self.linear1(x)))

    with pytest.raises(CheckFailure, match="Not your own work"):
        check_feedforward_values(Borrowed)
    with pytest.raises(CheckFailure, match="reference library"):
        check_feedforward_values(stepformer.ffn.FeedForward)


def test_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(50):
        sizes = _sizes(seed)
        assert len(set(sizes.values())) == len(sizes) and sizes["d_ff"] > sizes["d_model"]


# -- issue 27: verified diagnoses ------------------------------------------------------------------

SWIGLU_SLIPS = {"no_gate": "the gate is missing", "no_up": r"w_up\(x\) is missing", "divided": "you divided the gate",
                "added": "you added w_up"}


@pytest.mark.parametrize("slip", SWIGLU_SLIPS)
def test_swiglu_values_name_each_combination_slip_and_no_other(slip):
    for seed, dtype in ((0, torch.float32), (505, torch.float64)):
        with pytest.raises(CheckFailure, match=SWIGLU_SLIPS[slip]) as failure:
            check_swiglu_values(glu(slip), seed=seed, dtype=dtype)
        # The neighbouring slips' names are not given to this one.
        assert not [m for other, m in SWIGLU_SLIPS.items() if other != slip and re.search(m, str(failure.value))]


def test_swiglu_values_name_nothing_they_did_not_confirm():
    class Shifted(Glu):
        def forward(self, x):
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x) + 1)

    with pytest.raises(CheckFailure, match="matches none of the common mistakes") as failure:
        check_swiglu_values(Shifted)
    assert not [m for m in SWIGLU_SLIPS.values() if re.search(m, str(failure.value))]


def _count(d_model, d_ff):
    return 2 * d_model * d_ff + d_ff + d_model


def test_matching_check_names_the_missing_or_wrong_division():
    named = {
        lambda d_model, d_ff: _count(d_model, d_ff): "FeedForward's parameter count itself .*, without the division",
        lambda d_model, d_ff: _count(d_model, d_ff) * 3 * d_model: r"multiplied by what one SwiGLU hidden unit costs",
        lambda d_model, d_ff: _count(d_model, d_ff) / (3 * d_model * 0): r"raised ZeroDivisionError: division by "
                                                                          r"zero\. What your function divides by is 0",
    }
    for wrong, message in named.items():
        with pytest.raises(CheckFailure, match=message):
            check_matching_swiglu_hidden(wrong)
    # Near misses of those: one parameter more, a division by what one FeedForward unit costs, another exception.
    unnamed = [lambda d_model, d_ff: _count(d_model, d_ff) + 1,
               lambda d_model, d_ff: round(_count(d_model, d_ff) / (2 * d_model + 1)),
               lambda d_model, d_ff: [][0]]
    for wrong in unnamed:
        with pytest.raises(CheckFailure) as failure:
            check_matching_swiglu_hidden(wrong)
        assert not re.search("without the division|multiplied by|divides by is 0", str(failure.value))
