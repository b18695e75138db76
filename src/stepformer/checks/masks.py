"""Checks for chapter 02: padding masks, causal masks, and measuring what a mask hides."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from stepformer.checks._core import CheckFailure, call, check, close, kind, passed, show

AXES = ("batch", "heads", "q_len", "k_len", "d_k")
# What exercise 2 asks students to write themselves.
BUILT_IN_CAUSAL = {
    "torch.nn.attention.bias.causal_lower_right": "PyTorch's causal mask",
    "torch.nn.attention.bias.causal_upper_left": "PyTorch's causal mask",
    "torch.nn.modules.transformer._generate_square_subsequent_mask": "PyTorch's causal mask",
}
# What exercise 3 asks students to measure by changing tokens themselves.
BUILT_IN_JACOBIAN = {
    "torch.autograd.functional.jacobian": "autograd's Jacobian",
    "torch.func.jacrev": "autograd's Jacobian",
    "torch.func.jacfwd": "autograd's Jacobian",
}
SHAPE_HINT = (
    "A padding mask must have shape (batch, 1, 1, k_len) so that it broadcasts against the scores "
    "(batch, heads, q_len, k_len): a (batch, k_len) mask would line batch up with q_len. "
    'Use rearrange(..., "batch k_len -> batch 1 1 k_len").'
)


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis changes a shape and cannot pass."""
    if seed == 0:
        return dict(zip(AXES, (2, 3, 4, 7, 5), strict=True))
    picks = torch.randperm(8, generator=torch.Generator().manual_seed(seed))[: len(AXES)] + 2
    s = dict(zip(AXES, picks.tolist(), strict=True))
    # Queries are the last q_len of k_len positions (cross-attention and caching both need k_len > q_len).
    s["q_len"], s["k_len"] = sorted((s["q_len"], s["k_len"]))
    return s


# -- exercise 1: padding_mask ------------------------------------------------------------

def _tokens(seed: int, pad_id: int) -> Tensor:
    """A padded batch: sentence b has lengths[b] real tokens (ids other than pad_id, 0 included), then padding."""
    s = _sizes(seed)
    g = torch.Generator().manual_seed(seed)
    batch, k_len = s["batch"], s["k_len"]
    tokens = torch.randint(0, 30, (batch, k_len), generator=g)
    tokens = torch.where(tokens == pad_id, pad_id + 1, tokens)
    tokens[0, 0] = 0 if pad_id != 0 else 2  # id 0 is a real word unless it is the padding id
    lengths = torch.randint(1, k_len, (batch,), generator=g)
    lengths[-1] = k_len  # one sentence is the longest and has no padding
    padded = torch.arange(k_len) >= lengths[:, None]
    return tokens.masked_fill(padded, pad_id)


def _padding_result(fn: Callable[..., Any], tokens: Tensor, pad_id: int) -> Tensor:
    batch, k_len = tokens.shape
    try:
        mask = call(fn, tokens, pad_id)
    except CheckFailure as failure:
        if "TypeCheckError" in str(failure) and "return value" in str(failure):
            raise CheckFailure(f"padding_mask returned a mask of the wrong shape. {SHAPE_HINT}") from None
        raise
    if type(mask) is not Tensor:
        raise CheckFailure(f"padding_mask should return a torch.Tensor, got {kind(mask)}.")
    if mask.dtype != torch.bool:
        raise CheckFailure(
            f"padding_mask should return a boolean mask (True = may attend), got dtype {mask.dtype}: "
            "a comparison such as tokens != pad_id gives one."
        )
    if tuple(mask.shape) != (batch, 1, 1, k_len):
        raise CheckFailure(
            f"padding_mask should have shape (batch={batch}, 1, 1, k_len={k_len}), got {tuple(mask.shape)}. "
            + SHAPE_HINT
        )
    expected = (tokens != pad_id).view(batch, 1, 1, k_len)
    if not torch.equal(mask, expected):
        if torch.equal(mask, ~expected):
            raise CheckFailure(
                "Your padding mask is inverted: it is True on the padding. The course's masks say True = "
                "'may attend', so real tokens are True and padding is False (tokens != pad_id)."
            )
        if pad_id != 0 and torch.equal(mask, (tokens != 0).view(batch, 1, 1, k_len)):
            raise CheckFailure(
                f"Your mask treats token id 0 as padding, but here pad_id={pad_id} and 0 is a real word: "
                "compare with pad_id, not with 0."
            )
        raise CheckFailure(
            f"Your padding mask differs from tokens != pad_id. For tokens {show(tokens)} with pad_id={pad_id} "
            f"it should be {show(expected.view(batch, k_len))}, got {show(mask.view(batch, k_len))}."
        )
    return mask


