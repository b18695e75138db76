"""Chapter 12, trained here: a LLaMA-style language model, BERT's masked-LM objective and LoRA, on Multi30k captions.

The models are :mod:`stepformer.models`'s; this module gives them data and a training step, which
the loop chapter 11 shares (:mod:`stepformer.runs`) runs, and measures what chapter 12 says about them:

- the data: the English (and German) captions through chapter 11's data layer, one caption a
  sequence, ``<s> caption </s>``, with chapter 11's byte-level BPE trained on the training split
  of both languages (one vocabulary, so the English model can later read German) plus a
  ``<mask>`` token for BERT's objective;
- a decoder-only model with LLaMA's parts (:func:`llama_config`) trained with AdamW, warmup and
  cosine decay, gradient clipping, a budget in steps or minutes, a progress bar and a JSON-lines
  log; its held-out perplexity before and after, samples by each decoding rule, decoding speed
  with and without the KV-cache, and the cache's bytes per token with and without GQA;
- BERT's objective (:func:`mask_tokens`, :func:`masked_lm_loss`) on an encoder-only model
  (:func:`bert_config`): masked-token accuracy before and after, and its top-5 guesses;
- LoRA against full fine-tuning, adapting the English model to German: trainable parameters,
  the bytes one step holds, time, and the German loss before and after.

``stepformer-lm all`` runs everything and writes ``results.json`` and ``metrics.jsonl``; see
``stepformer-lm --help``.
"""

import argparse
import copy
import hashlib
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import rearrange
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn
from tqdm.auto import tqdm

from stepformer.kvcache import cache_bytes, new_cache
from stepformer.models import EncoderModel, LanguageModel, add_lora, generate, merge_lora, next_token_loss
from stepformer.parts import ModelConfig
from stepformer.runs import (
    Budget,
    MetricsLog,
    Position,
    Progress,
    StepResult,
    commit,
    hardware,
    save_text_atomically,
    training_loop,
)
from stepformer.translator.batching import Encoded, pad, token_batches
from stepformer.translator.config import pick_device
from stepformer.translator.data import SPLITS, DataError, load_split
from stepformer.translator.tokenizer import SubwordTokenizer

MASK = "<mask>"

# Prompts for the samples: openings that Multi30k's captions use, none a whole caption.
PROMPTS = ("A man", "Two dogs", "A woman in a red", "A group of children", "A young girl is")
# Each decoding rule of chapter 12: keyword arguments of models.generate.
DECODINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 1.0": {"temperature": 1.0},
    "top-k 20": {"temperature": 1.0, "top_k": 20},
    "top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
}


