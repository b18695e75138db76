"""Chapter 10: grouped-query and multi-query attention (GQA, MQA), and the attention the full model uses.

``GroupedQueryAttention(d_model, heads, kv_heads)`` keeps ``heads`` query heads but only
``kv_heads`` key and value heads; each key/value head serves a group of ``heads // kv_heads``
query heads. ``kv_heads == heads`` is chapter 03's multi-head attention (same parameters, same
names, same result), ``kv_heads == 1`` is multi-query attention. The same module takes the
rotary positions of chapter 06 and the KV-cache of chapter 09, so that the model of chapters
07 and 08 has one attention for every option.
"""

import math

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import einsum, reduce, repeat
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.before import masked_softmax
from stepformer.kvcache import KVCache
from stepformer.multihead import merge_heads, split_heads
from stepformer.positional import RotaryEmbedding


@jaxtyped(typechecker=beartype)
def repeat_kv(x: Float[Tensor, "batch kv_heads seq d_head"], heads: int) -> Float[Tensor, "batch heads seq d_head"]:
    """Give every query head its key/value head: head ``h`` reads key/value head ``h // group``.

    ``group = heads // kv_heads`` consecutive query heads share one key/value head, so the
    repeated axis is ``(kv_heads group)``, group innermost, the order of
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` and of the GQA paper.
    """
    kv_heads = x.shape[1]
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return repeat(x, "batch kv_heads seq d_head -> batch (kv_heads group) seq d_head", group=heads // kv_heads)


@jaxtyped(typechecker=beartype)
def grouped_attention(
    q: Float[Tensor, "batch heads q_len d_head"],
    k: Float[Tensor, "batch kv_heads k_len d_head"],
    v: Float[Tensor, "batch kv_heads k_len d_head"],
    mask: Bool[Tensor, "#batch #heads #q_len #k_len"] | Bool[Tensor, "#q_len #k_len"] | None = None,
    dropout: nn.Module | None = None,
) -> Float[Tensor, "batch heads q_len d_head"]:
    """Attention of ``heads`` query heads over ``kv_heads`` key/value heads, each serving ``heads // kv_heads``.

    The key/value heads are repeated in the ``(kv_heads group)`` order of :func:`repeat_kv`,
    then every head attends as in chapter 01: scores scaled by sqrt(d_head), ``mask`` with
    ``True`` = may attend, a query with no key to read gets zero weights and a zero output.
    ``dropout``, if given, acts on the attention weights before the weighted sum, as in chapter 01's
    :func:`scaled_dot_product_attention`.
    """
    heads = q.shape[1]
    k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    # From here on every query head has its own (shared) key/value head: chapter 01's attention,
    # written out so that each step shows its axes. Each head's dot products have d_head terms.
    scores = einsum(q, k, "batch heads q_len d_head, batch heads k_len d_head -> batch heads q_len k_len")
    scores = scores / math.sqrt(q.shape[-1])
    # Chapter 00's masked softmax: masked keys get weight 0, a row with no key left zeros, not NaN.
    weights = masked_softmax(scores, mask)
    if dropout is not None:
        weights = dropout(weights)
    return einsum(weights, v, "batch heads q_len k_len, batch heads k_len d_head -> batch heads q_len d_head")


class GroupedQueryAttention(nn.Module):
    """Attention with ``heads`` query heads and ``kv_heads`` key/value heads (``heads % kv_heads == 0``).

    ``w_q`` and ``w_o`` are ``nn.Linear(d_model, d_model)`` as in :class:`MultiHeadAttention`;
    ``w_k`` and ``w_v`` map ``d_model`` to ``kv_heads * d_head`` only, which is what shrinks
    the parameters and, above all, the KV-cache by ``heads / kv_heads``. ``kv_heads=None``
    means ``heads``. ``rope`` rotates queries and keys by their positions (chapter 06) before
    the scores; it is meant for self-attention. ``rope=True`` builds chapter 06's
    ``RotaryEmbedding(d_head)``; a ``RotaryEmbedding`` (or a subclass, such as
    :class:`~stepformer.parts.ComplexRotaryEmbedding`) is used as given, as chapters 07 and 08's
    layers take their parts, and must turn this attention's ``d_head`` features; ``False`` or
    ``None`` turns nothing. ``fast=True`` computes the attention with PyTorch's fused
    ``F.scaled_dot_product_attention`` instead of :func:`grouped_attention`: same result, less
    memory traffic, tested equal.
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope: bool | RotaryEmbedding | None = False,
        fast: bool = False,
    ) -> None:
        super().__init__()  # first: nn.Module must exist before the layers below can register as its parameters
        kv_heads = heads if kv_heads is None else kv_heads
        if heads < 1 or d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of heads ({heads})")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
        self.heads, self.kv_heads, self.d_head = heads, kv_heads, d_model // heads
        self.fast = fast
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        # Only kv_heads heads of keys and values: these are the numbers a KV-cache keeps.
        self.w_k = nn.Linear(d_model, kv_heads * self.d_head, bias=bias)
        self.w_v = nn.Linear(d_model, kv_heads * self.d_head, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        if isinstance(rope, RotaryEmbedding):  # the caller's choice of rotation, kept as it is
            if rope.d_head != self.d_head:
                raise ValueError(f"the given RotaryEmbedding turns d_head={rope.d_head} features, but this "
                                 f"attention's heads have d_head={self.d_head}")
            self.rope = rope
        else:
            self.rope = RotaryEmbedding(self.d_head) if rope else None

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        query: Float[Tensor, "batch q_len d_model"],
        key: Float[Tensor, "batch k_len d_model"],
        value: Float[Tensor, "batch k_len d_model"],
        mask: Bool[Tensor, "#batch #heads #q_len #total"] | Bool[Tensor, "#q_len #total"] | None = None,
        cache: KVCache | None = None,
        positions: Int[Tensor, " q_len"] | None = None,
    ) -> Float[Tensor, "batch q_len d_model"]:
        """Attend from ``query`` to ``key``/``value``, as :class:`MultiHeadAttention` does.

        ``mask`` is boolean, ``True`` = may attend, over all ``total`` keys read: ``k_len``
        without a cache, cached + ``k_len`` with a growing cache. The ``cache``'s ``update``
        takes the new keys and values and gives back all of them, as in chapter 03's attention;
        a fixed cache (cross-attention) that is already filled is read without projecting
        ``key`` and ``value`` at all, which it would ignore. ``positions`` are the query positions for RoPE (default:
        the cached length onwards); in self-attention the new keys sit at the same positions.
        """
        q = split_heads(self.w_q(query), self.heads)
        if cache is not None and cache.fixed and cache.keys is not None:
            k, v = cache.keys, cache.values
        else:
            # kv_heads heads of keys and values, not heads: the cache below stores these.
            k = split_heads(self.w_k(key), self.kv_heads)
            v = split_heads(self.w_v(value), self.kv_heads)
            if self.rope is not None:
                if positions is None:
                    start = 0 if cache is None else len(cache)
                    positions = torch.arange(start, start + query.shape[1], device=query.device)
                q, k = self.rope(q, positions), self.rope(k, positions)
            if cache is not None:
                k, v = cache.update(k, v)  # as chapter 03's attention does
        if self.fast:
            heads_out = _fused_attention(q, k, v, mask, self.dropout.p if self.training else 0.0)
        else:
            heads_out = grouped_attention(q, k, v, mask, self.dropout)
        return self.w_o(merge_heads(heads_out))


def _fused_attention(
    q: Float[Tensor, "batch heads q_len d_head"],
    k: Float[Tensor, "batch kv_heads k_len d_head"],
    v: Float[Tensor, "batch kv_heads k_len d_head"],
    mask: Tensor | None,
    dropout: float,
) -> Float[Tensor, "batch heads q_len d_head"]:
    """PyTorch's fused attention with the chapter 01 guarantee: a fully masked row gives zeros."""
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1]
    )
    if mask is None:
        return out
    # A query that may read no key has no defined softmax; the library's answer is zero. (Any
    # NaN left in a row that can read a key came from the inputs, and is left to be seen.)
    readable = reduce(mask, "... q_len k_len -> ... q_len 1", "max")
    return out.masked_fill(~readable, 0.0)


