"""Checks for chapter 06: the sinusoidal encoding, rotary embeddings, and RoPE's relative scores."""

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from einops import einsum, rearrange
from torch import Tensor

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    call,
    check,
    describe,
    difference,
    draw_sizes,
    dtype_name,
    expect_tensor,
    kind,
    passed,
    raised_error,
    show,
)
from stepformer.checks._messages import marked, t, tr

AXES = ("batch", "heads", "seq")
# Float32 angles pos · θ are off by ~1e-7 · pos radians however θ is computed; every mistake that the
# checks name changes some entry by far more than this. In float64, with positions up to ~60, a correct
# rotation is off by ~1e-14: 1e-10 leaves room and still refuses angles computed in float32 (~1e-6).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
# The properties and the offset measurement are about rotations, not precision: angles computed in float32
# keep them to ~1e-6, and only the values check (its float64 run) asks for float64 accuracy.
PROPERTY_TOLERANCE = 1e-5
FLOAT32_ANGLES = marked("Your float64 result is only as accurate as float32 (a correct float64 one is off by ~1e-14): "
                        "compute θ and the angles pos · θ in the input's dtype when it is float64 (torch.arange(..., "
                        "dtype=torch.float64); .float() rounds them to float32).")


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes (d_head even), so that a swapped axis changes a shape and cannot pass."""
    if seed == 0:
        return dict(batch=2, heads=3, seq=5, d_head=8)
    g = torch.Generator().manual_seed(seed)
    sizes = draw_sizes(g, AXES, span=7)
    d_heads = [d for d in range(4, 17, 2) if d not in sizes.values()]
    sizes["d_head"] = d_heads[int(torch.randint(len(d_heads), (1,), generator=g))]
    return sizes


def _near(actual: Tensor, expected: Tensor, tolerance: float | None = None) -> bool:
    tolerance = TOLERANCE[expected.dtype] if tolerance is None else tolerance
    return actual.shape == expected.shape and bool(torch.allclose(actual, expected, rtol=tolerance, atol=tolerance))


def _float32_accurate(actual: Tensor, expected: Tensor) -> bool:
    """A float64 result that misses float64's tolerance but meets float32's: angles computed in float32."""
    return expected.dtype == torch.float64 and _near(actual, expected, TOLERANCE[torch.float32])


# -- exercise 1: the sinusoidal encoding ---------------------------------------------------

def _paper_encoding(seq_len: int, d_model: int, *, sin_first: bool = True, exponent: Callable[[int], float] = None,
                    halves: bool = False, start: int = 0, sign: float = -1.0) -> Tensor:
    """Vaswani et al. (2017) §3.5 as a plain double loop in float64, with switches for the usual mistakes.

    With the defaults: PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(same angle).
    ``exponent(channel)`` gives the exponent's numerator for a channel (default: 2i for channels 2i and 2i + 1).
    """
    exponent = exponent or (lambda channel: 2 * (channel // 2))
    table = [[0.0] * d_model for _ in range(seq_len)]
    half = d_model // 2
    for pos in range(seq_len):
        for channel in range(d_model):
            if halves:  # sin of every pair first, then cos of every pair
                pair, is_sin = channel % half, channel < half
                numerator = 2 * pair
            else:
                is_sin = channel % 2 == 0
                numerator = exponent(channel)
            angle = (pos + start) * 10000.0 ** (sign * numerator / d_model)
            use_sin = is_sin if sin_first else not is_sin
            table[pos][channel] = math.sin(angle) if use_sin else math.cos(angle)
    return torch.tensor(table, dtype=torch.float64)


_ENCODING_MISTAKES = {  # hint (shown through tr()) -> the switches of _paper_encoding
    marked("sin and cos are swapped: even channels 2i hold sin, odd channels 2i + 1 hold cos."): dict(sin_first=False),
    marked("Your frequencies are wrong: the exponent is 2i / d_model, where i numbers the (sin, cos) pair "
           "(you used i, so your frequencies fall too slowly)."): dict(exponent=lambda channel: channel // 2),
    marked("The cos channel 2i + 1 must use the same frequency as its sin partner 2i: the exponent is 2i / d_model "
           "for both (you used the channel number, 2i + 1, for the cos)."): dict(exponent=lambda channel: channel),
    marked("You put all the sines first and then all the cosines: the paper interleaves them, sin in channel 2i "
           "and cos in channel 2i + 1 (rearrange '... seq pair sin_cos -> ... seq (pair sin_cos)')."):
        dict(halves=True),
    marked("Positions start at 0: the first row is pos = 0 (sin 0 = 0, cos 0 = 1)."): dict(start=1),
    marked("Divide pos by 10000^(2i/d_model) (the frequencies shrink with i); you multiplied by it."): dict(sign=1.0),
}
# float32 angles for positions up to ~40 are off by up to ~1e-5 radians, depending on how the
# frequency is computed; every mistake above changes some entry by far more than this.
ENCODING_TOLERANCE = 1e-4


def _encoding(fn: Callable[..., Any], seq_len: int, d_model: int) -> Tensor:
    try:
        result = call(fn, seq_len, d_model)
    except CheckFailure as failure:
        if not (raised_error(failure) == "TypeError" and
                re.match(r".*expected Tensor .*but got (float|int)", failure.text)):
            raise
        raise CheckFailure(t(
            "{failure}. A Python number reached a function that takes tensors. The frequencies 10000^(-2i/d_model) "
            "are a tensor, one per pair i = torch.arange(d_model // 2): an expression without the tensor i in it is "
            "a plain number, one frequency for every pair.", failure=failure)) from None
    if type(result) is Tensor and tuple(result.shape) == (seq_len, d_model) and result.dtype != torch.float32:
        raise CheckFailure(t("The encoding should be float32 (what embeddings are), got {dtype}: end with .float().",
                             dtype=result.dtype))
    if type(result) is Tensor and result.dim() == 2 and tuple(result.shape) not in ((seq_len, d_model),
                                                                                  (d_model, seq_len)):
        rows, channels = result.shape
        if rows == seq_len and channels % 2 == 0:
            raise CheckFailure(t(
                "the encoding should have shape (seq={seq_len}, d_model={d_model}), got {shape}. Your encoding has "
                "{channels} channels, {pairs} (sin, cos) pairs; d_model = "
                "{d_model} needs d_model // 2 = {needed} pairs, i = 0 ... {last}, one per "
                "value of the pair index i = torch.arange(d_model // 2).", seq_len=seq_len, d_model=d_model,
                shape=tuple(result.shape), channels=channels, pairs=channels // 2, needed=d_model // 2,
                last=d_model // 2 - 1))
        if channels == d_model:
            raise CheckFailure(t(
                "the encoding should have shape (seq={seq_len}, d_model={d_model}), got {shape}. Your encoding has "
                "{rows} rows; it needs one per position 0 ... seq_len - 1.", seq_len=seq_len, d_model=d_model,
                shape=tuple(result.shape), rows=rows))
    return expect_tensor(result, t("the encoding"), (seq_len, d_model), "seq d_model", torch.float32)


@check
def check_sinusoidal_values(fn: Callable[..., Any], seed: int = 0) -> None:
    """Equal to the paper's formula computed independently in float64, interleaved (sin, cos) channels."""
    s = _sizes(seed)
    cases = [(s["seq"] * 7, s["d_head"] * 4), (s["seq"], s["d_head"]), (1, 2)]
    for seq_len, d_model in cases:
        got = _encoding(fn, seq_len, d_model).double()
        expected = _paper_encoding(seq_len, d_model)
        if torch.allclose(got, expected, rtol=0, atol=ENCODING_TOLERANCE):
            continue
        found = difference(got, expected, {"seq_len": seq_len, "d_model": d_model})
        for hint, variant in _ENCODING_MISTAKES.items():
            if torch.allclose(got, _paper_encoding(seq_len, d_model, **variant), rtol=0, atol=ENCODING_TOLERANCE):
                raise CheckFailure(t("For seq_len={seq_len}, d_model={d_model} ({found}): {hint}", seq_len=seq_len,
                                     d_model=d_model, found=found, hint=tr(hint)))
        row, channel = divmod(int((got - expected).abs().argmax()), d_model)
        raise CheckFailure(t(
            "For seq_len={seq_len}, d_model={d_model} your encoding differs from the paper's formula ({found}), "
            "most at pos={row}, channel={channel}: got {got:.5f}, expected "
            "{expected:.5f}. Compare a few entries by hand with sin(pos / 10000^(2i/d_model)).", seq_len=seq_len,
            d_model=d_model, found=found, row=row, channel=channel, got=got[row, channel].item(),
            expected=expected[row, channel].item()))
    passed(t("equal to the paper's formula (sin in channel 2i, cos in channel 2i + 1)"))


