"""Checks for chapter 02: padding masks, causal masks, and measuring what a mask hides."""

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
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
    s = distinct_sizes(seed, AXES, span=8, fixed=(2, 3, 4, 7, 5))
    # Queries are the last q_len of k_len positions (cross-attention and caching both need k_len > q_len).
    s["q_len"], s["k_len"] = sorted((s["q_len"], s["k_len"]))
    return s


def _grid(mask: Tensor) -> str:
    """A small boolean matrix as rows of 0 and 1 (``show`` prints only 12 elements)."""
    return "\n".join("    " + " ".join("1" if v else "0" for v in row.tolist()) for row in mask)


def _keys(row: Tensor, noun: str = "keys") -> str:
    """The True positions of a boolean row, as ranges: 'keys 0..5', 'keys 0..2, 4', 'no key'."""
    on = torch.nonzero(row).flatten().tolist()
    if not on:
        return f"no {noun.removesuffix('s')}"
    runs, start = [], on[0]
    for a, b in zip(on, [*on[1:], None], strict=True):
        if b != a + 1:
            runs.append(f"{start}..{a}" if a > start else f"{a}")
            start = b
    return f"{noun} {', '.join(runs)}"


def _compare_grids(expected: Tensor, got: Tensor, row: str, col: str, verb: str, verbs: str) -> str:
    """Name the first wrong row ('query 2 should read keys 0..5; yours reads keys 0..6'), then
    print both matrices as 0/1 grids when they are small enough to read."""
    wrong = (expected != got).any(-1).nonzero().flatten()
    i = int(wrong[0]) if len(wrong) else 0
    message = f"{row} {i} should {verb} {_keys(expected[i], col)}; yours {verbs} {_keys(got[i], col)}."
    if expected.shape[-2] <= 10 and expected.shape[-1] <= 10:
        message += f"\nExpected (1 = True):\n{_grid(expected)}\nYours:\n{_grid(got)}"
    return message


def _named(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={n}" for a, n in sizes.items())


def _mask_difference(got: Tensor, expected: Tensor, sizes: dict[str, int]) -> str:
    """How many entries of a boolean mask are wrong, and the largest difference (1 for a bool), on which sizes."""
    wrong = int((got != expected).sum()) if got.shape == expected.shape else None
    count = f"{wrong} of {expected.numel()} entries wrong, " if wrong is not None else ""
    return count + difference(got.double(), expected.double(), sizes)


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


def _shape_mistake(shape: tuple[int, ...], batch: int, k_len: int) -> str:
    """Why a padding mask of this shape is wrong: the usual misplaced axes first, then the general rule."""
    if batch == 1 and len(shape) < 4 and shape == (1, 1, 1, k_len)[4 - len(shape):]:
        return ("squeeze() without an axis dropped the batch axis, which is 1 here: squeeze only the axis you mean, "
                'or build the mask with rearrange(tokens != pad_id, "batch k_len -> batch 1 1 k_len").')
    named = {(batch, k_len): SHAPE_HINT,
             (batch, 1, k_len): ("With three axes (batch, 1, k_len) the mask lines batch up with the heads axis of "
                                 "the scores (batch, heads, q_len, k_len): add both 1-axes, (batch, 1, 1, k_len)."),
             (batch, 1, k_len, 1): ("Your mask puts k_len on the q_len axis (batch, 1, k_len, 1): padding hides keys, "
                                    "the last axis of the scores, so k_len goes last: (batch, 1, 1, k_len)."),
             (batch, k_len, 1, 1): ("Your mask puts k_len on the heads axis (batch, k_len, 1, 1): padding hides keys, "
                                    "the last axis of the scores, so k_len goes last: (batch, 1, 1, k_len)."),
             (1, 1, batch, k_len): ("Your mask puts batch on the q_len axis (1, 1, batch, k_len): batch goes first, "
                                    "(batch, 1, 1, k_len).")}
    return named.get(shape, SHAPE_HINT)


def _padding_result(fn: Callable[..., Any], tokens: Tensor, pad_id: int) -> Tensor:
    batch, k_len = tokens.shape
    try:
        mask = call(fn, tokens, pad_id)
    except CheckFailure as failure:
        if raised_error(failure) == "TypeCheckError" and "return value" in failure.text:
            squeezed = (" With batch=1, a squeeze() without an axis drops the batch axis too: squeeze only the "
                        "axis you mean." if batch == 1 else "")
            raise CheckFailure(f"padding_mask returned a mask of the wrong shape. {SHAPE_HINT} (Here batch={batch}, "
                               f"k_len={k_len}.){squeezed}") from None
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
            + _shape_mistake(tuple(mask.shape), batch, k_len)
        )
    expected = (tokens != pad_id).view(batch, 1, 1, k_len)
    if not torch.equal(mask, expected):
        raise CheckFailure(_diagnose_padding(mask.view(batch, k_len), tokens, pad_id))
    return mask


