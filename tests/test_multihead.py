"""stepformer.multihead against torch.nn.MultiheadAttention on random shapes, and the chapter's checks."""

import math
import sys
import types
from pathlib import Path

import pytest
import torch
from einops import EinopsError
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from torch import nn

import stepformer.attention
import stepformer.multihead
from stepformer.checks._core import RECORD_ENV, CheckFailure, replaying
from stepformer.checks.multihead import (
    check_merge_heads,
    check_mha_cross_attention,
    check_mha_init,
    check_mha_self_attention,
    check_parameter_count,
    check_split_heads,
)
from stepformer.multihead import MultiHeadAttention, count_parameters, from_torch, merge_heads, split_heads
from tests.fixtures.student import student_copy

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-6}

shapes = st.fixed_dictionaries({
    "batch": st.integers(1, 3),
    "heads": st.integers(1, 4),
    "d_head": st.integers(1, 6),
    "q_len": st.integers(1, 7),
    "k_len": st.integers(1, 7),
    "bias": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
    "dtype": st.sampled_from([torch.float32, torch.float64]),
})


def _pair(s):
    """PyTorch's module with random weights (biases too) and ours with the same weights, both in eval mode."""
    g = torch.Generator().manual_seed(s["seed"])
    d_model, dtype = s["heads"] * s["d_head"], s["dtype"]
    theirs = nn.MultiheadAttention(d_model, s["heads"], bias=s["bias"], batch_first=True, dtype=dtype).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) / math.sqrt(d_model))
    return theirs, from_torch(theirs).eval(), g


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from(["none", "padding", "causal"]), st.booleans())
def test_matches_pytorch(s, masking, cross):
    theirs, ours, g = _pair(s)
    b, d_model, dtype = s["batch"], s["heads"] * s["d_head"], s["dtype"]
    q_len = s["q_len"]
    k_len = s["k_len"] if cross else q_len
    query = torch.randn(b, q_len, d_model, generator=g, dtype=dtype)
    key, value = (torch.randn(b, k_len, d_model, generator=g, dtype=dtype) for _ in range(2)) if cross else (query,) * 2
    mask, kwargs = None, {}
    if masking == "padding":  # every sentence keeps at least one token: PyTorch gives NaN otherwise
        lengths = torch.randint(1, k_len + 1, (b,), generator=g)
        mask = torch.arange(k_len).view(1, 1, 1, k_len) < lengths.view(b, 1, 1, 1)
        kwargs["key_padding_mask"] = ~mask[:, 0, 0, :]
    elif masking == "causal":
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        mask[:, 0] = True
        kwargs["attn_mask"] = ~mask
    with torch.no_grad():
        expected = theirs(query, key, value, need_weights=False, **kwargs)[0]
        _assert_close(ours(query, key, value, mask), expected, dtype)


def test_float64_agrees_to_1e6_with_masks():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        b, heads, d_head, q_len, k_len = torch.randint(1, 8, (5,), generator=g).tolist()
        s = dict(heads=heads, d_head=d_head, bias=seed % 3 != 0, seed=seed, dtype=torch.float64)
        theirs, ours, g = _pair(s)
        query = torch.randn(b, q_len, heads * d_head, generator=g, dtype=torch.float64)
        memory = torch.randn(b, k_len, heads * d_head, generator=g, dtype=torch.float64)
        keep = torch.rand(b, k_len, generator=g) < 0.6
        keep[:, 0] = True
        with torch.no_grad():
            got = ours(query, memory, memory, keep.view(b, 1, 1, k_len))
            expected = theirs(query, memory, memory, key_padding_mask=~keep, need_weights=False)[0]
        assert (got - expected).abs().max() <= 1e-6


