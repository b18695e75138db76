"""stepformer.attention against torch.nn.functional.scaled_dot_product_attention, on random shapes."""

import inspect
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from torch import nn

from stepformer import attention
from stepformer.attention import attention_entropy, mean_attention_entropy, scaled_dot_product_attention
from stepformer.before import masked_softmax
from stepformer.checks._core import CheckFailure
from stepformer.checks.attention import (
    check_attention_dropout,
    check_attention_entropy,
    check_attention_mask,
    check_attention_shapes,
    check_attention_values,
    check_entropy_measurement,
)

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-6}

shapes = st.fixed_dictionaries({
    "batch": st.lists(st.integers(1, 3), min_size=0, max_size=2),
    "q_len": st.integers(1, 9),
    "k_len": st.integers(1, 9),
    "d_k": st.integers(1, 16),
    "d_v": st.integers(1, 16),
    "seed": st.integers(0, 2**31 - 1),
    "dtype": st.sampled_from([torch.float32, torch.float64]),
})


def _inputs(s):
    g = torch.Generator().manual_seed(s["seed"])
    batch, dtype = s["batch"], s["dtype"]
    q = torch.randn(*batch, s["q_len"], s["d_k"], generator=g, dtype=dtype)
    k = torch.randn(*batch, s["k_len"], s["d_k"], generator=g, dtype=dtype)
    v = torch.randn(*batch, s["k_len"], s["d_v"], generator=g, dtype=dtype)
    return g, q, k, v


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@settings(max_examples=150, deadline=None)
@given(shapes)
def test_matches_pytorch_without_mask(s):
    _, q, k, v = _inputs(s)
    output, weights = scaled_dot_product_attention(q, k, v)
    _assert_close(output, F.scaled_dot_product_attention(q, k, v), s["dtype"])
    _assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), s["dtype"])


@settings(max_examples=150, deadline=None)
@given(shapes, st.data())
def test_matches_pytorch_with_random_broadcast_masks(s, data):
    g, q, k, v = _inputs(s)
    full_shape = (*s["batch"], s["q_len"], s["k_len"])
    # Any axis of the mask may be 1 (broadcast); leading axes may be dropped.
    keep = data.draw(st.lists(st.booleans(), min_size=len(full_shape), max_size=len(full_shape)))
    drop = data.draw(st.integers(0, len(s["batch"])))
    mask_shape = tuple(n if kept else 1 for n, kept in zip(full_shape, keep, strict=True))[drop:]
    mask = torch.rand(mask_shape, generator=g) < data.draw(st.floats(0.0, 1.0))
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    _assert_close(output, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), s["dtype"])
    assert not torch.isnan(output).any() and not torch.isnan(weights).any()
    full_mask = mask.expand(full_shape)
    assert (weights.masked_select(~full_mask) == 0).all(), "masked keys must get exactly zero weight"
    blind = ~full_mask.any(-1)
    assert (output[blind] == 0).all() and (weights[blind] == 0).all(), "fully masked rows give zeros"


def test_float64_agrees_to_1e6_on_random_masks():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.randint(1, 10, (5,), generator=g).tolist()
        b, h, q_len, k_len, d = sizes
        q = torch.randn(b, h, q_len, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, h, k_len, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, h, k_len, d + 1, generator=g, dtype=torch.float64)
        mask = torch.rand(b, h, q_len, k_len, generator=g) < 0.5
        output, _ = scaled_dot_product_attention(q, k, v, mask)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (output - expected).abs().max() <= 1e-6


def test_fully_masked_rows_are_zero_and_gradients_finite():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 5, 7, generator=g) < 0.5
    mask[:, 2] = False
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    assert (output[:, 2] == 0).all() and (weights[:, 2] == 0).all()
    output.sum().backward()
    for tensor in (q, k, v):
        assert torch.isfinite(tensor.grad).all()
    assert (q.grad[:, 2] == 0).all(), "a query that reads nothing gets no gradient"


