"""stepformer.kvcache and stepformer.decoding: cached decoding equals full recomputation, the memory
formula equals the bytes of the tensors, the paged cache equals the contiguous one; and the chapter's checks."""

import contextlib
import math

import pytest
import torch
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from torch import nn

import stepformer.attention
import stepformer.decoding
import stepformer.kvcache
import stepformer.masks
import stepformer.multihead
from stepformer.checks._core import RECORD_ENV, CheckFailure, replaying
from stepformer.checks.kvcache import (
    _sizes,
    check_cache_formula,
    check_cached_attention,
    check_gather_blocks,
    check_kv_cache_append,
    check_kv_cache_fixed,
    check_projects_new_only,
)
from stepformer.decoding import cached_self_attention, generate_cached
from stepformer.gqa import GroupedQueryAttention, grouped_attention
from stepformer.kvcache import (
    KVCache,
    LayerCache,
    PagedKVCache,
    cache_bytes,
    gather_blocks,
    new_cache,
    paged_attention,
)
from stepformer.masks import causal_mask, padding_mask
from stepformer.multihead import MultiHeadAttention
from stepformer.parts import ModelConfig, configured_transformer
from stepformer.transformer import build_transformer, generate, greedy
from tests.fixtures.student import patched as _patched
from tests.fixtures.student import student_copy

BOS, EOS, PAD = 1, 2, 0


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(positional="sinusoidal", kv_heads=None, dtype=torch.float64, seed=0, heads=4, d_head=2, layers=2,
           dropout=0.1, norm_first=False):
    torch.manual_seed(seed)
    config = ModelConfig.original(29, d_model=heads * d_head, heads=heads, layers=layers, d_ff=20, dropout=dropout,
                                  placement="pre" if norm_first else "post", positions=positional, kv_heads=kv_heads,
                                  src_vocab=23, encoder_layers=2)
    model = configured_transformer(config, pad_id=PAD)
    return model.to(dtype)


def _padded_source(batch=3, src_len=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 23, (batch, src_len), generator=g)
    for b in range(1, batch):  # every sentence but the first ends in padding, each of another length
        src[b, max(1, src_len - 2 * b):] = PAD
    return src


# -- cached decoding == full recomputation --------------------------------------------------

@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cached_logits_equal_uncached_at_every_step(positional, kv_heads):
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        model = _model(positional, kv_heads, dtype)
        src = _padded_source()
        tokens, logits = generate(model, src, 9, BOS, EOS)
        cached_tokens, cached_logits = generate_cached(model, src, 9, BOS, EOS)
        assert torch.equal(tokens, cached_tokens)
        assert logits.shape == cached_logits.shape == (3, tokens.shape[1] - 1, 29)
        assert (logits - cached_logits).abs().max() <= tolerance
        # Both equal teacher forcing on the generated tokens: one parallel pass, every position at once.
        forced = model.eval()(src, tokens[:, :-1])
        alive = tokens[:, :-1] != PAD  # after its EOS a sentence's places are padding, its logits unused
        assert (forced - cached_logits)[alive].abs().max() <= tolerance


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoding_equals_recomputation_with_chapter_03s_own_attention(norm_first):
    """The model of chapters 07 and 08 with their own stacks, every attention chapter 03's MultiHeadAttention:
    chapter 09's cache works through it."""
    torch.manual_seed(1)
    model = build_transformer(23, 29, 8, 4, 2, 2, 20, dropout=0.1, norm_first=norm_first, pad_id=PAD).double()
    attentions = [m for m in model.modules() if hasattr(m, "w_q")]
    assert attentions and all(type(m) is MultiHeadAttention for m in attentions)
    src = _padded_source()
    tokens, logits = generate(model, src, 9, BOS, EOS)
    cached_tokens, cached_logits = generate_cached(model, src, 9, BOS, EOS)
    assert torch.equal(tokens, cached_tokens)
    assert (logits - cached_logits).abs().max() <= 1e-10


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([(4, 4), (4, 2), (6, 3), (6, 1)]),
       st.integers(1, 8), st.booleans(), st.integers(0, 2**16))
def test_cached_decoding_equals_recomputation_on_random_models(batch, layers, heads_kv, src_len, norm_first, seed):
    heads, kv_heads = heads_kv
    model = _model("rope" if seed % 2 else "sinusoidal", kv_heads, seed=seed, heads=heads, d_head=2,
                   layers=layers, norm_first=norm_first)
    src = _padded_source(batch, src_len, seed)
    tokens, logits = generate(model, src, 6, BOS, EOS)
    cached_tokens, cached_logits = generate_cached(model, src, 6, BOS, EOS)
    assert torch.equal(tokens, cached_tokens)
    torch.testing.assert_close(cached_logits, logits, rtol=1e-10, atol=1e-10)


def test_generation_restores_training_mode_and_refuses_zero_tokens():
    model = _model().train()
    generate_cached(model, _padded_source(), 3, BOS, EOS)
    assert model.training
    with pytest.raises(ValueError, match="at least 1"):
        generate_cached(model, _padded_source(), 0, BOS, EOS)


