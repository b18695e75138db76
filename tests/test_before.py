"""stepformer.before against oracles nobody here wrote (nn.Embedding, F.one_hot, collections.Counter, nn.RNN,
PyTorch's softmax-weighted sum), and the chapter's checks: they pass on the solution, fail on the stub and name
each realistic mistake."""

import ast
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from torch import nn

import stepformer.before
from stepformer.before import (
    RNN,
    additive_attention,
    context_counts,
    mean_top_weight,
    ngram_counts,
    ngram_probability,
    one_hot_embed,
)
from stepformer.checks._core import CheckFailure
from stepformer.checks.before import (
    _attention_sizes,
    check_additive_attention_mask,
    check_additive_attention_shapes,
    check_additive_attention_values,
    check_ngram_counts,
    check_ngram_probability,
    check_one_hot_embed,
    check_one_hot_vocab,
    check_top_weight_measurement,
)
from tests.fixtures.student import student_copy

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
dtypes = st.sampled_from([torch.float32, torch.float64])


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


# -- one_hot_embed ---------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=2), st.integers(1, 9), st.integers(1, 30), st.integers(1, 9),
       st.integers(0, 2**31 - 1), dtypes)
def test_one_hot_embed_is_nn_embedding(batch, seq, vocab, d_model, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (*batch, seq), generator=g)
    embedding = nn.Embedding(vocab, d_model, dtype=dtype)
    ours = one_hot_embed(tokens, embedding.weight)
    assert ours.dtype == dtype and ours.shape == (*batch, seq, d_model)
    assert torch.equal(ours, embedding(tokens))  # a one-hot product adds exact zeros: no rounding at all
    assert torch.equal(ours, F.one_hot(tokens, vocab).to(dtype) @ embedding.weight)


def test_one_hot_embed_has_nn_embeddings_gradient():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5, (3, 7), generator=g)  # ids 0..4 of a vocabulary of 12: rows 5..11 unused
    embedding = nn.Embedding(12, 4, dtype=torch.float64)
    upstream = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
    (ours,) = torch.autograd.grad((one_hot_embed(tokens, embedding.weight) * upstream).sum(), embedding.weight)
    (theirs,) = torch.autograd.grad((embedding(tokens) * upstream).sum(), embedding.weight)
    _assert_close(ours, theirs, torch.float64)
    assert (ours[5:] == 0).all()


def test_one_hot_embed_refuses_float_ids_naming_the_axis():
    with pytest.raises(TypeCheckError):
        one_hot_embed(torch.zeros(2, 3), torch.randn(4, 5))


# -- n-grams -----------------------------------------------------------------------------------

words = st.lists(st.sampled_from(["the", "cat", "sat", "on", "mat", "."]), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(words, st.integers(1, 8))
def test_ngram_counts_are_counters_over_zip(tokens, n):
    counts = ngram_counts(tokens, n)
    assert counts == Counter(zip(*(tokens[i:] for i in range(n)), strict=False))
    assert sum(counts.values()) == max(0, len(tokens) - n + 1)
    assert all(type(gram) is tuple and len(gram) == n for gram in counts)


@settings(max_examples=100, deadline=None)
@given(words, st.integers(2, 6))
def test_a_contexts_count_is_the_sum_of_its_ngrams(tokens, n):
    counts = ngram_counts(tokens, n)
    # The contexts are the (n-1)-grams of the text without its last token: that token begins no n-gram.
    expected = ngram_counts(tokens[:-1], n - 1) if len(tokens) >= n else Counter()
    assert context_counts(counts) == expected


@settings(max_examples=100, deadline=None)
@given(words, words, st.integers(1, 4), st.sampled_from([1.0, 0.5, 1e-3]))
def test_ngram_probabilities_sum_to_one_over_the_vocabulary(tokens, history, n, alpha):
    vocab = ["the", "cat", "sat", "on", "mat", ".", "dog"]
    counts = ngram_counts(tokens, n)
    contexts = context_counts(counts)
    total = math.fsum(ngram_probability(w, history, counts, contexts, n=n, vocab_size=len(vocab), alpha=alpha)
                      for w in vocab)
    assert math.isclose(total, 1.0, rel_tol=1e-12)


def test_ngram_probability_reads_the_last_n_minus_one_words():
    tokens = "the cat sat . the cat ran . a dog sat .".split()
    counts, contexts = ngram_counts(tokens, 3), context_counts(ngram_counts(tokens, 3))
    # C(the cat, sat) = 1, C(the cat) = 2; with a tiny alpha the estimate is the relative frequency.
    p = ngram_probability("sat", ["a", "dog", ".", "the", "cat"], counts, contexts, n=3, vocab_size=7, alpha=1e-12)
    assert math.isclose(p, 0.5, rel_tol=1e-9)
    unigrams = ngram_counts(tokens, 1)
    # n = 1 has no context, whatever the history: C(sat) = 2 of 12 words.
    p = ngram_probability("sat", ["a", "dog"], unigrams, context_counts(unigrams), n=1, vocab_size=7, alpha=1e-12)
    assert math.isclose(p, 2 / 12, rel_tol=1e-9)
    # A context never seen: every word equally likely.
    assert math.isclose(ngram_probability("sat", ["dog", "dog"], counts, contexts, n=3, vocab_size=7), 1 / 7)


# -- RNN ---------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 8), st.integers(1, 8), st.integers(0, 2**31 - 1), dtypes,
       st.booleans())
