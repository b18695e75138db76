"""Chapter 12's models against Hugging Face's: the same logits from the same weights, and the same tokens.

Every Hugging Face model is built from a config with random weights (nothing is downloaded);
its weights are copied into the course's model by stepformer.huggingface, then both run on the
same random tokens. LLaMA's RMSNorm computes in float32 whatever the dtype, so LLaMA is compared
in float32 only; GPT-2, BERT and Marian also in float64. Sampling is compared with Hugging Face's
logits processors, LoRA with peft.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config builds a model without the network; never fetch

import peft  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from stepformer import huggingface as hf_convert  # noqa: E402
from stepformer.ffn import FeedForward  # noqa: E402
from stepformer.masks import causal_mask  # noqa: E402
from stepformer.models import (  # noqa: E402
    LanguageModel,
    LlamaBlock,
    LoRALinear,
    add_lora,
    filter_logits,
    generate,
    merge_lora,
    sample_next,
)
from stepformer.parts import ComplexRotaryEmbedding, ModelConfig, configured_transformer, decoder_layer  # noqa: E402
from stepformer.positional import RotaryEmbedding  # noqa: E402
from tests.fixtures.student import failure_of  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def randomise(model: nn.Module, seed: int, skip: tuple[str, ...] = ()) -> nn.Module:
    """Weights far from any initialisation (norm weights and biases included), so that a mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in skip):
                continue
            # Norm weights around 1, everything else around 0: either way far from where they started.
            centre = 1.0 if p.dim() == 1 and "norm" in name.lower() and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if p.dim() == 1 else 0.15) + centre)
    return model


def tokens(seed: int, batch: int, seq: int, vocab: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    difference = (ours - theirs).abs().max().item()
    assert difference < TOLERANCE[dtype], f"{what}: max |ours - theirs| = {difference:.2e} in {dtype}"


LLAMA_CONFIGS = [  # (hidden, layers, heads, kv_heads, intermediate, vocab)
    (32, 2, 4, 2, 48, 50),  # GQA
    (48, 1, 6, 1, 64, 37),  # MQA
    (64, 3, 4, 4, 96, 71),  # MHA
]


@pytest.mark.parametrize("hidden, layers, heads, kv_heads, intermediate, vocab", LLAMA_CONFIGS)
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fast", [True, False])  # PyTorch's fused parts, or the chapters' own
def test_llama_logits_equal_huggingfaces(hidden, layers, heads, kv_heads, intermediate, vocab, tie, fast) -> None:
    config = transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    theirs = randomise(transformers.LlamaForCausalLM(config), seed=hidden + layers).eval()
    ours = hf_convert.from_llama(theirs, fast=fast).eval()
    for seed, (batch, seq) in enumerate([(1, 1), (3, 9), (2, 33)]):
        x = tokens(seed, batch, seq, vocab)
        assert_close(ours(x), theirs(x).logits, torch.float32, f"LLaMA {hidden}/{heads}/{kv_heads}, {batch}x{seq}")
    # Their padding (a 0 in attention_mask) is our padding mask; only the real positions are compared.
    x = tokens(7, 2, 10, vocab)
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, 6:] = False
    got, expected = ours(x, real), theirs(x, attention_mask=real.long()).logits
    assert_close(got[real], expected[real], torch.float32, "LLaMA with right padding")


def test_the_course_rope_pairs_differ_from_llamas_until_converted() -> None:
    """Without the row reordering of chapter 06's pairs, the logits differ: the conversion is needed."""
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=48, vocab_size=40)
    theirs = randomise(transformers.LlamaForCausalLM(config), seed=3).eval()
    ours = hf_convert.from_llama(theirs).eval()
    layer, their_layer = ours.decoder.layers[0], theirs.model.layers[0]
    with torch.no_grad():
        layer.self_attn.w_q.weight.copy_(their_layer.self_attn.q_proj.weight)
        layer.self_attn.w_k.weight.copy_(their_layer.self_attn.k_proj.weight)
    x = tokens(0, 2, 12, 40)
    assert (ours(x) - theirs(x).logits).abs().max() > 1e-3


