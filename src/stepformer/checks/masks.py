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
from stepformer.checks._messages import marked, t, tr

AXES = ("batch", "heads", "q_len", "k_len", "d_k")
# What exercise 2 asks students to write themselves.
BUILT_IN_CAUSAL = {
    "torch.nn.attention.bias.causal_lower_right": marked("PyTorch's causal mask"),
    "torch.nn.attention.bias.causal_upper_left": marked("PyTorch's causal mask"),
    "torch.nn.modules.transformer._generate_square_subsequent_mask": marked("PyTorch's causal mask"),
}
# What exercise 3 asks students to measure by changing tokens themselves.
BUILT_IN_JACOBIAN = {
    "torch.autograd.functional.jacobian": marked("autograd's Jacobian"),
    "torch.func.jacrev": marked("autograd's Jacobian"),
    "torch.func.jacfwd": marked("autograd's Jacobian"),
}
SHAPE_HINT = marked(
    "A padding mask must have shape (batch, 1, 1, k_len) so that it broadcasts against the scores "
    "(batch, heads, q_len, k_len): a (batch, k_len) mask would line batch up with q_len. "
    'Use rearrange(..., "batch k_len -> batch 1 1 k_len").'
)
# The first wrong row of a 0/1 matrix, in each exercise's words, one sentence per case: (both rows hold some
# True, only the expected one does, only yours does, neither does). {expected} and {got} are ranges: "0..5, 7".
ROW_MESSAGES = {
    "sentence": (
        marked("Sentence {row} should keep positions {expected}; yours keeps positions {got}."),
        marked("Sentence {row} should keep positions {expected}; yours keeps no position."),
        marked("Sentence {row} should keep no position; yours keeps positions {got}."),
        marked("Sentence {row} should keep no position; yours keeps no position."),
    ),
    "query": (
        marked("Query {row} should read keys {expected}; yours reads keys {got}."),
        marked("Query {row} should read keys {expected}; yours reads no key."),
        marked("Query {row} should read no key; yours reads keys {got}."),
        marked("Query {row} should read no key; yours reads no key."),
    ),
    "output": (
        marked("Output {row} should change with inputs {expected}; yours changes with inputs {got}."),
        marked("Output {row} should change with inputs {expected}; yours changes with no input."),
        marked("Output {row} should change with no input; yours changes with inputs {got}."),
        marked("Output {row} should change with no input; yours changes with no input."),
    ),
}


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis changes a shape and cannot pass."""
    s = distinct_sizes(seed, AXES, span=8, fixed=(2, 3, 4, 7, 5))
    # Queries are the last q_len of k_len positions (cross-attention and caching both need k_len > q_len).
    s["q_len"], s["k_len"] = sorted((s["q_len"], s["k_len"]))
    return s


def _grid(mask: Tensor) -> str:
    """A small boolean matrix as rows of 0 and 1 (``show`` prints only 12 elements)."""
    return "\n".join("    " + " ".join("1" if v else "0" for v in row.tolist()) for row in mask)


def _runs(row: Tensor) -> str:
    """The True positions of a boolean row, as ranges: '0..5', '0..2, 4'; '' when there is none."""
    on = torch.nonzero(row).flatten().tolist()
    if not on:
        return ""
    runs, start = [], on[0]
    for a, b in zip(on, [*on[1:], None], strict=True):
        if b != a + 1:
            runs.append(f"{start}..{a}" if a > start else f"{a}")
            start = b
    return ", ".join(runs)


def _compare_grids(expected: Tensor, got: Tensor, rows: str) -> str:
    """Name the first wrong row ('Query 2 should read keys 0..5; yours reads keys 0..6', ``rows`` a key of
    :data:`ROW_MESSAGES`), then print both matrices as 0/1 grids when they are small enough to read."""
    wrong = (expected != got).any(-1).nonzero().flatten()
    i = int(wrong[0]) if len(wrong) else 0
    should, have = _runs(expected[i]), _runs(got[i])
    template = ROW_MESSAGES[rows][(0 if should else 2) + (0 if have else 1)]
    message = tr(template, row=i, expected=should, got=have)
    if expected.shape[-2] <= 10 and expected.shape[-1] <= 10:
        message += t("\nExpected (1 = True):\n{expected}\nYours:\n{got}", expected=_grid(expected), got=_grid(got))
    return message


def _named(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={n}" for a, n in sizes.items())


def _mask_difference(got: Tensor, expected: Tensor, sizes: dict[str, int]) -> str:
    """How many entries of a boolean mask are wrong, and the largest difference (1 for a bool), on which sizes."""
    found = difference(got.double(), expected.double(), sizes)
    if got.shape != expected.shape:
        return found
    return t("{wrong} of {total} entries wrong, {difference}", wrong=int((got != expected).sum()),
             total=expected.numel(), difference=found)


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
        return t("squeeze() without an axis dropped the batch axis, which is 1 here: squeeze only the axis you mean, "
                 'or build the mask with rearrange(tokens != pad_id, "batch k_len -> batch 1 1 k_len").')
    named = {(batch, k_len): tr(SHAPE_HINT),
             (batch, 1, k_len): t("With three axes (batch, 1, k_len) the mask lines batch up with the heads axis of "
                                  "the scores (batch, heads, q_len, k_len): add both 1-axes, (batch, 1, 1, k_len)."),
             (batch, 1, k_len, 1): t("Your mask puts k_len on the q_len axis (batch, 1, k_len, 1): padding hides "
                                     "keys, the last axis of the scores, so k_len goes last: (batch, 1, 1, k_len)."),
             (batch, k_len, 1, 1): t("Your mask puts k_len on the heads axis (batch, k_len, 1, 1): padding hides "
                                     "keys, the last axis of the scores, so k_len goes last: (batch, 1, 1, k_len)."),
             (1, 1, batch, k_len): t("Your mask puts batch on the q_len axis (1, 1, batch, k_len): batch goes first, "
                                     "(batch, 1, 1, k_len).")}
    return named.get(shape, tr(SHAPE_HINT))


def _padding_result(fn: Callable[..., Any], tokens: Tensor, pad_id: int) -> Tensor:
    batch, k_len = tokens.shape
    try:
        mask = call(fn, tokens, pad_id)
    except CheckFailure as failure:
        if raised_error(failure) == "TypeCheckError" and "return value" in failure.text:
            squeezed = t(" With batch=1, a squeeze() without an axis drops the batch axis too: squeeze only the "
                         "axis you mean.") if batch == 1 else ""
            raise CheckFailure(t("padding_mask returned a mask of the wrong shape. {hint} (Here batch={batch}, "
                                 "k_len={k_len}.){squeezed}", hint=tr(SHAPE_HINT), batch=batch, k_len=k_len,
                                 squeezed=squeezed)) from None
        raise
    if type(mask) is not Tensor:
        raise CheckFailure(t("padding_mask should return a torch.Tensor, got {kind}.", kind=kind(mask)))
    if mask.dtype != torch.bool:
        raise CheckFailure(t(
            "padding_mask should return a boolean mask (True = may attend), got dtype {dtype}: "
            "a comparison such as tokens != pad_id gives one.", dtype=mask.dtype
        ))
    if tuple(mask.shape) != (batch, 1, 1, k_len):
        raise CheckFailure(t(
            "padding_mask should have shape (batch={batch}, 1, 1, k_len={k_len}), got {shape}. {hint}",
            batch=batch, k_len=k_len, shape=tuple(mask.shape), hint=_shape_mistake(tuple(mask.shape), batch, k_len)
        ))
    expected = (tokens != pad_id).view(batch, 1, 1, k_len)
    if not torch.equal(mask, expected):
        raise CheckFailure(_diagnose_padding(mask.view(batch, k_len), tokens, pad_id))
    return mask


def _padding_variants(tokens: Tensor, pad_id: int) -> list[tuple[str, Tensor]]:
    """The (batch, k_len) masks of the usual mistakes, each with the hint that names it."""
    expected = tokens != pad_id
    variants = [(t("Your padding mask is inverted: it is True on the padding. The course's masks say True = "
                   "'may attend', so real tokens are True and padding is False (tokens != pad_id)."), ~expected)]
    if pad_id != 0:
        variants.append((t("Your mask treats token id 0 as padding, but here pad_id={pad_id} and 0 is a real word: "
                           "compare with pad_id, not with 0.", pad_id=pad_id), tokens != 0))
    variants.append((t("Your mask is tokens > pad_id: it marks real tokens whose id is below pad_id={pad_id} "
                       "(id 0, for one) as padding. Token ids are names, not sizes: compare with tokens != pad_id.",
                       pad_id=pad_id), tokens > pad_id))
    return variants


def _diagnose_padding(mask: Tensor, tokens: Tensor, pad_id: int) -> str:
    """Why a (batch, k_len) boolean mask differs from tokens != pad_id: a named mistake, or the first wrong
    sentence; either way how many entries are wrong, on which sizes."""
    expected = tokens != pad_id
    sizes = dict(zip(("batch", "k_len"), tokens.shape, strict=True))
    found = _mask_difference(mask, expected, sizes)
    for hint, variant in _padding_variants(tokens, pad_id):
        if torch.equal(mask, variant):
            return t("{hint} ({found}, pad_id={pad_id})", hint=hint, found=found, pad_id=pad_id)
    return t("Your padding mask differs from tokens != pad_id (pad_id={pad_id}; {found}). {rows}\nTokens:\n{tokens}",
             pad_id=pad_id, found=found, rows=_compare_grids(expected, mask, "sentence"), tokens=_grid_ids(tokens))


def _grid_ids(tokens: Tensor) -> str:
    return "\n".join("    " + " ".join(f"{i:2d}" for i in row.tolist()) for row in tokens)


@check
def check_padding_mask(fn: Callable[..., Any], seed: int = 0, pad_id: int = 0) -> None:
    """padding_mask is boolean, (batch, 1, 1, k_len), True on real tokens and False on padding; batch=1 too."""
    tokens = _tokens(seed, pad_id)
    _padding_result(fn, tokens, pad_id)
    _padding_result(fn, tokens[:1], pad_id)  # one sentence, padded: no axis of size 1 may go
    passed(t("padding mask: (batch, 1, 1, k_len), True on real tokens, False where tokens == {pad_id} (batch=1 too)",
             pad_id=pad_id))


@check
def check_padding_in_attention(fn: Callable[..., Any], seed: int = 0, pad_id: int = 0,
                               dtype: torch.dtype = torch.float32) -> None:
    """Cross-attention with your mask equals attention that ignores exactly the padded source tokens (batch=1 too)."""
    s = _sizes(seed)
    tokens = _tokens(seed, pad_id)
    for sample in (tokens, tokens[:1]):
        _padding_attention(fn, sample, pad_id, s["heads"], s["d_k"], seed, dtype)
    passed(t("cross-attention with your mask equals attention that ignores exactly the padded source tokens"))


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
        raise CheckFailure(t("padding_mask should return a torch.Tensor, got {kind}.", kind=kind(mask)))
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
        raise CheckFailure(t(
            "Your mask of shape {shape} and dtype {dtype} cannot be the mask of attention whose scores have shape "
            "({scores}): {error}. {hint}", shape=tuple(mask.shape), dtype=mask.dtype,
            scores=_named({a: sizes[a] for a in ("batch", "heads", "q_len", "k_len")}),
            error=str(error).rstrip(". "),
            hint=(_shape_mistake(tuple(mask.shape), batch, k_len) if mask.dtype == torch.bool
                  else t("Return a boolean mask (True = may attend): tokens != pad_id."))
        )) from None
    if close(output, expected, dtype):
        return
    what = t("Cross-attention with your mask differs from attention that ignores exactly the padded keys "
             "({found}).", found=difference(output, expected, sizes))
    if mask.dtype != torch.bool:
        raise CheckFailure(t(
            "{what} Your mask has dtype {dtype}: attention adds a float mask to the scores instead of "
            "hiding keys, so padding still gets weight. Return a boolean mask (tokens != pad_id).",
            what=what, dtype=mask.dtype
        ))
    if tuple(mask.shape) == (batch, k_len):
        raise CheckFailure(t(
            "{what} Your mask has shape (batch, k_len) = {shape}: it broadcast without an error "
            "because here q_len = batch = {batch}, so query i of every sentence got sentence i's padding. {hint}",
            what=what, shape=tuple(mask.shape), batch=batch, hint=tr(SHAPE_HINT)
        ))
    if mask.numel() == batch * k_len and tuple(mask.shape) == (batch, 1, 1, k_len):
        raise CheckFailure(t("{what} {diagnosis}", what=what,
                             diagnosis=_diagnose_padding(mask.reshape(batch, k_len), tokens, pad_id)))
    raise CheckFailure(t(
        "{what} Your mask has shape {shape}; it should be (batch={batch}, 1, 1, k_len={k_len}). {hint}",
        what=what, shape=tuple(mask.shape), batch=batch, k_len=k_len,
        hint=_shape_mistake(tuple(mask.shape), batch, k_len)
    ))


# -- exercise 2: causal_mask -------------------------------------------------------------

def _causal_result(fn: Callable[..., Any], q_len: int, k_len: int | None = None) -> Tensor:
    args = (q_len,) if k_len is None else (q_len, k_len)
    try:
        mask = call(fn, *args)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        text = str(failure).splitlines()[0].rstrip(" .")
        raised = (failure.text.splitlines() or [""])[0]
        if "tril: input tensor must have at least 2 dimensions" in raised or \
                "triu: input tensor must have at least 2 dimensions" in raised:
            # PyTorch's own words: the tensor whose triangle was taken has one axis.
            raise CheckFailure(t(
                "{raised}. The tensor you take the triangle of has fewer than two axes: create it with both "
                "lengths, torch.ones(q_len, k_len, dtype=torch.bool), then take its tril.", raised=text
            )) from None
        if k_len is None:
            try:
                explicit = call(fn, q_len, q_len)
            except CheckFailure:
                raise failure from None
            if type(explicit) is Tensor and torch.equal(explicit, torch.ones(q_len, q_len, dtype=torch.bool).tril()):
                raise CheckFailure(t(
                    "{raised}. causal_mask({q_len}, {q_len}) gives the right mask, so only k_len left out fails: "
                    "with k_len=None it must default to q_len. Look at how k_len is set when it is None, before "
                    "it is compared or used.", raised=text, q_len=q_len
                )) from None
        raise
    rows, cols = q_len, q_len if k_len is None else k_len
    if type(mask) is not Tensor:
        raise CheckFailure(t("causal_mask should return a torch.Tensor, got {kind}.", kind=kind(mask)))
    if tuple(mask.shape) != (rows, cols):
        raise CheckFailure(t(
            "causal_mask{args} should have shape (q_len={rows}, k_len={cols}), got {shape}.{default}{transposed}",
            args=args, rows=rows, cols=cols, shape=tuple(mask.shape),
            default=t(" With k_len left out, it must default to q_len.") if k_len is None else "",
            transposed=(t(" Yours is transposed: rows are queries, columns are keys.")
                        if tuple(mask.shape) == (cols, rows) and rows != cols else "")
        ))
    if mask.dtype != torch.bool:
        lower = torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)
        additive = mask.is_floating_point() and bool(((mask == 0) == lower).all()
                                                      and (mask[~lower] == -torch.inf).all())
        if additive:
            raise CheckFailure(t(
                "causal_mask should be boolean (True = may attend), got dtype {dtype}: yours is the additive mask of "
                "PyTorch's generate_square_subsequent_mask (0 where a query may attend, -inf where not), which "
                "attention adds to the scores. The course's masks are boolean and choose instead: True on and below "
                "the diagonal.", dtype=mask.dtype
            ))
        raise CheckFailure(t(
            "causal_mask should be boolean (True = may attend), got dtype {dtype}. Create it with dtype=torch.bool "
            "(torch.ones(..., dtype=torch.bool).tril(...)).", dtype=mask.dtype
        ))
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
            (ones.tril(), t(
                "Your mask is aligned to the first key, not the last: with k_len > q_len the queries are the "
                "last q_len positions, so query i may read keys up to i + k_len - q_len (tril(diagonal={offset})).",
                offset=offset
            )),
            (ones.tril(-offset), t(
                "Your diagonal has the wrong sign: tril(diagonal=q_len - k_len) = tril({minus_offset}) moves the "
                "triangle away from the keys. The queries are the last q_len positions, so query i may read "
                "keys up to i + k_len - q_len: tril(diagonal=k_len - q_len) = tril({offset}).",
                minus_offset=-offset, offset=offset
            )),
            (ones.tril(-1), t(
                "Your mask is aligned to the first key and hides the diagonal: with k_len > q_len query i may read "
                "keys up to i + k_len - q_len, its own position included (tril(diagonal={offset})).", offset=offset
            )),
        ]
    hints += [
        (ones.tril(offset + 1), t(
            "Your diagonal is off by one: each query also reads the key just after its own position, a "
            "future token. Keep tril(diagonal={offset}) (k_len - q_len).", offset=offset
        ) if offset else t(
            "Your diagonal is off by one: each query also reads the key just after its own position, a "
            "future token. Keep tril(diagonal={offset}).", offset=offset
        )),
        (ones.tril(offset - 1), t("Your mask hides the diagonal (j < i instead of j <= i): a token may attend to "
                                  "itself.")),
        (ones.triu(offset), t("Your mask is the upper triangle: it lets each query read the future. "
                              "Keep the lower triangle (tril, not triu).")),
        (~expected, t("Your mask is inverted: it is True on the future. True must mean 'may attend' "
                      "(the past and the token itself), so keep the lower triangle.")),
        (torch.ones_like(expected), t(
            "Your mask is True everywhere: it hides nothing, so every query reads the future. tril(diagonal=d) "
            "keeps every entry once d ≥ k_len - 1 = {last_key}; the diagonal must be k_len - q_len = {offset}.",
            last_key=k_len - 1, offset=offset
        )),
    ]
    for wrong, hint in hints:
        if torch.equal(mask, wrong):
            return t("{hint} ({found})", hint=hint, found=found)
    return t("{found}. {rows}", found=found, rows=_compare_grids(expected, mask, "query"))


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
                raise CheckFailure(t("causal_mask({n}): {diagnosis}", n=n, diagnosis=_diagnose_causal(mask, expected)))
    n = s["k_len"]
    mask = _causal_result(fn, n)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s["batch"], s["heads"], n, s["d_k"], generator=g, dtype=torch.float64) for _ in range(3))
    with_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if not close(with_mask, expected, torch.float64):
        sizes = {"batch": s["batch"], "heads": s["heads"], "q_len": n, "k_len": n, "d_k": s["d_k"]}
        raise CheckFailure(t("Attention with your mask differs from scaled_dot_product_attention(..., is_causal=True) "
                             "({found}).", found=difference(with_mask, expected, sizes)))
    passed(t("causal_mask(n) equals nn.Transformer.generate_square_subsequent_mask(n) == 0 and is_causal=True"))


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
            raise CheckFailure(t("causal_mask({q_len}, {k_len}): {diagnosis}", q_len=q_len, k_len=k_len,
                                 diagnosis=_diagnose_causal(mask, expected)))
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
        raise CheckFailure(t("The last queries with your mask differ from the last rows of full causal attention "
                             "({found}).", found=difference(last, full[..., -q_len:, :], sizes)))
    passed(t("causal_mask(q_len, k_len) is aligned to the last key: the last q_len rows of full causal attention"))


def _expect_value_error(fn: Callable[..., Any], args: tuple, why: str) -> None:
    shown = ", ".join(map(repr, args))
    try:
        result = call(fn, *args)
    except CheckFailure as failure:
        if raised_error(failure) == "ValueError":
            return
        # Not an error of the code (the stub, say): its own message says what is wrong.
        if not isinstance(failure, CodeRaised):
            raise
        raise CheckFailure(t(
            "causal_mask({args}) should raise a ValueError saying that {why}; {failure} "
            "Check the arguments at the top of the function and raise ValueError(...) yourself.",
            args=shown, why=why, failure=failure
        )) from None
    raise CheckFailure(t(
        "causal_mask({args}) should raise a ValueError saying that {why}, but it returned {kind}.",
        args=shown, why=why, kind=kind(result)
    ))


@check(forbid=BUILT_IN_CAUSAL)
def check_causal_mask_arguments(fn: Callable[..., Any], seed: int = 0) -> None:
    """The mask is created on the requested device; impossible lengths raise ValueError."""
    s = _sizes(seed)
    mask = call(fn, s["q_len"], s["k_len"], device="meta")
    if type(mask) is not Tensor or mask.device.type != "meta":
        where = mask.device if type(mask) is Tensor else kind(mask)
        raise CheckFailure(t(
            "causal_mask(..., device='meta') should create the mask on that device, got {where}: "
            "pass device=device to the function that creates the tensor.", where=where
        ))
    _expect_value_error(fn, (0,), t("q_len must be positive"))
    _expect_value_error(fn, (-s["q_len"],), t("q_len must be positive"))
    _expect_value_error(fn, (s["k_len"], s["q_len"]), t("k_len must be at least q_len"))
    passed(t("the mask is created on the requested device, and impossible lengths raise ValueError"))


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
        # What the code raised, in its own words (jaxtyping's or PyTorch's): never this check's message.
        raised = failure.text if isinstance(failure, CodeRaised) else ""
        returned = re.search(r"Actual value: \w+\[(\d+),(\d+)\]", raised)
        if "return value" in raised and returned:
            raise CheckFailure(_shape_problem((int(returned[1]), int(returned[2])), seq, d_model)) from None
        if f"index {seq} is out of bounds for dimension 0 with size {seq}" in raised:
            raise CheckFailure(t(
                "{raised}. Your loop reaches j = seq = {seq}, one past the last token: "
                "the tokens are x[0] ... x[seq - 1], so let j run over range(seq).",
                raised=str(failure).splitlines()[0].rstrip(" ."), seq=seq
            )) from None
        raise
    if type(got) is not Tensor or got.dtype != torch.bool or tuple(got.shape) != (seq, seq):
        if type(got) is Tensor and got.dtype == torch.bool:
            raise CheckFailure(_shape_problem(tuple(got.shape), seq, d_model))
        what = t("a {dtype} tensor of shape {shape}", dtype=dtype_name(got.dtype), shape=tuple(got.shape)) \
            if type(got) is Tensor else kind(got)
        raise CheckFailure(t(
            "which_outputs_change should return a boolean tensor of shape (seq={seq}, seq={seq}), got {what}.",
            seq=seq, what=what
        ))
    return got


def _shape_problem(shape: tuple[int, ...], seq: int, d_model: int) -> str:
    hint = ""
    if seq != d_model and shape in ((seq, d_model), (d_model, seq)):
        hint = t(" One of its axes has d_model={d_model} entries, one per feature of x rather than one per "
                 "token: look at where the number of tokens is read. x is (seq, d_model), so seq = x.shape[0] "
                 "(axis 0 holds the tokens, axis 1 the features).", d_model=d_model)
    elif len(shape) == 2 and shape[0] == seq and abs(shape[1] - seq) == 1:
        if shape[1] < seq:
            hint = t(" Your matrix has {columns} columns, one fewer than the {seq} tokens: it needs one column per "
                     "changed token j, for every j in range(seq), the last token included.", columns=shape[1], seq=seq)
        else:
            hint = t(" Your matrix has {columns} columns, one more than the {seq} tokens: it needs one column per "
                     "changed token j, for every j in range(seq), the last token included.", columns=shape[1], seq=seq)
    return t("which_outputs_change should return a boolean tensor of shape (seq={seq}, seq={seq}), got shape "
             "{shape}.{hint}", seq=seq, shape=shape, hint=hint)


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
    # Each mask with the message that names it.
    for failed, mask in ((marked("With no mask ({found}): {hint}"), None),
                         (marked("With a causal mask ({found}): {hint}"), causal),
                         (marked("With a random mask ({found}): {hint}"), random)):
        got = _measure(fn, x.clone(), mask, seq, d_model)  # a copy: a function that changes x in place keeps x
        expected = _expected_changes(x.double(), mask)
        if torch.equal(got, expected):
            continue
        if call(_changes_in_place, fn, x, mask):
            cumulative = _cumulative_changes(x.double(), mask)
            if torch.equal(got, cumulative):
                hint = t("Your function changed x in place: after the call, the x it was given differs from before. "
                         "Each change then stays for the next tokens (your matrix equals the one where token j's "
                         "change adds to those of tokens 0 ... j - 1). Change a copy: changed_x = x.clone().")
            else:
                hint = t("Your function changed x in place: after the call, the x it was given differs from before. "
                         "Change a copy: changed_x = x.clone().")
        elif torch.equal(got, expected.T):
            hint = t("Your matrix is transposed: row i is output i, column j is the input you changed.")
        elif mask is not None and torch.equal(got, mask):
            hint = t("You changed only the keys and values. In self-attention the changed token is also a query: "
                     "run attention on the changed x as queries, keys and values.")
        elif torch.equal(got, torch.eye(seq, dtype=torch.bool)):
            hint = t("You changed only the queries: then output i changes only when token i does. Token j is also "
                     "a key and a value that other queries read: run attention on the changed x as queries, "
                     "keys and values.")
        elif torch.equal(got, ~expected) and _inverted_elsewhere(fn, x, causal, seq, d_model):
            hint = t("Your matrix is inverted, here and with a causal mask: True exactly where an output did not "
                     "change, so it marks the outputs equal to the unchanged run. changed[i, j] must be True where "
                     "output i moved: out != base, not out == base.")
        elif not got.any():
            hint = t("No output moved for any changed token, so the attention never saw a change. Look at the change "
                     "itself (1.0 added to every entry of x[j], on a copy of x) and at the tensor the attention runs "
                     "on (that changed copy, as queries, keys and values).")
        elif mask is not None and got.all():
            hint = t("Every output changed although the mask hides some keys from some queries: look at whether the "
                     "mask reaches the attention (pass the mask to scaled_dot_product_attention).")
        else:
            hint = t("Row i says which changed inputs j reach output i. {rows}",
                     rows=_compare_grids(expected, got, "output"))
        found = _mask_difference(got, expected, {"seq": seq, "d_model": d_model})
        raise CheckFailure(tr(failed, found=found, hint=hint))
    passed(t("your measurement matches the dependence read off autograd's Jacobian (no mask, causal, random)"))
