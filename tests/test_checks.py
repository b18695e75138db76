"""The exercise checks pass on the library, fail on the stub, and name realistic mistakes."""

import math

import pytest
import torch

from stepformer.attention import attention_entropy, mean_attention_entropy, scaled_dot_product_attention
from stepformer.checks import (
    CheckFailure,
    check_attention_entropy,
    check_attention_mask,
    check_attention_shapes,
    check_attention_values,
    check_entropy_measurement,
)

ATTENTION_CHECKS = [check_attention_shapes, check_attention_values, check_attention_mask]


def stub(*args, **kwargs):
    raise NotImplementedError()


def softmax_over_queries(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores, dim=-2)
    return weights @ v, weights


def no_scale(q, k, v, mask=None):
    return scaled_dot_product_attention(q * math.sqrt(q.shape[-1]), k, v, mask)


def divide_by_d_k(q, k, v, mask=None):
    return scaled_dot_product_attention(q / math.sqrt(q.shape[-1]), k, v, mask)


def inverted_mask(q, k, v, mask=None):
    return scaled_dot_product_attention(q, k, v, None if mask is None else ~mask)


def nan_on_blind_rows(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def naive_exp(q, k, v, mask=None):
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).exp()
    weights = scores / scores.sum(-1, keepdim=True)
    return weights @ v, weights


def swapped_results(q, k, v, mask=None):
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    return weights, output


def weights_before_normalising(q, k, v, mask=None):
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    return output, weights * 2


def float32_always(q, k, v, mask=None):
    output, weights = scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)
    return output, weights


class AlwaysEqual(torch.Tensor):
    def __eq__(self, other):
        return True


def impostor(q, k, v, mask=None):
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    return output.as_subclass(AlwaysEqual), weights


@pytest.mark.parametrize("check", ATTENTION_CHECKS)
def test_attention_checks_pass_on_the_library(check, capsys):
    check(scaled_dot_product_attention)
    check(scaled_dot_product_attention, seed=17)
    assert "✔" in capsys.readouterr().out


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
        (check_attention_mask, nan_on_blind_rows, "all masked gives NaN"),
        (check_attention_shapes, swapped_results, "output should have shape"),
        (check_attention_shapes, float32_always, "dtype"),
        (check_attention_shapes, impostor, "should be a torch.Tensor"),
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
    check_attention_entropy(attention_entropy)
    with pytest.raises(CheckFailure, match="not implemented"):
        check_attention_entropy(stub)
    with pytest.raises(CheckFailure, match="log base 2"):
        check_attention_entropy(lambda w: attention_entropy(w) / math.log(2))
    with pytest.raises(CheckFailure, match="wrong sign"):
        check_attention_entropy(lambda w: -attention_entropy(w))
    with pytest.raises(CheckFailure, match="0·log 0"):
        check_attention_entropy(lambda w: -(w * w.log()).sum(-1))
    with pytest.raises(CheckFailure, match="summed over the k_len axis"):
        check_attention_entropy(lambda w: -(w * w.log()).sum(-2)[..., : w.shape[-2]].expand(w.shape[:-1]).contiguous())


def test_measurement_check():
    check_entropy_measurement(mean_attention_entropy)
    with pytest.raises(CheckFailure, match="not implemented"):
        check_entropy_measurement(stub)

    def ignores_scale(d_k, *, scale, **kwargs):
        return mean_attention_entropy(d_k, scale=True, **kwargs)

    with pytest.raises(CheckFailure, match="scale=False"):
        check_entropy_measurement(ignores_scale)

    def returns_tensor(d_k, *, scale, **kwargs):
        return torch.tensor(mean_attention_entropy(d_k, scale=scale, **kwargs))

    with pytest.raises(CheckFailure, match="Python float"):
        check_entropy_measurement(returns_tensor)
