"""The exercise checks pass on the library, fail on the stub, and name realistic mistakes."""

import math

import pytest
import torch

import stepformer.attention
from stepformer.checks import (
    CheckFailure,
    check_attention_entropy,
    check_attention_mask,
    check_attention_shapes,
    check_attention_values,
    check_entropy_measurement,
)
from tests.fixtures.student import student_copy

ATTENTION_CHECKS = [check_attention_shapes, check_attention_values, check_attention_mask]


def stub(*args, **kwargs):
    raise NotImplementedError()


def attention(q, k, v, mask=None, *, scale=None, softmax_dim=-1, invert_mask=False, safe_rows=True, naive=False):
    """A standalone attention with switches for the usual mistakes (not the library's code)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        mask = ~mask if invert_mask else mask
        scores = scores.masked_fill(~mask, -math.inf)
        if safe_rows:
            scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    if naive:
        scores = scores.exp()
        weights = scores / scores.sum(-1, keepdim=True)
    else:
        weights = torch.softmax(scores, dim=softmax_dim)
    if mask is not None and safe_rows:
        weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return weights @ v, weights


student = student_copy(stepformer.attention)
correct = attention


def softmax_over_queries(q, k, v, mask=None):
    return attention(q, k, v, mask, softmax_dim=-2)


def no_scale(q, k, v, mask=None):
    return attention(q, k, v, mask, scale=1.0)


def divide_by_d_k(q, k, v, mask=None):
    return attention(q, k, v, mask, scale=1 / q.shape[-1])


def inverted_mask(q, k, v, mask=None):
    return attention(q, k, v, mask, invert_mask=True)


def nan_on_blind_rows(q, k, v, mask=None):
    return attention(q, k, v, mask, safe_rows=False)


def naive_exp(q, k, v, mask=None):
    return attention(q, k, v, mask, naive=True)


def swapped_results(q, k, v, mask=None):
    output, weights = attention(q, k, v, mask)
    return weights, output


def weights_before_normalising(q, k, v, mask=None):
    output, weights = attention(q, k, v, mask)
    return output, weights * 2


def float32_always(q, k, v, mask=None):
    return attention(q.float(), k.float(), v.float(), mask)


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def masks_after_softmax(q, k, v, mask=None):
    weights = torch.softmax(_scores(q, k), dim=-1)
    if mask is not None:
        weights = weights * mask  # the scores were right; the weights no longer sum to 1
    return weights @ v, weights


def fills_with_zero(q, k, v, mask=None):
    scores = _scores(q, k)
    if mask is not None:
        scores = scores.masked_fill(~mask, 0.0)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def adds_the_mask(q, k, v, mask=None):
    scores = _scores(q, k)
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def masked_softmax_over_queries(q, k, v, mask=None):
    return attention(q, k, v, mask, softmax_dim=-2 if mask is not None else -1)


def off_by_a_little(q, k, v, mask=None):
    output, weights = attention(q, k, v, mask)
    return output + 0.01 * (mask is not None), weights


def four_axes_only(q, k, v, mask=None):
    # Written for (batch, heads, seq, d) only: the pattern names four axes where *batch allows any number.
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v), weights


def squeezes(q, k, v, mask=None):
    output, weights = attention(q, k, v, mask)
    return output.squeeze(), weights.squeeze()  # meant for a leftover axis; batch=1 goes too


def weights_masked_after_softmax(q, k, v, mask=None):
    output, weights = attention(q, k, v, mask)  # the output is right...
    if mask is not None:  # ...but the weights returned for plotting are masked after the softmax
        weights = torch.softmax(_scores(q, k), dim=-1) * mask
    return output, weights


def returns_unmasked_weights(q, k, v, mask=None):
    output, _ = attention(q, k, v, mask)
    return output, torch.softmax(_scores(q, k), dim=-1)


class AlwaysEqual(torch.Tensor):
    def __eq__(self, other):
        return True


def impostor(q, k, v, mask=None):
    output, weights = attention(q, k, v, mask)
    return output.as_subclass(AlwaysEqual), weights


@pytest.mark.parametrize("check", ATTENTION_CHECKS)
def test_attention_checks_pass_on_the_solution(check, capsys):
    check(student.scaled_dot_product_attention)
    check(student.scaled_dot_product_attention, seed=17)
    check(correct, seed=5)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("check", [check_attention_values, check_attention_mask])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_correct_solution_passes_on_every_seed(check, dtype):
    # Hidden tests use other seeds: scores in the thousands must not fail a correct answer on
    # float32 rounding that PyTorch's own attention shares.
    for seed in range(40):
        check(student.scaled_dot_product_attention, seed=seed, dtype=dtype)


@pytest.mark.parametrize("check", ATTENTION_CHECKS)
def test_attention_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stub)


@pytest.mark.parametrize(
    ("check", "mistake", "message"),
    [
        (check_attention_values, softmax_over_queries, "over the query axis"),
        (check_attention_values, no_scale, "did not divide the scores by sqrt"),
        (check_attention_values, divide_by_d_k, "divided the scores by d_k"),
        (check_attention_values, naive_exp, "NaN"),
        (check_attention_values, weights_before_normalising, "weights you return"),
        (check_attention_mask, inverted_mask, "mask is inverted"),
        (check_attention_mask, masks_after_softmax, "masked after the softmax"),
        (check_attention_mask, fills_with_zero, "filled the masked scores with 0"),
        (check_attention_mask, adds_the_mask, "added the mask to the scores as numbers"),
        (check_attention_mask, masked_softmax_over_queries, "softmax over the query axis"),
        # The last resort says where and on which sizes, never a guess that the scores are wrong.
        (check_attention_mask, off_by_a_little,
         r"largest difference 0\.01 at index \[.*\] on sizes batch=2, heads=3, q_len=5, k_len=7, d_k=4, d_v=6"),
        (check_attention_mask, nan_on_blind_rows, "all masked gives NaN"),
        (check_attention_shapes, swapped_results, "output should have shape"),
        (check_attention_shapes, float32_always, "dtype"),
        (check_attention_shapes, impostor, "should be a torch.Tensor"),
        # Gap 21: a pattern with four named axes passed while every check used 4-D inputs only.
        (check_attention_shapes, four_axes_only, r"with 1 leading axis instead of \(batch, heads\).*'\.\.\.'"),
        (check_attention_values, four_axes_only, r"leading axis instead of \(batch, heads\)"),
        # Gap 19: no size was ever 1.
        (check_attention_shapes, squeezes, r"shape \(batch=1, heads=3, q_len=5, d_v=6\).*squeeze\(\) without an axis"),
        (check_attention_values, squeezes, r"squeeze\(\) without an axis"),
        # Gap 22: the weights under a mask were never compared with the masked softmax.
        (check_attention_mask, weights_masked_after_softmax,
         r"your output is right, but the weights you return differ .*largest difference .* on sizes batch=2, "
         r"heads=3, q_len=5, k_len=7, d_k=4, d_v=6\)\. Your weights are masked after the softmax"),
        # Section 3: every message gives the largest difference and the sizes, a named mistake included.
        (check_attention_values, no_scale,
         r"did not divide the scores by sqrt\(d_k\)\. \(Your output: largest difference .* on sizes batch=2, heads=3"),
        (check_attention_mask, inverted_mask, r"mask is inverted.*\(Your output: largest difference .* on sizes"),
        (check_attention_values, weights_before_normalising,
         r"weights you return are not softmax.*\(largest difference .* on sizes batch=2, heads=3, q_len=5"),
        (check_attention_mask, returns_unmasked_weights, r"masked keys got weight up to .* on sizes batch=2, heads=3"),
    ],
)
def test_attention_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake)


def test_sizes_are_pairwise_distinct_for_every_seed():
    from stepformer.checks.attention import _sizes

    for seed in range(50):
        sizes = list(_sizes(seed).values())
        assert len(set(sizes)) == len(sizes)


def test_entropy_check():
    check_attention_entropy(student.attention_entropy)
    with pytest.raises(CheckFailure, match="not implemented"):
        check_attention_entropy(stub)
    with pytest.raises(CheckFailure, match="log base 2"):
        check_attention_entropy(lambda w: student.attention_entropy(w) / math.log(2))
    with pytest.raises(CheckFailure, match="wrong sign"):
        check_attention_entropy(lambda w: -student.attention_entropy(w))
    with pytest.raises(CheckFailure, match="0·log 0"):
        check_attention_entropy(lambda w: -(w * w.log()).sum(-1))
    with pytest.raises(CheckFailure, match=r"summed over the k_len axis \(largest difference .* on sizes batch=2"):
        check_attention_entropy(lambda w: -(w * w.log()).sum(-2)[..., : w.shape[-2]].expand(w.shape[:-1]).contiguous())
    # Gap 28: float32 input, the row of a fully masked query (all zeros), the shape of every result.
    with pytest.raises(CheckFailure, match="entropy should have dtype torch.float32"):
        check_attention_entropy(lambda w: student.attention_entropy(w.double()))
    # PyTorch's Categorical normalises its probs: right on every softmax row, 0/0 on a fully masked one.
    with pytest.raises(CheckFailure, match=r"A fully masked row .* raised ValueError.*Categorical normalises them"):
        check_attention_entropy(lambda w: torch.distributions.Categorical(probs=w).entropy())
    with pytest.raises(CheckFailure, match=r"A fully masked row .* gives NaN \(largest difference inf.*p / p.sum"):
        check_attention_entropy(lambda w: torch.distributions.Categorical(probs=w, validate_args=False).entropy())
    with pytest.raises(CheckFailure, match=r"entropy should have shape"):
        check_attention_entropy(lambda w: student.attention_entropy(w) if (w > 0).all() else torch.zeros(1).double())


def test_measurement_check():
    check_entropy_measurement(student.mean_attention_entropy)
    with pytest.raises(CheckFailure, match="not implemented"):
        check_entropy_measurement(stub)

    def ignores_scale(d_k, *, scale, **kwargs):
        return student.mean_attention_entropy(d_k, scale=True, **kwargs)

    with pytest.raises(CheckFailure, match="scale=False"):
        check_entropy_measurement(ignores_scale)

    def returns_tensor(d_k, *, scale, **kwargs):
        return torch.tensor(student.mean_attention_entropy(d_k, scale=scale, **kwargs))

    with pytest.raises(CheckFailure, match="Python float"):
        check_entropy_measurement(returns_tensor)

    # Gap 17: k_len was the default (16), so a function that ignored it passed.
    def ignores_k_len(d_k, *, scale, q_len=16, k_len=16, samples=64, seed=0):
        return student.mean_attention_entropy(d_k, scale=scale, q_len=q_len, samples=samples, seed=seed)

    with pytest.raises(CheckFailure, match=r"over 9 keys lies in \[0, log 9\].*the k_len it is given"):
        check_entropy_measurement(ignores_k_len)

    # Issue 27: the keys drawn with the query count, an argument that only the noise hides, or no seed.
    def measured(**changes):
        def fn(d_k, *, scale, q_len=16, k_len=16, samples=64, seed=0):
            given = dict(q_len=q_len, k_len=k_len, samples=samples, seed=seed)
            given.update({k: v(given) for k, v in changes.items()})
            return student.mean_attention_entropy(d_k, scale=scale, **given)

        return fn

    with pytest.raises(CheckFailure, match=r"That is the entropy over 12 keys"):
        check_entropy_measurement(measured(k_len=lambda a: a["q_len"]))
    with pytest.raises(CheckFailure, match=r"spread of a mean over many draws: does your function use samples"):
        check_entropy_measurement(measured(samples=lambda a: 64))
    with pytest.raises(CheckFailure, match=r"all gave .* ignores seed"):
        check_entropy_measurement(measured(seed=lambda a: 0))
    with pytest.raises(CheckFailure, match=r"Called twice with the same arguments and seed=0"):
        check_entropy_measurement(measured(seed=lambda a: int(torch.randint(0, 10**6, ()))))
    with pytest.raises(CheckFailure, match=r"With one key \(k_len=1\).*exactly 0"):
        check_entropy_measurement(measured(k_len=lambda a: max(a["k_len"], 2)))


# -- own work -----------------------------------------------------------------------------

import torch.nn.functional as F  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as captured_before  # noqa: E402


def calls_pytorch(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None


def calls_captured_alias(q, k, v, mask=None):
    output = captured_before(q, k, v, attn_mask=mask)
    return output, attention(q, k, v, mask)[1]


def calls_through_default(q, k, v, mask=None, _hidden=F.scaled_dot_product_attention):
    return _hidden(q, k, v, attn_mask=mask), attention(q, k, v, mask)[1]


def calls_by_name(q, k, v, mask=None):
    module = __import__("importlib").import_module("torch.nn." + "functional")
    output = getattr(module, "scaled_dot_" + "product_attention")(q, k, v, attn_mask=mask)
    return output, attention(q, k, v, mask)[1]


def calls_the_library(q, k, v, mask=None):
    import stepformer.attention as reference

    return reference.scaled_dot_product_attention(q, k, v, mask)


@pytest.mark.parametrize(
    "cheat", [calls_pytorch, calls_captured_alias, calls_through_default, calls_by_name, calls_the_library,
              stepformer.attention.scaled_dot_product_attention],
)
def test_using_the_reference_is_not_own_work(cheat):
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_attention_values(cheat)


def test_tripwires_are_removed_afterwards():
    original = F.scaled_dot_product_attention
    with pytest.raises(CheckFailure):
        check_attention_values(calls_by_name)
    assert F.scaled_dot_product_attention is original


# -- record and replay ----------------------------------------------------------------------

from stepformer.checks._core import RECORD_ENV, _key_file, replaying  # noqa: E402


def _record(monkeypatch, tmp_path, fn):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    try:
        check_attention_values(fn, seed=3)
    except CheckFailure:
        pass
    monkeypatch.delenv(RECORD_ENV)


def test_replay_gives_the_recorded_verdict_without_calling_anything(monkeypatch, tmp_path):
    _record(monkeypatch, tmp_path, student.scaled_dot_product_attention)
    with replaying(tmp_path):
        check_attention_values(object(), seed=3)  # the object is never called
    _record(monkeypatch, tmp_path / "wrong", no_scale)
    with replaying(tmp_path / "wrong"), pytest.raises(CheckFailure, match="did not divide"):
        check_attention_values(object(), seed=3)


def test_patching_in_the_student_process_does_not_reach_the_replay(monkeypatch, tmp_path):
    # A submission that makes every comparison succeed while its answer is recorded...
    monkeypatch.setattr(torch, "allclose", lambda *a, **k: True)
    _record(monkeypatch, tmp_path, no_scale)
    monkeypatch.undo()
    # ...is judged in a process where torch.allclose is the real one.
    with replaying(tmp_path), pytest.raises(CheckFailure, match="did not divide"):
        check_attention_values(object(), seed=3)


def test_replay_without_records_or_with_forged_ones_fails(monkeypatch, tmp_path):
    with replaying(tmp_path), pytest.raises(CheckFailure, match="left no result"):
        check_attention_values(object(), seed=3)
    _record(monkeypatch, tmp_path, student.scaled_dot_product_attention)
    # A record for seed 3 passed off as the answer to seed 4: the inputs' fingerprints differ.
    (tmp_path / f"{_key_file('check_attention_values(seed=3)')}-0.pt").rename(
        tmp_path / f"{_key_file('check_attention_values(seed=4)')}-0.pt")
    with replaying(tmp_path), pytest.raises(CheckFailure, match="does not match"):
        check_attention_values(object(), seed=4)
    _record(monkeypatch, tmp_path / "impostor", impostor)
    with replaying(tmp_path / "impostor"), pytest.raises(CheckFailure, match="AlwaysEqual"):
        check_attention_values(object(), seed=3)
