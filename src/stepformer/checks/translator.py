"""Checks for chapter 11: the label-smoothed loss, the learning-rate schedule, one training step,
one step of beam search, and memorising a batch.

The oracles: PyTorch's ``F.cross_entropy(..., ignore_index=pad_id, label_smoothing=...)`` for the
loss; the paper's formula, ``d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)``, for the schedule;
the recipe's step written out here (PyTorch's loss, ``clip_grad_norm_``, the optimiser's own step) on
a twin of the student's model for the step; every ``beam · vocab`` candidate sorted by hand for the
beam step; greedy decoding of the memorised weights, written out here. The models are PyTorch's
``nn.Transformer`` with embeddings and an output layer, built here (the student trains them, never
builds them), so the checks need none of the course's reference code. Every touch of the student's
code goes through :func:`call`.
"""

import contextlib
import inspect
import linecache
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    call,
    check,
    close,
    difference,
    dtype_name,
    kind,
    one_thread,
    passed,
    raised_error,
)
from stepformer.checks._messages import language, marked, t, tr
from stepformer.checks._modules import error_of as _error_of
from stepformer.checks._modules import parameters_of as _parameters_of

# The loss is what exercise 1 asks students to write: PyTorch's versions of it are off limits there,
# and in the exercises whose code calls the student's loss (the step, memorising).
BUILT_IN_LOSS = {
    "torch.nn.functional.cross_entropy": marked("PyTorch's cross-entropy, which does the smoothing and the padding"),
    "torch.nn.functional.nll_loss": marked("PyTorch's negative log-likelihood loss"),
    "torch.nn.CrossEntropyLoss": marked("PyTorch's cross-entropy module"),
    "torch.nn.NLLLoss": marked("PyTorch's negative log-likelihood module"),
}