@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_pytorch(masked):
    g = torch.Generator().manual_seed(11)
    inputs = [torch.randn(3, 2, n, d, generator=g, dtype=torch.float64) for n, d in ((5, 4), (6, 4), (6, 7))]
    mask = (torch.rand(3, 1, 5, 6, generator=g) < 0.7) | torch.eye(5, 6, dtype=torch.bool) if masked else None
    ours = [x.clone().requires_grad_() for x in inputs]
    theirs = [x.clone().requires_grad_() for x in inputs]
    upstream = torch.randn(3, 2, 5, 7, generator=g, dtype=torch.float64)
    (scaled_dot_product_attention(*ours, mask)[0] * upstream).sum().backward()
    (F.scaled_dot_product_attention(*theirs, attn_mask=mask) * upstream).sum().backward()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9)
    # Numerical differentiation costs two calls per input entry: one batch entry and one head suffice.
    one = None if mask is None else mask[:1]
    assert torch.autograd.gradcheck(lambda *x: scaled_dot_product_attention(*x, one)[0],
                                    [x[:1, :1].clone().requires_grad_() for x in inputs])


def test_large_scores_do_not_overflow():
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(4, 6, 8, generator=g) * 100 for _ in range(2))
    v = torch.randn(4, 6, 3, generator=g)
    output, weights = scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(output).all()
    _assert_close(output, F.scaled_dot_product_attention(q, k, v), torch.float32)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "axis"),
    [
        ((2, 5, 4), (2, 7, 3), (2, 7, 6), "d_k"),
        ((2, 5, 4), (2, 7, 4), (2, 8, 6), "k_len"),
        ((2, 5, 4), (3, 7, 4), (3, 7, 6), "batch"),
    ],
)
def test_wrong_shapes_fail_naming_the_axis(q_shape, k_shape, v_shape, axis):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with pytest.raises(TypeCheckError, match=rf"{axis}="):
        scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_matches_pytorchs_dropout_p_from_the_same_seed(masked, dtype):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, n, d, generator=g, dtype=dtype) for n, d in ((5, 4), (7, 4), (7, 6)))
    mask = torch.rand(2, 1, 5, 7, generator=g) < 0.6 if masked else None
    torch.manual_seed(9)
    output, weights = scaled_dot_product_attention(q, k, v, mask, nn.Dropout(0.3))
    torch.manual_seed(9)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3)
    _assert_close(output, theirs, dtype)
    _, undropped = scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(weights, undropped), "the weights returned are those before dropout"
    assert not torch.allclose(output, scaled_dot_product_attention(q, k, v, mask)[0])


def test_dropout_acts_on_the_weights_and_only_in_training():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, n, d, generator=g, dtype=torch.float64) for n, d in ((5, 4), (7, 4), (7, 6)))
    plain, weights = scaled_dot_product_attention(q, k, v)
    output, returned = scaled_dot_product_attention(q, k, v, dropout=nn.Dropout(0.5).eval())
    assert torch.equal(output, plain) and torch.equal(returned, weights)
    output, returned = scaled_dot_product_attention(q, k, v, dropout=nn.Dropout(1.0))
    assert (output == 0).all() and torch.equal(returned, weights)
    keep = torch.rand(3, 5, 7, generator=g) < 0.5

    class Known(nn.Module):
        def forward(self, x):
            return x * keep * 2

    output, returned = scaled_dot_product_attention(q, k, v, dropout=Known())
    torch.testing.assert_close(output, (weights * keep * 2) @ v, rtol=0, atol=1e-12)
    assert torch.equal(returned, weights)


def test_non_boolean_mask_is_refused():
    q, k, v = torch.randn(5, 4), torch.randn(7, 4), torch.randn(7, 2)
    with pytest.raises(TypeCheckError, match="mask"):
        scaled_dot_product_attention(q, k, v, torch.ones(5, 7))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_entropy_matches_categorical(s):
    g, q, k, _ = _inputs(s)
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    expected = torch.distributions.Categorical(probs=weights).entropy()
    _assert_close(attention_entropy(weights), expected, s["dtype"])


def test_entropy_of_one_hot_and_uniform_rows():
    one_hot = torch.eye(4, 6)
    assert (attention_entropy(one_hot) == 0).all()
    uniform = torch.full((3, 6), 1 / 6)
    torch.testing.assert_close(attention_entropy(uniform), torch.full((3,), math.log(6)))
    assert attention_entropy(torch.zeros(2, 5)).eq(0).all(), "a fully masked row has zero entropy"


