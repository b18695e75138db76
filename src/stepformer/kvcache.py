"""Chapter 09: the KV-cache. Keys and values kept between decoding steps, so each step projects one token."""

import math
from dataclasses import dataclass, field

import torch
from beartype import beartype
from einops import einsum, rearrange, reduce
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor


class KVCache:
    """One attention layer's keys and values, ``(batch, kv_heads, cached, d_head)`` each.

    A self-attention cache grows: every decoding step :meth:`append`\\ s the new positions'
    keys and values along the sequence axis and gets the whole prefix back. A cross-attention
    cache is ``fixed``: the encoder's memory does not change while the target is generated, so
    its keys and values are stored once (:meth:`store`) and read at every step. An empty cache
    holds ``None``. An attention layer calls :meth:`update`, which does whichever of the two
    the cache is for.
    """

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        """The number of cached positions."""
        return 0 if self.keys is None else self.keys.shape[-2]

    @jaxtyped(typechecker=beartype)
    def append(
        self, keys: Float[Tensor, "batch kv_heads new d_head"], values: Float[Tensor, "batch kv_heads new d_head"]
    ) -> tuple[Float[Tensor, "batch kv_heads total d_head"], Float[Tensor, "batch kv_heads total d_head"]]:
        """Add ``new`` positions after the cached ones; return all ``total = cached + new`` of them."""
        if self.fixed:
            raise ValueError("a fixed (cross-attention) cache is stored once, not appended to")
        if self.keys is not None and (self.keys.shape[:2] != keys.shape[:2] or self.keys.shape[-1] != keys.shape[-1]):
            raise ValueError(
                f"new keys {tuple(keys.shape)} do not continue the cached {tuple(self.keys.shape)}: "
                "batch, kv_heads and d_head must match"
            )
        # Axis -2 is the sequence: positions are appended, never heads or features.
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=-2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    @jaxtyped(typechecker=beartype)
    def update(
        self, keys: Float[Tensor, "batch kv_heads new d_head"], values: Float[Tensor, "batch kv_heads new d_head"]
    ) -> tuple[Float[Tensor, "batch kv_heads total d_head"], Float[Tensor, "batch kv_heads total d_head"]]:
        """What an attention layer calls with this step's keys and values: all those to attend over.

        A growing cache appends them (:meth:`append`) and returns every cached position. A fixed
        cache stores them at the first call (:meth:`store`) and returns the stored ones at every
        later call, ignoring what it is given: the encoder's memory has not changed.
        """
        if not self.fixed:
            return self.append(keys, values)
        if self.keys is None:
            self.store(keys, values)
        return self.keys, self.values

    @jaxtyped(typechecker=beartype)
    def store(
        self, keys: Float[Tensor, "batch kv_heads k_len d_head"], values: Float[Tensor, "batch kv_heads k_len d_head"]
    ) -> None:
        """Keep the cross-attention keys and values of the encoder's memory for every later step."""
        if not self.fixed:
            raise ValueError("only a fixed (cross-attention) cache is stored; a self-attention cache is appended to")
        self.keys, self.values = keys, values

    @property
    def nbytes(self) -> int:
        """The bytes held by the cached keys and values."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class LayerCache:
    """What one decoder layer keeps between steps: its growing self-attention cache and its
    fixed cross-attention cache."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(fixed=True))

    @property
    def nbytes(self) -> int:
        return self.self_attn.nbytes + self.cross_attn.nbytes


def new_cache(layers: int) -> list[LayerCache]:
    """An empty cache for a decoder of ``layers`` layers."""
    return [LayerCache() for _ in range(layers)]


def cache_bytes(
    layers: int, kv_heads: int, d_head: int, length: int, batch: int = 1, bytes_per_element: int = 4
) -> int:
    """The bytes that a decoder's self-attention KV-caches hold after ``length`` positions.

    Each of the ``layers`` layers keeps, for each of ``batch`` sequences and each position, a key
    and a value of ``d_head`` numbers per key/value head, ``bytes_per_element`` bytes a number (4
    for float32). With multi-head attention ``kv_heads`` is the number of heads; grouped-query
    attention (chapter 10) keeps fewer. Computed from the sizes alone; the tests hold it against
    the bytes of the tensors after decoding.
    """
    return 2 * layers * kv_heads * d_head * length * batch * bytes_per_element


