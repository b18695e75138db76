"""Checks for chapter 00: embeddings as one-hot × matrix, n-gram counts and probabilities, additive
(Bahdanau) attention, and how peaked attention gets as d_k grows.

The oracles: ``torch.nn.functional.embedding`` and ``F.one_hot(tokens) @ weight`` for embeddings;
``collections.Counter`` over ``zip`` for n-gram counts; for n-gram probabilities and additive attention,
whose definitions PyTorch has no function for, the formulas written out here in another way (loops, float64),
with their defining properties (probabilities sum to 1 over the vocabulary; weights sum to 1 over the
unmasked keys, masked keys get exactly 0, a fully masked row gives zeros).
"""

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    _plain,
    call,
    check,
    close,
    describe,
    difference,
    distinct_sizes,
    dtype_name,
    expect_tensor,
    kind,
    one_thread,
    passed,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks.attention import _check_measurement_arguments

# What exercise 1 asks students to write themselves: the one-hot product, not the lookup.
BUILT_IN_EMBEDDING = {
    "torch.nn.functional.embedding": marked("PyTorch's embedding lookup"),
    "torch.nn.Embedding": marked("PyTorch's embedding"),
    "torch.embedding": marked("PyTorch's embedding lookup"),
}
ATTENTION_AXES = ("batch", "q_len", "k_len", "d_q", "d_k", "d_v", "d_attn")


def _named(sizes: dict[str, Any]) -> str:
    return ", ".join(f"{a}={n}" for a, n in sizes.items())


def _sentence(text: str) -> str:
    """An error's text closed with a full stop, so that a hint after it reads as a sentence of its own."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?", ")")) else text + "."


# -- exercise 1: one_hot_embed --------------------------------------------------------------

def _embedding_inputs(seed: int, dtype: torch.dtype) -> tuple[dict[str, int], Tensor, Tensor]:
    """Token ids (batch, seq) over a vocabulary of ``vocab`` words, and a (vocab, d_model) weight."""
    g = torch.Generator().manual_seed(seed)
    if seed == 0:
        s = {"batch": 2, "seq": 5, "vocab": 11, "d_model": 3}
    else:
        picks = (torch.randperm(9, generator=g)[:3] + 2).tolist()
        s = {"batch": picks[0], "seq": picks[1] + 3, "vocab": 12 + seed % 5, "d_model": picks[2]}
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    weight = torch.randn(s["vocab"], s["d_model"], generator=g, dtype=dtype)
    return s, tokens, weight


def _embed(fn: Callable[..., Any], tokens: Tensor, weight: Tensor, what: str) -> Tensor:
    """Call ``fn``, name the usual causes of a crash, and check the result's type, shape and dtype."""
    sizes = {**dict(zip(("batch", "seq")[2 - tokens.dim():], tokens.shape, strict=True)),
             "vocab": weight.shape[0], "d_model": weight.shape[1]}
    try:
        result = call(fn, tokens, weight)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        # What the code raised, not the message around it: the message is in the reader's language.
        raised = failure.raised
        if "Long" in raised:
            # tokens is the only int64 (Long) input: a Long operand in a product comes from it, through F.one_hot.
            hint = t("An int64 (Long) tensor met the floating weight: F.one_hot gives int64 entries, and a product "
                     "needs both factors in one floating dtype. Convert the one-hot matrix with .to(weight.dtype).")
        elif "Double" in raised or "dtype" in raised.lower():
            hint = t("The weight here is {dtype}, and a product needs both factors in one dtype: .float() makes "
                     "float32 whatever the weight is; convert the one-hot matrix with .to(weight.dtype).",
                     dtype=weight.dtype)
        elif int(tokens.max()) < weight.shape[0] - 1:
            hint = t("Here the largest id in tokens is {largest}, below vocab - 1 = {last_id}: "
                     "F.one_hot(tokens) without num_classes makes vectors of width max(tokens) + 1, not vocab. Pass "
                     "num_classes=weight.shape[0]: a batch need not hold every word of the vocabulary.",
                     largest=int(tokens.max()), last_id=weight.shape[0] - 1)
        elif tokens.dim() < 2:
            hint = t("The leading axes are *batch, any number of them, none included: write the einsum pattern with "
                     "'...' (\"... seq vocab, vocab d_model -> ... seq d_model\").")
        elif swapped := _swapped_product(fn, tokens, weight):
            hint = swapped
        else:
            hint = t("weight is (vocab, d_model), the layout of nn.Embedding.weight: contract the one-hot's vocab axis "
                     "with it.")
        raise CheckFailure(t("{what} ({sizes}): {error} {hint}", what=what, sizes=_named(sizes),
                             error=_sentence(str(failure)), hint=hint)) from None
    axes = " ".join([*("batch", "seq")[2 - tokens.dim():], "d_model"])
    if type(result) is Tensor and result.dtype != weight.dtype and result.dtype.is_floating_point:
        raise CheckFailure(t(
            "{what} ({sizes}): your embedding has dtype {got}, the weight {dtype}. .float() "
            "makes float32 whatever the weight is: convert the one-hot matrix with .to(weight.dtype).",
            what=what, sizes=_named(sizes), got=result.dtype, dtype=weight.dtype))
    return expect_tensor(result, t("the embedding"), (*tokens.shape, weight.shape[1]), axes, weight.dtype)


def _swapped_product(fn: Callable[..., Any], tokens: Tensor, weight: Tensor) -> str:
    """For a crash on (batch, seq) tokens: the call again on (seq,) tokens with seq = d_model, where an einsum whose
    operands come in the other order than its pattern runs. Named when it then returns weight @ one_hot(tokens)."""
    vocab, d_model = weight.shape
    toks = tokens.reshape(-1)[:d_model]
    if toks.numel() != d_model:
        return ""
    try:
        result = call(fn, toks, weight)
    except CheckFailure:
        return ""
    swapped = (weight.double() @ F.one_hot(toks, vocab).double()).to(weight.dtype)  # (vocab, vocab)
    if type(result) is not Tensor or not close(result, swapped, weight.dtype):
        return ""
    return t("On tokens of shape (seq,) with seq = d_model = {d_model} your function runs and returns "
             "weight @ one_hot(tokens), (vocab, vocab): the operands of your product come in the other order than "
             "its pattern. Pass the one-hot matrix first: einsum(one_hot, weight, \"... seq vocab, vocab d_model -> "
             "... seq d_model\").", d_model=d_model)


def _compare_embedding(got: Tensor, tokens: Tensor, weight: Tensor, what: str) -> None:
    expected = F.embedding(tokens, weight)
    product = (F.one_hot(tokens, weight.shape[0]).double() @ weight.double()).to(weight.dtype)
    if close(got, expected, weight.dtype) and close(got, product, weight.dtype):
        return
    sizes = {**dict(zip(("batch", "seq")[2 - tokens.dim():], tokens.shape, strict=True)),
             "vocab": weight.shape[0], "d_model": weight.shape[1]}
    found = difference(got, expected, sizes)
    hint = t("Position i should hold row tokens[i] of weight, which is what one_hot(tokens) @ weight gives: check "
             "that you contract the vocab axis of the one-hot vectors with the vocab axis of weight.")
    raise CheckFailure(t("{what}, your embedding differs from nn.Embedding's with the same weight ({difference}). "
                         "{hint}", what=what, difference=found, hint=hint))


def _leading_cases(tokens: Tensor) -> list[tuple[str, Tensor]]:
    return [(t("On tokens (batch, seq)"), tokens), (t("On one sentence, tokens (batch=1, seq)"), tokens[:1]),
            (t("On tokens (seq,) without a batch axis"), tokens[0])]


def _case(what: str, dtype: torch.dtype) -> str:
    """A case's label with the dtype it runs in: "On tokens (batch, seq), float32"."""
    return t("{case}, {dtype}", case=what, dtype=dtype_name(dtype))


