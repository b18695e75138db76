"""Chapter 12: today's models from the same parts. Decoder-only and encoder-only models, sampling, LoRA.

Every model here is built from a :class:`~stepformer.parts.ModelConfig`: its layers are
chapter 07's ``EncoderLayer`` and chapter 08's ``DecoderLayer`` filled with the parts the
configuration names (``stepformer.parts``). The encoder-decoder is chapter 08's
:class:`~stepformer.transformer.Transformer`; :class:`LanguageModel` is a decoder-only stack
(GPT-2, LLaMA) and :class:`EncoderModel` an encoder-only one with a masked-language-model head
(BERT). :func:`generate` samples from a language model with chapter 09's KV-cache, and
:class:`LoRALinear` adapts a trained linear map with a low-rank update.
"""

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import rearrange
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.ffn import SwiGLU
from stepformer.gqa import GroupedQueryAttention
from stepformer.kvcache import KVCache, LayerCache
from stepformer.masks import causal_mask
from stepformer.norms import RMSNorm
from stepformer.parts import ModelConfig, decoder_stack, encoder_stack, make_norm
from stepformer.positional import LearnedPositionalEmbedding, sinusoidal_encoding

__all__ = [
    "EncoderModel",
    "Embeddings",
    "LanguageModel",
    "LlamaBlock",
    "LoRALinear",
    "ModelConfig",
    "add_lora",
    "filter_logits",
    "generate",
    "merge_lora",
    "nucleus_size",
    "sample_next",
]