def _padding_variants(tokens: Tensor, pad_id: int) -> dict[str, Tensor]:
    """The (batch, k_len) masks of the usual mistakes, keyed by the hint that names each."""
    expected = tokens != pad_id
    variants = {"Your padding mask is inverted: it is True on the padding. The course's masks say True = "
                "'may attend', so real tokens are True and padding is False (tokens != pad_id).": ~expected}
    if pad_id != 0:
        variants[f"Your mask treats token id 0 as padding, but here pad_id={pad_id} and 0 is a real word: "
                 "compare with pad_id, not with 0."] = tokens != 0
    variants[f"Your mask is tokens > pad_id: it marks real tokens whose id is below pad_id={pad_id} "
             "(id 0, for one) as padding. Token ids are names, not sizes: compare with tokens != pad_id."] = (
        tokens > pad_id)
    return variants


def _diagnose_padding(mask: Tensor, tokens: Tensor, pad_id: int) -> str:
    """Why a (batch, k_len) boolean mask differs from tokens != pad_id: a named mistake, or the first wrong
    sentence; either way how many entries are wrong, on which sizes."""
    expected = tokens != pad_id
    sizes = dict(zip(("batch", "k_len"), tokens.shape, strict=True))
    found = _mask_difference(mask, expected, sizes)
    for hint, variant in _padding_variants(tokens, pad_id).items():
        if torch.equal(mask, variant):
            return f"{hint} ({found}, pad_id={pad_id})"
    return (f"Your padding mask differs from tokens != pad_id (pad_id={pad_id}; {found}). "
            + _compare_grids(expected, mask, "Sentence", "positions", "keep", "keeps")
            + f"\nTokens:\n{_grid_ids(tokens)}")


def _grid_ids(tokens: Tensor) -> str:
    return "\n".join("    " + " ".join(f"{t:2d}" for t in row.tolist()) for row in tokens)


@check
def check_padding_mask(fn: Callable[..., Any], seed: int = 0, pad_id: int = 0) -> None:
    """padding_mask is boolean, (batch, 1, 1, k_len), True on real tokens and False on padding; batch=1 too."""
    tokens = _tokens(seed, pad_id)
    _padding_result(fn, tokens, pad_id)
    _padding_result(fn, tokens[:1], pad_id)  # one sentence, padded: no axis of size 1 may go
    passed(f"padding mask: (batch, 1, 1, k_len), True on real tokens, False where tokens == {pad_id} (batch=1 too)")