def test_mean_entropy_collapses_without_scaling_and_holds_with_it():
    k_len = 16
    scaled = [mean_attention_entropy(d, scale=True, k_len=k_len) for d in (4, 64, 1024)]
    unscaled = [mean_attention_entropy(d, scale=False, k_len=k_len) for d in (4, 64, 1024)]
    assert max(scaled) - min(scaled) < 0.1 * math.log(k_len)
    assert unscaled[0] > unscaled[1] > unscaled[2] and unscaled[2] < 0.1 * math.log(k_len)
    assert mean_attention_entropy(1, scale=True) == mean_attention_entropy(1, scale=False)



# -- the checks' diagnoses, each on the library's code with one edit ---------------------------

def _edited(module, *edits):
    """The module's source with each ``(old, new)`` replaced once, loaded under another name: a student's
    solution with one mistake (not the library's objects, so the own-work rule does not flag it)."""
    source = Path(module.__file__).read_text()
    # A student's notebook holds chapter 00's masked_softmax in a cell of its own, above the attention:
    # the source as a notebook has it, so that an edit can reach every line the student writes.
    source = source.replace("from stepformer.before import masked_softmax\n", inspect.getsource(masked_softmax))
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    name = "student_edited_" + module.__name__.rpartition(".")[2]
    copy = types.ModuleType(name)
    copy.__file__ = module.__file__
    sys.modules[name] = copy
    exec(compile(source, module.__file__, "exec"), copy.__dict__)  # noqa: S102 - the test's own edited source
    return copy


def _message(check, fn, **kwargs):
    with pytest.raises(CheckFailure) as failure:
        check(fn, **kwargs)
    return str(failure.value)


GUARD = "mask.any(dim=-1, keepdim=True)"
GUARD_MISTAKES = {
    "all": ([(GUARD, "mask.all(dim=-1, keepdim=True)")], "not those where not every key is allowed (mask.all)"),
    "dim -2": ([(GUARD, "mask.any(dim=-2, keepdim=True)")], "fully masked rows over the query axis"),
    "neutral where has_key": ([(".masked_fill(~has_key, 0.0)\n", ".masked_fill(has_key, 0.0)\n")],
                              "set to 0 before the softmax are the queries that have a key"),
    "zero where has_key": ([("dim=-1).masked_fill(~has_key, 0.0)", "dim=-1).masked_fill(has_key, 0.0)")],
                           "weights you zero after the softmax are the queries that have a key"),
    "fill where mask": ([("masked_fill(~mask, -math.inf)", "masked_fill(mask, -math.inf)")], "Your mask is inverted"),
}


@pytest.mark.parametrize("mistake", list(GUARD_MISTAKES))
def test_mask_check_names_the_guard_mistake_and_only_it(mistake):
    edits, named = GUARD_MISTAKES[mistake]
    message = _message(check_attention_mask, _edited(attention, *edits).scaled_dot_product_attention)
    assert named in message
    assert "differs from" in message or "largest difference" in message  # the observed facts stay
    for other, (_, other_named) in GUARD_MISTAKES.items():
        if other != mistake:
            assert other_named not in message


@pytest.mark.parametrize("keepdim", ["mask.any(dim=-1)", "mask.any(dim=-1, keepdim=False)"])
def test_mask_check_names_a_lost_keepdim_after_the_shape_error(keepdim):
    message = _message(check_attention_mask, _edited(attention, (GUARD, keepdim)).scaled_dot_product_attention)
    assert "must match the size" in message and "mask.any(dim=-1, keepdim=True)" in message


def test_a_shape_error_with_a_mask_is_not_blamed_on_keepdim_when_square_inputs_disagree():
    # The mask read with a fixed (batch, heads) layout: a shape error, but not the keepdim one.
    edits = [(GUARD, "mask.any(dim=-1, keepdim=True)[..., :1, :, :]")]
    message = _message(check_attention_mask, _edited(attention, *edits).scaled_dot_product_attention)
    assert "keepdim" not in message


UNMASKED = "if mask is None:\n        return torch.softmax(scores, dim=-1)\n"


@pytest.mark.parametrize(("edit", "named"), [
    # masked_softmax without its mask=None branch: mask.any on None, with or without dropout
    ((UNMASKED, ""), "with a dropout given it raises the same: the only None left is mask=None"),
    # the mask=None branch reads has_key, which only the masked path sets
    ((UNMASKED, UNMASKED.replace("dim=-1)", "dim=-1).masked_fill(~has_key, 0.0)")), "the mask=None path is what fails"),
])
def test_shapes_check_names_the_unmasked_path(edit, named):
    message = _message(check_attention_shapes, _edited(attention, edit).scaled_dot_product_attention)
    assert named in message