GPT2_CONFIGS = [  # (n_embd, n_layer, n_head, vocab, activation)
    (32, 2, 4, 50, "gelu_new"),
    (48, 1, 3, 29, "gelu"),
    (64, 3, 8, 61, "relu"),
]


@pytest.mark.parametrize("n_embd, n_layer, n_head, vocab, activation", GPT2_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_logits_equal_huggingfaces(n_embd, n_layer, n_head, vocab, activation, dtype, tie) -> None:
    config = transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab, n_positions=40,
                                     activation_function=activation, bos_token_id=0, eos_token_id=0,
                                     tie_word_embeddings=tie)
    theirs = randomise(transformers.GPT2LMHeadModel(config), seed=n_embd).to(dtype).eval()
    ours = hf_convert.from_gpt2(theirs).eval()
    for seed, (batch, seq) in enumerate([(1, 1), (2, 17), (3, 40)]):
        x = tokens(seed, batch, seq, vocab)
        assert_close(ours(x), theirs(x).logits, dtype,
                     f"GPT-2 {n_embd}/{n_head}/{activation}, tie={tie}, {batch}x{seq}")


def test_gpt2s_tanh_gelu_is_not_the_exact_one() -> None:
    """GPT-2's "gelu_new" needs the tanh approximation: with the exact GELU the logits move."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=30, n_positions=20,
                                     activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    theirs = randomise(transformers.GPT2LMHeadModel(config), seed=5).to(torch.float64).eval()
    ours = hf_convert.from_gpt2(theirs).eval()
    for layer in ours.decoder.layers:
        # Chapter 04's FeedForward, built with activation="gelu_tanh"; swapped here for the exact GELU.
        assert type(layer.ffn) is FeedForward and layer.ffn.activation.approximate == "tanh"
        layer.ffn.activation = nn.GELU()
    x = tokens(0, 2, 12, 30)
    assert (ours(x) - theirs(x).logits).abs().max() > 1e-6


BERT_CONFIGS = [  # (hidden, layers, heads, intermediate, vocab, segments)
    (32, 2, 4, 64, 50, 2),
    (48, 1, 6, 80, 33, 1),
    (64, 3, 2, 128, 71, 3),
]


@pytest.mark.parametrize("hidden, layers, heads, intermediate, vocab, segments", BERT_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_bert_masked_lm_logits_equal_huggingfaces(hidden, layers, heads, intermediate, vocab, segments, dtype,
                                                  fast, tie) -> None:
    config = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=40,
                                     type_vocab_size=segments, tie_word_embeddings=tie)
    theirs = randomise(transformers.BertForMaskedLM(config), seed=hidden).to(dtype).eval()
    head = theirs.cls.predictions
    # Untied, the head holds two output biases and its forward adds only decoder.bias: randomised apart, a
    # copy of the wrong one shows.
    assert tie or not torch.equal(head.decoder.bias, head.bias)
    ours = hf_convert.from_bert(theirs, fast=fast).eval()
    for seed, (batch, seq) in enumerate([(1, 1), (3, 13), (2, 40)]):
        x = tokens(seed, batch, seq, vocab)
        segment_ids = tokens(seed + 10, batch, seq, segments)
        real = torch.ones(batch, seq, dtype=torch.bool)
        real[0, seq // 2 + 1:] = False  # a padded sentence: its padding is read by no one
        got = ours(x, real, segment_ids)
        expected = theirs(x, attention_mask=real.long(), token_type_ids=segment_ids).logits
        assert_close(got[real], expected[real], dtype, f"BERT {hidden}/{heads}, tie={tie}, {batch}x{seq}")


def test_a_bert_configured_as_a_decoder_is_refused() -> None:
    """is_decoder=True makes BertForMaskedLM's self-attention causal; the course's EncoderModel reads both ways."""
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=30, max_position_embeddings=20, is_decoder=True)
    with pytest.raises(ValueError, match="is_decoder"):
        hf_convert.from_bert(transformers.BertForMaskedLM(config))


MARIAN_CONFIGS = [  # (d_model, encoder layers, decoder layers, heads, ffn, vocab, activation)
    (32, 2, 2, 4, 64, 50, "relu"),
    (48, 1, 3, 6, 96, 41, "gelu"),
    (64, 3, 1, 2, 80, 67, "relu"),
]


def marian_config(d_model, enc, dec, heads, ffn, vocab, activation) -> transformers.MarianConfig:
    """One of MARIAN_CONFIGS, laid out as opus-mt is: the decoder starts with the padding id."""
    return transformers.MarianConfig(
        d_model=d_model, encoder_layers=enc, decoder_layers=dec, encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, vocab_size=vocab,
        max_position_embeddings=48, pad_token_id=0, decoder_start_token_id=0, scale_embedding=True,
        activation_function=activation,
    )  # fmt: skip


@pytest.mark.parametrize("d_model, enc, dec, heads, ffn, vocab, activation", MARIAN_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_marian_logits_equal_huggingfaces(d_model, enc, dec, heads, ffn, vocab, activation, dtype) -> None:
    theirs = transformers.MarianMTModel(marian_config(d_model, enc, dec, heads, ffn, vocab, activation))
    randomise(theirs, seed=d_model, skip=("embed_positions",))  # its sinusoidal table is fixed, not learned
    with torch.no_grad():
        theirs.final_logits_bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    theirs = theirs.to(dtype).eval()
    ours = hf_convert.from_marian(theirs).eval()
    for seed, (batch, src_len, tgt_len) in enumerate([(1, 1, 1), (3, 11, 7), (2, 30, 45)]):
        src = tokens(seed, batch, src_len, vocab, low=1)
        src[0, max(1, src_len - 3):] = 0  # padded source sentence
        tgt = tokens(seed + 5, batch, tgt_len, vocab, low=1)
        expected = theirs(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
        assert_close(ours(src, tgt), expected, dtype, f"Marian {d_model}/{heads}, {batch}x{src_len}->{tgt_len}")


@pytest.mark.parametrize("d_model, enc, dec, heads, ffn, vocab, activation", MARIAN_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_marian_reads_its_start_token_although_it_is_the_padding_id(d_model, enc, dec, heads, ffn, vocab,
                                                                    activation, dtype) -> None:
    """The opus-mt layout: every target starts with decoder_start_token_id == pad_token_id, read by every position."""
    theirs = transformers.MarianMTModel(marian_config(d_model, enc, dec, heads, ffn, vocab, activation))
    randomise(theirs, seed=d_model + 1, skip=("embed_positions",))
    theirs = theirs.to(dtype).eval()
    ours = hf_convert.from_marian(theirs).eval()
    for seed, (batch, src_len, tgt_len) in enumerate([(1, 4, 1), (3, 11, 7), (2, 30, 45)]):
        src = tokens(seed, batch, src_len, vocab, low=1)
        src[0, max(1, src_len - 3):] = 0
        tgt = tokens(seed + 5, batch, tgt_len, vocab, low=1)
        tgt[:, 0] = theirs.config.decoder_start_token_id  # as shift_tokens_right makes them from the labels
        tgt[-1, max(1, tgt_len - 3):] = 0  # a shorter sentence, padded at the end
        real = tgt != 0
        real[:, 0] = True  # the start token is not padding, whatever its id
        what = f"Marian {d_model}/{heads}, start = pad, {batch}x{src_len}->{tgt_len}"
        # Called as in training (no decoder mask, causal only), the start and the real tokens agree ...
        expected = theirs(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
        got = ours(src, tgt)
        assert_close(got[real], expected[real], dtype, what)
        # ... and every position, once Hugging Face too is told which target positions are padding.
        expected = theirs(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt,
                          decoder_attention_mask=real.long()).logits
        assert_close(got, expected, dtype, what + ", decoder_attention_mask given")


@pytest.mark.parametrize("layout", [
    dict(tie_word_embeddings=False),  # one table for both inputs, a separate output layer
    dict(share_encoder_decoder_embeddings=False),  # a source table, and a target table that is the output layer
    dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=37),  # a target vocabulary of its own
    dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=37, tie_word_embeddings=False),  # three tables
])
def test_marian_with_separate_tables_equals_huggingfaces(layout) -> None:
    config = transformers.MarianConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=50, max_position_embeddings=48, pad_token_id=0,
        decoder_start_token_id=1, scale_embedding=True, **layout,
    )  # fmt: skip
    theirs = transformers.MarianMTModel(config)
    randomise(theirs, seed=len(layout), skip=("embed_positions",))
    with torch.no_grad():
        theirs.final_logits_bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    theirs = theirs.to(torch.float64).eval()
    ours = hf_convert.from_marian(theirs).eval()
    src = tokens(0, 3, 9, config.vocab_size, low=1)
    src[0, 5:] = 0
    tgt = tokens(1, 3, 7, config.decoder_vocab_size, low=1)
    tgt[:, 0] = config.decoder_start_token_id
    expected = theirs(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
    assert_close(ours(src, tgt), expected, torch.float64, f"Marian with {layout}")


def test_marians_sines_come_first_and_the_reordering_matches_chapter_06s_code() -> None:
    from stepformer.positional import sinusoidal_encoding

    d_model, length = 16, 20
    marian = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(length, d_model)
    table = marian.create_weight()
    order = hf_convert.sines_first_order(d_model)
    assert torch.allclose(table[:, order], sinusoidal_encoding(length, d_model), atol=1e-6)
    assert not torch.allclose(table, sinusoidal_encoding(length, d_model), atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_generate_gives_huggingfaces_tokens(family: str) -> None:
    vocab = 43
    if family == "llama":
        config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=48, vocab_size=vocab,
                                          pad_token_id=0, bos_token_id=None, eos_token_id=None)
        theirs = randomise(transformers.LlamaForCausalLM(config), seed=11).eval()
        ours = hf_convert.from_llama(theirs).eval()
    else:
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, n_positions=64,
                                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
        theirs = randomise(transformers.GPT2LMHeadModel(config), seed=12).eval()
        ours = hf_convert.from_gpt2(theirs).eval()
    for seed, (batch, prompt_len) in enumerate([(1, 1), (3, 5)]):
        prompt = tokens(seed, batch, prompt_len, vocab)
        expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                                   do_sample=False)
        for use_cache in (True, False):
            got = generate(ours, prompt, 20, use_cache=use_cache)
            assert torch.equal(got, expected), f"{family}, cache={use_cache}: {got.tolist()} != {expected.tolist()}"


def llama_config(**changes) -> ModelConfig:
    values = dict(vocab=40, d_model=32, heads=4, kv_heads=2, layers=2, d_ff=48, norm="rms", norm_eps=1e-6,
                  placement="pre", ffn="swiglu", positions="rope", bias=False, fast=False)
    return ModelConfig(**(values | changes))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_written_out_llama_block_is_the_configured_decoder_layer(kv_heads: int) -> None:
    config = llama_config(kv_heads=kv_heads)
    configured = randomise(decoder_layer(config, cross_attention=False), seed=kv_heads).eval()
    block = LlamaBlock(32, 4, kv_heads, 48, eps=1e-6).eval()
    state = {name.replace("norm3", "norm2"): value for name, value in configured.state_dict().items()}
    block.load_state_dict(state)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    mask = causal_mask(9)
    assert torch.allclose(block(x, mask), configured(x, None, None, mask), atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_rope_as_a_complex_product_is_chapter_06s_rotation(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d_head = 2 * int(torch.randint(1, 33, (1,), generator=g))
    base = [10000.0, 500.0, 1e6, 10.0][seed]
    seq, heads = int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    positions = torch.randint(0, 4000, (seq,), generator=g)
    chapter_06, complex_product = RotaryEmbedding(d_head, base), ComplexRotaryEmbedding(d_head, base)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        x = torch.randn(3, heads, seq, d_head, generator=g, dtype=dtype)
        assert torch.allclose(complex_product(x, positions), chapter_06(x, positions), atol=tolerance)
    # A view whose pairs start at an odd offset (heads split from a wider projection) is turned as well.
    wide = torch.randn(3, seq, heads * d_head + 1, generator=g)[..., 1:]
    odd = wide.unflatten(-1, (heads, d_head)).transpose(1, 2)
    assert odd.storage_offset() % 2 == 1
    assert torch.allclose(complex_product(odd, positions), chapter_06(odd, positions), atol=1e-5)
    # Half precision is turned in float32 and rounded once: closer to the float64 rotation than chapter 06's.
    x = torch.randn(3, heads, seq, d_head, generator=g)
    exact = chapter_06(x.bfloat16().double(), positions)
    turned = complex_product(x.bfloat16(), positions)
    assert turned.dtype == torch.bfloat16
    assert (turned.double() - exact).abs().max() <= (chapter_06(x.bfloat16(), positions).double() - exact).abs().max()
    with pytest.raises(ValueError, match="d_head"):
        complex_product(torch.randn(2, seq, d_head + 2), positions)


@pytest.mark.parametrize("fast", [False, True])
def test_fast_models_turn_rope_as_complex_products_and_keep_chapter_06s_otherwise(fast: bool) -> None:
    model = LanguageModel(llama_config(fast=fast))
    ropes = [layer.self_attn.rope for layer in model.decoder.layers]
    assert all(type(rope) is (ComplexRotaryEmbedding if fast else RotaryEmbedding) for rope in ropes)
    assert all(rope.d_head == 8 for rope in ropes)


@pytest.mark.parametrize("fast", [False, True])
def test_cached_decoding_of_the_language_model_equals_one_causal_pass(fast: bool) -> None:
    model = randomise(LanguageModel(llama_config(fast=fast)), seed=2).eval()
    x = tokens(0, 2, 11, 40)
    full = model(x)
    from stepformer.kvcache import LayerCache

    cache = [LayerCache() for _ in model.decoder.layers]
    steps = [model(x[:, :4], cache=cache)]  # a prompt of 4, then one token at a time
    steps += [model(x[:, t:t + 1], cache=cache) for t in range(4, 11)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


# -- sampling against Hugging Face's logits processors and against the definitions -------------------------

@pytest.mark.parametrize("seed", range(4))
def test_top_k_and_top_p_keep_what_huggingfaces_warpers_keep(seed: int) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 97, generator=g) * (1 + seed)
    for k in (1, 3, 20, 97, 200):
        expected = TopKLogitsWarper(top_k=k)(None, logits.clone())
        assert torch.equal(filter_logits(logits, top_k=k).isinf(), expected.isinf()), f"top_k={k}"
    for p in (0.05, 0.3, 0.9, 0.999, 1.0):
        expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(filter_logits(logits, top_p=p).isinf(), expected.isinf()), f"top_p={p}"


@pytest.mark.parametrize("seed", range(4))
def test_the_nucleus_is_the_smallest_most_likely_set_with_mass_p(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, 50, generator=g) * 2  # leading axes are carried through
    for p in (0.1, 0.5, 0.8):
        kept = ~filter_logits(logits, top_p=p).isinf()
        probs = torch.softmax(logits, dim=-1)
        for row_probs, row_kept in zip(probs.reshape(-1, 50), kept.reshape(-1, 50), strict=True):
            inside, outside = row_probs[row_kept], row_probs[~row_kept]
            assert inside.sum() >= p - 1e-6, "the nucleus must hold at least p"
            assert inside.sum() - inside.min() < p, "without its least likely token it must fall below p"
            if outside.numel():
                assert inside.min() >= outside.max(), "every kept token is at least as likely as every dropped one"


def test_sampling_draws_from_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temperature, top_k = 0.8, 4
    expected = torch.softmax(filter_logits(logits / temperature, top_k=top_k), dim=-1)[0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits.expand(500, -1), temperature, top_k=top_k, generator=g)
                         for _ in range(20)]).flatten()
    frequencies = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert frequencies[4:].sum() == 0, "a token outside the top 4 was drawn"
    assert (frequencies - expected).abs().max() < 0.02, f"{frequencies} against {expected}"
    assert torch.equal(sample_next(logits, 0.0), logits.argmax(dim=-1)), "temperature 0 is greedy"


def test_bad_sampling_settings_are_refused() -> None:
    logits = torch.zeros(1, 5)
    for kwargs in ({"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            filter_logits(logits, **kwargs)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


# -- LoRA against peft -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("r, alpha", [(1, 1.0), (4, 8.0), (8, 32.0)])
def test_lora_on_the_converted_llama_equals_pefts_lora(r: int, alpha: float) -> None:
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, vocab_size=40)
    base = randomise(transformers.LlamaForCausalLM(config), seed=r).eval()
    ours = hf_convert.from_llama(base).eval()
    lora_config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                  init_lora_weights=False)  # B random too, so the update is not zero
    theirs = peft.get_peft_model(base, lora_config).eval()
    wrapped = add_lora(ours, ("w_q", "w_v"), r=r, alpha=alpha)
    assert len(wrapped) == 2 * config.num_hidden_layers
    for layer, their_layer in zip(ours.decoder.layers, theirs.base_model.model.model.layers, strict=True):
        for mine, name, reorder in ((layer.self_attn.w_q, "q_proj", True), (layer.self_attn.w_v, "v_proj", False)):
            their_lora = getattr(their_layer.self_attn, name)
            b = their_lora.lora_B["default"].weight
            if reorder:  # B writes the query rows, which LLaMA pairs differently (half_split_to_pairs)
                b = hf_convert.half_split_to_pairs(b, config.num_attention_heads)
            with torch.no_grad():
                mine.lora_a.weight.copy_(their_lora.lora_A["default"].weight)
                mine.lora_b.weight.copy_(b)
    x = tokens(0, 2, 10, 40)
    assert_close(ours(x), theirs(x).logits, torch.float32, f"LoRA r={r}")
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    theirs_trainable = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    assert trainable == theirs_trainable == 2 * r * (32 + 32) + 2 * r * (32 + 16)  # w_q 32->32, w_v 32->16
    merged_theirs = theirs.merge_and_unload()
    assert merge_lora(ours) == 4
    assert_close(ours(x), merged_theirs(x).logits, torch.float32, "merged LoRA")


def test_lora_starts_as_its_base_and_trains_only_its_own_weights() -> None:
    base = nn.Linear(12, 7)
    lora = LoRALinear(base, r=3, alpha=6.0, dropout=0.5)
    x = torch.randn(4, 5, 12)
    lora.eval()
    assert torch.equal(lora(x), base(x)), "B starts at zero: the layer starts equal to its base"
    with torch.no_grad():
        lora.lora_b.weight.normal_()
    expected = base(x) + 2.0 * x @ lora.lora_a.weight.T @ lora.lora_b.weight.T
    assert torch.allclose(lora(x), expected, atol=1e-5)
    assert torch.allclose(lora.merged()(x), expected, atol=1e-5)
    lora.train()
    assert not torch.allclose(lora(x), expected, atol=1e-3), "dropout acts on the LoRA path in training"
    lora(x).sum().backward()
    assert base.weight.grad is None and lora.lora_a.weight.grad is not None


def test_add_lora_refuses_a_target_that_matches_nothing() -> None:
    model = LanguageModel(llama_config())
    with pytest.raises(ValueError, match="q_proj"):
        add_lora(model, ("q_proj",), r=2, alpha=2.0)


def test_the_2017_transformer_is_built_from_its_configuration() -> None:
    """Chapter 10's attention and the norm the configuration names are there from the start, nothing swapped."""
    config = ModelConfig.original(30, d_model=16, heads=4, layers=1, d_ff=32, kv_heads=2, fast=True, final_norm=False)
    model = configured_transformer(config)
    layer = model.decoder.layers[0]
    assert layer.self_attn.kv_heads == 2 and layer.cross_attn.kv_heads == 2
    assert isinstance(layer.norm1, nn.LayerNorm) and isinstance(model.encoder.norm, nn.Identity)