def test_rnn_is_nn_rnn(batch, seq, d_in, d_hidden, seed, dtype, with_state):
    torch.manual_seed(seed)
    ours, theirs = RNN(d_in, d_hidden).to(dtype), nn.RNN(d_in, d_hidden, batch_first=True, dtype=dtype)
    with torch.no_grad():
        theirs.weight_ih_l0.copy_(ours.w_ih.weight)
        theirs.bias_ih_l0.copy_(ours.w_ih.bias)
        theirs.weight_hh_l0.copy_(ours.w_hh.weight)
        theirs.bias_hh_l0.copy_(ours.w_hh.bias)
        x = torch.randn(batch, seq, d_in, dtype=dtype)
        h = torch.randn(batch, d_hidden, dtype=dtype) if with_state else None
        expected, last = theirs(x, None if h is None else h[None])
        states = ours(x, h)
    _assert_close(states, expected, dtype)
    _assert_close(states[:, -1], last[0], dtype)


def test_an_rnn_state_depends_only_on_the_words_before_it():
    rnn = RNN(3, 5).double()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    changed = x.clone()
    changed[:, 4:] += 1.0
    with torch.no_grad():
        assert torch.equal(rnn(x)[:, :4], rnn(changed)[:, :4])


# -- additive_attention ---------------------------------------------------------------------------

