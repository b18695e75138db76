"""Checks for chapter 13: the online softmax, one tile of FlashAttention's forward pass, the blocks a causal attention
computes.

The oracles: ``torch.softmax`` in float64 (with chapter 01's zeros for a row of nothing but -inf, where it gives
NaN); the state of a tile by its definition, written out here in float64 (the running maximum of the scores
q·k / sqrt(d_k), the sum of exp(score - max), the unnormalised output Σ exp(score - max) · v);
``F.scaled_dot_product_attention`` for a whole causal forward pass folded together with the student's own step; and
PyTorch's lower-right causal mask (``causal_lower_right``: the queries are the last ``q_len`` of ``k_len`` positions,
chapter 02's convention) cut into tiles, a tile computed where any of its entries is True. Where no built-in exists,
the defining property: two steps equal one step over both blocks. Nothing here imports the course's reference
library, which the class edition's students do not have. Every call of the student's code goes through :func:`call`.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float, jaxtyped
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
    draw_sizes,
    dtype_name,
    expect_tensor,
    kind,
    passed,
    raised_error,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import error_of as _error_of

# Exercise 1 rebuilds the softmax, so PyTorch's own is off limits in it (comparing with it in a scratch cell is fine).
BUILT_IN_SOFTMAX = {
    "torch.softmax": marked("PyTorch's softmax"),
    "torch.nn.functional.softmax": marked("PyTorch's softmax"),
    "torch.special.softmax": marked("PyTorch's softmax"),
    "torch.log_softmax": marked("PyTorch's log-softmax"),
    "torch.nn.functional.log_softmax": marked("PyTorch's log-softmax"),
    "torch.special.log_softmax": marked("PyTorch's log-softmax"),
}
# Exercise 2 is attention computed a tile at a time: PyTorch's fused attention would skip the point of it.
BUILT_IN_TILE = {
    "torch.nn.functional.scaled_dot_product_attention": marked("PyTorch's fused attention"),
}


def _then(failure: CheckFailure, hint: str) -> str:
    """A failure's message and what a probe after it found (a hint that starts with a space), as sentences."""
    text = str(failure).rstrip()
    if not hint or text.endswith(("。", "！", "？")):
        return text + hint
    if text.endswith((".", "!", "?")):  # a Chinese hint starts without the English one's space
        return text + ("" if hint[:1].isspace() else " ") + hint
    return t("{message}.{hint}", message=text, hint=hint)


def _raised_text(failure: CheckFailure) -> str:
    """What the student's code raised, where ``failure`` reports that (the text is PyTorch's or the student's, in
    either language of the checks); else the failure's own message."""
    return failure.text if isinstance(failure, CodeRaised) else str(failure)


def _call_on_copies(fn: Callable[..., Any], args: tuple, names: tuple[str, ...], what: str,
                    probe: Callable[[CheckFailure], str] | None = None) -> Any:
    """``fn(*args)`` on copies of the tensors; fail if it wrote into any of them (``+=``, ``mul_``, an assignment into
    ``x[...]``): the caller's tensors must stay as they were, and a call is recorded by what it was given. Where the
    call itself fails, ``probe(failure)`` (if given) adds what it finds to the failure's message."""
    copies = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
    try:
        got = call(fn, *copies)
    except CheckFailure as failure:
        if probe is None:
            raise
        raise CheckFailure(_then(failure, probe(failure))) from failure
    changed = [name for name, a, c in zip(names, args, copies, strict=True)
               if isinstance(a, Tensor) and not torch.equal(a, c)]
    if changed:
        raise CheckFailure(t("{function} changed the tensors it was given ({changed}): an in-place operation "
                             "(+=, mul_, masked_fill_, an assignment into x[...]) writes into the caller's tensors. "
                             "Compute new tensors and return them.", function=what, changed=", ".join(changed)))
    return got


# -- exercise 1: the online softmax ----------------------------------------------------------------------------

def _softmax_oracle(scores: Tensor) -> Tensor:
    """``torch.softmax`` in float64; a row of nothing but -inf gets zeros (softmax gives NaN there), as chapter 01's
    attention gives a query that may read no key."""
    weights = torch.softmax(scores.double(), dim=-1)
    readable = (scores > -math.inf).any(dim=-1, keepdim=True)
    return torch.where(readable, weights, torch.zeros_like(weights))


def _online_variant(scores: Tensor, block: int, mistake: str) -> Tensor:
    """The online softmax in float64 with one usual mistake in how the running sum is carried (to name it):
    "no rescale" (the old sum added as it is), "wrong sign" (multiplied by exp(new max - old max)), "restart" (only
    the last block's terms kept)."""
    scores = scores.double()
    row_max = torch.full(scores.shape[:-1], -math.inf, dtype=torch.float64)
    row_sum = torch.zeros_like(row_max)
    for start in range(0, scores.shape[-1], block):
        chunk = scores[..., start:start + block]
        new_max = torch.maximum(row_max, reduce(chunk, "... n -> ...", "max"))
        shift = torch.where(torch.isfinite(new_max), new_max, 0.0)
        factor = {
            "no rescale": torch.ones_like(row_sum),
            "wrong sign": torch.where(torch.isfinite(row_max), torch.exp(shift - row_max), 0.0),
            "restart": torch.zeros_like(row_sum),
        }[mistake]
        row_sum = row_sum * factor + reduce(torch.exp(chunk - rearrange(shift, "... -> ... 1")), "... n -> ...", "sum")
        row_max = new_max
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(scores - rearrange(shift, "... -> ... 1")) / rearrange(row_sum, "... -> ... 1")
    return torch.where(rearrange(row_sum > 0, "... -> ... 1"), weights, 0.0)


def _first_columns_softmax(scores: Tensor, columns: int) -> Tensor:
    """exp(score - m) / l for every column, m and l taken over the first ``columns`` only (a loop that stops there)."""
    scores = scores.double()
    seen = scores[..., :columns]
    row_max = seen.amax(dim=-1, keepdim=True)
    return torch.exp(scores - row_max) / torch.exp(seen - row_max).sum(dim=-1, keepdim=True)


def _softmax_probe(fn: Callable[..., Any], failure: CheckFailure, n: int, dtype: torch.dtype) -> str:
    """After online_softmax raised: the same function on one row with several block sizes, and with 0, 1 and 2 leading
    axes, to say which of them it handles; a cause only where the pattern of failures singles one out."""
    g = torch.Generator().manual_seed(n)
    row = 3 * torch.randn(n, generator=g, dtype=dtype)

    def works(scores: Tensor, block: int) -> bool:
        try:
            got = call(fn, scores.clone(), block)
        except CheckFailure:
            return False
        return type(got) is Tensor and close(got, _softmax_oracle(scores).to(dtype), dtype)

    blocks = sorted({1, 2, 3, n - 1, n, n + 3})
    ok = {block: works(row, block) for block in blocks}
    fine, broken = [b for b in blocks if ok[b]], [b for b in blocks if not ok[b]]
    if fine:
        said = t(" On one row of n = {n} scores, blocks of {broken} fail and blocks of {fine} are right.", n=n,
                 broken=broken, fine=fine)
    else:
        said = t(" On one row of n = {n} scores, blocks of {broken} fail.", n=n, broken=broken)
    error = _raised_text(failure)
    empty = "non-zero size" in error or "zero-size" in error
    if broken and all(ok[b] == bool(n % b) for b in blocks):
        return said + t(" It fails exactly when block divides n: then your loop takes one block more, starting at n "
                        "itself, an empty block past the last score. The starts are range(0, n, block), which stops "
                        "before n.")
    if empty and fine and all(ok[b] == (b >= n) for b in blocks):
        return said + t(" With one block it is right, with several a later block of scores is empty (the maximum "
                        "over it raises): look at the slice of each block, scores[..., start : start + block].")
    if empty and not fine:
        return said + t(" With every block size a block of scores your loop takes is empty (the maximum over it "
                        "raises): look at the slice of each block, scores[..., start : start + block], and at the "
                        "starts, range(0, n, block).")
    if fine == blocks:
        lead = [works(3 * torch.randn(*shape, n, generator=g, dtype=dtype), 2) for shape in ((4,), (4, 5))]
        if lead[0] and not lead[1]:
            return t(" One row (n,) and rows of shape (4, n) are right, rows of shape (4, 5, n) fail: your running "
                     "state does not have one entry per row. The running maximum and sum have the shape of every "
                     "axis but the last, scores.shape[:-1].")
    return ""


