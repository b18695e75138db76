"""Chapter 13: the online softmax, tiled attention forward and backward, checkpointing, windows and sinks.

The oracles are PyTorch's: ``torch.softmax``, ``torch.logsumexp``, ``F.scaled_dot_product_attention``,
autograd through it, ``torch.autograd.gradcheck``; the memory claims are held against bytes counted.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import stepformer.scale as scale
from stepformer.encoder import build_encoder
from stepformer.masks import causal_mask
from stepformer.scale import (
    LiveBytes,
    causal_block_visits,
    checkpointed_encoder,
    flash_attention,
    kept_positions,
    online_softmax,
    sliding_window_mask,
    tile_step,
    tiled_attention,
    window_cache_bytes,
)
from tests.fixtures.student import failure_of


def sizes(seed: int) -> tuple[torch.Generator, int, int, int, int, int, int]:
    """A generator and random (batch, heads, q_len, k_len, d_k, d_v), k_len >= q_len so causal fits."""
    g = torch.Generator().manual_seed(seed)
    batch, heads = (int(torch.randint(1, 4, (1,), generator=g)) for _ in range(2))
    q_len = int(torch.randint(1, 40, (1,), generator=g))
    k_len = q_len + int(torch.randint(0, 20, (1,), generator=g))
    d_k, d_v = (int(torch.randint(1, 17, (1,), generator=g)) for _ in range(2))
    return g, batch, heads, q_len, k_len, d_k, d_v


def qkv(seed: int, dtype=torch.float64):
    g, batch, heads, q_len, k_len, d_k, d_v = sizes(seed)
    q = torch.randn(batch, heads, q_len, d_k, generator=g, dtype=dtype)
    k = torch.randn(batch, heads, k_len, d_k, generator=g, dtype=dtype)
    v = torch.randn(batch, heads, k_len, d_v, generator=g, dtype=dtype)
    return g, q, k, v


def masks(g: torch.Generator, batch: int, q_len: int, k_len: int) -> dict[str, torch.Tensor | None]:
    """No mask, a random one with a fully masked row, a padding mask, a 2-D one that broadcasts."""
    random = torch.rand(batch, 1, q_len, k_len, generator=g) > 0.4
    random[0, 0, int(torch.randint(0, q_len, (1,), generator=g))] = False
    lengths = torch.randint(1, k_len + 1, (batch,), generator=g)
    padding = (torch.arange(k_len)[None, :] < lengths[:, None])[:, None, None, :]
    return {"none": None, "random": random, "padding": padding, "two-d": torch.rand(q_len, k_len, generator=g) > 0.5}


def blocks(g: torch.Generator) -> tuple[int, int]:
    return int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))


def reference(q, k, v, mask, causal):
    """PyTorch's fused attention; the scaled scores' log-sum-exp with torch.logsumexp."""
    if causal:
        mask = causal_mask(q.shape[-2], k.shape[-2]) if mask is None else mask & causal_mask(q.shape[-2], k.shape[-2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return out, torch.logsumexp(scores, dim=-1)


# -- the online softmax -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_the_online_softmax_is_softmax_including_masked_and_fully_masked_rows(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows, n = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 50, (1,), generator=g))
    scores = torch.randn(3, rows, n, generator=g, dtype=torch.float64) * 10
    scores = scores.masked_fill(torch.rand(3, rows, n, generator=g) < 0.3, -math.inf)
    scores[0, 0] = -math.inf  # a fully masked row: zeros, as chapter 01's attention gives
    scores[-1, -1, :] = torch.tensor(700.0, dtype=torch.float64)  # exp(700) alone would overflow float32
    for block in (1, 3, n, n + 5):
        weights = online_softmax(scores, block)
        assert torch.allclose(weights, torch.softmax(scores, dim=-1).nan_to_num(0.0), atol=1e-12)
        assert torch.equal(weights[0, 0], torch.zeros(n, dtype=torch.float64))
    assert torch.isfinite(online_softmax(scores.float(), 4)).all()
    with pytest.raises(ValueError, match="block"):
        online_softmax(scores, 0)


def test_a_tile_step_folds_a_block_into_the_state_and_two_steps_equal_one_over_both_blocks() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 9, 3, generator=g, dtype=torch.float64)
    allowed = torch.rand(2, 5, 9, generator=g) > 0.3
    start = (torch.full((2, 5), -math.inf, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64),
             torch.zeros(2, 5, 3, dtype=torch.float64))
    whole = tile_step(q, k, v, allowed, *start)
    first = tile_step(q, k[:, :4], v[:, :4], allowed[..., :4], *start)
    halves = tile_step(q, k[:, 4:], v[:, 4:], allowed[..., 4:], *first)
    for one, two in zip(whole, halves, strict=True):
        assert torch.allclose(one, two, atol=1e-12)
    scores = (q @ k.transpose(-1, -2) / 2).masked_fill(~allowed, -math.inf)
    row_max, row_sum, out = whole
    assert torch.allclose(row_max, scores.amax(-1))
    assert torch.allclose(row_sum, torch.exp(scores - row_max[..., None]).sum(-1))
    assert torch.allclose(out / row_sum[..., None], torch.softmax(scores, -1) @ v, atol=1e-12)


# -- which blocks a causal attention visits ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_causal_block_visits_are_the_blocks_where_the_causal_mask_has_a_true(seed: int) -> None:
    g, _, _, q_len, k_len, _, _ = sizes(seed)
    block_q, block_k = blocks(g)
    visits = causal_block_visits(q_len, k_len, block_q, block_k)
    mask = causal_mask(q_len, k_len)
    expected = torch.tensor([[bool(mask[a:a + block_q, b:b + block_k].any()) for b in range(0, k_len, block_k)]
                             for a in range(0, q_len, block_q)])
    assert torch.equal(visits, expected)


def test_a_square_causal_attention_skips_about_half_of_its_blocks_and_of_its_flops(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(scale, "tile_step", lambda *args: calls.append(1) or tile_step(*args))
    q = torch.randn(1, 1, 256, 16)
    tiled_attention(q, q, q, causal=True, block_q=32, block_k=32)
    assert len(calls) == int(causal_block_visits(256, 256, 32, 32).sum()) == 8 * 9 // 2
    with FlopCounterMode(display=False) as full:
        tiled_attention(q, q, q, block_q=32, block_k=32)
    with FlopCounterMode(display=False) as causal:
        tiled_attention(q, q, q, causal=True, block_q=32, block_k=32)
    assert causal.get_total_flops() == full.get_total_flops() * 36 // 64


def test_bad_block_sizes_and_causal_shapes_are_refused() -> None:
    q = torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match="block"):
        tiled_attention(q, q, q, block_q=0)
    with pytest.raises(ValueError, match="k_len"):
        tiled_attention(q, q[:, :3], q[:, :3], causal=True)
    with pytest.raises(ValueError, match="k_len"):
        causal_block_visits(5, 3, 2, 2)
    with pytest.raises(ValueError, match="block"):
        flash_attention(q, q, q, block_k=-1)


# -- tiled attention, forward ------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_tiled_attention_equals_pytorchs_attention_and_its_log_sum_exp(seed: int, causal: bool) -> None:
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        g, q, k, v = qkv(seed, dtype)
        block_q, block_k = blocks(g)
        for name, mask in masks(g, q.shape[0], q.shape[-2], k.shape[-2]).items():
            out, lse = tiled_attention(q, k, v, mask, causal, block_q, block_k)
            expected_out, expected_lse = reference(q, k, v, mask, causal)
            assert torch.allclose(out, expected_out, atol=tolerance), (name, block_q, block_k)
            assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse)), name
            assert torch.allclose(lse.nan_to_num(neginf=0.0), expected_lse.nan_to_num(neginf=0.0), atol=tolerance)


def test_a_query_that_reads_no_key_gets_zeros_and_a_log_sum_exp_of_minus_infinity() -> None:
    q = torch.randn(2, 6, 4)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    out, lse = tiled_attention(q, q, q, mask, block_q=4, block_k=4)
    assert torch.equal(out[:, 2], torch.zeros(2, 4)) and torch.isneginf(lse[:, 2]).all()
    assert torch.isfinite(out).all()


# -- tiled attention, backward by recomputation -------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_flash_attentions_gradients_pass_gradcheck_in_float64(seed: int, causal: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    q_len, extra, d_k, d_v = (int(torch.randint(1, 7, (1,), generator=g)) for _ in range(4))
    q = torch.randn(2, q_len, d_k, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, q_len + extra, d_k, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, q_len + extra, d_v, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, q_len, q_len + extra, generator=g) > 0.3
    mask[0, 0] = False  # a fully masked row: its gradients are zero, never NaN
    block_q, block_k = (int(torch.randint(2, 5, (1,), generator=g)) for _ in range(2))
    for m in (None, mask):
        def attention(a, b, c, m=m):
            return flash_attention(a, b, c, m, causal, block_q, block_k)

        assert torch.autograd.gradcheck(attention, (q, k, v))


@pytest.mark.parametrize("seed", range(4))
def test_flash_attentions_gradients_equal_autograds_through_pytorchs_attention(seed: int) -> None:
    g, q, k, v = qkv(seed, torch.float32)
    block_q, block_k = blocks(g)
    for causal in (False, True):
        for name, mask in masks(g, q.shape[0], q.shape[-2], k.shape[-2]).items():
            grad = torch.randn(*q.shape[:-1], v.shape[-1], generator=g)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            flash_attention(*inputs, mask, causal, block_q, block_k).backward(grad)
            expected = [t.clone().requires_grad_() for t in (q, k, v)]
            reference(*expected, mask, causal)[0].backward(grad)
            for ours, theirs in zip(inputs, expected, strict=True):
                assert torch.allclose(ours.grad, theirs.grad, atol=1e-4), (name, causal)


# -- memory, counted --------------------------------------------------------------------------------------

def test_live_bytes_counts_each_storage_once_and_forgets_it_when_freed() -> None:
    made_before = torch.randn(300, 300)
    with LiveBytes() as live:
        made_before.t(), made_before[:10], made_before.view(-1), made_before.mul_(2)  # views and in place: nothing new
        assert live.now == live.peak == 0
        made_before.sum()  # a new (scalar) tensor, freed at once
    assert live.peak == 4 and live.now == 0
    with LiveBytes() as live:
        x = torch.zeros(1000)  # 4000 bytes
        views = [x[:10], x.view(10, 100)]
        y = torch.ones(500)  # 2000 bytes
        del x
        assert live.now == 6000  # the views keep x's storage alive
        del views, y
    assert live.peak == 6000 and live.now == 0


def test_tiled_attention_never_holds_a_score_matrix_and_its_memory_grows_linearly() -> None:
    peaks = {}
    for n in (2048, 4096):
        q = torch.randn(1, 1, n, 16)
        with LiveBytes() as naive:
            q @ q.transpose(-1, -2)
        assert naive.peak >= n * n * 4  # the counter sees a score matrix where there is one
        for causal in (False, True):
            with LiveBytes() as tiled:
                tiled_attention(q, q, q, causal=causal, block_q=512, block_k=128)
            assert tiled.peak < n * n * 4 / 8, (n, causal, tiled.peak)
            peaks[n, causal] = tiled.peak
    for causal in (False, True):  # twice the length, at most 2.2 times the memory (a score matrix: 4 times)
        assert peaks[4096, causal] < 2.2 * peaks[2048, causal]


def test_flash_attentions_backward_recomputes_where_autograd_through_the_tiles_stores_them() -> None:
    n = 2048
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    with LiveBytes() as flash:
        flash_attention(q, k, v, causal=True, block_q=128, block_k=128).sum().backward()
    with LiveBytes() as stored:
        tiled_attention(q, k, v, causal=True, block_q=128, block_k=128)[0].sum().backward()
    assert flash.peak < n * n * 4 / 8
    assert stored.peak > n * n * 4 / 2  # the lower triangle of weights, kept block by block for backward


# -- activation checkpointing ------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
def test_a_checkpointed_encoder_gives_the_same_output_and_gradients_with_less_memory(training: bool) -> None:
    torch.manual_seed(0)
    encoder = build_encoder(d_model=32, heads=4, d_ff=64, layers=3, dropout=0.2).train(training)
    x = torch.randn(2, 50, 32)
    mask = (torch.arange(50) < torch.tensor([[50], [31]]))[:, None, None, :]
    results = []
    for run in (lambda h: encoder(h, mask), lambda h: checkpointed_encoder(encoder, h, mask)):
        encoder.zero_grad()
        h = x.clone().requires_grad_()
        torch.manual_seed(1)  # the same dropout masks for both, if checkpointing replays them
        with LiveBytes() as live:
            out = run(h)
            after_forward = live.now
        out.pow(2).sum().backward()
        results.append((out, h.grad, [p.grad.clone() for p in encoder.parameters()], after_forward))
    (plain, plain_grad, plain_params, plain_bytes), (ckpt, ckpt_grad, ckpt_params, ckpt_bytes) = results
    assert torch.allclose(plain, ckpt, atol=1e-6)
    assert torch.allclose(plain_grad, ckpt_grad, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain_params, ckpt_params, strict=True))
    assert ckpt_bytes < plain_bytes / 3, (ckpt_bytes, plain_bytes)


# -- sliding windows and attention sinks -------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_the_sliding_window_mask_is_its_definition(seed: int) -> None:
    g, _, _, q_len, k_len, _, _ = sizes(seed)
    window, sinks = int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
    mask = sliding_window_mask(q_len, window, k_len, sinks)
    for i in range(q_len):
        p = i + k_len - q_len
        assert [bool(x) for x in mask[i]] == [j <= p and (p - j < window or j < sinks) for j in range(k_len)]
    assert torch.equal(sliding_window_mask(q_len, k_len, k_len), causal_mask(q_len, k_len))
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(q_len, 0)


@pytest.mark.parametrize("seed", range(4))
def test_a_new_query_under_a_window_reads_only_the_kept_positions_so_the_cache_can_drop_the_rest(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, 60, (1,), generator=g))
    window, sinks = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 4, length, 8, generator=g), torch.randn(2, 4, length, 8, generator=g)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_window_mask(1, window, length, sinks))
    kept = torch.tensor(kept_positions(length, window, sinks))
    assert torch.allclose(F.scaled_dot_product_attention(q, k[..., kept, :], v[..., kept, :]), masked, atol=1e-6)
    kept_cache = [k[..., kept, :], v[..., kept, :]]  # one layer, 4 key/value heads of 8, batch 2
    assert window_cache_bytes(1, 4, 8, length, window, sinks, batch=2) == sum(t.nbytes for t in kept_cache)
    assert window_cache_bytes(4, 4, 8, 100_000, window, sinks) == window_cache_bytes(4, 4, 8, 1_000, window, sinks)


# -- the checks' diagnoses: each fires on its mistake, and not on a similar one -------------------------------

def edited(name: str, *edits: tuple[str, str]):
    """The library's ``name`` with its source edited, defined as a student would define it (not the library's)."""
    from tests.fixtures.student import edited as edited_in

    return edited_in(scale, name, *edits)


def test_the_softmax_check_tells_which_blocks_an_online_softmax_fails_on() -> None:
    from stepformer.checks.scale import check_online_softmax_values as check

    past_the_end = failure_of(check, edited("online_softmax", ("shape[-1], block)", "shape[-1] + 1, block)")))
    later_empty = failure_of(check, edited("online_softmax", ("start : start + block]", "start : block]")))
    all_empty = failure_of(check, edited("online_softmax", ("start : start + block]", "start : start]")))
    state = failure_of(check, edited("online_softmax", ("full(scores.shape[:-1]", "full(scores.shape[:-2]")))
    columns = failure_of(check, edited("online_softmax", ("scores.shape[-1], block)", "scores.shape[-2], block)")))
    assert "It fails exactly when block divides n" in past_the_end and "With one block" not in past_the_end
    assert "With one block it is right" in later_empty and "divides n" not in later_empty
    assert "With every block size" in all_empty and "With one block" not in all_empty
    assert "does not have one entry per row" in state and "block" not in state.split("fail:")[-1]
    assert "cover only the first" in columns
    assert failure_of(check, edited("online_softmax")) == "passed"


def test_the_tile_check_probes_a_step_that_raises() -> None:
    from stepformer.checks.scale import check_tile_step_first, check_tile_step_mask

    transposed = failure_of(check_tile_step_first, edited("tile_step", ("einsum(q, k,", "einsum(k, q,")))
    leading = failure_of(check_tile_step_first, edited("tile_step", (
        '"... q_block k_block -> ... q_block", "max"', '"... q_block k_block -> q_block ...", "max"')))
    out = failure_of(check_tile_step_first, edited("tile_step", (
        'k_block d_v -> ... q_block d_v"', 'k_block d_v -> ... d_v q_block"')))
    inverted = failure_of(check_tile_step_first, edited("tile_step", ("if allowed is not", "if allowed is")))
    assert "the scores transposed" in transposed and "out transposed" not in transposed
    assert "with no leading axes, runs and is right" in leading and "transposed" not in leading
    assert "with out transposed" in out and "scores transposed" not in out
    assert "your test of allowed is inverted" in inverted
    ignored = failure_of(check_tile_step_mask, edited("tile_step", ("if allowed is not None:", "if False:")))
    assert "Your step ignores allowed" in ignored and "inverted" not in ignored


def test_the_visits_checks_name_boundary_and_range_slips() -> None:
    from stepformer.checks.scale import check_causal_block_visits_square as check

    strict = failure_of(check, edited("causal_block_visits", ('1 k_blocks") <= rearrange', '1 k_blocks") < rearrange')))
    late_keys = failure_of(check, edited("causal_block_visits", ("torch.arange(0, k_len, block_k)",
                                                                 "torch.arange(1, k_len, block_k)")))
    last_query = failure_of(check, edited("causal_block_visits", ("torch.arange(block_q - 1, q_len",
                                                                  "torch.arange(block_q, q_len")))
    one_more = failure_of(check, edited("causal_block_visits", ("q_len + block_q - 1, block_q",
                                                                "q_len + block_q, block_q")))
    assert "equality included" in strict and "equality included" in late_keys  # the same tiles: both named
    assert "last queries are off by one" in last_query and "equality" not in last_query
    assert "number of query blocks is off by one" in one_more
    inverted = failure_of(check, edited("causal_block_visits", ("if min(q_len", "if not min(q_len")))
    largest = failure_of(check, edited("causal_block_visits", ("if min(q_len", "if max(q_len")))
    zero = failure_of(check, edited("causal_block_visits", ("block_k) < 1:", "block_k) < 0:")))
    assert "your test is inverted" in inverted
    assert "all four below 1" in largest and "lets 0 through" not in largest
    assert "lets 0 through" in zero and "all four" not in zero
    axis = failure_of(check, edited("causal_block_visits", ('"k_blocks -> 1 k_blocks"', '"k_blocks -> k_blocks 1"')))
    assert "lie along the same axis" in axis and "never spreads over" in axis
    assert failure_of(check, edited("causal_block_visits")) == "passed"
