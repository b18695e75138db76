"""stepformer.transformer against torch.nn.TransformerDecoderLayer / nn.Transformer on random shapes, its
defining properties (teacher forcing, per-sentence EOS, tied embeddings, fast == plain), and the chapter's checks."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stepformer.attention
import stepformer.encoder
import stepformer.ffn
import stepformer.masks
import stepformer.multihead
import stepformer.norms
import stepformer.transformer
from stepformer.checks._core import RECORD_ENV, CheckFailure, replaying
from stepformer.checks.decoder import (
    BOS,
    EOS,
    PAD,
    ToyModel,
    _sizes,
    _sources,
    check_build_decoder_layer,
    check_decoder_layer_init,
    check_decoder_layer_post_norm,
    check_decoder_layer_pre_norm,
    check_greedy,
    check_logits_that_change,
    check_target_mask,
)
from stepformer.checks.encoder import _randomise
from stepformer.encoder import build_encoder, encoder_layer_from_torch
from stepformer.masks import causal_mask, padding_mask
from stepformer.parts import ModelConfig, configured_transformer
from stepformer.transformer import (
    Decoder,
    DecoderLayer,
    Transformer,
    build_decoder,
    build_decoder_layer,
    build_transformer,
    decoder_layer_from_torch,
    generate,
    greedy,
    load_torch_transformer,
    logits_that_change,
    target_mask,
)
from tests.fixtures.student import student_copy


def _padded(batch, length, vocab, g, pad_id=0):
    """Token ids (batch, length) with padding at the end of some sentences; every sentence has >= 1 real token."""
    tokens = torch.randint(1, vocab, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    tokens[torch.arange(length)[None, :] >= lengths[:, None]] = pad_id
    return tokens


def _torch_masks(src, tgt, pad_id=0):
    """PyTorch's masks: True = ignore (the opposite of ours)."""
    tgt_len = tgt.shape[1]
    return dict(src_key_padding_mask=src == pad_id, memory_key_padding_mask=src == pad_id,
                tgt_key_padding_mask=tgt == pad_id,
                tgt_mask=~torch.ones(tgt_len, tgt_len, dtype=torch.bool).tril())


sizes = st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 7), st.sampled_from([1, 2, 3, 4]),
                  st.integers(1, 4), st.integers(1, 12))


@settings(max_examples=20, deadline=None)
@given(s=sizes, norm_first=st.booleans(), layers=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       seed=st.integers(0, 2**16))
def test_full_model_matches_torch_transformer_float64(s, norm_first, layers, seed):
    """Encoder + decoder of Transformer == torch.nn.Transformer with copied weights, padding and causal masks."""
    batch, src_len, tgt_len, heads, d_head, d_ff = s
    d_model = heads * d_head
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        theirs = nn.Transformer(d_model, heads, layers[0], layers[1], d_ff, dropout=0.0, batch_first=True,
                                norm_first=norm_first, dtype=torch.float64)
    _randomise(theirs, g)
    theirs.eval()
    ours = build_transformer(11, 11, d_model, heads, layers[0], layers[1], d_ff, dropout=0.0, norm_first=norm_first)
    ours = ours.double().eval()
    load_torch_transformer(ours, theirs)
    src, tgt = _padded(batch, src_len, 11, g), _padded(batch, tgt_len, 11, g)
    x = torch.randn(batch, src_len, d_model, generator=g, dtype=torch.float64)
    y = torch.randn(batch, tgt_len, d_model, generator=g, dtype=torch.float64)
    with torch.no_grad():
        expected = theirs(x, y, **_torch_masks(src, tgt))
        src_mask = padding_mask(src, 0)
        got = ours.decoder(y, ours.encoder(x, src_mask), src_mask, target_mask(tgt, 0))
    difference = (got - expected).abs().max().item()
    assert difference < 1e-5, difference


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_pytorch_float64(norm_first):
    g = torch.Generator().manual_seed(1)
    layer = nn.TransformerDecoderLayer(12, 3, 10, dropout=0.0, batch_first=True, norm_first=norm_first,
                                       dtype=torch.float64)
    _randomise(layer, g)
    layer.eval()
    ours = decoder_layer_from_torch(layer).eval()
    src, tgt = _padded(2, 5, 9, g), _padded(2, 4, 9, g)
    y, memory = torch.randn(2, 4, 12, generator=g, dtype=torch.float64), torch.randn(2, 5, 12, generator=g,
                                                                                    dtype=torch.float64)
    masks = _torch_masks(src, tgt)
    with torch.no_grad():
        expected = layer(y, memory, tgt_mask=masks["tgt_mask"], tgt_key_padding_mask=masks["tgt_key_padding_mask"],
                         memory_key_padding_mask=masks["memory_key_padding_mask"])
        got = ours(y, memory, padding_mask(src, 0), target_mask(tgt, 0))
    assert (got - expected).abs().max().item() < 1e-10


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 8), pad_id=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_target_mask_is_causal_and_padding(batch, length, pad_id, seed):
    tokens = torch.randint(0, 6, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = target_mask(tokens, pad_id)
    assert mask.shape == (batch, 1, length, length)
    for b in range(batch):
        for i in range(length):
            for j in range(length):
                assert bool(mask[b, 0, i, j]) == (j <= i and int(tokens[b, j]) != pad_id)


def _transformer(src_vocab, tgt_vocab, **options):
    """build_transformer's model; with chapter 10's options (kv_heads, rotary positions, fused kernels) the same
    model from parts.configured_transformer, which composes chapter 08's Transformer with chapter 10's attention."""
    if not ({"kv_heads", "fast"} & set(options) or options.get("positional") == "rope"):
        return build_transformer(src_vocab, tgt_vocab, **options)
    renamed = {"positional": "positions", "n_decoder_layers": "layers", "n_encoder_layers": "encoder_layers",
               "activation": "ffn"}
    changes = {renamed.get(key, key): value for key, value in options.items() if key not in ("norm_first", "pad_id")}
    changes["placement"] = "pre" if options.get("norm_first") else "post"
    config = ModelConfig.original(tgt_vocab, src_vocab=src_vocab, **{"encoder_layers": 6, **changes})
    return configured_transformer(config, options.get("pad_id", 0))


def _small_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    options = dict(d_model=16, heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=24, dropout=0.0, max_len=40)
    return _transformer(13, 13, **{**options, **kwargs}).double().eval()


def test_the_transformer_is_its_five_parts_and_their_wiring():
    """A Transformer composed of another one's parts computes what that one computes; rotary positions, which
    chapter 03's attention lacks, are the configured model's (chapter 10)."""
    model = _small_model(7)
    again = Transformer(model.src_embed, model.tgt_embed, model.encoder, model.decoder, model.generator, model.pad_id)
    g = torch.Generator().manual_seed(3)
    src, tgt = _padded(2, 6, 13, g), _padded(2, 5, 13, g)
    with torch.no_grad():
        assert torch.equal(again(src, tgt), model(src, tgt))
    with pytest.raises(ValueError, match="configured_transformer"):
        build_transformer(13, 13, positional="rope")


def test_teacher_forcing_equals_prefix_by_prefix():
    """One parallel pass gives, at position i, the logits that the prefix tgt[:, :i + 1] alone gives."""
    model = _small_model()
    g = torch.Generator().manual_seed(4)
    src, tgt = _padded(3, 6, 13, g), torch.randint(1, 13, (3, 5), generator=g)
    with torch.no_grad():
        parallel = model(src, tgt)
        for i in range(tgt.shape[1]):
            one = model(src, tgt[:, :i + 1])[:, -1]
            assert (one - parallel[:, i]).abs().max() < 1e-12


def test_a_later_target_token_changes_only_later_logits():
    model = _small_model(1)
    g = torch.Generator().manual_seed(5)
    src, tgt = _padded(2, 6, 13, g), torch.randint(1, 13, (2, 7), generator=g)
    for position in (0, 3, 6):
        changed = logits_that_change(model, src, tgt, position, int(tgt[0, position] % 12 + 1))
        assert torch.equal(changed[0], torch.arange(7) >= position)


def test_teacher_forcing_reads_the_start_token_even_when_its_id_is_the_padding_id():
    """A target that starts with a real start token gets target_mask exactly (chapter 11's); one whose start token
    has the padding id (Marian's) has it read by every position, as greedy generation's causal mask does."""
    model = _small_model(4)
    g = torch.Generator().manual_seed(9)
    src, tgt = _padded(3, 6, 13, g), _padded(3, 7, 13, g)
    with torch.no_grad():
        src_mask = padding_mask(src, 0)
        memory = model.encode(src, src_mask)
        masked = model.generator(model.decode(tgt, memory, src_mask, target_mask(tgt, 0)))
        assert torch.equal(model(src, tgt), masked), "a real start token: forward should use target_mask as it is"
        tgt[:, 0] = 0
        causal = model.generator(model.decode(tgt, memory, src_mask, causal_mask(7)))
        real = tgt != 0
        real[:, 0] = True
        difference = (model(src, tgt) - causal)[real].abs().max()
        assert difference < 1e-12, f"a start token with the padding id should be read: {difference:.2e}"


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
@pytest.mark.parametrize("tie", [False, True])
def test_positional_options_and_tied_embeddings(positional, tie):
    model = _small_model(positional=positional, tie_embeddings=tie)
    g = torch.Generator().manual_seed(6)
    src, tgt = _padded(2, 6, 13, g), _padded(2, 5, 13, g)
    logits = model(src, tgt)
    assert logits.shape == (2, 5, 13) and torch.isfinite(logits).all()
    shared = model.generator.weight is model.tgt_embed.tokens.weight
    assert shared == tie
    assert (model.src_embed.tokens.weight is model.tgt_embed.tokens.weight) == tie
    if tie:  # one tensor: a gradient step on the generator moves the embedding
        names = [n for n, p in model.named_parameters() if p is model.generator.weight]
        assert len(names) == 1


def test_tied_embeddings_with_two_vocabularies_share_only_the_target_side():
    torch.manual_seed(0)
    model = build_transformer(9, 13, d_model=8, heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=8,
                              tie_embeddings=True)
    assert model.generator.weight is model.tgt_embed.tokens.weight
    assert model.src_embed.tokens.weight is not model.tgt_embed.tokens.weight
    untied = build_transformer(9, 13, d_model=8, heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=8)
    saved = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in model.parameters())
    assert saved == 13 * 8