# -- settings -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run besides its budget, saved in its results.

    The model sizes fill :func:`llama_config` and :func:`bert_config`; the optimisation is
    AdamW with ``warmup`` steps of linear warmup, then cosine decay to ``min_lr`` times the peak
    at the end of the budget (:func:`cosine_lr`).
    """

    vocab_size: int = 6000  # one BPE vocabulary for English and German: 29,000 captions each
    max_len: int = 64  # tokens per caption with <s> and </s>; Multi30k's longest English one has 51
    d_model: int = 192
    heads: int = 6  # d_head 32
    kv_heads: int = 2  # GQA: three query heads share each key/value head
    layers: int = 4
    d_ff: int = 512  # SwiGLU's hidden size, about 8/3 d_model (LLaMA's rule, rounded to 64)
    peak_lr: float = 2e-3  # a 3M-parameter pre-norm model takes a high rate
    warmup: int = 100
    min_lr: float = 0.1  # the rate ends at this fraction of the peak
    betas: tuple[float, float] = (0.9, 0.95)  # LLaMA's: beta2 0.95 steadies the updates
    weight_decay: float = 0.1  # on matrices and embeddings only, never norms or biases
    clip_norm: float = 1.0
    max_tokens: int = 2048  # padded positions per batch: about 120 captions
    eval_every: int = 100  # steps between held-out evaluations
    eval_limit: int | None = None  # held-out captions evaluated (None: all)
    seed: int = 1234
    # BERT's objective: an encoder of the same sizes, post-norm, so a lower rate
    mlm_lr: float = 1e-3
    mlm_dropout: float = 0.1
    # BERT chose 15% of the pieces; 40% gives more predictions per step (Wettig et al. 2023). After 1,000 steps,
    # asked BERT's 15% questions on the val captions: 38.6% right, against 33.7% when trained at 15%
    # (benchmarks/mlm_mask_rate.py, book/results/mlm_mask_rate.json).
    mlm_mask: float = 0.4
    # adapting the English model to German
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_lr: float = 2e-3  # LoRA's few parameters start at zero and take a larger rate than full fine-tuning
    full_lr: float = 5e-4
    adapt_steps: int = 200
    adapt_max_tokens: int = 1024  # smaller batches than pre-training: more steps in the same time
    log_every: int = 50  # steps between reads of the losses from the device; every step is logged
    # measurements
    sample_tokens: int = 40  # new tokens per sample
    speed_batch: int = 8
    speed_tokens: int = 48

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # Seconds on any CPU: the tests, and a first try of the command.
    "tiny": RunConfig(vocab_size=500, d_model=32, heads=4, kv_heads=2, layers=2, d_ff=64, warmup=10, max_tokens=1024,
                      eval_every=20, eval_limit=100, adapt_steps=5, sample_tokens=8, speed_batch=2, speed_tokens=8),
    # This course's 2-core machine or a laptop: the numbers of results/lm.
    "cpu": RunConfig(),
}


def llama_config(vocab: int, run: RunConfig = PRESETS["cpu"]) -> ModelConfig:
    """LLaMA's choices at a CPU's size: RMSNorm before each sublayer, RoPE, SwiGLU, GQA, no biases, tied embeddings.

    No dropout, as LLaMA; ``max_len`` is unused by RoPE, which has no table.
    """
    return ModelConfig(
        vocab=vocab, d_model=run.d_model, heads=run.heads, kv_heads=run.kv_heads, layers=run.layers, d_ff=run.d_ff,
        norm="rms", norm_eps=1e-6, placement="pre", final_norm=True, ffn="swiglu", positions="rope",
        max_len=run.max_len, bias=False, tie_embeddings=True, dropout=0.0,
    )


def bert_config(vocab: int, run: RunConfig = PRESETS["cpu"]) -> ModelConfig:
    """BERT's choices at the same size: LayerNorm after each sublayer, learned positions, GELU, biases,
    a normalised embedding with two segments (every caption is segment 0), dropout, tied embeddings."""
    return ModelConfig(
        vocab=vocab, d_model=run.d_model, heads=run.heads, layers=run.layers, d_ff=4 * run.d_model,
        norm="layer", norm_eps=1e-12, placement="post", final_norm=False, ffn="gelu", positions="learned",
        max_len=run.max_len, bias=True, tie_embeddings=True, embedding_norm=True, segments=2,
        dropout=run.mlm_dropout,
    )


# -- data -----------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> SubwordTokenizer:
    """Chapter 11's byte-level BPE (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2) learnt from ``texts``, plus ``<mask>`` last.

    Pass training captions only: the vocabulary is part of the model. ``<mask>`` is BERT's
    placeholder; a language model never reads it.
    """
    tokenizer = SubwordTokenizer.train(texts, vocab_size)
    tokenizer.tokenizer.add_special_tokens([MASK])
    return tokenizer


def mask_id(tokenizer: SubwordTokenizer) -> int:
    """The id of ``<mask>`` in a tokenizer from :func:`train_tokenizer`."""
    found = tokenizer.tokenizer.token_to_id(MASK)
    if found is None:
        raise ValueError(f"this tokenizer has no {MASK} token: train it with stepformer.lm.train_tokenizer")
    return found


@dataclass
class Captions:
    """Captions as ``<s> caption </s>`` id sequences; ``truncated`` counts those cut to ``max_len``."""

    sequences: list[list[int]]
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.sequences)


def encode_captions(tokenizer: SubwordTokenizer, texts: list[str], max_len: int) -> Captions:
    """One sequence per caption, ``<s> ids </s>``, the ids cut to ``max_len - 2`` where longer."""
    ids = tokenizer.encode(texts)
    cut = max_len - 2
    return Captions([[tokenizer.bos_id, *i[:cut], tokenizer.eos_id] for i in ids], sum(len(i) > cut for i in ids))


def caption_batches(
    captions: Captions, max_tokens: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[int]]:
    """Chapter 11's batches by tokens: captions of similar length together, at most ``max_tokens`` padded positions.

    Each caption stands where the translator has a source sentence, with an empty target, so
    its length is its own; the order follows ``(seed, epoch)``.
    """
    return token_batches(Encoded(captions.sequences, [[] for _ in captions.sequences]), max_tokens, seed, epoch,
                         shuffle)


@jaxtyped(typechecker=beartype)
def collate_captions(captions: Captions, indices: list[int], pad_id: int) -> Int[Tensor, "batch seq"]:
    """The sequences ``indices`` in one tensor, padded on the right with ``pad_id``."""
    return pad([captions.sequences[i] for i in indices], pad_id)


# -- the language model's loss and perplexity -------------------------------------------------------------


@jaxtyped(typechecker=beartype)
def lm_loss(model: LanguageModel, tokens: Int[Tensor, "batch seq"], pad_id: int) -> tuple[Float[Tensor, ""], int]:
    """The mean next-token loss over the real targets of a right-padded batch, and how many there are.

    No padding mask is needed: with padding only on the right, the causal mask already keeps
    every real position from reading a padded one, and padded targets are ignored.
    """
    targets = int((tokens[:, 1:] != pad_id).sum())
    return next_token_loss(model(tokens), tokens, pad_id), targets


@torch.no_grad()
def evaluate_lm(model: LanguageModel, captions: Captions, pad_id: int, max_tokens: int, device: torch.device) -> dict:
    """Held-out loss (nats per token) and perplexity exp(loss) over every next-token prediction of ``captions``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for indices in caption_batches(captions, max_tokens, 0, 0, shuffle=False):
        loss, targets = lm_loss(model, collate_captions(captions, indices, pad_id).to(device), pad_id)
        total, count = total + float(loss) * targets, count + targets
    model.train(was_training)
    return {"loss": total / count, "perplexity": math.exp(total / count), "tokens": count}


# -- BERT's objective -------------------------------------------------------------------------------------


@jaxtyped(typechecker=beartype)
def mask_tokens(
    tokens: Int[Tensor, "batch seq"],
    maskable: Bool[Tensor, "batch seq"],
    mask_id: int,
    random_ids: tuple[int, int],
    generator: torch.Generator | None = None,
    p: float = 0.15,
) -> tuple[Int[Tensor, "batch seq"], Bool[Tensor, "batch seq"]]:
    """BERT's corruption (Devlin et al. 2019, section 3.1): ``(inputs, chosen)``.

    Each ``maskable`` position (``True``: a word piece, not padding, ``<s>`` or ``</s>``) is chosen
    with probability ``p``; of the chosen, 80% become ``mask_id``, 10% a token drawn uniformly
    from ``random_ids = (low, high)`` (``high`` excluded) and 10% stay as they are, so that the
    model cannot learn that only ``<mask>`` needs predicting. The loss is computed at ``chosen``
    only. ``generator`` (on the CPU) makes the draw repeatable; the tensors may live anywhere.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"the masking probability must lie in (0, 1), got {p}")
    shape = tokens.shape
    draw = torch.rand(shape, generator=generator).to(tokens.device)
    chosen = maskable & (torch.rand(shape, generator=generator).to(tokens.device) < p)
    masked = chosen & (draw < 0.8)
    randomised = chosen & (draw >= 0.8) & (draw < 0.9)
    replacements = torch.randint(*random_ids, shape, generator=generator).to(tokens.device)
    inputs = tokens.masked_fill(masked, mask_id)
    inputs = torch.where(randomised, replacements, inputs)
    return inputs, chosen


@jaxtyped(typechecker=beartype)
def masked_lm_loss(
    logits: Float[Tensor, "batch seq vocab"], tokens: Int[Tensor, "batch seq"], chosen: Bool[Tensor, "batch seq"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy of the original tokens at the ``chosen`` positions only (0 if none is chosen)."""
    per_token = F.cross_entropy(rearrange(logits, "batch seq vocab -> batch vocab seq"), tokens, reduction="none")
    return per_token.masked_fill(~chosen, 0.0).sum() / chosen.sum().clamp(min=1)


