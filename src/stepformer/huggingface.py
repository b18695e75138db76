"""Chapter 12: Hugging Face models as the course's models, weights copied across.

Each ``from_*`` function reads a ``transformers`` model's configuration, builds the course's model
of the same family from a :class:`~stepformer.parts.ModelConfig`, and copies every weight under
its new name. The outputs then agree to float rounding (tests/test_models.py), which is the
proof that LLaMA, GPT-2, BERT and Marian are the course's parts in other arrangements.

Two conversions are more than renaming. LLaMA's code pairs RoPE channel ``i`` with
``i + d_head / 2`` where chapter 06 pairs ``2i`` with ``2i + 1``: the rows of its query and key
projections are reordered so that the same pairs rotate together. Marian's sinusoidal code puts
every sine before every cosine where chapter 06 interleaves them: every weight that reads or
writes the residual stream is reordered along ``d_model`` to match.

``transformers`` is imported by the caller, not here: this module reads attributes only.
"""

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from stepformer.models import EncoderModel, LanguageModel
from stepformer.parts import ModelConfig, configured_transformer
from stepformer.transformer import Transformer


def _copy(target: Tensor, source: Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(f"cannot copy a {tuple(source.shape)} weight into a {tuple(target.shape)} one")
    with torch.no_grad():
        target.copy_(source)


def _linear(ours: nn.Linear, weight: Tensor, bias: Tensor | None = None) -> None:
    _copy(ours.weight, weight)
    if bias is not None:
        _copy(ours.bias, bias)
    elif ours.bias is not None:
        raise ValueError("the source layer has no bias where ours has one")


def _norm(ours: nn.Module, theirs: nn.Module) -> None:
    _copy(ours.weight, theirs.weight)
    if getattr(theirs, "bias", None) is not None:
        _copy(ours.bias, theirs.bias)


def _like(model: nn.Module, reference: Tensor) -> nn.Module:
    return model.to(dtype=reference.dtype, device=reference.device)


def _rope_base(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(f"only plain RoPE converts; this model scales it ({parameters['rope_type']!r})")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def half_split_to_pairs(weight: Tensor, heads: int) -> Tensor:
    """Reorder a query or key projection's rows from LLaMA's RoPE pairing to chapter 06's.

    LLaMA rotates channel ``i`` of a head with channel ``i + d_head / 2``; chapter 06 rotates
    ``2i`` with ``2i + 1``. Row ``(head, half, i)`` moves to ``(head, 2i + half)``. Scores are dot
    products, which do not change when queries and keys are reordered alike.
    """
    return rearrange(weight, "(heads half pair) d_model -> (heads pair half) d_model", heads=heads, half=2)


def from_llama(hf: nn.Module, fast: bool = True) -> LanguageModel:
    """The course's :class:`LanguageModel` with the weights of a ``LlamaForCausalLM``.

    LLaMA is RMSNorm, pre-norm, RoPE, SwiGLU and grouped-query attention, no biases, untied
    output layer (unless its config ties it). RoPE scaling (Llama 3.1's) and a base other than
    10000 are refused: chapter 06's rotary embedding has the plain schedule with that base.
    """
    c = hf.config
    if c.hidden_act != "silu":
        raise ValueError(f"LLaMA's feed-forward is SwiGLU (silu); this config has {c.hidden_act!r}")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("only LLaMA without biases converts (attention_bias=False, mlp_bias=False)")
    if c.head_dim != c.hidden_size // c.num_attention_heads:
        raise ValueError(f"head_dim {c.head_dim} must be hidden_size / heads, as in the course's attention")
    if _rope_base(c) != 10000.0:
        raise ValueError(f"chapter 06's RoPE has base 10000; this config has {_rope_base(c)}")
    config = ModelConfig(
        vocab=c.vocab_size, d_model=c.hidden_size, heads=c.num_attention_heads, layers=c.num_hidden_layers,
        d_ff=c.intermediate_size, kv_heads=c.num_key_value_heads, norm="rms", norm_eps=c.rms_norm_eps,
        placement="pre", final_norm=True, ffn="swiglu", positions="rope", max_len=c.max_position_embeddings,
        bias=False, tie_embeddings=bool(c.tie_word_embeddings), fast=fast,
    )  # fmt: skip
    ours = _like(LanguageModel(config), hf.lm_head.weight)
    _copy(ours.embed.tokens.weight, hf.model.embed_tokens.weight)
    for layer, theirs in zip(ours.decoder.layers, hf.model.layers, strict=True):
        attention = theirs.self_attn
        _linear(layer.self_attn.w_q, half_split_to_pairs(attention.q_proj.weight, config.heads))
        _linear(layer.self_attn.w_k, half_split_to_pairs(attention.k_proj.weight, layer.self_attn.kv_heads))
        _linear(layer.self_attn.w_v, attention.v_proj.weight)
        _linear(layer.self_attn.w_o, attention.o_proj.weight)
        _linear(layer.ffn.w_gate, theirs.mlp.gate_proj.weight)
        _linear(layer.ffn.w_up, theirs.mlp.up_proj.weight)
        _linear(layer.ffn.w_down, theirs.mlp.down_proj.weight)
        _norm(layer.norm1, theirs.input_layernorm)
        _norm(layer.norm3, theirs.post_attention_layernorm)
    _norm(ours.decoder.norm, hf.model.norm)
    if not config.tie_embeddings:
        _copy(ours.generator.weight, hf.lm_head.weight)
    return ours


def from_gpt2(hf: nn.Module, fast: bool = True) -> LanguageModel:
    """The course's :class:`LanguageModel` with the weights of a ``GPT2LMHeadModel``.

    GPT-2 is LayerNorm, pre-norm, learned positions, GELU (its tanh approximation,
    ``gelu_new``, or the exact one), biases everywhere, tied output layer. Its ``Conv1D``
    layers store the transpose of an ``nn.Linear`` weight, and one ``c_attn`` holds the query,
    key and value projections side by side.
    """
    c = hf.config
    activations = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
    if c.activation_function not in activations:
        raise ValueError(f"GPT-2's activation {c.activation_function!r} has no course counterpart")
    if c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn or not c.scale_attn_weights:
        raise ValueError("only GPT-2's standard attention converts (scores divided by sqrt(d_head), nothing else)")
    config = ModelConfig(
        vocab=c.vocab_size, d_model=c.n_embd, heads=c.n_head, layers=c.n_layer, d_ff=c.n_inner or 4 * c.n_embd,
        norm="layer", norm_eps=c.layer_norm_epsilon, placement="pre", final_norm=True,
        ffn=activations[c.activation_function], positions="learned", max_len=c.n_positions, bias=True,
        tie_embeddings=bool(c.tie_word_embeddings), fast=fast,
    )  # fmt: skip
    ours = _like(LanguageModel(config), hf.lm_head.weight)
    t = hf.transformer
    _copy(ours.embed.tokens.weight, t.wte.weight)
    _copy(ours.embed.positions.embedding.weight, t.wpe.weight)
    for layer, theirs in zip(ours.decoder.layers, t.h, strict=True):
        q, k, v = theirs.attn.c_attn.weight.T.chunk(3, dim=0)  # Conv1D: (in, out) -> nn.Linear's (out, in)
        q_bias, k_bias, v_bias = theirs.attn.c_attn.bias.chunk(3)
        _linear(layer.self_attn.w_q, q, q_bias)
        _linear(layer.self_attn.w_k, k, k_bias)
        _linear(layer.self_attn.w_v, v, v_bias)
        _linear(layer.self_attn.w_o, theirs.attn.c_proj.weight.T, theirs.attn.c_proj.bias)
        _linear(layer.ffn.linear1, theirs.mlp.c_fc.weight.T, theirs.mlp.c_fc.bias)
        _linear(layer.ffn.linear2, theirs.mlp.c_proj.weight.T, theirs.mlp.c_proj.bias)
        _norm(layer.norm1, theirs.ln_1)
        _norm(layer.norm3, theirs.ln_2)
    _norm(ours.decoder.norm, t.ln_f)
    if not config.tie_embeddings:
        _copy(ours.generator.weight, hf.lm_head.weight)
    return ours


def from_bert(hf: nn.Module, fast: bool = True) -> EncoderModel:
    """The course's :class:`EncoderModel` with the weights of a ``BertForMaskedLM``.

    BERT is the 2017 encoder (LayerNorm, post-norm, no final norm) with learned positions,
    segment embeddings, a LayerNorm on the embeddings, GELU, and a masked-LM head tied to the
    token table (or not, with ``tie_word_embeddings=False``).
    """
    c = hf.config
    if c.hidden_act not in ("gelu", "relu"):
        raise ValueError(f"BERT's activation {c.hidden_act!r} has no course counterpart")
    if getattr(c, "position_embedding_type", "absolute") != "absolute":
        raise ValueError("only BERT's absolute (learned) positions convert")
    if c.is_decoder:
        raise ValueError("is_decoder=True makes BERT's attention causal; the course's EncoderModel reads both ways")
    config = ModelConfig(
        vocab=c.vocab_size, d_model=c.hidden_size, heads=c.num_attention_heads, layers=c.num_hidden_layers,
        d_ff=c.intermediate_size, norm="layer", norm_eps=c.layer_norm_eps, placement="post", final_norm=False,
        ffn=c.hidden_act, positions="learned", max_len=c.max_position_embeddings, bias=True,
        tie_embeddings=bool(c.tie_word_embeddings), embedding_norm=True, segments=c.type_vocab_size, fast=fast,
    )  # fmt: skip
    head = hf.cls.predictions
    ours = _like(EncoderModel(config), head.decoder.weight)
    e = hf.bert.embeddings
    _copy(ours.embed.tokens.weight, e.word_embeddings.weight)
    _copy(ours.embed.positions.embedding.weight, e.position_embeddings.weight)
    _copy(ours.embed.segments.weight, e.token_type_embeddings.weight)
    _norm(ours.embed.norm, e.LayerNorm)
    for layer, theirs in zip(ours.encoder.layers, hf.bert.encoder.layer, strict=True):
        attention = theirs.attention.self
        _linear(layer.self_attn.w_q, attention.query.weight, attention.query.bias)
        _linear(layer.self_attn.w_k, attention.key.weight, attention.key.bias)
        _linear(layer.self_attn.w_v, attention.value.weight, attention.value.bias)
        _linear(layer.self_attn.w_o, theirs.attention.output.dense.weight, theirs.attention.output.dense.bias)
        _norm(layer.norm1, theirs.attention.output.LayerNorm)
        _linear(layer.ffn.linear1, theirs.intermediate.dense.weight, theirs.intermediate.dense.bias)
        _linear(layer.ffn.linear2, theirs.output.dense.weight, theirs.output.dense.bias)
        _norm(layer.norm2, theirs.output.LayerNorm)
    _linear(ours.mlm_dense, head.transform.dense.weight, head.transform.dense.bias)
    _norm(ours.mlm_norm, head.transform.LayerNorm)
    if not config.tie_embeddings:
        _copy(ours.generator.weight, head.decoder.weight)
    # The forward adds decoder.bias. Tied, head.bias is that same tensor; untied, it is a second one that
    # nothing reads.
    _copy(ours.generator.bias, head.decoder.bias)
    return ours


def sines_first_order(d_model: int) -> Tensor:
    """Where each of chapter 06's channels sits in Marian's code: ``order[c]`` is Marian's channel for ours ``c``.

    Chapter 06 interleaves the pairs, (sin_0, cos_0, sin_1, cos_1, ...); Marian puts every sine
    first, (sin_0, sin_1, ..., cos_0, cos_1, ...). Our channel ``2i`` is Marian's ``i``, our
    ``2i + 1`` is Marian's ``d_model / 2 + i``.
    """
    return rearrange(torch.arange(d_model), "(sin_cos pair) -> (pair sin_cos)", sin_cos=2)


def from_marian(hf: nn.Module, fast: bool = True) -> Transformer:
    """Chapter 08's :class:`~stepformer.transformer.Transformer` with the weights of a ``MarianMTModel``.

    Marian is the 2017 Transformer: post-norm LayerNorm, no final norms, sinusoidal positions,
    embeddings scaled by sqrt(d_model) (``scale_embedding=True`` in its config), one table for
    source, target and output (or separate ones, the target's with ``decoder_vocab_size`` rows),
    and a ``final_logits_bias`` (our generator's bias). Its sines come before its cosines
    (:func:`sines_first_order`), so every weight along the residual stream is reordered to
    chapter 06's interleaved channels: the model then computes the same function with its
    channels in another order.

    Its published checkpoints start every target with the padding id
    (``decoder_start_token_id == pad_token_id``); the Transformer's ``forward`` reads position 0
    whatever its id, as Marian does. Marian hides the source's padding only when given
    ``attention_mask`` and the target's only when given ``decoder_attention_mask``; ours always
    hides ``pad_id`` (after the start token). With the source's mask given, the logits agree at
    the start token and every real target token; at the target's padding, which no loss reads,
    once ``decoder_attention_mask`` is given too.
    """
    c = hf.config
    if c.activation_function not in ("relu", "gelu"):
        raise ValueError(f"Marian's activation {c.activation_function!r}: only relu and gelu convert")
    if not c.scale_embedding:
        raise ValueError("chapter 08's embeddings are scaled by sqrt(d_model): convert a config with scale_embedding")
    if (c.encoder_attention_heads, c.encoder_ffn_dim) != (c.decoder_attention_heads, c.decoder_ffn_dim):
        raise ValueError("the encoder and decoder must have the same heads and d_ff in chapter 08's Transformer")
    m = hf.model
    # Our Transformer ties all three tables or none; where Marian ties only two, copies of the same values
    # compute the same function.
    shared = m.encoder.embed_tokens.weight is m.decoder.embed_tokens.weight is hf.lm_head.weight
    ours = configured_transformer(
        ModelConfig(
            vocab=c.decoder_vocab_size, d_model=c.d_model, heads=c.encoder_attention_heads, layers=c.decoder_layers,
            d_ff=c.encoder_ffn_dim, placement="post", final_norm=False, ffn=c.activation_function,
            positions="sinusoidal", max_len=c.max_position_embeddings, tie_embeddings=shared,
            scale_embeddings=True, dropout=0.0, fast=fast, src_vocab=c.vocab_size, encoder_layers=c.encoder_layers,
        ),
        pad_id=c.pad_token_id,
    )  # fmt: skip
    ours = _like(ours, hf.lm_head.weight)
    order = sines_first_order(c.d_model)
    # Along d_model everything is read in Marian's order and written in ours: `order` picks, for each of
    # our channels, the Marian channel it is.

    def reads(linear: nn.Linear, theirs: nn.Linear) -> None:  # in_features is d_model
        _linear(linear, theirs.weight[:, order], theirs.bias)

    def writes(linear: nn.Linear, theirs: nn.Linear) -> None:  # out_features is d_model
        _linear(linear, theirs.weight[order], theirs.bias[order])

    def norm(ours_norm: nn.Module, theirs: nn.Module) -> None:
        _copy(ours_norm.weight, theirs.weight[order])
        _copy(ours_norm.bias, theirs.bias[order])

    def attention(ours_attention: nn.Module, theirs: nn.Module) -> None:
        reads(ours_attention.w_q, theirs.q_proj)
        reads(ours_attention.w_k, theirs.k_proj)
        reads(ours_attention.w_v, theirs.v_proj)
        writes(ours_attention.w_o, theirs.out_proj)

    _copy(ours.src_embed.tokens.weight, m.encoder.embed_tokens.weight[:, order])
    _copy(ours.tgt_embed.tokens.weight, m.decoder.embed_tokens.weight[:, order])
    for layer, theirs in zip(ours.encoder.layers, m.encoder.layers, strict=True):
        attention(layer.self_attn, theirs.self_attn)
        norm(layer.norm1, theirs.self_attn_layer_norm)
        reads(layer.ffn.linear1, theirs.fc1)
        writes(layer.ffn.linear2, theirs.fc2)
        norm(layer.norm2, theirs.final_layer_norm)
    for layer, theirs in zip(ours.decoder.layers, m.decoder.layers, strict=True):
        attention(layer.self_attn, theirs.self_attn)
        norm(layer.norm1, theirs.self_attn_layer_norm)
        attention(layer.cross_attn, theirs.encoder_attn)
        norm(layer.norm2, theirs.encoder_attn_layer_norm)
        reads(layer.ffn.linear1, theirs.fc1)
        writes(layer.ffn.linear2, theirs.fc2)
        norm(layer.norm3, theirs.final_layer_norm)
    _linear(ours.generator, hf.lm_head.weight[:, order], hf.final_logits_bias[0])
    return ours