def from_multihead(mha: nn.Module, kv_heads: int) -> GroupedQueryAttention:
    """Convert a multi-head checkpoint to GQA by mean-pooling each group's key and value heads.

    ``mha`` is chapter 03's :class:`~stepformer.multihead.MultiHeadAttention` or a
    :class:`GroupedQueryAttention` (with ``kv_heads`` a multiple of the new ``kv_heads``).

    This is the conversion of Ainslie et al. (2023), "GQA": the ``heads // kv_heads``
    consecutive key heads of a group are averaged into one (and the value heads likewise);
    queries and the output projection are kept. The paper then trains for a short while
    ("uptraining") to recover the quality lost; this function only converts. A
    :class:`GroupedQueryAttention` source keeps its ``rope`` and ``fast`` settings.
    """
    heads = mha.heads
    d_model = mha.w_q.in_features
    bias = mha.w_q.bias is not None
    gqa = GroupedQueryAttention(
        d_model,
        heads,
        kv_heads,
        bias=bias,
        dropout=mha.dropout.p,
        rope=getattr(mha, "rope", None) is not None,
        fast=getattr(mha, "fast", False),
    )
    gqa = gqa.to(dtype=mha.w_q.weight.dtype, device=mha.w_q.weight.device)
    source_kv_heads = getattr(mha, "kv_heads", heads)
    if source_kv_heads % kv_heads:
        raise ValueError(f"the source's {source_kv_heads} key/value heads cannot be pooled into {kv_heads} groups")
    with torch.no_grad():
        gqa.w_q.load_state_dict(mha.w_q.state_dict())
        gqa.w_o.load_state_dict(mha.w_o.state_dict())
        for ours, theirs in ((gqa.w_k, mha.w_k), (gqa.w_v, mha.w_v)):
            # The heads of one group are consecutive, (kv_heads group), as in repeat_kv.
            ours.weight.copy_(
                reduce(
                    theirs.weight,
                    "(kv_heads group d_head) d_model -> (kv_heads d_head) d_model",
                    "mean",
                    kv_heads=kv_heads,
                    d_head=gqa.d_head,
                )
            )
            if bias:
                ours.bias.copy_(
                    reduce(
                        theirs.bias,
                        "(kv_heads group d_head) -> (kv_heads d_head)",
                        "mean",
                        kv_heads=kv_heads,
                        d_head=gqa.d_head,
                    )
                )
    return gqa


def measure_cache_bytes(d_model: int, heads: int, kv_heads: int, length: int, batch: int = 1) -> int:
    """Decode ``length`` positions one at a time through one attention layer; the bytes its cache holds.

    A :class:`GroupedQueryAttention` in self-attention reads each new position and appends its
    keys and values to a :class:`~stepformer.kvcache.KVCache`, as a decoder layer does in
    chapter 09. Measured on the cache's tensors (float32), not computed from a formula.
    """
    # Building the layer and the inputs draws random numbers: the caller's generator is left as it was.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        attention = GroupedQueryAttention(d_model, heads, kv_heads).eval()
        cache = KVCache()
        x = torch.randn(batch, length, d_model)
        for t in range(length):
            step = x[:, t:t + 1]
            attention(step, step, step, cache=cache)
    return cache.nbytes