@jaxtyped(typechecker=beartype)
def maskable_positions(tokens: Int[Tensor, "batch seq"], tokenizer: SubwordTokenizer) -> Bool[Tensor, "batch seq"]:
    """``True`` at the word pieces: never padding, ``<s>`` or ``</s>``."""
    return (tokens != tokenizer.pad_id) & (tokens != tokenizer.bos_id) & (tokens != tokenizer.eos_id)


def ordinary_ids(tokenizer: SubwordTokenizer) -> tuple[int, int]:
    """``(low, high)``: the ids of word pieces, after the three specials and before ``<mask>``."""
    return (3, mask_id(tokenizer))


@jaxtyped(typechecker=beartype)
def mlm_step_loss(
    model: EncoderModel, tokens: Int[Tensor, "batch seq"], tokenizer: SubwordTokenizer, generator: torch.Generator,
    p: float = 0.15,
) -> Float[Tensor, ""]:
    """The masked-LM loss of one batch of captions, corrupted afresh by :func:`mask_tokens` (choosing each piece
    with probability ``p``) from ``generator``."""
    inputs, chosen = mask_tokens(tokens, maskable_positions(tokens, tokenizer), mask_id(tokenizer),
                                 ordinary_ids(tokenizer), generator, p=p)
    logits = model(inputs, padding=tokens != tokenizer.pad_id)
    return masked_lm_loss(logits, tokens, chosen)


# A "long word" has this many letters or more. On Multi30k's English captions the most frequent ones are
# woman, people, wearing, shirt, young, white: content words. At four letters "with" would lead them all.
LONG_WORD = 5


def is_long_word(piece: str) -> bool:
    """Whether a decoded piece starts a word (byte-level BPE marks that with a space) and is :data:`LONG_WORD`+
    letters long: mostly nouns, verbs and adjectives. Pieces from inside a word ("eople") are not counted."""
    return piece.startswith(" ") and piece[1:].isalpha() and len(piece) - 1 >= LONG_WORD


def long_word_ids(tokenizer: SubwordTokenizer) -> Bool[Tensor, " vocab"]:
    """``True`` at the ids whose piece is a long word (:func:`is_long_word`)."""
    return torch.tensor([is_long_word(tokenizer.decode([[i]])[0]) for i in range(tokenizer.vocab_size)])


def frequent_ids(captions: Captions, tokenizer: SubwordTokenizer) -> dict[str, int]:
    """The frequency baseline's guesses: the most frequent word piece of ``captions`` (``"any"``), and the most
    frequent of those that are long words (``"long"``, :func:`is_long_word`). Pass training captions only."""
    counts = torch.bincount(torch.tensor([i for s in captions.sequences for i in s[1:-1]]),
                            minlength=tokenizer.vocab_size)
    long_counts = counts.masked_fill(~long_word_ids(tokenizer), 0)
    if not long_counts.any():
        raise ValueError(f"no word piece of these captions is a word of {LONG_WORD}+ letters: the vocabulary "
                         f"({tokenizer.vocab_size} pieces) is too small to measure long words")
    return {"any": int(counts.argmax()), "long": int(long_counts.argmax())}


@torch.no_grad()
def evaluate_mlm(model: EncoderModel, captions: Captions, tokenizer: SubwordTokenizer, max_tokens: int,
                 device: torch.device, seed: int = 0, frequent: dict[str, int] | None = None) -> dict:
    """Held-out masked-LM loss and accuracy (the argmax is the original token) over one fixed corruption.

    The questions are BERT's: 15% of the pieces chosen, whatever rate the model was trained with, so that
    runs trained at different rates answer the same questions.

    The corruption is drawn from ``seed``, not from the training's generator, so that the model
    before and after training answers the same questions. ``long_words`` repeats the accuracy at
    the positions whose original token is a long word (:func:`is_long_word`). With ``frequent`` (from
    :func:`frequent_ids`) each accuracy comes with its frequency baseline: the accuracy of always
    guessing the most frequent training piece (among long words, the most frequent long word),
    the score of a model that ignores the context.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    long = long_word_ids(tokenizer).to(device)
    total, correct, count = 0.0, 0, 0
    long_correct, long_count, baseline, long_baseline = 0, 0, 0, 0
    for indices in caption_batches(captions, max_tokens, 0, 0, shuffle=False):
        tokens = collate_captions(captions, indices, tokenizer.pad_id).to(device)
        inputs, chosen = mask_tokens(tokens, maskable_positions(tokens, tokenizer), mask_id(tokenizer),
                                     ordinary_ids(tokenizer), generator)
        logits = model(inputs, padding=tokens != tokenizer.pad_id)
        n = int(chosen.sum())
        right = (logits.argmax(-1) == tokens) & chosen
        long_chosen = chosen & long[tokens]
        total += float(masked_lm_loss(logits, tokens, chosen)) * n
        correct, count = correct + int(right.sum()), count + n
        long_correct, long_count = long_correct + int((right & long_chosen).sum()), long_count + int(long_chosen.sum())
        if frequent is not None:
            baseline += int(((tokens == frequent["any"]) & chosen).sum())
            long_baseline += int(((tokens == frequent["long"]) & long_chosen).sum())
    model.train(was_training)
    result = {"loss": total / count, "accuracy": correct / count, "masked": count,
              "long_words": {"accuracy": long_correct / max(long_count, 1), "masked": long_count}}
    if frequent is not None:
        result["frequency_baseline"] = baseline / count
        result["long_words"]["frequency_baseline"] = long_baseline / max(long_count, 1)
    return result


@torch.no_grad()
def fill_mask_examples(model: EncoderModel, tokenizer: SubwordTokenizer, texts: list[str], device: torch.device,
                       count: int = 5, k: int = 5) -> list[dict]:
    """For the first ``count`` of ``texts`` with a long word (:func:`is_long_word`) that is one token: that word
    masked, the model's ``k`` most likely tokens there (the longest such word of each caption, so mostly nouns)."""
    model.eval()
    examples = []
    for text in texts:
        ids = tokenizer.encode([text])[0]
        pieces = [tokenizer.decode([[i]])[0] for i in ids]
        words = [(len(p.strip()), n) for n, p in enumerate(pieces) if is_long_word(p)]
        if not words:
            continue
        position = max(words)[1]
        inputs = [tokenizer.bos_id, *ids, tokenizer.eos_id]
        inputs[position + 1] = mask_id(tokenizer)
        logits = model(torch.tensor([inputs], device=device))[0, position + 1]
        top = torch.topk(torch.softmax(logits.float(), -1), k)
        space = " " if pieces[position].startswith(" ") else ""
        shown = tokenizer.decode([ids[:position]])[0] + space + MASK + tokenizer.decode([ids[position + 1:]])[0]
        examples.append({
            "masked": shown, "answer": pieces[position].strip(),
            "top5": [[tokenizer.decode([[int(i)]])[0].strip(), round(float(p), 4)]
                     for i, p in zip(top.indices, top.values, strict=True)],
        })
        if len(examples) == count:
            break
    return examples