@check(forbid=BUILT_IN_EMBEDDING)
def check_one_hot_embed(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to nn.Embedding with the same weight (and to F.one_hot(tokens) @ weight), in float32 and float64,
    for tokens with any leading axes, batch=1 included; the result has the weight's dtype."""
    for dt in dict.fromkeys((dtype, torch.float64, torch.float32)):
        _, tokens, weight = _embedding_inputs(seed, dt)
        tokens[..., 0] = weight.shape[0] - 1  # every batch holds the largest id; see check_one_hot_vocab
        for what, toks in _leading_cases(tokens):
            got = _embed(fn, toks, weight, _case(what, dt))
            _compare_embedding(got, toks, weight, _case(what, dt))
    passed(t("equal to nn.Embedding (and to one_hot @ weight) in float32 and float64, with (batch, seq), batch=1 "
             "and (seq,) tokens"))


@check(forbid=BUILT_IN_EMBEDDING)
def check_one_hot_vocab(fn: Callable[..., Any], seed: int = 0) -> None:
    """Batches that do not use every word: ids well below vocab - 1, a sentence of one repeated word."""
    for dtype in (torch.float64, torch.float32):
        s, tokens, weight = _embedding_inputs(seed + 1, dtype)
        rare = tokens % max(2, s["vocab"] // 3)  # ids from the first third of the vocabulary only
        cases = [(t("On a batch that uses only the first ids of the vocabulary"), rare),
                 (t("On a batch of one sentence, one word repeated"), torch.full((1, s["seq"]), 1))]
        for what, toks in cases:
            got = _embed(fn, toks, weight, _case(what, dtype))
            _compare_embedding(got, toks, weight, _case(what, dtype))
    passed(t("right on batches that leave most of the vocabulary out (one-hot vectors of width vocab)"))


# -- exercises 2 and 3: n-grams ----------------------------------------------------------------------

WORDS = ("the", "cat", "dog", "sat", "on", "mat", "a", "ran")


def _text(seed: int, length: int) -> list[str]:
    """A seeded text over a few words, with repeats, so that n-grams recur and some never occur."""
    g = torch.Generator().manual_seed(seed)
    vocab = WORDS[: 5 + seed % 3]
    # Skewed towards the first words: some n-grams recur often, others once.
    probs = torch.tensor([1.0 / (i + 1) for i in range(len(vocab))])
    ids = torch.multinomial(probs, length, replacement=True, generator=g).tolist()
    return [vocab[i] for i in ids]


def _counts_oracle(tokens: list[str], n: int) -> Counter:
    return Counter(zip(*(tokens[i:] for i in range(n)), strict=False))


def _items(counts: Any) -> list[tuple[Any, Any]]:
    """A mapping's (key, count) pairs as plain data, so that they can be recorded and replayed."""
    return [(key if _plain(key) else f"<{type(key).__name__}> {key!r}", value if _plain(value) else repr(value))
            for key, value in counts.items()]


def _show_gram(gram: Any) -> str:
    return repr(gram) if not isinstance(gram, tuple) else "(" + ", ".join(map(repr, gram)) + ("," if len(gram) == 1
                                                                                             else "") + ")"


# n-gram i of the usual slips, tuple(tokens[start : end]) for i in range(stop), each part with what it means; the
# first of each list is right. T is len(tokens).
# The meanings are shown with tr(): "each slice <start's> and <end's>", "the range <stop's>".
SLICE_STARTS = {"i": (lambda i, n: i, ""), "i + 1": (lambda i, n: i + 1, marked("starts one token late")),
                "i - 1": (lambda i, n: i - 1, marked("starts one token early"))}
SLICE_ENDS = {"i + n": (lambda i, n: i + n, ""),
              "i + n - 1": (lambda i, n: i + n - 1, marked("ends one token short")),
              "i + n + 1": (lambda i, n: i + n + 1, marked("ends one token too far")),
              "n": (lambda i, n: n, marked("ends at n instead of i + n, without the i")),
              "i": (lambda i, n: i, marked("ends at i, where it starts, without the n")),
              "i - n": (lambda i, n: i - n, marked("ends at i - n, subtracting n where it should add it"))}
SLICE_STOPS = {"len(tokens) - n + 1": (lambda t, n: t - n + 1, ""),
               "len(tokens) - n": (lambda t, n: t - n, marked("misses the last n-gram, one window too few")),
               "len(tokens) - n + 2": (lambda t, n: t - n + 2, marked("runs one window past the last n-gram")),
               "len(tokens)": (lambda t, n: t, marked("runs past the last n-gram, to the end of the text, where the "
                                                       "windows get shorter than n"))}


def _counts_slip(fn: Callable[..., Any], tokens: list[str]) -> tuple[str, str, str] | None:
    """The slice that the student's counts are made of, told by their counts for every n the check tries: named when
    one (start, end, stop) among the usual slips gives them all, and the right one does not."""
    ns = (1, 2, 3, 5, len(tokens), len(tokens) + 1)
    try:
        got = [dict(call(_items, call(fn, list(tokens), n))) for n in ns]
    except CheckFailure:
        return None
    # Slips that give the same counts for every n are one answer: the one with the fewest wrong parts stands for it.
    for wrong in range(1, 4):
        for (start, (first, why_start)), (end, (after, why_end)), (stop, (count, why_stop)) in itertools.product(
                SLICE_STARTS.items(), SLICE_ENDS.items(), SLICE_STOPS.items()):
            whys = [w for w in (why_start, why_end, why_stop) if w]
            if len(whys) != wrong:
                continue
            if all(dict(Counter(tuple(tokens[first(i, n) : after(i, n)]) for i in range(count(len(tokens), n))))
                   == counts for n, counts in zip(ns, got, strict=True)):
                return start, end, stop
    return None


@check
def check_ngram_counts(fn: Callable[..., Any], seed: int = 0) -> None:
    """Equal to collections.Counter over the n-grams (tuples of n consecutive tokens), for n = 1, 2, 3, 5, for
    n = len(tokens) (one n-gram) and n > len(tokens) (none)."""
    tokens = _text(seed, 23 + seed % 7)
    for n in (1, 2, 3, 5, len(tokens), len(tokens) + 1):
        result = call(fn, list(tokens), n)
        if kind(result) not in ("Counter", "dict", "defaultdict"):
            raise CheckFailure(t("ngram_counts should return a Counter (n-gram -> count), got {kind}. "
                                 "collections.Counter(iterable of n-grams) counts them for you.", kind=kind(result)))
        got = dict(call(_items, result))
        expected = _counts_oracle(tokens, n)
        where = t("on a text of {length} tokens with n={n}", length=len(tokens), n=n)
        bad_keys = [key for key in got if not (isinstance(key, tuple) and all(isinstance(w, str) for w in key))]
        if bad_keys:
            raise CheckFailure(t("The keys of your counts should be tuples of n tokens, like "
                                 "{example}, got {key!r} ({where}). A tuple, unlike a "
                                 "joined string, keeps the words apart, and unlike a list it can be a key.",
                                 example=_show_gram(tuple(tokens[:n])), key=bad_keys[0], where=where))
        odd = [v for v in got.values() if type(v) is not int]
        if odd:
            raise CheckFailure(t("Each count should be an int, got {count!r} ({where}).", count=odd[0], where=where))
        if got == dict(expected):
            continue
        total, expected_total = sum(got.values()), sum(expected.values())
        last = tuple(tokens[len(tokens) - n:]) if 0 < n <= len(tokens) else None
        slip = _counts_slip(fn, tokens)
        short = [key for key in got if len(key) < n]
        if slip == ("i", "i + n", "len(tokens) - n") and last is not None:
            hint = t("Off by one: your counts miss the last n-gram, {gram}. A text of T tokens has "
                     "T - n + 1 n-grams, so the positions run over range(len(tokens) - n + 1).", gram=_show_gram(last))
        elif slip == ("i", "i + n", "len(tokens)") and short:
            hint = t("Your counts hold {gram}, shorter than n: the windows that run past the end of "
                     "the text are not n-grams. A text of T tokens has T - n + 1 n-grams.", gram=_show_gram(short[0]))
        elif slip:
            hint = _slice_hint(*slip)
        elif short:
            hint = t("Among the keys is {gram}, of {length} tokens where an n-gram has n = "
                     "{n}: n-gram i is tuple(tokens[i : i + n]), for i in range(len(tokens) - n + 1).",
                     gram=_show_gram(short[0]), length=len(short[0]), n=n)
        elif last is not None and total == expected_total - 1 and got.get(last, 0) == expected[last] - 1:
            hint = t("Off by one: your counts miss the last n-gram, {gram}. A text of T tokens has "
                     "T - n + 1 n-grams, so the positions run over range(len(tokens) - n + 1).", gram=_show_gram(last))
        elif total == expected_total:
            hint = t("You count the right number of n-grams, but not the right ones: n-gram i is tokens[i : i + n].")
        else:
            hint = t("A text of T tokens has T - n + 1 n-grams: n-gram i is tuple(tokens[i : i + n]).")
        wrong = sorted({*got, *expected} - {k for k in expected if got.get(k) == expected[k]}, key=str)
        gram = wrong[0]
        raise CheckFailure(t("Your counts differ from collections.Counter's {where}: {total} n-grams counted instead "
                             "of {expected_total}, and {gram} counted {count} times instead of "
                             "{expected_count}. {hint}", where=where, total=total, expected_total=expected_total,
                             gram=_show_gram(gram), count=got.get(gram, 0), expected_count=expected.get(gram, 0),
                             hint=hint))
    passed(t("equal to collections.Counter over the n-grams, n = 1, 2, 3, 5, len(tokens) and beyond"))


def _slice_hint(start: str, end: str, stop: str) -> str:
    """What the slice tuple(tokens[start : end]) for i in range(stop) gets wrong, part by part."""
    start_why, end_why, stop_why = SLICE_STARTS[start][1], SLICE_ENDS[end][1], SLICE_STOPS[stop][1]
    if start_why and end_why:
        each_slice = t("each slice {start_why} and {end_why}", start_why=tr(start_why), end_why=tr(end_why))
    elif start_why or end_why:
        each_slice = t("each slice {why}", why=tr(start_why or end_why))
    else:
        each_slice = ""
    the_range = t("the range {why}", why=tr(stop_why)) if stop_why else ""
    if each_slice and the_range:
        mistakes = t("{each_slice}; {the_range}", each_slice=each_slice, the_range=the_range)
    else:
        mistakes = each_slice or the_range
    return t("Your counts are those of tuple(tokens[{start} : {end}]) for i in range({stop}), for every n "
             "tried: {mistakes}. n-gram i is tuple(tokens[i : i + n]) for i in "
             "range(len(tokens) - n + 1): a text of T tokens has T - n + 1 n-grams.", start=start, end=end, stop=stop,
             mistakes=mistakes)


def _probability_oracle(word: str, history: list[str], counts: Counter, contexts: Counter, n: int, vocab_size: int,
                        alpha: float, *, context_of: Callable[[list[str], int], tuple] | None = None,
                        top: float = 1.0, bottom: float | None = None, count_top: bool = True,
                        count_bottom: bool = True, divide: bool = True) -> float:
    """(C(context, word) + alpha) / (C(context) + alpha · vocab_size), and the mistaken variants: another context
    (``context_of``), alpha counted ``top`` times above, ``bottom`` · alpha below instead of vocab_size, a count
    left out above (``count_top``) or below (``count_bottom``), no division at all (``divide``)."""
    context = context_of(history, n) if context_of else (tuple(history[len(history) - n + 1:]) if n > 1 else ())
    above = counts[(*context, word)] * count_top + top * alpha
    if not divide:
        return above
    below = contexts[context] * count_bottom + alpha * (vocab_size if bottom is None else bottom)
    if not below:  # only without smoothing: a context never seen, which such code answers with 1 / vocab_size
        return 1 / vocab_size
    return above / below


# The contexts students take instead of the last n - 1 tokens of the history, each with what to say (shown with tr()).
CONTEXTS: dict[str, tuple[Callable[[list[str], int], tuple], str]] = {
    "right": (lambda h, n: tuple(h[len(h) - n + 1:]) if n > 1 else (), ""),
    "last n": (lambda h, n: tuple(h[len(h) - n:]),
               marked("Off by one: your context is the last n tokens of the history; it is the last n - 1 (an n-gram "
                      "is the context and the word).")),
    "last n + 1": (lambda h, n: tuple(h[max(len(h) - n - 1, 0):]),
                   marked("Your context is the last n + 1 tokens of the history, two too many: it is the last n - 1 "
                          "(an n-gram is the context and the word).")),
    "last n - 2": (lambda h, n: tuple(h[len(h) - n + 2:]) if n > 2 else (),
                   marked("Your context is one token short, the last n - 2 tokens of the history: it is the last "
                          "n - 1.")),
    "whole for n = 1": (lambda h, n: tuple(h[-(n - 1):]),
                        marked("For n = 1 your context is the whole history: history[-(n - 1):] is history[-0:] = "
                               "history[0:], all of it. A unigram has no context, the empty tuple ().")),
    "first": (lambda h, n: tuple(h[: n - 1]),
              marked("Your context is the first n - 1 tokens of the history; it is the last n - 1, the words just "
                     "before the one predicted.")),
    "empty": (lambda h, n: (),
              marked("Your context is the empty tuple () for every n, a unigram's: for n > 1 it is the last n - 1 "
                     "tokens of the history (the condition that picks the unigram case is inverted or too wide).")),
    "whole": (lambda h, n: tuple(h),
              marked("Your context is the whole history: it is only its last n - 1 tokens.")),
}
# The same slips in code that gives n = 1 its empty context first (`... if n > 1 else ()`), where they differ.
CONTEXTS_AFTER_UNIGRAM = {
    "last n": marked("For n > 1: off by one: your context is the last n tokens of the history; it is the last n - 1 "
                     "(an n-gram is the context and the word)."),
    "last n + 1": marked("For n > 1: your context is the last n + 1 tokens of the history, two too many: it is the "
                         "last n - 1 (an n-gram is the context and the word)."),
    "whole": marked("For n > 1: your context is the whole history: it is only its last n - 1 tokens."),
}
CONTEXTS.update({f"{name}, n > 1": ((lambda f: lambda h, n: f(h, n) if n > 1 else ())(CONTEXTS[name][0]), hint)
                 for name, hint in CONTEXTS_AFTER_UNIGRAM.items()})


def _probability_variants() -> dict[str, dict[str, Any]]:
    """The common mistakes in the formula, each as arguments of the oracle."""
    return {  # each key a hint, shown with tr()
        "": {},
        marked("Your probabilities are not smoothed: an n-gram never seen in training gets 0, so any text that holds "
               "one gets probability 0. Add alpha to the n-gram's count and alpha · vocab_size to the context's "
               "count."):
            {"top": 0.0, "bottom": 0.0},
        marked("You added alpha to the n-gram's count but not alpha · vocab_size to the context's: every word gets "
               "alpha more, so the probabilities over the vocabulary no longer sum to 1."): {"bottom": 0.0},
        marked("You added alpha to the context's count once, not once per word of the vocabulary: the denominator "
               "is C(context) + alpha · vocab_size."): {"bottom": 1.0},
        marked("You return the smoothed count C(context, word) + alpha without dividing it by C(context) + alpha · "
               "vocab_size: a probability is the n-gram's share of its context's count."): {"divide": False},
        marked("Your numerator is missing the n-gram's count: it is C(context, word) + alpha, so that a word seen "
               "after the context gets more than alpha."): {"count_top": False},
        marked("Your denominator is missing the context's count: it is C(context) + alpha · vocab_size, the number "
               "of n-grams that begin with the context plus alpha for each word."): {"count_bottom": False},
    }


def _probability_probe(fn: Callable[..., Any], seed: int) -> str | None:
    """Which context and which formula the student's function uses, told apart on counts of every order.

    The check's own counts hold n-grams of one order, where every context of another length is unseen and gives the
    same answer. Here the counts of 1- to 8-grams of a text sit in one Counter (and their contexts in another): a
    function that reads the key of the right length is unaffected, and each wrong context length reads counts of its
    own. A long text over three words makes every context of up to five words recur, each length with counts of its
    own (a context seen once would give the same answer at every length). The answer is named only when exactly one
    (context, formula) pair gives all the student's values."""
    g = torch.Generator().manual_seed(seed + 200)
    tokens = [WORDS[i] for i in torch.randint(0, 3, (1500,), generator=g).tolist()]
    counts: Counter = Counter()
    for order in range(1, 9):
        counts.update(_counts_oracle(tokens, order))
    contexts: Counter = Counter()
    for gram, count in counts.items():
        contexts[gram[:-1]] += count
    vocab_size = len(set(tokens)) + 1
    cases = [(list(tokens[i : i + 5]), tokens[i + 5], n, alpha)
             for n in (1, 2, 3) for i, alpha in ((3, 1.0), (17, 0.5), (41, 1.0))]
    try:
        got = [call(fn, word, list(history), counts, contexts, n=n, vocab_size=vocab_size, alpha=alpha)
               for history, word, n, alpha in cases]
    except CheckFailure:
        return None
    if not all(type(value) is float for value in got):
        return None
    found = [(context_hint, formula_hint)
             for context_of, context_hint in CONTEXTS.values()
             for formula_hint, variant in _probability_variants().items()
             if all(math.isclose(value, _probability_oracle(word, history, counts, contexts, n, vocab_size, alpha,
                                                            context_of=context_of, **variant),
                                 rel_tol=1e-9, abs_tol=1e-12)
                    for value, (history, word, n, alpha) in zip(got, cases, strict=True))]
    if len(found) != 1 or found[0] == ("", ""):
        return None
    context_hint, formula_hint = found[0]
    if context_hint and formula_hint:
        return t("{context_hint} {formula_hint}", context_hint=tr(context_hint), formula_hint=tr(formula_hint))
    return tr(context_hint or formula_hint)


@check
def check_ngram_probability(fn: Callable[..., Any], seed: int = 0) -> None:
    """Equal to (C(context, word) + alpha) / (C(context) + alpha · vocab_size) with the context the last n - 1 tokens,
    for n = 1, 2, 3 and two alphas, on seen and unseen n-grams and contexts; sums to 1 over the vocabulary."""
    tokens = _text(seed + 100, 60)
    vocab = sorted(set(tokens)) + ["unseen"]  # one word of the vocabulary never occurs in training
    vocab_size = len(vocab)
    g = torch.Generator().manual_seed(seed + 7)
    for n in (2, 1, 3):
        counts = _counts_oracle(tokens, n)
        contexts: Counter = Counter()
        for gram, count in counts.items():
            contexts[gram[:-1]] += count
        for alpha in (1.0, 0.25):
            seen = tokens[5 : 5 + n]
            histories = [
                (["cat", "unseen", *seen[:-1]], seen[-1], t("a seen n-gram")),
                (list(tokens[10 : 10 + n + 2]), "unseen", t("a word never seen after its context")),
                (["unseen"] * max(n - 1, 1), vocab[int(torch.randint(0, vocab_size - 1, (), generator=g))],
                 t("a context never seen in training")),
                (tuple(tokens[20 : 20 + n - 1]), tokens[20 + n - 1],
                 t("a history given as a tuple, exactly n - 1 long")),
            ]
            got, expected, cases = [], [], []
            for history, word, what in histories:
                args = (word, history, counts, contexts)
                kwargs = {"n": n, "vocab_size": vocab_size, "alpha": alpha}
                try:
                    value = call(fn, *args, **kwargs)
                except CheckFailure as failure:
                    # What the code raised, not the message around it: the message is in the reader's language.
                    raised = failure.raised if isinstance(failure, CodeRaised) else ""
                    hint = ""
                    if "ZeroDivisionError" in raised:
                        hint = t(" A context never seen in training has count 0, and so does your denominator: it is "
                                 "C(context) + alpha · vocab_size, never 0 (and the numerator C(context, word) + "
                                 "alpha).")
                    elif "unhashable" in raised or "concatenate" in raised:
                        hint = t(" Counter's keys are tuples: make the context a tuple (tuple(history[...])) before "
                                 "you look it up or add the word to it.")
                    raise CheckFailure(t("For {what} (n={n}, alpha={alpha}, history={history}, word={word!r}): "
                                         "{error}{hint}", what=what, n=n, alpha=alpha, history=list(history),
                                         word=word, error=str(failure), hint=hint)) from None
                if type(value) is not float:
                    raise CheckFailure(t("ngram_probability should return a Python float, got {kind} "
                                         "(n={n}, history={history}, word={word!r}).", kind=kind(value), n=n,
                                         history=list(history), word=word))
                got.append(value)
                expected.append(_probability_oracle(word, list(history), counts, contexts, n, vocab_size, alpha))
                cases.append((what, history, word))
            if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got, expected, strict=True)):
                continue
            i = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True))
                     if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))
            what, history, word = cases[i]
            hint = _probability_probe(fn, seed) or t(
                "Compare with (C(context, word) + alpha) / (C(context) + alpha · vocab_size), the context being the "
                "last n - 1 tokens of the history as a tuple.")
            raise CheckFailure(t(
                "For {what} (n={n}, alpha={alpha}, vocab_size={vocab_size}, history={history}, word={word!r}) "
                "you give {got:.6g}; the add-alpha estimate is {expected:.6g} (largest difference "
                "{largest:.3g} over {cases} cases). {hint}", what=what, n=n, alpha=alpha, vocab_size=vocab_size,
                history=list(history), word=word, got=got[i], expected=expected[i],
                largest=max(abs(a - b) for a, b in zip(got, expected, strict=True)), cases=len(got), hint=hint))
        history = tokens[30 : 30 + 4]
        total = sum(call(fn, word, list(history), counts, contexts, n=n, vocab_size=vocab_size, alpha=0.5)
                    for word in vocab)
        if not math.isclose(total, 1.0, rel_tol=1e-9):
            raise CheckFailure(t("Your probabilities of the {vocab_size} words after history={history} (n={n}, "
                                 "alpha=0.5) sum to {total:.6g}, not 1.", vocab_size=vocab_size, history=history, n=n,
                                 total=total))
        value = call(fn, tokens[40], list(history), counts, contexts, n=n, vocab_size=vocab_size)
        expected_value = _probability_oracle(tokens[40], list(history), counts, contexts, n, vocab_size, 1.0)
        if not (type(value) is float and math.isclose(value, expected_value, rel_tol=1e-9)):
            raise CheckFailure(t("Called without alpha (n={n}, history={history}, word={word!r}), your function "
                                 "gives {got!r}; alpha defaults to 1 (Laplace's rule), which gives "
                                 "{expected:.6g}.", n=n, history=history, word=tokens[40], got=value,
                                 expected=expected_value))
    passed(t("equal to the add-alpha estimate for n = 1, 2, 3 on seen and unseen n-grams and contexts; sums to 1 over "
             "the vocabulary"))


