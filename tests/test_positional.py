"""stepformer.positional against independent formulas, its defining properties, and the chapter's checks."""

import math

import einops
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

import stepformer.positional
from stepformer.checks._core import CheckFailure
from stepformer.checks.positional import (
    _sizes,
    check_offset_measurement,
    check_rope_properties,
    check_rope_values,
    check_sinusoidal_errors,
    check_sinusoidal_values,
)
from stepformer.positional import LearnedPositionalEmbedding, RotaryEmbedding, scores_by_offset, sinusoidal_encoding
from tests.fixtures.student import student_copy

student = student_copy(stepformer.positional)


# -- independent oracles (no code shared with the library) ---------------------------------

def paper_encoding(seq_len, d_model):
    """Vaswani et al. 2017 §3.5, a NumPy double loop in float64."""
    pe = np.zeros((seq_len, d_model))
    for pos in range(seq_len):
        for i in range(d_model // 2):
            pe[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d_model))
            pe[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d_model))
    return torch.from_numpy(pe)


def rope_complex(x, positions, base=10000.0):
    """RoPE as complex multiplication: (x_2i + i x_2i+1) · e^{i pos θ_i}, in float64."""
    d = x.shape[-1]
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turned = z * torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64),
                             positions.double()[:, None] * theta)
    return torch.view_as_real(turned).reshape(x.shape)


# -- sinusoidal ----------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 40))
def test_sinusoidal_matches_the_paper(seq_len, half):
    pe = sinusoidal_encoding(seq_len, 2 * half)
    assert pe.dtype == torch.float32 and pe.shape == (seq_len, 2 * half)
    assert (pe.double() - paper_encoding(seq_len, 2 * half)).abs().max() <= 1e-6


def test_sinusoidal_shift_is_a_fixed_rotation():
    d_model, k = 16, 3
    pe = sinusoidal_encoding(50, d_model).double()
    rotation = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        w = k / 10000 ** (2 * i / d_model)
        rotation[2 * i: 2 * i + 2, 2 * i: 2 * i + 2] = torch.tensor([[math.cos(w), math.sin(w)],
                                                                      [-math.sin(w), math.cos(w)]])
    torch.testing.assert_close(pe[k:], pe[:-k] @ rotation.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("seq_len", "d_model"), [(4, 7), (0, 4), (4, 0), (-1, 2)])
def test_sinusoidal_refuses_bad_sizes(seq_len, d_model):
    with pytest.raises(ValueError, match="d_model|seq_len"):
        sinusoidal_encoding(seq_len, d_model)


# -- learned -------------------------------------------------------------------------------

def test_learned_embedding_rows_and_limits():
    torch.manual_seed(0)
    table = LearnedPositionalEmbedding(10, 6)
    torch.testing.assert_close(table(4), table.embedding.weight[:4])
    positions = torch.tensor([[0, 9, 3], [2, 2, 1]])
    assert table(positions).shape == (2, 3, 6)
    torch.testing.assert_close(table(positions)[0, 1], table.embedding.weight[9])
    with pytest.raises(ValueError, match="max_len"):
        table(11)
    with pytest.raises(ValueError, match="max_len"):
        table(torch.tensor([3, 10]))
    with pytest.raises(TypeCheckError):
        table(torch.tensor([1.0, 2.0]))


# -- rotary --------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3), max_size=2), st.integers(1, 9), st.integers(1, 8),
       st.sampled_from([10000.0, 500.0]), st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31 - 1))
def test_rope_matches_complex_multiplication(batch, seq, half, base, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, seq, 2 * half, generator=g, dtype=dtype)
    positions = torch.randint(0, 200, (seq,), generator=g)
    got = RotaryEmbedding(2 * half, base=base)(x, positions)
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = 1e-6 if dtype == torch.float64 else 1e-4
    assert (got.double() - rope_complex(x, positions, base)).abs().max() <= tolerance