def test_gradients_match_pytorch():
    s = dict(heads=3, d_head=4, bias=True, seed=7, dtype=torch.float64)
    theirs, ours, g = _pair(s)
    theirs.train()
    ours.train()
    # Separate query, key and value inputs (k_len != q_len), so that each input's gradient is its own.
    inputs = [torch.randn(2, seq, 12, generator=g, dtype=torch.float64) for seq in (5, 7, 7)]
    upstream = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    ours_in = [x.clone().requires_grad_() for x in inputs]
    theirs_in = [x.clone().requires_grad_() for x in inputs]
    (ours(*ours_in) * upstream).sum().backward()
    (theirs(*theirs_in, need_weights=False)[0] * upstream).sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    q_grad, k_grad, v_grad = theirs.in_proj_weight.grad.chunk(3)
    q_bias, k_bias, v_bias = theirs.in_proj_bias.grad.chunk(3)
    expected = {
        "w_q.weight": q_grad, "w_k.weight": k_grad, "w_v.weight": v_grad, "w_o.weight": theirs.out_proj.weight.grad,
        "w_q.bias": q_bias, "w_k.bias": k_bias, "w_v.bias": v_bias, "w_o.bias": theirs.out_proj.bias.grad,
    }
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-9, msg=name)
    for name, a, b in zip(("query", "key", "value"), ours_in, theirs_in, strict=True):
        assert a.grad.abs().max() > 0
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=f"gradient of the {name}")


def test_from_torch_copies_a_sequence_first_module_whose_inputs_are_transposed():
    g = torch.Generator().manual_seed(5)
    theirs = nn.MultiheadAttention(12, 3, dtype=torch.float64).eval()  # batch_first=False: (seq, batch, d_model)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / 4)
    ours = from_torch(theirs).eval()
    x, memory = torch.randn(2, 5, 12, generator=g, dtype=torch.float64), torch.randn(2, 7, 12, generator=g,
                                                                                      dtype=torch.float64)
    with torch.no_grad():
        expected = theirs(x.transpose(0, 1), memory.transpose(0, 1), memory.transpose(0, 1), need_weights=False)[0]
        torch.testing.assert_close(ours(x, memory, memory), expected.transpose(0, 1), rtol=1e-9, atol=1e-9)
    assert "batch_first" in from_torch.__doc__


def test_split_and_merge_heads():
    g = torch.Generator().manual_seed(0)
    for b, seq, heads, d_head in ((2, 5, 3, 4), (1, 1, 1, 7), (3, 6, 4, 2)):
        x = torch.randn(b, seq, heads * d_head, generator=g)
        split = split_heads(x, heads)
        assert torch.equal(split, x.view(b, seq, heads, d_head).transpose(1, 2))
        # Head h holds the contiguous block of features h * d_head ... (h + 1) * d_head - 1.
        assert torch.equal(split[:, 1 % heads], x[..., (1 % heads) * d_head:(1 % heads + 1) * d_head])
        assert torch.equal(merge_heads(split), x)


def test_concat_then_project_is_the_sum_of_per_head_projections():
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3).eval()
    heads_out = torch.randn(2, 3, 5, 4)
    concat_then_project = mha.w_o(merge_heads(heads_out))
    w_o_blocks = mha.w_o.weight.view(12, 3, 4)  # (d_model, heads, d_head): head h's columns
    per_head = sum(heads_out[:, h] @ w_o_blocks[:, h].T for h in range(3)) + mha.w_o.bias
    torch.testing.assert_close(concat_then_project, per_head)


def test_one_big_projection_is_h_small_ones():
    torch.manual_seed(1)
    mha = MultiHeadAttention(12, 3).eval()
    x = torch.randn(2, 5, 12)
    q = split_heads(mha.w_q(x), 3)
    for h in range(3):
        rows = slice(4 * h, 4 * h + 4)
        torch.testing.assert_close(q[:, h], x @ mha.w_q.weight[rows].T + mha.w_q.bias[rows])


def test_dropout_acts_on_weights_only_in_training():
    torch.manual_seed(2)
    x = torch.randn(2, 5, 12)
    mha = MultiHeadAttention(12, 3, dropout=1.0)
    plain = MultiHeadAttention(12, 3)
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(mha.eval()(x, x, x), plain.eval()(x, x, x))
    mha.train()
    torch.testing.assert_close(mha(x, x, x), mha.w_o.bias.expand(2, 5, 12))
    half = MultiHeadAttention(12, 3, dropout=0.5).train()
    torch.manual_seed(3)
    got = half(x, x, x)
    # The same dropout mask, drawn from the same seed, applied to independently computed weights.
    torch.manual_seed(3)
    q, k, v = (w(x).view(2, 5, 3, 4).transpose(1, 2) for w in (half.w_q, half.w_k, half.w_v))
    weights = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)
    dropped = nn.functional.dropout(weights, 0.5, training=True)
    expected = half.w_o((dropped @ v).transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, half.eval()(x, x, x))