# -- exercise 4: additive attention -----------------------------------------------------------

def _attention_sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that a swapped axis or weight changes a shape and cannot pass."""
    return distinct_sizes(seed, ATTENTION_AXES, span=9, fixed=(2, 3, 5, 4, 6, 7, 8))


def _attention_inputs(seed: int, dtype: torch.dtype) -> tuple[dict[str, int], tuple[Tensor, ...]]:
    s = _attention_sizes(seed)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype) * std

    q, k, v = randn(s["batch"], s["q_len"], s["d_q"]), randn(s["batch"], s["k_len"], s["d_k"]), randn(
        s["batch"], s["k_len"], s["d_v"])
    # Weights of about nn.Linear's size, and a v_a large enough that the scores differ clearly between keys.
    w_q, w_k = randn(s["d_attn"], s["d_q"], std=1 / math.sqrt(s["d_q"])), randn(s["d_attn"], s["d_k"],
                                                                                 std=1 / math.sqrt(s["d_k"]))
    v_a = randn(s["d_attn"], std=2.0)
    return s, (q, k, v, w_q, w_k, v_a)


def _additive_oracle(q: Tensor, k: Tensor, v: Tensor, w_q: Tensor, w_k: Tensor, v_a: Tensor,
                     mask: Tensor | None = None, *, tanh: bool = True, dim: int = -1, scale: float = 1.0,
                     v_a_ones: bool = False, mask_style: str = "fill", transposed: str = "") -> tuple[Tensor, Tensor]:
    """score_ij = v_aᵀ tanh(W_q q_i + W_k k_j), one key at a time in float64; then the masked softmax over k_len.
    The keyword arguments give the common mistakes (no tanh, softmax over q_len, a scale, no v_a, masks done
    otherwise, a projection transposed)."""
    q, k, v, w_q, w_k, v_a = (x.double() for x in (q, k, v, w_q, w_k, v_a))
    v_a = torch.ones_like(v_a) if v_a_ones else v_a
    query, key = F.linear(q, w_q), F.linear(k, w_k)  # (..., q_len, d_attn), (..., k_len, d_attn)
    # A projection that comes out transposed, (d_attn, len), runs where len = d_attn.
    query = query.transpose(-2, -1) if "query" in transposed else query
    key = key.transpose(-2, -1) if "key" in transposed else key
    columns = []
    for j in range(k.shape[-2]):
        pre = query + key[..., j : j + 1, :]  # (..., q_len, d_attn): query i with key j
        columns.append(F.linear(torch.tanh(pre) if tanh else pre, v_a[None])[..., 0])
    scores = torch.stack(columns, dim=-1) * scale  # (..., q_len, k_len)
    if mask is None:
        weights = torch.softmax(scores, dim=dim)
    else:
        raw_mask, mask = mask, mask.expand_as(scores)
        if mask_style == "fill":
            weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=dim).nan_to_num(0.0)
        elif mask_style == "inverted":
            weights = torch.softmax(scores.masked_fill(mask, -math.inf), dim=dim).nan_to_num(0.0)
        elif mask_style == "after":
            weights = torch.softmax(scores, dim=dim) * mask
        elif mask_style == "zero":
            weights = torch.softmax(scores.masked_fill(~mask, 0.0), dim=dim)
        elif mask_style == "add":  # the mask added to the scores as numbers
            weights = torch.softmax(scores + mask.double(), dim=dim)
        else:  # the guard of fully masked rows, written as the solution does, with one slip
            weights = _guarded_softmax(scores, raw_mask, dim, mask_style)
    return weights @ v, weights


def _guarded_softmax(scores: Tensor, mask: Tensor, dim: int, slip: str) -> Tensor:
    """The masked softmax as the solution writes it, with the guard of fully masked rows, ``has_key =
    mask.any(dim=-1, keepdim=True)``, mistaken as ``slip`` says: ``all`` instead of ``any``, over the query axis
    (``q_axis``), without keepdim (``no_keepdim``, in both places or only where it zeroes the ``scores`` or the
    ``weights``), or with ``~has_key`` inverted where it zeroes the scores (``scores_inverted``) or the weights
    (``weights_inverted``)."""
    if slip == "guard all":
        has_key = mask.all(dim=-1, keepdim=True)
    elif slip == "guard q_axis":
        has_key = mask.any(dim=-2, keepdim=True)
    else:
        has_key = mask.any(dim=-1, keepdim=True)
    fill_scores = has_key if slip == "guard scores_inverted" else ~has_key
    fill_weights = has_key if slip == "guard weights_inverted" else ~has_key
    if slip.startswith("guard no_keepdim"):  # (..., q_len) lines up with the keys' axis: runs only where they agree
        fill_scores = ~mask.any(dim=-1) if "weights" not in slip else fill_scores
        fill_weights = ~mask.any(dim=-1) if "scores" not in slip else fill_weights
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf).masked_fill(fill_scores, 0.0), dim=dim)
    return weights.masked_fill(fill_weights, 0.0)


def _attention_variants(mask: Tensor | None, d_attn: int) -> dict[str, dict[str, Any]]:
    """The common mistakes, each a hint (shown with tr()) and the oracle's arguments that make it."""
    variants: dict[str, dict[str, Any]] = {
        marked("tanh is missing: without it the score is v_aᵀ W_q q_i + v_aᵀ W_k k_j, and the query's term is the "
               "same for every key, so it cancels in the softmax: every query gets the same weights. Score with "
               "v_aᵀ tanh(W_q q_i + W_k k_j)."): {"tanh": False},
        marked("You took the softmax over the query axis: take it over k_len (dim=-1), so that each query's weights "
               "over the keys sum to 1."): {"dim": -2},
        marked("You scaled the scores by 1/sqrt(d_attn): additive attention has no scaling, its tanh keeps the "
               "scores bounded."): {"scale": 1 / math.sqrt(d_attn)},
        marked("You left v_a out (summing tanh(...) over d_attn is v_a = 1): the score is the dot product of v_a "
               "with tanh(W_q q_i + W_k k_j)."): {"v_a_ones": True},
    }
    if mask is not None:
        variants.update({
            marked("Your mask is inverted: True means 'may attend', so fill the scores where the mask is False."):
                {"mask_style": "inverted"},
            marked("You masked after the softmax: the masked keys get 0 but the others no longer sum to 1. Fill the "
                   "scores with -inf before the softmax."): {"mask_style": "after"},
            marked("You filled the masked scores with 0, which is an ordinary score: fill them with -inf."):
                {"mask_style": "zero"},
            marked("You added the mask to the scores as numbers: use it to choose, scores.masked_fill(~mask, -inf)."):
                {"mask_style": "add"},
            # The guard of fully masked rows (there are none in these masks, so a right guard changes nothing).
            marked("Your output is the masked attention with every query that has a masked key zeroed, as if the "
                   "guard of fully masked rows asked whether all keys are kept (mask.all) where it should ask whether "
                   "at least one is: has_key = mask.any(dim=-1, keepdim=True)."): {"mask_style": "guard all"},
            marked("Your output is the masked attention with the guard of fully masked rows taken over the query axis "
                   "(dim=-2): a query has no key left when its row of the mask, over k_len, holds no True: "
                   "mask.any(dim=-1, keepdim=True)."): {"mask_style": "guard q_axis"},
            marked("Your output gives every query that has a key the same weight on all k_len keys, masked ones "
                   "included: the guard that sets the scores of fully masked rows to 0 is inverted, it overwrote the "
                   "rows that have keys. Fill where ~has_key, the rows with no key."):
                {"mask_style": "guard scores_inverted"},
            marked("Your weights are zero in every row that has a key: the guard that zeroes fully masked rows after "
                   "the softmax is inverted. Zero the weights where ~has_key, the rows with no key."):
                {"mask_style": "guard weights_inverted"},
        })
    return variants