@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
def test_positions_are_used(positional):
    """Without positions a permutation of the source would not change the logits; with them it does."""
    model = _small_model(2, positional=positional)
    g = torch.Generator().manual_seed(7)
    src, tgt = torch.randint(1, 13, (2, 6), generator=g), torch.randint(1, 13, (2, 4), generator=g)
    with torch.no_grad():
        assert (model(src, tgt) - model(src.flip(1), tgt)).abs().max() > 1e-6


@pytest.mark.parametrize("norm_first", [False, True])
def test_fast_equals_plain(norm_first):
    plain = _small_model(3, norm_first=norm_first)
    fast = _small_model(3, norm_first=norm_first, fast=True)
    fast.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(8)
    src, tgt = _padded(3, 7, 13, g), _padded(3, 5, 13, g)
    with torch.no_grad():
        assert (fast(src, tgt) - plain(src, tgt)).abs().max() < 1e-10


@pytest.mark.parametrize("options", [{}, {"norm_first": True}, {"kv_heads": 2, "positional": "rope"}])
def test_fast_training_step_has_the_gradients_of_the_plain_one_float64(options):
    """Backward too: the fused attention and nn.LayerNorm give every parameter the plain path's gradient."""
    plain = _small_model(6, **options).train()  # dropout=0.0: training mode, yet deterministic
    fast = _small_model(6, fast=True, **options).train()
    fast.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(10)
    src, tgt = _padded(3, 7, 13, g), _padded(3, 6, 13, g)
    for model in (plain, fast):
        model.zero_grad()
        logits = model(src, tgt[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0).backward()
    fast_grads = dict(fast.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None and fast_grads[name].grad is not None, name
        torch.testing.assert_close(fast_grads[name].grad, p.grad, rtol=1e-9, atol=1e-11, msg=name)


def test_generate_stops_each_sentence_at_its_eos_and_pads_after():
    model = ToyModel(16, seed=0)
    src = _sources([3, 1, 5, 2], 6, seed=0)
    tokens, logits = greedy(model, src, 8, 1, EOS, model.next_logits)
    assert tokens.shape == (4, 6) and logits.shape == (4, 5, 16)
    for row, stop in zip(tokens.tolist(), [3, 1, 5, 2], strict=True):
        assert row[stop] == EOS and EOS not in row[1:stop]
        assert all(t == PAD for t in row[stop + 1:])
        assert PAD not in row[:stop]
    never = _sources([0, 2], 6, seed=1)
    tokens, _ = greedy(model, never, 5, 1, EOS, model.next_logits)
    assert tokens.shape == (2, 6) and EOS not in tokens[0].tolist()


def test_generate_batch_equals_each_sentence_alone():
    """Batched greedy decoding of the real model == decoding each sentence by itself, up to its EOS."""
    model = _small_model(4)
    g = torch.Generator().manual_seed(9)
    src = _padded(4, 6, 13, g)
    eos = int(generate(model, src[:1], 3, 1, 2)[0][0, 2])  # a token the model does produce, to get some EOS
    tokens, logits = generate(model, src, 6, 1, eos)
    assert tokens[:, 0].eq(1).all() and logits.shape == (4, tokens.shape[1] - 1, 13)
    for b in range(4):
        real = src[b:b + 1, : int((src[b] != 0).sum())]
        alone, _ = generate(model, real, 6, 1, eos)
        row = tokens[b].tolist()
        end = row.index(eos) + 1 if eos in row[1:] else len(row)
        assert row[:end] == alone[0, :end].tolist()
        assert all(t == model.pad_id for t in row[end:])
    assert model.training is False


def test_generate_restores_training_mode():
    model = _small_model(5).train()
    generate(model, torch.tensor([[3, 4, 5]]), 2, 1, 2)
    assert model.training


def test_greedy_needs_a_step():
    with pytest.raises(ValueError, match="at least 1"):
        generate(_small_model(), torch.tensor([[3, 4]]), 0, 1, 2)


# -- the decoder-only (GPT) block ----------------------------------------------------------------

def _gpt_layer_from_encoder_layer(encoder_layer, norm_first):
    """A decoder layer without cross-attention holding an encoder layer's weights: its FFN norm is norm3.

    The whole state dict loads (strict): a decoder-only block has one layout, the encoder layer's with norm2
    renamed norm3, and no idle norm2."""
    attention = encoder_layer.self_attn
    gpt = build_decoder_layer(attention.w_q.in_features, attention.heads, encoder_layer.ffn.linear1.out_features,
                              dropout=0.0, norm_first=norm_first, cross_attention=False).double()
    gpt.load_state_dict({name.replace("norm2.", "norm3."): value for name, value in encoder_layer.state_dict().items()})
    return gpt


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_decoder_only_block_is_torch_encoder_layer_with_a_causal_mask_float64(norm_first):
    """GPT's block: DecoderLayer(cross_attention=False) with memory=None == nn.TransformerEncoderLayer + causal mask."""
    g = torch.Generator().manual_seed(11)
    batch, seq, heads, d_head, d_ff = 2, 7, 3, 4, 10
    d_model = heads * d_head
    theirs = nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.0, batch_first=True, norm_first=norm_first,
                                        dtype=torch.float64)
    _randomise(theirs, g)
    gpt = _gpt_layer_from_encoder_layer(encoder_layer_from_torch(theirs), norm_first)
    assert gpt.cross_attn is None and gpt.norm2 is None and gpt.dropout2 is None
    x = torch.randn(batch, seq, d_model, generator=g, dtype=torch.float64)
    tokens = _padded(batch, seq, 9, g)
    # Gradients on: PyTorch's inference fast path would zero the padded positions instead.
    expected = theirs(x, src_mask=~causal_mask(seq), src_key_padding_mask=tokens == 0)
    got = gpt(x, None, tgt_mask=target_mask(tokens, 0))
    assert (got - expected).abs().max().item() < 1e-10
    # The mask is what makes it a decoder: without it, position 0 would read later positions.
    later = x.clone()
    later[:, 1:] += 1.0
    assert torch.equal(gpt(later, None, tgt_mask=causal_mask(seq))[:, 0], gpt(x, None, tgt_mask=causal_mask(seq))[:, 0])


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_decoder_only_stack_is_our_encoder_with_a_causal_mask_float64(norm_first):
    """A Decoder of decoder-only layers made of an Encoder's own parts, with memory=None == that Encoder under a
    causal mask: the two layers differ only in their wiring's optional middle sublayer."""
    torch.manual_seed(12)
    d_model, heads, d_ff, layers, seq = 12, 3, 10, 3, 6
    encoder = build_encoder(d_model, heads, d_ff, layers, dropout=0.0, norm_first=norm_first).double()
    _randomise(encoder, torch.Generator().manual_seed(13))
    decoder = Decoder((DecoderLayer(layer.self_attn, None, layer.ffn, layer.norm1, None, layer.norm2, 0.0, norm_first)
                       for layer in encoder.layers), encoder.norm)
    built = build_decoder(d_model, heads, d_ff, layers, dropout=0.0, norm_first=norm_first, cross_attention=False)
    built.load_state_dict(decoder.state_dict())  # strict: the builder's layout, without a norm2 in any layer
    x = torch.randn(2, seq, d_model, dtype=torch.float64)
    with torch.no_grad():
        difference = (decoder(x, None, tgt_mask=causal_mask(seq)) - encoder(x, causal_mask(seq))).abs().max()
    assert difference.item() < 1e-12


def test_a_cross_attention_layer_without_memory_says_it_needs_the_memory():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="needs the encoder's memory"):
        build_decoder_layer(8, 2, 12, dropout=0.0)(x, None)
    with pytest.raises(ValueError, match="needs the encoder's memory"):
        build_decoder(8, 2, 12, 2, dropout=0.0)(x, None, tgt_mask=causal_mask(3))


