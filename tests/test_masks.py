"""stepformer.masks against PyTorch's own masks and attention, and the chapter's checks."""

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from beartype import beartype
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import Bool, Int, TypeCheckError, jaxtyped
from torch.nn.attention.bias import causal_lower_right

import stepformer.attention
import stepformer.masks
from stepformer.attention import scaled_dot_product_attention
from stepformer.checks._core import CheckFailure
from stepformer.checks.masks import (
    _sizes,
    check_causal_mask,
    check_causal_mask_arguments,
    check_causal_mask_offset,
    check_padding_in_attention,
    check_padding_mask,
    check_which_outputs_change,
)
from stepformer.masks import causal_mask, padding_mask, which_outputs_change
from tests.fixtures.student import student_copy

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-6}


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


# -- causal_mask --------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 12))
def test_square_causal_mask_is_pytorchs(n):
    expected = torch.nn.Transformer.generate_square_subsequent_mask(n) == 0  # float 0 / -inf -> bool
    assert torch.equal(causal_mask(n), expected)
    assert torch.equal(causal_mask(n, n), expected)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 10), st.integers(0, 8))
def test_causal_mask_is_aligned_to_the_last_key(q_len, extra):
    k_len = q_len + extra
    expected = causal_lower_right(q_len, k_len)._materialize()
    assert torch.equal(causal_mask(q_len, k_len), expected)
    # Incremental decoding: the queries are the last q_len rows of the full square mask.
    assert torch.equal(causal_mask(q_len, k_len), causal_mask(k_len)[-q_len:])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 8), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.float64]))
def test_attention_with_causal_mask_equals_is_causal(n, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, d, generator=g, dtype=dtype) for _ in range(3))
    output, _ = scaled_dot_product_attention(q, k, v, causal_mask(n))
    _assert_close(output, F.scaled_dot_product_attention(q, k, v, is_causal=True), dtype)


def test_cached_queries_equal_the_last_rows_of_full_causal_attention():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        k_len, q_len, d = (int(x) for x in torch.randint(1, 9, (3,), generator=g))
        k_len += q_len
        q, k, v = (torch.randn(2, k_len, d, generator=g, dtype=torch.float64) for _ in range(3))
        full, _ = scaled_dot_product_attention(q, k, v, causal_mask(k_len))
        last, _ = scaled_dot_product_attention(q[:, -q_len:], k, v, causal_mask(q_len, k_len))
        assert (last - full[:, -q_len:]).abs().max() <= 1e-6


def test_future_invariance_under_the_causal_mask():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 9, 5, generator=g, dtype=torch.float64)
    for t in range(9):
        changed = x.clone()
        changed[:, t + 1:] = torch.randn(3, 8 - t, 5, generator=g, dtype=torch.float64) * 10
        before, _ = scaled_dot_product_attention(x, x, x, causal_mask(9))
        after, _ = scaled_dot_product_attention(changed, changed, changed, causal_mask(9))
        assert torch.equal(before[:, : t + 1], after[:, : t + 1]), "changing the future moved the past"


def test_causal_mask_device_and_errors():
    assert causal_mask(3, 5, device="meta").device.type == "meta"
    assert causal_mask(3).device.type == "cpu"
    with pytest.raises(ValueError, match="q_len must be a positive"):
        causal_mask(0)
    with pytest.raises(ValueError, match="q_len must be a positive"):
        causal_mask(-2, 3)
    with pytest.raises(ValueError, match=r"k_len \(2\) must be at least q_len \(3\)"):
        causal_mask(3, 2)


# -- padding_mask -------------------------------------------------------------------------