def _error_of(fn: Callable[..., Any], *args: Any) -> tuple[str, str] | None:
    """Run ``fn(*args)`` and report what it raised, as plain data (for record and replay)."""
    try:
        fn(*args)
    except NotImplementedError:
        raise
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def _expect_value_error(fn: Callable[..., Any], args: tuple, call_text: str, why: str) -> None:
    raised = call(_error_of, fn, *args)
    if raised is None:
        raise CheckFailure(t("{call} should raise ValueError for {why}, but returned.", call=call_text, why=why))
    if raised[0] != "ValueError":
        raise CheckFailure(t(
            "{call} should raise ValueError for {why}, got {error}: {text}. "
            "Check the sizes first and raise ValueError yourself.", call=call_text, why=why, error=raised[0],
            text=raised[1]))
    if not raised[1]:
        raise CheckFailure(t("{call} raised ValueError without a message: say what is wrong.", call=call_text))


@check
def check_sinusoidal_errors(fn: Callable[..., Any], seed: int = 0) -> None:
    """An odd d_model or a size below 1 raises ValueError, with a message."""
    if seed == 0:
        seq_len, d_model, negative = 4, 4, -2
    else:
        g = torch.Generator().manual_seed(seed)
        seq_len, pairs, negative = (int(n) for n in torch.randint(2, 10, (3,), generator=g))
        d_model, negative = 2 * pairs, -negative
    _encoding(fn, seq_len - 1, d_model)
    for args, why in (((seq_len, d_model + 3), t("an odd d_model (channels come in (sin, cos) pairs)")),
                      ((0, d_model), "seq_len = 0"), ((seq_len, 0), "d_model = 0"),
                      ((negative, d_model), t("a negative seq_len"))):
        _expect_value_error(fn, args, f"sinusoidal_encoding{args}", why)
    passed(t("odd d_model and sizes below 1 raise ValueError"))