class PagedKVCache:
    """A KV-cache stored in fixed-size blocks from a shared pool, found through a block table.

    This is the idea of PagedAttention (Kwon et al., 2023, vLLM): instead of one contiguous
    tensor per sequence, which must be allocated for the longest possible length, the cache is
    cut into blocks of ``block_size`` positions taken from a pool as a sequence grows. Sequence
    ``s``'s block table lists which pool blocks hold its positions 0 ... block_size - 1,
    block_size ... 2 · block_size - 1, and so on; the last block is the only one partly empty.
    The pool is ``(blocks, kv_heads, block_size, d_head)`` for keys and the same for values, on
    ``device`` (default: PyTorch's current default device).
    """

    def __init__(
        self,
        blocks: int,
        kv_heads: int,
        block_size: int,
        d_head: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.block_size = block_size
        self.key_pool = torch.zeros(blocks, kv_heads, block_size, d_head, dtype=dtype, device=device)
        self.value_pool = torch.zeros(blocks, kv_heads, block_size, d_head, dtype=dtype, device=device)
        self.free = list(range(blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @jaxtyped(typechecker=beartype)
    def append(
        self, sequence: int, keys: Float[Tensor, "kv_heads new d_head"], values: Float[Tensor, "kv_heads new d_head"]
    ) -> None:
        """Write ``new`` positions of one sequence, taking a fresh block from the pool when one fills up."""
        table = self.block_tables.setdefault(sequence, [])
        length = self.lengths.get(sequence, 0)
        for i in range(keys.shape[-2]):
            slot = length % self.block_size
            if slot == 0:
                if not self.free:
                    raise RuntimeError("the block pool is exhausted: no free block for a new position")
                table.append(self.free.pop(0))
            self.key_pool[table[-1], :, slot] = keys[:, i]
            self.value_pool[table[-1], :, slot] = values[:, i]
            length += 1
        self.lengths[sequence] = length

    @jaxtyped(typechecker=beartype)
    def gather(
        self, sequence: int
    ) -> tuple[Float[Tensor, "kv_heads length d_head"], Float[Tensor, "kv_heads length d_head"]]:
        """One sequence's keys and values in order, read block by block through its table."""
        table, length = self.table(sequence), self.lengths[sequence]
        return gather_blocks(self.key_pool, table, length), gather_blocks(self.value_pool, table, length)

    def table(self, sequence: int) -> Int[Tensor, " used"]:
        """One sequence's block table as a tensor, on the pool's device."""
        return torch.tensor(self.block_tables[sequence], dtype=torch.long, device=self.key_pool.device)

    @jaxtyped(typechecker=beartype)
    def attend(self, sequence: int, query: Float[Tensor, "heads q_len d_head"]) -> Float[Tensor, "heads q_len d_head"]:
        """Attention of ``query`` over one sequence's cached positions, read from the pool (:func:`paged_attention`)."""
        return paged_attention(query, self.key_pool, self.value_pool, self.table(sequence), self.lengths[sequence])

    def release(self, sequence: int) -> None:
        """A finished sequence gives its blocks back to the pool."""
        self.free.extend(self.block_tables.pop(sequence))
        del self.lengths[sequence]


@jaxtyped(typechecker=beartype)
def gather_blocks(
    pool: Float[Tensor, "blocks kv_heads block_size d_head"], table: Int[Tensor, " used"], length: int
) -> Float[Tensor, "kv_heads length d_head"]:
    """One sequence's keys (or values) in position order, read from the pool through its block table.

    Position ``p`` lives in slot ``p % block_size`` of block ``table[p // block_size]``: take the
    table's blocks in the table's order (not the pool's), lay their slots end to end along the
    sequence, and keep the first ``length`` positions, since the last block may be partly empty.
    """
    used = pool[table]
    # Block outermost, slot innermost: position p = i * block_size + slot of the table's i-th block.
    return rearrange(used, "used kv_heads slot d_head -> kv_heads (used slot) d_head")[:, :length]


@jaxtyped(typechecker=beartype)
def paged_attention(
    query: Float[Tensor, "heads q_len d_head"],
    key_pool: Float[Tensor, "blocks kv_heads block_size d_head"],
    value_pool: Float[Tensor, "blocks kv_heads block_size d_head"],
    table: Int[Tensor, " used"],
    length: int,
) -> Float[Tensor, "heads q_len d_head"]:
    """softmax(q kᵀ / sqrt(d_head)) v over one sequence's ``length`` cached positions, block by block from the pool.

    Nothing is gathered into a contiguous copy: each block of the table is read where it lies,
    as a PagedAttention kernel does, and the softmax is computed online across blocks (Milakov
    and Gimelshein, 2018; FlashAttention): each query row keeps ``row_max``, its largest score so
    far, ``row_sum``, the sum of exp(score - row_max), and ``out``, the unnormalised output; the
    last two are rescaled by ``exp(old max - new max)`` whenever a block raises the maximum
    (chapter 13's ``tile_step`` keeps the same state, and adds masks). Every query reads all
    ``length`` positions (a decoding step); query head ``h`` reads key/value head
    ``h // (heads // kv_heads)``, the ``(kv_heads group)`` order of chapter 10.
    """
    kv_heads, block_size = key_pool.shape[1], key_pool.shape[2]
    if not 0 < length <= len(table) * block_size:
        raise ValueError(f"length {length} must be at least 1 and fit in {len(table)} blocks of {block_size}")
    q = rearrange(query, "(kv_heads group) q_len d_head -> kv_heads group q_len d_head", kv_heads=kv_heads)
    # Each query row's state, named and shaped as chapter 13's tile_step keeps it: its largest score so far,
    # the sum of exp(score - row_max) so far, and the unnormalised output.
    row_max = torch.full(q.shape[:-1], -torch.inf, dtype=q.dtype, device=q.device)
    row_sum = torch.zeros_like(row_max)
    out = torch.zeros_like(q)
    for i, block in enumerate(table.tolist()):
        filled = min(block_size, length - i * block_size)  # only the last block may be partly empty
        if filled <= 0:
            break
        k, v = key_pool[block, :, :filled], value_pool[block, :, :filled]
        scores = einsum(q, k, "kv_heads group q_len d_head, kv_heads slot d_head -> kv_heads group q_len slot")
        scores = scores / math.sqrt(query.shape[-1])
        new_max = torch.maximum(row_max, reduce(scores, "... q_len slot -> ... q_len", "max"))
        rescale = torch.exp(row_max - new_max)  # 0 at the first block, where the old max is -inf
        weights = torch.exp(scores - new_max[..., None])
        row_sum = row_sum * rescale + reduce(weights, "... q_len slot -> ... q_len", "sum")
        out = out * rescale[..., None] + einsum(
            weights, v, "kv_heads group q_len slot, kv_heads slot d_head -> kv_heads group q_len d_head"
        )
        row_max = new_max
    return rearrange(out / row_sum[..., None], "kv_heads group q_len d_head -> (kv_heads group) q_len d_head")