def _padded_tokens(g, batch, k_len, pad_id):
    tokens = torch.randint(0, 20, (batch, k_len), generator=g)
    tokens = torch.where(tokens == pad_id, pad_id + 1, tokens)
    lengths = torch.randint(1, k_len + 1, (batch,), generator=g)
    return tokens.masked_fill(torch.arange(k_len) >= lengths[:, None], pad_id), lengths


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 10), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_padding_mask_is_true_on_real_tokens(batch, k_len, pad_id, seed):
    tokens, lengths = _padded_tokens(torch.Generator().manual_seed(seed), batch, k_len, pad_id)
    mask = padding_mask(tokens, pad_id)
    assert mask.shape == (batch, 1, 1, k_len) and mask.dtype == torch.bool
    assert torch.equal(mask[:, 0, 0].sum(-1), lengths)
    # nn.MultiheadAttention's key_padding_mask says True = ignore: the opposite convention.
    assert torch.equal(mask[:, 0, 0], ~(tokens == pad_id))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padding_mask_in_cross_attention_matches_multihead_attention(dtype):
    g = torch.Generator().manual_seed(7)
    batch, q_len, k_len, d_model = 3, 4, 6, 8
    tokens, _ = _padded_tokens(g, batch, k_len, pad_id=1)
    tgt = torch.randn(batch, q_len, d_model, generator=g, dtype=dtype)
    src = torch.randn(batch, k_len, d_model, generator=g, dtype=dtype)
    mha = torch.nn.MultiheadAttention(d_model, 1, bias=False, batch_first=True, dtype=dtype)
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    with torch.no_grad():
        expected, _ = mha(tgt, src, src, key_padding_mask=tokens == 1)
        ours, _ = scaled_dot_product_attention(tgt @ w_q.T, src @ w_k.T, src @ w_v.T, padding_mask(tokens, 1)[:, 0])
        _assert_close(ours @ mha.out_proj.weight.T, expected, dtype)


def test_padding_invariance():
    g = torch.Generator().manual_seed(2)
    tokens, _ = _padded_tokens(g, 4, 7, pad_id=0)
    q = torch.randn(4, 2, 5, 3, generator=g, dtype=torch.float64)
    k, v = (torch.randn(4, 2, 7, 3, generator=g, dtype=torch.float64) for _ in range(2))
    padded = (tokens == 0)[:, None, :, None]
    k2, v2 = (torch.where(padded, torch.randn(t.shape, generator=g, dtype=torch.float64) * 100, t) for t in (k, v))
    mask = padding_mask(tokens, 0)
    assert torch.equal(scaled_dot_product_attention(q, k, v, mask)[0], scaled_dot_product_attention(q, k2, v2, mask)[0])


def test_decoder_self_attention_combines_both_masks():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    both = padding_mask(tokens, 0) & causal_mask(4)  # (batch, 1, 1, k_len) & (q_len, k_len)
    assert both.shape == (2, 1, 4, 4)
    assert torch.equal(both[1, 0], torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]).bool())


@pytest.mark.parametrize(("tokens", "axis"), [(torch.zeros(4, dtype=torch.long), "tokens"),
                                               (torch.zeros(2, 3), "tokens")])
def test_padding_mask_refuses_wrong_inputs(tokens, axis):
    with pytest.raises(TypeCheckError, match=axis):
        padding_mask(tokens, 0)


def test_which_outputs_change_refuses_a_mismatched_mask_naming_the_axis():
    with pytest.raises(TypeCheckError, match="seq="):
        which_outputs_change(torch.randn(4, 3), torch.ones(5, 5, dtype=torch.bool))


# -- which_outputs_change -----------------------------------------------------------------

def test_which_outputs_change_without_and_with_the_causal_mask():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert which_outputs_change(x).all()
    assert torch.equal(which_outputs_change(x, causal_mask(6)), causal_mask(6))