def test_a_decoder_layer_refuses_a_shared_norm_and_a_cross_attention_without_its_norm():
    layer = build_decoder_layer(8, 2, 12)
    parts = dict(self_attn=layer.self_attn, cross_attn=layer.cross_attn, ffn=layer.ffn, norm1=layer.norm1,
                 norm2=layer.norm2, norm3=layer.norm3)
    for shared in ({"norm3": layer.norm1}, {"norm2": layer.norm3}, {"cross_attn": None, "norm2": None,
                                                                     "norm3": layer.norm1}):
        with pytest.raises(ValueError, match="the same norm module"):
            DecoderLayer(**{**parts, **shared})
    for unpaired in ({"norm2": None}, {"cross_attn": None}):
        with pytest.raises(ValueError, match="give cross_attn and norm2, or neither"):
            DecoderLayer(**{**parts, **unpaired})
    # The parts are the layer's own: one built from them computes what it computes.
    again = DecoderLayer(**parts, dropout=0.1).eval()
    x, memory = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    assert torch.equal(again(x, memory), layer.eval()(x, memory))


# -- load_torch_transformer refuses what it cannot copy faithfully --------------------------------

def _torch_transformer(**kwargs):
    options = dict(d_model=12, nhead=3, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=10,
                   dropout=0.0, batch_first=True)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bias=False: PyTorch notes that it skips its nested-tensor path
        return nn.Transformer(**{**options, **kwargs})


def _ours_for_torch(**kwargs):
    options = dict(d_model=12, heads=3, n_encoder_layers=2, n_decoder_layers=2, d_ff=10, dropout=0.0)
    return _transformer(11, 11, **{**options, **kwargs})