def _attention_names(q: Tensor, k: Tensor, v: Tensor, w_q: Tensor) -> dict[str, int]:
    lead = {"batch": q.shape[0]} if q.dim() == 3 else {}
    return {**lead, "q_len": q.shape[-2], "k_len": k.shape[-2], "d_q": q.shape[-1], "d_k": k.shape[-1],
            "d_v": v.shape[-1], "d_attn": w_q.shape[0]}


def _runs(fn: Callable[..., Any], inputs: tuple[Tensor, ...]) -> bool:
    """Whether ``fn(*inputs)`` returns without raising: tells a failure of the mask's path from the rest."""
    try:
        call(fn, *inputs)
    except CheckFailure:
        return False
    return True


def _square_projection_hint(fn: Callable[..., Any], inputs: tuple[Tensor, ...]) -> str:
    """For a shape error without a mask: the call again on 2-D inputs with q_len = k_len = d_attn, where a projection
    that comes out transposed, (d_attn, len) for (len, d_attn), still runs. Named when it runs, the right answer
    differs from its output, and exactly one of the transposed projections gives it."""
    q, k, v, w_q, w_k, v_a = inputs
    d_attn = w_q.shape[0]
    g = torch.Generator().manual_seed(27)
    square = (torch.randn(d_attn, q.shape[-1], generator=g, dtype=q.dtype),
              torch.randn(d_attn, k.shape[-1], generator=g, dtype=q.dtype),
              torch.randn(d_attn, v.shape[-1], generator=g, dtype=q.dtype), w_q, w_k, v_a)
    try:
        result = call(fn, *square)
    except CheckFailure:
        return ""
    output = result[0] if isinstance(result, tuple) and len(result) == 2 else None
    if type(output) is not Tensor or output.shape != (d_attn, v.shape[-1]):
        return ""
    right, _ = _additive_oracle(*square)
    tolerance = 1e-4 if q.dtype == torch.float32 else 1e-9
    if close(output, right.to(q.dtype), q.dtype, tolerance):
        return ""
    found = [which for which in ("query", "key", "query key")
             if close(output, _additive_oracle(*square, transposed=which)[0].to(q.dtype), q.dtype, tolerance)]
    if len(found) != 1:
        return ""
    names = {"query": "W_q q", "key": "W_k k"}.get(found[0]) or t("W_q q and W_k k")
    return t(" On 2-D inputs with q_len = k_len = d_attn = {d_attn} your function runs, and gives what it gives with "
             "{names} transposed, (d_attn, len) instead of (len, d_attn). Check that the operands of that einsum "
             "come in the order of its pattern, the inputs first: einsum(q, w_q, \"... q_len d_q, d_attn d_q -> ... "
             "q_len d_attn\"), and likewise for k.", d_attn=d_attn, names=names)