NO_RESCALE = marked(
    "You added each block's Σ exp(score − new max) to the running sum without rescaling the old sum: its terms were "
    "taken relative to the old maximum, so when a block raises the maximum they are too large. Multiply the old sum "
    "by exp(old max − new max) first: l' = l · exp(m − m') + Σ exp(block − m')."
)
WRONG_SIGN = marked(
    "You rescaled the running sum by exp(new max − old max) instead of exp(old max − new max): when a block raises "
    "the maximum, the old terms must shrink (the factor is at most 1), not grow."
)
WRONG_SIGN_NAN = marked(
    "Your weights are {what} in rows that read some score, so the running sum went wrong before the end. The "
    "usual cause is the factor of the old sum with its sign swapped: you probably rescaled the running sum by "
    "exp(new max − old max) instead of exp(old max − new max). Before the first block the old maximum is -inf and "
    "the sum 0, so the right factor is exp(-inf) = 0, while the swapped one is exp(+inf) = inf, and 0 · inf is NaN "
    "(which a final torch.where(row_sum > 0, ...) turns into zeros)."
)
RESTART = marked(
    "Your running sum keeps only the last block's terms: carry the sum from block to block, l' = l · exp(m − m') + "
    "Σ exp(block − m'), starting from l = 0 before the first block."
)


def _softmax_hint(got: Tensor, scores: Tensor, block: int, one_block_passed: bool) -> str:
    readable = (scores > -math.inf).any(dim=-1)
    if torch.isnan(got)[readable].any():
        return tr(WRONG_SIGN_NAN, what="NaN")
    if (got == 0).all(dim=-1)[readable].any():
        return tr(WRONG_SIGN_NAN, what=t("all 0"))
    for mistake, hint in (("no rescale", NO_RESCALE), ("wrong sign", WRONG_SIGN), ("restart", RESTART)):
        if close(got, _online_variant(scores, block, mistake).to(got.dtype), got.dtype):
            return tr(hint)
    columns = scores.shape[-2] if scores.dim() > 1 else scores.shape[-1]
    if columns < scores.shape[-1] and close(got, _first_columns_softmax(scores, columns).to(got.dtype), got.dtype):
        return t("Your running maximum and sum cover only the first {columns} of the n = {n} columns, "
                 "{columns} being the size of the second-to-last axis: the blocks run over the last axis, "
                 "range(0, scores.shape[-1], block).", columns=columns, n=scores.shape[-1])
    if scores.dim() > 1 and close(got, torch.softmax(scores.double(), dim=-2).to(got.dtype), got.dtype):
        return t("Your weights sum to 1 over the second-to-last axis: the softmax runs over the last axis, n.")
    sums = got.double().sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
        return t("Your rows do not sum to 1: after the last block, divide exp(score − final max) by the final running "
                 "sum.")
    if one_block_passed:
        return t("With one block (block ≥ n) your weights are right, with several they are not: look at how the "
                 "running maximum and sum go from one block to the next, l' = l · exp(m − m') + Σ exp(block − m').")
    return t("Keep a running maximum m (from -inf) and sum l (from 0); for each block m' = max(m, the block's "
             "largest score), l' = l · exp(m − m') + Σ exp(block − m'); at the end, exp(score − m) / l.")


def _softmax_sizes(seed: int) -> tuple[int, list[int], int]:
    """The row length n, three distinct leading sizes (all below n, so that a swapped axis changes the shape) and a
    block size that does not divide n."""
    g = torch.Generator().manual_seed(seed + 31)
    n = int(torch.randint(9, 25, (1,), generator=g))
    rows = (torch.randperm(6, generator=g)[:3] + 2).tolist()
    start = int(torch.randint(2, n - 1, (1,), generator=g))
    not_dividing = next(b for b in range(start, n) if n % b)  # n - 1 never divides n
    return n, rows, not_dividing


def _expect_weights(got: Any, what: str, scores: Tensor) -> Tensor:
    shape = tuple(scores.shape)
    axes = " ".join([f"rows{i}" for i in range(len(shape) - 1)] + ["n"])
    return expect_tensor(got, t("online_softmax's result for {what}", what=what), shape, axes, scores.dtype)


def _weights(fn: Callable[..., Any], scores: Tensor, block: int, what: str) -> Tensor:
    got = _call_on_copies(fn, (scores, block), ("scores", "block"), "online_softmax",
                          lambda failure: _softmax_probe(fn, failure, scores.shape[-1], scores.dtype))
    return _expect_weights(got, what, scores)