@check
def check_padding_mask(fn: Callable[..., Any], seed: int = 0, pad_id: int = 0) -> None:
    """padding_mask is boolean, (batch, 1, 1, k_len), True on real tokens and False on padding."""
    _padding_result(fn, _tokens(seed, pad_id), pad_id)
    passed(f"padding mask: (batch, 1, 1, k_len), True on real tokens, False where tokens == {pad_id}")


@check
def check_padding_in_attention(fn: Callable[..., Any], seed: int = 0, pad_id: int = 0,
                               dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention with the mask ignores padded source tokens: changing them changes no output."""
    s = _sizes(seed)
    tokens = _tokens(seed, pad_id)
    mask = _padding_result(fn, tokens, pad_id)
    g = torch.Generator().manual_seed(seed + 1)
    batch, heads, q_len, k_len, d_k = s["batch"], s["heads"], s["q_len"], s["k_len"], s["d_k"]
    # Target queries read the padded source sentence: the encoder-decoder's cross-attention.
    q = torch.randn(batch, heads, q_len, d_k, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, heads, k_len, d_k, generator=g, dtype=dtype) for _ in range(2))
    padded = (tokens == pad_id).view(batch, 1, k_len, 1)
    other_k, other_v = (torch.where(padded, torch.randn(k.shape, generator=g, dtype=dtype) * 10, t) for t in (k, v))
    output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    moved = F.scaled_dot_product_attention(q, other_k, other_v, attn_mask=mask)
    if not close(output, moved, dtype):
        raise CheckFailure("Changing the padded tokens' keys and values changed the output: padding must be masked.")
    # nn.MultiheadAttention's convention is the opposite (True = ignore): ~ converts.
    key_padding_mask = (tokens == pad_id).view(batch, 1, 1, k_len)
    if not close(output, F.scaled_dot_product_attention(q, k, v, attn_mask=~key_padding_mask), dtype):
        raise CheckFailure("Attention with your mask differs from attention that ignores exactly the padded keys.")
    passed("cross-attention with your mask ignores the padded source tokens (changing them changes nothing)")


# -- exercise 2: causal_mask -------------------------------------------------------------

def _causal_result(fn: Callable[..., Any], q_len: int, k_len: int | None = None) -> Tensor:
    args = (q_len,) if k_len is None else (q_len, k_len)
    mask = call(fn, *args)
    rows, cols = q_len, q_len if k_len is None else k_len
    if type(mask) is not Tensor:
        raise CheckFailure(f"causal_mask should return a torch.Tensor, got {kind(mask)}.")
    if tuple(mask.shape) != (rows, cols):
        raise CheckFailure(
            f"causal_mask{args} should have shape (q_len={rows}, k_len={cols}), got {tuple(mask.shape)}."
            + (" With k_len left out, it must default to q_len." if k_len is None else "")
        )
    if mask.dtype != torch.bool:
        raise CheckFailure(f"causal_mask should be boolean (True = may attend), got dtype {mask.dtype}.")
    return mask


def _diagnose_causal(mask: Tensor, expected: Tensor) -> str:
    q_len, k_len = expected.shape
    ones = torch.ones(q_len, k_len, dtype=torch.bool)
    offset = k_len - q_len
    hints = [
        (~expected, "Your mask is inverted: it is True on the future. True must mean 'may attend' "
                    "(the past and the token itself), so keep the lower triangle."),
        (ones.triu(offset), "Your mask is the upper triangle: it lets each query read the future. "
                            "Keep the lower triangle (tril, not triu)."),
        (ones.tril(offset - 1), "Your mask hides the diagonal: a token may attend to itself."),
    ]
    if offset:
        hints.append((ones.tril(), (
            "Your mask is aligned to the first key, not the last: with k_len > q_len the queries are the "
            f"last q_len positions, so query i may read keys up to i + k_len - q_len (tril(diagonal={offset}))."
        )))
    for wrong, hint in hints:
        if torch.equal(mask, wrong):
            return hint
    return f"Expected {show(expected)}, got {show(mask)}."


@check(forbid=BUILT_IN_CAUSAL)
def check_causal_mask(fn: Callable[..., Any], seed: int = 0) -> None:
    """Square causal masks equal nn.Transformer.generate_square_subsequent_mask and attention's is_causal."""
    s = _sizes(seed)
    # n = 1 last: a 1 x 1 mask cannot tell one mistake from another.
    for n in (s["q_len"], s["k_len"], 1):
        for explicit in (False, True):
            mask = _causal_result(fn, n, n if explicit else None)
            # PyTorch's own causal mask is float: 0 where a query may attend, -inf above the diagonal.
            expected = torch.nn.Transformer.generate_square_subsequent_mask(n) == 0
            if not torch.equal(mask, expected):
                raise CheckFailure(f"causal_mask({n}): {_diagnose_causal(mask, expected)}")
    n = s["k_len"]
    mask = _causal_result(fn, n)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s["batch"], s["heads"], n, s["d_k"], generator=g, dtype=torch.float64) for _ in range(3))
    with_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if not close(with_mask, F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.float64):
        raise CheckFailure("Attention with your mask differs from scaled_dot_product_attention(..., is_causal=True).")
    passed("causal_mask(n) equals nn.Transformer.generate_square_subsequent_mask(n) == 0 and is_causal=True")


