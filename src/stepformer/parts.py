"""Which part fills each slot of a Transformer layer: one configuration, read in one place.

The 2017 Transformer, BERT, GPT-2, T5 and LLaMA differ in a handful of choices: the norm and
where it sits, the feed-forward network, how positions enter, how many key/value heads the
attention keeps, whether the linear maps have biases, whether the output layer shares the
embedding table. :class:`ModelConfig` names each choice, and :func:`make_norm`,
:func:`make_ffn` and :func:`make_attention` turn it into the part that an earlier chapter
built (chapters 04, 05, 06 and 10). :func:`encoder_layer`, :func:`decoder_layer` and
:func:`configured_transformer` give those parts to chapters 07 and 08's layers and model, which
take their parts as arguments; the translator and chapter 12's model families are built from
them (:mod:`stepformer.models`).
"""

from dataclasses import asdict, dataclass
from typing import Any

import torch
from beartype import beartype
from einops import einsum, rearrange
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.encoder import Embedding, Encoder, EncoderLayer
from stepformer.ffn import FeedForward, SwiGLU
from stepformer.gqa import GroupedQueryAttention
from stepformer.norms import LayerNorm, RMSNorm
from stepformer.positional import RotaryEmbedding
from stepformer.transformer import Decoder, DecoderLayer, Transformer, initialise

NORMS = ("layer", "rms")
PLACEMENTS = ("pre", "post")
FFNS = ("relu", "gelu", "gelu_tanh", "swiglu")
POSITIONS = ("sinusoidal", "learned", "rope")


