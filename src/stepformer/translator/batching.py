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