def _forward_recomputing_the_sum(mha, query, key, value, mask=None):
    """The forward pass as it was before chapter 01's attention took the dropout: the weighted sum taken again here,
    with mha.dropout applied to the weights that the attention returns."""
    q, k, v = (split_heads(w(x), mha.heads) for w, x in ((mha.w_q, query), (mha.w_k, key), (mha.w_v, value)))
    _, weights = stepformer.attention.scaled_dot_product_attention(q, k, v, mask)
    return mha.w_o(merge_heads(mha.dropout(weights) @ v))


@pytest.mark.parametrize("training", [False, True])
def test_passing_dropout_to_the_attention_changes_nothing_from_the_same_random_state(training):
    torch.manual_seed(6)
    mha = MultiHeadAttention(12, 3, dropout=0.4).train(training)
    x, memory = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    padding = torch.tensor([[True] * 7, [True] * 4 + [False] * 3]).view(2, 1, 1, 7)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for query, key, mask in ((x, x, None), (x, x, causal), (x, memory, padding)):
        torch.manual_seed(7)
        got = mha(query, key, key, mask)
        torch.manual_seed(7)
        expected = _forward_recomputing_the_sum(mha, query, key, key, mask)
        assert torch.equal(got, expected)
    # And PyTorch's module, from the same seed, drops the same weights.
    reference = nn.MultiheadAttention(12, 3, dropout=0.4, batch_first=True).train(training)
    ours = from_torch(reference).train(training)
    for need_weights in (False, True):
        torch.manual_seed(8)
        got = ours(x, memory, memory)
        torch.manual_seed(8)
        _assert_close(got, reference(x, memory, memory, need_weights=need_weights)[0], torch.float32)


def test_parameter_count():
    for d_model, heads, bias in ((12, 3, True), (12, 4, True), (12, 1, False), (512, 8, True)):
        expected = sum(p.numel() for p in nn.MultiheadAttention(d_model, heads, bias=bias).parameters())
        assert count_parameters(d_model, heads, bias) == expected == 4 * d_model**2 + 4 * d_model * bias


def test_bad_heads_and_unsupported_pytorch_modules_are_refused():
    with pytest.raises(ValueError, match="multiple of heads"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="multiple of heads"):
        MultiHeadAttention(12, 0)
    with pytest.raises(ValueError, match="supported"):
        from_torch(nn.MultiheadAttention(12, 3, kdim=5, vdim=5))
    with pytest.raises(ValueError, match="supported"):
        from_torch(nn.MultiheadAttention(12, 3, add_bias_kv=True))


@pytest.mark.parametrize(
    ("shapes", "mask_shape", "axis"),
    [
        (((2, 5, 12), (2, 7, 8), (2, 7, 8)), None, "d_model"),
        (((2, 5, 12), (2, 7, 12), (2, 6, 12)), None, "k_len"),
        (((2, 5, 12), (3, 7, 12), (3, 7, 12)), None, "batch"),
    ],
)
def test_wrong_shapes_fail_naming_the_axis(shapes, mask_shape, axis):
    mha = MultiHeadAttention(12, 3)
    with pytest.raises(TypeCheckError, match=rf"{axis}="):
        mha(*(torch.randn(s) for s in shapes))


def test_wrong_masks_are_refused():
    mha = MultiHeadAttention(12, 3)
    x, memory = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    for bad in (torch.ones(5, 5, dtype=torch.bool), torch.ones(2, 5, 7, dtype=torch.bool), torch.ones(5, 7)):
        with pytest.raises(TypeCheckError, match="mask"):
            mha(x, memory, memory, bad)
    with pytest.raises(EinopsError, match="can't divide"):
        split_heads(torch.randn(2, 5, 12), 5)


# -- the checks ------------------------------------------------------------------------------

student = student_copy(stepformer.multihead)
# The notebook gives students chapter 01's attention as their own code, not the library's.
student.scaled_dot_product_attention = student_copy(stepformer.attention).scaled_dot_product_attention

MODULE_CHECKS = [check_mha_init, check_mha_self_attention, check_mha_cross_attention]


class Stub(nn.Module):
    def __init__(self, d_model, heads, bias=True, dropout=0.0):
        raise NotImplementedError()


def stub(*args, **kwargs):
    raise NotImplementedError()