# -- the checks' diagnoses: each fires on its mistake, and not on a similar one -------------------------------

def edited(name: str, *edits: tuple[str, str]):
    """The library's ``name`` with its source edited, defined as a student would define it (not the library's)."""
    import stepformer.models
    from tests.fixtures.student import edited as edited_in

    return edited_in(stepformer.models, name, *edits)


def test_the_block_check_names_the_norm_that_keeps_rmsnorms_default_eps() -> None:
    from stepformer.checks.models import _block_reference, _block_sizes, _block_state, _diagnose_block

    s = _block_sizes(0)
    state = _block_state(s, s["kv_heads"], torch.float64, 5)
    x = 0.2 * torch.randn(s["batch"], s["seq"], s["d_model"], dtype=torch.float64)
    mask = torch.ones(s["seq"], s["seq"], dtype=torch.bool).tril()

    def diagnosis(eps) -> str:
        output = _block_reference(state, s["heads"], s["kv_heads"], x, mask, eps)
        return _diagnose_block(state, s["heads"], s["kv_heads"], x, mask, 0.1, output)

    assert "Your norm1 uses eps=1e-6" in diagnosis((1e-6, 0.1))
    assert "Your norm2 uses eps=1e-6" in diagnosis((0.1, 1e-6))
    assert "Your RMSNorms use eps=1e-6" in diagnosis((1e-6, 1e-6))
    assert "eps=1e-6" not in diagnosis((0.1, 0.01))  # another eps: not RMSNorm's default