def _decode_keeping_cache(model, src, steps):
    """generate_cached's loop with a cache that the test keeps."""
    cache = new_cache(len(model.decoder.layers))

    def newest_token(tokens, memory, src_mask):
        return model.generator(model.decode(tokens[:, -1:], memory, src_mask, None, cache)[:, -1])

    tokens, _ = greedy(model, src, steps, BOS, -1, newest_token)  # eos -1: never stops early
    return tokens, cache


@pytest.mark.parametrize("kv_heads", [6, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_memory_formula_equals_the_bytes_of_the_caches_after_generation(kv_heads, dtype):
    layers, heads, d_head, steps = 3, 6, 2, 7
    model = _model(kv_heads=kv_heads, dtype=dtype, heads=heads, d_head=d_head, layers=layers, dropout=0.0)
    src = _padded_source(batch=3, src_len=5)
    tokens, cache = _decode_keeping_cache(model, src, steps)
    element = torch.empty((), dtype=dtype).element_size()
    measured = sum(layer.self_attn.keys.nbytes + layer.self_attn.values.nbytes for layer in cache)
    assert measured == sum(layer.self_attn.nbytes for layer in cache)
    assert measured == cache_bytes(layers, kv_heads, d_head, steps, batch=3, bytes_per_element=element)
    assert cache[0].self_attn.keys.shape == (3, kv_heads, steps, d_head)
    # The cross-attention cache holds the source's keys and values once: the same formula over src_len.
    cross = sum(layer.cross_attn.nbytes for layer in cache)
    assert cross == cache_bytes(layers, kv_heads, d_head, src.shape[1], batch=3, bytes_per_element=element)
    assert sum(layer.nbytes for layer in cache) == measured + cross
    assert tokens.shape == (3, steps + 1)


def test_cross_attention_keys_are_computed_once_from_the_memory():
    model = _model(dropout=0.0).eval()
    src = _padded_source()
    calls = []
    model.decoder.layers[0].cross_attn.w_k.register_forward_hook(lambda module, inputs, out: calls.append(inputs[0]))
    tokens, cache = _decode_keeping_cache(model, src, 5)
    assert len(calls) == 1 and calls[0].shape[1] == src.shape[1]
    memory = model.encode(src)
    torch.testing.assert_close(calls[0], memory)
    assert cache[0].cross_attn.fixed and len(cache[0].cross_attn) == src.shape[1]


# -- the cache object --------------------------------------------------------------------------

def test_append_grows_along_the_sequence_axis():
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 3, 9, 4, generator=g) for _ in range(2))
    cache = KVCache()
    assert len(cache) == 0 and cache.nbytes == 0
    done = 0
    for new in (4, 1, 1, 3):
        k, v = cache.append(keys[:, :, done:done + new], values[:, :, done:done + new])
        done += new
        assert torch.equal(k, keys[:, :, :done]) and torch.equal(v, values[:, :, :done])
        assert len(cache) == done
    assert cache.nbytes == 2 * 2 * 3 * 9 * 4 * 4


def test_append_refuses_what_does_not_continue_the_cache():
    cache = KVCache()
    cache.append(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5))
    for shape in ((2, 4, 1, 5), (2, 3, 1, 6), (1, 3, 1, 5)):
        with pytest.raises(ValueError, match="do not continue"):
            cache.append(torch.randn(shape), torch.randn(shape))
    with pytest.raises(TypeCheckError):  # keys and values of different shapes
        cache.append(torch.randn(2, 3, 1, 5), torch.randn(2, 3, 2, 5))


def test_a_fixed_cache_refuses_append_and_a_growing_one_refuses_store():
    fixed = LayerCache().cross_attn
    k = torch.randn(2, 3, 4, 5)
    fixed.store(k, k + 1)
    assert len(fixed) == 4 and torch.equal(fixed.values, k + 1)
    with pytest.raises(ValueError, match="fixed"):
        fixed.append(k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="appended to"):
        KVCache().store(k, k)


# -- one cached attention step -----------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.lists(st.integers(1, 3),
       max_size=5), st.integers(0, 2**16))
def test_cached_self_attention_equals_one_causal_pass(batch, heads, d_head, prefill, chunks, seed):
    torch.manual_seed(seed)
    attention = MultiHeadAttention(heads * d_head, heads).double().eval()
    length = prefill + sum(chunks)
    x = torch.randn(batch, length, heads * d_head, dtype=torch.float64)
    full = attention(x, x, x, causal_mask(length))
    cache, done, outputs = KVCache(), 0, []
    for new in (prefill, *chunks):
        outputs.append(cached_self_attention(attention, x[:, :done + new], cache))
        done += new
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.keys.shape == (batch, heads, length, d_head)