# -- training --------------------------------------------------------------------------------------------


def cosine_lr(step: int, spent: float, peak_lr: float, warmup: int, min_lr: float) -> float:
    """Linear warmup over the first ``warmup`` steps, then a half cosine from ``peak_lr`` to ``min_lr · peak_lr``.

    ``step`` counts from 1; ``spent`` is the fraction of the budget used
    (:func:`stepformer.runs.budget_fraction`), so the cosine ends where the budget does, in steps or in minutes.
    """
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if step <= warmup:
        return peak_lr * step / warmup
    return peak_lr * (min_lr + (1.0 - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(spent, 1.0))))


def make_optimizer(model: nn.Module, lr: float, run: RunConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, decaying matrices and embeddings, not norms or biases."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": run.weight_decay},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=run.betas)


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _bytes(tensors) -> int:
    """The bytes of distinct tensors (a tied weight counts once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def train_loop(
    model: nn.Module,
    train: Captions,
    step_loss: Callable[[nn.Module, Tensor, torch.Generator], Tensor],
    run: RunConfig,
    budget: Budget,
    peak_lr: float,
    pad_id: int,
    device: torch.device,
    phase: str,
    warmup: int | None = None,
    evaluate: Callable[[], dict] | None = None,
    metrics=None,
    progress: bool = True,
    measure_memory: bool = False,
) -> dict:
    """Train ``model`` on ``train`` until ``budget`` is spent (:func:`stepformer.runs.training_loop`); its record:
    steps, time, the loss curve.

    ``step_loss(model, tokens, generator)`` gives a batch's loss; ``generator`` is seeded from
    ``run.seed`` (BERT's masking draws from it), as are the batches and their order, so the same
    seed and a budget in steps give the same losses. Every ``run.eval_every`` steps, and at the
    end, ``evaluate()`` adds a held-out point. Each step and each evaluation is a line of
    ``metrics`` (JSON, tagged with ``phase``). ``measure_memory`` counts the bytes that the first
    step holds (:func:`_step_bytes`).
    """
    warmup = run.warmup if warmup is None else warmup
    optimizer = make_optimizer(model, peak_lr, run)
    generator = torch.Generator().manual_seed(run.seed)
    log = MetricsLog(metrics, phase=phase)
    curve, evaluations, seen = [], [], {"tokens": 0, "evaluating_s": 0.0, "memory": None}

    def step(indices: list[int], lr: float) -> StepResult:
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = collate_captions(train, indices, pad_id)
        count = int((batch != pad_id).sum())  # tokens read, for tokens/s (counted before the copy to the device)
        tokens = batch.to(device)
        if measure_memory and seen["memory"] is None:
            loss, grad_norm, seen["memory"] = _step_bytes(model, optimizer, tokens, step_loss, generator,
                                                          run.clip_norm, device)
        else:
            loss = step_loss(model, tokens, generator)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), run.clip_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepResult(loss.detach(), count, grad_norm)

    def write(record: dict) -> None:
        curve.append([record["step"], record["loss"]])
        seen["tokens"] += record["tokens"]
        log.write(record)

    def held_out(at: Position) -> None:
        evaluation_started = time.perf_counter()
        evaluations.append({"step": at.step, **evaluate()})
        log.write(evaluations[-1])
        model.train()
        seen["evaluating_s"] += time.perf_counter() - evaluation_started

    model.train()
    started = time.perf_counter()
    end = training_loop(
        budget, lambda epoch: caption_batches(train, run.max_tokens, run.seed, epoch),
        lambda number, spent: cosine_lr(number, spent, peak_lr, warmup, run.min_lr), step, write,
        progress=Progress(budget, 0, enabled=progress), log_every=run.log_every,
        every=((run.eval_every, held_out),) if evaluate is not None else ())
    wall = time.perf_counter() - started
    if evaluate is not None and (not evaluations or evaluations[-1]["step"] != end.step):
        evaluations.append({"step": end.step, **evaluate()})
        log.write(evaluations[-1])
    # The budget is wall-clock, evaluations included; the speed is the training steps' own.
    return {"steps": end.step, "epochs": round(end.epochs, 3), "wall_s": round(wall, 2),
            "evaluating_s": round(seen["evaluating_s"], 2), "tokens": seen["tokens"],
            "tokens_per_s": round(seen["tokens"] / max(wall - seen["evaluating_s"], 1e-9), 1),
            "peak_lr": peak_lr, "warmup": warmup, "loss_curve": _thin(curve), "evaluations": evaluations,
            "trainable_parameters": trainable_parameters(model), "step_memory": seen["memory"]}


def _thin(curve: list[list], points: int = 100) -> list[list]:
    """About ``points`` points of a loss curve, each the mean loss of the steps up to it since the previous one."""
    size = max(1, math.ceil(len(curve) / points))
    return [[curve[min(i + size, len(curve)) - 1][0], round(sum(loss for _, loss in curve[i:i + size])
                                                           / len(curve[i:i + size]), 4)]
            for i in range(0, len(curve), size)]


def _step_bytes(model, optimizer, tokens, step_loss, generator, clip_norm, device) -> tuple:
    """One training step that counts the bytes it holds: parameters, gradients, AdamW's state, and the
    activations autograd saves for the backward pass (counted as the forward saves them, parameters excluded).

    Counted from the tensors themselves, on any device: Python's ``tracemalloc`` does not see
    PyTorch's allocator. The activations are freed during the backward pass as the gradients
    appear, so the sum of the four is an upper bound on the step's peak; on CUDA the allocator's
    own peak (``torch.cuda.max_memory_allocated``) is reported beside it.
    """
    saved = {}

    def pack(t: Tensor) -> Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_loss(model, tokens, generator)
    loss.backward()
    gradients = _bytes(p.grad for p in model.parameters())
    grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
    optimizer.step()
    state = _bytes(t for s in optimizer.state.values() for t in s.values())
    optimizer.zero_grad(set_to_none=True)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    memory = {
        "parameters_bytes": _bytes(model.parameters()), "gradients_bytes": gradients, "adamw_state_bytes": state,
        "saved_activations_bytes": sum(b for ptr, b in saved.items() if ptr not in parameter_storages),
        "batch_tokens": list(tokens.shape),
    }
    memory["counted_total_bytes"] = sum(v for k, v in memory.items() if k.endswith("_bytes"))
    memory["cuda_max_memory_allocated_bytes"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                                                 else None)
    return loss, grad_norm, memory


# -- what the trained language model does ----------------------------------------------------------------


def state_hash(model: nn.Module) -> str:
    """A sha256 of every tensor of the state dict (names, shapes, dtypes, values): equal means the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def sample(model: LanguageModel, tokenizer: SubwordTokenizer, prompts: tuple[str, ...] | list[str], decoding: dict,
           max_new_tokens: int, seed: int, device: torch.device) -> list[str]:
    """Each prompt (``<s>`` and its tokens) continued by :func:`~stepformer.models.generate` up to ``</s>``; the texts.

    One prompt at a time (prompts differ in length and the cache has no left padding), each
    with a generator seeded from ``seed`` and its index, so a sample can be reproduced alone.
    """
    texts = []
    for n, prompt in enumerate(prompts):
        ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode([prompt])[0]]], device=device)
        generator = torch.Generator(device=device).manual_seed(seed + n)
        out = generate(model, ids, max_new_tokens, eos_id=tokenizer.eos_id, generator=generator, **decoding)
        texts.append(tokenizer.decode([out[0].tolist()])[0])
    return texts