def _square_mask_hint(fn: Callable[..., Any], inputs: tuple[Tensor, ...]) -> str:
    """For a shape error that only the mask causes: the call again on 2-D inputs with q_len = k_len, where an axis
    of q_len and one of k_len line up, and a mask with a fully masked row. When it runs and gives what the guard of
    fully masked rows gives without keepdim (and the right answer does not), that is named."""
    q, k, v, *weights_in = inputs
    m = min(q.shape[-2], k.shape[-2])
    if m < 2:
        return ""
    square = (q.reshape(-1, q.shape[-1])[:m], k.reshape(-1, k.shape[-1])[:m], v.reshape(-1, v.shape[-1])[:m],
              *weights_in)
    mask = torch.ones(m, m, dtype=torch.bool)
    mask[1] = False  # query 1 may read no key
    mask[0, -1] = False
    try:
        result = call(fn, *square, mask)
    except CheckFailure:
        return ""
    output = result[0] if isinstance(result, tuple) and len(result) == 2 else None
    if type(output) is not Tensor or output.shape != (m, v.shape[-1]):
        return ""
    right, _ = _additive_oracle(*square, mask)
    if close(output, right.to(q.dtype), q.dtype):
        return ""
    for place in ("", " scores", " weights"):
        slipped, _ = _additive_oracle(*square, mask, mask_style="guard no_keepdim" + place)
        if close(output.nan_to_num(0.0), slipped.to(q.dtype), q.dtype, 1e-4 if q.dtype == torch.float32 else 1e-9):
            return t(" On 2-D inputs with q_len = k_len = {m} it runs, and gives what the guard of fully masked rows "
                     "gives without keepdim: mask.any(dim=-1) drops the k_len axis, and its (..., q_len) then lines "
                     "up with the keys' axis. Keep it with keepdim=True.", m=m)
    return ""