class Attention(nn.Module):
    """A standalone multi-head attention with switches for the usual mistakes (not the library's code)."""

    mistake: str = ""

    def __init__(self, d_model, heads, bias=True, dropout=0.0):
        super().__init__()
        if (heads < 1 or d_model % heads) and self.mistake != "no validation":
            raise ValueError("d_model must be a multiple of heads")
        self.heads = heads
        width = d_model // heads if self.mistake == "per-head width" else d_model
        self.w_q = nn.Linear(d_model, width, bias=bias)
        self.w_k = nn.Linear(d_model, width, bias=bias)
        self.w_v = nn.Linear(d_model, width, bias=bias)
        self.w_o = nn.Linear(width, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None, cache=None):
        b, heads = query.shape[0], self.heads
        order = (0, 3, 1, 2) if self.mistake == "split d_head heads" else (0, 2, 1, 3)

        def split(x):
            d = x.shape[-1] // heads
            shape = (b, x.shape[1], d, heads) if self.mistake == "split d_head heads" else (b, x.shape[1], heads, d)
            return x.reshape(shape).permute(order)

        q = split(self.w_q(query))
        k = split((self.w_q if self.mistake == "keys with w_q" else self.w_k)(key))
        v = split(self.w_v(key if self.mistake == "key as value" else value))
        if cache is not None:
            k, v = cache.update(k, v)
        scale = math.sqrt(query.shape[-1] if self.mistake == "sqrt(d_model)" else q.shape[-1])
        scores = q @ k.transpose(-2, -1) / scale
        if mask is not None and self.mistake == "padding row only" and mask.dim() == 4:
            mask = mask[:, 0, 0, :][:, None, None, :]  # every 4-D mask read as a padding mask
        if mask is not None and self.mistake != "ignores mask":
            scores = scores.masked_fill(~mask, -math.inf)
        weights = torch.softmax(scores, dim=-1)
        if self.mistake == "dropout through F":
            weights = nn.functional.dropout(weights, self.dropout.p, self.training)
        elif self.mistake == "dropout on values":
            v = self.dropout(v)
        elif self.mistake not in ("no dropout", "dropout on merged heads"):
            weights = self.dropout(weights)
        out = weights @ v  # (b, heads, q_len, d_head)
        if self.mistake == "squeeze heads":
            out = out.squeeze()  # meant for nothing in particular; with heads=1 the heads axis goes
            return self.w_o(torch.cat(out.unbind(1), dim=-1))
        if self.mistake in ("merge d_head heads", "split d_head heads"):
            concat = out.permute(0, 2, 3, 1).reshape(b, out.shape[2], -1)
        else:
            concat = out.transpose(1, 2).reshape(b, out.shape[2], -1)
        if self.mistake == "squeeze merged":
            concat = concat.squeeze()  # with batch=1 the batch axis goes too
        if self.mistake == "dropout on merged heads":
            concat = self.dropout(concat)
        if self.mistake == "w_o by hand":
            return concat @ self.w_o.weight.T + self.w_o.bias
        return concat if self.mistake == "no w_o" else self.w_o(concat)


def mistake(name):
    return type(name.replace(" ", "_"), (Attention,), {"mistake": name})


@pytest.mark.parametrize("check", MODULE_CHECKS)
def test_module_checks_pass_on_the_solution(check, capsys):
    check(student.MultiHeadAttention)
    check(student.MultiHeadAttention, seed=17)
    check(Attention, seed=5)
    assert "✔" in capsys.readouterr().out


def test_module_checks_pass_in_float64():
    check_mha_self_attention(student.MultiHeadAttention, seed=3, dtype=torch.float64)
    check_mha_cross_attention(student.MultiHeadAttention, seed=4, dtype=torch.float64)


@pytest.mark.parametrize("check", MODULE_CHECKS)
def test_module_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(Stub)