def all_samples(model: LanguageModel, tokenizer: SubwordTokenizer, run: RunConfig, device: torch.device) -> dict:
    """:data:`PROMPTS` continued by every rule of :data:`DECODINGS`."""
    return {name: sample(model, tokenizer, PROMPTS, decoding, run.sample_tokens, run.seed, device)
            for name, decoding in DECODINGS.items()}


@jaxtyped(typechecker=beartype)
def decoding_speed(model: LanguageModel, prompt: Int[Tensor, "batch prompt_len"], new_tokens: int,
                   repeats: int = 2) -> dict:
    """Greedy tokens per second with and without the KV-cache, the best of ``repeats``; the outputs must agree.

    No end token: every row generates all ``new_tokens``, so both ways do the same number of steps.
    """
    timings, outputs = {}, {}
    for use_cache in (True, False):
        best = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            outputs[use_cache] = generate(model, prompt, new_tokens, use_cache=use_cache)
            best = min(best, time.perf_counter() - started)
        timings[use_cache] = best
    same = torch.equal(outputs[True], outputs[False])
    if not same:
        raise AssertionError("greedy decoding with the KV-cache gave other tokens than without it")
    generated = prompt.shape[0] * new_tokens
    return {"batch": prompt.shape[0], "prompt_tokens": prompt.shape[1], "new_tokens": new_tokens,
            "with_cache_tokens_per_s": round(generated / timings[True], 1),
            "without_cache_tokens_per_s": round(generated / timings[False], 1),
            "speedup": round(timings[False] / timings[True], 2), "same_tokens": same}


@torch.no_grad()
@jaxtyped(typechecker=beartype)
def kv_cache_bytes_per_token(model: LanguageModel, tokens: Int[Tensor, "batch seq"]) -> float:
    """The bytes that the self-attention caches hold per position after reading ``tokens`` (measured on the tensors)."""
    model.eval()
    cache = new_cache(len(model.decoder.layers))
    model(tokens, cache=cache)
    return sum(layer.nbytes for layer in cache) / tokens.numel()


@jaxtyped(typechecker=beartype)
def kv_cache_comparison(model: LanguageModel, tokens: Int[Tensor, "batch seq"]) -> dict:
    """The cache's bytes per token of ``model`` (its ``kv_heads``) and of the same model with ``kv_heads = heads``."""
    config = model.config
    mha = LanguageModel(replace(config, kv_heads=None)).to(tokens.device)
    d_head = config.d_model // config.heads
    kv_heads = config.kv_heads or config.heads
    return {
        "heads": config.heads, "kv_heads": kv_heads, "layers": config.layers, "d_head": d_head,
        "dtype": str(next(model.parameters()).dtype),
        "bytes_per_token_mha": kv_cache_bytes_per_token(mha, tokens),
        "bytes_per_token_gqa": kv_cache_bytes_per_token(model, tokens),
        "formula_mha": cache_bytes(config.layers, config.heads, d_head, 1),
        "formula_gqa": cache_bytes(config.layers, kv_heads, d_head, 1),
    }


# -- the experiments --------------------------------------------------------------------------------------


@dataclass
class Data:
    """The captions that every experiment uses, encoded with one tokenizer."""

    tokenizer: SubwordTokenizer
    en_train: Captions
    en_val: Captions
    de_train: Captions
    de_val: Captions
    en_val_texts: list[str]
    eval_split: str

    def describe(self) -> dict:
        return {"tokenizer": {"vocab_size": self.tokenizer.vocab_size, "fingerprint": self.tokenizer.fingerprint,
                              "trained_on": "train.en + train.de", "specials": ["<pad>", "<s>", "</s>", MASK]},
                "captions": {"en_train": len(self.en_train), "de_train": len(self.de_train),
                             f"en_{self.eval_split}": len(self.en_val), f"de_{self.eval_split}": len(self.de_val)},
                "truncated": sum(c.truncated for c in (self.en_train, self.en_val, self.de_train, self.de_val)),
                "held_out_split": self.eval_split}


