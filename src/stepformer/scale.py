"""Chapter 13: attention at scale. What the score matrix costs, and how FlashAttention avoids keeping it.

Attention over ``n`` positions computes an ``n × n`` matrix of scores: its time and memory
grow as n². FlashAttention (Dao et al., 2022) computes the same output without ever holding
that matrix: queries and keys are taken in blocks (tiles), and the softmax over a row is put
together block by block with the *online softmax* (Milakov and Gimelshein, 2018), which keeps a
running maximum and a running sum of exponentials instead of the whole row. The backward pass
recomputes each block's weights from the one number per row that the forward saved, the
log-sum-exp, instead of storing them. This module builds each step in PyTorch on any device:

- :func:`online_softmax`: the softmax of each row, its normaliser found in one pass over blocks;
- :func:`tile_step`: one block of keys folded into the running maximum, sum and output;
- :func:`causal_block_visits`: which blocks a causal attention must compute at all;
- :func:`tiled_attention`: the forward pass, returning the output and the log-sum-exp;
- :func:`flash_attention`: forward and backward by recomputation (:class:`TiledAttention`);
- :func:`checkpointed_encoder`: activation checkpointing on chapter 07's encoder;
- :func:`sliding_window_mask`, :func:`kept_positions`, :func:`window_cache_bytes`: local
  attention and attention sinks, and the KV-cache they let a decoder drop;
- :class:`LiveBytes`: the bytes of tensors alive at once, counted, to measure memory on a CPU.

Conventions are chapter 01's: boolean masks, ``True`` = may attend; a query that may read no key
gets a zero output, and its log-sum-exp is -inf.
"""

import math
import weakref
from collections.abc import Iterator

import torch
from beartype import beartype
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float, jaxtyped
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from stepformer.kvcache import cache_bytes
from stepformer.masks import causal_mask


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors that PyTorch operations create while the mode is on.

    Every tensor made by an operation inside ``with LiveBytes() as live:`` is counted once per
    storage (a view is not new memory) until Python frees that storage; ``live.peak`` is the
    most bytes alive at one time, ``live.now`` the bytes still alive. Tensors made before the
    ``with`` (the inputs, the weights) are not counted, nor are views of them, so the peak is
    what the computation itself needed. This is how this chapter measures memory on a CPU, where PyTorch keeps no
    allocator statistics; on a GPU ``torch.cuda.max_memory_allocated`` measures the same.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view (a slice, a transpose, a reshape) or an in-place result lies in an argument's
        # storage: no new memory, even when that argument was made before the mode was on.
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata  # one number per storage, however many views share it
            if key in self._sizes or key in inputs:
                continue
            self._sizes[key] = storage.nbytes()
            self.now += self._sizes[key]
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)


def _shift(row_max: Tensor) -> Tensor:
    """The running maximum where it is finite, else 0: a row that has read no key yet has nothing to shift."""
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


@jaxtyped(typechecker=beartype)
def online_softmax(scores: Float[Tensor, "*rows n"], block: int) -> Float[Tensor, "*rows n"]:
    """softmax over the last axis, its normaliser found in one pass over ``block`` columns at a time.

    The running maximum ``m`` and the running sum ``l`` of exp(score - m) start at -inf and 0.
    For each block, m' = max(m, the block's largest score), and the sum so far, taken relative
    to the old maximum, is rescaled: l' = l · exp(m - m') + Σ exp(block - m'). After the last
    block, softmax = exp(scores - m) / l. ``-inf`` marks a masked score; a row of nothing but
    -inf (a fully masked row) gives zeros, as chapter 01's attention does.
    """
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    row_max = torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype, device=scores.device)
    row_sum = torch.zeros_like(row_max)
    for start in range(0, scores.shape[-1], block):
        chunk = scores[..., start : start + block]
        new_max = torch.maximum(row_max, reduce(chunk, "... n -> ...", "max"))
        shift = _shift(new_max)
        row_sum = row_sum * torch.exp(row_max - shift) + reduce(
            torch.exp(chunk - shift[..., None]), "... n -> ...", "sum"
        )
        row_max = new_max
    weights = torch.exp(scores - _shift(row_max)[..., None]) / row_sum[..., None]
    return torch.where(row_sum[..., None] > 0, weights, torch.zeros_like(weights))