def test_cached_self_attention_projects_only_the_new_positions_and_equals_the_library_module():
    torch.manual_seed(1)
    attention = MultiHeadAttention(12, 3).double().eval()
    gqa = GroupedQueryAttention(12, 3).double().eval()
    gqa.load_state_dict(attention.state_dict())
    rows = []
    attention.w_k.register_forward_hook(lambda module, inputs, out: rows.append(inputs[0].shape[1]))
    x = torch.randn(2, 8, 12, dtype=torch.float64)
    ours, theirs = KVCache(), KVCache()
    step = cached_self_attention(attention, x[:, :5], ours)
    torch.testing.assert_close(step, gqa(x[:, :5], x[:, :5], x[:, :5], causal_mask(5), cache=theirs))
    for t in range(5, 8):
        step = cached_self_attention(attention, x[:, :t + 1], ours)
        torch.testing.assert_close(step, gqa(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=theirs))
    assert rows == [5, 1, 1, 1]
    torch.testing.assert_close(ours.keys, theirs.keys)


@pytest.mark.parametrize(("kv_heads", "positional"), [(None, "sinusoidal"), (2, "rope"), (1, "learned")])
def test_fast_cached_decoding_equals_fast_and_plain_uncached(kv_heads, positional):
    """fast=True (PyTorch's fused attention, also over the cache) decodes as the plain path does, cached or not."""
    plain = _model(positional, kv_heads, seed=7, dropout=0.0)
    torch.manual_seed(7)
    config = ModelConfig.original(29, d_model=8, heads=4, layers=2, d_ff=20, dropout=0.0, positions=positional,
                                  kv_heads=kv_heads, fast=True, src_vocab=23, encoder_layers=2)
    fast = configured_transformer(config, pad_id=PAD).to(torch.float64)
    fast.load_state_dict(plain.state_dict())
    src = _padded_source(seed=3)
    cached_tokens, cached_logits = generate_cached(fast, src, 6, BOS, EOS)
    tokens, logits = generate(fast, src, 6, BOS, EOS)
    plain_tokens, plain_logits = generate(plain, src, 6, BOS, EOS)
    assert torch.equal(cached_tokens, tokens) and torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(cached_logits, logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-10, atol=1e-10)


# -- the paged cache -----------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4),
       st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5)), min_size=1, max_size=12), st.integers(0, 2**16))
def test_paged_cache_gathers_the_contiguous_cache_and_attends_equally(block_size, kv_heads, d_head, writes, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in writes)
    paged = PagedKVCache(total, kv_heads, block_size, d_head, dtype=torch.float64)  # enough blocks for anything
    contiguous = {s: KVCache() for s, _ in writes}
    for sequence, new in writes:  # the sequences' writes interleave, so their blocks do too
        k, v = (torch.randn(1, kv_heads, new, d_head, generator=g, dtype=torch.float64) for _ in range(2))
        paged.append(sequence, k[0], v[0])
        contiguous[sequence].append(k, v)
    for sequence, cache in contiguous.items():
        keys, values = paged.gather(sequence)
        assert torch.equal(keys, cache.keys[0]) and torch.equal(values, cache.values[0])
        assert len(paged.block_tables[sequence]) == math.ceil(len(cache) / block_size)
        q = torch.randn(kv_heads, 1, d_head, generator=g, dtype=torch.float64)
        out, _ = stepformer.attention.scaled_dot_product_attention(q, keys, values)
        expected = nn.functional.scaled_dot_product_attention(q, cache.keys[0], cache.values[0])
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    used = {b for table in paged.block_tables.values() for b in table}
    assert len(used) == sum(len(t) for t in paged.block_tables.values())  # no block is shared
    assert sorted(used | set(paged.free)) == list(range(total))