def prepare_data(run: RunConfig, data_dir: Path | str | None = None, eval_split: str = "val",
                 progress: bool = True) -> Data:
    """Read the captions through chapter 11's data layer (``data_dir``: a local copy, else the verified
    download), learn the tokenizer from both languages' training captions, encode everything.

    ``eval_split`` is the held-out split (``val`` or ``test_2016_flickr``), of which the first
    ``run.eval_limit`` captions are kept (all with ``None``).
    """
    if eval_split == "train":
        raise DataError("the held-out split cannot be 'train': the models learn from it; use val or test_2016_flickr")
    en, de = load_split("train", "en", "de", data_dir, progress=progress)
    en_val, de_val = load_split(eval_split, "en", "de", data_dir, progress=progress)
    en_val, de_val = en_val[:run.eval_limit], de_val[:run.eval_limit]
    tokenizer = train_tokenizer(en + de, run.vocab_size)
    encode = lambda texts: encode_captions(tokenizer, texts, run.max_len)  # noqa: E731
    return Data(tokenizer, encode(en), encode(en_val), encode(de), encode(de_val), en_val, eval_split)


def language_model_experiment(data: Data, run: RunConfig, budget: Budget, device: torch.device, metrics=None,
                              progress: bool = True, log=print) -> tuple[LanguageModel, dict]:
    """Train the LLaMA-style model on the English captions; the model and what was measured before and after."""
    tokenizer = data.tokenizer
    torch.manual_seed(run.seed)
    config = llama_config(tokenizer.vocab_size, run)
    model = LanguageModel(config).to(device)
    evaluate = lambda: evaluate_lm(model, data.en_val, tokenizer.pad_id, run.max_tokens, device)  # noqa: E731
    untrained = evaluate()
    untrained_samples = all_samples(model, tokenizer, run, device)
    log(f"language model: {sum(p.numel() for p in model.parameters()):,} parameters; held-out perplexity "
        f"{untrained['perplexity']:.1f} untrained")
    training = train_loop(model, data.en_train, lambda m, t, g: lm_loss(m, t, tokenizer.pad_id)[0], run, budget,
                          run.peak_lr, tokenizer.pad_id, device, "lm", evaluate=evaluate, metrics=metrics,
                          progress=progress)
    trained = training["evaluations"][-1]
    log(f"language model: held-out perplexity {trained['perplexity']:.1f} after {training['steps']} steps")
    before = state_hash(model)
    trained_samples = all_samples(model, tokenizer, run, device)
    after = state_hash(model)
    prompt = collate_captions(data.en_val, list(range(run.speed_batch)), tokenizer.pad_id)[:, :4].to(device)
    result = {
        "config": config.to_dict(), "parameters": sum(p.numel() for p in model.parameters()),
        **training,
        "perplexity": {"untrained": round(untrained["perplexity"], 2), "trained": round(trained["perplexity"], 2)},
        "loss": {"untrained": round(untrained["loss"], 4), "trained": round(trained["loss"], 4)},
        "held_out_tokens": trained["tokens"],
        "prompts": list(PROMPTS),
        "samples": {"untrained": untrained_samples, "trained": trained_samples},
        "sample_settings": {"max_new_tokens": run.sample_tokens, "seed": run.seed,
                            "decodings": {k: v for k, v in DECODINGS.items()}},
        "prompting_changes_no_weight": {"state_dict_sha256_before": before, "state_dict_sha256_after": after,
                                        "equal": before == after},
        "decoding_speed": decoding_speed(model, prompt, run.speed_tokens),
        "kv_cache": kv_cache_comparison(model, prompt),
    }
    return model, result


def masked_lm_experiment(data: Data, run: RunConfig, budget: Budget, device: torch.device, metrics=None,
                         progress: bool = True, log=print) -> dict:
    """Train a BERT-like encoder with the masked-LM objective on the English captions; accuracy before and after."""
    tokenizer = data.tokenizer
    torch.manual_seed(run.seed)
    config = bert_config(tokenizer.vocab_size, run)
    model = EncoderModel(config).to(device)
    frequent = frequent_ids(data.en_train, tokenizer)
    evaluate = lambda: evaluate_mlm(model, data.en_val, tokenizer, run.max_tokens, device,  # noqa: E731
                                    frequent=frequent)
    untrained = evaluate()
    log(f"masked LM: {sum(p.numel() for p in model.parameters()):,} parameters; held-out masked-token accuracy "
        f"{untrained['accuracy']:.1%} untrained")
    training = train_loop(model, data.en_train, lambda m, t, g: mlm_step_loss(m, t, tokenizer, g, run.mlm_mask),
                          run, budget, run.mlm_lr, tokenizer.pad_id, device, "mlm", evaluate=evaluate, metrics=metrics,
                          progress=progress)
    trained = training["evaluations"][-1]
    log(f"masked LM: held-out masked-token accuracy {trained['accuracy']:.1%} after {training['steps']} steps")
    return {
        "config": config.to_dict(), "parameters": sum(p.numel() for p in model.parameters()), **training,
        "recipe": {"chosen": run.mlm_mask, "chosen_when_evaluated": 0.15,
                   "of_chosen_masked": 0.8, "of_chosen_random": 0.1, "of_chosen_kept": 0.1,
                   "never_chosen": ["<pad>", "<s>", "</s>"]},
        "accuracy": {"untrained": round(untrained["accuracy"], 4), "trained": round(trained["accuracy"], 4),
                     "frequency_baseline": round(trained["frequency_baseline"], 4)},
        "long_words": {"untrained": round(untrained["long_words"]["accuracy"], 4),
                       "trained": round(trained["long_words"]["accuracy"], 4),
                       "frequency_baseline": round(trained["long_words"]["frequency_baseline"], 4),
                       "masked": trained["long_words"]["masked"]},
        "frequent_guesses": {k: tokenizer.decode([[i]])[0].strip() for k, i in frequent.items()},
        "loss": {"untrained": round(untrained["loss"], 4), "trained": round(trained["loss"], 4)},
        "held_out_masked_tokens": trained["masked"],
        "examples": fill_mask_examples(model, tokenizer, data.en_val_texts, device, count=8),
    }