def _attend(fn: Callable[..., Any], inputs: tuple[Tensor, ...], mask: Tensor | None,
            where: str) -> tuple[Tensor, Tensor]:
    """Call ``fn``; check that it returns (output, weights) of the right types, shapes and dtype."""
    q, k, v, w_q, w_k, v_a = inputs
    sizes = _attention_names(q, k, v, w_q)
    try:
        result = call(fn, *inputs) if mask is None else call(fn, *inputs, mask)
    except CheckFailure as failure:
        if not isinstance(failure, CodeRaised):
            raise
        hint = ""
        # What the code raised, not the message around it: the message is in the reader's language.
        raised = failure.raised
        every_key = torch.ones(*q.shape[:-1], k.shape[-2], dtype=torch.bool)
        if mask is None and _runs(fn, (*inputs, every_key)):
            hint = t(" The same call with a mask that keeps every key, which must change nothing, runs: your code "
                     "uses the mask when mask is None. Guard each step that uses it with `if mask is not None`.")
        elif mask is None and "'NoneType' object has no attribute" in raised:
            hint = t(" Called without a mask, your code read an attribute of None, and mask is the only argument "
                     "that is None: a step that uses the mask runs when mask is None. Guard each step that uses it "
                     "with `if mask is not None`.")
        elif mask is not None and _runs(fn, inputs):
            hint = t(" The same call without the mask runs, so the error comes from where your code uses the mask: "
                     "compare the shape of each tensor you make from it with the scores' (..., q_len, k_len).{more}",
                     more=_square_mask_hint(fn, inputs))
        elif mask is None and (square := _square_projection_hint(fn, inputs)):
            hint = square
        elif q.dim() == 2:
            hint = t(" The leading axes are *batch, any number of them, none included: write einsum patterns with "
                     "'...' (\"... q_len d_q, d_attn d_q -> ... q_len d_attn\"), never with fixed axis numbers.")
        elif "shape" in raised or "size" in raised:
            hint = t(" w_q is (d_attn, d_q) and w_k is (d_attn, d_k), the layout of nn.Linear.weight: W_q q is "
                     "einsum(q, w_q, \"... q_len d_q, d_attn d_q -> ... q_len d_attn\"). The query and key terms "
                     "meet in a (..., q_len, k_len, d_attn) tensor: add axes of size 1 with rearrange.")
        text = _sentence(str(failure)) if hint else str(failure)
        raise CheckFailure(t("{where} (sizes {sizes}): {error}{hint}", where=where, sizes=_named(sizes), error=text,
                             hint=hint)) from None
    if not isinstance(result, tuple) or len(result) != 2:
        raise CheckFailure(t("{where} (sizes {sizes}): additive_attention should return a pair "
                             "(output, weights), got {kind}.", where=where, sizes=_named(sizes), kind=kind(result)))
    lead = [n for n in ("batch",) if n in sizes]
    output = expect_tensor(result[0], t("output"), (*q.shape[:-2], q.shape[-2], v.shape[-1]),
                           " ".join([*lead, "q_len d_v"]), q.dtype)
    weights = expect_tensor(result[1], t("weights"), (*q.shape[:-2], q.shape[-2], k.shape[-2]),
                            " ".join([*lead, "q_len k_len"]), q.dtype)
    return output, weights


def _diagnose_attention(inputs: tuple[Tensor, ...], mask: Tensor | None, output: Tensor, weights: Tensor) -> str:
    q, k, v, w_q, *_ = inputs
    dtype = q.dtype
    expected, _ = _additive_oracle(*inputs, mask)
    found = difference(output, expected.to(dtype), _attention_names(q, k, v, w_q))
    tolerance = 1e-4 if dtype == torch.float32 else 1e-9
    # NaN counts as 0 here: an inverted mask, say, also leaves NaN where it hides every key of a row.
    matches = []
    for hint, variant in _attention_variants(mask, w_q.shape[0]).items():
        try:
            out, _ = _additive_oracle(*inputs, mask, **variant)
        except RuntimeError:  # a slip that cannot broadcast on these shapes
            continue
        if close(output.nan_to_num(0.0), out.nan_to_num(0.0).to(dtype), dtype, tolerance):
            matches.append(hint)
    if len(matches) == 1:
        return t("{hint} (Your output: {difference}.)", hint=tr(matches[0]), difference=found)
    if torch.isnan(output).any() or torch.isnan(weights).any():
        return t("Your result contains NaN ({difference}). A query whose keys are all masked must give zeros: the "
                 "softmax of a row of -inf is NaN.", difference=found)
    return t("Your output differs from the definition ({difference}) and matches none of the common mistakes. On a "
             "small example, compare your scores with v_aᵀ tanh(W_q q_i + W_k k_j) for one query i and key j, then "
             "their softmax over k_len.", difference=found)


def _leading(inputs: tuple[Tensor, ...]) -> list[tuple[str, tuple[Tensor, ...]]]:
    q, k, v, *weights = inputs
    return [(t("With (batch, q_len, d) inputs"), inputs), (t("With batch=1"), (q[:1], k[:1], v[:1], *weights)),
            (t("With 2-D (q_len, d) inputs, no batch axis"), (q[0], k[0], v[0], *weights))]


@check
def check_additive_attention_shapes(fn: Callable[..., Any], seed: int = 0) -> None:
    """output is (*batch, q_len, d_v) and weights (*batch, q_len, k_len), in the inputs' dtype, for a batch axis,
    batch=1 and no batch axis."""
    for dtype in (torch.float32, torch.float64):
        _, inputs = _attention_inputs(seed, dtype)
        for where, case in _leading(inputs):
            _attend(fn, case, None, _case(where, dtype))
    passed(t("shapes and dtypes are right, with a batch axis, batch=1 and no batch axis"))


