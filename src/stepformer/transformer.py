"""Chapter 08: the decoder and the full encoder-decoder Transformer, with greedy generation.

The decoder layer adds masked self-attention and cross-attention to the encoder's pieces
(chapter 07); generation can read earlier keys and values from the KV-cache of chapter 09.
Parameter names follow ``torch.nn.Transformer``, so its weights copy across
(``load_torch_transformer``).
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from beartype import beartype
from einops import reduce
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.encoder import (
    Embedding,
    add_and_norm,
    build_encoder,
    encoder_from_torch,
    layer_from_torch,
    stack_from_torch,
)
from stepformer.ffn import FeedForward
from stepformer.masks import causal_mask, padding_mask
from stepformer.multihead import MultiHeadAttention
from stepformer.norms import LayerNorm

# One decoder layer's caches, chapter 09's kvcache.LayerCache: any object with a growing .self_attn and a fixed
# .cross_attn cache, each with the .update(keys, values) that the attention calls.
LayerCache = Any
# With a cache, a target mask spans the cached positions as well: `total` keys.
SourceMask = Bool[Tensor, "#batch #heads #tgt_len #src_len"] | None
TargetMask = Bool[Tensor, "#batch #heads #tgt_len #total"] | Bool[Tensor, "#tgt_len #total"] | None


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder's memory, then the FFN, each in Add & Norm.

    Like chapter 07's :class:`~stepformer.encoder.EncoderLayer`, the layer is its wiring and is
    given its parts: ``self_attn`` and ``cross_attn`` are called as ``attention(query, key,
    value, mask, cache=...)`` (chapter 03's, or chapter 10's, which also rotates positions),
    ``ffn`` as ``ffn(x)``, and ``norm1``-``norm3`` are three separate norms, one per sublayer.
    ``cross_attn=None`` with ``norm2=None`` leaves the middle sublayer out: a decoder-only (GPT)
    block, with no ``norm2`` or ``dropout2`` either. One norm module given twice, or only one of
    ``cross_attn`` and ``norm2``, raises ``ValueError``. ``dropout`` acts on each sublayer's output
    before the residual add (``dropout1``-``dropout3``); ``norm_first`` chooses pre-norm. Attribute
    names are ``torch.nn.TransformerDecoderLayer``'s, with ``cross_attn`` for its ``multihead_attn``;
    :func:`build_decoder_layer` builds PyTorch's layer from this course's parts.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        cross_attn: nn.Module | None,
        ffn: nn.Module,
        norm1: nn.Module,
        norm2: nn.Module | None,
        norm3: nn.Module,
        dropout: float = 0.1,
        norm_first: bool = False,
    ) -> None:
        super().__init__()  # before the sublayers below: nn.Module must exist to register them
        if (cross_attn is None) != (norm2 is None):
            raise ValueError("norm2 belongs to the cross-attention sublayer: give cross_attn and norm2, or neither")
        norms = [norm for norm in (norm1, norm2, norm3) if norm is not None]
        if len({id(norm) for norm in norms}) < len(norms):
            raise ValueError("two sublayers are given the same norm module: each sublayer needs a norm of its own")
        self.norm_first = norm_first
        self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
        self.norm1, self.norm2, self.norm3 = norm1, norm2, norm3
        self.dropout1, self.dropout3 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout) if cross_attn is not None else None

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        x: Float[Tensor, "batch tgt_len d_model"],
        memory: Float[Tensor, "batch src_len d_model"] | None,
        src_mask: SourceMask = None,
        tgt_mask: TargetMask = None,
        cache: LayerCache | None = None,
    ) -> Float[Tensor, "batch tgt_len d_model"]:
        """``tgt_mask`` is causal (and padding); ``src_mask`` hides the source's padding from cross-attention.

        With a ``cache`` (chapter 09), ``x`` holds only the new target positions and
        ``tgt_mask`` spans the cached ones too (``None`` for a single new position, which may
        read everything before it).
        """
        self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn, cache.cross_attn)
        x = add_and_norm(
            x, lambda h: self.self_attn(h, h, h, tgt_mask, cache=self_cache), self.norm1, self.dropout1,
            self.norm_first,
        )
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError("this decoder layer has cross-attention and needs the encoder's memory")
            # Queries from the target, keys and values from the source: the only place they meet.
            x = add_and_norm(
                x,
                lambda h: self.cross_attn(h, memory, memory, src_mask, cache=cross_cache),
                self.norm2,
                self.dropout2,
                self.norm_first,
            )
        return add_and_norm(x, self.ffn, self.norm3, self.dropout3, self.norm_first)


def build_decoder_layer(
    d_model: int,
    heads: int,
    d_ff: int,
    dropout: float = 0.1,
    norm_first: bool = False,
    activation: str = "relu",
    cross_attention: bool = True,
) -> DecoderLayer:
    """``torch.nn.TransformerDecoderLayer(d_model, heads, d_ff, dropout, activation, norm_first=...)`` from the
    course's parts: two multi-head attentions (03), the feed-forward network (04), three LayerNorms (05).

    ``dropout`` goes where PyTorch puts it: the attention weights, the FFN's hidden units and each
    sublayer's output; ``activation`` goes to the FFN. ``cross_attention=False``: a decoder-only
    block (``None`` for ``cross_attn`` and ``norm2``).
    """
    return DecoderLayer(
        MultiHeadAttention(d_model, heads, dropout=dropout),
        MultiHeadAttention(d_model, heads, dropout=dropout) if cross_attention else None,
        FeedForward(d_model, d_ff, activation, dropout),
        LayerNorm(d_model),
        LayerNorm(d_model) if cross_attention else None,
        LayerNorm(d_model),
        dropout,
        norm_first,
    )


class Decoder(nn.Module):
    """A stack of layers (:class:`DecoderLayer`), each reading the same ``memory``, then a final norm (``norm``;
    none: ``nn.Identity``), as in ``torch.nn.TransformerDecoder``."""

    def __init__(self, layers: Iterable[nn.Module], norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Identity() if norm is None else norm

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        x: Float[Tensor, "batch tgt_len d_model"],
        memory: Float[Tensor, "batch src_len d_model"] | None,
        src_mask: SourceMask = None,
        tgt_mask: TargetMask = None,
        cache: list[LayerCache] | None = None,
    ) -> Float[Tensor, "batch tgt_len d_model"]:
        """Every layer reads the same ``memory``; ``cache`` holds one :class:`LayerCache` per layer."""
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"the cache has {len(cache)} layers, the decoder {len(self.layers)}")
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_mask, tgt_mask, None if cache is None else cache[i])
        return self.norm(x)


def build_decoder(
    d_model: int,
    heads: int,
    d_ff: int,
    layers: int,
    dropout: float = 0.1,
    norm_first: bool = False,
    activation: str = "relu",
    final_norm: bool = True,
    cross_attention: bool = True,
) -> Decoder:
    """``torch.nn.TransformerDecoder`` of ``layers`` :func:`build_decoder_layer` layers, each built afresh with its own
    weights, with a final LayerNorm if ``final_norm``; ``cross_attention=False``: a decoder-only (GPT) stack."""
    return Decoder(
        (build_decoder_layer(d_model, heads, d_ff, dropout, norm_first, activation, cross_attention)
         for _ in range(layers)),
        LayerNorm(d_model) if final_norm else None,
    )  # fmt: skip


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need": five parts and the wiring between them.

    ``src_embed`` and ``tgt_embed`` turn token ids into vectors (chapter 07's
    :class:`~stepformer.encoder.Embedding`, called as ``embed(tokens, start)``), ``encoder``
    (:class:`~stepformer.encoder.Encoder`) reads the source, ``decoder`` (:class:`Decoder`) the
    target and the encoder's memory, and ``generator`` (``nn.Linear(d_model, tgt_vocab)``) gives
    the logits. ``pad_id`` marks padding in ``src``, and in ``tgt`` after its first token, the
    start token. :func:`build_transformer` builds the 2017 model from sizes;
    :func:`stepformer.parts.configured_transformer` builds one from a
    :class:`~stepformer.parts.ModelConfig` (grouped-query attention, rotary positions, fused kernels).
    """

    def __init__(
        self,
        src_embed: nn.Module,
        tgt_embed: nn.Module,
        encoder: nn.Module,
        decoder: nn.Module,
        generator: nn.Module,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
        self.encoder, self.decoder = encoder, decoder
        self.generator = generator
        self.pad_id = pad_id

    @jaxtyped(typechecker=beartype)
    def encode(
        self, src: Int[Tensor, "batch src_len"], src_mask: SourceMask = None
    ) -> Float[Tensor, "batch src_len d_model"]:
        """The encoder's memory of ``src``; ``src_mask`` defaults to its padding mask."""
        if src_mask is None:
            src_mask = padding_mask(src, self.pad_id)
        return self.encoder(self.src_embed(src), src_mask)

    @jaxtyped(typechecker=beartype)
    def decode(
        self,
        tgt: Int[Tensor, "batch tgt_len"],
        memory: Float[Tensor, "batch src_len d_model"],
        src_mask: SourceMask = None,
        tgt_mask: TargetMask = None,
        cache: list[LayerCache] | None = None,
    ) -> Float[Tensor, "batch tgt_len d_model"]:
        """The decoder's output for ``tgt`` (no generator). With a ``cache``, ``tgt`` holds only the new tokens."""
        start = 0 if cache is None else len(cache[0].self_attn)
        return self.decoder(self.tgt_embed(tgt, start), memory, src_mask, tgt_mask, cache)

    @jaxtyped(typechecker=beartype)
    def forward(
        self, src: Int[Tensor, "batch src_len"], tgt: Int[Tensor, "batch tgt_len"]
    ) -> Float[Tensor, "batch tgt_len tgt_vocab"]:
        """Teacher forcing: the logits of the next token after each prefix of ``tgt``, all positions at once.

        ``tgt`` starts with the start token, which every position reads even if its id is ``pad_id``.
        """
        src_mask = padding_mask(src, self.pad_id)
        tgt_mask = target_mask(tgt, self.pad_id)
        # Position 0 is the start token, never padding; Marian's start token has the padding id, and greedy
        # generation, with its causal mask only, reads it too.
        tgt_mask[..., 0] = True
        return self.generator(self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask))