def test_gather_blocks_reads_position_p_from_slot_p_mod_block_size_of_block_table_p_div_block_size():
    g = torch.Generator().manual_seed(5)
    for block_size, length, blocks in ((3, 7, 5), (1, 4, 6), (4, 8, 2)):
        pool = torch.randn(blocks, 2, block_size, 3, generator=g)
        table = torch.randperm(blocks, generator=g)[: -(-length // block_size)]
        got = gather_blocks(pool, table, length)
        for p in range(length):
            assert torch.equal(got[:, p], pool[table[p // block_size], :, p % block_size])
        assert got.shape == (2, length, 3)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _contiguous_attention(q, keys, values):
    """PyTorch's attention on the contiguous cache, each key/value head repeated for its group of query heads."""
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
    return nn.functional.scaled_dot_product_attention(q, keys, values)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([1, 2, 3]), st.integers(1, 4), st.integers(1, 3),
       st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5)), min_size=1, max_size=12), st.integers(0, 2**16))
def test_paged_attention_reads_the_pool_block_by_block_as_contiguous_attention(
        block_size, kv_heads, group, d_head, q_len, writes, seed):
    """No gather: the online softmax across the table's blocks equals attention over the contiguous KVCache."""
    g = torch.Generator().manual_seed(seed)
    heads, total = kv_heads * group, sum(n for _, n in writes)
    paged = PagedKVCache(total + 2, kv_heads, block_size, d_head, dtype=torch.float64)
    paged.key_pool.fill_(math.nan)  # an unwritten slot that were read would make the output NaN
    paged.value_pool.fill_(math.nan)
    paged.free = torch.randperm(total + 2, generator=g).tolist()  # blocks out of order in the pool
    contiguous = {s: KVCache() for s, _ in writes}
    for sequence, new in writes:  # interleaved writes: each sequence's blocks are not next to each other
        k, v = (torch.randn(1, kv_heads, new, d_head, generator=g, dtype=torch.float64) for _ in range(2))
        paged.append(sequence, k[0], v[0])
        contiguous[sequence].append(k, v)
    for sequence, cache in contiguous.items():
        q = torch.randn(heads, q_len, d_head, generator=g, dtype=torch.float64)
        got = paged.attend(sequence, q)
        expected = _contiguous_attention(q, cache.keys[0], cache.values[0])
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        ours = grouped_attention(q[None], cache.keys, cache.values)[0]  # the library's attention, chapter 10
        torch.testing.assert_close(got, ours, rtol=1e-12, atol=1e-12)
        if group == 1:
            library, _ = stepformer.attention.scaled_dot_product_attention(q, cache.keys[0], cache.values[0])
            torch.testing.assert_close(got, library, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_with_a_shuffled_table_a_partly_filled_last_block_and_large_scores(device):
    g = torch.Generator().manual_seed(21)
    blocks, kv_heads, block_size, d_head, heads = 9, 2, 4, 3, 6
    key_pool = torch.randn(blocks, kv_heads, block_size, d_head, generator=g, dtype=torch.float64).to(device)
    value_pool = torch.randn(blocks, kv_heads, block_size, d_head, generator=g, dtype=torch.float64).to(device)
    table = torch.tensor([7, 2, 5, 0], device=device)  # neither sorted nor adjacent
    length = 14  # the last block holds 2 of its 4 slots
    key_pool[0, :, 2:], value_pool[0, :, 2:] = math.nan, math.nan  # the empty slots must not be read
    keys, values = gather_blocks(key_pool, table, length), gather_blocks(value_pool, table, length)
    assert not keys.isnan().any()
    for scale in (1.0, 100.0):  # 100: scores in the thousands, exp overflows without the running max
        q = scale * torch.randn(heads, 2, d_head, generator=g, dtype=torch.float64).to(device)
        got = paged_attention(q, key_pool, value_pool, table, length)
        torch.testing.assert_close(got, _contiguous_attention(q, keys, values), rtol=1e-10, atol=1e-10)
    assert got.device == key_pool.device


@pytest.mark.parametrize("device", DEVICES)
def test_paged_cache_lives_on_the_device_it_is_given(device):
    paged = PagedKVCache(blocks=3, kv_heads=1, block_size=2, d_head=4, device=device)
    assert paged.key_pool.device.type == device and paged.value_pool.device.type == device
    k = torch.randn(1, 3, 4, device=device)
    paged.append(0, k, 2 * k)
    q = torch.randn(1, 1, 4, device=device)
    torch.testing.assert_close(paged.attend(0, q), _contiguous_attention(q, k, 2 * k))


@pytest.mark.parametrize("length", [0, 9])
def test_paged_attention_refuses_a_length_its_table_does_not_hold(length):
    pool = torch.zeros(4, 1, 2, 3)
    with pytest.raises(ValueError, match="fit in 4 blocks of 2"):
        paged_attention(torch.zeros(1, 1, 3), pool, pool, torch.arange(4), length)


def test_released_blocks_return_to_the_pool_and_are_reused():
    paged = PagedKVCache(blocks=4, kv_heads=1, block_size=2, d_head=3)
    paged.append(0, torch.randn(1, 3, 3), torch.randn(1, 3, 3))  # 3 positions: 2 blocks
    paged.append(1, torch.randn(1, 4, 3), torch.randn(1, 4, 3))  # 4 positions: 2 blocks
    assert paged.free == []
    with pytest.raises(RuntimeError, match="exhausted"):
        paged.append(1, torch.randn(1, 1, 3), torch.randn(1, 1, 3))
    blocks_of_0 = list(paged.block_tables[0])
    paged.release(0)
    assert sorted(paged.free) == sorted(blocks_of_0) and 0 not in paged.block_tables
    k = torch.randn(1, 3, 3)
    paged.append(2, k, k + 1)
    assert set(paged.block_tables[2]) == set(blocks_of_0)
    keys, values = paged.gather(2)
    assert torch.equal(keys, k) and torch.equal(values, k + 1)


# -- the checks ----------------------------------------------------------------------------------


def _student_modules():
    """The library as a student would define it in the notebook: every earlier piece is their own too."""
    attention, multihead = student_copy(stepformer.attention), student_copy(stepformer.multihead)
    masks, kvcache = student_copy(stepformer.masks), student_copy(stepformer.kvcache)
    with _patched([(stepformer.attention, "scaled_dot_product_attention", attention.scaled_dot_product_attention),
                   (stepformer.multihead, "split_heads", multihead.split_heads),
                   (stepformer.multihead, "merge_heads", multihead.merge_heads),
                   (stepformer.masks, "causal_mask", masks.causal_mask),
                   (stepformer.kvcache, "KVCache", kvcache.KVCache)]):
        decoding = student_copy(stepformer.decoding)
    return kvcache, decoding, multihead, masks, attention


student_kvcache, student_decoding, student_multihead, student_masks, student_attention = _student_modules()
StudentKVCache = student_kvcache.KVCache
STEP = (student_decoding.cached_self_attention, StudentKVCache)


def stub(*args, **kwargs):
    raise NotImplementedError()


class StubCache:
    def __init__(self, fixed=False):
        raise NotImplementedError()


def test_every_check_passes_on_the_solution(capsys):
    for seed, dtype in ((0, torch.float32), (17, torch.float64), (33, torch.float32)):
        check_kv_cache_append(StudentKVCache, seed=seed, dtype=dtype)
        check_kv_cache_fixed(StudentKVCache, seed=seed)
        check_cached_attention(STEP, seed=seed, dtype=dtype)
        check_projects_new_only(STEP, seed=seed)
        check_cache_formula(student_kvcache.cache_bytes, seed=seed)
        check_gather_blocks(student_kvcache.gather_blocks, seed=seed, dtype=dtype)
    assert capsys.readouterr().out.count("✔") == 18


def test_every_check_fails_on_the_stub():
    for check, student in ((check_kv_cache_append, StubCache), (check_kv_cache_fixed, StubCache),
                           (check_cached_attention, (stub, StudentKVCache)),
                           (check_projects_new_only, (stub, StudentKVCache)), (check_cache_formula, stub),
                           (check_gather_blocks, stub)):
        with pytest.raises(CheckFailure, match="not implemented yet"):
            check(student)


def test_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(50):
        sizes = list(_sizes(seed).values())
        assert len(set(sizes)) == len(sizes)


def _cache_with(append=None, **methods):
    """The student's cache class with one method replaced by a mistake."""
    body = dict(methods)
    if append is not None:
        body["append"] = append
    return type("KVCache", (StudentKVCache,), body)


def _append_along(dim):
    def append(self, keys, values):
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=dim)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=dim)
        return self.keys, self.values

    return append


