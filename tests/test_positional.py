"""stepformer.positional against independent formulas, its defining properties, and the chapter's checks."""

import math

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