def test_shapes_check_does_not_blame_the_unmasked_path_when_masked_calls_fail_too():
    edits = [("d_k = q.shape[-1]", "d_k = q.shape[-1]\n    q = q.view(-1)")]
    message = _message(check_attention_shapes, _edited(attention, *edits).scaled_dot_product_attention)
    assert "mask=None" not in message


@pytest.mark.parametrize(("axis", "named"), [("q.shape[-2]", "sqrt(q_len)"), ("k.shape[-2]", "sqrt(k_len)"),
                                             ("v.shape[-1]", "sqrt(d_v)")])
def test_values_check_names_d_k_read_off_another_axis(axis, named):
    message = _message(check_attention_values, _edited(attention, ("d_k = q.shape[-1]", f"d_k = {axis}"))
                       .scaled_dot_product_attention)
    assert named in message and "largest difference" in message
    assert "d_k: divide by sqrt(d_k)" not in message


def test_values_check_keeps_dividing_by_d_k_apart_from_another_axis():
    edits = [("/ math.sqrt(d_k)", "/ d_k")]
    message = _message(check_attention_values, _edited(attention, *edits).scaled_dot_product_attention)
    assert "divided the scores by d_k" in message and "another axis" not in message


PLOGP = "weights * weights.log()"
ENTROPY_MISTAKES = {
    "mean": ([('"sum"', '"mean"')], "a mean over k_len"),
    "no weight": ([(PLOGP, "weights.log()")], "log p without the weight p"),
    "no log": ([(PLOGP, "weights")], "Your terms are p, without log p"),
    "p times p": ([(PLOGP, "weights * weights")], "Your terms are p · p"),
    "divided": ([(PLOGP, "weights / weights.log()")], "You divided p by log p"),
    "where swapped": ([(f"torch.where(weights > 0, {PLOGP}, 0.0)", f"torch.where(weights > 0, 0.0, {PLOGP})")],
                      "its two values are the wrong way round"),
    "nothing kept": ([("weights > 0,", "weights > 1,")], "every p log p term is dropped"),
    "sign": ([("return -reduce(", "return reduce(")], "wrong sign"),
}


@pytest.mark.parametrize("mistake", list(ENTROPY_MISTAKES))
def test_entropy_check_names_the_slip_and_only_it(mistake):
    edits, named = ENTROPY_MISTAKES[mistake]
    message = _message(check_attention_entropy, _edited(attention, *edits).attention_entropy)
    assert named in message and "largest difference" in message
    for other, (_, other_named) in ENTROPY_MISTAKES.items():
        if other != mistake:
            assert other_named not in message


MEASURE_Q = "q = torch.randn(samples, q_len, d_k, generator=generator, dtype=torch.float64)"


@pytest.mark.parametrize(("edits", "named"), [
    ([(MEASURE_Q, "q = torch.randn(samples, q_len, d_k, generator=generator)")], "different dtypes"),
    ([("torch.zeros(samples, k_len, 1, dtype=torch.float64)", "torch.zeros(samples, k_len, 1)")], "different dtypes"),
    ([("q if scale else", "q if not scale else")], "your test of scale is inverted"),
    ([(".mean().item()", ".sum().item()")], "you summed the entropies instead of averaging them"),
    ([("k = torch.randn(samples, k_len,", "k = torch.randn(samples, q_len,"),
      ("torch.zeros(samples, k_len, 1", "torch.zeros(samples, q_len, 1")], "That is the entropy over 12 keys"),
])
def test_measurement_check_names_the_slip(edits, named):
    message = _message(check_entropy_measurement, _edited(attention, *edits).mean_attention_entropy)
    assert named in message
    others = {"different dtypes", "inverted", "summed the entropies", "entropy over 12 keys"} - {named}
    assert not any(other in message for other in others if other not in named)


def test_measurement_check_does_not_call_a_mean_over_too_many_keys_a_sum():
    # Keys drawn over k_len + q_len positions: out of no range, so neither the sum nor the inverted scale.
    edits = [("q = q if scale else q * math.sqrt(d_k)", "q = q if scale else q * d_k")]
    message = _message(check_entropy_measurement, _edited(attention, *edits).mean_attention_entropy)
    assert "summed the entropies" not in message and "inverted" not in message