@check(forbid=BUILT_IN_CAUSAL)
def check_causal_mask_offset(fn: Callable[..., Any], seed: int = 0) -> None:
    """With k_len > q_len the triangle is aligned to the last key: cached decoding equals full decoding."""
    s = _sizes(seed)
    k_len = s["k_len"]
    for q_len in (1, s["q_len"], k_len - 1):
        mask = _causal_result(fn, q_len, k_len)
        # PyTorch's lower-right causal bias: the queries are the last q_len positions.
        expected = causal_lower_right(q_len, k_len)._materialize()
        if not torch.equal(mask, expected):
            raise CheckFailure(f"causal_mask({q_len}, {k_len}): {_diagnose_causal(mask, expected)}")
    # The defining property: the last q_len queries, reading all k_len keys (cached ones included)
    # through the mask, give the last q_len rows of full causal attention over the k_len positions.
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s["batch"], s["heads"], k_len, s["d_k"], generator=g, dtype=torch.float64)
               for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = F.scaled_dot_product_attention(q[..., -q_len:, :], k, v, attn_mask=mask)
    if not close(last, full[..., -q_len:, :], torch.float64):
        raise CheckFailure("The last queries with your mask differ from the last rows of full causal attention.")
    passed("causal_mask(q_len, k_len) is aligned to the last key: the last q_len rows of full causal attention")


