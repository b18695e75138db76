"""Chapter 11: turning the trained model into translations: batched greedy decoding and beam search.

Both read earlier target positions from chapter 09's KV-cache (``use_cache=True``): each step
feeds one token per hypothesis through the decoder, and the cross-attention keys and values of
the encoder's memory are computed at the first step and read at every later one. With
``use_cache=False`` every step recomputes the whole prefix instead: the same translations,
slower, which is what the decoding benchmark measures. A sentence may produce at most
``max_len_a · source length + max_len_b`` tokens.
"""

import torch
from beartype import beartype
from einops import rearrange, repeat
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor

from stepformer.kvcache import LayerCache, new_cache
from stepformer.masks import causal_mask, padding_mask
from stepformer.transformer import Transformer
from stepformer.translator.batching import Encoded, collate, token_batches
from stepformer.translator.recipe import beam_step


class _Stepper:
    """The decoder's next-token log-probabilities for a set of hypotheses, with or without a cache.

    Holds each hypothesis's memory row, source mask and (with a cache) its per-layer keys and
    values, and keeps them in step with the hypotheses when beam search reorders or drops them.
    """

    def __init__(self, model: Transformer, memory: Tensor, src_mask: Tensor, use_cache: bool) -> None:
        self.model, self.memory, self.src_mask = model, memory, src_mask
        self.cache: list[LayerCache] | None = new_cache(len(model.decoder.layers)) if use_cache else None
        # The logits are the largest tensor of a step (rows × vocabulary); on a CPU a fresh one of
        # that size costs a round of page faults, so every step writes into this one. Rows only
        # shrink, so its first ``rows`` rows always fit.
        self.buffer = torch.empty(memory.shape[0], model.generator.out_features, device=memory.device)

    def logits(self, tokens: Int[Tensor, "rows length"]) -> Float[Tensor, "rows vocab"]:
        """The next token's logits after each row of ``tokens``, in float32, in :attr:`buffer`."""
        if self.cache is None:
            mask = causal_mask(tokens.shape[1], device=tokens.device)
            hidden = self.model.decode(tokens, self.memory, self.src_mask, mask)[:, -1]
        else:
            # One new position may read every cached one: no causal mask is needed.
            hidden = self.model.decode(tokens[:, -1:], self.memory, self.src_mask, None, self.cache)[:, -1]
        generator = self.model.generator
        logits = torch.mm(hidden.float(), generator.weight.float().t(), out=self.buffer[: hidden.shape[0]])
        return logits if generator.bias is None else logits.add_(generator.bias)

    def log_probs(self, tokens: Int[Tensor, "rows length"]) -> Float[Tensor, "rows vocab"]:
        """The next token's log-probabilities after each row of ``tokens``, overwriting the logits in place."""
        logits = self.logits(tokens)
        return torch.log_softmax(logits, dim=-1, out=logits)

    def select(self, rows: Int[Tensor, " new_rows"], source_rows: Tensor | None = None) -> None:
        """Keep only these hypotheses' state, in this order (a row may appear several times).

        The target-side state (the self-attention cache) follows ``rows``. The source-side state
        (memory, mask, cross-attention cache) is the same for all of a sentence's beams, so it is
        copied only when sentences leave the batch, following ``source_rows``; without them (beam
        search reordering beams within each sentence) it is already right and stays as it is.
        (``index_select`` rather than ``tensor[rows]``: the same rows, copied about twice as fast on a CPU.)
        """
        def take(kvs, chosen: Tensor) -> None:
            for kv in kvs:
                if kv.keys is not None:
                    kv.keys, kv.values = kv.keys.index_select(0, chosen), kv.values.index_select(0, chosen)

        take((layer.self_attn for layer in self.cache or []), rows)
        if source_rows is not None:
            self.memory = self.memory.index_select(0, source_rows)
            self.src_mask = self.src_mask.index_select(0, source_rows)
            take((layer.cross_attn for layer in self.cache or []), source_rows)