# -- exercise 2: rotary embeddings ---------------------------------------------------------

def _rope_oracle(x: Tensor, positions: Tensor, base: float = 10000.0, *, halves: bool = False,
                 sign: float = 1.0, exponent: int = 2, theta: Callable[[Tensor, int], Tensor] | None = None,
                 angle: Tensor | None = None, read_halves: bool | None = None, write_halves: bool | None = None,
                 terms: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None) -> Tensor:
    """RoPE as complex multiplication (RoFormer, eq. 13): pair (x_2i, x_2i+1) is the number x_2i + i·x_2i+1,
    multiplied by e^{i · pos · θ_i}, θ_i = base^(-2i/d_head). Computed in float64; switches for the usual mistakes:
    ``theta(i, d_head)`` for another frequency, ``angle`` for another (seq, pair) angle table, ``read_halves`` /
    ``write_halves`` for a half-split on one side only, ``terms(x0, x1, cos, sin)`` for another pair formula.
    """
    d_head = x.shape[-1]
    i = torch.arange(d_head // 2, dtype=torch.float64)
    theta_i = theta(i, d_head) if theta is not None else base ** (-exponent * i / d_head)
    if angle is None:
        angle = sign * positions.double()[:, None] * theta_i[None, :]  # (seq, pair)
    read = halves if read_halves is None else read_halves
    write = halves if write_halves is None else write_halves
    pattern = "... seq (two pair) -> ... seq pair two" if read else "... seq (pair two) -> ... seq pair two"
    pairs = rearrange(x.double(), pattern, two=2)
    if terms is None:
        z = torch.view_as_complex(pairs.contiguous())
        turned = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle))
    else:
        turned = torch.stack(terms(pairs[..., 0], pairs[..., 1], angle.cos(), angle.sin()), dim=-1)
    back = "... seq pair two -> ... seq (two pair)" if write else "... seq pair two -> ... seq (pair two)"
    return rearrange(turned, back).to(x.dtype)


# The formula (x₀ cos − x₁ sin, x₀ sin + x₁ cos) with one term changed: the slips a student makes in one line.
_PAIR = marked("(x'_2i, x'_2i+1) = (x₀ cos pθ − x₁ sin pθ, x₀ sin pθ + x₁ cos pθ), with x₀ = x_2i and x₁ = x_2i+1")
_TERMS = {  # (channel, term) -> (the term's text, its factors x and trig as indices into (x0, x1, cos, sin), sign)
    ("even", "x₀ cos pθ"): (0, 0, 2, 1.0), ("even", "x₁ sin pθ"): (0, 1, 3, -1.0),
    ("odd", "x₀ sin pθ"): (1, 0, 3, 1.0), ("odd", "x₁ cos pθ"): (1, 1, 2, 1.0),
}


def _term_variants() -> dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]]:
    """For each of the four terms: left out, its x or its cos/sin factor missing, divided instead of
    multiplied, its sign flipped."""
    variants = {}
    for (channel, text), (out, xi, ti, sign) in _TERMS.items():
        trig = "cos" if ti == 2 else "sin"
        changes = {
            t("the term {term} is missing", term=text): lambda x, f: 0 * x,
            t("the term {term} has no {trig} factor: you left out {trig} pθ (it reads x alone)", term=text,
              trig=trig): lambda x, f: x,
            t("the term {term} has no x factor: you left out x (it reads {trig} pθ alone)", term=text, trig=trig):
                lambda x, f: f,
            t("you divided by {trig} pθ instead of multiplying by it in {term}", term=text, trig=trig):
                lambda x, f: x / f,
            t("the sign of {term} is flipped (only x₁ sin pθ, in the even channel, has a minus)", term=text):
                lambda x, f: -x * f,
        }
        for change, term in changes.items():
            def formula(x0: Tensor, x1: Tensor, cos: Tensor, sin: Tensor, out: int = out, xi: int = xi,
                        ti: int = ti, sign: float = sign, term: Callable = term) -> tuple[Tensor, Tensor]:
                parts = (x0, x1, cos, sin)
                right = [[x0 * cos, -(x1 * sin)], [x0 * sin, x1 * cos]]
                k = 0 if (out, xi) in ((0, 0), (1, 0)) else 1
                right[out][k] = sign * term(parts[xi], parts[ti])
                return right[0][0] + right[0][1], right[1][0] + right[1][1]
            if channel == "even":
                hint = t("In your even channels {change}; your odd channels are right. {pair}.", change=change,
                         pair=tr(_PAIR))
            else:
                hint = t("In your odd channels {change}; your even channels are right. {pair}.", change=change,
                         pair=tr(_PAIR))
            variants[hint] = formula
    return variants