class Embeddings(nn.Module):
    """Token vectors (scaled by sqrt(d_model) if ``config.scale_embeddings``), plus positions and segments.

    ``positions`` is a learned table when ``config.positions == "learned"``, the fixed code of
    chapter 06 when ``"sinusoidal"``, and nothing for ``"rope"`` (the attention rotates instead).
    ``segments`` (BERT's token types) adds one learned vector per segment id. The sum is
    normalised if ``config.embedding_norm`` (BERT), then dropped out.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.d_model)
        learned = config.positions == "learned"
        self.positions = LearnedPositionalEmbedding(config.max_len, config.d_model) if learned else None
        self.segments = nn.Embedding(config.segments, config.d_model) if config.segments else None
        self.norm = make_norm(config) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)

    @jaxtyped(typechecker=beartype)
    def forward(
        self, tokens: Int[Tensor, "batch seq"], start: int = 0, segments: Int[Tensor, "batch seq"] | None = None
    ) -> Float[Tensor, "batch seq d_model"]:
        """Embed ``tokens`` at positions ``start ... start + seq - 1`` (``start > 0``: decoding with a cache)."""
        x = self.tokens(tokens)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        seq = tokens.shape[1]
        if self.positions is not None:
            x = x + self.positions(torch.arange(start, start + seq, device=tokens.device))
        elif self.config.positions == "sinusoidal":
            x = x + sinusoidal_encoding(start + seq, self.config.d_model)[start:].to(x)
        if self.segments is not None:
            x = x + self.segments(torch.zeros_like(tokens) if segments is None else segments)
        return self.dropout(self.norm(x))


class LlamaBlock(nn.Module):
    """LLaMA's layer written out from the course's parts: RMSNorm before each sublayer, grouped-query
    attention with RoPE, SwiGLU.

    h = x + self_attn(norm1(x)), out = h + ffn(norm2(h)). Attributes: ``norm1`` and ``norm2``
    (chapter 05's :class:`~stepformer.norms.RMSNorm`, ``eps``), ``self_attn`` (chapter 10's
    :class:`~stepformer.gqa.GroupedQueryAttention`, no biases, rotary positions) and ``ffn``
    (chapter 04's :class:`~stepformer.ffn.SwiGLU`). No dropout: LLaMA trains without it.
    """

    def __init__(self, d_model: int, heads: int, kv_heads: int, d_ff: int, eps: float = 1e-6) -> None:
        super().__init__()  # first: the parts below register with nn.Module as they are assigned
        self.norm1 = RMSNorm(d_model, eps)
        self.self_attn = GroupedQueryAttention(d_model, heads, kv_heads, bias=False, rope=True)
        self.norm2 = RMSNorm(d_model, eps)
        self.ffn = SwiGLU(d_model, d_ff)

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        x: Float[Tensor, "batch seq d_model"],
        mask: Bool[Tensor, "#batch #heads #seq #total"] | Bool[Tensor, "#seq #total"] | None = None,
        cache: KVCache | None = None,
    ) -> Float[Tensor, "batch seq d_model"]:
        """``mask`` (``True`` = may attend) is causal in a language model; with a ``cache`` (chapter 09),
        ``x`` holds the new positions only and the mask spans the cached ones too."""
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, mask, cache=cache)
        return x + self.ffn(self.norm2(x))


class LanguageModel(nn.Module):
    """A decoder-only language model (GPT-2, LLaMA): embeddings, masked self-attention layers, logits.

    ``embed`` (:class:`Embeddings`), ``decoder`` (chapter 08's ``Decoder`` of layers without
    cross-attention) and ``generator`` (``nn.Linear(d_model, vocab, bias=False)``, sharing the
    embedding table when ``config.tie_embeddings``), the output layer's name in chapter 08's ``Transformer``
    (Hugging Face's ``lm_head``). Position ``t``'s logits predict token
    ``t + 1`` from tokens ``0 ... t``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        self.decoder = decoder_stack(config, cross_attention=False)
        self.generator = nn.Linear(config.d_model, config.vocab, bias=False)
        self.apply(_init_weights)
        if config.tie_embeddings:
            self.generator.weight = self.embed.tokens.weight

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        tokens: Int[Tensor, "batch seq"],
        padding: Bool[Tensor, "batch total"] | None = None,
        cache: list[LayerCache] | None = None,
    ) -> Float[Tensor, "batch seq vocab"]:
        """The next-token logits after each position.

        ``padding`` (``True`` = a real token) hides padded keys, e.g. the tail of a shorter
        sentence in a batch; it spans every key read, ``total`` = cached + new positions. With a
        ``cache`` (chapter 09), ``tokens`` are only the new positions, placed after the cached ones.
        """
        start = 0 if cache is None else len(cache[0].self_attn)
        seq = tokens.shape[1]
        # New query i sits at position start + i and may read keys 0 ... start + i. A single new
        # position may read everything cached, so it needs no mask at all.
        mask = None if seq == 1 and padding is None else causal_mask(seq, start + seq, device=tokens.device)
        if padding is not None:
            mask = mask & rearrange(padding, "batch k_len -> batch 1 1 k_len")
        return self.generator(self.decoder(self.embed(tokens, start), None, None, mask, cache))


class EncoderModel(nn.Module):
    """An encoder-only model (BERT): embeddings, bidirectional self-attention layers, a masked-LM head.

    ``embed`` (:class:`Embeddings`, with segments and a norm in BERT's configuration),
    ``encoder`` (chapter 07's ``Encoder``), and the head that predicts a masked token from its
    vector: ``mlm_dense`` (d_model → d_model), the feed-forward's activation, ``mlm_norm``, and the
    output layer ``generator`` (d_model → vocab, with a bias, sharing the embedding table when
    ``config.tie_embeddings``; Hugging Face's ``cls.predictions.decoder``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.ffn == "swiglu":
            raise ValueError("the masked-LM head uses the feed-forward's activation: relu, gelu or gelu_tanh")
        self.config = config
        self.embed = Embeddings(config)
        self.encoder = encoder_stack(config)
        self.mlm_dense = nn.Linear(config.d_model, config.d_model)
        self.mlm_activation = {"relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh")}[
            config.ffn
        ]
        self.mlm_norm = make_norm(config)
        self.generator = nn.Linear(config.d_model, config.vocab)
        self.apply(_init_weights)
        if config.tie_embeddings:
            self.generator.weight = self.embed.tokens.weight

    @jaxtyped(typechecker=beartype)
    def encode(
        self,
        tokens: Int[Tensor, "batch seq"],
        padding: Bool[Tensor, "batch seq"] | None = None,
        segments: Int[Tensor, "batch seq"] | None = None,
    ) -> Float[Tensor, "batch seq d_model"]:
        """One vector per position, each having read the whole sentence (no causal mask); padding unread."""
        mask = None if padding is None else rearrange(padding, "batch k_len -> batch 1 1 k_len")
        return self.encoder(self.embed(tokens, segments=segments), mask)

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        tokens: Int[Tensor, "batch seq"],
        padding: Bool[Tensor, "batch seq"] | None = None,
        segments: Int[Tensor, "batch seq"] | None = None,
    ) -> Float[Tensor, "batch seq vocab"]:
        """The masked-LM logits at every position: what token belongs there."""
        hidden = self.encode(tokens, padding, segments)
        return self.generator(self.mlm_norm(self.mlm_activation(self.mlm_dense(hidden))))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's and BERT's initialisation: normal(0, 0.02) weights and embeddings, zero biases.

    Chapter 08's Glorot initialisation suits a 512-wide model trained from scratch with warmup;
    the language models here follow the recipe of the models they reproduce.
    """
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# -- sampling -------------------------------------------------------------------------------------------


@jaxtyped(typechecker=beartype)
def filter_logits(
    logits: Float[Tensor, "*batch vocab"], top_k: int | None = None, top_p: float | None = None
) -> Float[Tensor, "*batch vocab"]:
    """Keep the tokens that top-k and top-p (nucleus) sampling may draw; the others' logits become -inf.

    ``top_k`` keeps the ``k`` most likely tokens (ties at the k-th logit are all kept).
    ``top_p`` keeps the smallest set of most likely tokens whose probabilities sum to at least
    ``p`` (Holtzman et al. 2020): what it drops are the least likely tokens whose probabilities,
    each token's own included, sum to at most ``1 - p``. The most likely token always stays.
    Both: top-k first, then the nucleus of the k survivors' renormalised probabilities (the
    order of Hugging Face's ``generate``). ``None`` (the default) filters nothing.
    """
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
        # Least likely first: the running sum is then the mass of a token and of every less likely one.
        # Summing from this end keeps a token whose own probability is tiny but not zero at p = 1,
        # which a sum of the likely ones, rounded to 1.0 early, would drop.
        probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1)
        drop_sorted = torch.cumsum(probs, dim=-1) <= 1.0 - top_p
        drop_sorted[..., -1] = False  # the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits


@jaxtyped(typechecker=beartype)
def sample_next(
    logits: Float[Tensor, "batch vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, " batch"]:
    """One token per row: the most likely at ``temperature == 0`` (greedy), else a draw from
    softmax(logits / temperature) restricted by :func:`filter_logits`."""
    if temperature < 0:
        raise ValueError(f"temperature must be 0 (greedy) or positive, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def generate(
    model: LanguageModel,
    prompt: Int[Tensor, "batch prompt_len"],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Int[Tensor, "batch total"]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens: ``prompt`` followed by what was generated.

    Greedy at ``temperature == 0``, else sampled (:func:`sample_next`). With ``use_cache`` the
    prompt is read once and each step feeds one token through the model (chapter 09); without
    it every step recomputes the whole sequence (the same tokens, more work). A row that has
    produced ``eos_id`` keeps producing ``eos_id``; the loop ends when all have, or after
    ``max_new_tokens`` steps. The model is in ``eval()`` mode for the call.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    try:
        cache = [LayerCache() for _ in model.decoder.layers] if use_cache else None
        tokens, fed = prompt, prompt
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for _ in range(max_new_tokens):
            logits = model(fed, cache=cache)[:, -1]
            next_token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_id is not None:
                next_token = next_token.masked_fill(finished, eos_id)
                finished |= next_token == eos_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            fed = next_token[:, None] if use_cache else tokens
            if eos_id is not None and finished.all():
                break
        return tokens
    finally:
        model.train(was_training)


# -- LoRA -----------------------------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (Hu et al. 2022, "LoRA").

    y = base(x) + (alpha / r) · B(A(dropout(x))), with ``lora_a`` (``in → r``) drawn as
    ``nn.Linear`` draws its weights and ``lora_b`` (``r → out``) zero, so that the layer starts
    equal to ``base``. Only ``lora_a`` and ``lora_b`` train: r · (in + out) numbers instead of
    in · out. After training, the update can be folded back into one ``nn.Linear`` of weight
    W + (alpha / r) · B A, which costs nothing at inference.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()  # first: base, lora_a and lora_b register with nn.Module as they are assigned
        if r < 1:
            raise ValueError(f"the rank r must be at least 1, got {r}")
        self.base = base  # the trained layer, kept as it is: frozen, and never changed in place
        self.base.requires_grad_(False)
        self.r, self.alpha = r, alpha
        self.scaling = alpha / r
        self.lora_a = nn.Linear(base.in_features, r, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_b = nn.Linear(r, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.dropout = nn.Dropout(dropout)  # on the LoRA path's input only, as in peft

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "*batch d_in"]) -> Float[Tensor, "*batch d_out"]:
        return self.base(x) + self.scaling * self.lora_b(self.lora_a(self.dropout(x)))

    def merged(self) -> nn.Linear:
        """One ``nn.Linear`` computing the same function: W + (alpha / r) · B A."""
        linear = nn.Linear(
            self.base.in_features,
            self.base.out_features,
            bias=self.base.bias is not None,
            device=self.base.weight.device,
            dtype=self.base.weight.dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(self.base.weight + self.scaling * self.lora_b.weight @ self.lora_a.weight)
            if self.base.bias is not None:
                linear.bias.copy_(self.base.bias)
        return linear


def add_lora(model: nn.Module, targets: Iterable[str], r: int, alpha: float, dropout: float = 0.0) -> list[str]:
    """Freeze ``model`` and wrap each ``nn.Linear`` whose attribute name is in ``targets`` in a :class:`LoRALinear`.

    ``targets`` names attributes, e.g. ``("w_q", "w_v")`` for the queries' and values'
    projections of every attention. Returns the dotted names of the wrapped layers; raises
    ``ValueError`` if none matched (a misspelt target would otherwise train nothing).
    """
    targets = set(targets)
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, r, alpha, dropout))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    if not wrapped:
        raise ValueError(f"no nn.Linear named {sorted(targets)} in the model: nothing to adapt")
    return wrapped


def merge_lora(model: nn.Module) -> int:
    """Replace every :class:`LoRALinear` in ``model`` by its merged ``nn.Linear`` (in place); how many were merged."""
    merged = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, child_name, child.merged())
                merged += 1
    return merged


@jaxtyped(typechecker=beartype)
def next_token_loss(
    logits: Float[Tensor, "batch seq vocab"], tokens: Int[Tensor, "batch seq"], pad_id: int | None = None
) -> Float[Tensor, ""]:
    """Mean cross-entropy of predicting token ``t + 1`` from position ``t``; padding targets are ignored."""
    targets = tokens[:, 1:]
    return F.cross_entropy(
        rearrange(logits[:, :-1], "batch seq vocab -> (batch seq) vocab"),
        rearrange(targets, "batch seq -> (batch seq)"),
        ignore_index=-100 if pad_id is None else pad_id,
    )


# -- exercise 12's measurement


@jaxtyped(typechecker=beartype)
def nucleus_size(logits: Float[Tensor, " vocab"], temperature: float, top_p: float) -> int:
    """How many tokens nucleus sampling may draw from at this ``temperature``: those that
    :func:`filter_logits` keeps of ``logits / temperature`` with ``top_p``.

    Measured by filtering, not from a formula. ``temperature`` must be positive (0, greedy,
    always draws the one most likely token).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return int((filter_logits(logits / temperature, top_p=top_p) > -math.inf).sum())