@jaxtyped(typechecker=beartype)
def best_extensions(
    scores: Float[Tensor, "batch beam"], log_probs: Float[Tensor, "batch beam vocab"], k: int
) -> tuple[Float[Tensor, "batch k"], Int[Tensor, "batch k"], Int[Tensor, "batch k"]]:
    """:func:`~stepformer.translator.recipe.beam_step`'s answer, found among fewer candidates.

    A beam's score adds the same amount to all of its tokens, so each of a sentence's ``k`` best
    candidates is among its own beam's ``k`` best tokens. ``beam_step`` then ranks those
    ``beam · k`` candidates instead of all ``beam · vocab``, and never builds the full-size sum.
    """
    top_log_probs, top_tokens = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    best, from_beam, top_index = beam_step(scores, top_log_probs, k)
    flat_tokens = rearrange(top_tokens, "batch beam top -> batch (beam top)")
    return best, from_beam, flat_tokens.gather(1, from_beam * top_tokens.shape[-1] + top_index)


def max_lengths(src: Tensor, pad_id: int, max_len_a: float, max_len_b: int, limit: int) -> Tensor:
    """Each sentence's cap on output tokens: ``a · source length + b``, at most ``limit`` (the model's positions)."""
    src_lengths = (src != pad_id).sum(dim=1)
    return (max_len_a * src_lengths + max_len_b).long().clamp(min=1, max=limit)


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def greedy_search(
    model: Transformer,
    src: Int[Tensor, "batch src_len"],
    bos_id: int,
    eos_id: int,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_positions: int = 256,
    use_cache: bool = True,
) -> list[list[int]]:
    """The most likely next token at every step, for a batch: each sentence's tokens (no ``<s>``, no ``</s>``)."""
    model.eval()
    src_mask = padding_mask(src, model.pad_id)
    stepper = _Stepper(model, model.encode(src, src_mask), src_mask, use_cache)
    limits = max_lengths(src, model.pad_id, max_len_a, max_len_b, max_positions - 1)
    tokens = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for step in range(int(limits.max())):
        next_token = stepper.logits(tokens).argmax(dim=-1)  # the log-softmax keeps the order
        next_token = next_token.masked_fill(finished, model.pad_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        finished |= (next_token == eos_id) | (step + 1 >= limits)
        if finished.all():
            break
    return [_strip(row, bos_id, eos_id, model.pad_id) for row in tokens.tolist()]


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def beam_search(
    model: Transformer,
    src: Int[Tensor, "batch src_len"],
    bos_id: int,
    eos_id: int,
    beam: int = 4,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_positions: int = 256,
    use_cache: bool = True,
) -> list[list[int]]:
    """The ``beam`` best partial translations kept at every step; each sentence's best finished one.

    Every step extends all beams of a sentence by one token and keeps the best ``2 · beam``
    (:func:`~stepformer.translator.recipe.beam_step`): those that end with ``</s>`` among the
    first ``beam`` become finished hypotheses, the best ``beam`` others go on. A sentence is done
    when it has ``beam`` finished hypotheses, or at its length cap, where its live beams are
    finished as they are. Finished hypotheses are ranked by score / length^``length_penalty``
    (length counting ``</s>``); done sentences leave the batch, so the rest decode faster.
    """
    if beam < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    model.eval()
    batch, device = src.shape[0], src.device
    src_mask = padding_mask(src, model.pad_id)
    memory = model.encode(src, src_mask)
    # Every beam of a sentence reads the same memory: rows are (batch beam), beam innermost.
    stepper = _Stepper(
        model,
        repeat(memory, "batch src_len d_model -> (batch beam) src_len d_model", beam=beam),
        repeat(src_mask, "batch 1 1 src_len -> (batch beam) 1 1 src_len", beam=beam),
        use_cache,
    )
    limits = max_lengths(src, model.pad_id, max_len_a, max_len_b, max_positions - 1)
    alive = torch.arange(batch, device=device)  # which sentences are still in the batch
    tokens = torch.full((batch * beam, 1), bos_id, dtype=torch.long, device=device)
    # Only the first beam is real at the start: the others would duplicate it.
    scores = torch.full((batch, beam), -torch.inf, device=device)
    scores[:, 0] = 0.0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    for step in range(1, int(limits.max()) + 1):
        log_probs = rearrange(stepper.log_probs(tokens), "(batch beam) vocab -> batch beam vocab", beam=beam)
        best, from_beam, token = best_extensions(scores, log_probs, 2 * beam)
        rows = alive.shape[0]
        # The bookkeeping below runs once per sentence: on Python lists, not tensor elements, which
        # would cost a tensor operation each.
        best_list, from_list, token_list = best.tolist(), from_beam.tolist(), token.tolist()
        history = rearrange(tokens, "(batch beam) length -> batch beam length", beam=beam)
        at_limit = (limits[alive] <= step).tolist()
        keep_rank = [[0] * beam for _ in range(rows)]
        kept_counts = [0] * rows  # early on, fewer than beam may exist
        done = set()
        for r, sentence in enumerate(alive.tolist()):
            kept = 0
            for rank in range(2 * beam):
                score, b, t = best_list[r][rank], from_list[r][rank], token_list[r][rank]
                if score == -torch.inf:
                    break
                if t == eos_id or at_limit[r]:
                    # An ended hypothesis counts only if it is among the ``beam`` best candidates.
                    if rank < beam and len(finished[sentence]) < beam:
                        ids = [*history[r, b, 1:].tolist(), *([] if t == eos_id else [t])]
                        normalised = score / (step ** length_penalty)
                        finished[sentence].append((normalised, ids))
                    continue
                if kept < beam:
                    keep_rank[r][kept] = rank
                    kept += 1
            kept_counts[r] = kept
            if len(finished[sentence]) >= beam or at_limit[r] or kept == 0:
                done.add(r)
        # The surviving beams: their scores, the beam each extends, the token it adds.
        keep_rank_t = torch.tensor(keep_rank, dtype=torch.long, device=device)
        counts = rearrange(torch.tensor(kept_counts, device=device), "batch -> batch 1")
        live = torch.arange(beam, device=device) < counts
        scores = best.gather(1, keep_rank_t).masked_fill(~live, -torch.inf)
        chosen_beam, chosen_token = from_beam.gather(1, keep_rank_t), token.gather(1, keep_rank_t)
        offsets = rearrange(torch.arange(rows, device=device) * beam, "batch -> batch 1")
        source_rows = rearrange(offsets + chosen_beam, "batch beam -> (batch beam)")
        tokens = torch.cat([tokens[source_rows], rearrange(chosen_token, "batch beam -> (batch beam) 1")], dim=1)
        if not done:
            stepper.select(source_rows)
            continue
        keep = torch.tensor([r for r in range(rows) if r not in done], dtype=torch.long, device=device)
        if keep.numel() == 0:
            break
        alive, scores = alive[keep], scores[keep]
        kept_rows = rearrange(
            rearrange(keep * beam, "batch -> batch 1") + torch.arange(beam, device=device),
            "batch beam -> (batch beam)",
        )
        tokens = tokens[kept_rows]
        # One copy of the self-attention cache: reorder the beams and drop the done sentences together.
        stepper.select(source_rows[kept_rows], source_rows=kept_rows)
    return [max(hypotheses)[1] if hypotheses else [] for hypotheses in finished]


def _strip(row: list[int], bos_id: int, eos_id: int, pad_id: int) -> list[int]:
    """The tokens after ``<s>`` and before the first ``</s>``."""
    out = []
    for t in row[1:]:
        if t in (eos_id, pad_id):
            break
        out.append(t)
    return out


def translate_encoded(
    model: Transformer,
    data: Encoded,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    max_tokens: int,
    beam: int = 1,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_positions: int = 256,
    use_cache: bool = True,
    progress: bool = False,
) -> list[list[int]]:
    """The output tokens for every source of ``data``, in its order: batched by length (``max_tokens``
    positions, or the longest source alone if that is longer), greedy for ``beam=1``, else beam search;
    on the model's device, in the caller's autocast."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    out: dict[int, list[int]] = {}
    longest = max((len(s) for s in data.src), default=1)
    batches = token_batches(data, max(max_tokens, longest), 0, 0, shuffle=False)
    for indices in tqdm(batches, desc="translating", unit="batch", disable=not progress):
        src, _ = collate(data, indices, pad_id, bos_id, eos_id)
        src = src.to(device)
        if beam == 1:
            ids = greedy_search(model, src, bos_id, eos_id, max_len_a, max_len_b, max_positions, use_cache)
        else:
            ids = beam_search(model, src, bos_id, eos_id, beam, length_penalty, max_len_a, max_len_b,
                              max_positions, use_cache)
        out.update(zip(indices, ids, strict=True))
    return [out[i] for i in range(len(data))]