@jaxtyped(typechecker=beartype)
def tile_step(
    q: Float[Tensor, "*batch q_block d_k"],
    k: Float[Tensor, "*batch k_block d_k"],
    v: Float[Tensor, "*batch k_block d_v"],
    allowed: Bool[Tensor, "*#batch #q_block #k_block"] | None,
    row_max: Float[Tensor, "*batch q_block"],
    row_sum: Float[Tensor, "*batch q_block"],
    out: Float[Tensor, "*batch q_block d_v"],
) -> tuple[Float[Tensor, "*batch q_block"], Float[Tensor, "*batch q_block"], Float[Tensor, "*batch q_block d_v"]]:
    """Fold one block of keys and values into a block of queries' running state.

    The state of each query row is its largest score so far (``row_max``, -inf before any key),
    the sum of exp(score - row_max) so far (``row_sum``) and the unnormalised output
    Σ exp(score - row_max) · v (``out``). A new block of scores q kᵀ / sqrt(d_k), with the
    keys that ``allowed`` marks ``False`` set to -inf, may raise the maximum; the old sum and
    output were taken relative to the old maximum, so both are multiplied by
    exp(old max - new max) before the block's own terms are added. Returns the new
    ``(row_max, row_sum, out)``; the attention output is ``out / row_sum`` after the last block.
    """
    scores = einsum(q, k, "... q_block d_k, ... k_block d_k -> ... q_block k_block") / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    new_max = torch.maximum(row_max, reduce(scores, "... q_block k_block -> ... q_block", "max"))
    shift = _shift(new_max)
    rescale = torch.exp(row_max - shift)  # 0 for a row's first readable block: its old max is -inf
    weights = torch.exp(scores - shift[..., None])
    row_sum = row_sum * rescale + reduce(weights, "... q_block k_block -> ... q_block", "sum")
    out = out * rescale[..., None] + einsum(weights, v, "... q_block k_block, ... k_block d_v -> ... q_block d_v")
    return new_max, row_sum, out


@jaxtyped(typechecker=beartype)
def causal_block_visits(q_len: int, k_len: int, block_q: int, block_k: int) -> Bool[Tensor, "q_blocks k_blocks"]:
    """Which (query block, key block) pairs a causal attention must compute: ``True`` where any query may read any key.

    The mask is chapter 02's ``causal_mask(q_len, k_len)``: the queries are the last ``q_len`` of
    ``k_len`` positions, so query ``i`` reads keys ``0 ... i + k_len - q_len``. Query block ``a``
    holds queries ``a·block_q ...``, key block ``b`` keys ``b·block_k ...``. A block whose first
    key lies beyond what its last query may read is all masked: skipping it saves its work and
    changes nothing. For a square causal mask about half of the blocks are skipped.
    """
    if min(q_len, k_len, block_q, block_k) < 1:
        raise ValueError(f"lengths and block sizes must be at least 1, got {q_len}, {k_len}, {block_q}, {block_k}")
    if k_len < q_len:
        raise ValueError(f"k_len ({k_len}) must be at least q_len ({q_len}): the queries are the last q_len positions")
    last_query = torch.clamp(torch.arange(block_q - 1, q_len + block_q - 1, block_q), max=q_len - 1)
    first_key = torch.arange(0, k_len, block_k)
    reads_up_to = last_query + (k_len - q_len)
    return rearrange(first_key, "k_blocks -> 1 k_blocks") <= rearrange(reads_up_to, "q_blocks -> q_blocks 1")