@check(forbid=BUILT_IN_SOFTMAX)
def check_online_softmax_values(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """softmax over the last axis for blocks of 1, blocks that do not divide n and one block, with any leading axes;
    block < 1 raises ValueError."""
    n, (r1, r2, r3), b = _softmax_sizes(seed)
    g = torch.Generator().manual_seed(seed + 37)

    def draw(*shape: int) -> Tensor:
        return 3 * torch.randn(*shape, n, generator=g, dtype=dtype)  # spread 3: the maximum moves between blocks

    # One block first: a failure with several blocks then says that the single block was right.
    cases = [(t("one block longer than the row (block = {block}, n = {n})", block=n + 3, n=n), draw(r1), n + 3),
             (t("one block exactly the row (block = n = {n})", n=n), draw(r1, r2), n),
             (t("blocks of 1, one score at a time (n = {n})", n=n), draw(r2), 1),
             (t("blocks of {block}, which does not divide n = {n} (the last block is shorter)", block=b, n=n),
              draw(r1, r2, r3), b),
             (t("a single row with no leading axis, blocks of 2 (n = {n})", n=n), draw(), 2)]
    one_block_passed = False
    for index, (what, scores, block) in enumerate(cases):
        got = _weights(fn, scores, block, what)
        expected = _softmax_oracle(scores).to(dtype)
        if not close(got, expected, dtype):
            raise CheckFailure(t(
                "For {what}, scores of shape {shape} ({dtype}), your weights differ from "
                "torch.softmax(scores, dim=-1) ({difference}). {hint}", what=what, shape=tuple(scores.shape),
                dtype=dtype_name(dtype), difference=difference(got, expected),
                hint=_softmax_hint(got, scores, block, one_block_passed)))
        one_block_passed = one_block_passed or index < 2
    for block in (0, -2):
        error = call(_error_of, fn, cases[0][1], block)
        if error is None:
            raise CheckFailure(t("online_softmax(scores, block={block}) should raise a ValueError (a block holds at "
                                 "least one column); it raised no error. Check block < 1 before the loop.",
                                 block=block))
        if error != "ValueError":
            raise CheckFailure(t("online_softmax(scores, block={block}) should raise a ValueError (a block holds at "
                                 "least one column); it raised a {error}. Check block < 1 before the loop.",
                                 block=block, error=error))
    passed(t("online_softmax equals torch.softmax for blocks of 1, of {block} (not dividing n = {n}), of n and beyond, "
             "with 0 to 3 leading axes; block < 1 raises ValueError ({dtype})", block=b, n=n,
             dtype=dtype_name(dtype)))


def _masked_scores(seed: int, dtype: torch.dtype) -> tuple[Tensor, int, dict[str, tuple[int, ...]]]:
    """Scores with -inf scattered over them, a fully masked row, and a row whose first block is all -inf (its
    maximum is still -inf after that block); the rows of each kind by index."""
    n, (r1, r2, _), b = _softmax_sizes(seed)
    g = torch.Generator().manual_seed(seed + 41)
    scores = 3 * torch.randn(r1, r2, n, generator=g, dtype=dtype)
    scores = scores.masked_fill(torch.rand(r1, r2, n, generator=g) < 0.3, -math.inf)
    scores[..., -1] = torch.randn(r1, r2, generator=g, dtype=dtype)  # every other row reads at least one key
    blind, late = (0, 0), (r1 - 1, r2 - 1)
    scores[blind] = -math.inf
    scores[late][:b] = -math.inf
    return scores, b, {"blind": blind, "late": late}


@check(forbid=BUILT_IN_SOFTMAX)
def check_online_softmax_masked(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """-inf scores get weight 0; a row of nothing but -inf gives zeros, not NaN, and a row whose first block is all -inf
    its softmax."""
    scores, block, rows = _masked_scores(seed, dtype)
    blind = scores[rows["blind"]][None]
    cases = ((t("scores of shape {shape} with -inf entries (masked keys), blocks of {block}, row {blind} all -inf "
                "and row {late} -inf in its whole first block", shape=tuple(scores.shape), block=block,
                blind=list(rows["blind"]), late=list(rows["late"])), scores, block),
             (t("one row of nothing but -inf, blocks of 1"), blind, 1))
    for what, x, b in cases:
        got = _weights(fn, x, b, what)
        expected = _softmax_oracle(x).to(dtype)
        if close(got, expected, dtype):
            continue
        readable = (x > -math.inf).any(dim=-1)
        late = torch.zeros_like(readable)
        if x is scores:
            late[rows["late"]] = True
        nan_rows = torch.isnan(got).any(dim=-1)
        bad_rows = nan_rows | (readable & (got == 0).all(dim=-1))  # a final torch.where may hide a NaN sum as zeros
        if (nan_rows & ~readable).any():
            hint = t("A fully masked row (all scores -inf) must give zeros, as chapter 01's attention does; yours "
                     "gives NaN. Its maximum stays -inf and its sum 0: exp(-inf − (-inf)) and 0 / 0 are both NaN. "
                     "Subtract _shift(m) (0 where m is -inf) instead of m, and return zeros where the final sum is 0 "
                     "(torch.where(row_sum > 0, ...)).")
        elif (bad_rows & late).any() and not (bad_rows & readable & ~late).any():
            hint = t("A row whose first block holds only -inf gives NaN (or zeros, where a final torch.where hides a "
                     "NaN sum): after that block its maximum is still -inf, and exp(score − max) = exp(-inf − "
                     "(-inf)) is NaN. Subtract _shift(m), which is 0 where m is -inf, instead of m.")
        elif not bad_rows.any() and (got[x == -math.inf] != 0).any():
            hint = t("A masked score (-inf) must get weight exactly 0: exp(-inf − m) = 0.")
        else:
            hint = _softmax_hint(got, x, b, False)
        raise CheckFailure(t("For {what} ({dtype}), your weights differ from torch.softmax(scores, "
                             "dim=-1) with zeros for a fully masked row ({difference}). {hint}", what=what,
                             dtype=dtype_name(dtype), difference=difference(got, expected), hint=hint))
    passed(t("online_softmax gives -inf scores weight 0, a fully masked row zeros (no NaN), and a row whose first "
             "block is all -inf its softmax ({dtype})", dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_SOFTMAX)
def check_online_softmax_overflow(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Scores near +1000 and near -1000: exp overflows (or underflows to 0) unless the running maximum is subtracted."""
    n, (r1, r2, _), b = _softmax_sizes(seed)
    g = torch.Generator().manual_seed(seed + 43)
    high = 1000 + 5 * torch.randn(r1, n, generator=g, dtype=dtype)
    low = -1000 + 5 * torch.randn(r2, n, generator=g, dtype=dtype)
    # The largest score in the last block only: the maximum rises at the end, after the sum has started.
    rising = 1000 + 5 * torch.randn(r1, r2, n, generator=g, dtype=dtype)
    rising[..., -1] = rising.amax(dim=-1) + 10
    rising[..., 0] = -math.inf
    for what, scores in ((t("scores near +1000, blocks of {block}", block=b), high),
                         (t("scores near -1000, blocks of {block}", block=b), low),
                         (t("scores near +1000 with the largest in the last block and the first -inf, blocks of "
                            "{block}", block=b), rising)):
        got = _weights(fn, scores, b, what)
        expected = _softmax_oracle(scores).to(dtype)
        if close(got, expected, dtype):
            continue
        # softmax(s) = softmax(s - c): the same scores moved near 0 tell the size of the numbers from the method.
        near_zero = scores - scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
        moved = _weights(fn, near_zero, b, t("{what}, moved near 0", what=what))
        if close(moved, _softmax_oracle(near_zero).to(dtype), dtype):
            largest = 88 if dtype == torch.float32 else 709
            hint = t("The same scores moved near 0 (softmax does not change when a constant is subtracted from a row) "
                     "give the right weights, so the size of the numbers is the problem: exp(1000) overflows "
                     "{dtype} (its largest number is about e^{largest}) and exp(-1000) rounds to 0, so "
                     "inf / inf and 0 / 0 are NaN. Subtract the running maximum before exponentiating, "
                     "exp(score − m) ≤ 1, and rescale the running sum whenever the maximum rises.",
                     dtype=dtype_name(dtype), largest=largest)
        else:
            hint = _softmax_hint(moved, near_zero, b, False)
        raise CheckFailure(t("For {what}, shape {shape} ({dtype}), your weights differ "
                             "from torch.softmax(scores, dim=-1) ({difference}). {hint}", what=what,
                             shape=tuple(scores.shape), dtype=dtype_name(dtype),
                             difference=difference(got, expected), hint=hint))
    passed(t("online_softmax is exact for scores near ±1000, where exp alone overflows or underflows, and when the "
             "maximum comes last ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 2: one tile -----------------------------------------------------------------------------------

TILE_AXES = ("batch", "heads", "q_block", "k_block", "d_k", "d_v")


def _tile_sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes (2 to 9), so that a swapped axis changes a shape and d_v differs from d_k."""
    return distinct_sizes(seed + 53, TILE_AXES, span=8)


@jaxtyped(typechecker=beartype)
def _tile_oracle(
    q: Float[Tensor, "*batch q_block d_k"],
    k: Float[Tensor, "*batch k_block d_k"],
    v: Float[Tensor, "*batch k_block d_v"],
    allowed: Bool[Tensor, "*#batch #q_block #k_block"] | None,
    row_max: Float[Tensor, "*batch q_block"],
    row_sum: Float[Tensor, "*batch q_block"],
    out: Float[Tensor, "*batch q_block d_v"],
    mistake: str = "",
) -> tuple[Float[Tensor, "*batch q_block"], Float[Tensor, "*batch q_block"], Float[Tensor, "*batch q_block d_v"]]:
    """One tile by its definition, in float64; ``mistake`` (a key of :data:`TILE_MISTAKES`) builds a usual wrong one,
    to name it."""
    q, k, v, row_max, row_sum, out = (t.double() for t in (q, k, v, row_max, row_sum, out))
    d_k, d_v = q.shape[-1], v.shape[-1]
    scale = {"no scale": 1.0, "d_k": d_k, "sqrt d_v": math.sqrt(d_v)}.get(mistake, math.sqrt(d_k))
    scores = einsum(q, k, "... q_block d_k, ... k_block d_k -> ... q_block k_block") / scale
    if mistake == "scores transposed":  # k qᵀ: only where q_block == k_block
        scores = rearrange(scores, "... q_block k_block -> ... k_block q_block")
    if allowed is not None and mistake != "mask ignored":
        scores = scores.masked_fill(allowed if mistake == "mask inverted" else ~allowed, -math.inf)
    block_max = reduce(scores, "... q_block k_block -> ... q_block", "max")
    new_max = torch.maximum(row_max, block_max)
    shift = torch.where(torch.isfinite(new_max), new_max, 0.0)  # a row that has read no key: nothing to shift
    if mistake == "wrong sign":
        factor = torch.where(torch.isfinite(row_max), torch.exp(shift - row_max), 0.0)
    else:
        factor = torch.where(torch.isfinite(row_max), torch.exp(row_max - shift), 0.0)
    weights = torch.exp(scores - rearrange(shift, "... q_block -> ... q_block 1"))
    kept = torch.ones_like(factor)
    sum_factor = kept if mistake in ("sum not rescaled", "neither rescaled") else factor
    out_factor = kept if mistake in ("out not rescaled", "neither rescaled") else factor
    new_sum = row_sum * sum_factor + reduce(weights, "... q_block k_block -> ... q_block", "sum")
    new_out = out * rearrange(out_factor, "... q_block -> ... q_block 1") + einsum(
        weights, v, "... q_block k_block, ... k_block d_v -> ... q_block d_v")
    if mistake == "normalised":
        new_out = torch.where(rearrange(new_sum > 0, "... -> ... 1"),
                              new_out / rearrange(new_sum, "... q_block -> ... q_block 1"), 0.0)
    if mistake == "block max":
        new_max = block_max
    if mistake == "out transposed":  # (d_v, q_block): only where q_block == d_v
        new_out = rearrange(new_out, "... q_block d_v -> ... d_v q_block")
    return new_max, new_sum, new_out


TILE_MISTAKES = {
    "no scale": marked("You did not scale the scores: divide q kᵀ by sqrt(d_k), the keys' width."),
    "d_k": marked("You divided the scores by d_k: divide them by sqrt(d_k)."),
    "sqrt d_v": marked("You divided the scores by sqrt(d_v), the values' width: the scale is sqrt(d_k), the width of "
                       "the vectors in the dot product."),
    "mask ignored": marked("Your step ignores allowed: where it is False, set the score to -inf before the maximum "
                           "and the exponentials (scores.masked_fill(~allowed, -math.inf))."),
    "mask inverted": marked("Your step masks the keys that allowed marks True: True means may attend, so fill "
                            "~allowed."),
    "sum not rescaled": marked("You added the block's terms to row_sum without rescaling the old sum by exp(old max − "
                               "new max): it was taken relative to the old maximum."),
    "out not rescaled": marked("You rescaled row_sum but not the accumulated output: out was taken relative to the "
                               "old maximum too, so multiply it by the same rescale factor, exp(old max − new max), "
                               "before adding the block's Σ exp(score − new max) · v."),
    "neither rescaled": marked("You added the block's terms to row_sum and out without rescaling the old ones: both "
                               "were taken relative to the old maximum, so multiply both by exp(old max − new max) "
                               "first."),
    "wrong sign": marked("You rescaled by exp(new max − old max) instead of exp(old max − new max): when a block "
                         "raises the maximum, the old sum and output must shrink (the factor is at most 1), not grow."),
    "block max": marked("The row_max you return is the block's own maximum: it must be the largest score so far, "
                        "max(row_max, the block's largest score)."),
    "normalised": marked("You divided the output by the sum: return the unnormalised out, Σ exp(score − max) · v; the "
                         "caller divides once, after the last block."),
}


def _tile_inputs(s: dict[str, int], dtype: torch.dtype, g: torch.Generator, lead: tuple[int, ...],
                 k_block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    k_block = s["k_block"] if k_block is None else k_block
    q = torch.randn(*lead, s["q_block"], s["d_k"], generator=g, dtype=dtype)
    k = torch.randn(*lead, k_block, s["d_k"], generator=g, dtype=dtype)
    v = torch.randn(*lead, k_block, s["d_v"], generator=g, dtype=dtype)
    return q, k, v


def _initial(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The state of a block of queries before any key: row_max -inf, row_sum 0, out 0."""
    row_max = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    return row_max, torch.zeros_like(row_max), torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)


def _expect_state(got: Any, what: str, q: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if type(got) not in (tuple, list) or len(got) != 3:
        raise CheckFailure(t("tile_step should return the new (row_max, row_sum, out), three tensors; for {what} it "
                             "returned {kind}.", what=what, kind=kind(got)))
    lead = tuple(q.shape[:-1])
    axes = " ".join([f"lead{i}" for i in range(len(lead) - 1)] + ["q_block"])
    return (expect_tensor(got[0], t("the returned row_max for {what}", what=what), lead, axes, q.dtype),
            expect_tensor(got[1], t("the returned row_sum for {what}", what=what), lead, axes, q.dtype),
            expect_tensor(got[2], t("the returned out for {what}", what=what), (*lead, v.shape[-1]), axes + " d_v",
                          q.dtype))


def _tile_sizes_text(q: Tensor, k: Tensor, v: Tensor) -> dict[str, int]:
    return {"q_block": q.shape[-2], "k_block": k.shape[-2], "d_k": q.shape[-1], "d_v": v.shape[-1]}


def _rows_close(got: tuple[Tensor, ...], expected: tuple[Tensor, ...], rows: Tensor,
                tolerance: float | None) -> bool:
    """Whether the two states agree in the rows ``rows`` (a boolean of the leading shape), in all three parts."""
    dtype = got[0].dtype
    return all(close(a[rows], b[rows].to(dtype), dtype, tolerance) for a, b in zip(got, expected, strict=True))


def _tile_hint(got: tuple[Tensor, Tensor, Tensor], args: tuple, tolerance: float | None) -> str:
    allowed, row_max = args[3], args[4]
    expected = _tile_oracle(*args)
    read = torch.isfinite(expected[0])  # the rows that have read some key, once this block is folded in
    if _rows_close(got, expected, read, tolerance):
        if any(torch.isnan(part[~read]).any() for part in got):
            return t("Your state is NaN in a row that has read no key yet (all its scores so far are -inf): its "
                     "maximum is still -inf, and exp(-inf − (-inf)) is NaN. Subtract _shift(new max), which is 0 "
                     "there, so that such a row keeps row_max -inf, row_sum 0 and out 0.")
        return t("A row that has read no key yet (allowed False for all its keys so far) must keep row_max -inf, "
                 "row_sum 0 and out 0: nothing of this block may enter it.")
    for mistake in [m for m in TILE_MISTAKES if allowed is not None or not m.startswith("mask")]:
        if _rows_close(got, _tile_oracle(*args, mistake=mistake), read, tolerance):
            return tr(TILE_MISTAKES[mistake])
    if any(torch.isnan(part[read]).any() for part in got):
        if bool((~torch.isfinite(row_max)).any()):
            return t("Your state is NaN in rows that do read keys. The usual cause is the factor of the old state "
                     "with its sign swapped: you probably rescaled by exp(new max − old max) instead of exp(old max − "
                     "new max). From the initial state the old maximum is -inf and the sum 0, so the right factor is "
                     "exp(-inf) = 0, while the swapped one is exp(+inf) = inf, and 0 · inf is NaN.")
        return t("Your state holds NaN: subtract the new maximum before exponentiating, exp(score − new max) ≤ 1.")
    if any(torch.isinf(part).any() for part in got[1:]):
        return t("Your row_sum or out is inf: exp of a large score overflows. Subtract the new maximum before "
                 "exponentiating, exp(score − new max) ≤ 1.")
    return t("The scores are q kᵀ / sqrt(d_k) (-inf where allowed is False); m' = max(row_max, the block's largest "
             "score); row_sum and out are multiplied by exp(row_max − m') and then get the block's Σ exp(score − m') "
             "and Σ exp(score − m') · v.")


def _compare_state(got: tuple[Tensor, Tensor, Tensor], args: tuple, what: str,
                   tolerance: float | None = None) -> None:
    """Fail, naming the first wrong part of the state and the likely mistake, unless ``got`` is the tile's state."""
    q, k, v = args[:3]
    expected = _tile_oracle(*args)
    for name, mine, theirs in zip(("row_max", "row_sum", "out"), got, expected, strict=True):
        if close(mine, theirs.to(q.dtype), q.dtype, tolerance):
            continue
        hint = _tile_hint(got, args, tolerance)
        if name == "row_max" and (torch.isneginf(theirs) & ~torch.isneginf(mine)).any():
            raise CheckFailure(t("For {what} ({dtype}), the returned row_max is finite in a row that has read no key "
                                 "yet, where it must stay -inf. {hint}", what=what, dtype=dtype_name(q.dtype),
                                 hint=hint))
        if name == "row_max" and (torch.isneginf(mine) & ~torch.isneginf(theirs)).any():
            raise CheckFailure(t("For {what} ({dtype}), the returned row_max is -inf in a row that has read keys. "
                                 "{hint}", what=what, dtype=dtype_name(q.dtype), hint=hint))
        raise CheckFailure(t("For {what} ({dtype}), the returned {name} is not the tile's ({difference}). {hint}",
                             what=what, dtype=dtype_name(q.dtype), name=name,
                             difference=difference(mine, theirs, _tile_sizes_text(q, k, v)), hint=hint))


STEP_NAMES = ("q", "k", "v", "allowed", "row_max", "row_sum", "out")


def _step(fn: Callable[..., Any], args: tuple, what: str) -> tuple[Tensor, Tensor, Tensor]:
    got = _call_on_copies(fn, args, STEP_NAMES, "tile_step", lambda failure: _step_probe(fn, failure, args))
    return _expect_state(got, what, args[0], args[2])


def _probe_state(fn: Callable[..., Any], args: tuple) -> tuple[Tensor, ...] | None:
    """The student's step on ``args``, or None if it raises or returns something else than three tensors of the
    state's shapes."""
    try:
        got = call(fn, *(a.clone() if isinstance(a, Tensor) else a for a in args))
    except CheckFailure:
        return None
    q, v = args[0], args[2]
    shapes = (q.shape[:-1], q.shape[:-1], (*q.shape[:-1], v.shape[-1]))
    if type(got) not in (tuple, list) or len(got) != 3 or any(
            type(t) is not Tensor or tuple(t.shape) != tuple(shape) for t, shape in zip(got, shapes, strict=True)):
        return None
    return tuple(got)


def _step_probe(fn: Callable[..., Any], failure: CheckFailure, args: tuple) -> str:
    """After tile_step raised: the same step without leading axes, on a square tile (q_block = k_block = d_k = d_v,
    where a transposed einsum runs too), and with a mask given, to say which of them it gets right."""
    q, k, v, allowed = args[:4]
    dtype = q.dtype
    g = torch.Generator().manual_seed(q.shape[-2] * 100 + k.shape[-2])
    if allowed is None and "NoneType" in _raised_text(failure):
        # allowed=None made it raise: with a mask given, does it apply it?
        mask = torch.rand(q.shape[-2], k.shape[-2], generator=g) < 0.5
        mask[:, 0] = True
        masked = (q, k, v, mask, *args[4:])
        got = _probe_state(fn, masked)
        if got is not None and _rows_close(got, _tile_oracle(*masked, mistake="mask ignored"),
                                           torch.ones(q.shape[:-1], dtype=torch.bool), None) \
                and not _rows_close(got, _tile_oracle(*masked), torch.ones(q.shape[:-1], dtype=torch.bool), None):
            return t(" With allowed=None your step applies the mask anyway (~ of None), and with a mask given it "
                     "ignores it: your test of allowed is inverted. Mask only if allowed is not None.")
        return ""
    every = torch.ones(q.shape[-2], dtype=torch.bool)
    if q.dim() > 2:
        flat = (q[(0,) * (q.dim() - 2)], k[(0,) * (k.dim() - 2)], v[(0,) * (v.dim() - 2)], None,
                *(t[(0,) * (q.dim() - 2)] for t in args[4:]))
        got = _probe_state(fn, flat)
        if got is not None and _rows_close(got, _tile_oracle(*flat), every, None):
            return t(" The same step on q of shape {shape}, with no leading axes, runs and is right: "
                     "with leading axes (batch, heads) it fails, so some operation of your step puts the leading axes "
                     "elsewhere than the other tensors have them: an einops pattern with its '...' not first, or a "
                     "transpose or index of fixed axes (0, 1). Keep '...' first in every pattern ('... q_block "
                     "k_block', '... q_block', '... q_block d_v') and count other axes from the end (-2, -1).",
                     shape=tuple(flat[0].shape))
    c = 4
    square = (torch.randn(c, c, generator=g, dtype=dtype), torch.randn(c, c, generator=g, dtype=dtype),
              torch.randn(c, c, generator=g, dtype=dtype), None)
    square = (*square, torch.full((c,), -math.inf, dtype=dtype), torch.zeros(c, dtype=dtype),
              torch.zeros(c, c, dtype=dtype))
    got = _probe_state(fn, square)
    if got is None:
        return ""
    found = [m for m in ("scores transposed", "out transposed")
             if _rows_close(got, _tile_oracle(*square, mistake=m), torch.ones(c, dtype=torch.bool), None)]
    if _rows_close(got, _tile_oracle(*square), torch.ones(c, dtype=torch.bool), None) or len(found) != 1:
        return ""
    if found[0] == "scores transposed":
        return t(" On a square tile (q_block = k_block = d_k = d_v = {size}, no leading axes) your step runs, and "
                 "equals the step with the scores transposed, k qᵀ instead of q kᵀ: the scores have one row per "
                 "query, einsum(q, k, '... q_block d_k, ... k_block d_k -> ... q_block k_block').", size=c)
    return t(" On a square tile (q_block = k_block = d_k = d_v = {size}, no leading axes) your step runs, and equals "
             "the step with out transposed, (d_v, q_block) instead of (q_block, d_v): the weighted sum of the values "
             "ends in '... q_block d_v'.", size=c)


def _large_scores(q: Tensor, k: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """q and k with one shared large channel, so that every score is near 150 in float32 (exp overflows beyond 88)
    and near 800 in float64 (beyond 709)."""
    target = 150.0 if dtype == torch.float32 else 800.0
    a = math.sqrt(target * math.sqrt(q.shape[-1]))
    q, k = q.clone(), k.clone()
    q[..., 0], k[..., 0] = a, a
    return q, k


@check(forbid=BUILT_IN_TILE)
def check_tile_step_first(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """The first block from the initial state (row_max -inf, row_sum 0, out 0), allowed=None: the scale 1/sqrt(d_k),
    d_v != d_k, any leading axes, scores large enough to overflow exp."""
    s = _tile_sizes(seed)
    g = torch.Generator().manual_seed(seed + 59)
    cases = []
    for lead, what in (((s["batch"], s["heads"]), t("q (batch, heads, q_block, d_k)")),
                       ((), t("q (q_block, d_k), no leading axis")), ((s["batch"],), t("q (batch, q_block, d_k)"))):
        q, k, v = _tile_inputs(s, dtype, g, lead)
        cases.append((t("the first block of keys, {what}, allowed=None", what=what), (q, k, v, None, *_initial(q, v)),
                      None))
    q, k, v = _tile_inputs(s, dtype, g, (s["heads"],))
    q, k = _large_scores(q, k, dtype)
    # Scores near 150 in float32 carry rounding errors of about 1e-5 each, which exp turns into relative errors.
    cases.append((t("the first block with scores near {size}", size="150" if dtype == torch.float32 else "800"),
                  (q, k, v, None, *_initial(q, v)), 1e-4 if dtype == torch.float32 else None))
    for what, args, tolerance in cases:
        _compare_state(_step(fn, args, what), args, what, tolerance)
    passed(t("tile_step from the initial state: the block's maximum of q kᵀ / sqrt(d_k), Σ exp(score − max) and "
             "Σ exp(score − max) · v, for d_k={d_k}, d_v={d_v}, 0 to 2 leading axes and scores that "
             "overflow exp ({dtype})", d_k=s["d_k"], d_v=s["d_v"], dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_TILE)
def check_tile_step_mask(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """allowed broadcast as (q_block, k_block), (batch, 1, 1, k_block) and in full; a row that stays fully masked
    keeps -inf, 0 and 0; a row masked in the first block reads the second."""
    s = _tile_sizes(seed)
    g = torch.Generator().manual_seed(seed + 61)
    b, h, q_block, k_block = s["batch"], s["heads"], s["q_block"], s["k_block"]
    q, k, v = _tile_inputs(s, dtype, g, (b, h))
    start = _initial(q, v)
    pairs = torch.rand(q_block, k_block, generator=g) < 0.6
    pairs[1:, 0] = True
    pairs[0] = False  # query 0 reads nothing of this block: from the initial state it stays (-inf, 0, 0)
    padding = torch.rand(b, 1, 1, k_block, generator=g) < 0.6
    padding[..., 0] = True
    padding[-1] = False  # the last sequence's keys are all padding
    full = torch.rand(b, h, q_block, k_block, generator=g) < 0.5
    cases = [(t("allowed of shape (q_block, k_block) = {shape}, query 0 reading no key", shape=tuple(pairs.shape)),
              pairs),
             (t("a padding mask of shape (batch, 1, 1, k_block) = {shape}, the last sequence all padding",
                shape=tuple(padding.shape)), padding),
             (t("allowed of the scores' full shape {shape}", shape=tuple(full.shape)), full)]
    for what, allowed in cases:
        args = (q, k, v, allowed, *start)
        _compare_state(_step(fn, args, t("the first block, {what}", what=what)), args,
                       t("the first block, {what}", what=what))
    # Two steps: nothing readable in the first block; in the second, every query but the last reads something.
    what = t("a first block that no query may read, then a second block where the last query still reads nothing")
    first = (q, k, v, torch.zeros(1, 1, dtype=torch.bool), *start)
    state = _step(fn, first, what)
    _compare_state(state, first, t("{what} (after the first block)", what=what))
    _, k2, v2 = _tile_inputs(s, dtype, g, (b, h), k_block + 1)
    second = torch.rand(q_block, k_block + 1, generator=g) < 0.5
    second[:-1, -1] = True
    second[-1] = False
    args = (q, k2, v2, second, *state)
    _compare_state(_step(fn, args, what), args, what)
    passed(t("tile_step with allowed of shapes (q_block, k_block), (batch, 1, 1, k_block) and in full: masked keys "
             "are skipped, a row that has read no key keeps row_max -inf, row_sum 0 and out 0 (no NaN) and reads "
             "a later block ({dtype})", dtype=dtype_name(dtype)))


def _state_before(s: dict[str, int], dtype: torch.dtype, g: torch.Generator,
                  q: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor, Tensor]:
    """A running state after one earlier block (by the definition), and that block's keys and values."""
    _, k, v = _tile_inputs(s, dtype, g, tuple(q.shape[:-2]))
    state = tuple(t.to(dtype) for t in _tile_oracle(q, k, v, None, *_initial(q, v)))
    return state, k, v


@check(forbid=BUILT_IN_TILE)
def check_tile_step_fold(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """A second block folded into a running state rescales the sum and the output by exp(old max - new max); two steps
    equal one step over both blocks; a causal attention folded block by block equals F.scaled_dot_product_attention."""
    s = _tile_sizes(seed)
    g = torch.Generator().manual_seed(seed + 67)
    b, h, q_block, k_block = s["batch"], s["heads"], s["q_block"], s["k_block"]
    q = torch.randn(b, h, q_block, s["d_k"], generator=g, dtype=dtype)
    # The second block's keys are longer: in most rows it raises the maximum, in some it does not.
    while True:
        state, k1, v1 = _state_before(s, dtype, g, q)
        _, k2, v2 = _tile_inputs(s, dtype, g, (b, h))
        k2 = 1.5 * k2
        rises = _tile_oracle(q, k2, v2, None, *state)[0] > state[0]
        if rises.any() and not rises.all():
            break
    what = t("a second block folded into the state after a first one (the maximum rises in some rows)")
    args = (q, k2, v2, None, *state)
    _compare_state(_step(fn, args, what), args, what)
    allowed = torch.rand(q_block, k_block, generator=g) < 0.6
    allowed[0] = False  # query 0 reads nothing of this block: its state must come back as it was
    what = t("a second block with allowed (q_block, k_block), query 0 reading none of it")
    args = (q, k2, v2, allowed, *state)
    _compare_state(_step(fn, args, what), args, what)
    # The defining property, on your own function alone: two steps equal one step over both blocks.
    start = _initial(q, v1)
    what = t("two blocks one after the other")
    first = _step(fn, (q, k1, v1, None, *start), what)
    two = _step(fn, (q, k2, v2, None, *first), what)
    both = (q, torch.cat([k1, k2], dim=-2), torch.cat([v1, v2], dim=-2), None, *start)
    one = _step(fn, both, t("both blocks at once"))
    for name, a, c in zip(("row_max", "row_sum", "out"), two, one, strict=True):
        if not close(a, c, dtype):
            raise CheckFailure(t(
                "Two steps of your tile_step (a block of {k_block} keys, then another) do not give the state of one "
                "step over all {keys} keys: {name} differs ({difference}). {hint}", k_block=k_block,
                keys=2 * k_block, name=name, difference=difference(a, c, _tile_sizes_text(q, k1, v1)),
                hint=_tile_hint(two, (q, k2, v2, None, *first), None)))
    _check_tiled_forward(fn, s, dtype, g)
    passed(t("tile_step folds a block into a running state (rescaling row_sum and out by exp(old max − new max)); two "
             "steps equal one over both blocks; a causal attention folded from your steps equals "
             "F.scaled_dot_product_attention, with partial last blocks ({dtype})", dtype=dtype_name(dtype)))


def _check_tiled_forward(fn: Callable[..., Any], s: dict[str, int], dtype: torch.dtype, g: torch.Generator) -> None:
    """Causal attention with the queries the last q_len of k_len positions, folded tile by tile with the student's
    step (each tile's part of the causal mask as allowed), against PyTorch's fused attention."""
    b, h, block_q, block_k = s["batch"], s["heads"], s["q_block"], s["k_block"]
    q_len = 2 * block_q + 1  # a last query block of one row
    k_len = q_len + block_k + 1
    k_len += 1 if k_len % block_k == 0 else 0  # a shorter last key block
    q = torch.randn(b, h, q_len, s["d_k"], generator=g, dtype=dtype)
    k = torch.randn(b, h, k_len, s["d_k"], generator=g, dtype=dtype)
    v = torch.randn(b, h, k_len, s["d_v"], generator=g, dtype=dtype)
    causal = causal_lower_right(q_len, k_len)._materialize()
    outputs = []
    for q_start in range(0, q_len, block_q):
        rows = slice(q_start, q_start + block_q)
        state = _initial(q[..., rows, :], v)
        for k_start in range(0, k_len, block_k):
            cols = slice(k_start, k_start + block_k)
            what = t("the tile of queries {first_query}.. and keys {first_key}.. of a causal attention "
                     "(q_len={q_len}, k_len={k_len})", first_query=rows.start, first_key=cols.start, q_len=q_len,
                     k_len=k_len)
            args = (q[..., rows, :], k[..., cols, :], v[..., cols, :], causal[rows, cols], *state)
            state = _step(fn, args, what)
        outputs.append(state[2] / rearrange(state[1], "... q_block -> ... q_block 1"))
    got = torch.cat(outputs, dim=-2)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    if not close(got, expected, dtype):
        raise CheckFailure(t(
            "A causal attention (q_len={q_len}, k_len={k_len}, the queries the last q_len positions) folded tile by "
            "tile with your tile_step, blocks of {block_q} queries and {block_k} keys, each tile's part of the causal "
            "mask as allowed, and out / row_sum at the end, differs from F.scaled_dot_product_attention(q, k, v, "
            "attn_mask=causal) ({difference}). Each tile on its own passed the checks above, so look "
            "at what carries over between tiles: the state you return is the next step's input.", q_len=q_len,
            k_len=k_len, block_q=block_q, block_k=block_k, difference=difference(got, expected)))


# -- exercise 3: the tiles a causal attention computes -------------------------------------------------------

def _visits_oracle(q_len: int, k_len: int, block_q: int, block_k: int) -> Tensor:
    """PyTorch's lower-right causal mask (the queries the last q_len positions), padded to whole tiles with False,
    and ``any`` over each tile."""
    causal = causal_lower_right(q_len, k_len)._materialize()
    q_blocks, k_blocks = -(-q_len // block_q), -(-k_len // block_k)
    padded = F.pad(causal, (0, k_blocks * block_k - k_len, 0, q_blocks * block_q - q_len), value=False)
    return reduce(padded, "(q_blocks block_q) (k_blocks block_k) -> q_blocks k_blocks", "any",
                  block_q=block_q, block_k=block_k)


def _visits_variant(q_len: int, k_len: int, block_q: int, block_k: int, mistake: str) -> Tensor:
    """The tiles with one usual mistake, from the blocks' first and last positions."""
    offset = 0 if mistake == "no offset" else k_len - q_len
    first_query = torch.arange(0, q_len, block_q)
    last_query = (first_query + block_q - 1).clamp(max=q_len - 1)
    if mistake == "first query":
        last_query = first_query
    if mistake == "last query + 1":
        last_query = (first_query + block_q).clamp(max=q_len - 1)
    first_key = torch.arange(0, k_len, block_k)
    if mistake == "last key":
        first_key = (first_key + block_k - 1).clamp(max=k_len - 1)
    if mistake == "strict":  # first_key < reads_up_to, the same tiles as first keys counted one position late
        first_key = first_key + 1
    return rearrange(first_key, "k_blocks -> 1 k_blocks") <= rearrange(last_query + offset, "q_blocks -> q_blocks 1")


VISIT_MISTAKES = {
    "no offset": marked("You placed the queries at positions 0 .. q_len − 1: they are the last q_len of k_len "
                        "positions (chapter 02's causal_mask), so query i sits at position i + k_len − q_len and "
                        "reads keys up to there."),
    "first query": marked("You decided each tile by the first query of its block: a tile is needed when ANY of its "
                          "queries may read one of its keys, and the query that reads furthest is the last query of "
                          "the block."),
    "last key": marked("You asked whether the block's last key is readable, i.e. whether the whole tile is unmasked: "
                       "a tile is needed as soon as its first key is readable by the block's last query (a partly "
                       "masked tile on the diagonal is computed too)."),
    "last query + 1": marked("Your blocks' last queries are off by one: each tile is decided as if the block's last "
                             "query sat one position later, (a + 1)·block_q instead of (a + 1)·block_q − 1 (capped at "
                             "q_len − 1), so you compute tiles that no query of the block may read."),
    "strict": marked("You skip each tile whose first key is exactly the last key its block's queries may read: a tile "
                     "is needed when its first key <= that position, equality included. A strict first_key < "
                     "reads_up_to, or first keys shifted by one (counted from 1), skips exactly these tiles."),
}


def _grid(mask: Tensor) -> str:
    """A small boolean matrix as rows of 0 and 1."""
    return "\n".join("    " + " ".join("1" if v else "0" for v in row.tolist()) for row in mask)


def _same_axis_hint(fn: Callable[..., Any], shape: tuple[int, ...]) -> str:
    """A result of one row or one column: with as many query blocks as key blocks, is it still one row or column?"""
    try:
        square = call(fn, 12, 12, 3, 3)
    except CheckFailure:
        square = None
    if type(square) is not Tensor or tuple(square.shape) not in ((4, 1), (1, 4)):
        return ""
    if shape:
        return t("Your result has shape {shape}, and with as many query blocks as key blocks, "
                 "causal_block_visits(12, 12, 3, 3), gives shape {square} instead of (4, 4): the result never spreads "
                 "over a (q_blocks, k_blocks) grid, as when the two sides of the comparison lie along the same axis; "
                 "they broadcast to a grid only when one lies along each. Rearrange the first keys to (1, k_blocks) "
                 "and the last readable positions to (q_blocks, 1).", shape=shape, square=tuple(square.shape))
    return t("Your code raises the error above, and with as many query blocks as key blocks, "
             "causal_block_visits(12, 12, 3, 3), gives shape {square} instead of (4, 4): the result never spreads "
             "over a (q_blocks, k_blocks) grid, as when the two sides of the comparison lie along the same axis; "
             "they broadcast to a grid only when one lies along each. Rearrange the first keys to (1, k_blocks) "
             "and the last readable positions to (q_blocks, 1).", square=tuple(square.shape))


def _expect_visits(fn: Callable[..., Any], q_len: int, k_len: int, block_q: int, block_k: int, what: str) -> None:
    try:
        got = call(fn, q_len, k_len, block_q, block_k)
    except CheckFailure as failure:
        raise CheckFailure(_then(failure, _visits_error_hint(fn, failure, (q_len, k_len, block_q, block_k)))) \
            from failure
    expected = _visits_oracle(q_len, k_len, block_q, block_k)
    shape = tuple(expected.shape)
    call_text = t("causal_block_visits(q_len={q_len}, k_len={k_len}, block_q={block_q}, block_k={block_k}) ({what})",
                  q_len=q_len, k_len=k_len, block_q=block_q, block_k=block_k, what=what)
    if type(got) is not Tensor:
        raise CheckFailure(t("{call} should return a torch.Tensor of booleans, got {kind}.", call=call_text,
                             kind=kind(got)))
    if tuple(got.shape) != shape:
        q_blocks, k_blocks = shape
        if tuple(got.shape) == (k_blocks, q_blocks):
            hint = t("Your result is transposed: rows are query blocks, columns key blocks.")
        elif tuple(got.shape) in ((q_blocks + 1, k_blocks), (q_blocks, k_blocks + 1)) and got.shape[0] != q_blocks:
            hint = t("The number of query blocks is off by one, one too many: ⌈q_len / block_q⌉ = {q_blocks} query "
                     "blocks and ⌈k_len / block_k⌉ = {k_blocks} key blocks. Look at where the range of your blocks' "
                     "last queries stops.", q_blocks=q_blocks, k_blocks=k_blocks)
        elif tuple(got.shape) in ((q_blocks + 1, k_blocks), (q_blocks, k_blocks + 1)):
            hint = t("The number of key blocks is off by one, one too many: ⌈q_len / block_q⌉ = {q_blocks} query "
                     "blocks and ⌈k_len / block_k⌉ = {k_blocks} key blocks. Look at where the range of your blocks' "
                     "first keys stops.", q_blocks=q_blocks, k_blocks=k_blocks)
        elif q_blocks > 1 and tuple(got.shape) in ((q_blocks, 1), (1, k_blocks), (k_blocks, 1), (1, q_blocks)):
            hint = _same_axis_hint(fn, tuple(got.shape)) or t("There is one row per query block and one column "
                                                              "per key block, ⌈length / block⌉ of each.")
        elif tuple(got.shape) in ((q_len // block_q, k_len // block_k), (q_len // block_q, k_blocks),
                                  (q_blocks, k_len // block_k)):
            hint = t("The last query block is partial: with integer division a last block shorter than the others "
                     "is dropped (and a block longer than the length gives none). There are ⌈q_len / block_q⌉ query "
                     "blocks, -(-q_len // block_q), and ⌈k_len / block_k⌉ key blocks; the last of each may be "
                     "shorter.")
        else:
            hint = t("There is one row per query block and one column per key block, ⌈length / block⌉ of each.")
        raise CheckFailure(t("{call} should have shape (q_blocks, k_blocks) = {expected}; got {shape}. {hint}",
                             call=call_text, expected=shape, shape=tuple(got.shape), hint=hint))
    if got.dtype != torch.bool:
        raise CheckFailure(t("{call} should return booleans (True = compute the tile), got dtype {dtype}: "
                             "a comparison such as first_key <= reads_up_to gives them.", call=call_text,
                             dtype=got.dtype))
    if torch.equal(got, expected):
        return
    hint = next((tr(text) for mistake, text in VISIT_MISTAKES.items()
                 if torch.equal(got, _visits_variant(q_len, k_len, block_q, block_k, mistake))),
                t("A tile (a, b) is computed when the last query of block a, at position min((a + 1)·block_q, q_len) "
                  "− 1 + k_len − q_len, may read the first key of block b, at b·block_k."))
    if got.numel() <= 80:
        raise CheckFailure(t("{call} marks the wrong tiles (rows: query blocks, columns: key blocks):\n  yours:\n"
                             "{yours}\n  expected:\n{expected}\n{hint}", call=call_text, yours=_grid(got),
                             expected=_grid(expected), hint=hint))
    raise CheckFailure(t("{call} marks the wrong tiles (rows: query blocks, columns: key blocks): ({wrong} of {tiles} "
                         "tiles differ) {hint}", call=call_text, wrong=int((got != expected).sum()),
                         tiles=got.numel(), hint=hint))


def _visits_error_hint(fn: Callable[..., Any], failure: CheckFailure, args: tuple[int, int, int, int]) -> str:
    """After valid sizes raised: a ValueError, does a length of 0 raise none (then the test is inverted)? Another
    error: does the result with as many query blocks as key blocks lie along one axis?"""
    if min(args) < 1 or args[1] < args[0]:
        return ""
    if raised_error(failure) != "ValueError":
        hint = _same_axis_hint(fn, ())
        return " " + hint if hint else ""
    zero = (0, *args[1:])
    if call(_error_of, fn, *zero) == "ValueError":
        return ""
    return t(" Every length and block here is at least 1, while causal_block_visits{zero} raises no ValueError: your "
             "test is inverted. Raise when min(q_len, k_len, block_q, block_k) < 1.", zero=zero)


def _expect_value_error(fn: Callable[..., Any], args: tuple[int, int, int, int], why: str) -> None:
    error = call(_error_of, fn, *args)
    if error != "ValueError":
        q_len, k_len, block_q, block_k = args
        hint = ""
        if min(args) == 0 and k_len >= q_len:
            # Which sizes below 1 it does refuse: all four at 0, or the same one at -1.
            slot = args.index(0)
            negative = tuple(-1 if i == slot else a for i, a in enumerate(args))
            if call(_error_of, fn, 0, 0, 0, 0) == "ValueError":
                hint = t(" It does raise for causal_block_visits(0, 0, 0, 0), all four below 1: the test must fire "
                         "when any one of them is below 1, min(q_len, k_len, block_q, block_k) < 1, not only when the "
                         "largest of them is.")
            elif call(_error_of, fn, *negative) == "ValueError":
                hint = t(" It does raise for causal_block_visits{negative}: your test lets 0 through, but 0 is below "
                         "1 too (an empty length or block). Raise when min(q_len, k_len, block_q, block_k) < 1.",
                         negative=negative)
        if error is None:
            raise CheckFailure(t("causal_block_visits(q_len={q_len}, k_len={k_len}, block_q={block_q}, "
                                 "block_k={block_k}) should raise a ValueError ({why}); it raised no error.{hint}",
                                 q_len=q_len, k_len=k_len, block_q=block_q, block_k=block_k, why=why, hint=hint))
        raise CheckFailure(t("causal_block_visits(q_len={q_len}, k_len={k_len}, block_q={block_q}, block_k={block_k}) "
                             "should raise a ValueError ({why}); it raised a {error}.{hint}", q_len=q_len,
                             k_len=k_len, block_q=block_q, block_k=block_k, why=why, error=error, hint=hint))


def _visit_sizes(seed: int) -> tuple[int, int, int]:
    """Two distinct block sizes (2 to 5) and a length that both divide."""
    g = torch.Generator().manual_seed(seed + 71)
    block_q, block_k = draw_sizes(g, ("block_q", "block_k"), span=4).values()
    length = math.lcm(block_q, block_k) * int(torch.randint(1, 3, (1,), generator=g))
    length *= 2 if length < 8 else 1
    return length, block_q, block_k


@check
def check_causal_block_visits_square(fn: Callable[..., Any], seed: int = 0) -> None:
    """q_len == k_len with block sizes that divide the length (block_q != block_k, equal, 1); lengths or block sizes
    below 1 raise ValueError."""
    n, block_q, block_k = _visit_sizes(seed)
    for args, what in (((n, n, block_q, block_k), t("square, blocks that divide the length")),
                       ((n, n, block_k, block_q), t("square, the block sizes the other way round")),
                       ((n, n, block_q, block_q), t("square, equal blocks")),
                       ((7, 7, 1, 1), t("blocks of one position: the causal mask itself"))):
        _expect_visits(fn, *args, what)
    for args, why in (((0, n, block_q, block_k), t("q_len must be at least 1")),
                      ((n, n, 0, block_k), t("block_q must be at least 1")),
                      ((n, n, block_q, -1), t("block_k must be at least 1"))):
        _expect_value_error(fn, args, why)
    passed(t("causal_block_visits for square causal attention (n = {n}, blocks of {block_q} and {block_k}, equal "
             "blocks, blocks of 1); lengths and blocks below 1 raise ValueError", n=n, block_q=block_q,
             block_k=block_k))


@check
def check_causal_block_visits_partial(fn: Callable[..., Any], seed: int = 0) -> None:
    """q_len == k_len with block sizes that do not divide the length (partial last blocks) and block sizes larger
    than the length."""
    g = torch.Generator().manual_seed(seed + 73)
    block_q, block_k = draw_sizes(g, ("block_q", "block_k"), span=4, first=3).values()
    n = next(m for m in range(int(torch.randint(13, 30, (1,), generator=g)), 100) if m % block_q and m % block_k)
    for args, what in (((n, n, block_q, block_k), t("square, blocks that do not divide the length")),
                       ((n, n, block_k, block_q), t("square, the block sizes the other way round")),
                       ((n, n, n + 2, block_k), t("a query block longer than the length: one query block")),
                       ((n, n, block_q, n + 5), t("a key block longer than the length: one key block")),
                       ((block_q + 1, block_q + 1, block_q, 1), t("a last query block of one query"))):
        _expect_visits(fn, *args, what)
    passed(t("causal_block_visits with partial last blocks (n = {n}, blocks of {block_q} and {block_k}) and blocks "
             "longer than the length", n=n, block_q=block_q, block_k=block_k))


@check
def check_causal_block_visits_offset(fn: Callable[..., Any], seed: int = 0) -> None:
    """q_len < k_len, the queries the last q_len of k_len positions: with blocks that divide the lengths and that do
    not, one query (decoding), and a prefill; k_len < q_len raises ValueError."""
    g = torch.Generator().manual_seed(seed + 79)
    block_q, block_k = draw_sizes(g, ("block_q", "block_k"), span=4).values()
    q_len = block_q * int(torch.randint(2, 4, (1,), generator=g))
    k_len = q_len + block_k * int(torch.randint(2, 4, (1,), generator=g))
    # An offset of block_q - 1 would make "the first query, placed k_len - q_len later" equal "the last query, placed
    # at 0": two different mistakes could not be told apart.
    k_len += block_k if k_len - q_len == block_q - 1 else 0
    cases = (((q_len, k_len, block_q, block_k), t("the queries the last q_len positions")),
             ((q_len + 1, k_len + 2, block_q, block_k), t("the same with partial last blocks")),
             ((q_len, q_len + 1, block_k, block_q), t("one position cached before the queries")),
             ((1, k_len + 1, 4, block_k), t("decoding: one query, the last position")),
             ((block_q + 1, 4 * block_q + 3, block_q, block_q + 1), t("a prefill after a longer cache")))
    for args, what in cases:
        _expect_visits(fn, *args, what)
    _expect_value_error(fn, (k_len, q_len, block_q, block_k), t("k_len must be at least q_len: the queries are the "
                                                                "last q_len of k_len positions"))
    passed(t("causal_block_visits with the queries the last q_len of k_len positions (q_len={q_len}, "
             "k_len={k_len}), partial blocks, decoding and a prefill; k_len < q_len raises ValueError", q_len=q_len,
             k_len=k_len))