@pytest.mark.parametrize(("ours", "theirs", "named"), [
    ({"norm_first": True}, {}, "norm_first: ours True, theirs False"),
    ({}, {"norm_first": True}, "norm_first: ours False, theirs True"),
    ({"activation": "gelu"}, {}, "activation: ours 'gelu', theirs 'relu'"),
    ({}, {"activation": "gelu"}, "activation: ours 'relu', theirs 'gelu'"),
    ({}, {"activation": nn.GELU(approximate="tanh")}, "approximate='tanh'"),
    ({"dropout": 0.1}, {}, "dropout: ours 0.1, theirs 0.0"),
    ({}, {"bias": False}, "bias=False"),
    ({"heads": 4}, {}, "heads: ours 4, theirs 3"),
    ({"kv_heads": 1}, {}, "kv_heads: ours 1"),
    ({"positional": "rope"}, {}, "'rope'"),
    ({"d_ff": 8}, {}, "d_ff: ours 8, theirs 10"),
    ({"n_decoder_layers": 1}, {}, "decoder layers: ours 1, theirs 2"),
    ({}, {"layer_norm_eps": 1e-6}, "layer_norm_eps"),
])
def test_load_torch_transformer_names_a_mismatched_configuration(ours, theirs, named):
    model, reference = _ours_for_torch(**ours), _torch_transformer(**theirs)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="cannot copy this torch.nn.Transformer") as error:
        load_torch_transformer(model, reference)
    assert named in str(error.value)
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())  # nothing half-copied


def test_load_torch_transformer_accepts_matching_configurations_fast_or_not():
    for options in ({}, {"fast": True}, {"norm_first": True, "activation": "gelu", "dropout": 0.1}):
        torch_options = {k: v for k, v in options.items() if k != "fast"}
        load_torch_transformer(_ours_for_torch(**options), _torch_transformer(**torch_options))


# -- the checks ------------------------------------------------------------------------------

def _student_transformer():
    """The library as a student's notebook has it: its own copy, with the given pieces as copies too."""
    multihead = student_copy(stepformer.multihead)
    multihead.scaled_dot_product_attention = student_copy(stepformer.attention).scaled_dot_product_attention
    masks = student_copy(stepformer.masks)
    copy = student_copy(stepformer.transformer)
    copy.MultiHeadAttention = multihead.MultiHeadAttention
    copy.FeedForward = student_copy(stepformer.ffn).FeedForward
    copy.LayerNorm = student_copy(stepformer.norms).LayerNorm
    copy.add_and_norm = student_copy(stepformer.encoder).add_and_norm
    copy.padding_mask, copy.causal_mask = masks.padding_mask, masks.causal_mask
    return copy


student = _student_transformer()
def builder_for(cls, mistake=""):
    """build_decoder_layer for the layer class ``cls`` (the library's choice of parts), or with one mistake in it."""
    def build(d_model, heads, d_ff, dropout=0.1, norm_first=False, activation="relu", cross_attention=True):
        cross = {"inverted": not cross_attention, "never": False, "always cross-attention": True}.get(
            mistake, cross_attention)
        self_attn = student.MultiHeadAttention(d_model, heads, dropout=0.0 if mistake == "attention dropout" else
                                               dropout)
        cross_attn = self_attn if mistake == "one attention" else student.MultiHeadAttention(d_model, heads,
                                                                                            dropout=dropout)
        norm1 = student.LayerNorm(d_model)
        return cls(
            self_attn,
            cross_attn if (not cross if mistake == "cross_attn inverted" else cross) else None,
            student.FeedForward(d_model, d_ff, "relu" if mistake == "hard-coded relu" else activation, dropout),
            norm1,
            student.LayerNorm(d_model) if cross or mistake == "norm2 always" else None,
            norm1 if mistake == "shared norm" else student.LayerNorm(d_model),
            0.0 if mistake == "layer dropout" else dropout,
            False if mistake == "no norm_first" else norm_first,
        )

    return build


def test_checks_pass_on_the_solution(capsys):
    check_target_mask(student.target_mask)
    check_decoder_layer_init(student.DecoderLayer)
    check_build_decoder_layer(student.build_decoder_layer)
    check_decoder_layer_post_norm(student.DecoderLayer)
    check_decoder_layer_pre_norm(student.DecoderLayer)
    check_greedy(student.greedy)
    check_logits_that_change(student.logits_that_change)
    out = capsys.readouterr()
    assert out.out.count("✔") == 7 and out.err == ""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_checks_pass_in_float64_on_other_seeds(seed):
    check_target_mask(student.target_mask, seed=seed)
    check_decoder_layer_post_norm(student.DecoderLayer, seed=seed, dtype=torch.float64)
    check_decoder_layer_pre_norm(student.DecoderLayer, seed=seed, dtype=torch.float64)
    check_greedy(student.greedy, seed=seed, dtype=torch.float64)
    check_logits_that_change(student.logits_that_change, seed=seed, dtype=torch.float64)


def test_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(60):
        s = _sizes(seed)
        assert len(set(s.values())) == len(s) and s["d_model"] == s["heads"] * s["d_head"]


def _stub(*args, **kwargs):
    raise NotImplementedError()