def adaptation_experiment(base: LanguageModel, data: Data, run: RunConfig, budget: Budget, device: torch.device,
                          metrics=None, progress: bool = True, log=print) -> dict:
    """Adapt the English model to German twice, with LoRA on ``w_q`` and ``w_v`` and with every weight trainable.

    Each run starts from a copy of ``base``, trains for ``budget`` (each its own) over the same
    batches of ``run.adapt_max_tokens`` tokens, and reports its trainable parameters, the bytes
    its first step held, its time, and the held-out German and English losses before and after
    (the English one shows how much each forgets). LoRA's update is then merged into the weights
    and the logits compared.
    """
    tokenizer = data.tokenizer
    warmup = max(1, min(run.warmup, (budget.max_steps or run.adapt_steps) // 10))
    results = {}
    for mode in ("lora", "full"):
        torch.manual_seed(run.seed)
        model = copy.deepcopy(base)
        german = lambda m=model: evaluate_lm(m, data.de_val, tokenizer.pad_id, run.max_tokens, device)  # noqa: E731
        english = lambda m=model: evaluate_lm(m, data.en_val, tokenizer.pad_id, run.max_tokens, device)  # noqa: E731
        before_de, before_en = german(), english()
        wrapped = add_lora(model, ("w_q", "w_v"), run.lora_r, run.lora_alpha) if mode == "lora" else []
        training = train_loop(model, data.de_train, lambda m, t, g: lm_loss(m, t, tokenizer.pad_id)[0],
                              replace(run, max_tokens=run.adapt_max_tokens), budget,
                              run.lora_lr if mode == "lora" else run.full_lr, tokenizer.pad_id, device, mode,
                              warmup=warmup, evaluate=lambda g=german: {"german_" + k: v for k, v in g().items()},
                              metrics=metrics, progress=progress, measure_memory=True)
        after_de, after_en = german(), english()
        result = {
            "trainable_parameters": training["trainable_parameters"],
            "all_parameters": sum(p.numel() for p in model.parameters()),
            "steps": training["steps"], "wall_s": training["wall_s"], "peak_lr": training["peak_lr"],
            "step_memory": training["step_memory"],
            "german_loss": {"before": round(before_de["loss"], 4), "after": round(after_de["loss"], 4)},
            "german_perplexity": {"before": round(before_de["perplexity"], 2),
                                  "after": round(after_de["perplexity"], 2)},
            "english_loss": {"before": round(before_en["loss"], 4), "after": round(after_en["loss"], 4)},
            "loss_curve": training["loss_curve"],
        }
        if mode == "lora":
            probe = collate_captions(data.de_val, list(range(min(8, len(data.de_val)))), tokenizer.pad_id).to(device)
            with torch.no_grad():
                model.eval()
                adapted = model(probe)
                merged = merge_lora(model)
                difference = float((model(probe) - adapted).abs().max())
            result.update({"r": run.lora_r, "alpha": run.lora_alpha, "targets": ["w_q", "w_v"],
                           "wrapped_layers": len(wrapped), "merged_layers": merged,
                           "merged_logits_max_abs_difference": difference})
        log(f"{mode}: {result['trainable_parameters']:,} trainable parameters, German held-out loss "
            f"{result['german_loss']['before']:.3f} -> {result['german_loss']['after']:.3f} in "
            f"{result['steps']} steps, {result['wall_s']:.0f} s")
        results[mode] = result
    return results


# -- the command line -------------------------------------------------------------------------------------

COMMANDS = {
    "train": "train the LLaMA-style language model on the English captions; perplexity, samples, decoding speed",
    "mlm": "train a BERT-like encoder with the masked-LM objective; masked-token accuracy and top-5 guesses",
    "lora": "train the language model, then adapt it to German with LoRA and with full fine-tuning",
    "all": "train, mlm and lora in one run, sharing one language model, into one results.json",
}
# How `all --minutes M` shares M between its phases (the adaptations also stop at --adapt-steps). BERT's
# objective gets the most: it learns only at the pieces it masks, the language model at every piece.
SHARES = {"lm": 0.375, "mlm": 0.5, "adapt": 0.125}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepformer-lm",
        description="Chapter 12's models trained on Multi30k's captions on a CPU: a LLaMA-style language model, "
        "BERT's masked-LM objective, and LoRA against full fine-tuning.\nEach command writes OUT/results.json "
        "(settings, hardware, commit and what was measured) and OUT/metrics.jsonl (one line per training step).",
        epilog="Examples:\n"
        "  stepformer-lm all --out results/lm                    # everything, about 16 minutes on 2 CPU cores\n"
        "  stepformer-lm train --minutes 2 --out runs/lm-quick    # only the language model, 2 minutes of training\n"
        "  stepformer-lm all --preset tiny --steps 20 --out /tmp/lm   # seconds: see what the results hold\n"
        "  stepformer-lm all --data-dir ../shared/data/multi30k --threads 1 --out results/lm --replace\n\n"
        "Multi30k is downloaded on first use unless --data-dir names a local copy. No model weights are saved.\n"
        "Run 'stepformer-lm COMMAND --help' for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        command = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        command.add_argument("--out", type=Path, default=Path("results") / ("lm" if name == "all" else f"lm-{name}"),
                             help="the folder for results.json and metrics.jsonl; it must not exist yet unless "
                             "--replace (default: %(default)s)")
        command.add_argument("--replace", action="store_true", help="overwrite the results in an existing --out")
        budget = command.add_mutually_exclusive_group()
        budget.add_argument("--minutes", type=float,
                            help="wall-clock budget of the training" + (
                                " (default 14), shared: language model 37.5%%, masked LM 50%%, LoRA and "
                                "full fine-tuning 12.5%% each"
                                if name == "all" else " (default 4)"))
        budget.add_argument("--steps", type=int, help="a budget in optimiser steps instead, which makes a run "
                            "reproducible" + (" (for the language model and the masked LM each; the adaptations "
                                              "take --adapt-steps)" if name in ("all", "lora") else ""))
        if name in ("lora", "all"):
            command.add_argument("--adapt-steps", type=int,
                                 help="steps of each German adaptation (default: the preset's, 200 for cpu)")
        if name in ("mlm", "all"):
            command.add_argument("--mask-rate", type=float,
                                 help="the share of pieces BERT's objective chooses in training (default: the "
                                 "preset's, 0.4; BERT's was 0.15); the held-out test always chooses 0.15")
        command.add_argument("--seed", type=int, default=1234, help="seeds the weights, batches and sampling "
                             "(default: %(default)s)")
        command.add_argument("--preset", default="cpu", help=f"model sizes and settings: {', '.join(PRESETS)} "
                             "(default: cpu; tiny takes seconds and learns little)")
        command.add_argument("--data-dir", type=Path, help="a local folder with Multi30k's <split>.<lang>.gz files "
                             "instead of downloading them")
        command.add_argument("--eval-split", default="val", help="the held-out split: val (default) or "
                             "test_2016_flickr")
        command.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: its own choice, one per "
                             "core); on a machine busy with other work, 1 is often several times faster")
        command.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args, argv if argv is not None else sys.argv[1:])
    except (ValueError, FileNotFoundError, FileExistsError, DataError) as error:
        print(f"stepformer-lm {args.command}: error: {error}", file=sys.stderr)
        return 2