@pytest.mark.parametrize(
    ("check", "name", "message"),
    [
        (check_mha_self_attention, "merge d_head heads", r"merged the heads as \(d_head heads\)"),
        (check_mha_self_attention, "split d_head heads", r"split and merged d_model as \(d_head heads\)"),
        (check_mha_self_attention, "no w_o", "without the output projection"),
        (check_mha_self_attention, "sqrt(d_model)", r"scaled the scores by sqrt\(d_model\)"),
        (check_mha_self_attention, "keys with w_q", "projected the keys with w_q"),
        (check_mha_self_attention, "ignores mask", "ignores the mask"),
        (check_mha_self_attention, "no dropout", "ignores dropout"),
        (check_mha_cross_attention, "key as value", "took the values from `key`"),
        (check_mha_cross_attention, "sqrt(d_model)", r"sqrt\(d_model\)"),
        (check_mha_init, "no validation", "should raise a ValueError"),
        (check_mha_init, "per-head width", r"should be \(\d+, \d+\)"),
        # Gap 11: with p = 1 only, dropout on the values or on the merged heads also left w_o's bias alone.
        (check_mha_self_attention, "dropout on values",
         r"known half of the attention weights.*largest difference .* on sizes batch=2, heads=3, q_len=5, k_len=5, "
         r"d_head=4, d_model=12\)\. self\.dropout was applied to a tensor of shape \(2, 3, 5, 4\), not to the "
         r"attention weights"),
        (check_mha_self_attention, "dropout on merged heads", r"applied to a tensor of shape \(2, 5, 12\)"),
        (check_mha_self_attention, "dropout through F", "never calls self.dropout"),
        # Gap 29: every 4-D mask was a padding mask, so reading mask[:, 0, 0, :] passed.
        (check_mha_self_attention, "padding row only",
         r"per-head mask \(batch, heads, q_len, k_len\).*reads one row of the mask, mask\[:, 0, 0, :\]"),
        # Gap 18: the forward pass never ran with bias=False.
        (check_mha_self_attention, "w_o by hand",
         r"For self-attention with bias=False .* raised TypeError.*\.bias is None: apply the layers"),
        # Gap 19: no size was ever 1.
        (check_mha_self_attention, "squeeze merged",
         r"should have shape \(batch=1, q_len=5, d_model=12\), got \(5, 12\): the axes of size 1 are gone"),
        (check_mha_cross_attention, "squeeze merged", "squeeze"),
        (check_mha_self_attention, "squeeze heads",
         r"For self-attention with (batch|heads)=1 and a padding mask: .* raised"),
        (check_mha_cross_attention, "squeeze heads", r"For cross-attention with (batch|heads)=1"),
        # Section 3: the sizes and the largest difference, a named mistake included.
        (check_mha_cross_attention, "key as value",
         r"\(largest difference .* on sizes batch=2, heads=3, q_len=5, k_len=7, d_head=4, d_model=12\)\. You took "
         r"the values from `key`"),
    ],
)
def test_module_checks_name_the_mistake(check, name, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake(name))


def test_split_and_merge_checks():
    for seed in (0, 9):
        check_split_heads(student.split_heads, seed=seed)
        check_merge_heads(student.merge_heads, seed=seed, dtype=torch.float64)
    for check in (check_split_heads, check_merge_heads):
        with pytest.raises(CheckFailure, match="not implemented yet"):
            check(stub)

    def split_d_head_heads(x, heads):
        return x.reshape(*x.shape[:2], -1, heads).permute(0, 3, 1, 2)

    def merge_d_head_heads(x):
        return x.permute(0, 2, 3, 1).flatten(2)

    def split_without_moving_heads(x, heads):
        return x.reshape(*x.shape[:2], heads, -1)

    def merge_float32(x):
        return x.transpose(1, 2).flatten(2).float()

    with pytest.raises(CheckFailure, match=r"read d_model as \(d_head heads\)"):
        check_split_heads(split_d_head_heads)
    with pytest.raises(CheckFailure, match=r"merged the heads as \(d_head heads\)"):
        check_merge_heads(merge_d_head_heads)
    with pytest.raises(CheckFailure, match=r"shape \(batch=2, heads=3, seq=5, d_head=4\)"):
        check_split_heads(split_without_moving_heads)
    # Section 3 and gap 19: the sizes and the largest difference; batch=1 and heads=1 kept.
    with pytest.raises(CheckFailure, match=r"interleaves them.*\(largest difference .* on sizes batch=2, heads=3, "
                                           r"seq=5, d_head=4\)"):
        check_merge_heads(merge_d_head_heads)

    def split_squeezed(x, heads):
        return x.reshape(*x.shape[:2], heads, -1).transpose(1, 2).squeeze()

    def merge_squeezed(x):
        return x.transpose(1, 2).flatten(2).squeeze()

    with pytest.raises(CheckFailure, match=r"shape \(batch=1, heads=3, seq=5, d_head=4\).*squeeze\(\)"):
        check_split_heads(split_squeezed)
    with pytest.raises(CheckFailure, match=r"shape \(batch=1, seq=5, d_model=12\).*squeeze\(\)"):
        check_merge_heads(merge_squeezed)
    with pytest.raises(CheckFailure, match="dtype"):
        check_merge_heads(merge_float32, dtype=torch.float64)