def _block(mask: Tensor | None, rows: slice, cols: slice) -> Tensor | None:
    """The part of a broadcastable mask that covers ``rows`` of queries and ``cols`` of keys."""
    if mask is None:
        return None
    return mask[..., rows if mask.shape[-2] > 1 else slice(None), cols if mask.shape[-1] > 1 else slice(None)]


def _blocks(q_len: int, k_len: int, block_q: int, block_k: int, causal: bool) -> Iterator[tuple[slice, list[slice]]]:
    """Each block of query rows with the blocks of key columns it must read, in order.

    With ``causal``, a query block's key blocks stop at the first one that lies entirely beyond
    its last query (:func:`causal_block_visits`): every later one does too.
    """
    visits = causal_block_visits(q_len, k_len, block_q, block_k) if causal else None
    for a, q_start in enumerate(range(0, q_len, block_q)):
        cols = []
        for b, k_start in enumerate(range(0, k_len, block_k)):
            if visits is not None and not visits[a, b]:
                break
            cols.append(slice(k_start, min(k_start + block_k, k_len)))
        yield slice(q_start, min(q_start + block_q, q_len)), cols


def _check_blocks(q: Tensor, k: Tensor, causal: bool, block_q: int, block_k: int) -> None:
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q and block_k must be at least 1, got {block_q} and {block_k}")
    if causal and k.shape[-2] < q.shape[-2]:
        raise ValueError(f"a causal attention needs k_len >= q_len, got q_len {q.shape[-2]}, k_len {k.shape[-2]}")


def _allowed(mask: Tensor | None, causal: bool, rows: slice, cols: slice, offset: int, device) -> Tensor | None:
    """The mask of one block: the given mask's part, and the causal triangle's part if ``causal``."""
    allowed = _block(mask, rows, cols)
    if causal:
        query = torch.arange(rows.start, rows.stop, device=device) + offset
        key = torch.arange(cols.start, cols.stop, device=device)
        triangle = rearrange(key, "k -> 1 k") <= rearrange(query, "q -> q 1")
        allowed = triangle if allowed is None else allowed & triangle
    return allowed