def test_the_filter_checks_name_the_step_that_runs_with_its_option_none() -> None:
    from stepformer.checks.models import check_top_k

    top_k = failure_of(check_top_k, edited("filter_logits", ("if top_k is not None:", "if top_k is None:")))
    top_p = failure_of(check_top_k, edited("filter_logits", ("if top_p is not None:", "if top_p is None:")))
    assert "uses top_k although top_k is None" in top_k and "top_p although" not in top_k
    assert "uses top_p although top_p is None" in top_p and "top_k although" not in top_p


def test_the_filter_checks_repeat_which_dim_was_asked_of_a_row() -> None:
    from stepformer.checks.models import check_top_p

    sort = failure_of(check_top_p, edited("filter_logits", ("dim=-1), dim=-1)", "dim=-1), dim=-2)")))
    scatter = failure_of(check_top_p, edited("filter_logits", (".scatter(-1, order", ".scatter(0, order")))
    assert "asks a tensor with 1 axis for dim=-2" in sort
    assert "asks a tensor" not in scatter and scatter != "passed"  # a batch fails, no dim out of range


def test_the_nucleus_check_tells_a_strict_comparison_at_an_exact_boundary() -> None:
    from stepformer.checks.models import check_top_p

    strict = failure_of(check_top_p, edited("filter_logits", ("dim=-1) <= 1.0 - top_p", "dim=-1) < 1.0 - top_p")))
    keep_all = failure_of(check_top_p, edited("filter_logits", ("<= 1.0 - top_p", "<= 0.0 - top_p")))
    assert "8 equally likely tokens" in strict and "equality goes the other way" in strict
    assert "You drop no token at all" in keep_all and "equality" not in keep_all