def _expect_value_error(fn: Callable[..., Any], args: tuple, why: str) -> None:
    shown = ", ".join(map(repr, args))
    try:
        result = call(fn, *args)
    except CheckFailure as failure:
        if "raised ValueError" in str(failure):
            return
        if "not implemented yet" in str(failure):
            raise
        raise CheckFailure(
            f"causal_mask({shown}) should raise a ValueError saying that {why}; {failure} "
            "Check the arguments at the top of the function and raise ValueError(...) yourself."
        ) from None
    raise CheckFailure(
        f"causal_mask({shown}) should raise a ValueError saying that {why}, but it returned {kind(result)}."
    )


@check(forbid=BUILT_IN_CAUSAL)
def check_causal_mask_arguments(fn: Callable[..., Any], seed: int = 0) -> None:
    """The mask is created on the requested device; impossible lengths raise ValueError."""
    s = _sizes(seed)
    mask = call(fn, s["q_len"], s["k_len"], device="meta")
    if type(mask) is not Tensor or mask.device.type != "meta":
        where = mask.device if type(mask) is Tensor else kind(mask)
        raise CheckFailure(
            f"causal_mask(..., device='meta') should create the mask on that device, got {where}: "
            "pass device=device to the function that creates the tensor."
        )
    _expect_value_error(fn, (0,), "q_len must be positive")
    _expect_value_error(fn, (-s["q_len"],), "q_len must be positive")
    _expect_value_error(fn, (s["k_len"], s["q_len"]), "k_len must be at least q_len")
    passed("the mask is created on the requested device, and impossible lengths raise ValueError")


# -- exercise 3: measure which outputs a change reaches ----------------------------------

def _expected_changes(x: Tensor, mask: Tensor | None) -> Tensor:
    """changed[i, j]: does output i depend on input j? Read off autograd's Jacobian of PyTorch's attention."""
    jacobian = torch.autograd.functional.jacobian(
        lambda x: F.scaled_dot_product_attention(x, x, x, attn_mask=mask), x
    )  # (seq, d_model, seq, d_model)
    return jacobian.abs().amax(dim=(1, 3)) > 0


@check(forbid=BUILT_IN_JACOBIAN)
def check_which_outputs_change(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
    """The measured (seq, seq) matrix equals the dependence read off autograd's Jacobian, with and without masks."""
    s = _sizes(seed)
    seq, d_model = s["k_len"], s["d_k"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, d_model, generator=g, dtype=dtype)
    random = torch.rand(seq, seq, generator=g) < 0.4
    random[torch.arange(seq), torch.randint(0, seq, (seq,), generator=g)] = True  # no row fully masked
    # A query that cannot read its own key still changes when its token does.
    random[1, 1], random[1, 0] = False, True
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for name, mask in (("no mask", None), ("a causal mask", causal), ("a random mask", random)):
        got = call(fn, x, mask) if mask is not None else call(fn, x)
        if type(got) is not Tensor or got.dtype != torch.bool or tuple(got.shape) != (seq, seq):
            what = f"a {str(got.dtype).removeprefix('torch.')} tensor of shape {tuple(got.shape)}" \
                if type(got) is Tensor else kind(got)
            raise CheckFailure(
                f"which_outputs_change should return a boolean tensor of shape (seq={seq}, seq={seq}), got {what}."
            )
        expected = _expected_changes(x.double(), mask)
        if torch.equal(got, expected):
            continue
        if torch.equal(got, expected.T):
            hint = "Your matrix is transposed: row i is output i, column j is the input you changed."
        elif mask is not None and torch.equal(got, mask):
            hint = ("You changed only the keys and values. In self-attention the changed token is also a query: "
                    "run attention on the changed x as queries, keys and values.")
        elif not got.any():
            hint = "Nothing changed at all: did you run attention on the changed copy of x (not on x)?"
        elif mask is not None and got.all():
            hint = "Every output changed although some keys are masked: pass the mask to the attention."
        else:
            hint = f"Expected {show(expected)}, got {show(got)}."
        raise CheckFailure(f"With {name}: {hint}")
    passed("your measurement matches the dependence read off autograd's Jacobian (no mask, causal, random)")