@jaxtyped(typechecker=beartype)
def tiled_attention(
    q: Float[Tensor, "*batch q_len d_k"],
    k: Float[Tensor, "*batch k_len d_k"],
    v: Float[Tensor, "*batch k_len d_v"],
    mask: Bool[Tensor, "*#batch #q_len #k_len"] | None = None,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[Float[Tensor, "*batch q_len d_v"], Float[Tensor, "*batch q_len"]]:
    """softmax(q kᵀ / sqrt(d_k)) v computed block by block, without the (q_len, k_len) score matrix.

    Each block of ``block_q`` queries starts with row_max = -inf, row_sum = 0, out = 0 and reads
    the key blocks in order with :func:`tile_step`; the largest matrix alive is one block of
    scores, ``(block_q, block_k)`` per batch entry and head. ``mask`` is chapter 01's (``True``
    = may attend, broadcast against the scores); ``causal=True`` adds chapter 02's causal mask
    and skips the blocks it hides entirely (:func:`causal_block_visits`): once a key block is
    all masked for a query block, every later one is too.

    Returns ``(output, lse)``: the attention output, and per query the log-sum-exp of its
    scaled scores, log Σ_j exp(s_j) = row_max + log(row_sum), which the backward pass uses to
    recompute the weights as exp(s - lse). A query that may read no key gets a zero output and
    ``lse = -inf``.
    """
    _check_blocks(q, k, causal, block_q, block_k)
    q_len, k_len = q.shape[-2], k.shape[-2]
    outputs, lses = [], []
    for rows, key_blocks in _blocks(q_len, k_len, block_q, block_k, causal):
        q_block = q[..., rows, :]
        row_max = torch.full(q_block.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        out = torch.zeros((*q_block.shape[:-1], v.shape[-1]), dtype=v.dtype, device=v.device)
        for cols in key_blocks:
            allowed = _allowed(mask, causal, rows, cols, k_len - q_len, q.device)
            row_max, row_sum, out = tile_step(q_block, k[..., cols, :], v[..., cols, :], allowed, row_max, row_sum, out)
        read_any = row_sum > 0
        outputs.append(torch.where(read_any[..., None], out / torch.where(read_any, row_sum, 1.0)[..., None], 0.0))
        lses.append(torch.where(read_any, row_max + torch.log(torch.where(read_any, row_sum, 1.0)), -math.inf))
    return torch.cat(outputs, dim=-2), torch.cat(lses, dim=-1)


class TiledAttention(torch.autograd.Function):
    """Tiled attention whose backward pass recomputes each block's weights instead of storing them.

    The forward saves q, k, v, the output and the log-sum-exp: O(n · d), not O(n²). The backward
    visits the same blocks again; in each it recomputes the scores s = q kᵀ / sqrt(d_k) and the
    weights p = exp(s - lse) (exactly the forward's softmax), then applies the softmax's
    gradient: with dO the output's gradient and D = Σ_d dO ⊙ O per query (which equals Σ_j p_j
    dp_j), dV += pᵀ dO, dp = dO vᵀ, ds = p ⊙ (dp - D), dQ += ds k / sqrt(d_k) and
    dK += dsᵀ q / sqrt(d_k). This is Algorithm 2 of the FlashAttention paper, written with
    einsum; ``torch.autograd.gradcheck`` holds it against autograd in the tests.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, block_q, block_k):
        out, lse = tiled_attention(q, k, v, mask, causal, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.settings = (causal, block_q, block_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        causal, block_q, block_k = ctx.settings
        q_len, k_len, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # D_i = Σ_d dO_id O_id = Σ_j p_ij dp_ij: the softmax gradient's subtracted term, one per query.
        d_row = reduce(grad_out * out, "... q_len d_v -> ... q_len", "sum")
        # A row with lse = -inf read nothing: its recomputed weights must be 0, not exp(-inf + inf).
        lse = torch.where(torch.isfinite(lse), lse, math.inf)
        for rows, key_blocks in _blocks(q_len, k_len, block_q, block_k, causal):
            q_block, grad_out_block = q[..., rows, :], grad_out[..., rows, :]
            for cols in key_blocks:
                k_block, v_block = k[..., cols, :], v[..., cols, :]
                scores = einsum(q_block, k_block, "... q_block d_k, ... k_block d_k -> ... q_block k_block") * scale
                allowed = _allowed(mask, causal, rows, cols, k_len - q_len, q.device)
                if allowed is not None:
                    scores = scores.masked_fill(~allowed, -math.inf)
                weights = torch.exp(scores - lse[..., rows, None])
                grad_v[..., cols, :] += einsum(
                    weights, grad_out_block, "... q_block k_block, ... q_block d_v -> ... k_block d_v"
                )
                grad_weights = einsum(
                    grad_out_block, v_block, "... q_block d_v, ... k_block d_v -> ... q_block k_block"
                )
                grad_scores = weights * (grad_weights - d_row[..., rows, None])
                grad_q[..., rows, :] += scale * einsum(
                    grad_scores, k_block, "... q_block k_block, ... k_block d_k -> ... q_block d_k"
                )
                grad_k[..., cols, :] += scale * einsum(
                    grad_scores, q_block, "... q_block k_block, ... q_block d_k -> ... k_block d_k"
                )
        return grad_q, grad_k, grad_v, None, None, None, None


@jaxtyped(typechecker=beartype)
def flash_attention(
    q: Float[Tensor, "*batch q_len d_k"],
    k: Float[Tensor, "*batch k_len d_k"],
    v: Float[Tensor, "*batch k_len d_v"],
    mask: Bool[Tensor, "*#batch #q_len #k_len"] | None = None,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
) -> Float[Tensor, "*batch q_len d_v"]:
    """Attention by :class:`TiledAttention`: the tiled forward, and a backward that recomputes instead of storing.

    Same arguments and output as :func:`tiled_attention`'s first result. Differentiating
    :func:`tiled_attention` directly also works, but autograd then keeps every block's weights
    for the backward pass, which is the (q_len, k_len) matrix again, in pieces.
    """
    return TiledAttention.apply(q, k, v, mask, causal, block_q, block_k)[0]


@jaxtyped(typechecker=beartype)
def checkpointed_encoder(
    encoder: nn.Module, x: Float[Tensor, "batch seq d_model"], mask: Bool[Tensor, "..."] | None = None
) -> Float[Tensor, "batch seq d_model"]:
    """Chapter 07's ``Encoder`` run layer by layer under activation checkpointing.

    ``torch.utils.checkpoint.checkpoint`` keeps only each layer's input during the forward pass,
    not the activations inside the layer (the attention weights, the feed-forward's hidden
    units); the backward pass runs the layer's forward once more to get them back. Memory then
    grows with the number of layers times one ``(batch, seq, d_model)`` tensor, at the price of
    a second forward pass. The random state is saved with each layer and restored for the
    recomputation, so dropout draws the same masks and the gradients are those of ``encoder(x, mask)``.
    """
    for layer in encoder.layers:
        x = checkpoint(layer, x, mask, use_reentrant=False)
    return encoder.norm(x)


@jaxtyped(typechecker=beartype)
def sliding_window_mask(
    q_len: int, window: int, k_len: int | None = None, sinks: int = 0, device: torch.device | str | None = None
) -> Bool[Tensor, "q_len k_len"]:
    """Chapter 02's causal mask restricted to each query's last ``window`` keys, plus the first ``sinks`` keys.

    Query ``i`` (at position ``p = i + k_len - q_len``, the queries being the last ``q_len``
    positions) reads key ``j`` when ``j <= p`` and either ``p - j < window`` (local attention,
    as in Longformer and Mistral; the query itself included) or ``j < sinks`` (attention sinks,
    StreamingLLM: the first tokens, which trained models attend to heavily, are kept).
    """
    k_len = q_len if k_len is None else k_len
    if window < 1 or sinks < 0:
        raise ValueError(f"window must be at least 1 and sinks at least 0, got window={window}, sinks={sinks}")
    causal = causal_mask(q_len, k_len, device=device)
    position = rearrange(torch.arange(q_len, device=device) + (k_len - q_len), "q_len -> q_len 1")
    key = rearrange(torch.arange(k_len, device=device), "k_len -> 1 k_len")
    return causal & ((position - key < window) | (key < sinks))


def kept_positions(length: int, window: int, sinks: int = 0) -> list[int]:
    """The cached positions that a new query at position ``length - 1`` may read under :func:`sliding_window_mask`.

    The first ``sinks`` positions and the last ``window``: every other key is masked for this
    query and for every later one, so a decoder's KV-cache can drop it for good.
    """
    if length < 1 or window < 1 or sinks < 0:
        raise ValueError(f"length and window must be at least 1 and sinks at least 0, got {length}, {window}, {sinks}")
    return sorted(set(range(min(sinks, length))) | set(range(max(0, length - window), length)))


def window_cache_bytes(
    layers: int, kv_heads: int, d_head: int, length: int, window: int, sinks: int = 0, batch: int = 1,
    bytes_per_element: int = 4,
) -> int:
    """Chapter 09's :func:`~stepformer.kvcache.cache_bytes` for a cache that keeps only :func:`kept_positions`.

    At most ``window + sinks`` positions per sequence, however long the sequence grows.
    """
    kept = len(kept_positions(length, window, sinks))
    return cache_bytes(layers, kv_heads, d_head, kept, batch, bytes_per_element)