class StubLayer(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError()


@pytest.mark.parametrize("check", [check_target_mask, check_greedy, check_logits_that_change])
def test_function_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(_stub)


@pytest.mark.parametrize("check", [check_decoder_layer_init, check_decoder_layer_post_norm,
                                   check_decoder_layer_pre_norm])
def test_layer_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(StubLayer)


def test_builder_check_fails_on_the_stub():
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_build_decoder_layer(_stub)


# Mistakes in target_mask.
def _padding_only(tgt, pad_id):
    return student.padding_mask(tgt, pad_id)


def _causal_only(tgt, pad_id):
    return student.causal_mask(tgt.shape[1])


def _either(tgt, pad_id):
    return student.padding_mask(tgt, pad_id) | student.causal_mask(tgt.shape[1])


def _upper(tgt, pad_id):
    return student.padding_mask(tgt, pad_id) & student.causal_mask(tgt.shape[1]).T


def _no_diagonal(tgt, pad_id):
    return student.padding_mask(tgt, pad_id) & student.causal_mask(tgt.shape[1]).tril(-1)


@pytest.mark.parametrize(("fn", "message"), [
    (_padding_only, "only the padding mask"), (_causal_only, "only the causal mask"),
    (_either, r"with \| \(or\)"), (_upper, "upper triangle"), (_no_diagonal, "leaves out the diagonal"),
])
def test_target_mask_check_names_the_mistake(fn, message):
    with pytest.raises(CheckFailure, match=message):
        check_target_mask(fn)


# Mistakes in the decoder layer: the library's layer with one sublayer changed.
def layer_mistake(mistake):
    class Mistaken(student.DecoderLayer):
        def forward(self, x, memory, src_mask=None, tgt_mask=None, cache=None):
            add_and_norm = student.add_and_norm
            self_mask = None if mistake == "no target mask" else tgt_mask
            sc, cc = (None, None) if cache is None or mistake == "no cache" else (cache.self_attn, cache.cross_attn)
            x = add_and_norm(x, lambda h: self.self_attn(h, h, h, self_mask, cache=sc), self.norm1, self.dropout1,
                             self.norm_first)
            if mistake == "cross reads the decoder":
                def cross(h):
                    return self.cross_attn(h, h, h, src_mask, cache=cc)
            elif mistake == "no source mask":
                def cross(h):
                    return self.cross_attn(h, memory, memory, cache=cc)
            else:
                def cross(h):
                    return self.cross_attn(h, memory, memory, src_mask, cache=cc)
            if mistake == "normed memory":
                def cross(h):  # noqa: F811
                    m = self.norm2(memory)
                    return self.cross_attn(h, m, m, src_mask, cache=cc)
            if self.cross_attn is not None and mistake != "no cross-attention":
                if memory is None:
                    raise ValueError("this layer needs the encoder's memory")
                x = add_and_norm(x, cross, self.norm2, self.dropout2, self.norm_first)
            return add_and_norm(x, self.ffn, self.norm3, self.dropout3, self.norm_first)

    return Mistaken


@pytest.mark.parametrize(("check", "mistake", "message"), [
    (check_decoder_layer_post_norm, "cross reads the decoder", "reads its keys and values from the decoder"),
    (check_decoder_layer_pre_norm, "cross reads the decoder", "reads its keys and values from the decoder"),
    (check_decoder_layer_post_norm, "no target mask", "ignores tgt_mask"),
    (check_decoder_layer_pre_norm, "no source mask", "ignores src_mask"),
    (check_decoder_layer_post_norm, "no cross-attention", "leaves out cross-attention"),
    (check_decoder_layer_pre_norm, "normed memory", "normalised the encoder's memory"),
])
def test_layer_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(layer_mistake(mistake))


def test_mistake_free_layer_copy_passes():
    check_decoder_layer_post_norm(layer_mistake(""))
    check_decoder_layer_pre_norm(layer_mistake(""), seed=4, dtype=torch.float64)


def _constructor_mistake(mistake):
    """The library's layer with one mistake in what its constructor does with the parts it is given."""
    class Mistaken(student.DecoderLayer):
        def __init__(self, self_attn, cross_attn, ffn, norm1, norm2, norm3, dropout=0.1, norm_first=False):
            if mistake == "no refusals":  # the library's constructor, without its two ValueErrors
                nn.Module.__init__(self)
                self.norm_first = norm_first
                self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
                self.norm1, self.norm2, self.norm3 = norm1, norm2, norm3
                self.dropout1, self.dropout3 = nn.Dropout(dropout), nn.Dropout(dropout)
                self.dropout2 = nn.Dropout(dropout) if cross_attn is not None else None
                return
            super().__init__(self_attn, cross_attn, ffn, norm1, norm2, norm3, dropout, norm_first)
            if mistake == "norms swapped":
                self.norm2, self.norm3 = norm3, norm2
            elif mistake == "own norm":
                self.norm1 = student.LayerNorm(norm1.weight.shape[0])
            elif mistake == "no dropout3":
                del self.dropout3
            elif mistake == "dropout2 always":
                self.dropout2 = nn.Dropout(dropout)
            elif mistake == "dropout p fixed":
                self.dropout1 = nn.Dropout(0.1)

    return Mistaken


@pytest.mark.parametrize(("mistake", "message"), [
    ("norms swapped", r"self\.norm2 holds the module given as norm3: the parameters come in the order"),
    ("own norm", r"self\.norm1 is not the module given as norm1: store the given part itself"),
    ("no dropout3", "gives a layer without dropout3"),
    ("dropout2 always", r"DecoderLayer\(self_attn, None, .* gives a layer with a dropout2: a decoder-only block"),
    ("dropout p fixed", r"dropout1\.p is 0\.1: pass dropout on"),
    ("no refusals", r"DecoderLayer\(self_attn, cross_attn, ffn, norm1, None, norm3\) should raise a ValueError"),
])
def test_init_check_names_mistakes_in_the_constructor(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_decoder_layer_init(_constructor_mistake(mistake))


def test_init_check_names_a_shared_norm_that_the_layer_lets_through():
    class RefusesUnpairedOnly(student.DecoderLayer):
        """The library's constructor, refusing a cross_attn without norm2 but not a norm in two places."""
        def __init__(self, self_attn, cross_attn, ffn, norm1, norm2, norm3, dropout=0.1, norm_first=False):
            super().__init__(self_attn, cross_attn, ffn, norm1, norm2, student.LayerNorm(norm1.weight.shape[0]),
                             dropout, norm_first)
            self.norm3 = norm3

    with pytest.raises(CheckFailure, match=r"DecoderLayer\(self_attn, cross_attn, ffn, norm, norm2, norm\) should "
                                           r"raise a ValueError \(one norm in two sublayers"):
        check_decoder_layer_init(RefusesUnpairedOnly)


@pytest.mark.parametrize(("mistake", "message"), [
    ("shared norm", r"raised ValueError: two sublayers are given the same norm module"),
    ("norm2 always", r"raised ValueError: norm2 belongs to the cross-attention sublayer"),
    ("cross_attn inverted", r"\(8, 2, 11, dropout=0\.25, cross_attention=True\) raised ValueError: norm2 belongs"),
    ("one attention", "self_attn and cross_attn one and the same module: create two MultiHeadAttention"),
    ("attention dropout", r"self_attn\.dropout should drop with p=0\.25 too"),
    ("layer dropout", r"dropout1\.p 0\.0: pass dropout on to DecoderLayer"),
    ("hard-coded relu", r"Built with activation='gelu', the FFN of your build_decoder_layer's layer computes ReLU"),
    ("no norm_first", r"Built with norm_first=True, .* pass norm_first on to DecoderLayer"),
    ("always cross-attention", "cross_attention=False .* self.cross_attn should be None"),
])
def test_builder_check_names_mistakes_in_the_choice_of_parts(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_build_decoder_layer(builder_for(student.DecoderLayer, mistake))


# Mistakes in greedy generation.
def _greedy_mistake(mistake):
    def wrong(model, src, max_new_tokens, bos_id, eos_id, next_logits):
        src_mask = student.padding_mask(src, model.pad_id)
        memory = model.encode(src, src_mask)
        tokens = torch.full((src.shape[0], 1), bos_id)
        finished = torch.zeros(src.shape[0], dtype=torch.bool)
        steps = []
        for _ in range(max_new_tokens):
            logits = next_logits(tokens, memory, src_mask)
            steps.append(logits)
            token = logits.argmax(-1)
            if mistake != "no padding":
                token = token.masked_fill(finished, model.pad_id)
            tokens = torch.cat([tokens, token[:, None]], dim=1)
            finished |= token == eos_id
            if mistake == "first eos" and finished.any():
                break
            if mistake != "all steps" and finished.all():
                break
        if mistake == "all steps":
            tokens = torch.cat([tokens, torch.full((src.shape[0], max_new_tokens + 1 - tokens.shape[1]),
                                                   model.pad_id)], 1)
        return tokens, torch.stack(steps, 1)

    return wrong


@pytest.mark.parametrize(("mistake", "message"), [
    ("first eos", "stops every sentence at the first EOS"),
    ("no padding", "keeps writing its argmax tokens"),
    ("all steps", "always runs max_new_tokens"),
])
def test_greedy_check_names_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_greedy(_greedy_mistake(mistake))


def test_greedy_check_wants_logits_and_bos():
    with pytest.raises(CheckFailure, match=r"tuple \(tokens, logits\)"):
        check_greedy(lambda *args: _greedy_mistake("")(*args)[0])
    with pytest.raises(CheckFailure, match="start with bos_id"):
        check_greedy(lambda *args: tuple(t[:, 1:] if i == 0 else t
                                         for i, t in enumerate(_greedy_mistake("")(*args))))


# Mistakes in the measurement.
def _assumed(model, src, tgt, position, token):
    return (torch.arange(tgt.shape[1]) >= position).expand(tgt.shape[0], -1).clone()


def _in_place(model, src, tgt, position, token):
    before = model(src, tgt)
    tgt[:, position] = token
    return (model(src, tgt) - before).abs().amax(-1) > 1e-6


def _per_vocab(model, src, tgt, position, token):
    changed = tgt.clone()
    changed[:, position] = token
    return (model(src, changed) - model(src, tgt)).abs() > 1e-6


@pytest.mark.parametrize(("fn", "message"), [
    (_assumed, "not a measurement"), (_in_place, "in place"), (_per_vocab, "reduce over vocab only"),
])
def test_measurement_check_names_the_mistake(fn, message):
    with pytest.raises(CheckFailure, match=message):
        check_logits_that_change(fn)


def test_using_the_reference_is_not_own_work():
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_decoder_layer_post_norm(stepformer.transformer.DecoderLayer)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_target_mask(stepformer.transformer.target_mask)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_greedy(stepformer.transformer.greedy)

    class UsesPyTorch(nn.Module):
        def __init__(self, self_attn, cross_attn, ffn, norm1, norm2, norm3, dropout=0.1, norm_first=False):
            super().__init__()
            self.inner = nn.TransformerDecoderLayer(norm1.weight.shape[0], 1, 4, dropout, batch_first=True)

    def builds_pytorch_layer(d_model, heads, d_ff, dropout=0.1, norm_first=False, activation="relu",
                             cross_attention=True):
        return nn.TransformerDecoderLayer(d_model, heads, d_ff, dropout, activation, batch_first=True)

    with pytest.raises(CheckFailure, match="Not your own work"):
        check_decoder_layer_init(UsesPyTorch)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_build_decoder_layer(builds_pytorch_layer)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_build_decoder_layer(stepformer.transformer.build_decoder_layer)


def test_replay_of_a_module_check_needs_no_module(monkeypatch, tmp_path):
    for folder, cls in ((tmp_path / "right", student.DecoderLayer),
                        (tmp_path / "wrong", layer_mistake("cross reads the decoder"))):
        monkeypatch.setenv(RECORD_ENV, str(folder))
        try:
            check_decoder_layer_post_norm(cls, seed=2)
        except CheckFailure:
            pass
        monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path / "right"):
        check_decoder_layer_post_norm(object(), seed=2)  # the object is never touched
    with replaying(tmp_path / "wrong"), pytest.raises(CheckFailure, match="from the decoder"):
        check_decoder_layer_post_norm(object(), seed=2)


def test_causal_mask_in_target_mask_is_the_library_one():
    tokens = torch.tensor([[4, 5, 0]])
    assert torch.equal(target_mask(tokens, 0)[0, 0], causal_mask(3) & padding_mask(tokens, 0)[0, 0])


def test_target_mask_check_names_a_single_mask_refused_by_the_signature():
    """With the notebook's annotated signature, one mask alone fails the return type: the check still names it."""
    from beartype import beartype
    from jaxtyping import Bool, Int, jaxtyped
    from torch import Tensor

    @jaxtyped(typechecker=beartype)
    def padding_only(tgt: Int[Tensor, "batch tgt_len"], pad_id: int) -> Bool[Tensor, "batch 1 tgt_len tgt_len"]:
        return student.padding_mask(tgt, pad_id)

    @jaxtyped(typechecker=beartype)
    def causal_only(tgt: Int[Tensor, "batch tgt_len"], pad_id: int) -> Bool[Tensor, "batch 1 tgt_len tgt_len"]:
        return student.causal_mask(tgt.shape[1])

    with pytest.raises(CheckFailure, match="padding mask alone"):
        check_target_mask(padding_only)
    with pytest.raises(CheckFailure, match="causal mask alone"):
        check_target_mask(causal_only)


# Options the checks once left unexercised (the check audit's gaps 2, 3, 5, 6, 19, 20, 32): each mistake below
# passed the earlier checks.

def option_mistake(mistake):
    """The library's layer, written out, with one mistake in an option the earlier checks never used."""
    class Mistaken(student.DecoderLayer):
        def forward(self, x, memory, src_mask=None, tgt_mask=None, cache=None):
            add_and_norm = student.add_and_norm
            if mistake == "memory always needed" and memory is None:
                raise ValueError("the decoder needs the encoder's memory")
            if mistake == "mask always given":
                tgt_mask = tgt_mask.bool()
            if cache is None:
                extra = ({}, {})
            elif mistake == "swapped caches":
                extra = ({"cache": cache.cross_attn}, {"cache": cache.self_attn})
            elif mistake == "whole cache":
                extra = ({"cache": cache}, {"cache": cache})
            elif mistake == "no cross cache":
                extra = ({"cache": cache.self_attn}, {})
            else:
                extra = ({"cache": cache.self_attn}, {"cache": cache.cross_attn})
            x = add_and_norm(x, lambda h: self.self_attn(h, h, h, tgt_mask, **extra[0]), self.norm1, self.dropout1,
                             self.norm_first)
            if self.cross_attn is not None:
                if memory is None and mistake != "no memory check":
                    raise ValueError("this layer has cross-attention and needs the encoder's memory")
                x = add_and_norm(x, lambda h: self.cross_attn(h, memory, memory, src_mask, **extra[1]), self.norm2,
                                 nn.Identity() if mistake == "no dropout2" else self.dropout2, self.norm_first)
            return add_and_norm(x, self.ffn, self.norm3, nn.Identity() if mistake == "no dropout3" else self.dropout3,
                                self.norm_first)

    return Mistaken


def test_option_mistake_free_layer_passes():
    check_decoder_layer_init(option_mistake(""))
    check_decoder_layer_post_norm(option_mistake(""))
    check_decoder_layer_pre_norm(option_mistake(""), seed=3, dtype=torch.float64)


@pytest.mark.parametrize(("check", "mistake", "message"), [
    (check_decoder_layer_post_norm, "no dropout2", "skips dropout2"),
    (check_decoder_layer_pre_norm, "no dropout3", "skips dropout3"),
    (check_decoder_layer_init, "no memory check", "memory=None should raise a ValueError"),
    (check_decoder_layer_pre_norm, "memory always needed", "Without cross-attention the layer needs no memory"),
    (check_decoder_layer_post_norm, "mask always given", r"tgt_len=1\) and tgt_mask=None: .*raised AttributeError"),
    (check_decoder_layer_post_norm, "swapped caches", "got the cross-attention cache and the other way round"),
    (check_decoder_layer_pre_norm, "whole cache", "not the LayerCache itself"),
    (check_decoder_layer_post_norm, "no cross cache", "cross_attn got none as its cache"),
])
def test_layer_checks_name_mistakes_in_the_options(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(option_mistake(mistake))


def test_layer_check_failures_give_the_sizes_and_the_largest_difference():
    with pytest.raises(CheckFailure) as failure:
        check_decoder_layer_post_norm(layer_mistake("no target mask"))
    assert "largest difference" in str(failure.value) and "on sizes batch=3, tgt_len=5, src_len=7" in str(failure.value)


def test_the_cache_path_is_checked(capsys):
    check_decoder_layer_post_norm(student.DecoderLayer)
    check_decoder_layer_post_norm(layer_mistake(""))
    shown = capsys.readouterr().out.splitlines()
    assert all("decoding with a LayerCache equals the causal pass" in line for line in shown[:2])
    # A layer that never hands its caches on is told so, by the log of what each attention was given.
    with pytest.raises(CheckFailure, match="your attention modules got cache=None at every step: pass "
                                           "cache.self_attn to self-attention"):
        check_decoder_layer_post_norm(layer_mistake("no cache"))


def _greedy_with(mistake):
    def wrong(model, src, max_new_tokens, bos_id, eos_id, next_logits):
        if mistake == "hard-coded ids":
            bos_id, eos_id = BOS, EOS
        if mistake == "model's next_logits":
            next_logits = model.next_logits
        if mistake == "no ValueError" and max_new_tokens < 1:
            return torch.full((src.shape[0], 1), bos_id), torch.zeros(src.shape[0], 0, model.vocab)
        tokens, logits = student.greedy(model, src, max_new_tokens, bos_id, eos_id, next_logits)
        if mistake == "squeezed":
            return tokens, logits.squeeze()
        return tokens, logits * 2 if mistake == "doubled logits" else logits
    return wrong


@pytest.mark.parametrize(("mistake", "message"), [
    ("hard-coded ids", r"tokens start with bos_id \(3\)"),
    ("model's next_logits", "calls model.next_logits: use the next_logits argument"),
    ("no ValueError", r"max_new_tokens=0, ...\) should raise a ValueError"),
    ("squeezed", r"logits should have shape \(batch=1, "),
    ("doubled logits", r"logits differ \(largest difference"),
])
def test_greedy_check_catches_ids_and_functions_not_taken_from_the_arguments(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_greedy(_greedy_with(mistake))


def test_measurement_check_catches_an_ignored_tol():
    def ignores_tol(model, src, tgt, position, token, tol=1e-6):
        return student.logits_that_change(model, src, tgt, position, token)

    with pytest.raises(CheckFailure, match="ignores tol") as failure:
        check_logits_that_change(ignores_tol)
    assert "on sizes batch=" in str(failure.value)


# Diagnoses that are verified before they are named (issue 27): each fires on its mistake and not on a similar one.

def test_target_mask_check_names_the_causal_mask_alone_only_when_the_value_is_it():
    from beartype import beartype
    from jaxtyping import Bool, Int, jaxtyped
    from torch import Tensor

    @jaxtyped(typechecker=beartype)
    def causal_only(tgt: Int[Tensor, "batch tgt_len"], pad_id: int) -> Bool[Tensor, "batch 1 tgt_len tgt_len"]:
        return student.causal_mask(tgt.shape[1])

    @jaxtyped(typechecker=beartype)
    def all_true(tgt: Int[Tensor, "batch tgt_len"], pad_id: int) -> Bool[Tensor, "batch 1 tgt_len tgt_len"]:
        return torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool)

    with pytest.raises(CheckFailure, match="returns the causal mask alone, without the padding mask"):
        check_target_mask(causal_only)
    with pytest.raises(CheckFailure, match="shape of the causal mask alone") as failure:
        check_target_mask(all_true)
    assert "returns the causal mask alone" not in str(failure.value)


def _init_mistake(mistake):
    """(check, student): the builder with a mistake in its cross_attention, or the layer with one in its forward."""
    if mistake in ("inverted", "never"):
        return check_build_decoder_layer, builder_for(student.DecoderLayer, mistake)

    class Mistaken(student.DecoderLayer):
        def forward(self, x, memory, src_mask=None, tgt_mask=None, cache=None):
            if mistake == "reads the cache":
                cache.self_attn  # noqa: B018
            if mistake == "other attribute":
                self.missing  # noqa: B018
            if mistake == "skips cross":
                add_and_norm = student.add_and_norm
                x = add_and_norm(x, lambda h: self.self_attn(h, h, h, tgt_mask), self.norm1, self.dropout1,
                                 self.norm_first)
                return add_and_norm(x, self.ffn, self.norm3, self.dropout3, self.norm_first)
            if mistake == "no memory check" and memory is None:
                return x
            return super().forward(x, memory, src_mask, tgt_mask, cache)

    return check_decoder_layer_init, Mistaken


@pytest.mark.parametrize(("mistake", "named", "not_named"), [
    ("inverted", "the condition is inverted", "no parameter"),
    ("never", r"gives the layer no cross-attention \(self.cross_attn is None\): create it", "inverted"),
    ("reads the cache", "Read the cache's parts only when cache is not None", "should raise a ValueError"),
    ("other attribute", "raised AttributeError", "cache"),
    ("skips cross", "never calls self.cross_attn", "raised"),
    ("no memory check", "should raise a ValueError", "never calls"),
])
def test_init_check_names_only_verified_mistakes(mistake, named, not_named):
    with pytest.raises(CheckFailure, match=named) as failure:
        check, wrong = _init_mistake(mistake)
        check(wrong)
    assert not_named not in str(failure.value)


def _loop(mistake):
    """The greedy loop with one mistake in a size, an axis or the finished flags."""
    def loop(model, src, max_new_tokens, bos_id, eos_id, next_logits):
        if max_new_tokens < 1:
            raise ValueError("at least one step")
        src_mask = student.padding_mask(src, model.pad_id)
        memory = model.encode(src, src_mask)
        rows = src.shape[1] if mistake == "rows from src_len" else src.shape[0]
        tokens = torch.full((rows, 0 if mistake == "no start" else 1), bos_id)
        finished = torch.zeros(src.shape[0], dtype=torch.bool)
        steps = []
        for _ in range(max_new_tokens):
            logits = next_logits(tokens, memory, src_mask)
            steps.append(logits)
            dims = {"argmax of all": {}, "argmax over batch": {"dim": 0}}
            token = logits.argmax(**dims.get(mistake, {"dim": -1}))
            token = token.masked_fill(finished, model.pad_id)
            if mistake == "wrong token":
                token = (token + 1) % model.vocab
            tokens = torch.cat([tokens, token[:, None]], dim=0 if mistake == "rows" else 1)
            if mistake == "not eos":
                finished |= token != eos_id
            elif mistake == "reset":
                finished = token == eos_id
            else:
                finished |= token == eos_id
            if finished.all():
                break
        return tokens, torch.stack(steps, dim=0 if mistake == "stack dim 0" else 1)

    return loop


@pytest.mark.parametrize(("mistake", "named"), [
    ("rows from src_len", r"read from the source's length axis, src\.shape\[1\]"),
    ("no start", r"shape \(4, 0\), one short"),
    ("argmax of all", "flattened into one row"),
    ("argmax over batch", r"over the batch axis \(logits\.argmax\(dim=0\)\)"),
    ("rows", "appended the new tokens as new rows, along dim 0"),
    ("not eos", "the comparison is inverted"),
    ("reset", "forgets the sentences that finished at earlier steps"),
    ("stack dim 0", "stacked along dim 0"),
])
def test_greedy_check_names_verified_loop_mistakes(mistake, named):
    with pytest.raises(CheckFailure, match=named) as failure:
        check_greedy(_loop(mistake))
    others = ("source's length axis", "one short", "flattened", "over the batch axis", "new rows", "inverted",
              "forgets the sentences", "stacked along dim 0")
    assert sum(other in str(failure.value) for other in others) == 1


def test_greedy_check_names_nothing_for_a_wrong_token_of_the_right_shape():
    with pytest.raises(CheckFailure, match="Each step: logits = next_logits") as failure:
        check_greedy(_loop("wrong token"))
    assert "axis" not in str(failure.value)
    check_greedy(_loop(""))


def _measured(mistake):
    def measure(model, src, tgt, position, token, tol=1e-6):
        changed = tgt.clone()
        changed[:, position] = token
        after, before = model(src, changed), model(src, tgt)
        change = {"no subtraction": after.abs(), "no abs": after - before}.get(mistake, (after - before).abs())
        reduce = {"min": change.amin, "mean": change.mean, "sum": change.sum}.get(mistake, change.amax)
        return reduce(dim=-1) > tol

    return measure


@pytest.mark.parametrize(("mistake", "named"), [
    ("no subtraction", "subtract the original run"),
    ("no abs", "largest signed change"),
    ("min", "smallest change over vocab"),
    ("mean", "mean change over vocab"),
])
def test_measurement_check_names_a_mistake_that_one_variant_explains(mistake, named):
    with pytest.raises(CheckFailure, match=named) as failure:
        check_logits_that_change(_measured(mistake))
    others = ("subtract the original run", "signed change", "smallest change", "mean change", "summed change")
    assert sum(other in str(failure.value) for other in others) == 1
    check_logits_that_change(_measured(""))


def test_measurement_check_names_no_variant_for_the_causal_pattern():
    with pytest.raises(CheckFailure, match="not a measurement") as failure:
        check_logits_that_change(_assumed)
    assert "change over vocab" not in str(failure.value)


def test_target_mask_check_names_an_index_past_the_shape_only_when_one_is_read():
    def past_the_end(tgt, pad_id):
        return student.padding_mask(tgt, pad_id) & student.causal_mask(tgt.shape[2])

    def other_index_error(tgt, pad_id):
        return student.padding_mask(tgt, pad_id) & student.causal_mask([tgt.shape[1]][1])

    with pytest.raises(CheckFailure, match=r"reads tgt\.shape\[2\], but tgt has two axes"):
        check_target_mask(past_the_end)
    with pytest.raises(CheckFailure, match="IndexError") as failure:
        check_target_mask(other_index_error)
    assert "reads tgt.shape" not in str(failure.value)


def _message(check, student):
    with pytest.raises(CheckFailure) as failure:
        check(student)
    return str(failure.value)


@pytest.mark.parametrize(("check", "student"), [
    (check_target_mask, lambda tgt, pad_id: student.padding_mask(tgt, pad_id) & student.causal_mask(tgt.shape[2])),
    _init_mistake("inverted"),
    _init_mistake("reads the cache"),
    _init_mistake("skips cross"),
    (check_build_decoder_layer, builder_for(student.DecoderLayer, "no norm_first")),
    (check_build_decoder_layer, builder_for(student.DecoderLayer, "hard-coded relu")),
    (check_decoder_layer_init, _constructor_mistake("norms swapped")),
    *((check_greedy, _loop(mistake)) for mistake in ("rows from src_len", "argmax over batch", "rows", "reset")),
    (check_logits_that_change, _measured("no abs")),
])
def test_a_verified_diagnosis_replays_as_it_was_recorded(monkeypatch, tmp_path, check, student):
    """The grader replays the recorded calls: the diagnosis's extra calls must come back the same."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    recorded = _message(check, student)
    monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path):
        assert _message(check, object()) == recorded