@pytest.mark.parametrize("seed", range(6))
def test_which_outputs_change_matches_the_jacobian(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    mask = torch.rand(7, 7, generator=g) < 0.4
    mask[:, 0] = True
    jacobian = torch.autograd.functional.jacobian(lambda x: F.scaled_dot_product_attention(x, x, x, attn_mask=mask), x)
    assert torch.equal(which_outputs_change(x, mask), jacobian.abs().amax(dim=(1, 3)) > 0)


# -- the checks ---------------------------------------------------------------------------

student = student_copy(stepformer.masks)
# The notebook defines chapter 01's attention in a cell: the student's measurement uses that copy.
student.scaled_dot_product_attention = student_copy(stepformer.attention).scaled_dot_product_attention


def stub(*args, **kwargs):
    raise NotImplementedError()


PADDING_CHECKS = [check_padding_mask, check_padding_in_attention]
CAUSAL_CHECKS = [check_causal_mask, check_causal_mask_offset, check_causal_mask_arguments]


@pytest.mark.parametrize("seed", [0, 5, 17])
def test_checks_pass_on_the_solution(seed, capsys):
    for check in PADDING_CHECKS:
        check(student.padding_mask, seed=seed, pad_id=seed % 3)
    for check in CAUSAL_CHECKS:
        check(student.causal_mask, seed=seed)
    check_which_outputs_change(student.which_outputs_change, seed=seed)
    check_which_outputs_change(student.which_outputs_change, seed=seed, dtype=torch.float32)
    assert capsys.readouterr().out.count("✔") == 7


@pytest.mark.parametrize("check", [*PADDING_CHECKS, *CAUSAL_CHECKS, check_which_outputs_change])
def test_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stub)


def test_sizes_are_pairwise_distinct_and_keys_outnumber_queries():
    for seed in range(50):
        s = _sizes(seed)
        assert len(set(s.values())) == len(s) and s["k_len"] > s["q_len"]


# Standalone wrong implementations (not built from the library).

def padding_inverted(tokens, pad_id):
    return (tokens == pad_id)[:, None, None, :]


def padding_flat(tokens, pad_id):
    return tokens != pad_id


def padding_hard_coded_zero(tokens, pad_id):
    return (tokens != 0)[:, None, None, :]


def padding_as_float(tokens, pad_id):
    return (tokens != pad_id)[:, None, None, :].float()


def padding_greater(tokens, pad_id):
    return (tokens > pad_id)[:, None, None, :]


def padding_one_wrong(tokens, pad_id):
    mask = (tokens != pad_id)[:, None, None, :].clone()
    mask[-1, 0, 0, 0] = False
    return mask


def padding_k_len_on_queries(tokens, pad_id):
    return (tokens != pad_id)[:, None, :, None]


def padding_k_len_on_heads(tokens, pad_id):
    return (tokens != pad_id)[..., None, None]


def padding_squeezed(tokens, pad_id):
    # squeeze() meant for a leftover axis: with one sentence the batch axis goes too.
    return (tokens != pad_id).squeeze()[..., None, None, :]


def causal_additive(q_len, k_len=None, device=None):
    # PyTorch's convention (generate_square_subsequent_mask): 0 where a query may attend, -inf where not.
    k_len = q_len if k_len is None else k_len
    allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    return torch.zeros(q_len, k_len).masked_fill(~allowed, -torch.inf)


def causal_keys_by_queries(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len).T


def causal_top_left_strict(q_len, k_len=None, device=None):
    return _ones(q_len, k_len).tril(-1)


def _ones(q_len, k_len):
    return torch.ones(q_len, q_len if k_len is None else k_len, dtype=torch.bool)