def _no_shape_check(self, keys, values):
    if self.fixed:
        raise ValueError("fixed")
    return _append_along(-2)(self, keys, values)


def _no_batch_check(self, keys, values):
    """Compares kv_heads and d_head with the cache, forgetting the batch."""
    if self.fixed:
        raise ValueError("fixed")
    if self.keys is not None and (self.keys.shape[1] != keys.shape[1] or self.keys.shape[-1] != keys.shape[-1]):
        raise ValueError("do not continue")
    return _append_along(-2)(self, keys, values)


def _append_anyway(self, keys, values):
    return _append_along(-2)(self, keys, values)


@pytest.mark.parametrize(
    ("cls", "check", "message"),
    [
        (_cache_with(_append_along(1)), check_kv_cache_append, r"along the heads \(dim=1\) axis"),
        (_cache_with(_append_along(-1)), check_kv_cache_append, r"along the features \(d_head, dim=-1\) axis"),
        (_cache_with(_no_shape_check), check_kv_cache_append, "should raise a ValueError"),
        (_cache_with(_no_batch_check), check_kv_cache_append, r"Appending keys with batch=3 .* should raise"),
        (_cache_with(__len__=lambda self: 0 if self.keys is None else self.keys.shape[1]), check_kv_cache_append,
         "__len__ should count the positions"),
        (_cache_with(_append_anyway), check_kv_cache_fixed, "append should raise a ValueError on it"),
        (_cache_with(nbytes=property(lambda self: 0 if self.keys is None else self.keys.nbytes)),
         check_kv_cache_fixed, "count the values as well"),
        (_cache_with(nbytes=property(lambda self: 0 if self.keys is None else 2 * self.keys.numel())),
         check_kv_cache_fixed, "numbers, not bytes"),
    ],
)
def test_cache_checks_name_the_mistake(cls, check, message):
    with pytest.raises(CheckFailure, match=message):
        check(cls)


def _step(mistake):
    """The cached step written out with one of the usual mistakes (the student's own pieces)."""
    split, merge = student_multihead.split_heads, student_multihead.merge_heads
    attend = student_attention.scaled_dot_product_attention

    def step(attention, x, cache):
        cached = len(cache)
        projected = x if mistake == "re-projects the prefix" else x[:, cached:]
        q = split(attention.w_q(x[:, cached:]), attention.heads)
        k = split(attention.w_k(projected), attention.heads)
        v = split(attention.w_v(projected), attention.heads)
        if mistake == "re-projects the prefix":
            k, v = k[:, :, cached:], v[:, :, cached:]
        new_k, new_v = k, v
        k, v = cache.append(k, v)
        new, total = q.shape[-2], k.shape[-2]
        if mistake == "first rows of the mask":
            mask = student_masks.causal_mask(total)[:new]
        elif mistake == "new keys only":
            k, v, mask = new_k, new_v, student_masks.causal_mask(new)
        else:
            mask = student_masks.causal_mask(new, total)
        out, _ = attend(q, k, v, mask)
        return merge(out) if mistake == "no w_o" else attention.w_o(merge(out))

    return step


@pytest.mark.parametrize(
    ("mistake", "check", "message"),
    [
        ("first rows of the mask", check_cached_attention, "hides the cached keys"),
        ("new keys only", check_cached_attention, "read only the new keys"),
        ("no w_o", check_cached_attention, "without the output projection"),
        ("re-projects the prefix", check_projects_new_only, "re-projects the whole prefix"),
    ],
)
def test_step_checks_name_the_mistake(mistake, check, message):
    with pytest.raises(CheckFailure, match=message):
        check((_step(mistake), StudentKVCache))