def _scores_by_loops(q, k, w_q, w_k, v_a):
    """e_ij = Σ_a v_a[a] tanh(Σ_d w_q[a, d] q_i[d] + Σ_d w_k[a, d] k_j[d]), one pair at a time."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    scores = torch.empty(*q.shape[:-2], q_len, k_len, dtype=q.dtype)
    for i in range(q_len):
        for j in range(k_len):
            hidden = torch.tanh(nn.functional.linear(q[..., i, :], w_q) + nn.functional.linear(k[..., j, :], w_k))
            scores[..., i, j] = (hidden * v_a).sum(-1)
    return scores


def _additive_inputs(g, batch, q_len, k_len, d_q, d_k, d_v, d_attn, dtype):
    return (torch.randn(*batch, q_len, d_q, generator=g, dtype=dtype),
            torch.randn(*batch, k_len, d_k, generator=g, dtype=dtype),
            torch.randn(*batch, k_len, d_v, generator=g, dtype=dtype),
            torch.randn(d_attn, d_q, generator=g, dtype=dtype) / math.sqrt(d_q),
            torch.randn(d_attn, d_k, generator=g, dtype=dtype) / math.sqrt(d_k),
            torch.randn(d_attn, generator=g, dtype=dtype))


sizes = st.tuples(st.lists(st.integers(1, 3), max_size=2), *(st.integers(1, 6) for _ in range(6)))


@settings(max_examples=60, deadline=None)
@given(sizes, st.integers(0, 2**31 - 1), dtypes, st.data())
def test_additive_attention_is_its_definition_with_pytorchs_weighted_sum(size, seed, dtype, data):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w_q, w_k, v_a = _additive_inputs(g, *size, dtype)
    mask = None
    if data.draw(st.booleans()):
        mask = torch.rand(*size[0], size[1], size[2], generator=g) < data.draw(st.floats(0.0, 1.0))
    output, weights = additive_attention(q, k, v, w_q, w_k, v_a, mask)
    scores = _scores_by_loops(q, k, w_q, w_k, v_a)
    # PyTorch's own softmax-weighted sum: with queries and keys of zeros, scaled_dot_product_attention is
    # softmax(attn_mask) @ v, so the scores go in as an additive mask (-inf where masked).
    bias = scores if mask is None else scores.masked_fill(~mask, -math.inf)
    zeros_q, zeros_k = torch.zeros(*q.shape[:-1], 1, dtype=dtype), torch.zeros(*k.shape[:-1], 1, dtype=dtype)
    expected = F.scaled_dot_product_attention(zeros_q, zeros_k, v, attn_mask=bias).nan_to_num(0.0)
    _assert_close(output, expected, dtype)
    assert not torch.isnan(weights).any()
    if mask is not None:
        assert (weights.masked_select(~mask) == 0).all(), "masked keys must get exactly zero weight"
        blind = ~mask.any(-1)
        assert (weights[blind] == 0).all() and (output[blind] == 0).all(), "a fully masked row gives zeros"
        kept = ~blind
        _assert_close(weights.sum(-1)[kept], torch.ones_like(weights.sum(-1)[kept]), dtype)
    else:
        _assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), dtype)


def test_additive_attention_is_equivariant_to_permuting_the_keys():
    g = torch.Generator().manual_seed(5)
    q, k, v, w_q, w_k, v_a = _additive_inputs(g, [2], 3, 6, 4, 5, 2, 7, torch.float64)
    order = torch.randperm(6, generator=g)
    out, weights = additive_attention(q, k, v, w_q, w_k, v_a)
    out_p, weights_p = additive_attention(q, k[:, order], v[:, order], w_q, w_k, v_a)
    _assert_close(out_p, out, torch.float64)
    _assert_close(weights_p, weights[..., order], torch.float64)


def test_additive_attention_refuses_weights_of_the_wrong_layout_naming_the_axis():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 6), torch.randn(2, 5, 7)
    with pytest.raises(TypeCheckError, match="d_q"):
        additive_attention(q, k, v, torch.randn(4, 8), torch.randn(8, 6), torch.randn(8))


def test_mean_top_weight_unscaled_dot_products_saturate_and_additive_scores_do_not():
    dot = [mean_top_weight(d, additive=False, samples=32) for d in (4, 64, 1024)]
    additive = [mean_top_weight(d, additive=True, samples=32) for d in (4, 64, 1024)]
    assert all(type(x) is float for x in dot + additive)
    assert dot[0] < dot[1] < dot[2] and dot[2] > 0.9
    assert max(additive) - min(additive) < 0.05 and max(additive) < 0.25
    assert mean_top_weight(8, additive=True, seed=3) == mean_top_weight(8, additive=True, seed=3)


# -- the checks ---------------------------------------------------------------------------------

student = student_copy(stepformer.before)


def stub(*args, **kwargs):
    raise NotImplementedError()


CHECKS = [
    (check_one_hot_embed, "one_hot_embed"), (check_one_hot_vocab, "one_hot_embed"),
    (check_ngram_counts, "ngram_counts"), (check_ngram_probability, "ngram_probability"),
    (check_additive_attention_shapes, "additive_attention"), (check_additive_attention_values, "additive_attention"),
    (check_additive_attention_mask, "additive_attention"), (check_top_weight_measurement, "mean_top_weight"),
]


@pytest.mark.parametrize("seed", [0, 7, 101])
def test_checks_pass_on_the_solution(seed, capsys):
    for check, name in CHECKS:
        check(getattr(student, name), seed=seed)
    for check in (check_one_hot_embed, check_additive_attention_values, check_additive_attention_mask):
        check(getattr(student, "one_hot_embed" if check is check_one_hot_embed else "additive_attention"),
              seed=seed, dtype=torch.float64)
    assert capsys.readouterr().out.count("✔") == len(CHECKS) + 3


@pytest.mark.parametrize(("check", "name"), CHECKS, ids=[c.__name__ for c, _ in CHECKS])
def test_checks_fail_on_the_stub(check, name):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stub)


def test_attention_sizes_are_pairwise_distinct():
    for seed in range(40):
        s = _attention_sizes(seed)
        assert len(set(s.values())) == len(s)


def test_the_checks_import_no_reference_module():
    # Other check modules may be used (the measurement's argument check is shared with chapter 01's), if they in
    # turn import no reference module.
    for module in ("before", "attention", "_noise"):
        tree = ast.parse((ROOT / "src" / "stepformer" / "checks" / f"{module}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert all(name.startswith("stepformer.checks.") or not name.startswith("stepformer") for name in imported), (
            module, imported)


# Standalone wrong implementations (not built from the library).

def embed(tokens, weight, *, num_classes=True, convert="to"):
    one_hot = F.one_hot(tokens, weight.shape[0]) if num_classes else F.one_hot(tokens)
    if convert == "to":
        one_hot = one_hot.to(weight.dtype)
    elif convert == "float":
        one_hot = one_hot.float()
    return torch.einsum("...sv,vd->...sd", one_hot, weight)


def embed_swapped(tokens, weight):
    return torch.einsum("...sv,vd->...sd", weight, F.one_hot(tokens, weight.shape[0]).to(weight.dtype))


def embed_transposed_weight(tokens, weight):  # a different slip: a crash that no order of the operands explains
    return torch.einsum("...sv,dv->...sd", F.one_hot(tokens, weight.shape[0]).to(weight.dtype), weight)


def embed_by_lookup(tokens, weight):
    return F.embedding(tokens, weight)


def embed_with_module(tokens, weight):
    return nn.Embedding.from_pretrained(weight)(tokens)


def embed_three_axes(tokens, weight):
    return torch.einsum("bsv,vd->bsd", F.one_hot(tokens, weight.shape[0]).to(weight.dtype), weight)


def counts(tokens, n, *, stop=1, key=tuple, counted=True, start=0, end=0):
    grams = [key(tokens[i + start:i + n + end]) for i in range(len(tokens) - n + stop)]
    return Counter(grams) if counted else grams


def counts_of_prefixes(tokens, n):
    return Counter(tuple(tokens[i:n]) for i in range(len(tokens) - n + 1))


def probability(word, history, counts, contexts, *, n, vocab_size, alpha=1.0, context=None, top=1.0, bottom=None,
                guard=False, count_top=True, count_bottom=True, divide=True, square=False):
    ctx = context(history, n) if context else (tuple(history[len(history) - n + 1:]) if n > 1 else ())
    above = counts[(*ctx, word)] * count_top + top * alpha
    below = contexts[ctx] * count_bottom + alpha * (vocab_size if bottom is None else bottom)
    if guard and below == 0:
        return 1 / vocab_size
    if square:  # a different slip: the whole fraction squared
        return (above / below) ** 2
    return above / below if divide else above


def attention(q, k, v, w_q, w_k, v_a, mask=None, *, tanh=True, dim=-1, scale=1.0, use_v_a=True, mask_style="fill",
              safe_rows=True, keepdim=True, pattern=None, guard="any", swapped="", mask_when_none=False):
    if pattern:  # written for one fixed number of axes
        query, key = torch.einsum(pattern[0], q, w_q), torch.einsum(pattern[1], k, w_k)
    else:
        query, key = q @ w_q.T, k @ w_k.T
    if swapped == "query":  # einsum(w_q, q, "... q_len d_q, d_attn d_q -> ... q_len d_attn")
        query = torch.einsum("...ad,bd->...ab", w_q, q)
    if swapped == "key":
        key = torch.einsum("...ad,bd->...ab", w_k, k)
    if swapped == "pattern":  # a different slip: the pattern itself written for (q_len, d_attn) with the wrong axis
        query = torch.einsum("...qd,ad->...qa", q, w_q[:, :1].expand_as(w_q))
    if mask_when_none and mask is None:  # the slip: `if mask is None:` where `if mask is not None:` was meant
        mask.any(-1, keepdim=True)
    elif mask_when_none == "both":  # ... and then has_key, never set, read where the mask is given
        raise UnboundLocalError("cannot access local variable 'has_key' where it is not associated with a value")
    pre = query.unsqueeze(-2) + key.unsqueeze(-3)
    hidden = torch.tanh(pre) if tanh else pre
    scores = (hidden @ v_a if use_v_a else hidden.sum(-1)) * scale
    if mask is not None and mask_style == "inverted everywhere":
        mask, mask_style = ~mask, "fill"
    if mask is not None and mask_style in ("fill", "inverted", "zero"):
        keep = ~mask if mask_style == "inverted" else mask  # "inverted": the ~ forgotten in masked_fill only
        scores = scores.masked_fill(~keep, -math.inf if mask_style != "zero" else 0.0)
        if safe_rows and guard != "any":  # the guard of fully masked rows, mistaken
            has_key = {"all": lambda: mask.all(-1, keepdim=True), "query axis": lambda: mask.any(-2, keepdim=True),
                       "no keepdim": lambda: mask.any(-1)}.get(guard, lambda: mask.any(-1, keepdim=True))()
            scores = scores.masked_fill(has_key if guard == "scores inverted" else ~has_key, 0.0)
            weights = torch.softmax(scores, dim=dim).masked_fill(has_key if guard == "weights inverted" else ~has_key,
                                                                 0.0)
            return weights @ v, weights
        if safe_rows:
            scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    if mask is not None and mask_style == "transposed":  # a shape error of the mask's own, not of the guard's
        scores = scores.masked_fill(~mask.transpose(-1, -2), -math.inf)
    if mask is not None and mask_style == "add":
        scores = scores + mask.to(scores.dtype)
    weights = torch.softmax(scores, dim=dim)
    if mask is not None and mask_style in ("fill", "inverted") and safe_rows:
        weights = weights.masked_fill(~mask.any(-1, keepdim=keepdim), 0.0)
    if mask is not None and mask_style == "after":
        weights = weights * mask
    return weights @ v, weights


def measure(d_k, *, additive, q_len=16, k_len=16, d_attn=32, samples=64, seed=0, scaled=False, reduce="max",
            init=True, lengths=True, keys_from_queries=False, fixed_samples=None, fixed_seed=None, dim=-1,
            inverted=False, loops=0, q_dtype=torch.float64, additive_generator=True, fewer_keys=False):
    g = torch.Generator().manual_seed(seed if fixed_seed is None else fixed_seed)
    q_len, k_len = (q_len, k_len) if lengths else (16, 16)
    k_len = q_len if keys_from_queries else k_len
    k_len = max(k_len - 1, 1) if fewer_keys else k_len
    samples = samples if fixed_samples is None else fixed_samples
    additive = not additive if inverted else additive
    own = {"generator": g} if additive_generator else {}
    tops = []
    for _ in range(samples + loops):
        q = torch.randn(q_len, d_k, generator=g, dtype=q_dtype)
        k = torch.randn(k_len, d_k, generator=g, dtype=torch.float64)
        if additive:
            scale_in = 1 / math.sqrt(d_k) if init else 1.0
            w_q = torch.randn(d_attn, d_k, **own, dtype=torch.float64) * scale_in
            w_k = torch.randn(d_attn, d_k, generator=g, dtype=torch.float64) * scale_in
            v_a = torch.randn(d_attn, generator=g, dtype=torch.float64) / math.sqrt(d_attn)
            _, weights = attention(q, k, k, w_q, w_k, v_a)
        else:
            weights = torch.softmax(q @ k.T / (math.sqrt(d_k) if scaled else 1.0), dim=dim)
        tops.append(weights.amax(-1).mean() if reduce == "max" else weights.mean())
    return torch.stack(tops).mean().item()


MISTAKES = [
    # one_hot_embed
    (check_one_hot_vocab, lambda t, w: embed(t, w, num_classes=False),
     r"\(batch=\d+, seq=\d+, vocab=\d+, d_model=\d+\).*largest id in tokens is \d+, below vocab - 1 = \d+: "
     r"F\.one_hot\(tokens\) without num_classes"),
    (check_one_hot_embed, lambda t, w: embed(t, w, convert=None),
     r"raised RuntimeError: [^.]*\. An int64 \(Long\) tensor met the floating weight.*\.to\(weight\.dtype\)"),
    (check_one_hot_embed, lambda t, w: embed(t, w, convert="float"), r"float64.*\.float\(\) makes float32"),
    (check_one_hot_embed, embed_three_axes, r"without a batch axis.*any number of them, none included"),
    # Issue 27: the einsum's operands in the other order, told on (seq,) tokens with seq = d_model.
    (check_one_hot_embed, embed_swapped, r"seq = d_model = 3 your function runs and returns weight @ one_hot"),
    (check_one_hot_embed, embed_by_lookup, "Not your own work"),
    (check_one_hot_vocab, embed_with_module, "Not your own work"),
    # ngram_counts
    (check_ngram_counts, lambda t, n: counts(t, n, stop=0),
     r"Off by one: your counts miss the last n-gram.*range\(len\(tokens\) - n \+ 1\)"),
    (check_ngram_counts, lambda t, n: counts(t, n, stop=n), r"shorter than n: the windows that run past the end"),
    # Issue 27: the slice of n-gram i, told by the counts for every n.
    (check_ngram_counts, lambda t, n: counts(t, n, start=1),
     r"those of tuple\(tokens\[i \+ 1 : i \+ n\]\) for i in range\(len\(tokens\) - n \+ 1\), for every n tried: "
     r"each slice starts one token late\."),
    (check_ngram_counts, lambda t, n: counts(t, n, end=-1), r"tokens\[i : i \+ n - 1\]\).*ends one token short"),
    (check_ngram_counts, lambda t, n: counts(t, n, end=1), r"tokens\[i : i \+ n \+ 1\]\).*ends one token too far"),
    (check_ngram_counts, counts_of_prefixes, r"tokens\[i : n\]\).*ends at n instead of i \+ n"),
    (check_ngram_counts, lambda t, n: counts(t, n, stop=2), r"range\(len\(tokens\) - n \+ 2\).*one window past"),
    (check_ngram_counts, lambda t, n: counts(t, n, key=" ".join), r"keys of your counts should be tuples.*got '"),
    (check_ngram_counts, lambda t, n: counts(t, n, counted=False), "should return a Counter.*got list"),
    (check_ngram_counts, lambda t, n: {k: float(v) for k, v in counts(t, n).items()}, "Each count should be an int"),
    # ngram_probability
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, top=0.0, bottom=0.0),
     r"ZeroDivisionError.*C\(context\) \+ alpha · vocab_size, never 0"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, top=0.0, bottom=0.0, guard=True),
     r"not smoothed: an n-gram never seen in training gets 0"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, bottom=0.0), "ZeroDivisionError"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, bottom=1.0),
     "once, not once per word of the vocabulary"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: tuple(h[-(n - 1):])),
     r"n=1.*For n = 1 your context is the whole history: history\[-\(n - 1\):\] is history\[-0:\]"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: tuple(h[len(h) - n:])),
     "Off by one: your context is the last n tokens"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: tuple(h[:n - 1])),
     "first n - 1 tokens of the history"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: h[len(h) - n + 1:] if n > 1
                                                           else ()),
     "unhashable.*Counter's keys are tuples"),
    (check_ngram_probability, lambda *a, **k: torch.tensor(probability(*a, **k)), "should return a Python float"),
    # Issue 27: the formula's terms, and contexts told apart on counts of every order.
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, divide=False), "without dividing it"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, count_top=False),
     "numerator is missing the n-gram's count"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, count_bottom=False),
     "denominator is missing the context's count"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: tuple(h[len(h) - n - 1:])),
     r"the last n \+ 1 tokens of the history, two too many"),
    (check_ngram_probability,
     lambda *a, **k: probability(*a, **k, context=lambda h, n: tuple(h[len(h) - n:]) if n > 1 else ()),
     r"For n > 1: off by one: your context is the last n tokens"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: ()),
     r"context is the empty tuple \(\) for every n"),
    # additive_attention
    (check_additive_attention_values, lambda *a: attention(*a, tanh=False),
     r"tanh is missing.*\(Your output: largest difference .* sizes batch=2, q_len=3, k_len=5, d_q=4, d_k=6, d_v=7, "
     r"d_attn=8\.\)"),
    (check_additive_attention_values, lambda *a: attention(*a, dim=-2), "softmax over the query axis"),
    (check_additive_attention_values, lambda *a: attention(*a, scale=1 / math.sqrt(a[3].shape[0])),
     r"scaled the scores by 1/sqrt\(d_attn\)"),
    (check_additive_attention_values, lambda *a: attention(*a, use_v_a=False), "You left v_a out"),
    (check_additive_attention_mask, lambda *a: attention(*a, mask_style="inverted"), "Your mask is inverted"),
    (check_additive_attention_mask, lambda *a: attention(*a, mask_style="inverted everywhere"),
     "Your mask is inverted"),
    (check_additive_attention_mask, lambda *a: attention(*a, mask_style="after"), "You masked after the softmax"),
    (check_additive_attention_mask, lambda *a: attention(*a, mask_style="zero"), "filled the masked scores with 0"),
    (check_additive_attention_mask, lambda *a: attention(*a, mask_style="add"), "added the mask to the scores"),
    (check_additive_attention_mask, lambda *a: attention(*a, safe_rows=False), r"gives NaN \(the softmax of a row"),
    # The fully masked rows' guard without keepdim: a shape error that the mask alone causes, named as such (and
    # not as the weights' layout, which the same call without a mask shows to be right).
    (check_additive_attention_mask, lambda *a: attention(*a, keepdim=False),
     r"raised RuntimeError.*The same call without the mask runs, so the error comes from where your code uses the "
     r"mask"),
    (check_additive_attention_shapes, lambda *a: attention(*a, pattern=("bqd,ad->bqa", "bkd,ad->bka")),
     r"With 2-D \(q_len, d\) inputs.*any number of them, none included"),
    (check_additive_attention_shapes, lambda q, k, v, w_q, w_k, v_a, mask=None: attention(q, k, v, w_q.T, w_k.T, v_a),
     r"layout of nn\.Linear\.weight"),
    (check_additive_attention_shapes, lambda *a: attention(*a)[::-1], r"output should have shape \(batch=2, q_len=3, "
                                                                      r"d_v=7\)"),
    # Issue 27: the guard of fully masked rows, a step that uses the mask when there is none, and projections
    # whose einsum operands come in the other order (told on 2-D inputs where q_len = k_len = d_attn).
    (check_additive_attention_mask, lambda *a: attention(*a, guard="all"), r"asked whether all keys are kept"),
    (check_additive_attention_mask, lambda *a: attention(*a, guard="query axis"),
     r"guard of fully masked rows taken over the query axis"),
    (check_additive_attention_mask, lambda *a: attention(*a, guard="scores inverted"),
     r"sets the scores of fully masked rows to 0 is inverted"),
    (check_additive_attention_mask, lambda *a: attention(*a, guard="weights inverted"),
     r"zeroes fully masked rows after the softmax is inverted"),
    (check_additive_attention_mask, lambda *a: attention(*a, guard="no keepdim"),
     r"The same call without the mask runs.*On 2-D inputs with q_len = k_len = 3 it runs, and gives what the guard "
     r"of fully masked rows gives without keepdim"),
    (check_additive_attention_shapes, lambda *a: attention(*a, mask_when_none="both"),
     r"raised AttributeError.*\. Called without a mask, your code read an attribute of None"),
    (check_additive_attention_shapes, lambda *a: attention(*a, mask_when_none="none only"),
     r"raised AttributeError.*\. The same call with a mask that keeps every key, which must change nothing, runs"),
    (check_additive_attention_shapes, lambda *a: attention(*a, swapped="query"),
     r"q_len = k_len = d_attn = 8 your function runs, and gives what it gives with W_q q transposed"),
    (check_additive_attention_shapes, lambda *a: attention(*a, swapped="key"), r"with W_k k transposed"),
    # mean_top_weight
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, scaled=True), r"divided the dot products by sqrt"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, reduce="mean"), "You took the mean weight"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, init=False),
     r"more peaked than it should be.*divided by sqrt\(d_k\)"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, lengths=False),
     r"\[1/9, 1\]|a fresh sample gives about"),
    # Issue 27: the keys drawn with the query count, and the arguments that only the noise shows.
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, keys_from_queries=True),
     r"That is the largest weight over 20 keys"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, fixed_samples=64),
     r"spread of a mean over many draws: does your function use samples"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, fixed_seed=0), r"all gave .* ignores seed"),
    (check_top_weight_measurement, lambda d, **k: torch.tensor(measure(d, **k)),
     r"returns a one-element Tensor \(torch\.float\d+\), not a Python float: end with \.item\(\)"),
    (check_top_weight_measurement, lambda d, **k: [measure(d, **k)], "should return a Python float.*got list"),
    # Issue 27: hypotheses confirmed at every d_k, a loop one sample short, float32 draws, an unseeded draw.
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, dim=-2),
     r"agrees with a fresh sample of weights softmaxed over the queries"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, inverted=True),
     r"additive=True values with the dot product's, at every d_k: the branch on additive is inverted"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, loops=-1),
     r"stacked an empty list, and with samples=2 it runs: its loop runs fewer times than samples"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, q_dtype=torch.float32),
     r"Your tensors mix float32 and float64.*dtype=torch\.float64"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, additive_generator=False),
     r"additive=True gave .* while additive=False gives one answer: a draw of the additive branch"),
]

# Similar but different mistakes, which must not get these names.
NOT_NAMED = [
    (check_one_hot_embed, embed_transposed_weight, r"other order", r"layout of nn\.Embedding\.weight"),
    (check_ngram_counts, lambda t, n: counts(t, n, key=lambda g: tuple(reversed(g))), r"those of|Off by one",
     r"right number of n-grams, but not the right ones"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, square=True),
     r"without dividing|missing the|context is|not smoothed|alpha to the", r"Compare with"),
    (check_ngram_probability, lambda *a, **k: probability(*a, **k, context=lambda h, n: tuple(h[len(h) - n + 1:-1])
                                                           if n > 1 else ()),
     r"Off by one|n \+ 1 tokens|empty tuple", r"Compare with"),
    (check_additive_attention_mask, lambda *a: attention(*a, mask_style="transposed"),
     r"without keepdim", r"The same call without the mask runs"),
    (check_additive_attention_shapes, lambda *a: attention(*a, pattern=("bqd,ad->bqa", "bkd,ad->bka")),
     r"transposed", r"any number of them"),
    (check_additive_attention_values, lambda *a: attention(*a, swapped="pattern"), r"transposed", r"differs"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, scaled=True), r"over the queries|inverted",
     r"divided the dot products by sqrt"),
    (check_top_weight_measurement, lambda d, **k: measure(d, **k, fewer_keys=True),
     r"over the queries|inverted|empty list", r"a fresh sample gives about"),
]


@pytest.mark.parametrize(("check", "mistake", "message"), MISTAKES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(MISTAKES)])
def test_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake)


@pytest.mark.parametrize(("check", "mistake", "wrong", "message"), NOT_NAMED,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _, _) in enumerate(NOT_NAMED)])
def test_checks_do_not_name_a_similar_mistake(check, mistake, wrong, message, capsys):
    try:
        check(mistake)
        text = capsys.readouterr().out
    except CheckFailure as failure:
        text = str(failure)
    assert re.search(message, text) and not re.search(wrong, text), text


def test_every_failure_of_additive_attention_names_its_sizes_and_largest_difference():
    for check, mistake in ((check_additive_attention_values, lambda *a: attention(*a, dim=-2)),
                           (check_additive_attention_mask, lambda *a: attention(*a, mask_style="after"))):
        with pytest.raises(CheckFailure, match=r"largest difference [\d.e+-]+ at index \[.*\] on sizes batch=2"):
            check(mistake)


def test_checks_leave_the_global_rng_alone():
    draws = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        check_ngram_probability(student.ngram_probability)
        check_additive_attention_mask(student.additive_attention)
        draws.append(torch.rand(4))
    assert not torch.equal(*draws), "a check reset the global RNG to a fixed state"