def _rope_inputs(seed: int, dtype: torch.dtype) -> tuple[dict[str, int], Tensor, Tensor]:
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s["batch"], s["heads"], s["seq"], s["d_head"], generator=g, dtype=dtype)
    # Scattered positions, not 0 ... seq - 1: the rotation must follow positions, not the row number.
    positions = torch.randperm(40, generator=g)[: s["seq"]] + 3
    return s, x, positions


def _rotated(rope: Any, x: Tensor, positions: Tensor) -> Tensor:
    return expect_tensor(call(rope, x, positions), t("the rotated tensor"), tuple(x.shape),
                         " ".join(["batch", "heads", "seq", "d_head"][-x.dim():]), x.dtype)


def _diagnose_rope(x: Tensor, positions: Tensor, base: float, got: Tensor) -> str:
    if _float32_accurate(got, _rope_oracle(x, positions, base)):
        return tr(FLOAT32_ANGLES)
    if _near(got, x, TOLERANCE[torch.float32]):
        return t("Your output equals the input: nothing was rotated.")
    norms_in, norms_out = x.double().norm(dim=-1), got.double().norm(dim=-1)
    # The two exponents without the division by d_head: where both match, one hint names them together.
    exponent_hints = (
        t("Your angles are wrong: θ_i = base^(-2i/d_head); you did not divide the exponent by d_head (θ_i = "
          "base^(-2i))."),
        t("Your angles are wrong: θ_i = base^(-2i/d_head); you multiplied the exponent by d_head instead of dividing "
          "by it."),
    )
    variants = {
        t("You paired channel i with i + d_head/2 (the half-split of GPT-NeoX/LLaMA code); this exercise asks for "
          "interleaved pairs (0, 1), (2, 3), ... as in the RoFormer paper."): dict(halves=True),
        t("You rotate by -pos·θ: the rotation of a pair (x₀, x₁) is (x₀ cos − x₁ sin, x₀ sin + x₁ cos)."):
            dict(sign=-1.0),
        t("Your angles are wrong: θ_i = base^(-2i/d_head), where i numbers the pair (you used i instead of 2i)."):
            dict(exponent=1),
        exponent_hints[0]: dict(theta=lambda i, d: base ** (-2 * i)),
        exponent_hints[1]: dict(theta=lambda i, d: base ** (-2 * i * d)),
        t("You split x into half-split pairs (channel i with i + d_head/2) but put the result back as interleaved "
          "pairs (2i, 2i + 1): the order of pair and two in your two rearrange patterns disagrees; both are "
          "'(pair two)'."): dict(read_halves=True, write_halves=False),
        t("You split x into interleaved pairs (2i, 2i + 1) but put the result back as half-split pairs (channel i "
          "with i + d_head/2): the order of pair and two in your two rearrange patterns disagrees; both are "
          "'(pair two)'."): dict(read_halves=False, write_halves=True),
    } | {hint: dict(terms=formula) for hint, formula in _term_variants().items()}
    # Named by float32's tolerance: a mistake made with float32 angles on float64 inputs is still that mistake.
    loose = TOLERANCE[torch.float32]
    rotation = torch.allclose(norms_in, norms_out, rtol=1e-4, atol=1e-6)
    matches = [hint for hint, variant in variants.items()
               if _near(got, _rope_oracle(x, positions, base, **variant), loose)]
    if len(matches) > 1 and all(hint in exponent_hints for hint in matches):
        # base^(-2i) and base^(-2i·d_head) both leave only pair 0 turning (θ_0 = 1, every other θ_i ≈ 0).
        matches = [t("Your angles are wrong: your θ_0 = 1 and every other θ_i ≈ 0, what base^(-2i) or "
                     "base^(-2i·d_head) give: θ_i = base^(-2i/d_head), the exponent divided by d_head.")]
    if len(matches) == 1:
        if rotation:
            return matches[0]
        return t("{hint} Your output's lengths differ from the input's: this is not a rotation.", hint=matches[0])
    if _near(got, _rope_oracle(x, torch.arange(len(positions)), base), loose):
        return t("You rotated row s by s·θ: use the angle positions[s]·θ, the token's position.")
    if base != 10000.0 and _near(got, _rope_oracle(x, positions, 10000.0), loose):
        return t("You ignored base={base}: θ_i = base^(-2i/d_head) with the base given to __init__.", base=base)
    if not rotation:
        return t("Your output's lengths differ from the input's, so this is not a rotation; it matches none of the "
                 "common mistakes (a sign, a term left out, a factor divided): compare one pair by hand, {pair}.",
                 pair=tr(_PAIR))
    return t("Compare one pair by hand: (x₀, x₁) at position p becomes (x₀ cos pθ − x₁ sin pθ, x₀ sin pθ + x₁ cos "
             "pθ).")


def _retry(rope: Any, x: Tensor, positions: Tensor) -> Tensor | None:
    """The student's rotation of ``x``, or None where it raises or has the wrong shape."""
    try:
        return _rotated(rope, x, positions)
    except CheckFailure:
        return None