def test_re_projecting_the_prefix_gives_the_right_values_and_only_the_count_catches_it():
    check_cached_attention((_step("re-projects the prefix"), StudentKVCache))
    check_projects_new_only((_step(""), StudentKVCache))


def test_a_broken_cache_is_named_in_the_step_check():
    with pytest.raises(CheckFailure, match="exercise 1"):
        check_cached_attention((student_decoding.cached_self_attention, _cache_with(_append_along(1))))


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: layers * kv_heads * d_head * length * batch * b,
         "factor 2 counts the keys"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2 * layers * kv_heads * d_head * length * b,
         "multiply by batch"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2 * kv_heads * d_head * length * batch * b,
         "multiply by layers"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 16 * layers * kv_heads * d_head * length * batch * b,
         "bytes, not bits"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2 * layers * kv_heads * d_head * length * batch,
         "numbers, not bytes"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2.0 * layers * kv_heads * d_head * length * batch * b,
         "Python int"),
    ],
)
def test_formula_check_names_the_mistake(formula, message):
    with pytest.raises(CheckFailure, match=message):
        check_cache_formula(formula)


def _gather(mistake):
    def gather(pool, table, length):
        if mistake == "pool order":
            table = table.sort().values
        elif mistake == "first blocks":
            table = torch.arange(table.numel())
        pattern = "kv_heads (slot used) d_head" if mistake == "interleaved" else "kv_heads (used slot) d_head"
        out = rearrange(pool[table], f"used kv_heads slot d_head -> {pattern}")
        return out if mistake == "whole blocks" else out[:, :length]

    return gather


@pytest.mark.parametrize(
    ("mistake", "message"),
    [("interleaved", r"as \(slot used\)"), ("pool order", "the pool's order"), ("first blocks", "the pool's first"),
     ("whole blocks", "keep the first `length` positions")],
)
def test_gather_check_names_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_gather_blocks(_gather(mistake))
    check_gather_blocks(_gather(""))


def test_using_the_reference_is_not_own_work():
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_kv_cache_append(stepformer.kvcache.KVCache)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_cache_formula(stepformer.kvcache.cache_bytes)

    def delegates(attention, x, cache):
        return cached_self_attention(attention, x, cache)

    with pytest.raises(CheckFailure, match="Not your own work"):
        check_cached_attention((delegates, StudentKVCache))


def test_replay_of_the_counting_check_needs_no_student_code(monkeypatch, tmp_path):
    for folder, step in ((tmp_path / "right", _step("")), (tmp_path / "wrong", _step("re-projects the prefix"))):
        monkeypatch.setenv(RECORD_ENV, str(folder))
        with contextlib.suppress(CheckFailure):
            check_projects_new_only((step, StudentKVCache), seed=4)
        monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path / "right"):
        check_projects_new_only((object(), object()), seed=4)  # the objects are never touched
    with replaying(tmp_path / "wrong"), pytest.raises(CheckFailure, match="re-projects the whole prefix"):
        check_projects_new_only((object(), object()), seed=4)


@pytest.mark.parametrize("decode", [generate, generate_cached])
def test_the_padding_mask_of_the_source_is_what_generation_uses(decode):
    """What stands at the source's padded positions, or how many there are, never reaches the generated tokens."""
    model = _model(seed=9, dropout=0.0)
    src = _padded_source(seed=5)
    assert (~padding_mask(src, PAD)).any() and padding_mask(src, PAD)[0].all()  # padded, but not every sentence
    tokens, logits = decode(model, src, 6, BOS, EOS)
    # Another vector for the padding token: only padded source positions carry it.
    with torch.no_grad():
        model.src_embed.tokens.weight[PAD] = 5.0 * torch.randn(model.src_embed.tokens.weight.shape[1])
    other_tokens, other_logits = decode(model, src, 6, BOS, EOS)
    assert torch.equal(other_tokens, tokens)
    torch.testing.assert_close(other_logits, logits, rtol=1e-12, atol=1e-12)
    # More padding at the end: more keys that must not be read.
    longer = torch.cat([src, torch.full((src.shape[0], 3), PAD)], dim=1)
    longer_tokens, longer_logits = decode(model, longer, 6, BOS, EOS)
    assert torch.equal(longer_tokens, tokens)
    torch.testing.assert_close(longer_logits, logits, rtol=1e-12, atol=1e-12)
    # The control: read without the mask, the padding vector does reach the real positions' memory.
    with torch.no_grad():
        unmasked = model.encode(src, torch.ones(1, 1, 1, src.shape[1], dtype=torch.bool))
        masked = model.encode(src)
    real = padding_mask(src, PAD)[:, 0, 0]
    assert (unmasked - masked)[1:][real[1:]].abs().max() > 1e-3