def test_the_nucleus_check_names_the_decision_forced_at_the_wrong_place() -> None:
    from stepformer.checks.models import check_top_p

    def forced(line: str) -> str:
        return failure_of(check_top_p, edited("filter_logits", ("drop_sorted[..., -1] = False", line)))

    first, second = forced("drop_sorted[..., 0] = False"), forced("drop_sorted[..., 1] = False")
    dropped = forced("drop_sorted[..., -1] = True")
    assert "the least likely token, position 0" in first
    assert "the second least likely token, position 1" in second
    assert "You drop the most likely token" in dropped and "position" not in dropped


@pytest.mark.parametrize("a", ["", ", a=5", ", a=math.sqrt(6)"])
def test_the_lora_check_measures_how_lora_a_is_drawn(a: str) -> None:
    from stepformer.checks.models import check_lora_init

    message = failure_of(check_lora_init, edited("LoRALinear", (", a=math.sqrt(5))", a + ")")))
    assert "nn.init.kaiming_uniform_ with a ≈" in message
    assert failure_of(check_lora_init, edited("LoRALinear")) == "passed"
    normal = failure_of(check_lora_init, edited("LoRALinear", (
        "nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))", "nn.init.normal_(self.lora_a.weight)")))
    assert "reach" in normal and "kaiming_uniform_ with a ≈" not in normal  # not uniform: no a to name


