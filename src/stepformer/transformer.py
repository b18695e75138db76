"""Chapter 08: the decoder and the full encoder-decoder Transformer, with greedy generation.

The decoder layer adds masked self-attention and cross-attention to the encoder's pieces
(chapter 07); generation can read earlier keys and values from the KV-cache of chapter 09.
Parameter names follow ``torch.nn.Transformer``, so its weights copy across
(``load_torch_transformer``).
"""

from collections.abc import Callable
from typing import Any

import torch
from beartype import beartype
from einops import reduce
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.encoder import (
    Embedding,
    add_and_norm,
    encoder_from_torch,
    layer_from_torch,
    stack_from_torch,
)
from stepformer.ffn import FeedForward
from stepformer.masks import causal_mask, padding_mask
from stepformer.multihead import MultiHeadAttention
from stepformer.norms import LayerNorm
from stepformer.parts import ModelConfig, bare, encoder_stack, make_attention, make_ffn, make_norm

# One decoder layer's caches, chapter 09's kvcache.LayerCache: any object with a growing .self_attn and a fixed
# .cross_attn cache, each with the .update(keys, values) that the attention calls.
LayerCache = Any
# With a cache, a target mask spans the cached positions as well: `total` keys.
SourceMask = Bool[Tensor, "#batch #heads #tgt_len #src_len"] | None
TargetMask = Bool[Tensor, "#batch #heads #tgt_len #total"] | Bool[Tensor, "#tgt_len #total"] | None


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder's memory, then the FFN, each in Add & Norm.

    Attributes as in ``torch.nn.TransformerDecoderLayer``, with ``cross_attn`` for its
    ``multihead_attn``: ``self_attn``, ``cross_attn``, ``ffn``, ``norm1``-``norm3``,
    ``dropout1``-``dropout3``. ``cross_attention=False`` leaves the middle sublayer out: a
    decoder-only (GPT) block. RoPE, if asked for, rotates the self-attention only: the source
    and target positions of cross-attention are not on one axis.
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        d_ff: int,
        dropout: float = 0.1,
        norm_first: bool = False,
        activation: str = "relu",
        cross_attention: bool = True,
    ) -> None:
        super().__init__()  # before the sublayers below: nn.Module must exist to register them
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, heads, dropout=dropout)
        self.cross_attn = MultiHeadAttention(d_model, heads, dropout=dropout) if cross_attention else None
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.norm1, self.norm2, self.norm3 = LayerNorm(d_model), LayerNorm(d_model), LayerNorm(d_model)
        self.dropout1, self.dropout2, self.dropout3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

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