def test_every_check_replays_what_it_recorded(monkeypatch, tmp_path):
    """The grader re-runs the checks on recorded results: every input must be the same the second time."""
    runs = [(check_kv_cache_append, StudentKVCache), (check_kv_cache_fixed, StudentKVCache),
            (check_cached_attention, STEP), (check_projects_new_only, STEP),
            (check_cache_formula, student_kvcache.cache_bytes), (check_gather_blocks, student_kvcache.gather_blocks)]
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    for check, student in runs:
        check(student, seed=8)
    monkeypatch.delenv(RECORD_ENV)
    torch.manual_seed(12345)  # another global random state: the checks must not depend on it
    with replaying(tmp_path):
        for check, student in runs:  # stand-ins that are never touched, shaped like the graded cells' arguments
            check((object(), object()) if type(student) is tuple else object(), seed=8)


# Diagnoses that are verified before they are named (issue 27): each fires on its mistake and not on a similar one.

def _empty_guard_inverted(self, keys, values):
    """The empty-cache test inverted for the keys or the values: torch.cat gets None."""
    if self.fixed:
        raise ValueError("fixed")
    self.keys = keys if self.keys is not None else torch.cat([self.keys, keys], dim=-2)
    self.values = values if self.values is None else torch.cat([self.values, values], dim=-2)
    return self.keys, self.values


def _values_guard_inverted(self, keys, values):
    if self.fixed:
        raise ValueError("fixed")
    self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=-2)
    self.values = values if self.values is not None else torch.cat([self.values, values], dim=-2)
    return self.keys, self.values


def _shape_read_when_empty(self, keys, values):
    if self.fixed:
        raise ValueError("fixed")
    if self.keys.shape[:2] != keys.shape[:2]:
        raise ValueError("do not continue")
    return _append_along(-2)(self, keys, values)


def _refuses_every_continuation(self, keys, values):
    if self.fixed:
        raise ValueError("fixed")
    if self.keys is not None:
        raise ValueError("do not continue")
    return _append_along(-2)(self, keys, values)


def _type_error(self, keys, values):
    raise TypeError("not today")


@pytest.mark.parametrize(
    ("cls", "check", "named", "not_named"),
    [
        (_cache_with(__len__=lambda self: self.keys.shape[-2]), check_kv_cache_append,
         r"your __len__ reads \.shape of one of them", "handed None"),
        (_cache_with(__len__=lambda self: len(self.missing)), check_kv_cache_append, "AttributeError",
         "as they should be"),
        (_cache_with(_shape_read_when_empty), check_kv_cache_append, r"your append reads \.shape", "handed None"),
        (_cache_with(_empty_guard_inverted), check_kv_cache_append, "your append handed None to torch.cat",
         "self.values is still None"),
        (_cache_with(_values_guard_inverted), check_kv_cache_append, "self.values is still None", "handed None"),
        (_cache_with(_type_error), check_kv_cache_append, "not today", "as they should be"),
        (_cache_with(_refuses_every_continuation), check_kv_cache_append, "Your append refused them",
         "along the"),
        (_cache_with(_no_batch_check), check_kv_cache_append, "should raise", "refused them"),
        (_cache_with(__len__=lambda self: 1 if self.keys is None else self.keys.shape[-2]), check_kv_cache_append,
         "Your __len__ gives 1, one too many", "reads"),
        (_cache_with(__len__=lambda self: 2 if self.keys is None else self.keys.shape[-2]), check_kv_cache_append,
         "got 2", "one too many"),
        (_cache_with(nbytes=property(lambda self: self.keys.numel() * 8)), check_kv_cache_fixed,
         r"your nbytes reads \.numel", "one too many"),
        (_cache_with(nbytes=property(lambda self: 1 if self.keys is None else 2 * self.keys.nbytes)),
         check_kv_cache_fixed, "Your nbytes gives 1, one too many", "reads"),
        (_cache_with(nbytes=property(lambda self: 3 if self.keys is None else 2 * self.keys.nbytes)),
         check_kv_cache_fixed, "got 3", "one too many"),
    ],
)
def test_cache_checks_name_only_verified_mistakes(cls, check, named, not_named):
    with pytest.raises(CheckFailure, match=named) as failure:
        check(cls)
    assert not_named not in str(failure.value)


def _step_with(mistake):
    """The cached step with a mistake in a size or the mask's construction."""
    split, merge = student_multihead.split_heads, student_multihead.merge_heads
    attend = student_attention.scaled_dot_product_attention

    def step(attention, x, cache):
        new = x[:, len(cache) + 1:] if mistake == "skips one" else x[:, len(cache):]
        q, k, v = (split(w(new), attention.heads) for w in (attention.w_q, attention.w_k, attention.w_v))
        k, v = cache.append(k, v)
        new_len = q.shape[-3] if mistake == "heads for new" else q.shape[-2]
        total = k.shape[-2]
        if mistake == "one-axis mask":
            mask = torch.ones(new_len, dtype=torch.bool).tril(diagonal=total - new_len)
        elif mistake == "raises":
            raise RuntimeError("something else")
        else:
            mask = torch.ones(new_len, total, dtype=torch.bool).tril(diagonal=total - new_len)
        out, _ = attend(q, k, v, mask)
        return merge(out) if mistake == "no w_o" else attention.w_o(merge(out))

    return step