@check
def check_padding_in_attention(fn: Callable[..., Any], seed: int = 0, pad_id: int = 0,
                               dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention with your mask equals attention that ignores exactly the padded source tokens (batch=1 too)."""
    s = _sizes(seed)
    tokens = _tokens(seed, pad_id)
    for sample in (tokens, tokens[:1]):
        _padding_attention(fn, sample, pad_id, s["heads"], s["d_k"], seed, dtype)
    passed("cross-attention with your mask equals attention that ignores exactly the padded source tokens")


def _padding_attention(fn: Callable[..., Any], tokens: Tensor, pad_id: int, heads: int, d_k: int, seed: int,
                       dtype: torch.dtype) -> None:
    batch, k_len = tokens.shape
    # q_len == batch on purpose: a flat (batch, k_len) mask then broadcasts against the scores
    # (batch, heads, q_len, k_len) without an error, lining batch up with q_len, and only the
    # numbers can tell.
    q_len = batch
    sizes = {"batch": batch, "heads": heads, "q_len": q_len, "k_len": k_len, "d_k": d_k}
    mask = call(fn, tokens, pad_id)
    if type(mask) is not Tensor:
        raise CheckFailure(f"padding_mask should return a torch.Tensor, got {kind(mask)}.")
    g = torch.Generator().manual_seed(seed + 1)
    # Target queries read the padded source sentence: the encoder-decoder's cross-attention.
    q = torch.randn(batch, heads, q_len, d_k, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, heads, k_len, d_k, generator=g, dtype=dtype) for _ in range(2))
    # The oracle: what nn.MultiheadAttention(..., key_padding_mask=tokens == pad_id) does, in the
    # course's convention (True = may attend).
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=(tokens != pad_id).view(batch, 1, 1, k_len))
    try:
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    except Exception as error:  # a shape that does not broadcast, or a dtype attention refuses
        raise CheckFailure(
            f"Your mask of shape {tuple(mask.shape)} and dtype {mask.dtype} cannot be the mask of attention "
            f"whose scores have shape ({_named({a: sizes[a] for a in ('batch', 'heads', 'q_len', 'k_len')})}): "
            f"{str(error).rstrip('. ')}. "
            + (_shape_mistake(tuple(mask.shape), batch, k_len) if mask.dtype == torch.bool
               else "Return a boolean mask (True = may attend): tokens != pad_id.")
        ) from None
    if close(output, expected, dtype):
        return
    what = ("Cross-attention with your mask differs from attention that ignores exactly the padded keys "
            f"({difference(output, expected, sizes)}).")
    if mask.dtype != torch.bool:
        raise CheckFailure(
            f"{what} Your mask has dtype {mask.dtype}: attention adds a float mask to the scores instead of "
            "hiding keys, so padding still gets weight. Return a boolean mask (tokens != pad_id)."
        )
    if tuple(mask.shape) == (batch, k_len):
        raise CheckFailure(
            f"{what} Your mask has shape (batch, k_len) = {tuple(mask.shape)}: it broadcast without an error "
            f"because here q_len = batch = {batch}, so query i of every sentence got sentence i's padding. "
            + SHAPE_HINT
        )
    if mask.numel() == batch * k_len and tuple(mask.shape) == (batch, 1, 1, k_len):
        raise CheckFailure(f"{what} " + _diagnose_padding(mask.reshape(batch, k_len), tokens, pad_id))
    raise CheckFailure(
        f"{what} Your mask has shape {tuple(mask.shape)}; it should be (batch={batch}, 1, 1, k_len={k_len}). "
        + _shape_mistake(tuple(mask.shape), batch, k_len)
    )


# -- exercise 2: causal_mask -------------------------------------------------------------

def _causal_result(fn: Callable[..., Any], q_len: int, k_len: int | None = None) -> Tensor:
    args = (q_len,) if k_len is None else (q_len, k_len)
    try:
        mask = call(fn, *args)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        text = str(failure).splitlines()[0].rstrip(" .")
        if "tril: input tensor must have at least 2 dimensions" in text or \
                "triu: input tensor must have at least 2 dimensions" in text:
            # PyTorch's own words: the tensor whose triangle was taken has one axis.
            raise CheckFailure(
                f"{text}. The tensor you take the triangle of has fewer than two axes: create it with both "
                "lengths, torch.ones(q_len, k_len, dtype=torch.bool), then take its tril."
            ) from None
        if k_len is None:
            try:
                explicit = call(fn, q_len, q_len)
            except CheckFailure:
                raise failure from None
            if type(explicit) is Tensor and torch.equal(explicit, torch.ones(q_len, q_len, dtype=torch.bool).tril()):
                raise CheckFailure(
                    f"{text}. causal_mask({q_len}, {q_len}) gives the right mask, so only k_len left out fails: "
                    "with k_len=None it must default to q_len. Look at how k_len is set when it is None, before "
                    "it is compared or used."
                ) from None
        raise
    rows, cols = q_len, q_len if k_len is None else k_len
    if type(mask) is not Tensor:
        raise CheckFailure(f"causal_mask should return a torch.Tensor, got {kind(mask)}.")
    if tuple(mask.shape) != (rows, cols):
        raise CheckFailure(
            f"causal_mask{args} should have shape (q_len={rows}, k_len={cols}), got {tuple(mask.shape)}."
            + (" With k_len left out, it must default to q_len." if k_len is None else "")
            + (" Yours is transposed: rows are queries, columns are keys." if tuple(mask.shape) == (cols, rows)
               and rows != cols else "")
        )
    if mask.dtype != torch.bool:
        lower = torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)
        additive = mask.is_floating_point() and bool(((mask == 0) == lower).all()
                                                      and (mask[~lower] == -torch.inf).all())
        raise CheckFailure(
            f"causal_mask should be boolean (True = may attend), got dtype {mask.dtype}"
            + (": yours is the additive mask of PyTorch's generate_square_subsequent_mask (0 where a query may "
               "attend, -inf where not), which attention adds to the scores. The course's masks are boolean and "
               "choose instead: True on and below the diagonal." if additive else
               ". Create it with dtype=torch.bool (torch.ones(..., dtype=torch.bool).tril(...)).")
        )
    return mask


def _diagnose_causal(mask: Tensor, expected: Tensor) -> str:
    """Name the mistake whose mask equals the student's, or show the first wrong row; either way say how many
    entries are wrong, on which sizes."""
    q_len, k_len = expected.shape
    found = _mask_difference(mask, expected, {"q_len": q_len, "k_len": k_len})
    ones = torch.ones(q_len, k_len, dtype=torch.bool)
    offset = k_len - q_len
    # The most specific hints first: on small masks several mistakes can coincide.
    hints = []
    if offset:
        hints += [
            (ones.tril(), (
                "Your mask is aligned to the first key, not the last: with k_len > q_len the queries are the "
                f"last q_len positions, so query i may read keys up to i + k_len - q_len (tril(diagonal={offset}))."
            )),
            (ones.tril(-offset), (
                f"Your diagonal has the wrong sign: tril(diagonal=q_len - k_len) = tril({-offset}) moves the "
                "triangle away from the keys. The queries are the last q_len positions, so query i may read "
                f"keys up to i + k_len - q_len: tril(diagonal=k_len - q_len) = tril({offset})."
            )),
            (ones.tril(-1), (
                "Your mask is aligned to the first key and hides the diagonal: with k_len > q_len query i may read "
                f"keys up to i + k_len - q_len, its own position included (tril(diagonal={offset}))."
            )),
        ]
    hints += [
        (ones.tril(offset + 1), (
            f"Your diagonal is off by one: each query also reads the key just after its own position, a "
            f"future token. Keep tril(diagonal={offset})" + (" (k_len - q_len)." if offset else ".")
        )),
        (ones.tril(offset - 1), "Your mask hides the diagonal (j < i instead of j <= i): a token may attend to "
                                "itself."),
        (ones.triu(offset), "Your mask is the upper triangle: it lets each query read the future. "
                            "Keep the lower triangle (tril, not triu)."),
        (~expected, "Your mask is inverted: it is True on the future. True must mean 'may attend' "
                    "(the past and the token itself), so keep the lower triangle."),
        (torch.ones_like(expected), (
            "Your mask is True everywhere: it hides nothing, so every query reads the future. tril(diagonal=d) "
            f"keeps every entry once d ≥ k_len - 1 = {k_len - 1}; the diagonal must be k_len - q_len = {offset}."
        )),
    ]
    for wrong, hint in hints:
        if torch.equal(mask, wrong):
            return f"{hint} ({found})"
    return f"{found}. " + _compare_grids(expected, mask, "Query", "keys", "read", "reads")


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
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if not close(with_mask, expected, torch.float64):
        sizes = {"batch": s["batch"], "heads": s["heads"], "q_len": n, "k_len": n, "d_k": s["d_k"]}
        raise CheckFailure("Attention with your mask differs from scaled_dot_product_attention(..., is_causal=True) "
                           f"({difference(with_mask, expected, sizes)}).")
    passed("causal_mask(n) equals nn.Transformer.generate_square_subsequent_mask(n) == 0 and is_causal=True")


@check(forbid=BUILT_IN_CAUSAL)
def check_causal_mask_offset(fn: Callable[..., Any], seed: int = 0) -> None:
    """With k_len > q_len the triangle is aligned to the last key: cached decoding equals full decoding."""
    s = _sizes(seed)
    k_len = s["k_len"]
    # q_len = 1 last: a single row cannot tell a sign slip from an inverted mask.
    masks = {}
    for q_len in (s["q_len"], k_len - 1, 1):
        masks[q_len] = mask = _causal_result(fn, q_len, k_len)
        # PyTorch's lower-right causal bias: the queries are the last q_len positions.
        expected = causal_lower_right(q_len, k_len)._materialize()
        if not torch.equal(mask, expected):
            raise CheckFailure(f"causal_mask({q_len}, {k_len}): {_diagnose_causal(mask, expected)}")
    q_len, mask = s["q_len"], masks[s["q_len"]]
    # The defining property: the last q_len queries, reading all k_len keys (cached ones included)
    # through the mask, give the last q_len rows of full causal attention over the k_len positions.
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s["batch"], s["heads"], k_len, s["d_k"], generator=g, dtype=torch.float64)
               for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = F.scaled_dot_product_attention(q[..., -q_len:, :], k, v, attn_mask=mask)
    if not close(last, full[..., -q_len:, :], torch.float64):
        sizes = {"batch": s["batch"], "heads": s["heads"], "q_len": q_len, "k_len": k_len, "d_k": s["d_k"]}
        raise CheckFailure("The last queries with your mask differ from the last rows of full causal attention "
                           f"({difference(last, full[..., -q_len:, :], sizes)}).")
    passed("causal_mask(q_len, k_len) is aligned to the last key: the last q_len rows of full causal attention")


def _expect_value_error(fn: Callable[..., Any], args: tuple, why: str) -> None:
    shown = ", ".join(map(repr, args))
    try:
        result = call(fn, *args)
    except CheckFailure as failure:
        if raised_error(failure) == "ValueError":
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


def _measure(fn: Callable[..., Any], x: Tensor, mask: Tensor | None, seq: int, d_model: int) -> Tensor:
    """The student's (seq, seq) matrix; a wrong type, dtype or shape, or a loop that runs past the last token,
    says so."""
    try:
        got = call(fn, x, mask) if mask is not None else call(fn, x)
    except CheckFailure as failure:
        text = str(failure)
        returned = re.search(r"Actual value: \w+\[(\d+),(\d+)\]", text)
        if "return value" in text and returned:
            raise CheckFailure(_shape_problem((int(returned[1]), int(returned[2])), seq, d_model)) from None
        if f"index {seq} is out of bounds for dimension 0 with size {seq}" in text:
            raise CheckFailure(
                f"{text.splitlines()[0].rstrip(' .')}. Your loop reaches j = seq = {seq}, one past the last token: "
                f"the tokens are x[0] ... x[seq - 1], so let j run over range(seq)."
            ) from None
        raise
    if type(got) is not Tensor or got.dtype != torch.bool or tuple(got.shape) != (seq, seq):
        if type(got) is Tensor and got.dtype == torch.bool:
            raise CheckFailure(_shape_problem(tuple(got.shape), seq, d_model))
        what = f"a {dtype_name(got.dtype)} tensor of shape {tuple(got.shape)}" \
            if type(got) is Tensor else kind(got)
        raise CheckFailure(
            f"which_outputs_change should return a boolean tensor of shape (seq={seq}, seq={seq}), got {what}."
        )
    return got


def _shape_problem(shape: tuple[int, ...], seq: int, d_model: int) -> str:
    message = f"which_outputs_change should return a boolean tensor of shape (seq={seq}, seq={seq}), got shape {shape}."
    if seq != d_model and shape in ((seq, d_model), (d_model, seq)):
        message += (f" One of its axes has d_model={d_model} entries, one per feature of x rather than one per "
                    "token: look at where the number of tokens is read. x is (seq, d_model), so seq = x.shape[0] "
                    "(axis 0 holds the tokens, axis 1 the features).")
    elif len(shape) == 2 and shape[0] == seq and abs(shape[1] - seq) == 1:
        side = "fewer" if shape[1] < seq else "more"
        message += (f" Your matrix has {shape[1]} columns, one {side} than the {seq} tokens: it needs one column per "
                    "changed token j, for every j in range(seq), the last token included.")
    return message


def _changes_in_place(fn: Callable[..., Any], x: Tensor, mask: Tensor | None) -> bool:
    """Does the student's function change the x it is given? Run through :func:`call`, so that the answer is
    recorded and replayed with the rest."""
    given = x.clone()
    try:
        fn(given) if mask is None else fn(given, mask)
    except Exception:  # noqa: BLE001 - the first call reported what it raised; here only x matters
        return False
    return not torch.equal(given, x)


def _cumulative_changes(x: Tensor, mask: Tensor | None) -> Tensor:
    """What a measurement that changes x in place finds: token j's change on top of those of tokens 0 ... j - 1,
    compared with the run before any change."""
    base = F.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    changed, columns = x.clone(), []
    for j in range(x.shape[0]):
        changed[j] += 1.0
        out = F.scaled_dot_product_attention(changed, changed, changed, attn_mask=mask)
        columns.append((out != base).any(-1))
    return torch.stack(columns, dim=1)


def _inverted_elsewhere(fn: Callable[..., Any], x: Tensor, causal: Tensor, seq: int, d_model: int) -> bool:
    """Is the student's matrix with a causal mask the opposite of the expected one too? Without a mask every
    output changes, so an inverted matrix there is all False, like a change that reached nothing; a causal mask
    tells them apart."""
    try:
        got = _measure(fn, x.clone(), causal, seq, d_model)
    except CheckFailure:
        return False
    return torch.equal(got, ~_expected_changes(x.double(), causal))


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
        got = _measure(fn, x.clone(), mask, seq, d_model)  # a copy: a function that changes x in place keeps x
        expected = _expected_changes(x.double(), mask)
        if torch.equal(got, expected):
            continue
        if call(_changes_in_place, fn, x, mask):
            cumulative = _cumulative_changes(x.double(), mask)
            hint = ("Your function changed x in place: after the call, the x it was given differs from before. "
                    + ("Each change then stays for the next tokens (your matrix equals the one where token j's change "
                       "adds to those of tokens 0 ... j - 1). "
                       if torch.equal(got, cumulative) else "")
                    + "Change a copy: changed_x = x.clone().")
        elif torch.equal(got, expected.T):
            hint = "Your matrix is transposed: row i is output i, column j is the input you changed."
        elif mask is not None and torch.equal(got, mask):
            hint = ("You changed only the keys and values. In self-attention the changed token is also a query: "
                    "run attention on the changed x as queries, keys and values.")
        elif torch.equal(got, torch.eye(seq, dtype=torch.bool)):
            hint = ("You changed only the queries: then output i changes only when token i does. Token j is also "
                    "a key and a value that other queries read: run attention on the changed x as queries, "
                    "keys and values.")
        elif torch.equal(got, ~expected) and _inverted_elsewhere(fn, x, causal, seq, d_model):
            hint = ("Your matrix is inverted, here and with a causal mask: True exactly where an output did not "
                    "change, so it marks the outputs equal to the unchanged run. changed[i, j] must be True where "
                    "output i moved: out != base, not out == base.")
        elif not got.any():
            hint = ("No output moved for any changed token, so the attention never saw a change. Look at the change "
                    "itself (1.0 added to every entry of x[j], on a copy of x) and at the tensor the attention runs "
                    "on (that changed copy, as queries, keys and values).")
        elif mask is not None and got.all():
            hint = ("Every output changed although the mask hides some keys from some queries: look at whether the "
                    "mask reaches the attention (pass the mask to scaled_dot_product_attention).")
        else:
            hint = ("Row i says which changed inputs j reach output i. "
                    + _compare_grids(expected, got, "Output", "inputs", "change with", "changes with"))
        found = _mask_difference(got, expected, {"seq": seq, "d_model": d_model})
        raise CheckFailure(f"With {name} ({found}): {hint}")
    passed("your measurement matches the dependence read off autograd's Jacobian (no mask, causal, random)")
