"""Chapter 11: batches by tokens, not by sentences, with sentences of similar length together.

A batch of 128 sentences of 40 tokens holds ten times the work of one of 128 sentences of 4; a
budget in tokens keeps every step about equally heavy. Sorting by length before cutting the
batches (length buckets) keeps the padding small: fewer wasted positions, and for the
padding that remains, chapter 02's padding mask. The order within a length and the order of
the batches are drawn from ``seed`` and the epoch, so a run, or a resumed run, sees the same
batches in the same order.
"""

import random
from dataclasses import dataclass

import torch
from beartype import beartype
from jaxtyping import Int, jaxtyped
from torch import Tensor


@dataclass
class Encoded:
    """A split as token ids: ``src[i]`` translates to ``tgt[i]`` (no special tokens yet).

    ``truncated`` counts the sentences (source or target) that were longer than ``max_len``
    tokens and were cut to it.
    """

    src: list[list[int]]
    tgt: list[list[int]]
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.src)


def encode_pairs(tokenizer, src_texts: list[str], tgt_texts: list[str], max_len: int) -> Encoded:
    """Token ids of aligned sentences, each cut to ``max_len`` tokens (the cuts are counted).

    The target keeps two places for ``<s>`` and ``</s>`` within the model's ``max_len``
    positions, so it is cut to ``max_len - 2``; the source, which has no special token, to ``max_len``.
    """
    if len(src_texts) != len(tgt_texts):
        raise ValueError(f"{len(src_texts)} source sentences but {len(tgt_texts)} targets")
    src, tgt = tokenizer.encode(src_texts), tokenizer.encode(tgt_texts)
    truncated = sum(len(s) > max_len for s in src) + sum(len(t) > max_len - 2 for t in tgt)
    return Encoded([s[:max_len] for s in src], [t[: max_len - 2] for t in tgt], truncated)


def token_batches(data: Encoded, max_tokens: int, seed: int, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """The batches of one epoch, as lists of sentence indices.

    A batch holds as many sentences as fit in ``max_tokens`` *padded* positions, counting the
    longer of source and target (+2 for ``<s>`` and ``</s>``) for every sentence. Sentences are
    sorted by that length, ties in an order drawn from ``(seed, epoch)``; the batches are then
    shuffled with the same generator. ``shuffle=False`` keeps length order (for decoding).
    """
    lengths = [max(len(s), len(t) + 2) for s, t in zip(data.src, data.tgt, strict=True)]
    if max_tokens < max(lengths, default=0):
        raise ValueError(f"max_tokens={max_tokens} cannot hold the longest sentence ({max(lengths)} tokens)")
    rng = random.Random(f"{seed}-{epoch}")  # a string seed: the same on every platform and process
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])  # stable: the shuffle decides the order within a length
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


@jaxtyped(typechecker=beartype)
def pad(sequences: list[list[int]], pad_id: int) -> Int[Tensor, "batch seq"]:
    """Sequences of ids in one tensor, padded on the right with ``pad_id``."""
    longest = max(len(s) for s in sequences)
    out = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for row, s in enumerate(sequences):
        out[row, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(
    data: Encoded, indices: list[int], pad_id: int, bos_id: int, eos_id: int
) -> tuple[Int[Tensor, "batch src_len"], Int[Tensor, "batch tgt_len"]]:
    """``(src, tgt)`` for one batch: sources as they are, targets as ``<s> ... </s>``, both padded.

    The decoder reads ``tgt[:, :-1]`` and is trained to predict ``tgt[:, 1:]`` (teacher forcing).
    """
    src = pad([data.src[i] for i in indices], pad_id)
    tgt = pad([[bos_id, *data.tgt[i], eos_id] for i in indices], pad_id)
    return src, tgt


class PaddedTable:
    """A split padded once into two tables, so that a batch is a gather instead of Python padding.

    ``src[i]`` is sentence ``i``'s source and ``tgt[i]`` its ``<s> target </s>``, each padded with
    ``pad_id`` to the split's longest; both live on ``device``. :meth:`batch` gives exactly what
    :func:`collate` gives (tested), as two index lookups on the device: no per-step padding in Python,
    and on a GPU no copy from host memory but the batch's indices. The decoder's input and the
    targets come out as separate contiguous tensors, so their strides never differ between steps
    (a compiled model would otherwise see a new layout and compile again).
    """

    def __init__(self, data: Encoded, pad_id: int, bos_id: int, eos_id: int, device: torch.device | str = "cpu"):
        self.src_lengths = [len(s) for s in data.src]
        self.tgt_lengths = [len(t) + 2 for t in data.tgt]
        self.src = pad(data.src, pad_id).to(device)
        self.tgt = pad([[bos_id, *t, eos_id] for t in data.tgt], pad_id).to(device)
        self.device = self.src.device

    def indices(self, batches: list[list[int]]) -> list[Tensor]:
        """Each batch's indices as a device tensor, copied in one transfer for the whole epoch."""
        if not batches:
            return []
        flat = torch.tensor([i for b in batches for i in b], dtype=torch.long)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return list(flat.split([len(b) for b in batches]))

    def batch(self, batch: list[int], index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(src, tgt_in, tgt_out)``: ``collate``'s ``src``, ``tgt[:, :-1]`` and ``tgt[:, 1:]``, each contiguous.

        ``index`` is ``batch`` as a device tensor (from :meth:`indices`); the lengths, which set the
        shapes, are read from host lists, so nothing waits for the device.
        """
        if index is None:
            index = torch.tensor(batch, dtype=torch.long, device=self.device)
        src_len = max(self.src_lengths[i] for i in batch)
        tgt_len = max(self.tgt_lengths[i] for i in batch)
        src = self.src[index, :src_len]
        return src, self.tgt[index, : tgt_len - 1], self.tgt[index, 1:tgt_len]