def initialise(model: Transformer, tie_embeddings: bool) -> Transformer:
    """Glorot's uniform initialisation for every matrix, as in the paper's code and ``torch.nn.Transformer``; then,
    with ``tie_embeddings``, one table shared by the target embedding and the generator, and by the source
    embedding too when the vocabularies have the same size (a joint vocabulary, as in the paper)."""
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    if tie_embeddings:
        model.generator.weight = model.tgt_embed.tokens.weight
        if model.src_embed.tokens.num_embeddings == model.tgt_embed.tokens.num_embeddings:
            model.src_embed.tokens.weight = model.tgt_embed.tokens.weight
    return model


def build_transformer(
    src_vocab: int,
    tgt_vocab: int,
    d_model: int = 512,
    heads: int = 8,
    n_encoder_layers: int = 6,
    n_decoder_layers: int = 6,
    d_ff: int = 2048,
    dropout: float = 0.1,
    norm_first: bool = False,
    positional: str = "sinusoidal",
    tie_embeddings: bool = False,
    max_len: int = 512,
    pad_id: int = 0,
    activation: str = "relu",
    final_norm: bool = True,
) -> Transformer:
    """The 2017 Transformer from chapters 03-08's parts (the base model's sizes by default), initialised.

    ``positional`` is ``"sinusoidal"`` or ``"learned"``; ``tie_embeddings`` shares the tables (see
    :func:`initialise`); ``final_norm=False`` leaves out the norm after each stack (the 2017 post-norm model and
    Marian have none; ``torch.nn.Transformer`` has one). Rotary positions rotate inside the attention, which
    chapter 03's does not: :func:`stepformer.parts.configured_transformer` builds that model.
    """
    if positional not in ("sinusoidal", "learned"):
        raise ValueError(f"positional must be 'sinusoidal' or 'learned', got {positional!r}; rotary positions need "
                         "chapter 10's attention: stepformer.parts.configured_transformer builds that model")
    return initialise(Transformer(
        Embedding(src_vocab, d_model, positional, max_len, dropout),
        Embedding(tgt_vocab, d_model, positional, max_len, dropout),
        build_encoder(d_model, heads, d_ff, n_encoder_layers, dropout, norm_first, activation, final_norm),
        build_decoder(d_model, heads, d_ff, n_decoder_layers, dropout, norm_first, activation, final_norm),
        nn.Linear(d_model, tgt_vocab),
        pad_id,
    ), tie_embeddings)  # fmt: skip


