"""Chapter 09: decoding with a KV-cache: each step feeds only the new tokens through the model.

:func:`cached_self_attention` is one attention layer's step, written out: project the new
positions only, append their keys and values to the cache, attend over everything cached.
:func:`generate_cached` is greedy decoding for the whole encoder-decoder with one cache per
layer; it gives the tokens and logits of :func:`stepformer.transformer.generate`.
"""

import torch
from beartype import beartype
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.attention import scaled_dot_product_attention
from stepformer.kvcache import KVCache, new_cache
from stepformer.multihead import merge_heads, split_heads
from stepformer.transformer import Transformer, greedy


@jaxtyped(typechecker=beartype)
def cached_self_attention(
    attention: nn.Module, x: Float[Tensor, "batch seq d_model"], cache: KVCache
) -> Float[Tensor, "batch new d_model"]:
    """Causal self-attention for the positions of ``x`` not yet in ``cache``, reading every cached one.

    ``attention`` is chapter 03's :class:`~stepformer.multihead.MultiHeadAttention` (its
    ``w_q``, ``w_k``, ``w_v``, ``w_o`` and ``heads``), in ``eval()`` mode; ``x`` holds all
    ``seq`` positions so far, of which the first ``cached = len(cache)`` already have their
    keys and values in ``cache``. Only the ``new = seq - cached`` others are projected: their
    keys and values are appended, and their queries attend over all ``seq`` keys, new query
    ``i`` (position ``cached + i``) reading keys ``0 ... cached + i``. An empty cache is the
    *prefill*, one new position a decoding step. The result equals the last ``new`` rows of
    ``attention(x, x, x, causal_mask(seq))``.
    """
    new = x[:, len(cache):]
    q = split_heads(attention.w_q(new), attention.heads)
    k = split_heads(attention.w_k(new), attention.heads)
    v = split_heads(attention.w_v(new), attention.heads)
    # The cache gives back every key and value so far: the prefix is never projected again.
    k, v = cache.append(k, v)
    # The new queries are the *last* rows of the causal mask: its triangle is aligned to the last key,
    # so new query i reads keys 0 ... cached + i (chapter 02's causal_mask(new, total) is the same).
    new_len, total = q.shape[-2], k.shape[-2]
    mask = torch.ones(new_len, total, dtype=torch.bool, device=x.device).tril(diagonal=total - new_len)
    heads_out, _ = scaled_dot_product_attention(q, k, v, mask)
    return attention.w_o(merge_heads(heads_out))


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def generate_cached(
    model: Transformer, src: Int[Tensor, "batch src_len"], max_new_tokens: int, bos_id: int, eos_id: int
) -> tuple[Int[Tensor, "batch out_len"], Float[Tensor, "batch steps tgt_vocab"]]:
    """Greedy decoding as :func:`~stepformer.transformer.generate`, with a KV-cache: ``(tokens, logits)``.

    Step ``t`` projects only token ``t`` in each decoder layer and appends its keys and values
    to the layer's cache; the cross-attention keys and values of the encoder's memory are
    computed at the first step and read afterwards. Same tokens and logits as recomputing the
    whole prefix, at a cost per step that does not grow with the projections of the prefix.
    """
    cache = new_cache(len(model.decoder.layers))

    def newest_token(tokens: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        # One new position may read every cached one: no causal mask is needed.
        return model.generator(model.decode(tokens[:, -1:], memory, src_mask, None, cache)[:, -1])

    return greedy(model, src, max_new_tokens, bos_id, eos_id, newest_token)