def _rope_error_hint(cls: Callable[..., Any], rope: Any, x: Tensor, positions: Tensor, base: float) -> str:
    """After an error: inputs on which the suspected axes coincide, where the code runs and its output tells which."""
    loose, d_head = TOLERANCE[torch.float32], x.shape[-1]
    if x.dim() > 2:
        single = x[(0,) * (x.dim() - 2)]
        got = _retry(rope, single, positions)
        if got is not None and _near(got, _rope_oracle(single, positions, base), loose):
            return t("On x of shape (seq, d_head), without leading axes, your output is right, so your code breaks on "
                     "the leading axes (batch, heads): keep '...' in front of seq in every pattern ('... seq (pair "
                     "two) -> ... seq pair two') and make cos and sin (seq, pair), so that they broadcast over the "
                     "leading axes.")
    pair = d_head // 2
    if x.shape[-2] >= pair:
        square, square_positions = x[..., :pair, :], positions[:pair]
        got = _retry(rope, square, square_positions)
        if got is not None:
            theta = base ** (-2 * torch.arange(pair, dtype=torch.float64) / d_head)
            transposed = square_positions.double()[None, :] * theta[:, None]  # angle[s, i] = positions[i] · θ_s
            swapped = rearrange(rearrange(square, "... seq (pair two) -> ... pair seq two", two=2),
                                "... a b two -> ... a (b two)")
            if _near(got, _rope_oracle(square, square_positions, base, angle=transposed), loose):
                return t("On x with seq = d_head/2 = {pair} (where the seq and pair axes have one size) your code "
                         "runs, and its angle table is transposed: angle[s, i] = positions[i]·θ_s instead of "
                         "positions[s]·θ_i. The angles are einsum(positions, theta, \"seq, pair -> seq pair\"): the "
                         "operands in the order of the pattern.", pair=pair)
            if _near(got, _rope_oracle(swapped, square_positions, base), loose):
                return t("On x with seq = d_head/2 = {pair} (where the seq and pair axes have one size) your code "
                         "runs, and it rotates x with its seq and pair axes swapped: the axes of your pattern are "
                         "out of order; split the pairs with '... seq (pair two) -> ... seq pair two'.", pair=pair)
    if d_head != 4:
        try:
            small = call(cls, 4) if base == 10000.0 else call(cls, 4, base=base)
        except CheckFailure:
            return ""
        got = _retry(small, x[..., :4], positions)
        if got is not None and _near(got, _rope_oracle(x[..., :4], positions, base, read_halves=True,
                                                       write_halves=False), loose):
            return t("With d_head = 4 (where the pair and two axes both have size 2) your code runs, and it reads the "
                     "pairs (x_i, x_i+2) but writes them back as (2i, 2i + 1): the axes two and pair of your "
                     "pattern are out of order; split with '... seq (pair two) -> ... seq pair two'.")
    return ""