def _distinct(g: torch.Generator, ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """One draw from each inclusive range, all different (so a swapped axis cannot pass)."""
    while True:
        picks = tuple(int(torch.randint(low, high + 1, (), generator=g)) for low, high in ranges)
        if len(set(picks)) == len(picks):
            return picks


def _lengths(batch: int, longest: int, shortest: int, g: torch.Generator) -> list[int]:
    """Sentence lengths: the first sentence as long as the batch, the others between shortest and longest."""
    rest = torch.randint(shortest, longest + 1, (batch - 1,), generator=g).tolist()
    return [longest, *rest]


# -- what the student's code did, seen from inside (each run through call(), so recorded and replayed) --------

def _then(failure: CheckFailure, hint: str) -> CheckFailure:
    """The failure's message with ``hint`` after it, as a sentence of its own."""
    text = str(failure).rstrip()
    # A Chinese message may end in either full stop.
    if not hint or text.endswith((".", "。") if language() == "zh" else "."):
        return failure.reworded(text + hint)
    return failure.reworded(t("{failure}.{hint}", failure=text, hint=hint))


def _raised_at(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str] | None:
    """The function and the line of the student's own code (the notebook's, not a library's) where
    ``fn(*args, **kwargs)`` raises: the deepest of the notebook's frames."""
    home = getattr(inspect.unwrap(fn), "__globals__", None)
    try:
        fn(*args, **kwargs)
    except Exception as error:  # which line raised is the answer
        found = None
        for frame, lineno in traceback.walk_tb(error.__traceback__):
            line = linecache.getline(frame.f_code.co_filename, lineno).strip()
            if frame.f_globals is home and line:
                found = (frame.f_code.co_name, line)
        return found
    return None


def _where(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """' The line that raised it, in f: `...`.' for a failure that the student's code raised, else ''."""
    found = call(_raised_at, fn, *args, **kwargs)
    if type(found) is not tuple or len(found) != 2:
        return ""
    name, line = found
    return t(" The line that raised it, in {name}: `{line}`.", name=name, line=line) if name.isidentifier() else \
        t(" The line that raised it: `{line}`.", line=line)


def _unchecked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` called without its jaxtyping and beartype wrapper: what it returns, whatever the annotations say."""
    return inspect.unwrap(fn)(*args, **kwargs)


@contextlib.contextmanager
def _spying(fn: Callable[..., Any], names: tuple[str, ...],
            seen: dict[str, list[tuple[tuple, dict]]]) -> Iterator[None]:
    """Within the block, the student's functions called ``names`` by ``fn`` (through its globals) note their
    arguments in ``seen[name]``; the notebook's names are given back afterwards."""
    home = getattr(inspect.unwrap(fn), "__globals__", {})
    saved = {name: home[name] for name in names if callable(home.get(name))}

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            seen[name].append((args, kwargs))
            return original(*args, **kwargs)
        return noted

    try:
        for name, original in saved.items():
            seen[name] = []
            home[name] = spy(name, original)
        yield
    finally:
        home.update(saved)


# -- the models the student trains -----------------------------------------------------------

class _Translator(nn.Module):
    """An encoder-decoder from PyTorch's own pieces: embeddings scaled by sqrt(d_model) plus sinusoids,
    ``nn.Transformer`` (post-norm, no dropout), an output layer. ``model(src, tgt)`` gives the logits
    ``(batch, tgt_len, tgt_vocab)`` of the next token at each target position, as the course's model does."""

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int, heads: int, d_ff: int, pad_id: int) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.src_tokens = nn.Embedding(src_vocab, d_model)
        self.tgt_tokens = nn.Embedding(tgt_vocab, d_model)
        self.transformer = nn.Transformer(d_model, heads, 1, 1, d_ff, dropout=0.0, batch_first=True)
        self.transformer.encoder.use_nested_tensor = False  # its padding-free fast path warns in eval mode
        self.generator = nn.Linear(d_model, tgt_vocab)
        position = torch.arange(_MAX_POSITIONS, dtype=torch.float64)[:, None]
        angle = position * torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(1e4) / d_model))
        table = rearrange(torch.stack([angle.sin(), angle.cos()]), "pair seq half -> seq (half pair)")
        self.register_buffer("positions", table, persistent=False)

    def _embed(self, tokens: Int[Tensor, "batch seq"], table: nn.Embedding) -> Float[Tensor, "batch seq d_model"]:
        x = table(tokens) * math.sqrt(table.embedding_dim)
        return x + self.positions[: tokens.shape[1]].to(x.dtype)

    def forward(self, src: Int[Tensor, "batch src_len"],
                tgt: Int[Tensor, "batch tgt_len"]) -> Float[Tensor, "batch tgt_len tgt_vocab"]:
        dtype = self.generator.weight.dtype
        # PyTorch's masks say True = "may not attend", the reverse of the course's.
        padding = src == self.pad_id
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=dtype)
        hidden = self.transformer(self._embed(src, self.src_tokens), self._embed(tgt, self.tgt_tokens), tgt_mask=causal,
                                  src_key_padding_mask=padding, memory_key_padding_mask=padding)
        return self.generator(hidden)

    def __repr__(self) -> str:  # one line in a failure's message, not the whole module tree
        return (f"Transformer(src_vocab={self.src_tokens.num_embeddings}, tgt_vocab={self.generator.out_features}, "
                f"d_model={self.generator.in_features}, 1 + 1 layers)")


_MAX_POSITIONS = 64


def _build(vocab: tuple[int, int], d_model: int, heads: int, d_ff: int, pad_id: int, seed: int,
           dtype: torch.dtype) -> _Translator:
    """A seeded 1 + 1 layer Transformer without dropout; the caller's random numbers are left as they were."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _Translator(vocab[0], vocab[1], d_model, heads, d_ff, pad_id)
    return model.to(dtype)


def _load(model: _Translator, params: dict[str, Tensor]) -> _Translator:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


@torch.no_grad()
def _greedy(model: _Translator, src: Int[Tensor, "batch src_len"], bos_id: int, eos_id: int) -> list[list[int]]:
    """The most likely next token at every step, the whole prefix re-read each time; each sentence without
    ``<s>`` and ``</s>``. At most src_len + 10 tokens, as the course's decoders allow."""
    model.eval()
    tokens = torch.full((src.shape[0], 1), bos_id)
    for _ in range(src.shape[1] + 10):
        tokens = torch.cat([tokens, model(src, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        if bool((tokens == eos_id).any(dim=1).all()):
            break
    rows = []
    for row in tokens[:, 1:].tolist():
        rows.append(row[: row.index(eos_id)] if eos_id in row else row)
    return rows


# -- exercise 1: the label-smoothed loss ---------------------------------------------------

def _loss_sizes(seed: int) -> tuple[int, int, int]:
    """(batch, tgt_len, vocab), pairwise distinct."""
    if seed == 0:
        return 3, 5, 11
    return _distinct(torch.Generator().manual_seed(seed), ((2, 5), (3, 9), (6, 16)))


def _pad_id(seed: int, vocab: int) -> int:
    return 0 if seed % 2 == 0 else vocab - 1


def _loss_inputs(seed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """Logits, and targets whose sentences end at different places, padded after."""
    batch, tgt_len, vocab = _loss_sizes(seed)
    g = torch.Generator().manual_seed(seed + 1)
    pad_id = _pad_id(seed, vocab)
    logits = 2 * torch.randn(batch, tgt_len, vocab, generator=g, dtype=dtype)
    words = torch.tensor([t for t in range(vocab) if t != pad_id])
    target = words[torch.randint(len(words), (batch, tgt_len), generator=g)]
    for b, n in enumerate(_lengths(batch, tgt_len, 1, g)):
        target[b, n:] = pad_id
    target[-1, tgt_len // 2:] = pad_id  # padding in every batch
    return logits, target, pad_id


def _oracle_loss(logits: Tensor, target: Tensor, pad_id: int, smoothing: float, reduction: str) -> Tensor:
    """PyTorch's cross-entropy with smoothing, padding ignored; 0 when every target is padding."""
    if not bool((target != pad_id).any()):
        return torch.zeros((), dtype=logits.dtype)
    return F.cross_entropy(rearrange(logits, "batch tgt_len vocab -> (batch tgt_len) vocab"),
                           rearrange(target, "batch tgt_len -> (batch tgt_len)"),
                           ignore_index=pad_id, label_smoothing=smoothing, reduction=reduction)


def _loss_variant(logits: Tensor, target: Tensor, pad_id: int, smoothing: float, reduction: str, *,
                  log: bool = True, spread: str = "all", mask_sum: bool = True, count: str = "real") -> Tensor:
    """The loss written out, with switches for the usual mistakes (to name them)."""
    vocab = logits.shape[-1]
    probs = torch.log_softmax(logits, dim=-1) if log else torch.softmax(logits, dim=-1)
    picked = -probs.gather(-1, target[..., None])[..., 0]
    if spread == "others":  # smoothing / (vocab - 1) on every token but the target
        uniform = (-probs.sum(dim=-1) - picked) / (vocab - 1)
    elif spread == "none":
        uniform = picked
    elif spread == "dropped":
        uniform = torch.zeros_like(picked)
    else:
        uniform = -probs.mean(dim=-1)
    per_token = (1 - smoothing) * picked + smoothing * uniform
    real = target != pad_id
    total = per_token.masked_fill(~real, 0.0).sum() if mask_sum else per_token.sum()
    if reduction == "sum":
        return total
    return total / (real.sum().clamp(min=1) if count == "real" else target.numel())


def _diagnose_loss(fn: Callable[..., Any], logits: Tensor, target: Tensor, pad_id: int, smoothing: float,
                   reduction: str, got: Tensor) -> str:
    if not bool(torch.isfinite(got)):
        return _non_finite_loss(fn, logits, target, pad_id, smoothing, reduction, got)
    other = "sum" if reduction == "mean" else "mean"
    variants = {
        marked("You averaged over padded positions too: divide the sum over real tokens by the number of real "
               "(non-padding) target tokens, not by batch · tgt_len."): dict(count="all"),
        marked("Your sum includes the padded positions: their losses must count for nothing (mask them out before "
               "summing), as ignore_index does."): dict(mask_sum=False),
        marked("Your loss ignores padding altogether: padded positions count neither in the sum nor in the number of "
               "tokens."): dict(mask_sum=False, count="all"),
        marked("You spread the smoothing over the vocab - 1 other tokens. PyTorch's convention (label_smoothing, and "
               "this exercise's) spreads it over all vocab classes, the target included: 1 - smoothing on the target "
               "plus smoothing / vocab on every token, so the smoothing term is the mean of -log p over the whole "
               "vocabulary."): dict(spread="others"),
        marked("Your loss ignores the smoothing: each position's loss is (1 - smoothing) · (-log p[target]) + "
               "smoothing · (the mean of -log p over the vocabulary)."): dict(spread="none"),
        marked("Your loss is (1 - smoothing) · (-log p[target]) alone: the smoothing term, smoothing · (the mean over "
               "the vocabulary of -log p), is missing."): dict(spread="dropped"),
        marked("You used probabilities (softmax) where the loss needs log-probabilities: -log p[target], with "
               "torch.log_softmax."): dict(log=False),
    }
    for hint, mistake in variants.items():
        if close(got, _loss_variant(logits, target, pad_id, smoothing, reduction, **mistake).to(got.dtype),
                 got.dtype):
            return tr(hint)
    if close(got, _oracle_loss(logits, target, pad_id, smoothing, other).to(got.dtype), got.dtype):
        return t("Your result for reduction={reduction!r} is what reduction={other!r} should give: 'sum' is the sum "
                 "over real tokens, 'mean' that sum divided by their number.", reduction=reduction, other=other)
    term = _loss_term_hint(fn, logits, target, pad_id, smoothing, reduction, got)
    if term:
        return term
    return t("Each real position's loss is (1 - smoothing) · (-log p[target]) + smoothing · mean over the vocabulary "
             "of (-log p), with log p = log_softmax(logits); sum it over the positions whose target is not pad_id, "
             "and for 'mean' divide by their number.")


def _non_finite_loss(fn: Callable[..., Any], logits: Tensor, target: Tensor, pad_id: int, smoothing: float,
                     reduction: str, got: Tensor) -> str:
    """A loss that is not finite: where it comes from, found by calling ``fn`` again with one thing changed
    (no padded target, then smaller logits); where neither tells, what was seen and where to look."""
    def finite(of: Tensor, at: Tensor) -> Tensor | None:
        try:
            value = call(fn, of, at, pad_id, smoothing=smoothing, reduction=reduction)
        except CheckFailure:
            return None
        ok = type(value) is Tensor and value.dim() == 0 and bool(torch.isfinite(value))
        return value if ok else None

    loss, largest = got.item(), logits.abs().max().item()
    padded = target == pad_id
    if bool(padded.any()):
        real_id = (pad_id + 1) % logits.shape[-1]
        unpadded = target.masked_fill(padded, real_id)
        value = finite(logits, unpadded)
        if value is not None:
            return t("You returned the loss {loss} for these logits (largest |logit| {largest:.3g}), and {value:.6g} "
                     "for the same logits with every padded target replaced by a real token ({padded} positions): "
                     "the padded positions reach the sum as -inf or NaN. Fill their per-position losses with 0, not "
                     "-inf, before summing, so that they count for nothing.", loss=loss, largest=largest,
                     value=value.item(), padded=int(padded.sum()))
    value = finite(logits / 100, target)
    if value is not None:
        return t("You returned the loss {loss} for these logits (largest |logit| {largest:.3g}), and {value:.6g} for "
                 "the same logits divided by 100: something overflows or reaches log(0) when logits are large. "
                 "torch.log_softmax computes log-probabilities without either (log of a softmax, or exp then log, "
                 "does not).", loss=loss, largest=largest, value=value.item())
    return t("You returned the loss {loss} for these logits (largest |logit| {largest:.3g}), and not finite either "
             "with no padded target or with logits divided by 100. Look for a log of 0 or a division by 0 in your "
             "loss.", loss=loss, largest=largest)


def _loss_term_hint(fn: Callable[..., Any], logits: Tensor, target: Tensor, pad_id: int, smoothing: float,
                    reduction: str, got: Tensor) -> str:
    """A term of the loss that does not follow the logits as it must, found by calling ``fn`` on other logits."""
    def loss(of: Tensor, at: float) -> Any:
        try:
            value = call(fn, of, target, pad_id, smoothing=at, reduction=reduction)
        except CheckFailure:
            return None
        return value.to(got.dtype) if type(value) is Tensor and value.dim() == 0 else None

    # The target's logit raised by 1 everywhere: -log p[target] falls, so the right loss moves.
    lifted = logits + F.one_hot(target, logits.shape[-1]).to(logits.dtype)
    moved = _oracle_loss(lifted, target, pad_id, smoothing, reduction).to(got.dtype)
    again = loss(lifted, smoothing)
    if again is not None and close(again, got, got.dtype) and not close(moved, got, got.dtype):
        return t("Raising every target's logit by 1 leaves your loss at {got:.6g}, where the right loss moves to "
                 "{moved:.6g}: your loss does not read -log p[target], so its term (1 - smoothing) · (-log p[target]) "
                 "is missing.", got=got.item(), moved=moved.item())
    if smoothing == 0:
        return ""
    # Which part the smoothing adds, on these logits and on others: (loss - (1 - smoothing) · loss at 0) / smoothing.
    other = (0.5 * logits).flip(-1)
    parts = []
    for of in (logits, other):
        plain = loss(of, 0.0)
        smoothed = got if of is logits else loss(of, smoothing)
        right_plain = _oracle_loss(of, target, pad_id, 0.0, reduction).to(got.dtype)
        if plain is None or smoothed is None or not close(plain, right_plain, got.dtype):
            return ""
        right = _oracle_loss(of, target, pad_id, smoothing, reduction).to(got.dtype)
        parts.append(((smoothed - (1 - smoothing) * plain) / smoothing, (right - (1 - smoothing) * plain) / smoothing))
    (mine, right), (mine_other, right_other) = parts
    if close(mine, mine_other, got.dtype, tolerance=1e-4) and not close(right, right_other, got.dtype,
                                                                        tolerance=1e-4):
        return t("The part that smoothing adds to your loss, (loss - (1 - smoothing) · loss at smoothing 0) / "
                 "smoothing, is {mine:.4g} on these logits and on other ones alike, where the mean over the "
                 "vocabulary of -log p gives {right:.4g} and {right_other:.4g}: your smoothing term does not depend on "
                 "the logits, so the mean of -log p over the vocabulary is missing from it.", mine=mine.item(),
                 right=right.item(), right_other=right_other.item())
    return ""


_SQUARE = 6  # batch = tgt_len = vocab: a mixed-up axis runs there, and shows what it does


def _loss_error_hint(fn: Callable[..., Any], dtype: torch.dtype) -> str:
    """After ``fn`` raised: run it where batch, tgt_len and vocab are equal, and name the mixed-up axis it matches."""
    n = _SQUARE
    g = torch.Generator().manual_seed(n)
    logits = 2 * torch.randn(n, n, n, generator=g, dtype=dtype)
    target = torch.randint(1, n, (n, n), generator=g)
    target[-1, n // 2:] = 0
    try:
        got = call(fn, logits, target, 0, smoothing=0.1, reduction="mean")
    except CheckFailure as failure:
        return _where(fn, logits, target, 0, smoothing=0.1, reduction="mean") if raised_error(failure) else ""
    if type(got) is not Tensor or got.dim() != 0:
        return ""
    log_probs = torch.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(-1, target[..., None])[..., 0]
    uniform = -log_probs.mean(dim=-1)
    real = target != 0
    variants = {
        marked(" Where batch = tgt_len = vocab = {n} your function runs, and gives exactly the loss of taking the "
               "target's log-probability along dim -2, the positions, instead of the vocabulary: pick it with "
               "log_probs.gather(-1, target[..., None])."): -log_probs.gather(-2, target[..., None])[..., 0],
        marked(" Where batch = tgt_len = vocab = {n} your function runs, and gives exactly the loss of a mean over the "
               "vocabulary whose axes are swapped, (tgt_len, batch): reduce 'batch tgt_len vocab -> batch "
               "tgt_len'."): None,
    }
    for hint, picked in variants.items():
        per_token = 0.9 * nll + 0.1 * uniform.T if picked is None else 0.9 * picked + 0.1 * uniform
        wrong = per_token.masked_fill(~real, 0.0).sum() / real.sum()
        if close(got, wrong.to(got.dtype), got.dtype):
            return tr(hint, n=n)
    if close(got, _oracle_loss(logits, target, 0, 0.1, "mean").to(got.dtype), got.dtype):
        return t(" Where batch = tgt_len = vocab = {n} your function runs and gives the right loss: somewhere an axis "
                 "is taken in the wrong place, which only shows when the sizes differ (look at each dim= and einops "
                 "pattern).", n=n)
    return ""


def _expect_scalar(got: Any, what: str, dtype: torch.dtype) -> Tensor:
    """A 0-dimensional tensor in the logits' dtype, or in float32 (where the log-softmax may be computed)."""
    if type(got) is not Tensor:
        raise CheckFailure(t("{what} should be a torch.Tensor (a 0-dimensional one, so that .backward() works), got "
                             "{kind}.", what=what, kind=kind(got)))
    if got.dim() != 0:
        raise CheckFailure(t("{what} should be a single number (a 0-dimensional tensor), got shape {shape}: reduce "
                             "over every position.", what=what, shape=tuple(got.shape)))
    if got.dtype not in (dtype, torch.float32):
        raise CheckFailure(t("{what} should have dtype {dtype} like the logits (or float32), got {got}.", what=what,
                             dtype=dtype, got=got.dtype))
    return got


@check(forbid=BUILT_IN_LOSS)
def check_label_smoothed_loss(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to F.cross_entropy(ignore_index=pad_id, label_smoothing=...) for several smoothings, 'mean' and 'sum'."""
    logits, target, pad_id = _loss_inputs(seed, dtype)
    batch, tgt_len, vocab = logits.shape
    for smoothing in (0.0, 0.1, 0.35):
        for reduction in ("mean", "sum"):
            what = f"smoothing={smoothing}, reduction={reduction!r}"
            try:
                result = call(fn, logits, target, pad_id, smoothing=smoothing, reduction=reduction)
            except CheckFailure as failure:
                if not raised_error(failure):
                    raise
                raise _then(failure, _loss_error_hint(fn, dtype)) from None
            got = _expect_scalar(result, t("The loss with {what}", what=what), dtype)
            expected = _oracle_loss(logits, target, pad_id, smoothing, reduction)
            if not close(got, expected.to(got.dtype), got.dtype):
                real = int((target != pad_id).sum())
                raise CheckFailure(t(
                    "With {what} (batch={batch}, tgt_len={tgt_len}, vocab={vocab}, pad_id={pad_id}, {real} real "
                    "tokens of {total}), you returned the loss {got:.6g}; F.cross_entropy(..., ignore_index=pad_id, "
                    "label_smoothing={smoothing}, reduction={reduction!r}) gives {expected:.6g}. {diagnosis}",
                    what=what, batch=batch, tgt_len=tgt_len, vocab=vocab, pad_id=pad_id, real=real,
                    total=target.numel(), got=got.item(), smoothing=smoothing, reduction=reduction,
                    expected=expected.item(),
                    diagnosis=_diagnose_loss(fn, logits, target, pad_id, smoothing, reduction, got)))
    passed(t("label_smoothed_loss equals F.cross_entropy(ignore_index=pad_id, label_smoothing=...) for smoothing 0, "
             "0.1 and 0.35, reductions 'mean' and 'sum' ({dtype})", dtype=dtype_name(dtype)))


@check(forbid=BUILT_IN_LOSS)
def check_label_smoothed_loss_edges(fn: Callable[..., Any], seed: int = 0) -> None:
    """Large logits do not overflow; an all-padding batch gives 0, not NaN; smoothing outside [0, 1) raises."""
    logits, target, pad_id = _loss_inputs(seed, torch.float32)
    plain = _expect_scalar(call(fn, logits, target, pad_id, smoothing=0.1), t("The loss"), torch.float32)
    shifted = _expect_scalar(call(fn, logits + 100, target, pad_id, smoothing=0.1), t("The loss of logits + 100"),
                             torch.float32)
    if not bool(torch.isfinite(shifted)):
        raise CheckFailure(t(
            "With every logit raised by 100 your loss is {loss}: exp(100 + x) overflows float32. Adding a constant to "
            "all logits changes no probability: use torch.log_softmax, which subtracts the largest logit first, never "
            "exp then log.", loss=shifted.item()))
    if not close(shifted, plain, torch.float32, tolerance=1e-4):
        raise CheckFailure(t(
            "Adding 100 to every logit changes no probability, so it must not change the loss; yours goes from "
            "{plain:.6g} to {shifted:.6g}. Compute log-probabilities with torch.log_softmax.", plain=plain.item(),
            shifted=shifted.item()))
    empty = torch.full_like(target, pad_id)
    losses = {reduction: _expect_scalar(call(fn, logits, empty, pad_id, smoothing=0.1, reduction=reduction),
                                        t("The loss of an all-padding batch (reduction={reduction!r})",
                                          reduction=reduction), torch.float32)
              for reduction in ("mean", "sum")}
    for reduction, got in losses.items():
        if not bool(torch.isfinite(got)) or got.item() != 0.0:
            # 'sum' right and 'mean' not a number: the mean divided that 0 by a count of 0.
            hint = t(" Your 'sum' of it is 0, and your 'mean' divides that 0 by the number of real tokens, 0: divide "
                     "by the count clamped to at least 1, real.sum().clamp(min=1).") \
                if reduction == "mean" and losses["sum"].item() == 0.0 and bool(torch.isnan(got)) else ""
            raise CheckFailure(t(
                "When every target is pad_id there is nothing to learn, so the loss (reduction={reduction!r}) must be "
                "0; yours is {loss}.{hint}", reduction=reduction, loss=got.item(), hint=hint))
    for smoothing in (1.0, -0.1, 1.5):
        error = call(_error_of, fn, logits, target, pad_id, smoothing=smoothing)
        if error is None:
            raise CheckFailure(t(
                "label_smoothed_loss(..., smoothing={smoothing}) should raise a ValueError: smoothing is a share of "
                "the target's probability, in [0, 1) (at 1 nothing would be left for the right token); it raised no "
                "error.", smoothing=smoothing))
        if error != "ValueError":
            raise CheckFailure(t(
                "label_smoothed_loss(..., smoothing={smoothing}) should raise a ValueError: smoothing is a share of "
                "the target's probability, in [0, 1) (at 1 nothing would be left for the right token); it raised a "
                "{error}.", smoothing=smoothing, error=error))
    error = call(_error_of, fn, logits, target, pad_id, smoothing=0.1, reduction="none")
    if error is None:
        raise CheckFailure(t("label_smoothed_loss(..., reduction='none') should raise a ValueError: the loss knows "
                             "'mean' and 'sum' only, and any other word is a typo to report; it raised no error."))
    if error != "ValueError":
        raise CheckFailure(t("label_smoothed_loss(..., reduction='none') should raise a ValueError: the loss knows "
                             "'mean' and 'sum' only, and any other word is a typo to report; it raised a {error}.",
                             error=error))
    passed(t("label_smoothed_loss: no overflow at logits + 100, 0 for an all-padding batch, ValueError for smoothing "
             "outside [0, 1) and for a reduction other than 'mean' or 'sum'"))


# -- exercise 2: the learning-rate schedule ------------------------------------------------

def _paper_lr(step: int, d_model: int, warmup: int) -> float:
    """Section 5.3 of the paper, as written there."""
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def _schedules(seed: int) -> list[tuple[int, int]]:
    """(d_model, warmup) pairs."""
    if seed == 0:
        return [(512, 4000), (256, 800), (64, 7)]
    g = torch.Generator().manual_seed(seed)
    return [(int(2 ** torch.randint(5, 11, (), generator=g)), int(torch.randint(3, 6000, (), generator=g)))
            for _ in range(3)]


def _diagnose_schedule(lr: dict[int, float], peak: float, warmup: int) -> str:
    tolerance = 1e-6 * peak
    rise = t("during warmup the rate rises in a straight line, step / warmup · peak_lr, from peak_lr / warmup = "
             "{start:.4g} at step 1 to peak_lr at step warmup, and only then decays", start=peak / warmup)
    if lr[1] > peak + tolerance:
        return t("At step 1 your rate, {first:.4g}, is above peak_lr: you took the larger of the rise and the decay. "
                 "Take the smaller, min(step / warmup, sqrt(warmup / step)): {rise}.", first=lr[1], rise=rise)
    if abs(lr[1] - peak) <= tolerance or lr[1] > 2 * peak / warmup + tolerance:
        return t("Your rate starts near its peak ({first:.4g} at step 1), with no warmup: {rise}.", first=lr[1],
                 rise=rise)
    best = max(lr, key=lambda s: lr[s])
    if best in (warmup - 1, warmup + 1) or abs(lr.get(warmup - 1, 0.0) - peak) <= tolerance or \
            abs(lr[warmup + 1] - peak) <= tolerance:
        at = warmup - 1 if abs(lr.get(warmup - 1, 0.0) - peak) <= tolerance or best == warmup - 1 else warmup + 1
        return t("Off by one: your rate peaks at step {at}, not at step warmup = {warmup}. Steps count from 1, and "
                 "the rate at step warmup is exactly peak_lr: peak_lr · min(step / warmup, sqrt(warmup / step)).",
                 at=at, warmup=warmup)
    late = 10 * warmup
    if abs(lr[late] - peak / 10) <= 1e-3 * peak:
        return t("After warmup your rate falls as 1 / step: at 10 · warmup it is peak_lr / 10 = {late:.4g}. The "
                 "paper's decays as 1 / sqrt(step): peak_lr · sqrt(warmup / step), {right:.4g} there.",
                 late=lr[late], right=peak / math.sqrt(10))
    if abs(lr[1] - peak / warmup) > tolerance:
        return t("At step 1 the rate is peak_lr / warmup = {start:.4g}, the first step of a straight-line rise to "
                 "peak_lr at step warmup; yours is {first:.4g}.", start=peak / warmup, first=lr[1])
    return t("The rate is peak_lr · min(step / warmup, sqrt(warmup / step)), steps counting from 1.")


def _guard_hint(fn: Callable[..., Any], step: int, peak: float, warmup: int) -> str:
    """After ``fn`` raised a ValueError for a valid step and warmup: which guard, and which way it errs."""
    def error(s: int, w: int) -> Any:
        return call(_error_of, fn, s, peak, w)

    if warmup == 1 and error(step, 2) is None:
        return t(" Your guard on warmup rejects warmup = 1, which is valid (the peak at step 1, then the decay): only "
                 "warmup < 1 is an error.")
    if step == 1 and error(2, warmup) is None:
        return t(" Your guard on step rejects step = 1, the first step: steps count from 1, so only step < 1 is an "
                 "error.")
    if error(step + 1, warmup) == "ValueError" and error(0, warmup) != "ValueError":
        return t(" Your guard on step is inverted: it raises a ValueError for steps {step} and {step_after}, which "
                 "are valid, and none for step 0, which is not: raise when step < 1.", step=step, step_after=step + 1)
    return ""


@check
def check_inverse_sqrt_lr(fn: Callable[..., Any], seed: int = 0) -> None:
    """The paper's d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) with peak_lr = (d_model · warmup)^-0.5."""
    g = torch.Generator().manual_seed(seed + 2)
    for d_model, warmup in _schedules(seed):
        peak = (d_model * warmup) ** -0.5
        steps = [1, warmup - 1, warmup, warmup + 1, 10 * warmup, int(torch.randint(2, 20 * warmup, (), generator=g))]
        lr = {}
        for step in steps:
            try:
                got = call(fn, step, peak, warmup)
            except CheckFailure as failure:
                if raised_error(failure) != "ValueError":
                    raise
                raise _then(failure, _guard_hint(fn, step, peak, warmup)) from None
            if type(got) is not float:
                raise CheckFailure(t("inverse_sqrt_lr({step}, {peak:.4g}, {warmup}) should return a Python float (the "
                                     "optimiser's lr), got {kind}. Use math.sqrt on numbers, not tensors.", step=step,
                                     peak=peak, warmup=warmup, kind=kind(got)))
            lr[step] = got
        for step in steps:
            expected = _paper_lr(step, d_model, warmup)
            if not math.isclose(lr[step], expected, rel_tol=1e-9, abs_tol=1e-15):
                raise CheckFailure(t(
                    "With warmup={warmup} and peak_lr={peak:.6g} (the paper's (d_model · warmup)^-0.5 for "
                    "d_model={d_model}), the rate at step {step} is d_model^-0.5 · min(step^-0.5, step · "
                    "warmup^-1.5) = {expected:.6g}; yours is {got:.6g}. {diagnosis}", warmup=warmup, peak=peak,
                    d_model=d_model, step=step, expected=expected, got=lr[step],
                    diagnosis=_diagnose_schedule(lr, peak, warmup)))
    # warmup = 1 is the shortest warmup there is: the peak at step 1, then the decay.
    for step in (1, 4):
        expected = 1e-3 * min(step, step ** -0.5)
        try:
            got = call(fn, step, 1e-3, 1)
        except CheckFailure as failure:
            if raised_error(failure) != "ValueError":
                raise
            raise _then(failure, _guard_hint(fn, step, 1e-3, 1)) from None
        if type(got) is not float or not math.isclose(got, expected, rel_tol=1e-9):
            raise CheckFailure(t("With warmup=1 (no rise: the peak at step 1, then the decay) the rate at step {step} "
                                 "with peak_lr=0.001 is {expected:.6g}; yours is {got!r}.", step=step,
                                 expected=expected, got=got))
    for step, warmup, why in ((0, 10, t("steps count from 1")), (-3, 10, t("steps count from 1")),
                              (5, 0, t("warmup is at least 1 step"))):
        error = call(_error_of, fn, step, 1e-3, warmup)
        if error is None:
            raise CheckFailure(t("inverse_sqrt_lr(step={step}, peak_lr=0.001, warmup={warmup}) should raise a "
                                 "ValueError ({why}); it raised no error.", step=step, warmup=warmup, why=why))
        if error != "ValueError":
            raise CheckFailure(t("inverse_sqrt_lr(step={step}, peak_lr=0.001, warmup={warmup}) should raise a "
                                 "ValueError ({why}); it raised a {error}.", step=step, warmup=warmup, why=why,
                                 error=error))
    passed(t("inverse_sqrt_lr equals the paper's d_model^-0.5 · min(step^-0.5, step · warmup^-1.5): the rise, the "
             "peak at step warmup, the 1/sqrt decay; ValueError for step < 1 and warmup < 1"))


# -- exercise 3: one training step ----------------------------------------------------------

_STEP_MODEL = dict(d_model=8, heads=2, d_ff=12)
_FIRST_LR = 0.05  # what the check's optimiser is built with: train_step must replace it
_NO_CLIP = 1e6


def _step_sizes(seed: int) -> tuple[int, int, int, int]:
    """(batch, src_len, tgt_len, vocab), pairwise distinct; tgt_len counts <s> and </s>."""
    if seed == 0:
        return 3, 5, 7, 11
    return _distinct(torch.Generator().manual_seed(seed), ((2, 4), (3, 8), (4, 9), (10, 14)))


def _specials(seed: int, vocab: int) -> tuple[int, int, int]:
    """(pad_id, bos_id, eos_id)."""
    return (0, 1, 2) if seed % 2 == 0 else (vocab - 1, 1, 2)


def _sentence_batch(seed: int, batch: int, src_len: int, tgt_len: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Sources (words, then padding) and targets (<s> words </s>, then padding) of different lengths."""
    pad_id, bos_id, eos_id = _specials(seed, vocab)
    words = torch.tensor([t for t in range(3, vocab) if t != pad_id])
    g = torch.Generator().manual_seed(seed + 3)
    src = words[torch.randint(len(words), (batch, src_len), generator=g)]
    for b, n in enumerate(_lengths(batch, src_len, 1, g)):
        src[b, n:] = pad_id
    tgt = torch.full((batch, tgt_len), pad_id)
    for b, n in enumerate(_lengths(batch, tgt_len - 2, 1, g)):
        tgt[b, 0], tgt[b, n + 1] = bos_id, eos_id
        tgt[b, 1:n + 1] = words[torch.randint(len(words), (n,), generator=g)]
    return src, tgt


def _step_model(seed: int, vocab: int) -> _Translator:
    return _build((vocab, vocab), _STEP_MODEL["d_model"], _STEP_MODEL["heads"], _STEP_MODEL["d_ff"],
                  _specials(seed, vocab)[0], seed + 5, torch.float64)


class _SGD(torch.optim.SGD):
    """PyTorch's SGD, shown in one line in a failure's message."""

    def __repr__(self) -> str:
        return f"SGD(lr={self.param_groups[0]['lr']:g}, momentum=0.9, {len(self.param_groups)} parameter groups)"


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, not AdamW: Adam's first update is about lr · sign(gradient), the same whatever the
    gradients' scale, so clipping would barely show; and for a gradient near 0 it is lr · (rounding noise) / eps,
    which would fail a loss computed in float64 instead of float32. train_step works with any optimiser."""
    # Two groups (biases and norms apart, as weight decay is usually set), so that an lr set on the first only shows.
    flat = [p for p in model.parameters() if p.dim() < 2]
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    return _SGD([{"params": matrices}, {"params": flat}], lr=_FIRST_LR, momentum=0.9)


def _gradient_norm(model: nn.Module, src: Tensor, tgt: Tensor, pad_id: int, smoothing: float) -> float:
    loss = _oracle_loss(model(src, tgt[:, :-1]), tgt[:, 1:], pad_id, smoothing, "mean")
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    model.zero_grad(set_to_none=True)
    return norm


def _mistaken_step(model: nn.Module, optimizer: torch.optim.Optimizer, src: Tensor, tgt: Tensor, pad_id: int,
                   lr: float, smoothing: float, clip_norm: float, *, reads: str = "prefix", clip: str = "norm",
                   set_lr: str = "all", zero: bool = True) -> float:
    """The recipe's training step (all switches at their defaults), or one of the usual mistakes (to name them)."""
    for group in optimizer.param_groups[: None if set_lr == "all" else 1 if set_lr == "first" else 0]:
        group["lr"] = lr
    decoder_in, expected = {"prefix": (tgt[:, :-1], tgt[:, 1:]), "whole": (tgt, tgt),
                            "same": (tgt[:, :-1], tgt[:, :-1]), "backwards": (tgt[:, 1:], tgt[:, :-1])}[reads]
    loss = _oracle_loss(model(src, decoder_in), expected, pad_id, smoothing, "mean")
    loss.backward()
    if clip == "norm":
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    elif clip == "value":
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_norm)
    optimizer.step()
    if zero:
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


_WHOLE_TARGET = marked("Your decoder read the whole target, including the token it must predict: with the causal mask "
                       "a position may read itself, so it learns to copy. Teacher forcing feeds tgt[:, :-1] (<s> y_1 "
                       "... y_n) to the decoder and trains each position to predict the next token, tgt[:, 1:] (y_1 "
                       "... </s>).")
_STEP_MISTAKES = {  # shown with tr()
    "reads": {
        "whole": _WHOLE_TARGET,
        "same": _WHOLE_TARGET,
        "backwards": marked("You shifted the wrong way: the decoder reads tgt[:, :-1] (starting with <s>) and predicts "
                            "tgt[:, 1:] (ending with </s>), not the reverse."),
    },
    "clip": {
        "none": marked("No clipping: the parameters moved as if the gradients had not been clipped. Before the "
                       "optimiser step, scale the gradients so that their global norm is at most clip_norm "
                       "(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))."),
        "value": marked("You clipped each gradient entry (clip_grad_value_); the recipe clips the global norm of all "
                        "the gradients together (clip_grad_norm_), which keeps their direction."),
    },
    "set_lr": {
        "none": marked("lr not set: the optimiser stepped with the learning rate it was built with. Set "
                       "group['lr'] = lr for every group in optimizer.param_groups before optimizer.step()."),
        "first": marked("lr set on the first parameter group only (optimizer.param_groups[0]): an optimiser can hold "
                        "several groups (say, with and without weight decay). Set group['lr'] = lr for every group in "
                        "optimizer.param_groups."),
    },
    "zero": {
        False: marked("Gradients accumulate across steps: zero them. backward() adds to .grad, so the second step also "
                      "followed the first batch's gradients: call optimizer.zero_grad() after optimizer.step()."),
    },
}


def _step_twin(seed: int, vocab: int, steps: list[tuple[Tensor, Tensor, float, float, float]],
               **mistake: Any) -> tuple[list[float], dict[str, Tensor]]:
    """A fresh twin of the student's model and optimiser, trained by the (mistaken) reference steps."""
    model = _step_model(seed, vocab)
    optimizer = _optimizer(model)
    pad_id = _specials(seed, vocab)[0]
    losses = [_mistaken_step(model, optimizer, src, tgt, pad_id, lr, smoothing, clip_norm, **mistake)
              for src, tgt, lr, smoothing, clip_norm in steps]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _same_parameters(got: Any, expected: dict[str, Tensor]) -> bool:
    return type(got) is dict and set(got) == set(expected) and all(
        type(got[name]) is Tensor and close(got[name], value, torch.float64, tolerance=1e-6)
        for name, value in expected.items())


def _same_losses(got: list[Any], expected: list[float]) -> bool:
    return all(type(a) is float and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
               for a, b in zip(got, expected, strict=True))


def _run_steps(fn: Callable[..., Any], seed: int, vocab: int,
               steps: list[tuple[Tensor, Tensor, float, float, float]]) -> tuple[list[Any], Any]:
    """The student's train_step, once per entry of ``steps``, on one model and optimiser; its losses and weights."""
    model = _step_model(seed, vocab)
    optimizer = _optimizer(model)
    pad_id = _specials(seed, vocab)[0]
    losses = [call(fn, model, optimizer, src, tgt, pad_id, lr, smoothing=smoothing, clip_norm=clip_norm)
              for src, tgt, lr, smoothing, clip_norm in steps]
    return losses, call(_parameters_of, model)


def _diagnose_steps(seed: int, vocab: int, steps: list[tuple[Tensor, Tensor, float, float, float]],
                    losses: list[Any], params: Any, check_losses: bool) -> str:
    for switch, hints in _STEP_MISTAKES.items():
        for value, hint in hints.items():
            their_losses, their_params = _step_twin(seed, vocab, steps, **{switch: value})
            if _same_losses(losses, their_losses) and (check_losses or _same_parameters(params, their_params)):
                return tr(hint)
    return ""


def _slice_of(part: Any, tgt: Tensor) -> str:
    """Which columns of ``tgt`` a tensor is, written ``tgt[:, a:b]``, or what it is where it is none."""
    if type(part) is not Tensor:
        return kind(part)
    n = tgt.shape[1]
    if part.dim() == 2 and part.shape[0] == tgt.shape[0] and part.dtype == tgt.dtype:
        for a in range(n + 1):
            for b in range(a, n + 1):
                if b - a == part.shape[1] and torch.equal(part, tgt[:, a:b]):
                    end = "" if b == n else "0" if b == 0 else str(b - n)
                    return f"tgt[:, {a or ''}:{end}]"
    return t("a tensor of shape {shape}", shape=tuple(part.shape))


def _observe_step(fn: Callable[..., Any], seed: int, vocab: int,
                  steps: list[tuple[Tensor, Tensor, float, float, float]]) -> dict[str, Any]:
    """The student's train_step on a fresh twin: what the decoder read, what its loss compared with (as slices of
    tgt), what it returned without its annotations' checks, the exception it raised; plain data."""
    model = _step_model(seed, vocab)
    optimizer = _optimizer(model)
    pad_id = _specials(seed, vocab)[0]
    read: list[Tensor] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: read.append(args[1] if len(args) > 1 else kwargs.get("tgt")), with_kwargs=True)
    seen: dict[str, list[tuple[tuple, dict]]] = {}
    found: dict[str, Any] = {"decoder": [], "target": [], "returned": None, "error": None}
    try:
        with _spying(fn, ("label_smoothed_loss",), seen):
            for src, tgt, lr, smoothing, clip_norm in steps:
                read.clear()
                seen.get("label_smoothed_loss", []).clear()
                try:
                    result = inspect.unwrap(fn)(model, optimizer, src, tgt, pad_id, lr, smoothing=smoothing,
                                                clip_norm=clip_norm)
                except Exception as error:  # what it raised is part of the answer
                    found["error"] = type(error).__name__
                finally:
                    found["decoder"] = [_slice_of(t, tgt) for t in read]
                    found["target"] = [_slice_of(args[1] if len(args) > 1 else kwargs.get("target"), tgt)
                                       for args, kwargs in seen.get("label_smoothed_loss", [])]
                if found["error"]:
                    break
                found["returned"] = kind(result)
    finally:
        hook.remove()
    return found


def _step_error_hint(fn: Callable[..., Any], seed: int, vocab: int,
                     steps: list[tuple[Tensor, Tensor, float, float, float]]) -> str:
    """After train_step raised: what its decoder read and its loss compared with, or what it returned."""
    seen = call(_observe_step, fn, seed, vocab, steps)
    if type(seen) is not dict:
        return ""
    decoder, target = seen.get("decoder") or [], seen.get("target") or []
    if decoder and decoder[0] != "tgt[:, :-1]":
        return t(" Your train_step fed the decoder {decoder}: teacher forcing feeds it tgt[:, :-1], every token but "
                 "the last, and the loss compares with tgt[:, 1:], the next token at each position.",
                 decoder=decoder[0])
    if target and target[0] != "tgt[:, 1:]":
        return t(" Your decoder read tgt[:, :-1], as it should, but your loss compared its logits with {target}: "
                 "each position predicts the next token, tgt[:, 1:].", target=target[0])
    if not seen.get("error") and seen.get("returned") == "Tensor":
        return t(" Called without its annotations' checks, your train_step returns a tensor where its signature says "
                 "float: return loss.item(), a Python float that holds no graph.")
    src, tgt, lr, smoothing, clip_norm = steps[0]
    model = _step_model(seed, vocab)
    return _where(fn, model, _optimizer(model), src, tgt, _specials(seed, vocab)[0], lr, smoothing=smoothing,
                  clip_norm=clip_norm)


def _compare_steps(fn: Callable[..., Any], seed: int, vocab: int,
                   steps: list[tuple[Tensor, Tensor, float, float, float]], what: str) -> None:
    try:
        losses, params = _run_steps(fn, seed, vocab, steps)
    except CheckFailure as failure:
        if not raised_error(failure):
            raise
        raise _then(failure, _step_error_hint(fn, seed, vocab, steps)) from None
    expected_losses, expected_params = _step_twin(seed, vocab, steps)
    for loss in losses:
        if type(loss) is Tensor:
            raise CheckFailure(t("train_step should return the batch's loss as a Python float (a tensor: return "
                                 "loss.item()), got {kind}: a float holds no graph, so a training loop can keep a list "
                                 "of them.", kind=kind(loss)))
        if type(loss) is not float:
            raise CheckFailure(t("train_step should return the batch's loss as a Python float, got {kind}: a float "
                                 "holds no graph, so a training loop can keep a list of them.", kind=kind(loss)))
    for number, (loss, expected) in enumerate(zip(losses, expected_losses, strict=True), start=1):
        if not math.isclose(loss, expected, rel_tol=1e-6, abs_tol=1e-6):
            src, tgt, lr, smoothing, clip_norm = steps[number - 1]
            hint = _diagnose_steps(seed, vocab, steps[:number], losses[:number], params, check_losses=True) or t(
                "The loss is your label_smoothed_loss of model(src, tgt[:, :-1]) against tgt[:, 1:], with pad_id and "
                "smoothing, computed before the step.")
            batch, src_len = src.shape
            raise CheckFailure(t("{what}: step {number} (smoothing={smoothing}; batch={batch}, src_len={src_len}, "
                                 "tgt_len={tgt_len}, vocab={vocab}) returned the loss {loss:.6g}; the recipe's step "
                                 "gives {expected:.6g}. {hint}", what=what, number=number, smoothing=smoothing,
                                 batch=batch, src_len=src_len, tgt_len=tgt.shape[1], vocab=vocab, loss=loss,
                                 expected=expected, hint=hint))
    if not _same_parameters(params, expected_params):
        if type(params) is not dict or set(params) != set(expected_params):
            raise CheckFailure(t("train_step changed which parameters the model has: it should only update them."))
        wrong = [name for name, value in expected_params.items()
                 if not close(params[name], value, torch.float64, tolerance=1e-6)]
        hint = _diagnose_steps(seed, vocab, steps, losses, params, check_losses=False) or t(
            "After the loss: backward, clip the gradients' global norm to clip_norm, set lr on every parameter group, "
            "optimizer.step(), then clear the gradients.")
        raise CheckFailure(t("{what}: your losses are right, but after the step {wrong} of {total} parameters differ "
                             "from the recipe's (e.g. {name}: {difference}). {hint}", what=what, wrong=len(wrong),
                             total=len(expected_params), name=wrong[0],
                             difference=difference(params[wrong[0]], expected_params[wrong[0]]), hint=hint))


@check(forbid=BUILT_IN_LOSS)
def check_train_step(fn: Callable[..., Any], seed: int = 0) -> None:
    """One step equals the recipe's: teacher forcing, your loss, clipping, lr set; the loss returned as a float."""
    batch, src_len, tgt_len, vocab = _step_sizes(seed)
    src, tgt = _sentence_batch(seed, batch, src_len, tgt_len, vocab)
    pad_id = _specials(seed, vocab)[0]
    with one_thread():
        # Small enough that clipping changes the step: a third of the first gradient's norm.
        clip_norm = _gradient_norm(_step_model(seed, vocab), src, tgt, pad_id, 0.1) / 3
        for what, steps in (
            (t("With smoothing 0.1 and clip_norm={clip_norm:.3g} (a third of the gradient's norm)",
               clip_norm=clip_norm), [(src, tgt, 2e-3, 0.1, clip_norm)]),
            (t("With smoothing 0 and a clip_norm too large to matter"), [(src, tgt, 5e-4, 0.0, _NO_CLIP)]),
        ):
            _compare_steps(fn, seed, vocab, steps, what)
    passed(t("train_step equals the recipe's step (batch={batch}, src_len={src_len}, tgt_len={tgt_len}, "
             "vocab={vocab}): teacher forcing, label smoothing, padding ignored, gradient clipping, lr set, the loss "
             "as a float", batch=batch, src_len=src_len, tgt_len=tgt_len, vocab=vocab))


@check(forbid=BUILT_IN_LOSS)
def check_train_steps(fn: Callable[..., Any], seed: int = 0) -> None:
    """Two steps in a row on one model equal the recipe's: gradients cleared after each step, each step's lr."""
    batch, src_len, tgt_len, vocab = _step_sizes(seed)
    first = _sentence_batch(seed, batch, src_len, tgt_len, vocab)
    second = _sentence_batch(seed + 1000, batch, src_len, tgt_len, vocab)
    with one_thread():
        _compare_steps(fn, seed, vocab, [(*first, 1e-3, 0.0, _NO_CLIP), (*second, 3e-3, 0.0, _NO_CLIP)],
                       t("Two steps in a row (lr 0.001, then 0.003) on one model and optimiser"))
    passed(t("two train_steps in a row equal the recipe's: the gradients are cleared after each step, each step "
             "uses its own lr"))



# -- exercise 4: one step of beam search ----------------------------------------------------

def _beam_sizes(seed: int) -> tuple[int, int, int]:
    """(batch, beam, vocab), pairwise distinct, vocab > 2 · beam (the first step needs 2 · beam real candidates)."""
    if seed == 0:
        return 2, 3, 7
    g = torch.Generator().manual_seed(seed)
    while True:
        batch, beam, vocab = _distinct(g, ((2, 4), (2, 4), (5, 12)))
        if vocab > 2 * beam:
            return batch, beam, vocab


def _brute_force(scores: Tensor, log_probs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Every (beam, token) candidate of each sentence scored and sorted, best first; the first k."""
    best, beams, tokens = [], [], []
    for b in range(scores.shape[0]):
        candidates = [(scores[b, i] + log_probs[b, i, t], i, t)
                      for i in range(scores.shape[1]) for t in range(log_probs.shape[2])]
        candidates.sort(key=lambda c: -float(c[0]))
        best.append(torch.stack([c[0] for c in candidates[:k]]))
        beams.append([c[1] for c in candidates[:k]])
        tokens.append([c[2] for c in candidates[:k]])
    return torch.stack(best), torch.tensor(beams), torch.tensor(tokens)


_PER_BEAM = marked("You took the top candidates of each beam separately, so that every beam supplied its share of the "
                   "winners (even a beam scored -inf). All beam · vocab candidates of a sentence compete together: "
                   "flatten (beam vocab), then one topk; a strong beam may supply several winners and a weak one none.")


def _beam_variants(scores: Tensor, log_probs: Tensor, k: int) -> list[tuple[str, Tensor, Tensor]]:
    """(hint, beams, tokens): the winners that the usual mistakes give."""
    vocab = log_probs.shape[-1]
    beam = log_probs.shape[1]
    candidates = rearrange(scores, "batch beam -> batch beam 1") + log_probs
    flat = rearrange(candidates, "batch beam vocab -> batch (beam vocab)").topk(k, dim=-1).indices
    unscored = rearrange(log_probs, "batch beam vocab -> batch (beam vocab)").topk(k, dim=-1).indices
    by_beam = t("You decoded the flat index with % beam and // beam: in the (beam vocab) order, candidate c extends "
                "beam c // vocab with token c % vocab.")
    return [
        (t("You ranked the candidates by the new token's log-probability alone: the previous scores were not added. A "
           "candidate's score is scores[beam] + log_probs[beam, token]."), unscored // vocab, unscored % vocab),
        (by_beam, flat // beam, flat % beam),
        (by_beam, flat % beam, flat // beam),
    ]


def _pairs(beams: Tensor, tokens: Tensor) -> list[list[tuple[int, int]]]:
    return [list(zip(b, t, strict=True)) for b, t in zip(beams.tolist(), tokens.tolist(), strict=True)]


def _shared_out(beams: Tensor, expected_beams: Tensor, beam: int, k: int) -> bool:
    """Every beam gave at most its share, ceil(k / beam), of the winners, where the best k come from fewer beams."""
    share = -(-k // beam)
    most = [max(row.count(b) for b in range(beam)) for row in beams.tolist()]
    expected_most = [max(row.count(b) for b in range(beam)) for row in expected_beams.tolist()]
    return max(most) <= share < max(expected_most)


def _beam_cases(seed: int, dtype: torch.dtype) -> list[tuple[str, Tensor, Tensor, int]]:
    batch, beam, vocab = _beam_sizes(seed)
    g = torch.Generator().manual_seed(seed + 4)

    def log_probs() -> Tensor:
        return torch.log_softmax(2 * torch.randn(batch, beam, vocab, generator=g, dtype=dtype), dim=-1)

    first = torch.full((batch, beam), -math.inf, dtype=dtype)
    first[:, 0] = 0.0
    scores = -(3 * torch.rand(batch, beam, generator=g, dtype=dtype)).sort(dim=-1).values
    ahead = torch.full((batch, beam), -6.0, dtype=dtype)
    ahead[:, 0] = -0.5
    ahead -= torch.rand(batch, beam, generator=g, dtype=dtype)
    return [
        (t("the first step (only beam 0 is real, the others score -inf)"), first, log_probs(), 2 * beam),
        (t("beams with different scores"), scores, log_probs(), beam),
        (t("one beam far ahead of the others"), ahead, log_probs(), 2 * beam),
        ("k = 1", scores, log_probs(), 1),
        (t("k = beam · vocab (every candidate, best first)"), scores, log_probs(), beam * vocab),
    ]


def _accepted(fn: Callable[..., Any], scores: Tensor, log_probs: Tensor, top: int) -> list[int]:
    """The k in 1, ..., top for which ``fn`` raises no ValueError."""
    accepted = []
    for k in range(1, top + 1):
        try:
            fn(scores, log_probs, k)
        except ValueError:
            continue
        except Exception:  # noqa: BLE001 - only the guard on k is asked about
            pass
        accepted.append(k)
    return accepted


def _square_beams(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Scores and log-probabilities where batch = beam = vocab, so that a mixed-up axis runs."""
    n = 4
    g = torch.Generator().manual_seed(n)
    scores = -(3 * torch.rand(n, n, generator=g, dtype=dtype)).sort(dim=-1).values
    return scores, torch.log_softmax(2 * torch.randn(n, n, n, generator=g, dtype=dtype), dim=-1)


def _square_variants(scores: Tensor, log_probs: Tensor, k: int) -> dict[str, Tensor]:
    """The winners' scores that the axis mix-ups give, where batch = beam = vocab."""
    right = rearrange(scores, "batch beam -> batch beam 1") + log_probs
    flat = rearrange(right, "batch beam vocab -> batch (beam vocab)")
    return {  # each a template of the hint, with the size {n}: shown with tr()
        marked(" Where batch = beam = vocab = {n} your beam_step runs, and its winners are those of each beam's score "
               "added along the vocab axis (scores broadcast as batch 1 beam): a beam's score goes with every token "
               "of that beam, rearrange(scores, 'batch beam -> batch beam 1')."):
            rearrange(rearrange(scores, "batch beam -> batch 1 beam") + log_probs,
                      "batch beam vocab -> batch (beam vocab)").topk(k, dim=-1).values,
        marked(" Where batch = beam = vocab = {n} your beam_step runs, and its winners are those of scores "
               "transposed, (beam, batch), before they are added: rearrange(scores, 'batch beam -> batch beam 1')."):
            rearrange(rearrange(scores, "batch beam -> beam batch 1") + log_probs,
                      "batch beam vocab -> batch (beam vocab)").topk(k, dim=-1).values,
        marked(" Where batch = beam = vocab = {n} your beam_step runs, and its winners are those of a topk along the "
               "batch axis (dim -2 of the flattened (batch, beam · vocab) scores): take it along dim=-1."):
            flat.topk(k, dim=-2).values,
        marked(" Where batch = beam = vocab = {n} your beam_step runs, and its winners are those of candidates "
               "flattened to ((beam vocab), batch), a topk along the batch axis: flatten 'batch beam vocab -> batch "
               "(beam vocab)'."):
            rearrange(right, "batch beam vocab -> (beam vocab) batch").topk(k, dim=-1).values,
    }


def _beam_error_hint(fn: Callable[..., Any], scores: Tensor, log_probs: Tensor, k: int, error: str) -> str:
    """After beam_step raised for a valid k: the k it accepts, or what it gives where the axis sizes coincide."""
    beam, vocab = log_probs.shape[1:]
    if error == "ValueError":
        accepted = call(_accepted, fn, scores, log_probs, beam * vocab)
        if accepted == list(range(1, vocab + 1)):
            return t(" Your beam_step accepts k up to vocab = {vocab} and raises a ValueError above: your bound on k "
                     "is vocab, without the factor beam. All beam · vocab = {candidates} candidates compete, so k may "
                     "be anything from 1 to beam · vocab.", vocab=vocab, candidates=beam * vocab)
        if type(accepted) is list and k not in accepted and accepted:
            return t(" k = {k} is valid (1 ≤ k ≤ beam · vocab = {candidates}); your beam_step accepts k in "
                     "{accepted}: look at your check of k.", k=k, candidates=beam * vocab, accepted=accepted)
        if type(accepted) is list and k not in accepted:
            return t(" k = {k} is valid (1 ≤ k ≤ beam · vocab = {candidates}); your beam_step accepts k in none of "
                     "them: look at your check of k.", k=k, candidates=beam * vocab)
    # One winner: a candidate set without the log-probabilities still runs, and shows it in its score.
    try:
        result = call(fn, scores, log_probs, 1)
    except CheckFailure:
        result = None
    best = result[0] if type(result) is tuple and len(result) == 3 else None
    if type(best) is Tensor and best.shape == (scores.shape[0], 1) and close(
            best, scores.max(dim=-1, keepdim=True).values, scores.dtype) and not close(
            best, _brute_force(scores, log_probs, 1)[0], scores.dtype):
        return t(" With k = 1 your beam_step runs, and its winners' scores are the beams' own scores: the log_probs "
                 "were not added, without them there are only beam candidates. A candidate's score is scores[beam] + "
                 "log_probs[beam, token].")
    square, square_log_probs = _square_beams(scores.dtype)
    n = square.shape[0]
    try:
        # Without the annotations' checks: a mixed-up axis may return the wrong shape, which shows which.
        got = call(_unchecked, fn, square, square_log_probs, 2)
    except CheckFailure as failure:
        return _where(fn, square, square_log_probs, 2) if raised_error(failure) else ""
    if type(got) is not tuple or len(got) != 3 or type(got[0]) is not Tensor:
        return ""
    for hint, wrong in _square_variants(square, square_log_probs, 2).items():
        if close(got[0], wrong, scores.dtype):
            return tr(hint, n=n)
    if close(got[0], _brute_force(square, square_log_probs, 2)[0], scores.dtype):
        return t(" Where batch = beam = vocab = {n} your beam_step runs and picks the right winners: somewhere an axis "
                 "is taken in the wrong place, which only shows when the sizes differ (look at each dim= and einops "
                 "pattern).", n=n)
    return ""


@check
def check_beam_step(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """The k best of all beam · vocab candidates, best first, as sorting them all by hand gives; bad k raises."""
    batch, beam, vocab = _beam_sizes(seed)
    for what, scores, log_probs, k in _beam_cases(seed, dtype):
        try:
            result = call(fn, scores, log_probs, k)
        except CheckFailure as failure:
            if not (error := raised_error(failure)):
                raise
            raise _then(failure, _beam_error_hint(fn, scores, log_probs, k, error)) from None
        if type(result) is not tuple or len(result) != 3 or any(type(r) is not Tensor for r in result):
            raise CheckFailure(t("beam_step should return a tuple of three tensors (scores, beams, tokens), got "
                                 "{kind}.", kind=kind(result)))
        best, beams, tokens = result
        expected_best, expected_beams, expected_tokens = _brute_force(scores, log_probs, k)
        for name, got in (("scores", best), ("beams", beams), ("tokens", tokens)):
            if tuple(got.shape) != (batch, k):
                hint = t(" That is one top-k per beam: all beam · vocab candidates of a sentence compete together, "
                         "so flatten them to (batch, beam · vocab) before topk.") \
                    if tuple(got.shape) in ((batch, beam, k), (batch, beam * k)) else ""
                raise CheckFailure(t("For {what}, the {name} should have shape (batch={batch}, k={k}), got "
                                     "{shape}.{hint}", what=what, name=name, batch=batch, k=k, shape=tuple(got.shape),
                                     hint=hint))
        if best.dtype != dtype:
            raise CheckFailure(t("The scores should have dtype {dtype} like the inputs, got {got}.", dtype=dtype,
                                 got=best.dtype))
        if beams.dtype != torch.long or tokens.dtype != torch.long:
            raise CheckFailure(t("The beams and tokens should be torch.long indices (as topk's are), got "
                                 "{beams_dtype} and {tokens_dtype}.", beams_dtype=beams.dtype,
                                 tokens_dtype=tokens.dtype))
        if torch.equal(beams, expected_beams) and torch.equal(tokens, expected_tokens) and close(
                best, expected_best, dtype):
            continue
        if torch.equal(beams, expected_beams) and torch.equal(tokens, expected_tokens):
            raise CheckFailure(t("For {what}, you chose the right candidates but returned other scores: each "
                                 "winner's score is scores[beam] + log_probs[beam, token].", what=what))
        hint = next((h for h, b, tok in _beam_variants(scores, log_probs, k)
                     if torch.equal(beams, b) and torch.equal(tokens, tok)), None)
        if hint is None and _shared_out(beams, expected_beams, beam, k):
            hint = tr(_PER_BEAM)
        if hint is None and sorted(zip(beams.flatten().tolist(), tokens.flatten().tolist(), strict=True)) == sorted(
                zip(expected_beams.flatten().tolist(), expected_tokens.flatten().tolist(), strict=True)):
            hint = t("You found the right winners but not best first: return them sorted by score, descending.")
        hint = hint or t("Score every candidate, scores[:, :, None] + log_probs, flatten (beam vocab), take the top "
                         "k, and decode each flat index c as beam c // vocab, token c % vocab.")
        small = batch * k <= 12
        shown = t(" Your (beam, token) pairs: {pairs}; expected {expected}.", pairs=_pairs(beams, tokens),
                  expected=_pairs(expected_beams, expected_tokens)) if small else ""
        raise CheckFailure(t("For {what} (batch={batch}, beam={beam}, vocab={vocab}, k={k}), your winners differ from "
                             "the best k of all beam · vocab candidates.{shown} {hint}", what=what, batch=batch,
                             beam=beam, vocab=vocab, k=k, shown=shown, hint=hint))
    scores, log_probs = _beam_cases(seed, dtype)[1][1:3]
    for k in (0, beam * vocab + 1):
        error = call(_error_of, fn, scores, log_probs, k)
        if error is None:
            raise CheckFailure(t("beam_step with k={k} should raise a ValueError: k is between 1 and beam · vocab = "
                                 "{candidates}; it raised no error.", k=k, candidates=beam * vocab))
        if error != "ValueError":
            raise CheckFailure(t("beam_step with k={k} should raise a ValueError: k is between 1 and beam · vocab = "
                                 "{candidates}; it raised a {error}.", k=k, candidates=beam * vocab, error=error))
    passed(t("beam_step keeps the k best of all beam · vocab candidates, best first; -inf beams never win; ValueError "
             "for k outside [1, beam · vocab] ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 5: memorise a batch, then decode it back ------------------------------------------

_GERMAN = ("<pad>", "<s>", "</s>", "ein", "hund", "läuft", "zwei", "kinder", "spielen", "im", "park", "mann", "eine",
           "frau", "liest", "buch")
_ENGLISH = ("<pad>", "<s>", "</s>", "a", "dog", "runs", "two", "children", "play", "in", "the", "park", "man",
            "woman", "reads", "book")
_PAIRS = (("ein hund läuft", "a dog runs"), ("zwei kinder spielen im park", "two children play in the park"),
          ("ein mann", "a man"), ("eine frau liest ein buch", "a woman reads a book"))
_PAD, _BOS, _EOS = 0, 1, 2
_MEMORISE = dict(steps=150, peak_lr=1e-2, warmup=20)
_COMPARED_STEPS = 10  # the first losses, compared with the recipe's
_FINAL_LOSS = 0.05


def _memorise_batch(seed: int) -> tuple[list[list[int]], list[list[int]], Tensor, Tensor]:
    """Four sentence pairs as ids: the pairs above (seed 0) or random words, of different lengths, padded."""
    if seed == 0:
        sources = [[_GERMAN.index(w) for w in de.split()] for de, _ in _PAIRS]
        targets = [[_ENGLISH.index(w) for w in en.split()] for _, en in _PAIRS]
    else:
        g = torch.Generator().manual_seed(seed)
        src_lengths, tgt_lengths = torch.randperm(5, generator=g)[:4] + 2, torch.randperm(5, generator=g)[:4] + 2
        sources = [torch.randint(3, len(_GERMAN), (int(n),), generator=g).tolist() for n in src_lengths]
        targets = [torch.randint(3, len(_ENGLISH), (int(n),), generator=g).tolist() for n in tgt_lengths]
    src = torch.full((4, max(map(len, sources))), _PAD)
    tgt = torch.full((4, max(map(len, targets)) + 2), _PAD)
    for b, (source, target) in enumerate(zip(sources, targets, strict=True)):
        src[b, :len(source)] = torch.tensor(source)
        tgt[b, :len(target) + 2] = torch.tensor([_BOS, *target, _EOS])
    return sources, targets, src, tgt


def _memorise_model(seed: int) -> _Translator:
    return _build((len(_GERMAN), len(_ENGLISH)), 32, 2, 64, _PAD, seed + 6, torch.float32)


def _recipe_losses(functions: tuple[Callable[..., Any], Callable[..., Any]], model: nn.Module, src: Tensor,
                   tgt: Tensor, steps: int, peak_lr: float, warmup: int, *, betas: tuple[float, float] = (0.9, 0.98),
                   schedule: bool = True, smoothing: float = 0.0, adam: bool = False) -> list[float]:
    """The first ``steps`` losses of the recipe, run with the student's own train_step and inverse_sqrt_lr."""
    train_step, inverse_sqrt_lr = functions
    optimizer = (torch.optim.Adam if adam else torch.optim.AdamW)(model.parameters(), betas=betas)
    return [train_step(model, optimizer, src, tgt, _PAD,
                       inverse_sqrt_lr(step, peak_lr, warmup) if schedule else peak_lr, smoothing=smoothing)
            for step in range(1, steps + 1)]


_MEMORISE_MISTAKES = {  # shown with tr()
    marked("Your losses are those of a constant learning rate of peak_lr: at step s (1, 2, ...) pass "
           "lr=inverse_sqrt_lr(s, peak_lr, warmup) to train_step."): dict(schedule=False),
    marked("Your losses are those of AdamW's default betas (0.9, 0.999): build it with betas=(0.9, 0.98), the "
           "paper's, whose second moments adapt faster."): dict(betas=(0.9, 0.999)),
    marked("Your losses are those of torch.optim.Adam, which has no weight decay: use AdamW, whose decoupled weight "
           "decay (0.01 by default) shrinks the weights a little at every step."): dict(adam=True),
    marked("Your losses are those of label smoothing 0.1: pass smoothing=0.0 to train_step. With smoothing the best "
           "loss is not 0, and the model is trained to keep some probability away from the right token."): dict(
        smoothing=0.1),
}


_OTHER_ARGUMENTS = dict(steps=12, peak_lr=3e-3, warmup=5)  # none of them the default


def _check_memorise_arguments(memorise: Callable[..., Any], train_step: Callable[..., Any],
                              inverse_sqrt_lr: Callable[..., Any], seed: int, src: Tensor, tgt: Tensor) -> None:
    """memorise with steps, peak_lr and warmup other than the defaults follows them, every step compared."""
    other = _OTHER_ARGUMENTS
    losses = call(memorise, _memorise_model(seed), src, tgt, _PAD, **other)
    if type(losses) is not list:
        raise CheckFailure(t("memorise(..., steps={steps}, peak_lr={peak_lr}, warmup={warmup}) returned {kind}: it "
                             "should run `steps` steps, not a fixed number.", steps=other["steps"],
                             peak_lr=other["peak_lr"], warmup=other["warmup"], kind=kind(losses)))
    if len(losses) != other["steps"]:
        raise CheckFailure(t("memorise(..., steps={steps}, peak_lr={peak_lr}, warmup={warmup}) returned {count} "
                             "losses: it should run `steps` steps, not a fixed number.", steps=other["steps"],
                             peak_lr=other["peak_lr"], warmup=other["warmup"], count=len(losses)))
    recipe = call(_recipe_losses, (train_step, inverse_sqrt_lr), _memorise_model(seed), src, tgt, **other)
    if _same_losses(losses, recipe):
        return
    defaults = {**_MEMORISE, "steps": other["steps"]}
    hint = (t("they are those of the default peak_lr and warmup: pass your arguments on to inverse_sqrt_lr")
            if _same_losses(losses, call(_recipe_losses, (train_step, inverse_sqrt_lr), _memorise_model(seed), src,
                                         tgt, **defaults)) else
            t("build a fresh AdamW and call train_step with lr=inverse_sqrt_lr(step, peak_lr, warmup) at each step"))
    raise CheckFailure(t("With steps={steps}, peak_lr={peak_lr} and warmup={warmup} your losses {losses} differ from "
                         "the recipe's {recipe}: {hint}.", steps=other["steps"], peak_lr=other["peak_lr"],
                         warmup=other["warmup"], losses=[round(x, 4) for x in losses],
                         recipe=[round(x, 4) for x in recipe], hint=hint))


def _observe_memorise(memorise: Callable[..., Any], model: nn.Module, src: Tensor, tgt: Tensor, steps: int,
                      peak_lr: float, warmup: int) -> dict[str, Any]:
    """memorise run with its train_step and inverse_sqrt_lr watched: the steps it asked the rate of, how many
    steps it took, the exception it raised; plain data."""
    seen: dict[str, list[tuple[tuple, dict]]] = {}
    error = None
    with _spying(memorise, ("train_step", "inverse_sqrt_lr"), seen):
        try:
            memorise(model, src, tgt, _PAD, steps=steps, peak_lr=peak_lr, warmup=warmup)
        except Exception as raised:  # what it raised is part of the answer
            error = type(raised).__name__
    asked = [args[0] if args else kwargs.get("step") for args, kwargs in seen.get("inverse_sqrt_lr", [])]
    return {"asked": [a if type(a) is int else repr(a) for a in asked] if "inverse_sqrt_lr" in seen else None,
            "steps": len(seen["train_step"]) if "train_step" in seen else None, "error": error}


def _span(values: list[Any]) -> str:
    """A list of steps, as ``1, 2, ..., 12`` where they follow each other."""
    if len(values) > 3 and all(type(v) is int for v in values) and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}, {values[1]}, ..., {values[-1]}"
    return ", ".join(map(str, values))


def _memorise_steps_hint(memorise: Callable[..., Any], seed: int, src: Tensor, tgt: Tensor, *,
                         raised: bool = False) -> str:
    """After memorise raised or returned too few or too many losses: the steps its loop went through, watched on a
    short run (steps=12), or the line that raised."""
    other = _OTHER_ARGUMENTS
    n = other["steps"]
    seen = call(_observe_memorise, memorise, _memorise_model(seed), src, tgt, n, other["peak_lr"], other["warmup"])
    asked = seen.get("asked") if type(seen) is dict else None
    where = (lambda: _where(memorise, _memorise_model(seed), src, tgt, _PAD, **other)) if raised else (lambda: "")
    # A run that raised says something about its loop only where it asked for a step that cannot be: one that
    # stopped early may have stopped at what raised.
    if type(asked) is not list or not all(type(a) is int for a in asked) or asked == list(range(1, n + 1)) or (
            raised and not (asked and asked[0] < 1)):
        return where()
    shown = _watched(n, asked, seen.get("steps"))
    recipe = t("step s goes 1, 2, ..., steps: for step in range(1, steps + 1).")
    if not asked:
        return t("{watched}: its loop never ran, {recipe}", watched=shown, recipe=recipe)
    if asked[0] < 1:
        return t("{watched}: it starts at step {first}, and steps count from 1: {recipe}", watched=shown,
                 first=asked[0], recipe=recipe)
    if asked[0] > 1:
        return t("{watched}: it starts at step {first}, so the first step, 1, is missing: {recipe}", watched=shown,
                 first=asked[0], recipe=recipe)
    if asked[-1] < n:
        missing = list(range(asked[-1] + 1, n + 1))
        if len(missing) == 1:
            return t("{watched}: it stops at step {last}, so the last step, {steps}, is missing: {recipe}",
                     watched=shown, last=asked[-1], steps=n, recipe=recipe)
        return t("{watched}: it stops at step {last}, so the last steps, {missing}, are missing: {recipe}",
                 watched=shown, last=asked[-1], missing=_span(missing), recipe=recipe)
    if asked[-1] > n:
        extra = asked[-1] - n
        if extra == 1:
            return t("{watched}: it runs on to step {last}, one step too many: {recipe}", watched=shown,
                     last=asked[-1], recipe=recipe)
        return t("{watched}: it runs on to step {last}, {extra} steps too many: {recipe}", watched=shown,
                 last=asked[-1], extra=extra, recipe=recipe)
    return t("{watched}. {recipe}", watched=shown, recipe=recipe)


def _watched(n: int, asked: list[int], calls: Any) -> str:
    """' Watched with steps=12, your memorise asked inverse_sqrt_lr for ...': what memorise's loop did."""
    if type(calls) is int:
        if not asked:
            return t(" Watched with steps={n}, your memorise asked inverse_sqrt_lr for no rate and called train_step "
                     "{calls} times", n=n, calls=calls)
        if len(asked) == 1:
            return t(" Watched with steps={n}, your memorise asked inverse_sqrt_lr for the rate of step {step} and "
                     "called train_step {calls} times", n=n, step=asked[0], calls=calls)
        return t(" Watched with steps={n}, your memorise asked inverse_sqrt_lr for the rates of steps {steps} and "
                 "called train_step {calls} times", n=n, steps=_span(asked), calls=calls)
    if not asked:
        return t(" Watched with steps={n}, your memorise asked inverse_sqrt_lr for no rate", n=n)
    if len(asked) == 1:
        return t(" Watched with steps={n}, your memorise asked inverse_sqrt_lr for the rate of step {step}", n=n,
                 step=asked[0])
    return t(" Watched with steps={n}, your memorise asked inverse_sqrt_lr for the rates of steps {steps}", n=n,
             steps=_span(asked))


def _words(ids: list[int], vocabulary: tuple[str, ...]) -> str:
    return " ".join(vocabulary[i] if 0 <= i < len(vocabulary) else f"<{i}>" for i in ids)


@check(forbid=BUILT_IN_LOSS)
def check_memorise(functions: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]],
                   seed: int = 0) -> None:
    """Your memorise, run for 150 steps, learns four sentence pairs by heart: greedy decoding gives every target back.

    ``functions`` is ``(memorise, train_step, inverse_sqrt_lr)``: memorise's first losses are compared with those of
    the recipe run with your own train_step and inverse_sqrt_lr, so a mistake in those is not counted twice here.
    """
    memorise, train_step, inverse_sqrt_lr = functions
    sources, targets, src, tgt = _memorise_batch(seed)
    steps, peak_lr, warmup = _MEMORISE["steps"], _MEMORISE["peak_lr"], _MEMORISE["warmup"]
    with one_thread():
        model = _memorise_model(seed)
        try:
            losses = call(memorise, model, src, tgt, _PAD, steps=steps, peak_lr=peak_lr, warmup=warmup)
        except CheckFailure as failure:
            if not raised_error(failure):
                raise
            raise _then(failure, _memorise_steps_hint(memorise, seed, src, tgt, raised=True)) from None
        if type(losses) is not list:
            raise CheckFailure(t("memorise(..., steps={steps}) should return the list of the {steps} losses that "
                                 "train_step returned (Python floats), got {kind}.", steps=steps, kind=kind(losses)))
        if len(losses) != steps or any(type(x) is not float for x in losses):
            raise CheckFailure(t("memorise(..., steps={steps}) should return the list of the {steps} losses that "
                                 "train_step returned (Python floats), got a list of {count}.{hint}", steps=steps,
                                 count=len(losses), hint=_memorise_steps_hint(memorise, seed, src, tgt)))
        params = call(_parameters_of, model)
        names = {name for name, _ in model.named_parameters()}
        if type(params) is not dict or set(params) != names:
            raise CheckFailure(t("memorise changed which parameters the model has: it should only train them."))
        recipe = call(_recipe_losses, (train_step, inverse_sqrt_lr), _memorise_model(seed), src, tgt,
                      _COMPARED_STEPS, peak_lr, warmup)
        if not _same_losses(losses[:_COMPARED_STEPS], recipe):
            hint = next((h for h, mistake in _MEMORISE_MISTAKES.items()
                         if _same_losses(losses[:_COMPARED_STEPS],
                                         call(_recipe_losses, (train_step, inverse_sqrt_lr), _memorise_model(seed),
                                              src, tgt, _COMPARED_STEPS, peak_lr, warmup, **mistake))), None)
            raise CheckFailure(t(
                "Your first {compared} losses {losses} differ from those of the recipe run with your own train_step "
                "and inverse_sqrt_lr {recipe}. {hint}", compared=_COMPARED_STEPS,
                losses=[round(x, 4) for x in losses[:_COMPARED_STEPS]], recipe=[round(x, 4) for x in recipe],
                hint=tr(hint) if hint else t(
                    "Build torch.optim.AdamW(model.parameters(), betas=(0.9, 0.98)), then for step = 1, ..., steps "
                    "call train_step(model, optimizer, src, tgt, pad_id, inverse_sqrt_lr(step, peak_lr, warmup), "
                    "smoothing=0.0) and keep what it returns.")))
        _check_memorise_arguments(memorise, train_step, inverse_sqrt_lr, seed, src, tgt)
    if not losses[-1] < _FINAL_LOSS:
        raise CheckFailure(t("After {steps} steps the loss is still {last:.4g} (it started at {first:.4g}); a model "
                             "that has learnt these four sentences by heart is under {final}. Your memorise's first "
                             "{compared} steps follow the recipe, so look at train_step and inverse_sqrt_lr: does the "
                             "lr rise to peak_lr and do the parameters move?", steps=steps, last=losses[-1],
                             first=losses[0], final=_FINAL_LOSS, compared=_COMPARED_STEPS))
    decoder = _load(_memorise_model(seed), params)
    decoded = _greedy(decoder, src, _BOS, _EOS)
    if decoded != targets:
        rows = "\n".join(t("  {source}  →  {decoded}   (expected: {target})", source=_words(source, _GERMAN),
                           decoded=_words(got, _ENGLISH), target=_words(target, _ENGLISH))
                         for source, got, target in zip(sources, decoded, targets, strict=True))
        raise CheckFailure(t(
            "The loss fell to {last:.4g}, yet greedy decoding does not give the targets back:\n{rows}\nYour "
            "memorise's first {compared} steps follow the recipe, so look at your train_step. A decoder that read, "
            "during training, the token it had to predict has learnt to copy its input, which it does not have when "
            "it generates: the decoder reads tgt[:, :-1] and the loss compares with tgt[:, 1:]. Gradients that are "
            "never cleared pile up from step to step.", last=losses[-1], rows=rows, compared=_COMPARED_STEPS))
    rows = "\n".join(f"    {_words(s, _GERMAN)}  →  {_words(d, _ENGLISH)}"
                     for s, d in zip(sources, decoded, strict=True))
    passed(t("memorise: the loss fell from {first:.3g} to {last:.2g} in {steps} steps, and greedy decoding gives every "
             "target back:\n{rows}", first=losses[0], last=losses[-1], steps=steps, rows=rows))