def test_rope_properties_in_float64():
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(12)
    q, k = torch.randn(3, 7, 12, generator=g, dtype=torch.float64), torch.randn(3, 7, 12, generator=g,
                                                                                 dtype=torch.float64)
    m, n = torch.randint(0, 100, (7,), generator=g), torch.randint(0, 100, (7,), generator=g)
    scores = torch.einsum("bqd,bkd->bqk", rope(q, m), rope(k, n))
    for t in (1, 13, 250):
        shifted = torch.einsum("bqd,bkd->bqk", rope(q, m + t), rope(k, n + t))
        assert (shifted - scores).abs().max() <= 1e-6
    torch.testing.assert_close(rope(q, m).norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=1e-12)
    assert torch.equal(rope(q, torch.zeros(7, dtype=torch.long)), q)
    assert list(rope.parameters()) == []


def test_half_split_is_a_permutation_of_interleaved():
    d = 10
    x = torch.randn(4, d, dtype=torch.float64)
    positions = torch.arange(3, 7)
    perm = torch.tensor([j for i in range(d // 2) for j in (i, i + d // 2)])  # half-split -> interleaved order
    z = torch.complex(x[:, : d // 2], x[:, d // 2:])
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turned = z * torch.polar(torch.ones(4, d // 2, dtype=torch.float64), positions.double()[:, None] * theta)
    half_split = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(RotaryEmbedding(d)(x[:, perm], positions), half_split[:, perm])


def test_scores_by_offset_depend_only_on_the_offset():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    mean, spread = scores_by_offset(q, k, 9)
    assert mean.shape == spread.shape == (17,)
    assert spread.abs().max() <= 1e-9
    assert abs(mean[8].item() - (q @ k).item()) <= 1e-9
    rope = rope_complex(torch.stack([q, k]), torch.tensor([0, 3]))
    assert abs(mean[8 - 3].item() - (rope[0] @ rope[1]).item()) <= 1e-9  # m - n = 0 - 3


@pytest.mark.parametrize(
    ("call", "axis"),
    [
        (lambda: RotaryEmbedding(6)(torch.randn(2, 5, 6), torch.arange(4)), "seq"),
        (lambda: scores_by_offset(torch.randn(6), torch.randn(8), 4), "d_head"),
    ],
)
def test_shape_errors_name_the_axis(call, axis):
    with pytest.raises(TypeCheckError, match=rf"{axis}="):
        call()


def test_rope_refuses_odd_width_and_the_wrong_width():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="d_head"):
        RotaryEmbedding(6)(torch.randn(3, 8), torch.arange(3))


# -- checks: pass on the solution, fail on the stub, name the mistake ----------------------

def stub(*args, **kwargs):
    raise NotImplementedError()


class StubRotary(torch.nn.Module):
    def __init__(self, d_head, base=10000.0):
        raise NotImplementedError()


def encoding(seq_len, d_model, *, swap=False, numerator=lambda i: 2 * i, halves=False, dtype=torch.float32):
    """A standalone sinusoidal encoding with switches for the usual mistakes."""
    if seq_len < 1 or d_model < 1 or d_model % 2:
        raise ValueError("bad sizes")
    pos = torch.arange(seq_len, dtype=torch.float64)[:, None]
    i = torch.arange(d_model // 2, dtype=torch.float64)
    angle = pos / 10000 ** (numerator(i) / d_model)
    first, second = (angle.cos(), angle.sin()) if swap else (angle.sin(), angle.cos())
    if halves:
        return torch.cat([first, second], dim=-1).to(dtype)
    return torch.stack([first, second], dim=-1).flatten(-2).to(dtype)


class Rotary(torch.nn.Module):
    """A standalone RoPE with switches for the usual mistakes."""

    mistake = None

    def __init__(self, d_head, base=10000.0):
        super().__init__()
        self.d_head, self.base = d_head, base

    def forward(self, x, positions):
        d = self.d_head
        exponent = 1 if self.mistake == "i_not_2i" else 2
        # The common ``torch.arange(0, d, 2).float()``: float32 angles, whatever the input's dtype.
        dtype = torch.float32 if self.mistake == "float32_angles" else torch.float64
        theta = self.base ** (-exponent * torch.arange(d // 2, dtype=dtype) / d)
        if self.mistake == "ignores_positions":
            positions = torch.arange(x.shape[-2])
        angle = positions.to(dtype)[:, None] * theta
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        if self.mistake == "half_split":
            a, b = x[..., : d // 2], x[..., d // 2:]
        else:
            a, b = x[..., 0::2], x[..., 1::2]
        if self.mistake == "minus_theta":
            sin = -sin
        first, second = a * cos - b * sin, a * sin + b * cos
        if self.mistake == "one_sided_sign":
            second = -a * sin + b * cos
        if self.mistake == "half_split":
            return torch.cat([first, second], dim=-1)
        return torch.stack([first, second], dim=-1).flatten(-2)


class CheckedRotary(Rotary):
    """Rotary with the argument checks that the exercise asks for; ``skip`` leaves one out."""

    skip = None

    def __init__(self, d_head, base=10000.0):
        if d_head % 2 and self.skip != "odd":
            raise ValueError(f"d_head must be even, got {d_head}")
        super().__init__(d_head, base)
        if self.skip == "store":
            del self.d_head
            self.size = d_head

    def forward(self, x, positions):
        width = self.size if self.skip == "store" else self.d_head
        if x.shape[-1] != width and self.skip != "width":
            raise ValueError(f"x has width {x.shape[-1]}, expected d_head={width}")
        if self.skip != "store":
            return super().forward(x, positions)
        self.d_head = width  # Rotary.forward reads it; gone again afterwards
        try:
            return super().forward(x, positions)
        finally:
            del self.d_head


def checked_without(check):
    return type(f"CheckedRotary_no_{check}", (CheckedRotary,), {"skip": check})


def rotary_with(mistake):
    return type(f"Rotary_{mistake}", (Rotary,), {"mistake": mistake})


class LearnedTheta(Rotary):
    def __init__(self, d_head, base=10000.0):
        super().__init__(d_head, base)
        self.theta = torch.nn.Parameter(torch.ones(1))


def measure_with(rotary_class, *, reverse=False):
    def scores_by_offset(q, k, seq_len):
        rope = rotary_class(q.shape[-1])
        positions = torch.arange(seq_len)
        q_rot = rope(q.expand(seq_len, -1), positions)
        k_rot = rope(k.expand(seq_len, -1), positions)
        table = q_rot @ k_rot.T
        offsets = range(-(seq_len - 1), seq_len)
        diagonals = [torch.diagonal(table, offset=(o if reverse else -o)) for o in offsets]
        return (torch.stack([d.mean() for d in diagonals]), torch.stack([d.max() - d.min() for d in diagonals]))
    return scores_by_offset


def test_checks_pass_on_the_solution(capsys):
    for seed in (0, 7, 101):
        check_sinusoidal_values(student.sinusoidal_encoding, seed=seed)
        check_rope_values(student.RotaryEmbedding, seed=seed)
        check_rope_values(student.RotaryEmbedding, seed=seed, dtype=torch.float64)
        check_rope_properties(student.RotaryEmbedding, seed=seed)
        check_offset_measurement(student.scores_by_offset, seed=seed)
    for seed in (0, 603, 11):
        check_sinusoidal_errors(student.sinusoidal_encoding, seed=seed)
    check_sinusoidal_values(encoding)
    check_rope_values(Rotary)
    check_rope_properties(CheckedRotary)
    check_offset_measurement(measure_with(Rotary))
    assert capsys.readouterr().out.count("✔") == 22


@pytest.mark.parametrize(("check", "stubbed"), [(check_sinusoidal_values, stub), (check_sinusoidal_errors, stub),
                                                (check_rope_values, StubRotary), (check_rope_properties, StubRotary),
                                                (check_offset_measurement, stub)])
def test_checks_fail_on_the_stub(check, stubbed):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stubbed)


def _no_value_error(seq_len, d_model):
    return encoding(max(seq_len, 1), max(d_model - d_model % 2, 2))


@pytest.mark.parametrize(
    ("check", "mistake", "message"),
    [
        (check_sinusoidal_values, lambda s, d: encoding(s, d, swap=True), "sin and cos are swapped"),
        (check_sinusoidal_values, lambda s, d: encoding(s, d, numerator=lambda i: i), "you used i"),
        (check_sinusoidal_values, lambda s, d: encoding(s, d, halves=True), "all the sines first"),
        (check_sinusoidal_values, lambda s, d: encoding(s, d, dtype=torch.float64), "float32"),
        (check_sinusoidal_values, lambda s, d: encoding(s, d).T, "shape"),
        (check_sinusoidal_errors, _no_value_error, "should raise ValueError"),
        (check_rope_values, rotary_with("half_split"), "half-split"),
        (check_rope_values, rotary_with("minus_theta"), "rotate by -pos"),
        (check_rope_values, rotary_with("i_not_2i"), "instead of 2i"),
        (check_rope_values, rotary_with("ignores_positions"), "positions\\[s\\]"),
        (check_rope_values, rotary_with("one_sided_sign"), "not a rotation"),
        (check_rope_properties, rotary_with("one_sided_sign"), "length"),
        (check_rope_properties, LearnedTheta, "no learned parameters|should have none"),
        (check_rope_properties, Rotary, r"RotaryEmbedding\(9\) should raise ValueError for an odd d_head .*returned"),
        (check_rope_properties, checked_without("odd"), "should raise ValueError for an odd d_head"),
        (check_rope_properties, checked_without("width"),
         r"on x Tensor\(2, 3, 5, 10\) float64 should raise ValueError for an input whose width 10 is not d_head = 8"),
        (check_rope_properties, checked_without("store"), r"should store self\.d_head = 8 .* self\.d_head = None"),
        (check_offset_measurement, measure_with(rotary_with("one_sided_sign")), "still vary"),
        (check_offset_measurement, measure_with(rotary_with("half_split")), "half-split"),
        (check_offset_measurement, measure_with(Rotary, reverse=True), "wrong way"),
        (check_offset_measurement, measure_with(rotary_with("minus_theta")), "mirrored"),
        # Gap 27: float64 was compared at 1e-5, so angles computed in float32 passed the float64 runs.
        (lambda cls: check_rope_values(cls, dtype=torch.float64), rotary_with("float32_angles"),
         r"\(largest difference .* on sizes batch=2, heads=3, seq=5, d_head=8\): Your float64 result is only as "
         r"accurate as float32"),
        # Section 3: the largest difference, a named mistake included.
        (check_rope_values, rotary_with("minus_theta"), r"\(largest difference .* on sizes .*\): You rotate by -pos"),
        (check_sinusoidal_values, lambda s, d: encoding(s, d, swap=True),
         r"\(largest difference .* on sizes seq_len=35, d_model=32\): sin and cos are swapped"),
        (check_rope_properties, rotary_with("one_sided_sign"), r"lengths: largest difference .* on sizes batch=2"),
    ],
)
def test_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake)


def test_float32_angles_cost_only_the_float64_values_run():
    # The properties and the measurement are about rotations, not precision.
    float32_angles = type("CheckedRotary_float32_angles", (CheckedRotary,), {"mistake": "float32_angles"})
    check_rope_properties(float32_angles)
    check_offset_measurement(measure_with(float32_angles))
    with pytest.raises(CheckFailure, match="only as accurate as float32"):
        check_rope_values(float32_angles, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 603, 11])
def test_sinusoidal_errors_check_names_each_missing_error(seed):
    def no_odd_check(seq_len, d_model):
        if seq_len < 1 or d_model < 1:
            raise ValueError("sizes must be at least 1")
        return torch.zeros(seq_len, d_model)

    def type_error(seq_len, d_model):
        if seq_len < 1 or d_model < 1 or d_model % 2:
            raise TypeError("bad sizes")
        return encoding(seq_len, d_model)

    with pytest.raises(CheckFailure, match=r"should raise ValueError for an odd d_model .*, but returned"):
        check_sinusoidal_errors(no_odd_check, seed=seed)
    with pytest.raises(CheckFailure, match="got TypeError: bad sizes"):
        check_sinusoidal_errors(type_error, seed=seed)


def test_using_the_library_is_not_own_work():
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_sinusoidal_values(stepformer.positional.sinusoidal_encoding)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_rope_values(stepformer.positional.RotaryEmbedding)


def test_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(60):
        sizes = list(_sizes(seed).values())
        assert len(set(sizes)) == len(sizes) and _sizes(seed)["d_head"] % 2 == 0


# -- issue 27: each named diagnosis is verified on its own mistake and withheld from a similar one ----------

class PairRotary(torch.nn.Module):
    """RoPE written the way the exercise suggests, with one line changed by ``edit`` (x0, x1, cos, sin -> pair)."""

    edit = staticmethod(lambda x0, x1, cos, sin: (x0 * cos - x1 * sin, x0 * sin + x1 * cos))
    exponent = staticmethod(lambda i, d: -2 * i / d)
    split, merge = "... seq (pair two) -> ... seq pair two", "two ... seq pair -> ... seq (pair two)"
    transposed_angle = False

    def __init__(self, d_head, base=10000.0):
        super().__init__()
        if d_head < 2 or d_head % 2:
            raise ValueError(f"d_head must be even, got {d_head}")
        self.d_head, self.base = d_head, base

    def forward(self, x, positions):
        if x.shape[-1] != self.d_head:
            raise ValueError("wrong width")
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        theta = self.base ** self.exponent(torch.arange(self.d_head // 2, dtype=dtype), self.d_head)
        if self.transposed_angle:
            angle = torch.einsum("s,p->sp", theta, positions.to(dtype))
        else:
            angle = positions.to(dtype)[:, None] * theta
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        pairs = einops.rearrange(x, self.split, two=2)
        return einops.rearrange(list(self.edit(pairs[..., 0], pairs[..., 1], cos, sin)), self.merge)


def pair_rotary(**changes):
    return type("PairRotary_edited", (PairRotary,), {k: staticmethod(v) if callable(v) else v
                                                      for k, v in changes.items()})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(edit=lambda x0, x1, c, s: (x0 * c - x1 * s, x1 * c)),
         "In your odd channels the term x₀ sin pθ is missing"),
        (dict(edit=lambda x0, x1, c, s: (x0 / c - x1 * s, x0 * s + x1 * c)),
         "you divided by cos pθ instead of multiplying by it in x₀ cos pθ"),
        (dict(edit=lambda x0, x1, c, s: (x0 * c - x1 * s, x0 + x1 * c)), "x₀ sin pθ has no sin factor"),
        (dict(edit=lambda x0, x1, c, s: (x0 * c - x1 * s, s + x1 * c)), "x₀ sin pθ has no x factor"),
        (dict(edit=lambda x0, x1, c, s: (x0 * c - x1 * s, -x0 * s + x1 * c)),
         "the sign of x₀ sin pθ is flipped.*not a rotation"),
        # Both leave only pair 0 turning: told apart by nothing, so named together.
        (dict(exponent=lambda i, d: -2 * i), "every other θ_i ≈ 0, what base\\^\\(-2i\\) or base\\^\\(-2i·d_head\\)"),
        (dict(exponent=lambda i, d: -2 * i * d), "the exponent divided by d_head"),
        (dict(exponent=lambda i, d: -i / d), "you used i instead of 2i"),
        (dict(split="... seq (two pair) -> ... seq pair two"),
         "You split x into half-split pairs .* but put the result"),
        (dict(merge="two ... seq pair -> ... seq (two pair)"), "You split x into interleaved pairs .* half-split"),
        (dict(transposed_angle=True), "angle table is transposed"),
        (dict(split="... seq (pair two) -> ... pair seq two"), "rotates x with its seq and pair axes swapped"),
        (dict(split="... seq (pair two) -> seq ... pair two"), "without leading axes, your output is right"),
        (dict(split="... seq (pair two) -> ... seq two pair"), "With d_head = 4 .* reads the pairs \\(x_i, x_i\\+2\\)"),
    ],
)
def test_rope_values_check_names_a_one_line_slip(changes, message):
    with pytest.raises(CheckFailure, match=message):
        check_rope_values(pair_rotary(**changes))


def test_rope_values_check_withholds_names_that_do_not_fit():
    # The correct formula passes; a sign flipped on the even channel's term is not called a missing term.
    check_rope_values(PairRotary)
    with pytest.raises(CheckFailure) as failure:
        check_rope_values(pair_rotary(edit=lambda x0, x1, c, s: (x0 * c + x1 * s, x0 * s + x1 * c)))
    assert "the sign of x₁ sin pθ is flipped" in str(failure.value) and "missing" not in str(failure.value)
    # The exact half-split (both patterns) keeps its own name, not the one-sided one.
    with pytest.raises(CheckFailure, match="You paired channel i with i \\+ d_head/2") as failure:
        check_rope_values(pair_rotary(split="... seq (two pair) -> ... seq pair two",
                                      merge="two ... seq pair -> ... seq (two pair)"))
    assert "put the result back" not in str(failure.value)
    # A shape error that no coinciding axes explain gets no name.
    with pytest.raises(CheckFailure) as failure:
        check_rope_values(pair_rotary(edit=lambda x0, x1, c, s: (x0 * c[:1, :1, None], x1)))
    assert "transposed" not in str(failure.value) and "leading axes" not in str(failure.value)


def test_rope_properties_check_accepts_two_channels_and_keeps_float16():
    check_rope_properties(PairRotary)

    class StrictRotary(PairRotary):
        def __init__(self, d_head, base=10000.0):
            if d_head <= 2:
                raise ValueError(f"d_head must be even and above 2, got {d_head}")
            super().__init__(d_head, base)

    with pytest.raises(CheckFailure, match="RotaryEmbedding\\(2\\) raised ValueError.*at the boundary, 2 itself"):
        check_rope_properties(StrictRotary)
    # An odd width refused, as asked, is not mistaken for a refused 2.
    with pytest.raises(CheckFailure, match="should raise ValueError for an odd d_head") as failure:
        check_rope_properties(type("NoOddCheck", (checked_without("odd"),), {}))
    assert "RotaryEmbedding(2)" not in str(failure.value)

    class Float32Out(PairRotary):
        def forward(self, x, positions):
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            theta = self.base ** (-2 * torch.arange(self.d_head // 2, dtype=dtype) / self.d_head)
            angle = positions.to(dtype)[:, None] * theta
            pairs = einops.rearrange(x, self.split, two=2)
            x0, x1, cos, sin = pairs[..., 0], pairs[..., 1], angle.cos(), angle.sin()
            return einops.rearrange([x0 * cos - x1 * sin, x0 * sin + x1 * cos], self.merge)

    with pytest.raises(CheckFailure, match="float16 returned torch.float32: return x's dtype"):
        check_rope_properties(Float32Out)

    # A rotation by -pos·θ keeps every property: d_head = 2 and float16 cost it nothing here.
    check_rope_properties(type("CheckedRotary_minus_theta", (CheckedRotary,), {"mistake": "minus_theta"}))


def test_sinusoidal_check_counts_the_pairs():
    def third(seq_len, d_model):
        return encoding(seq_len, 2 * (d_model // 3))
    with pytest.raises(CheckFailure, match=r"got \(35, 20\)\. Your encoding has 20 channels, 10 \(sin, cos\) pairs; "
                                           r"d_model = 32 needs d_model // 2 = 16 pairs"):
        check_sinusoidal_values(third)
    def frequency_without_i(seq_len, d_model):
        i = torch.arange(d_model // 2, dtype=torch.float64)
        return einops.einsum(torch.arange(seq_len, dtype=torch.float64), 10000.0 ** (-2 / d_model) + 0 * i[0].item(),
                             "seq, pair -> seq pair")
    with pytest.raises(CheckFailure, match="A Python number reached a function that takes tensors"):
        check_sinusoidal_values(frequency_without_i)
    with pytest.raises(CheckFailure) as failure:  # another TypeError gets no hint
        check_sinusoidal_values(lambda s, d: torch.zeros(s, d) + None)
    assert "Python number" not in str(failure.value)
    with pytest.raises(CheckFailure) as failure:  # the transposed table is not counted as pairs
        check_sinusoidal_values(lambda s, d: encoding(s, d).T)
    assert "pairs" not in str(failure.value)


def measure(*, offsets=None, diagonal=None, spread=None, shape=None, repeat_axes="d_head -> seq d_head",
            rotary=PairRotary):
    """scores_by_offset written with einops, one piece replaceable."""
    def scores_by_offset(q, k, seq_len):
        rope = rotary(q.shape[-1] if shape is None else shape(q))
        positions = torch.arange(seq_len)
        q_rot = rope(einops.repeat(q, repeat_axes, seq=seq_len), positions)
        k_rot = rope(einops.repeat(k, repeat_axes, seq=seq_len), positions)
        scores = q_rot @ k_rot.T
        ds = [(diagonal or (lambda t, o: torch.diagonal(t, offset=-o)))(scores, o)
              for o in (offsets or (lambda n: range(-(n - 1), n)))(seq_len)]
        return (torch.stack([d.mean() for d in ds]),
                torch.stack([(spread or (lambda d: d.max() - d.min()))(d) for d in ds]))
    return scores_by_offset


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(offsets=lambda n: range(-(n - 1) + 1, n)),
         r"offsets -9 \.\.\. 10 .* missing the first 1 \(-10 \.\.\. -10\)"),
        (dict(offsets=lambda n: range(-(n - 1), n - 1)), r"missing the last 1 \(10 \.\.\. 10\)"),
        (dict(offsets=lambda n: range(n - 1, n)), "the sign of the range's start is flipped"),
        (dict(diagonal=lambda t, o: torch.diagonal(t)), "each of your diagonals is the main one"),
        (dict(spread=lambda d: d.max()), "Your spread is each diagonal's max alone: you left out − d.min"),
        (dict(spread=lambda d: d.max() + d.min()), "max \\+ min of each diagonal"),
        (dict(diagonal=lambda t, o: torch.diagonal(t, offset=-o + 1)), "A max\\(\\) or min\\(\\) met an empty tensor"),
        (dict(shape=lambda q: q.shape[-2]), "q and k have one axis, \\(d_head,\\) = \\(12,\\)"),
        (dict(repeat_axes="d_head -> d_head seq", rotary=student.RotaryEmbedding),
         r"gave RotaryEmbedding an x of shape \(12, 11\), that is \(d_head, seq_len\): its axes are transposed"),
    ],
)
def test_offset_check_names_a_one_line_slip(kwargs, message):
    with pytest.raises(CheckFailure, match=message):
        check_offset_measurement(measure(**kwargs))


def test_offset_check_withholds_names_that_do_not_fit():
    check_offset_measurement(measure())
    # Mirrored offsets keep their own name, not the main diagonal's; min - max is not called max alone.
    with pytest.raises(CheckFailure, match="mirrored") as failure:
        check_offset_measurement(measure(diagonal=lambda t, o: torch.diagonal(t, offset=o)))
    assert "main one" not in str(failure.value)
    with pytest.raises(CheckFailure, match="spread is not max − min") as failure:
        check_offset_measurement(measure(spread=lambda d: d.min() - d.max() + 1))
    assert "alone" not in str(failure.value) and "max + min" not in str(failure.value)
    # Entries that are not RoPE's scores at any run of offsets get only the count.
    with pytest.raises(CheckFailure, match="Your mean has 20 entries; it needs one per offset") as failure:
        check_offset_measurement(lambda q, k, n: (torch.zeros(2 * n - 2, dtype=torch.float64),) * 2)