@check
def check_rope_values(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to RoPE computed as complex multiplication, any leading axes, scattered positions, another base."""
    s, x, positions = _rope_inputs(seed, dtype)
    for base, sample in ((10000.0, x), (10000.0, x[0, 0]), (10000.0, x[:1]), (500.0, x)):
        rope = call(cls, s["d_head"]) if base == 10000.0 else call(cls, s["d_head"], base=base)
        try:
            got = _rotated(rope, sample, positions)
        except CheckFailure as failure:
            if not isinstance(failure, CodeRaised):
                raise
            hint = _rope_error_hint(cls, rope, sample, positions, base)
            raise CheckFailure(t("{failure} {hint}", failure=failure, hint=hint).strip()) from None
        expected = _rope_oracle(sample, positions, base)
        if not _near(got, expected):
            sizes = dict(zip(("batch", "heads", "seq", "d_head")[4 - sample.dim():], sample.shape, strict=True))
            raise CheckFailure(t(
                "RotaryEmbedding({d_head}, base={base}) on x {x} at positions {positions} ({found}): {hint}",
                d_head=s["d_head"], base=base, x=describe(sample), positions=positions.tolist(),
                found=difference(got, expected, sizes), hint=_diagnose_rope(sample, positions, base, got)))
    passed(t("equal to RoPE as complex multiplication, batch=1 and no leading axes too ({dtype})",
             dtype=dtype_name(dtype)))


def _parameter_count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


@check
def check_rope_properties(cls: Callable[..., Any], seed: int = 0) -> None:
    """Relative position (q_m·k_n = q_{m+t}·k_{n+t}), lengths kept, position 0 untouched, nothing learned."""
    s, q, pos_q = _rope_inputs(seed, torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(q.shape, generator=g, dtype=torch.float64)
    pos_k = torch.randperm(40, generator=g)[: s["seq"]]
    rope = call(cls, s["d_head"])
    count = call(_parameter_count, rope)
    if count != 0:
        raise CheckFailure(t("RotaryEmbedding has {count} learned parameters; it should have none: "
                             "θ_i is fixed, so keep it a plain tensor (or a buffer), not an nn.Parameter.",
                             count=count))
    sizes = {a: s[a] for a in ("batch", "heads", "seq", "d_head")}
    at_zero = _rotated(rope, q, torch.zeros_like(pos_q))
    if not _near(at_zero, q, PROPERTY_TOLERANCE):
        raise CheckFailure(t("At position 0 the angle is 0, so the vector must come back unchanged; yours changed "
                             "({found}).", found=difference(at_zero, q, sizes)))
    rotated = _rotated(rope, q, pos_q)
    lengths_in, lengths_out = q.norm(dim=-1), rotated.norm(dim=-1)
    if not _near(lengths_out, lengths_in, PROPERTY_TOLERANCE):
        hint = (tr(FLOAT32_ANGLES) if _float32_accurate(lengths_out, lengths_in) else
                t("check the signs of (x₀ cos − x₁ sin, x₀ sin + x₁ cos)."))
        raise CheckFailure(t("A rotation keeps every vector's length, yours changed it (lengths: {found}): {hint}",
                             found=difference(lengths_out, lengths_in, sizes), hint=hint))
    pattern = "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len"
    scores = einsum(rotated, _rotated(rope, k, pos_k), pattern)
    for shift in (5, 17):
        shifted = einsum(_rotated(rope, q, pos_q + shift), _rotated(rope, k, pos_k + shift), pattern)
        if not _near(shifted, scores, PROPERTY_TOLERANCE):
            hint = (tr(FLOAT32_ANGLES) if _float32_accurate(shifted, scores) else
                    t("Rotate q and k the same way, by a proper rotation."))
            raise CheckFailure(t(
                "Shifting both the queries and the keys by {shift} positions changed their scores "
                "({found}); with RoPE they depend only on the offset m − n. {hint}", shift=shift,
                found=difference(shifted, scores, sizes), hint=hint))
    _check_rope_arguments(cls, rope, s, q, pos_q)
    passed(t("q_m·k_n depends only on m − n; lengths are kept; position 0 is the identity; no learned parameters; "
             "d_head and base are stored, d_head = 2 works, float16 stays float16, wrong widths raise ValueError"))


def _stored(module: Any) -> tuple[Any, Any]:
    """The module's d_head and base attributes, as plain data (None where missing)."""
    return getattr(module, "d_head", None), getattr(module, "base", None)


def _quietly(module: Any, x: Tensor, positions: Tensor) -> Any:
    """Run the module without warnings (PyTorch warns that complex float16 is experimental; stderr costs points)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module(x, positions)


def _check_rope_arguments(cls: Callable[..., Any], rope: Any, s: dict[str, int], x: Tensor, positions: Tensor) -> None:
    """What the exercise asks of __init__ and forward besides the rotation: stored sizes, ValueErrors."""
    d_head = s["d_head"]
    stored = call(_stored, call(cls, d_head, base=500.0))
    if stored != (d_head, 500.0):
        raise CheckFailure(t(
            "RotaryEmbedding({d_head}, base=500.0) should store self.d_head = {d_head} and self.base = 500.0; "
            "got self.d_head = {got_d_head!r}, self.base = {got_base!r} (None: not stored).", d_head=d_head,
            got_d_head=stored[0], got_base=stored[1]))
    _expect_value_error(cls, (d_head + 1,), f"RotaryEmbedding({d_head + 1})",
                        t("an odd d_head (channels are rotated in pairs)"))
    refused = call(_error_of, cls, 2)
    if refused is not None:
        raise CheckFailure(t(
            "RotaryEmbedding(2) raised {error}: {text}. d_head = 2 is even, one pair of channels, the "
            "smallest valid width: refuse only an odd d_head or one below 2 (at the boundary, 2 itself is allowed).",
            error=refused[0], text=refused[1]))
    # Values are exercise 2's first check; here only that the smallest width runs and float16 stays float16.
    _rotated(call(cls, 2), x[..., :2], positions)
    half = x.to(torch.float16)
    got = call(_quietly, rope, half, positions)
    if type(got) is Tensor and tuple(got.shape) == tuple(half.shape) and got.dtype != torch.float16:
        raise CheckFailure(t(
            "RotaryEmbedding({d_head}) on x {x} returned {dtype}: return x's dtype. A float32 factor "
            "makes the product float32: compute the angles in float32 (at least), then put cos and sin on x's dtype "
            "(.to(x.dtype)) before they multiply x.", d_head=d_head, x=describe(half), dtype=got.dtype))
    _rotated(rope, half, positions)
    wider = torch.cat([x, x[..., :2]], dim=-1)
    _expect_value_error(rope, (wider, positions), t("RotaryEmbedding({d_head}) on x {x}", d_head=d_head,
                                                    x=describe(wider)),
                        t("an input whose width {width} is not d_head = {d_head} (compare x.shape[-1] "
                          "with self.d_head in forward)", width=d_head + 2, d_head=d_head))


# -- exercise 3: measure the scores as a function of the offset ----------------------------

def _offset_oracle(q: Tensor, k: Tensor, seq_len: int, *, halves: bool = False) -> Tensor:
    """score(m − n = r) = Re Σ_i q̃_i conj(k̃_i) e^{i r θ_i}, with q̃_i = q_2i + i q_2i+1: RoPE's scores by offset."""
    d_head = q.shape[-1]
    pattern = "(two pair) -> pair two" if halves else "(pair two) -> pair two"
    q_c = torch.view_as_complex(rearrange(q.double(), pattern, two=2).contiguous())
    k_c = torch.view_as_complex(rearrange(k.double(), pattern, two=2).contiguous())
    theta = 10000.0 ** (-2 * torch.arange(d_head // 2, dtype=torch.float64) / d_head)
    offsets = torch.arange(-(seq_len - 1), seq_len, dtype=torch.float64)
    phase = torch.polar(torch.ones(len(offsets), d_head // 2, dtype=torch.float64), offsets[:, None] * theta)
    return (q_c * k_c.conj() * phase).sum(-1).real


def _expect_offsets(mean: Any, expected: Tensor, seq_len: int) -> None:
    """A mean with the wrong number of offsets: which offsets its entries are (their values tell)."""
    n_offsets = 2 * seq_len - 1
    if type(mean) is not Tensor or mean.dim() != 1 or len(mean) == n_offsets or mean.dtype != expected.dtype:
        return
    shape = t("mean should have shape (offset={n_offsets}), got {shape}", n_offsets=n_offsets, shape=tuple(mean.shape))
    found = [a for a in range(n_offsets - len(mean) + 1) if _near(mean, expected[a:a + len(mean)], PROPERTY_TOLERANCE)]
    if len(mean) == 0 or len(found) != 1:
        raise CheckFailure(t("{shape}. Your mean has {n} entries; it needs one per offset m − n from "
                             "−(seq_len − 1) = {low} to seq_len − 1 = {high}, both ends included.", shape=shape,
                             n=len(mean), low=-(seq_len - 1), high=seq_len - 1))
    first, last = found[0] - (seq_len - 1), found[0] + len(mean) - 1 - (seq_len - 1)
    # Which ends of the range are missing: the first offsets, the last ones, or both (the mean matches a slice).
    head = dict(n_first=first + seq_len - 1, first_from=-(seq_len - 1), first_to=first - 1)
    tail = dict(n_last=seq_len - 1 - last, last_from=last + 1, last_to=seq_len - 1)
    if first > -(seq_len - 1) and last < seq_len - 1:
        missing = t("the first {n_first} ({first_from} ... {first_to}) and the last {n_last} ({last_from} ... "
                    "{last_to})", **head, **tail)
    elif first > -(seq_len - 1):
        missing = t("the first {n_first} ({first_from} ... {first_to})", **head)
    else:
        missing = t("the last {n_last} ({last_from} ... {last_to})", **tail)
    start = (t(" It starts at +(seq_len − 1): the sign of the range's start is flipped, it is −(seq_len − 1).")
             if first == seq_len - 1 else "")
    if len(mean) == 1:
        raise CheckFailure(t(
            "{shape}. Your {n} entry is RoPE's scores at the offsets {first} ... {last} (their values match there): "
            "your range of offsets is missing {missing}; it runs from −(seq_len − 1) to seq_len − 1, both ends "
            "included, range(-(seq_len - 1), seq_len).{start}", shape=shape, n=len(mean), first=first, last=last,
            missing=missing, start=start))
    raise CheckFailure(t(
        "{shape}. Your {n} entries are RoPE's scores at the offsets {first} ... {last} (their values match there): "
        "your range of offsets is missing {missing}; it runs from −(seq_len − 1) to seq_len − 1, both ends "
        "included, range(-(seq_len - 1), seq_len).{start}", shape=shape, n=len(mean), first=first, last=last,
        missing=missing, start=start))


def _measurement_error_hint(failure: CheckFailure, d_head: int, seq_len: int) -> str:
    """What an error raised by scores_by_offset shows, and where to look: read from what the student's code raised
    (its exception's class and text), never from the check's own words, which depend on the language."""
    raised = failure.raised if isinstance(failure, CodeRaised) else ""
    if re.search(r"\b(max|min)\(\).*numel\(\) == 0", raised):
        return t("A max() or min() met an empty tensor. In the recipe that is a diagonal outside the (seq_len, "
                 "seq_len) = ({seq_len}, {seq_len}) table: torch.diagonal(scores, offset=d) is empty for "
                 "|d| ≥ seq_len. "
                 "Look at the ends of your range of offsets (−(seq_len − 1) ... seq_len − 1, range(-(seq_len - 1), "
                 "seq_len)) and at the diagonal's offset, −(m − n), for each.", seq_len=seq_len)
    if "IndexError: tuple index out of range" in raised:
        return t("An index ran past the end of a tuple: if it is a shape, q and k have one axis, (d_head,) = "
                 "({d_head},), so d_head is q.shape[-1] (or q.shape[0]); there is no axis -2.", d_head=d_head)
    if "Specify sizes for new axes in repeat" in raised:
        return t("repeat cannot know the size of an axis it creates: pass it as a keyword, e.g. repeat(q, "
                 "\"d_head -> q_len d_head\", q_len=seq_len).")
    given = re.search(r"'x': f\d+\[(\d+),(\d+)\]", raised)
    if given and (int(given.group(1)), int(given.group(2))) == (d_head, seq_len):
        return t("Your code gave RotaryEmbedding an x of shape ({d_head}, {seq_len}), that is (d_head, seq_len): its "
                 "axes are transposed. RotaryEmbedding rotates rows, one per position: repeat the vector to (seq_len, "
                 "d_head), e.g. repeat(q, \"d_head -> q_len d_head\", q_len=seq_len).", d_head=d_head,
                 seq_len=seq_len)
    return ""


@check
def check_offset_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """The measured scores agree with RoPE's closed form and do not vary at a fixed offset m − n."""
    s = _sizes(seed)
    d_head, seq_len = s["d_head"] + 4, s["seq"] + 6
    g = torch.Generator().manual_seed(seed + 2)
    q, k = torch.randn(d_head, generator=g, dtype=torch.float64), torch.randn(d_head, generator=g, dtype=torch.float64)
    try:
        result = call(fn, q, k, seq_len)
    except CheckFailure as failure:
        raise CheckFailure(t("{failure} {hint}", failure=failure,
                             hint=_measurement_error_hint(failure, d_head, seq_len)).strip()) from None
    if not isinstance(result, tuple) or len(result) != 2:
        raise CheckFailure(t("scores_by_offset should return a pair (mean, spread), got {got}.", got=kind(result)))
    n_offsets = 2 * seq_len - 1
    expected = _offset_oracle(q, k, seq_len)
    _expect_offsets(result[0], expected, seq_len)
    mean = expect_tensor(result[0], "mean", (n_offsets,), "offset", torch.float64)
    spread = expect_tensor(result[1], "spread", (n_offsets,), "offset", torch.float64)
    sizes = {"d_head": d_head, "seq_len": seq_len, "offset": n_offsets}
    if not _near(mean, expected, PROPERTY_TOLERANCE):
        found = difference(mean, expected, sizes)
        if _float32_accurate(mean, expected):
            raise CheckFailure(t("Your mean scores by offset are close to RoPE's but not to float64 precision "
                                 "({found}). In your RotaryEmbedding (exercise 2): {hint}", found=found,
                                 hint=tr(FLOAT32_ANGLES)))
        if torch.allclose(mean, expected.flip(0), rtol=1e-5, atol=1e-5):
            raise CheckFailure(t("Your scores by offset come out mirrored ({found}): either your offsets run the "
                                 "wrong way (entry 0 is m − n = −(seq_len − 1), the key seq_len − 1 positions after "
                                 "the query) or your RotaryEmbedding rotates by −pos·θ (run exercise 2's checks).",
                                 found=found))
        if torch.allclose(mean, _offset_oracle(q, k, seq_len, halves=True), rtol=1e-5, atol=1e-5):
            raise CheckFailure(t("Your measurement matches RoPE with half-split pairs ({found}): fix RotaryEmbedding "
                                 "(exercise 2) to pair channels (0, 1), (2, 3), ... and this passes too.",
                                 found=found))
        if torch.allclose(mean, torch.full_like(mean, (q @ k).item()), rtol=1e-5, atol=1e-5):
            raise CheckFailure(t(
                "Every entry of your mean is q·k = {qk:.4f}, the score at offset 0 ({found}): each of "
                "your diagonals is the main one. torch.diagonal(scores) without offset= is the main diagonal; pass "
                "offset=d to get the entries s[m, m + d], whose offset m − n is −d.", qk=(q @ k).item(),
                found=found))
        if (spread > 1e-5).any():
            raise CheckFailure(t(
                "At a fixed offset your scores still vary (spread up to {spread:.3g}; mean: {found}): "
                "does your RotaryEmbedding pass exercise 2's checks? Rotate q and k with it at positions "
                "0 ... seq_len − 1.", spread=spread.max().item(), found=found))
        raise CheckFailure(t(
            "Your mean scores by offset differ from RoPE's ({found}): at offset 0 the score is q·k = "
            "{qk:.4f} (both vectors turned by the same angle), you measured "
            "{measured:.4f}. "
            "Mean for offsets −2 ... 2: {middle}.", found=found, qk=(q @ k).item(),
            measured=mean[seq_len - 1].item(), middle=show(mean[seq_len - 3: seq_len + 2])))
    if not (spread.abs() < PROPERTY_TOLERANCE).all():
        zeros = torch.zeros_like(spread)
        # At a fixed offset every score is the mean, so a diagonal's max and min are both the mean.
        variants = {t("each diagonal's max alone: you left out − d.min(), the min subtracted from the max"): expected,
                    t("max + min of each diagonal: you added the min instead of subtracting it (its sign is minus)"):
                        2 * expected,
                    t("min − max of each diagonal, the opposite sign: spread is max − min"): zeros}
        for what, variant in list(variants.items())[:2]:
            if _near(spread, variant, PROPERTY_TOLERANCE) and not _near(variant, zeros, PROPERTY_TOLERANCE):
                raise CheckFailure(t("Your means are right, but your spread is not max − min of each diagonal "
                                     "(should be ~0: {found}). Your spread is {what}.",
                                     found=difference(spread, zeros, sizes), what=what))
        raise CheckFailure(t("Your means are right, but your spread is not max − min of each diagonal "
                             "(should be ~0: {found}).", found=difference(spread, zeros, sizes)))
    passed(t("over {n_offsets} offsets the score depends only on m − n (spread < {tolerance:g}); at m = n it is q·k",
             n_offsets=n_offsets, tolerance=PROPERTY_TOLERANCE))