def test_measurement_check_names_a_tensor_left_unconverted_and_only_that():
    message = _message(check_entropy_measurement, _edited(attention, (".mean().item()", ".mean()"))
                       .mean_attention_entropy)
    assert "Your value is a tensor holding one number" in message
    message = _message(check_entropy_measurement, _edited(attention, (".mean().item()", ".mean().tolist(),"))
                       .mean_attention_entropy)
    assert "should return a Python float" in message and "holding one number" not in message


# -- the dropout check ---------------------------------------------------------------------

DROPPED = "    dropped = weights if dropout is None else dropout(weights)\n"
DROPOUT_MISTAKES = {
    "ignored": ([(DROPPED, "    dropped = weights\n")], "Your function never called dropout"),
    "output": ([(DROPPED, "    dropped = weights\n"),
                ("    return output, weights", "    output = output if dropout is None else dropout(output)\n"
                                               "    return output, weights")], "You applied dropout to the output"),
    "scores": ([(DROPPED, "    dropped = weights\n"),
                ("    weights = masked_softmax(", "    scores = scores if dropout is None else dropout(scores)\n"
                                               "    weights = masked_softmax(")], "You applied dropout to the scores"),
    "values": ([(DROPPED, "    dropped = weights\n    v = v if dropout is None else dropout(v)\n")],
               "You applied dropout to v"),
    "twice": ([(DROPPED, "    dropped = weights if dropout is None else dropout(dropout(weights))\n")],
              "You applied dropout to the weights twice"),
    "returns dropped": ([(DROPPED, "    weights = weights if dropout is None else dropout(weights)\n"
                                   "    dropped = weights\n")], "they are the dropped weights"),
    "sums the undropped": ([(DROPPED, DROPPED + "    dropped = weights\n")],
                           "yet its output is attention without dropout"),
    "F.dropout": ([(DROPPED, "    dropped = weights if dropout is None else "
                             "torch.nn.functional.dropout(weights, dropout.p)\n")],
                  "Your function never called dropout"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_check_passes_on_the_solution(dtype, capsys):
    solution = _edited(attention).scaled_dot_product_attention
    for seed in range(8):
        check_attention_dropout(solution, seed=seed, dtype=dtype)
    assert "✔ dropout acts on the attention weights" in capsys.readouterr().out


def test_dropout_check_fails_on_the_stub_and_on_a_function_without_dropout():
    def stub(q, k, v, mask=None, dropout=None):
        raise NotImplementedError()

    def without_dropout(q, k, v, mask=None):  # written before the exercise asked for dropout
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        return weights @ v, weights

    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_attention_dropout(stub)
    message = _message(check_attention_dropout, without_dropout)
    assert "unexpected keyword argument 'dropout'" in message and "keep the exercise's signature" in message


@pytest.mark.parametrize("mistake", list(DROPOUT_MISTAKES))
def test_dropout_check_names_the_slip_and_only_it(mistake):
    edits, named = DROPOUT_MISTAKES[mistake]
    message = _message(check_attention_dropout, _edited(attention, *edits).scaled_dot_product_attention)
    assert named in message
    for other, (_, other_named) in DROPOUT_MISTAKES.items():
        if other_named != named:
            assert other_named not in message, other
    # The other checks call without dropout: none of these slips costs them anything.
    for check in (check_attention_shapes, check_attention_values, check_attention_mask):
        check(_edited(attention, *edits).scaled_dot_product_attention)


def test_dropout_check_says_when_the_output_is_wrong_without_dropout():
    message = _message(check_attention_dropout, _edited(attention, (") / math.sqrt(d_k)", ")"))
                       .scaled_dot_product_attention)
    assert message.startswith("Without dropout your output already differs") and "did not divide" in message


def test_an_unguarded_dropout_is_named_by_every_check_that_calls_without_one():
    fn = _edited(attention, (DROPPED, "    dropped = dropout(weights)\n")).scaled_dot_product_attention
    for check in (check_attention_shapes, check_attention_values, check_attention_mask):
        message = _message(check, fn)
        assert "'NoneType' object is not callable" in message and "the None it used is dropout=None" in message
        assert "mask=None" not in message