OUTPUTS = ("results.json", "metrics.jsonl")


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; the presets are {', '.join(PRESETS)}")
    if args.eval_split not in SPLITS or args.eval_split == "train":
        raise ValueError(f"unknown held-out split {args.eval_split!r}; it is val or test_2016_flickr")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.minutes is not None and not args.minutes > 0:
        raise ValueError(f"--minutes must be positive, got {args.minutes}")
    if args.data_dir is not None and not args.data_dir.is_dir():
        raise FileNotFoundError(f"the data folder {args.data_dir} does not exist; it must hold Multi30k's "
                                "<split>.<lang>.gz files")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.replace:
        raise FileExistsError(f"{out} already exists and is not empty: pass --replace to overwrite its results, "
                              "or choose another --out")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    run = replace(PRESETS[args.preset], seed=args.seed)
    adapt_steps = getattr(args, "adapt_steps", None)
    if adapt_steps is not None:
        if adapt_steps < 1:
            raise ValueError(f"--adapt-steps must be at least 1, got {adapt_steps}")
        run = replace(run, adapt_steps=adapt_steps)
    mask_rate = getattr(args, "mask_rate", None)
    if mask_rate is not None:
        if not 0.0 < mask_rate < 1.0:
            raise ValueError(f"--mask-rate must lie between 0 and 1, got {mask_rate}")
        run = replace(run, mlm_mask=mask_rate)
    budgets = _budgets(args, run)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log = lambda message: tqdm.write(message, file=sys.stderr)  # noqa: E731
    progress = not args.no_progress
    started = time.perf_counter()
    device = pick_device()
    data = prepare_data(run, args.data_dir, args.eval_split, progress)
    log(f"data: {len(data.en_train):,} English and {len(data.de_train):,} German training captions; vocabulary "
        f"{data.tokenizer.vocab_size:,} subwords; held-out split {args.eval_split}; on {hardware(device)}")
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    results = {
        "command": "stepformer-lm " + shlex.join(argv), "commit": commit(), "hardware": hardware(device),
        "torch": torch.__version__, "seed": run.seed, "preset": args.preset, "settings": run.to_dict(),
        "budgets": {k: asdict(v) for k, v in budgets.items() if k in _phases(args.command)},
        **data.describe(),
    }
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as metrics:
        if args.command in ("train", "lora", "all"):
            model, results["language_model"] = language_model_experiment(data, run, budgets["lm"], device, metrics,
                                                                         progress, log)
        if args.command in ("mlm", "all"):
            results["masked_lm"] = masked_lm_experiment(data, run, budgets["mlm"], device, metrics, progress, log)
        if args.command in ("lora", "all"):
            results["adaptation"] = adaptation_experiment(model, data, run, budgets["adapt"], device, metrics,
                                                          progress, log)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    save_json(results, out / "results.json")
    log(f"wrote {out / 'results.json'} and {out / 'metrics.jsonl'} in {results['wall_s'] / 60:.1f} min")
    return 0


def _phases(command: str) -> tuple[str, ...]:
    return {"train": ("lm",), "mlm": ("mlm",), "lora": ("lm", "adapt"), "all": ("lm", "mlm", "adapt")}[command]


def _budgets(args: argparse.Namespace, run: RunConfig) -> dict[str, Budget]:
    """Each phase's budget from --steps or --minutes; ``all`` shares its minutes (:data:`SHARES`).

    Each German adaptation stops after ``run.adapt_steps`` steps, or earlier at its share of
    ``all``'s minutes.
    """
    if args.steps is not None:
        steps = Budget(max_steps=args.steps)
        return {"lm": steps, "mlm": steps, "adapt": Budget(max_steps=run.adapt_steps)}
    if args.command == "all":
        minutes = 14.0 if args.minutes is None else args.minutes
        return {"lm": Budget(max_minutes=minutes * SHARES["lm"]), "mlm": Budget(max_minutes=minutes * SHARES["mlm"]),
                "adapt": Budget(max_steps=run.adapt_steps, max_minutes=minutes * SHARES["adapt"])}
    minutes = Budget(max_minutes=4.0 if args.minutes is None else args.minutes)
    return {"lm": minutes, "mlm": minutes, "adapt": Budget(max_steps=run.adapt_steps)}


def save_json(results: dict, path: Path) -> None:
    """``results`` as indented UTF-8 JSON, written atomically (:func:`stepformer.runs.save_atomically`)."""
    save_text_atomically(json.dumps(results, indent=1, ensure_ascii=False) + "\n", path)


if __name__ == "__main__":
    sys.exit(main())