@check
def check_additive_attention_values(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Equal to softmax over k_len of v_aᵀ tanh(W_q q_i + W_k k_j), written out key by key in float64, and its
    weighted sum of v, without a mask; each row of weights sums to 1."""
    _, inputs = _attention_inputs(seed, dtype)
    for where, case in _leading(inputs):
        sizes = _attention_names(*case[:4])
        output, weights = _attend(fn, case, None, where)
        expected_out, expected_w = _additive_oracle(*case)
        if not close(output, expected_out.to(dtype), dtype):
            raise CheckFailure(t("{case}, {dtype}: {diagnosis}", case=where, dtype=dtype_name(dtype),
                                 diagnosis=_diagnose_attention(case, None, output, weights)))
        if not close(weights, expected_w.to(dtype), dtype):
            raise CheckFailure(t("{case}, {dtype}: your output is right but the weights you return are "
                                 "not the softmax of the scores ({difference}): "
                                 "return the weights that you multiplied v by.", case=where, dtype=dtype_name(dtype),
                                 difference=difference(weights, expected_w.to(dtype), sizes)))
    # An exact answer: with one key every query gives it weight 1 and reads its value, whatever the scores.
    q, k, v, *weights_in = inputs
    one_key = (q, k[..., :1, :], v[..., :1, :], *weights_in)
    output, weights = _attend(fn, one_key, None, t("With one key (k_len=1)"))
    sizes = _attention_names(*one_key[:4])
    if not (close(weights, torch.ones_like(weights), dtype) and close(output, v[..., :1, :].expand_as(output), dtype)):
        raise CheckFailure(t("With one key (k_len=1) every query gives it weight 1 and its output is that key's "
                             "value; yours differ (weights: {weights_difference}; output: "
                             "{output_difference}). Look at the axis of "
                             "your softmax (it must be k_len, dim=-1) and at anything that drops the k_len axis when "
                             "it is 1 (a squeeze).",
                             weights_difference=difference(weights, torch.ones_like(weights), sizes),
                             output_difference=difference(output, v[..., :1, :].expand_as(output), sizes)))
    passed(t("equal to softmax(v_aᵀ tanh(W_q q + W_k k)) written out key by key, and its weighted sum of v; weight 1 "
             "on a single key ({dtype})", dtype=dtype_name(dtype)))


@check
def check_additive_attention_mask(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """Masked keys get exactly 0, the others their softmax weight (summing to 1), masks broadcast, and a fully
    masked row gives zero weights and a zero output, not NaN."""
    s, inputs = _attention_inputs(seed, dtype)
    q, k, v, *weights_in = inputs
    g = torch.Generator().manual_seed(seed + 1)
    b, q_len, k_len = s["batch"], s["q_len"], s["k_len"]
    full = torch.rand(b, q_len, k_len, generator=g) < 0.6
    full[..., 0] = True  # every query keeps a key here; the fully masked row comes last
    lengths = torch.randint(1, k_len + 1, (b,), generator=g)
    padding = torch.arange(k_len).expand(b, 1, k_len) < lengths.view(b, 1, 1)  # (batch, 1, k_len)
    cases = [(t("a random (batch, q_len, k_len) mask"), inputs, full),
             (t("a padding mask (batch, 1, k_len)"), inputs, padding),
             (t("a padding mask on batch=1"), (q[:1], k[:1], v[:1], *weights_in), padding[:1]),
             (t("a (q_len, k_len) mask on 2-D inputs"), (q[0], k[0], v[0], *weights_in), full[0])]
    for what, case, mask in cases:
        sizes = _attention_names(*case[:4])
        output, weights = _attend(fn, case, mask, t("With {mask}", mask=what))
        expected_out, expected_w = _additive_oracle(*case, mask)
        if not close(output, expected_out.to(dtype), dtype):
            raise CheckFailure(t("With {mask}, {dtype}: {diagnosis}", mask=what, dtype=dtype_name(dtype),
                                 diagnosis=_diagnose_attention(case, mask, output, weights)))
        leaked = weights.masked_select(~mask.expand_as(weights))
        if leaked.numel() and leaked.abs().max() != 0:
            raise CheckFailure(t("With {mask}, masked keys got weight up to {largest:.3g} (sizes "
                                 "{sizes}); they must get exactly 0: fill their scores with -inf before the "
                                 "softmax.", mask=what, largest=leaked.abs().max().item(), sizes=_named(sizes)))
        if not close(weights, expected_w.to(dtype), dtype):
            raise CheckFailure(t("With {mask} your output is right, but the weights you return differ from the masked "
                                 "softmax ({difference}): return the weights that "
                                 "you multiplied v by.", mask=what,
                                 difference=difference(weights, expected_w.to(dtype), sizes)))
        sums = weights.sum(-1)
        if not close(sums, torch.ones_like(sums), dtype):
            raise CheckFailure(t("With {mask}, each query's weights over its unmasked keys should sum to 1 "
                                 "({difference}).", mask=what,
                                 difference=difference(sums, torch.ones_like(sums), sizes)))
    blind = full.clone()
    blind[:, 1, :] = False  # query 1 of every sentence may read no key
    output, weights = _attend(fn, inputs, blind, t("With a mask that hides every key from query 1"))
    row_out, row_w = output[:, 1], weights[:, 1]
    where = t("query 1 of every sentence, sizes {sizes}", sizes=_named(s))
    if torch.isnan(row_out).any() or torch.isnan(row_w).any():
        raise CheckFailure(t("A query whose keys are all masked gives NaN (the softmax of a row of -inf), {where}. "
                             "Give such rows zero weights and a zero output: find them with mask.any(dim=-1, "
                             "keepdim=True).", where=where))
    if row_out.abs().max() != 0 or row_w.abs().max() != 0:
        raise CheckFailure(t("A query whose keys are all masked should get zero weights and a zero output ({where}), "
                             "got weights {weights} with largest {largest:.3g} (output: "
                             "{output_difference}).", where=where, weights=describe(row_w),
                             largest=row_w.abs().max().item(),
                             output_difference=difference(row_out, torch.zeros_like(row_out))))
    others = torch.cat([output[:, :1], output[:, 2:]], dim=1)
    expected_out, _ = _additive_oracle(*inputs, blind)
    expected_others = torch.cat([expected_out[:, :1], expected_out[:, 2:]], dim=1).to(dtype)
    if not close(others, expected_others, dtype):
        raise CheckFailure(t("With a fully masked query 1, the other queries' outputs changed "
                             "({difference}): only that row should be zeroed.",
                             difference=difference(others, expected_others, s)))
    passed(t("masks: masked keys get 0 and the others sum to 1, masks broadcast (batch=1 and 2-D too), a fully masked "
             "row gives zeros ({dtype})", dtype=dtype_name(dtype)))


# -- exercise 5: the measurement ----------------------------------------------------------------

def _reference_top_weight(d_k: int, additive: bool, q_len: int, k_len: int, d_attn: int, g: torch.Generator,
                          samples: int = 256, scaled: bool = False, dim: int = -1) -> float:
    """A fresh sample of the mean largest weight, computed here without the student's code (new weights for each
    sample, as the exercise asks)."""
    q = torch.randn(samples, q_len, d_k, generator=g, dtype=torch.float64)
    k = torch.randn(samples, k_len, d_k, generator=g, dtype=torch.float64)
    if additive:
        w_q = torch.randn(samples, d_attn, d_k, generator=g, dtype=torch.float64) / math.sqrt(d_k)
        w_k = torch.randn(samples, d_attn, d_k, generator=g, dtype=torch.float64) / math.sqrt(d_k)
        v_a = torch.randn(samples, d_attn, 1, generator=g, dtype=torch.float64) / math.sqrt(d_attn)
        query, key = q @ w_q.transpose(-2, -1), k @ w_k.transpose(-2, -1)  # (samples, len, d_attn)
        scores = torch.stack([torch.tanh(query + key[:, j : j + 1]) @ v_a for j in range(k_len)], dim=-2)[..., 0]
    else:
        scores = q @ k.transpose(-2, -1) / (math.sqrt(d_k) if scaled else 1.0)
    return torch.softmax(scores, dim=dim).amax(dim=-1).mean().item()


# |your value - a fresh sample's| under correct code, per (d_k, additive) cell, with q_len=20, k_len=5, d_attn=12,
# samples=48 against the check's 256. benchmarks/check_noise.py, part "top_weight" (50000 draws per cell): the
# difference has standard deviation 0.0103, 0.0110 (d_k=4, dot product/additive), 0.0053, 0.0099 (64), 0.0040,
# 0.0097 (256); the library's own function over 200 seeds agrees (0.0098, 0.0109, 0.0053 in the first three cells,
# largest difference 3.5 of these). Tolerance: 5.23 standard deviations (_noise.normal_tolerance for six
# comparisons: correct code fails a call with probability below 1e-6). Effects of the usual mistakes on the
# expected value, measured in the first three cells: keys drawn with the query count (20 keys, not 5) -0.21, -0.22,
# -0.06 (caught by 16, 25 and 5.5 standard deviations beyond the tolerance); k_len ignored (16 keys) -0.18, -0.19,
# -0.05; dividing by sqrt(d_k) -0.17 and -0.44 (dot product); the mean weight, not the largest, -0.41, -0.12, -0.70;
# v_a not divided by sqrt(d_attn) +0.25 (additive); torch.rand draws -0.33 and -0.36 (dot product); softmax over
# the queries -0.26 to -0.68. Not caught by the mean, whose expected value they move by 0.031 at most: d_attn
# ignored, w_q and w_k not divided by sqrt(d_k), one set of additive weights for all samples; q_len, samples and
# seed are left to the calls after the table (the mean does not depend on them). A draw of the additive branch that
# does not use the generator is told by calling additive=True twice; w_q alone divided by d_k, not sqrt(d_k), moves the
# mean by about 0.01 (0.345 against 0.336 at d_k=4), within the noise, and a loop of samples + 1 draws has the same
# distribution: neither is told apart.
TOP_WEIGHT_TOLERANCE = {(4, False): 0.054, (4, True): 0.058, (64, False): 0.028, (64, True): 0.052,
                        (256, False): 0.021, (256, True): 0.051}
# The hint "you divided by sqrt(d_k)" compares with the scaled dot product's mean, allowed 5.23 standard deviations
# of its difference from a fresh sample, 0.0080, 0.0049, 0.0047 for d_k = 4, 64, 256 (same
# functions, 20000 draws each).
SCALED_TOLERANCE = {4: 0.042, 64: 0.026, 256: 0.024}
# One query over two keys, d_k=4, dot product: the sd of a single draw's largest weight (check_noise.py, 480000
# draws): the sd of 24 calls with samples=1 is 0.995 ± 0.100 of it for correct code (lowest 0.490 in 20000
# repetitions) and 0.123 ± 0.018 when samples is ignored (highest 0.187), either side of _noise.SPREAD_THRESHOLD.
SINGLE_DRAW_SD = 0.1546


def _measure(fn: Callable[..., Any], d_k: int, **kwargs: Any) -> Any:
    """Call ``mean_top_weight``; an error raised from mixed dtypes says where they come from."""
    try:
        return call(fn, d_k, **kwargs)
    except CheckFailure as failure:
        said = failure.text if isinstance(failure, CodeRaised) else ""
        if re.search(r"\bdouble\b", said, re.I) and re.search(r"\bfloat\b", said, re.I):
            # Every tensor of the exercise is drawn in float64: a float32 one is a draw without its dtype.
            raise CheckFailure(t("{error} Your tensors mix float32 and float64: the exercise draws "
                                 "every tensor in float64, and torch.randn without dtype=torch.float64 gives float32. "
                                 "Pass dtype=torch.float64 to each draw.", error=_sentence(str(failure)))) from None
        raise


def _measure_runs(fn: Callable[..., Any], **kwargs: Any) -> bool:
    try:
        call(fn, 4, additive=False, q_len=1, k_len=2, **kwargs)
    except CheckFailure:
        return False
    return True


def _top_weight_hint(table: dict[tuple[int, bool], float], references: dict[tuple[int, bool], float],
                     cell: tuple[int, bool], lengths: tuple[int, int, int], g: torch.Generator) -> str:
    """What a measurement that disagrees with a fresh sample in ``cell`` probably does: a hypothesis is named only
    when it agrees with the student's values in every cell it concerns (every d_k), and the right answer does not."""
    (d_k, additive), (q_len, k_len, d_attn) = cell, lengths
    value = table[cell]
    dots = [d for d, a in table if not a]
    if abs(value - 1 / k_len) < 1e-6:
        return t("You took the mean weight, which is always 1/k_len: take each query's largest weight (max over "
                 "k_len).")
    if all(abs(table[d, a] - references[d, not a]) <= max(TOP_WEIGHT_TOLERANCE[d, a], TOP_WEIGHT_TOLERANCE[d, not a])
           for d, a in table):
        return t("Your additive=False values agree with fresh samples of additive attention, and your additive=True "
                 "values with the dot product's, at every d_k: the branch on additive is inverted.")
    if additive:
        if value > references[cell]:
            return t("Your additive attention is more peaked than it should be. Does exercise 4 pass (the tanh keeps "
                     "each score bounded)? Are w_q and w_k drawn with torch.randn divided by sqrt(d_k), and v_a with "
                     "torch.randn divided by sqrt(d_attn)?")
        return t("Are q, k, w_q, w_k and v_a drawn with torch.randn, w_q and w_k divided by sqrt(d_k) and v_a by "
                 "sqrt(d_attn), with the q_len, k_len, d_attn and samples you are given, and is the result the mean "
                 "over every query of its largest weight?")
    scaled = {d: _reference_top_weight(d, False, q_len, k_len, d_attn, g, scaled=True) for d in dots}
    if all(abs(table[d, False] - scaled[d]) < SCALED_TOLERANCE[d] for d in dots):
        return t("You divided the dot products by sqrt(d_k): this experiment measures the unscaled scores q·k.")
    over_queries = {d: _reference_top_weight(d, False, q_len, k_len, d_attn, g, dim=-2) for d in dots}
    if all(abs(table[d, False] - over_queries[d]) <= TOP_WEIGHT_TOLERANCE[d, False] for d in dots):
        return t("Your dot-product values agree, at every d_k, with fresh samples of a softmax taken over the queries "
                 "(for d_k={d_k}, about {value:.3f}): take it over the keys, dim=-1, so that each query's "
                 "weights sum to 1.", d_k=d_k, value=over_queries[d_k])
    over_q_len = {d: _reference_top_weight(d, False, q_len, q_len, d_attn, g) for d in dots}
    if all(abs(table[d, False] - over_q_len[d]) <= TOP_WEIGHT_TOLERANCE[d, False] for d in dots):
        return t("That is the largest weight over {q_len} keys, as many as queries (a fresh sample gives about "
                 "{value:.3f}): are the keys drawn with k_len rows, torch.randn(k_len, d_k), and are your "
                 "scores (q_len, k_len), a row per query?", q_len=q_len, value=over_q_len[d_k])
    return t("Are q and k unit-variance (torch.randn) with the q_len, k_len and samples you are given, are the scores "
             "the unscaled q·k, softmaxed over the keys, and is the result the mean over every query of its largest "
             "weight?")