class Decoder(nn.Module):
    """A stack of ``layers`` :class:`DecoderLayer` s, then a final LayerNorm (``norm``), as in torch's Transformer."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        d_ff: int,
        layers: int,
        dropout: float = 0.1,
        norm_first: bool = False,
        activation: str = "relu",
        final_norm: bool = True,
        cross_attention: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(d_model, heads, d_ff, dropout, norm_first, activation, cross_attention) for _ in range(layers)
        )
        self.norm = LayerNorm(d_model) if final_norm else nn.Identity()

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


def decoder_layer(config: ModelConfig, cross_attention: bool = True) -> DecoderLayer:
    """A :class:`DecoderLayer` with the parts that ``config`` names: its ``forward`` and its names, other parts.

    ``cross_attention=False`` is a decoder-only block (GPT, LLaMA): masked self-attention and the FFN.
    """
    layer = bare(DecoderLayer)
    layer.norm_first = config.placement == "pre"
    layer.self_attn = make_attention(config)
    layer.cross_attn = make_attention(config, self_attention=False) if cross_attention else None
    layer.ffn = make_ffn(config)
    # Without cross-attention there is no middle sublayer, so no norm2 or dropout2 either.
    layer.norm1 = make_norm(config)
    layer.norm2 = make_norm(config) if cross_attention else None
    layer.norm3 = make_norm(config)
    layer.dropout1, layer.dropout3 = nn.Dropout(config.dropout), nn.Dropout(config.dropout)
    layer.dropout2 = nn.Dropout(config.dropout) if cross_attention else None
    return layer


def decoder_stack(config: ModelConfig, layers: int | None = None, cross_attention: bool = True) -> Decoder:
    """A :class:`Decoder` of ``layers`` (default ``config.layers``) configured layers, with a final norm if
    ``config.final_norm``."""
    stack = bare(Decoder)
    count = config.layers if layers is None else layers
    stack.layers = nn.ModuleList(decoder_layer(config, cross_attention) for _ in range(count))
    stack.norm = make_norm(config) if config.final_norm else nn.Identity()
    return stack


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need", from the course's parts.

    ``src_embed`` and ``tgt_embed`` (:class:`Embedding`), ``encoder`` (:class:`Encoder`),
    ``decoder`` (:class:`Decoder`) and ``generator`` (``nn.Linear(d_model, tgt_vocab)``, the
    logits). ``tie_embeddings`` shares one matrix between the target embedding and the
    generator, and with the source embedding too when the vocabularies have the same size (a
    joint vocabulary, as in the paper). ``pad_id`` marks padding in ``src``, and in ``tgt``
    after its first token, the start token. ``kv_heads`` makes every attention grouped-query
    (chapter 10); ``fast`` uses PyTorch's fused attention and LayerNorm (same results).
    ``final_norm=False`` leaves out the norm after each stack (the 2017 post-norm model and
    Marian have none; ``torch.nn.Transformer`` has one).
    The arguments become a :class:`~stepformer.parts.ModelConfig` (``self.config``), from which
    the encoder and decoder are built: every attention is chapter 10's, which with
    ``kv_heads = heads`` is multi-head attention with the same parameters, and also takes
    rotary positions and a KV-cache.
    """

    def __init__(
        self,
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
        kv_heads: int | None = None,
        fast: bool = False,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.config = ModelConfig(
            vocab=tgt_vocab,
            d_model=d_model,
            heads=heads,
            layers=n_decoder_layers,
            d_ff=d_ff,
            kv_heads=kv_heads,
            norm="layer",
            placement="pre" if norm_first else "post",
            final_norm=final_norm,
            ffn=activation,
            positions=positional,
            max_len=max_len,
            tie_embeddings=tie_embeddings,
            scale_embeddings=True,
            dropout=dropout,
            fast=fast,
        )
        self.src_embed = Embedding(src_vocab, d_model, positional, max_len, dropout)
        self.tgt_embed = Embedding(tgt_vocab, d_model, positional, max_len, dropout)
        self.encoder = encoder_stack(self.config, n_encoder_layers)
        self.decoder = decoder_stack(self.config, n_decoder_layers)
        self.generator = nn.Linear(d_model, tgt_vocab)
        for p in self.parameters():
            if p.dim() > 1:  # Glorot, as in the paper's code and in torch.nn.Transformer
                nn.init.xavier_uniform_(p)
        if tie_embeddings:
            self.generator.weight = self.tgt_embed.tokens.weight
            if src_vocab == tgt_vocab:
                self.src_embed.tokens.weight = self.tgt_embed.tokens.weight

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
    return layer_from_torch(layer, DecoderLayer, {"self_attn": "self_attn", "cross_attn": "multihead_attn"})


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


# A ModelConfig's ffn as configuration_mismatches names PyTorch's activations.
ACTIVATION_NAMES = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu(approximate='tanh')", "swiglu": "swiglu"}


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
        "activation": ACTIVATION_NAMES[model.config.ffn],
        "dropout": ours_first.dropout1.p,
        "layer_norm_eps": ours_first.norm1.eps,
    }
    activation = theirs_first.activation
    activation_name = getattr(activation, "__name__", type(activation).__name__).lower()
    if getattr(activation, "approximate", "none") != "none":  # nn.GELU("tanh") is another function
        activation_name += f"(approximate={activation.approximate!r})"
    theirs_config = {
        "encoder layers": len(theirs.encoder.layers),
        "decoder layers": len(theirs.decoder.layers),
        "d_model": theirs.d_model,
        "heads": theirs.nhead,
        "d_ff": theirs_first.linear1.out_features,
        "norm_first": theirs_first.norm_first,
        "activation": activation_name,
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