def test_parameter_count_check():
    check_parameter_count(student.count_parameters)
    check_parameter_count(student.count_parameters, seed=23)
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_parameter_count(stub)

    def weights_only(d_model, heads, bias=True):
        return 4 * d_model * d_model

    def per_head(d_model, heads, bias=True):
        return 4 * d_model * (d_model // heads) + 4 * (d_model // heads) * bias

    def as_tensor(d_model, heads, bias=True):
        return torch.tensor(4 * d_model * d_model + 4 * d_model * bias)

    for wrong, message in ((weights_only, "weights only"), (per_head, "not to one head's d_head"),
                           (as_tensor, "Python int")):
        with pytest.raises(CheckFailure, match=message):
            check_parameter_count(wrong)


def test_sizes_are_pairwise_distinct_for_every_seed():
    from stepformer.checks.multihead import _sizes

    for seed in range(50):
        sizes = list(_sizes(seed).values())
        assert len(set(sizes)) == len(sizes)


class UsesPyTorch(nn.Module):
    def __init__(self, d_model, heads, bias=True, dropout=0.0):
        super().__init__()
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model, bias=bias) for _ in range(4))
        self.heads = heads

    def forward(self, query, key, value, mask=None):
        inner = nn.MultiheadAttention(query.shape[-1], self.heads, batch_first=True, dtype=query.dtype)
        return inner(query, key, value, need_weights=False)[0]


def test_using_the_reference_is_not_own_work():
    for cheat in (UsesPyTorch, stepformer.multihead.MultiHeadAttention):
        with pytest.raises(CheckFailure, match="Not your own work"):
            check_mha_self_attention(cheat)


def test_replay_of_a_module_check_needs_no_module(monkeypatch, tmp_path):
    for folder, cls in ((tmp_path / "right", student.MultiHeadAttention), (tmp_path / "wrong", mistake("no w_o"))):
        monkeypatch.setenv(RECORD_ENV, str(folder))
        try:
            check_mha_cross_attention(cls, seed=2)
        except CheckFailure:
            pass
        monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path / "right"):
        check_mha_cross_attention(object(), seed=2)  # the object is never touched
    with replaying(tmp_path / "wrong"), pytest.raises(CheckFailure, match="without the output projection"):
        check_mha_cross_attention(object(), seed=2)


# -- diagnoses verified on the library's code with one edit ----------------------------------

def _edited(*edits):
    """stepformer.multihead with each ``(old, new)`` replaced once, loaded under another name (a student's copy),
    with chapter 01's attention as the notebook hands it over."""
    source = Path(stepformer.multihead.__file__).read_text()
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    copy = types.ModuleType("student_edited_multihead")
    copy.__file__ = stepformer.multihead.__file__
    sys.modules[copy.__name__] = copy
    exec(compile(source, copy.__file__, "exec"), copy.__dict__)  # noqa: S102 - the test's own edited source
    copy.scaled_dot_product_attention = student.scaled_dot_product_attention
    return copy


@pytest.mark.parametrize("edit", [("heads < 1 or d_model % heads != 0", "d_model % heads != 0"),
                                  ("heads < 1 or", "heads < 0 or")])
def test_init_check_refuses_zero_heads_and_names_the_division(edit):
    with pytest.raises(CheckFailure, match=r"MultiHeadAttention\(\d+, 0\) should raise a ValueError.*divides by heads"):
        check_mha_init(_edited(edit).MultiHeadAttention)


def test_init_check_does_not_blame_a_division_when_zero_heads_is_accepted():
    edits = [("heads < 1 or d_model % heads != 0", "heads != 0 and d_model % heads != 0")]
    with pytest.raises(CheckFailure, match=r"should raise a ValueError.*it raised no error\.$"):
        check_mha_init(_edited(*edits).MultiHeadAttention)


ATTEND = "heads_out, _ = scaled_dot_product_attention(q, k, v, mask, self.dropout)"
# The weighted sum written out by a student, as the chapter's module did before chapter 01's attention took the dropout.
WEIGHTED_SUM = ('_, weights = scaled_dot_product_attention(q, k, v, mask)\n        heads_out = einsum('
                'self.dropout(weights), v, "batch heads q_len k_len, batch heads k_len d_head -> {order}")')