@jaxtyped(typechecker=beartype)
def target_mask(tgt: Int[Tensor, "batch tgt_len"], pad_id: int) -> Bool[Tensor, "batch 1 tgt_len tgt_len"]:
    """The decoder's self-attention mask: causal (no peeking ahead) and no padding keys."""
    return padding_mask(tgt, pad_id) & causal_mask(tgt.shape[1], device=tgt.device)


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def generate(
    model: Transformer, src: Int[Tensor, "batch src_len"], max_new_tokens: int, bos_id: int, eos_id: int
) -> tuple[Int[Tensor, "batch out_len"], Float[Tensor, "batch steps tgt_vocab"]]:
    """Greedy decoding for a batch, recomputing the whole prefix at every step: ``(tokens, logits)``.

    ``tokens`` starts with ``bos_id``; each sequence stops at its own ``eos_id`` (its later
    places are ``pad_id``), and the loop stops when all have, or after ``max_new_tokens``.
    ``logits`` holds the generator's output at every step. The model is put in ``eval()``
    mode for the call and restored afterwards. Chapter 09's ``generate_cached`` gives the same
    result without recomputing the prefix.
    """

    def full_prefix(tokens: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        mask = causal_mask(tokens.shape[1], device=tokens.device)
        return model.generator(model.decode(tokens, memory, src_mask, mask)[:, -1])

    return greedy(model, src, max_new_tokens, bos_id, eos_id, full_prefix)


def greedy(
    model: nn.Module,
    src: Tensor,
    max_new_tokens: int,
    bos_id: int,
    eos_id: int,
    next_logits: Callable[[Tensor, Tensor, Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """The greedy loop shared by :func:`generate` and the cached version: ``(tokens, logits)``.

    ``model`` needs ``pad_id`` and ``encode(src, src_mask)``; ``next_logits(tokens, memory, src_mask)``
    gives the logits ``(batch, tgt_vocab)`` of the token after ``tokens`` ``(batch, length)``. A
    sequence that has produced ``eos_id`` is finished: its later places are ``pad_id`` (and it is
    fed ``pad_id``), while the others go on; the loop ends when every sequence is finished or after
    ``max_new_tokens`` steps. ``tokens`` starts with ``bos_id``; ``logits`` has one row per step.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    try:
        src_mask = padding_mask(src, model.pad_id)
        memory = model.encode(src, src_mask)
        tokens = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        steps = []
        for _ in range(max_new_tokens):
            logits = next_logits(tokens, memory, src_mask)
            steps.append(logits)
            next_token = logits.argmax(dim=-1).masked_fill(finished, model.pad_id)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            finished |= next_token == eos_id
            if finished.all():
                break
        return tokens, torch.stack(steps, dim=1)
    finally:
        model.train(was_training)


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def logits_that_change(
    model: nn.Module,
    src: Int[Tensor, "batch src_len"],
    tgt: Int[Tensor, "batch tgt_len"],
    position: int,
    token: int,
    tol: float = 1e-6,
) -> Bool[Tensor, "batch tgt_len"]:
    """Which teacher-forced logits move when the target token at ``position`` becomes ``token``.

    ``model(src, tgt)`` gives the logits ``(batch, tgt_len, vocab)`` of every position at once.
    Entry ``[b, i]`` is ``True`` when a logit of sentence ``b`` at position ``i`` differs by more
    than ``tol`` between the two runs. ``tgt`` itself is left as it was.
    """
    changed = tgt.clone()  # not in place: the caller's targets stay as they were
    changed[:, position] = token
    difference = (model(src, changed) - model(src, tgt)).abs()
    return reduce(difference, "batch tgt_len vocab -> batch tgt_len", "max") > tol


def decoder_layer_from_torch(layer: nn.TransformerDecoderLayer) -> DecoderLayer:
    """A :class:`DecoderLayer` with the weights of a ``torch.nn.TransformerDecoderLayer``.

    Its ``multihead_attn`` is our ``cross_attn``, its ``linear1`` and ``linear2`` are our
    ``ffn.linear1`` and ``ffn.linear2``; ``self_attn`` and the norms keep their names."""
    return layer_from_torch(layer, build_decoder_layer, {"self_attn": "self_attn", "cross_attn": "multihead_attn"})


def decoder_from_torch(decoder: nn.TransformerDecoder) -> Decoder:
    """A :class:`Decoder` with the weights of a ``torch.nn.TransformerDecoder`` (its final ``norm`` if it has one)."""
    return stack_from_torch(decoder, Decoder, decoder_layer_from_torch)


def load_torch_transformer(model: Transformer, theirs: nn.Transformer) -> None:
    """Copy the encoder and decoder weights of a ``torch.nn.Transformer`` into ``model`` (in place).

    ``torch.nn.Transformer`` has no embeddings and no generator, so those are left as they are.
    The two must be configured alike (sizes, ``norm_first``, activation, dropout, ...): a
    ``ValueError`` names what differs, since weights that fit would otherwise compute another function.
    """
    mismatches = configuration_mismatches(model, theirs)
    if mismatches:
        raise ValueError("cannot copy this torch.nn.Transformer: " + "; ".join(mismatches))
    model.encoder.load_state_dict(encoder_from_torch(theirs.encoder).state_dict())
    model.decoder.load_state_dict(decoder_from_torch(theirs.decoder).state_dict())


def activation_name(activation: Callable | nn.Module) -> str:
    """``relu``, ``gelu`` or ``gelu(approximate='tanh')`` for a function or module (a gated FFN: its class name)."""
    name = getattr(activation, "__name__", type(activation).__name__).lower()
    if getattr(activation, "approximate", "none") != "none":  # nn.GELU("tanh") is another function
        name += f"(approximate={activation.approximate!r})"
    return name


def configuration_mismatches(model: Transformer, theirs: nn.Transformer) -> list[str]:
    """What differs between ``model`` and ``theirs`` beyond the weights, one line each (empty: they match).

    Some differences would make ``load_state_dict`` fail with a list of keys (sizes, ``bias=False``);
    others would load and quietly compute something else (``norm_first``, activation, dropout, the
    number of heads, rotary positions). Both kinds are reported here by name.
    """
    ours_first, theirs_first = model.encoder.layers[0], theirs.encoder.layers[0]
    attention = ours_first.self_attn
    ours_config = {
        "encoder layers": len(model.encoder.layers),
        "decoder layers": len(model.decoder.layers),
        "d_model": attention.w_q.in_features,
        "heads": attention.heads,
        "d_ff": ours_first.ffn.linear1.out_features,
        "norm_first": ours_first.norm_first,
        "activation": activation_name(getattr(ours_first.ffn, "activation", ours_first.ffn)),
        "dropout": ours_first.dropout1.p,
        "layer_norm_eps": ours_first.norm1.eps,
    }
    theirs_config = {
        "encoder layers": len(theirs.encoder.layers),
        "decoder layers": len(theirs.decoder.layers),
        "d_model": theirs.d_model,
        "heads": theirs.nhead,
        "d_ff": theirs_first.linear1.out_features,
        "norm_first": theirs_first.norm_first,
        "activation": activation_name(theirs_first.activation),
        "dropout": theirs_first.dropout.p,
        "layer_norm_eps": theirs_first.norm1.eps,
    }
    mismatches = [
        f"{key}: ours {ours_config[key]!r}, theirs {theirs_config[key]!r}"
        for key in ours_config
        if ours_config[key] != theirs_config[key]
    ]
    if theirs_first.linear1.bias is None:
        mismatches.append("bias: theirs was built with bias=False, and every linear layer and LayerNorm here has one")
    if getattr(attention, "kv_heads", attention.heads) != attention.heads:
        mismatches.append(f"kv_heads: ours {attention.kv_heads} (grouped-query), theirs {theirs.nhead} (multi-head)")
    if getattr(attention, "rope", None) is not None:
        mismatches.append("positional: ours is 'rope', which rotates queries and keys; torch.nn.Transformer does not")
    return mismatches