def causal_triu(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return _ones(q_len, k_len).triu(k_len - q_len)


def causal_future(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return _ones(q_len, k_len).triu(k_len - q_len + 1)


def causal_strict(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return _ones(q_len, k_len).tril(k_len - q_len - 1)


def causal_flipped_sign(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return _ones(q_len, k_len).tril(q_len - k_len)


def causal_off_by_one(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return _ones(q_len, k_len).tril(k_len - q_len + 1)


def causal_one_wrong(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    mask = _ones(q_len, k_len).tril(k_len - q_len)
    mask[-1, 0] = False
    return mask


def causal_top_left(q_len, k_len=None, device=None):
    if q_len < 1 or (k_len is not None and k_len < q_len):
        raise ValueError("bad lengths")
    return _ones(q_len, k_len).tril()


def causal_unchecked(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def causal_no_device(q_len, k_len=None, device=None):
    k_len = q_len if k_len is None else k_len
    return _ones(q_len, k_len).tril(k_len - q_len)


def causal_no_default(q_len, k_len=None, device=None):
    return _ones(q_len, q_len + 1 if k_len is None else k_len).tril(1 if k_len is None else k_len - q_len)


def _measure(x, mask, *, queries=True, keys=True, transpose=False, apply_mask=True, same_copy=False):
    def attend(q, kv):
        scores = q @ kv.T
        if mask is not None and apply_mask:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ kv

    base = attend(x, x)
    changed = torch.zeros(x.shape[0], x.shape[0], dtype=torch.bool)
    for j in range(x.shape[0]):
        other = x.clone()
        other[j] += 1.0
        seen = x if same_copy else other
        out = attend(seen if queries else x, seen if keys else x)
        changed[:, j] = (out != base).any(-1)
    return changed.T.contiguous() if transpose else changed


@pytest.mark.parametrize(
    ("check", "mistake", "message"),
    [
        (check_padding_mask, padding_inverted, "padding mask is inverted"),
        (check_padding_in_attention, padding_inverted, "padding mask is inverted"),
        (check_padding_mask, padding_flat, r"shape \(batch, 1, 1, k_len\)"),
        (check_padding_mask, padding_as_float, "boolean"),
        (check_padding_in_attention, padding_flat, r"q_len = batch = \d+, so query i of every sentence"),
        (check_padding_in_attention, padding_as_float, "adds a float mask to the scores"),
        (check_padding_in_attention, lambda tokens, pad_id: padding_inverted(tokens, pad_id).int(),
         "Return a boolean mask"),
        (check_padding_in_attention, lambda tokens, pad_id: (tokens != pad_id)[:, None, :],
         r"cannot be the mask of attention .* With three axes \(batch, 1, k_len\) the mask lines batch up with the "
         r"heads axis"),
        (check_padding_mask, padding_one_wrong,
         r"Sentence 1 should keep positions 0\.\.6; yours keeps positions 1\.\.6"),
        (check_padding_in_attention, padding_one_wrong, r"differs from attention that ignores.*Sentence 1 should keep"),
        (check_causal_mask_offset, causal_flipped_sign, r"wrong sign: tril\(diagonal=q_len - k_len\)"),
        (check_causal_mask_offset, causal_off_by_one, "off by one"),
        (check_causal_mask, causal_off_by_one, "off by one"),
        (check_causal_mask_offset, causal_one_wrong,
         r"(?s)Query 3 should read keys 0\.\.6; yours reads keys 1\.\.6\.\nExpected \(1 = True\):\n    1 1 1 1 0 0 0"),
        (check_which_outputs_change, lambda x, mask=None: _measure(x, mask, keys=False), "only the queries"),
        (check_causal_mask, causal_triu, r"tril, not triu"),
        (check_causal_mask, causal_future, "inverted: it is True on the future"),
        (check_causal_mask, causal_strict, "hides the diagonal"),
        (check_causal_mask, causal_no_default, "default to q_len"),
        (check_causal_mask_offset, causal_top_left, "aligned to the first key, not the last"),
        (check_causal_mask_arguments, causal_unchecked, "should raise a ValueError"),
        (check_causal_mask_arguments, causal_no_device, "on that device"),
        (check_which_outputs_change, lambda x, mask=None: _measure(x, mask, queries=False), "only the keys and values"),
        (check_which_outputs_change, lambda x, mask=None: _measure(x, mask, transpose=True), "transposed"),
        (check_which_outputs_change, lambda x, mask=None: _measure(x, mask, apply_mask=False), "pass the mask"),
        (check_which_outputs_change, lambda x, mask=None: _measure(x, mask, same_copy=True), "No output moved"),
        # The catalogue of chapter 02: each usual mistake named, with how many entries are wrong and the sizes.
        (check_padding_mask, padding_inverted,
         r"padding mask is inverted.*\(\d+ of 14 entries wrong, largest difference 1 at index \[0, 0\] on sizes "
         r"batch=2, k_len=7, pad_id=0\)"),
        (check_padding_mask, padding_k_len_on_queries, r"puts k_len on the q_len axis \(batch, 1, k_len, 1\)"),
        (check_padding_in_attention, padding_k_len_on_queries, r"cannot be the mask.*puts k_len on the q_len axis"),
        (check_padding_mask, padding_k_len_on_heads, r"puts k_len on the heads axis"),
        (check_padding_mask, padding_squeezed,
         r"should have shape \(batch=1, 1, 1, k_len=7\), got \(1, 1, 7\)\. squeeze\(\) without an axis dropped "
         r"the batch axis"),
        (check_padding_in_attention, padding_one_wrong,
         r"ignores exactly the padded keys \(largest difference .* on sizes batch=2, heads=3, q_len=2, k_len=7, "
         r"d_k=5\)"),
        (check_causal_mask, causal_triu,
         r"tril, not triu\)\. \(\d+ of 16 entries wrong, largest difference 1 at index \[.*\] on sizes q_len=4, "
         r"k_len=4\)"),
        (check_causal_mask, causal_strict, r"hides the diagonal \(j < i instead of j <= i\)"),
        (check_causal_mask, causal_additive, "the additive mask of PyTorch's generate_square_subsequent_mask"),
        (check_causal_mask_offset, causal_keys_by_queries,
         r"should have shape \(q_len=4, k_len=7\), got \(7, 4\)\. Yours is transposed"),
        (check_causal_mask_offset, causal_top_left_strict, "aligned to the first key and hides the diagonal"),
        (check_causal_mask_offset, causal_one_wrong, r"1 of 28 entries wrong.*on sizes q_len=4, k_len=7\. Query 3"),
        (check_which_outputs_change, lambda x, mask=None: _measure(x, mask, transpose=True),
         r"With a causal mask \(\d+ of 49 entries wrong, .* on sizes seq=7, d_model=5\): Your matrix is transposed"),
    ],
)
def test_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake)


def test_padding_as_greater_than_pad_id_is_named():
    check_padding_mask(padding_greater, pad_id=0)  # the same mask when pad_id is 0 and ids are >= 0
    for check in PADDING_CHECKS:
        with pytest.raises(CheckFailure, match=r"tokens > pad_id.*compare with tokens != pad_id"):
            check(padding_greater, pad_id=1)


def test_padding_in_attention_fails_on_its_own_for_a_flat_mask():
    # The flat mask is refused by its own behaviour in attention, not by a comparison of masks.
    for seed in (0, 5, 17, 102):
        with pytest.raises(CheckFailure, match="broadcast without an error"):
            check_padding_in_attention(padding_flat, seed=seed, pad_id=seed % 3)


def test_hard_coded_pad_zero_is_named_when_pad_id_is_not_zero():
    check_padding_mask(padding_hard_coded_zero, pad_id=0)  # indistinguishable when pad_id is 0
    with pytest.raises(CheckFailure, match="compare with pad_id"):
        check_padding_mask(padding_hard_coded_zero, pad_id=1)


def test_the_annotated_flat_padding_mask_names_the_shape():
    @jaxtyped(typechecker=beartype)
    def annotated(tokens: Int[torch.Tensor, "batch k_len"], pad_id: int) -> Bool[torch.Tensor, "batch 1 1 k_len"]:
        return tokens != pad_id

    with pytest.raises(CheckFailure, match=r"wrong shape\. A padding mask must have shape"):
        check_padding_mask(annotated)


def test_pytorchs_own_causal_mask_is_not_own_work():
    def borrowed(q_len, k_len=None, device=None):
        return causal_lower_right(q_len, q_len if k_len is None else k_len)._materialize(device)

    with pytest.raises(CheckFailure, match="Not your own work"):
        check_causal_mask(borrowed)


# -- diagnoses verified on the library's code with one edit ----------------------------------

def _edited(*edits):
    """stepformer.masks with each ``(old, new)`` replaced once, loaded under another name (a student's copy)."""
    source = Path(stepformer.masks.__file__).read_text()
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    copy = types.ModuleType("student_edited_masks")
    copy.__file__ = stepformer.masks.__file__
    sys.modules[copy.__name__] = copy
    exec(compile(source, copy.__file__, "exec"), copy.__dict__)  # noqa: S102 - the test's own edited source
    # The notebook hands students chapter 01's attention as their own cell, not the library's object.
    copy.scaled_dot_product_attention = student_copy(stepformer.attention).scaled_dot_product_attention
    return copy


def _message(check, fn):
    with pytest.raises(CheckFailure) as failure:
        check(fn)
    return str(failure.value)


TRIANGLE = "torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)"


@pytest.mark.parametrize(("edits", "named", "not_named"), [
    # k_len=None not replaced: only the call without k_len fails, and causal_mask(n, n) shows it.
    ([("k_len = q_len if k_len is None else k_len", "k_len = q_len if k_len is not None else k_len")],
     "causal_mask(4, 4) gives the right mask", "fewer than two axes"),
    ([("torch.ones(q_len, k_len,", "torch.ones(q_len,")], "fewer than two axes", "default to q_len"),
    ([(".tril(diagonal=k_len - q_len)", ".tril(diagonal=k_len)")], "True everywhere", "off by one"),
    ([(".tril(diagonal=k_len - q_len)", ".tril(diagonal=k_len + q_len)")], "True everywhere", "off by one"),
    ([(".tril(diagonal=k_len - q_len)", ".tril(diagonal=k_len - q_len + 1)")], "off by one", "True everywhere"),
])
def test_causal_mask_check_names_the_slip(edits, named, not_named):
    message = _message(check_causal_mask, _edited(*edits).causal_mask)
    assert named in message and not_named not in message


def test_a_causal_mask_that_fails_with_k_len_too_is_not_called_a_default_problem():
    edits = [("k_len = q_len if k_len is None else k_len", "k_len = None")]
    message = _message(check_causal_mask, _edited(*edits).causal_mask)
    assert "gives the right mask" not in message


CHANGED = "scaled_dot_product_attention(changed_x, changed_x, changed_x, mask)"


@pytest.mark.parametrize(("edits", "named"), [
    ([("seq = x.shape[0]", "seq = x.shape[1]")], "one per feature of x rather than one per token"),
    ([("range(seq)", "range(seq + 1)")], "one past the last token"),
    ([("range(seq)", "range(seq - 1)")], "one fewer than the 7 tokens"),
    ([("changed_x = x.clone()", "changed_x = x")], "Your function changed x in place"),
    ([("out != base", "out == base")], "Your matrix is inverted, here and with a causal mask"),
    ([("changed_x[j] += 1.0", "changed_x[j] += 0.0")], "No output moved for any changed token"),
    ([(CHANGED, CHANGED.replace(", mask)", ")"))], "pass the mask to scaled_dot_product_attention"),
])
def test_measurement_check_names_the_slip_and_only_it(edits, named):
    message = _message(check_which_outputs_change, _edited(*edits).which_outputs_change)
    assert named in message
    others = {"one per feature of x rather than one per token", "one past the last token",
              "one fewer than the 7 tokens",
              "Your function changed x in place", "Your matrix is inverted, here and with a causal mask",
              "No output moved for any changed token",
              "pass the mask to scaled_dot_product_attention"} - {named}
    assert not any(other in message for other in others)