@pytest.mark.parametrize(("order", "named"), [("heads batch q_len d_head", "(heads, batch, q_len, d_head)"),
                                              ("batch heads d_head q_len", "(batch, heads, d_head, q_len)"),
                                              ("batch q_len heads d_head", "(batch, q_len, heads, d_head)")])
def test_self_attention_check_names_the_order_of_the_heads_outputs(order, named):
    edits = [("from einops import rearrange", "from einops import einsum, rearrange"),
             (ATTEND, WEIGHTED_SUM.format(order=order))]
    with pytest.raises(CheckFailure, match="mat1 and mat2 shapes cannot be multiplied") as failure:
        check_mha_self_attention(_edited(*edits).MultiHeadAttention)
    assert f"in the order {named} instead of (batch, heads, q_len, d_head)" in str(failure.value)


def test_a_forward_that_takes_the_weighted_sum_itself_from_the_weights_returned_passes():
    # The weights chapter 01's attention returns are those before dropout, so the earlier way stays right.
    edits = [("from einops import rearrange", "from einops import einsum, rearrange"),
             (ATTEND, WEIGHTED_SUM.format(order="batch heads q_len d_head"))]
    check_mha_self_attention(_edited(*edits).MultiHeadAttention)


def test_a_crash_after_w_o_is_not_blamed_on_the_order_of_the_heads():
    edits = [("return self.w_o(merge_heads(heads_out))", "return self.w_o(merge_heads(heads_out))[:, :, :, None]")]
    with pytest.raises(CheckFailure) as failure:
        check_mha_self_attention(_edited(*edits).MultiHeadAttention)
    assert "in the order" not in str(failure.value)


# -- the cache (chapter 09's KVCache): MultiHeadAttention attends over what cache.update gives back --------

def test_a_cache_makes_step_by_step_decoding_equal_one_causal_pass():
    from stepformer.decoding import cached_self_attention
    from stepformer.kvcache import KVCache
    from stepformer.masks import causal_mask

    torch.manual_seed(4)
    mha = MultiHeadAttention(12, 3).double().eval()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    full = mha(x, x, x, causal_mask(9))
    cache = KVCache()
    steps = [mha(x[:, :4], x[:, :4], x[:, :4], causal_mask(4), cache=cache)]  # a prefill, then one at a time
    steps += [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    # Chapter 09's written-out step computes the same thing.
    written = KVCache()
    out = torch.cat([cached_self_attention(mha, x[:, :t], written) for t in (4, 5, 6, 7, 8, 9)], dim=1)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    # A fixed cache (cross-attention) keeps the first memory, whatever later calls pass.
    memory, other = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 6, 12, dtype=torch.float64)
    fixed = KVCache(fixed=True)
    first = mha(x[:, :1], memory, memory, cache=fixed)
    later = mha(x[:, 1:2], other, other, cache=fixed)
    torch.testing.assert_close(torch.cat([first, later], dim=1), mha(x[:, :2], memory, memory), rtol=0, atol=1e-12)


def _cached_mistake(how):
    class Mistaken(student.MultiHeadAttention):
        def forward(self, query, key, value, mask=None, cache=None):
            q = student.split_heads(self.w_q(query), self.heads)
            k, v = self.w_k(key), self.w_v(value)
            if how == "before split" and cache is not None:
                k, v = cache.update(k, v)
            k, v = student.split_heads(k, self.heads), student.split_heads(v, self.heads)
            if how == "result ignored" and cache is not None:
                cache.update(k, v)
            _, weights = student.scaled_dot_product_attention(q, k, v, mask)
            return self.w_o(student.merge_heads(self.dropout(weights) @ v))
    return Mistaken


@pytest.mark.parametrize(("how", "message"), [
    ("ignored", r"your output is the attention over the new positions alone: your forward never calls "
                r"cache.update"),
    ("result ignored", "calls cache.update but attends over this call's keys and values only"),
    ("before split", r"called cache.update with keys of shape \(\d+, 1, \d+\); the cache keeps \(batch, heads, "
                     r"k_len, d_head\)"),
])
def test_self_attention_check_names_what_a_cache_was_not_given(how, message):
    with pytest.raises(CheckFailure, match=message):
        check_mha_self_attention(_cached_mistake(how))