@dataclass(frozen=True)
class ModelConfig:
    """Every choice that tells one Transformer model from another, beyond its weights.

    Sizes: ``vocab`` tokens, ``d_model`` features, ``heads`` query heads and ``kv_heads``
    key/value heads (``None``: as many as ``heads``; 1: multi-query), ``layers`` layers,
    ``d_ff`` hidden units of the feed-forward network, ``max_len`` positions for a learned
    table; an encoder-decoder's ``vocab`` and ``layers`` are its target side's and decoder's, and
    ``src_vocab`` and ``encoder_layers`` its source's and encoder's (``None``: the same), so that
    one config describes the whole model. The parts:

    - ``norm``: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm), with ``norm_eps``;
    - ``placement``: ``"post"`` (the 2017 paper, BERT: ``norm(x + f(x))``) or ``"pre"``
      (GPT-2, T5, LLaMA: ``x + f(norm(x))``); ``final_norm`` adds a norm after the last layer,
      which pre-norm needs because its residual stream is never normalised;
    - ``ffn``: ``"relu"``, ``"gelu"``, ``"gelu_tanh"`` (GELU's tanh approximation, GPT-2's)
      or ``"swiglu"`` (LLaMA's gated unit, no biases);
    - ``positions``: ``"sinusoidal"`` (the fixed code, added), ``"learned"`` (a table, added)
      or ``"rope"`` (queries and keys rotated in self-attention; nothing added);
    - ``bias``: biases in the attention's four linear maps (the relu/gelu feed-forward of
      chapter 04 always has them, SwiGLU never);
    - ``tie_embeddings``: the output layer reuses the token embedding table;
      ``scale_embeddings`` multiplies token vectors by sqrt(d_model) (the 2017 paper);
      ``embedding_norm`` normalises the embeddings before the first layer and ``segments``
      adds a table of that many segment (token type) vectors (both BERT);
    - ``dropout`` everywhere the 2017 paper puts it; ``fast`` uses PyTorch's fused attention
      and norms, and RoPE as a complex multiplication (same parameters, same results).
    """

    vocab: int  # the output vocabulary: an encoder-decoder's target side
    d_model: int
    heads: int
    layers: int  # an encoder-decoder's decoder layers
    d_ff: int
    kv_heads: int | None = None  # None: as many as heads, plain multi-head attention
    # The defaults below are a GPT-2-like decoder-only model, what chapter 12 builds most; ModelConfig.original
    # gives the 2017 encoder-decoder.
    norm: str = "layer"
    norm_eps: float = 1e-5  # torch.nn.LayerNorm's; BERT uses 1e-12, LLaMA's RMSNorm 1e-6
    placement: str = "pre"  # trains without the warmup post-norm needs (Xiong et al. 2020); the 2017 paper: "post"
    final_norm: bool = True  # pre-norm's residual stream is never normalised otherwise
    ffn: str = "gelu"
    positions: str = "learned"
    max_len: int = 1024  # rows of a learned table and of the sinusoidal buffer; RoPE needs none
    bias: bool = True
    tie_embeddings: bool = True  # one table in and out (Press and Wolf 2017): vocab x d_model fewer parameters
    scale_embeddings: bool = False  # the 2017 paper's sqrt(d_model); GPT-2 and LLaMA do not scale
    embedding_norm: bool = False
    segments: int = 0
    dropout: float = 0.0  # for evaluation and conversion; training sets it (the 2017 paper: 0.1)
    fast: bool = True  # the same parameters and results, fused kernels; the chapters' own parts read better
    src_vocab: int | None = None  # an encoder-decoder's source vocabulary; None: vocab (a joint vocabulary)
    encoder_layers: int | None = None  # an encoder-decoder's encoder layers; None: layers

    def __post_init__(self) -> None:
        for name, value, allowed in (("norm", self.norm, NORMS), ("placement", self.placement, PLACEMENTS),
                                     ("ffn", self.ffn, FFNS), ("positions", self.positions, POSITIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("vocab", "d_model", "heads", "layers", "d_ff", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.segments < 0:
            raise ValueError(f"segments must be 0 (none) or more, got {self.segments}")
        for name in ("src_vocab", "encoder_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (or None: as vocab and layers), got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def original(cls, vocab: int, **changes: Any) -> "ModelConfig":
        """The 2017 paper's base model, as chapter 08's ``build_transformer`` builds it, with ``changes``.

        Post-norm LayerNorm, ReLU, sinusoidal positions, scaled embeddings, no tied tables, dropout 0.1, a final
        norm after each stack (``torch.nn.Transformer``'s), chapter 03-05's own parts (``fast=False``). With
        ``kv_heads``, ``positions="rope"`` or ``fast=True`` among the changes it is that model with chapter 10's
        attention, rotary positions or PyTorch's fused kernels.
        """
        paper = dict(vocab=vocab, d_model=512, heads=8, layers=6, d_ff=2048, norm="layer", placement="post",
                     final_norm=True, ffn="relu", positions="sinusoidal", max_len=512, tie_embeddings=False,
                     scale_embeddings=True, dropout=0.1, fast=False)  # fmt: skip
        return cls(**{**paper, **changes})


def make_norm(config: ModelConfig) -> nn.Module:
    """Chapter 05's LayerNorm or RMSNorm; with ``fast``, PyTorch's fused module with the same parameters."""
    d_model, eps = config.d_model, config.norm_eps
    if config.norm == "rms":
        return nn.RMSNorm(d_model, eps=eps) if config.fast else RMSNorm(d_model, eps)
    return nn.LayerNorm(d_model, eps=eps) if config.fast else LayerNorm(d_model, eps)


def make_ffn(config: ModelConfig) -> nn.Module:
    """Chapter 04's feed-forward network (ReLU, GELU or its tanh approximation) or SwiGLU."""
    if config.ffn == "swiglu":
        return SwiGLU(config.d_model, config.d_ff)
    return FeedForward(config.d_model, config.d_ff, config.ffn, config.dropout)


class ComplexRotaryEmbedding(RotaryEmbedding):
    """Chapter 06's rotation computed as a complex multiplication: the same result in fewer steps.

    Pair ``(x_2i, x_2i+1)`` is read as the complex number x_2i + i·x_2i+1 (``view_as_complex``,
    no copy) and multiplied by e^(i·pos·θ_i), which turns it by pos·θ_i. Chapter 06 writes the
    four real products and reassembles the pairs; here one complex product does it, about three
    times faster forward and backward on a CPU, enough to decide whether a LLaMA-style training
    step keeps up with Hugging Face's (``benchmarks/lm_training_step.py``). Half-precision inputs
    are turned in float32 (PyTorch has no bfloat16 complex numbers) and returned in their dtype.
    """

    @jaxtyped(typechecker=beartype)
    def forward(
        self, x: Float[Tensor, "*batch seq d_head"], positions: Int[Tensor, " seq"]
    ) -> Float[Tensor, "*batch seq d_head"]:
        """Rotate each query or key ``x[..., s, :]`` to its position ``positions[s]``; same shape and dtype."""
        if x.shape[-1] != self.d_head:
            raise ValueError(f"x has d_head={x.shape[-1]}, but this RotaryEmbedding was built for {self.d_head}")
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        i = torch.arange(self.d_head // 2, dtype=dtype, device=x.device)
        angle = einsum(positions.to(dtype), self.base ** (-2 * i / self.d_head), "seq, pair -> seq pair")
        turn = torch.polar(torch.ones_like(angle), angle)
        pairs = rearrange(x.to(dtype), "... seq (pair two) -> ... seq pair two", two=2)
        if pairs.storage_offset() % 2 or any(stride % 2 for stride in pairs.stride()[:-1]):
            pairs = pairs.contiguous()  # a complex view needs each pair at an even offset
        turned = torch.view_as_real(torch.view_as_complex(pairs) * turn)
        return rearrange(turned, "... seq pair two -> ... seq (pair two)").to(x.dtype)


def make_attention(config: ModelConfig, self_attention: bool = True) -> GroupedQueryAttention:
    """Chapter 10's attention: ``heads`` query heads over ``kv_heads`` key/value heads (all of them: chapter 03's).

    RoPE rotates self-attention only: in cross-attention the queries' and keys' positions lie on
    two different sentences. With ``fast``, the rotation is :class:`ComplexRotaryEmbedding`.
    """
    rope: bool | RotaryEmbedding = self_attention and config.positions == "rope"
    if rope and config.fast:
        rope = ComplexRotaryEmbedding(config.d_model // config.heads)  # the attention's part, given at construction
    return GroupedQueryAttention(
        config.d_model,
        config.heads,
        config.kv_heads,
        bias=config.bias,
        dropout=config.dropout,
        rope=rope,
        fast=config.fast,
    )


def encoder_layer(config: ModelConfig) -> EncoderLayer:
    """Chapter 07's :class:`EncoderLayer` given the parts that ``config`` names."""
    return EncoderLayer(make_attention(config), make_ffn(config), make_norm(config), make_norm(config), config.dropout,
                        config.placement == "pre")  # fmt: skip


def encoder_stack(config: ModelConfig, layers: int | None = None) -> Encoder:
    """An :class:`Encoder` of ``layers`` (default ``config.layers``) configured layers, with a final norm if
    ``config.final_norm``."""
    count = config.layers if layers is None else layers
    return Encoder((encoder_layer(config) for _ in range(count)), make_norm(config) if config.final_norm else None)


def decoder_layer(config: ModelConfig, cross_attention: bool = True) -> DecoderLayer:
    """Chapter 08's :class:`DecoderLayer` given the parts that ``config`` names.

    ``cross_attention=False`` is a decoder-only block (GPT, LLaMA): masked self-attention and the FFN.
    """
    return DecoderLayer(
        make_attention(config),
        make_attention(config, self_attention=False) if cross_attention else None,
        make_ffn(config),
        make_norm(config),
        make_norm(config) if cross_attention else None,
        make_norm(config),
        config.dropout,
        config.placement == "pre",
    )


def decoder_stack(config: ModelConfig, layers: int | None = None, cross_attention: bool = True) -> Decoder:
    """A :class:`Decoder` of ``layers`` (default ``config.layers``) configured layers, with a final norm if
    ``config.final_norm``."""
    count = config.layers if layers is None else layers
    return Decoder((decoder_layer(config, cross_attention) for _ in range(count)),
                   make_norm(config) if config.final_norm else None)  # fmt: skip


def configured_transformer(config: ModelConfig, pad_id: int = 0) -> Transformer:
    """Chapter 08's :class:`Transformer` with the parts that ``config`` names, initialised as chapter 08's.

    ``config.vocab`` is the target vocabulary and ``config.layers`` the decoder's depth; ``config.src_vocab`` and
    ``config.encoder_layers`` the source's and the encoder's (``None``: the same). ``pad_id`` is the tokenizer's,
    not the model's. Embeddings are chapter 07's (scaled by sqrt(d_model), with ``config.positions``; rotary
    positions add nothing there and rotate in every self-attention).
    """
    if not config.scale_embeddings or config.embedding_norm or config.segments:
        raise ValueError("chapter 07's embeddings scale by sqrt(d_model) and have no norm or segments: set "
                         "scale_embeddings=True, embedding_norm=False, segments=0")
    src_vocab = config.vocab if config.src_vocab is None else config.src_vocab
    return initialise(Transformer(
        Embedding(src_vocab, config.d_model, config.positions, config.max_len, config.dropout),
        Embedding(config.vocab, config.d_model, config.positions, config.max_len, config.dropout),
        encoder_stack(config, config.encoder_layers),
        decoder_stack(config),
        nn.Linear(config.d_model, config.vocab),
        pad_id,
    ), config.tie_embeddings)  # fmt: skip