def test_the_lora_checks_name_an_inverted_rank_test_and_a_missing_update() -> None:
    from stepformer.checks.models import check_lora_init

    inverted = failure_of(check_lora_init, edited("LoRALinear", ("if r < 1:", "if not r < 1:")))
    at_most_one = failure_of(check_lora_init, edited("LoRALinear", ("if r < 1:", "if r <= 1:")))
    assert "your test of r is inverted" in inverted
    assert "inverted" not in at_most_one and "r=1" in at_most_one
    missing = failure_of(check_lora_init, edited("LoRALinear", (
        "return self.base(x) + self.scaling * self.lora_b(self.lora_a(self.dropout(x)))", "return self.base(x)")))
    frozen = failure_of(check_lora_init, edited("LoRALinear", (
        "nn.init.zeros_(self.lora_b.weight)", "nn.init.zeros_(self.lora_b.weight)\n        "
        "self.lora_b.requires_grad_(False)")))
    assert "your forward leaves out the update" in missing
    assert "leaves out" not in frozen


def test_the_merged_check_names_a_bias_test_the_wrong_way_and_a_weight_without_its_base() -> None:
    from stepformer.checks.models import check_lora_merged

    inverted = failure_of(check_lora_merged, edited("LoRALinear", ("bias=self.base.bias is not None",
                                                                  "bias=self.base.bias is None")))
    never = failure_of(check_lora_merged, edited("LoRALinear", ("bias=self.base.bias is not None", "bias=False")))
    assert "the test of base.bias is inverted" in inverted
    assert "inverted" not in never and never != "passed"
    update = failure_of(check_lora_merged, edited("LoRALinear", (
        "self.base.weight + self.scaling * self.lora_b.weight", "self.scaling * self.lora_b.weight")))
    base = failure_of(check_lora_merged, edited("LoRALinear", (
        "self.base.weight + self.scaling * self.lora_b.weight @ self.lora_a.weight", "self.base.weight")))
    assert "the update (alpha / r) · B A alone, without the base's weight" in update
    assert "the base's alone, without the update" in base and "B A alone" not in base