@check
def check_top_weight_measurement(fn: Callable[..., Any], seed: int = 0) -> None:
    """Unscaled dot-product attention gets peaked as d_k grows, additive attention does not; each value agrees with a
    fresh sample taken here; one key gets weight exactly 1; seed and samples are used."""
    # Not the defaults (16 queries and keys, d_attn 32, 64 samples), and q_len far from k_len: a function that
    # ignores an argument, or draws the keys with the query count, is off by more than the noise.
    q_len, k_len, d_attn, samples = 20, 5, 12, 48
    table = {}
    with one_thread():
        for d_k in (4, 64, 256):
            for additive in (False, True):
                table[d_k, additive] = _measure(fn, d_k, additive=additive, q_len=q_len, k_len=k_len, d_attn=d_attn,
                                                samples=samples, seed=seed)
    for (d_k, additive), value in table.items():
        if type(value) is Tensor and value.numel() == 1:
            raise CheckFailure(t("Your mean_top_weight returns a one-element Tensor ({dtype}), not a Python "
                                 "float: end with .item().", dtype=value.dtype))
        if type(value) is not float:
            raise CheckFailure(t("mean_top_weight should return a Python float (use .item()), got {kind}.",
                                 kind=kind(value)))
        if not 1 / k_len - 1e-9 <= value <= 1 + 1e-9:
            with one_thread():
                g = torch.Generator().manual_seed(seed + 13)
                over_q_len = _reference_top_weight(d_k, additive, q_len, q_len, d_attn, g)
                over_queries = _reference_top_weight(d_k, False, q_len, k_len, d_attn, g, dim=-2)
            near = [abs(value - over_q_len) <= TOP_WEIGHT_TOLERANCE[d_k, additive],
                    not additive and abs(value - over_queries) <= TOP_WEIGHT_TOLERANCE[d_k, additive]]
            if near == [True, False]:
                hint = t("That is the largest weight over {q_len} keys (a fresh sample gives about {value:.3f}): "
                         "draw the keys with k_len rows, torch.randn(k_len, d_k), and the queries with q_len.",
                         q_len=q_len, value=over_q_len)
            elif near == [False, True]:
                hint = t("That agrees with a fresh sample of weights softmaxed over the queries (about "
                         "{value:.3f}), whose largest over the keys can be below 1/k_len: take the softmax "
                         "over the keys, dim=-1, so that each query's weights sum to 1.", value=over_queries)
            else:
                hint = t("Does your function draw the k_len keys it is given, and take the largest weight over k_len?")
            raise CheckFailure(t("The largest of {k_len} weights that sum to 1 lies in [1/{k_len}, 1] = "
                                 "[{lowest:.3f}, 1], got {value:.3f} for d_k={d_k}, additive={additive}. {hint}",
                                 k_len=k_len, lowest=1 / k_len, value=value, d_k=d_k, additive=additive, hint=hint))
    g = torch.Generator().manual_seed(seed + 11)
    with one_thread():
        references = {cell: _reference_top_weight(*cell, q_len, k_len, d_attn, g) for cell in table}
    for (d_k, additive), value in table.items():
        reference, allowed = references[d_k, additive], TOP_WEIGHT_TOLERANCE[d_k, additive]
        if abs(value - reference) <= allowed:
            continue
        with one_thread():
            hint = _top_weight_hint(table, references, (d_k, additive), (q_len, k_len, d_attn), g)
        raise CheckFailure(t("For d_k={d_k}, additive={additive}, q_len={q_len}, k_len={k_len}, d_attn={d_attn}, "
                             "samples={samples} you measured {value:.3f}; a fresh sample gives about {reference:.3f} "
                             "(difference {gap:.3f}, allowed {allowed}: 5.2 standard deviations "
                             "of the difference between two such samples). {hint}", d_k=d_k, additive=additive,
                             q_len=q_len, k_len=k_len, d_attn=d_attn, samples=samples, value=value,
                             reference=reference, gap=abs(value - reference), allowed=allowed, hint=hint))
    first = (table[4, False], (4,), dict(additive=False, q_len=q_len, k_len=k_len, d_attn=d_attn, samples=samples,
                                        seed=seed))
    with one_thread():
        # The argument check's first single draw, alone: a function that raises only when samples is 1 is told.
        try:
            call(fn, 4, additive=False, q_len=1, k_len=2, samples=1, seed=seed + 1000)
        except CheckFailure as failure:
            if not isinstance(failure, CodeRaised) or not _measure_runs(fn, samples=2, seed=seed + 1000):
                raise
            # What the code raised, not the message around it: the message is in the reader's language.
            hint = (t("With samples=1 your function stacked an empty list, and with samples=2 it runs: its loop runs "
                      "fewer times than samples (once per sample is range(samples)).") if "empty" in failure.raised
                    else t("The same call with samples=2 runs: look at what your function does with samples when it "
                           "is 1."))
            raise CheckFailure(t("{error} {hint}", error=_sentence(str(failure)), hint=hint)) from None
        _check_measurement_arguments(fn, "mean_top_weight", "additive", 1.0, t("the largest weight"), seed,
                                     SINGLE_DRAW_SD, first)
        # The argument check called additive=False twice; the additive branch draws three more tensors.
        again = call(fn, 4, additive=True, q_len=q_len, k_len=k_len, d_attn=d_attn, samples=samples, seed=seed)
    if again != table[4, True]:
        raise CheckFailure(t(
            "Called twice with the same arguments and seed={seed}, additive=True gave {first!r} and then "
            "{again!r}, while additive=False gives one answer: a draw of the additive branch (w_q, w_k or v_a) "
            "does not come from the seeded generator. Pass generator=... to each torch.randn.",
            seed=seed, first=table[4, True], again=again))
    passed(t("dot product: the largest weight grows from {smallest_d_k:.2f} to {largest_d_k:.2f} as d_k goes "
             "4 → 256; additive: it stays near {additive:.2f} (over {k_len} keys); 1 for one key; seed and "
             "samples used", smallest_d_k=table[4, False], largest_d_k=table[256, False], additive=table[256, True],
             k_len=k_len))