@pytest.mark.parametrize(
    ("mistake", "named", "not_named"),
    [
        ("skips one", r"returned 4 positions, and len\(cache\) is 4", "heads axis"),
        ("no w_o", "without the output projection", "heads axis"),
        ("heads for new", "read from the heads axis", "tril"),
        ("one-axis mask", "passed to tril has fewer than two axes", "heads axis"),
        ("raises", "something else", "heads axis"),
    ],
)
def test_step_check_names_only_verified_mistakes(mistake, named, not_named):
    with pytest.raises(CheckFailure, match=named) as failure:
        check_cached_attention((_step_with(mistake), StudentKVCache))
    assert not_named not in str(failure.value)
    check_cached_attention((_step_with(""), StudentKVCache))


@pytest.mark.parametrize(
    ("formula", "named", "not_named"),
    [
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2 * layers / kv_heads * d_head * length * batch * b,
         "divides by kv_heads where it should multiply", "layers where"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2 * layers * kv_heads * d_head * length / batch * b,
         "divides by batch where it should multiply", "kv_heads where"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: 2.0 * layers * kv_heads * d_head * length * batch * b,
         "its values equal the bytes measured", "divides"),
        (lambda layers, kv_heads, d_head, length, batch=1, b=4: layers * kv_heads * d_head * length * batch * b / 1,
         "Python int", "divides"),
    ],
)
def test_formula_check_names_a_division_only_when_one_size_explains_every_case(formula, named, not_named):
    with pytest.raises(CheckFailure, match=named) as failure:
        check_cache_formula(formula)
    assert not_named not in str(failure.value)


@pytest.mark.parametrize(
    ("extra", "named"),
    [(1, "one more than the sequence's length"), (-1, "one fewer than the sequence's length"), (-2, "2 too few")],
)
def test_gather_check_names_a_length_off_by_some(extra, named):
    def gather(pool, table, length):
        return rearrange(pool[table], "used kv_heads slot d_head -> kv_heads (used slot) d_head")[:, :length + extra]

    with pytest.raises(CheckFailure, match=named):
        check_gather_blocks(gather)


def test_gather_check_does_not_call_other_positions_a_length_off_by_one():
    def gather(pool, table, length):  # one position too many, and the blocks in the pool's order
        out = rearrange(pool[table.sort().values], "used kv_heads slot d_head -> kv_heads (used slot) d_head")
        return out[:, :length + 1]

    with pytest.raises(CheckFailure, match="should have shape") as failure:
        check_gather_blocks(gather)
    assert "one more" not in str(failure.value)


def _message(check, student):
    with pytest.raises(CheckFailure) as failure:
        check(student)
    return str(failure.value)


@pytest.mark.parametrize(("check", "student"), [
    (check_kv_cache_append, _cache_with(_values_guard_inverted)),
    (check_kv_cache_append, _cache_with(__len__=lambda self: 1 if self.keys is None else self.keys.shape[-2])),
    (check_kv_cache_fixed, _cache_with(nbytes=property(lambda self: self.keys.numel() * 8))),
    (check_cached_attention, (_step_with("heads for new"), StudentKVCache)),
    (check_cached_attention, (_step_with("skips one"), StudentKVCache)),
    (check_cache_formula, lambda layers, kv_heads, d_head, length, batch=1, b=4: 2 * layers / kv_heads * d_head
     * length * batch * b),
])
def test_a_verified_diagnosis_replays_as_it_was_recorded(monkeypatch, tmp_path, check, student):
    """The grader replays the recorded calls: the diagnosis's extra calls must come back the same."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    recorded = _message(check, student)
    monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path):
        assert _message(check, (object(), object()) if type(student) is tuple else object()) == recorded


def _update_new_only(self, keys, values):
    self.append(keys, values) if not self.fixed else self.store(keys, values)
    return keys, values


def _update_always_stores(self, keys, values):
    if self.fixed:
        self.store(keys, values)
        return self.keys, self.values
    return self.append(keys, values)


@pytest.mark.parametrize(("update", "message"), [
    (_update_new_only, r"update on a growing cache, called with 2 positions and then \d+, should do what append does "
                       r"and return the keys and values of all \d+, in order; it gave only the 2nd call's keys"),
    (_update_always_stores, "A fixed cache's second update should return the keys and values stored at the first "
                            r".*it returned others, and the cache now holds them"),
])
def test_fixed_check_names_what_update_does_wrong(update, message):
    with pytest.raises(CheckFailure, match=message):
        check_kv_cache_fixed(_cache_with(update=update))


def test_a_wrong_append_costs_the_append_check_only():
    """update on a growing cache delegates to append: a cache appending along the heads axis fails the append
    check, and the fixed-cache check, which compares update with append, passes."""
    def append(self, keys, values):
        if self.fixed:
            raise ValueError("a fixed cache is not appended to")
        return _append_along(1)(self, keys, values)

    along_heads = _cache_with(append)
    with pytest.raises(CheckFailure):
        check_kv_cache_append(along_heads)
    check_kv_cache_fixed(along_heads)
