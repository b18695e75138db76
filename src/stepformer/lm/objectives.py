"""The two objectives and their held-out measures: next-token prediction (perplexity) and BERT's masked LM
(accuracy, on long words too, against the frequency baseline)."""

import math

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import rearrange
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor

from stepformer.lm.data import MASK, Captions, caption_batches, collate_captions, mask_id
from stepformer.models import EncoderModel, LanguageModel, next_token_loss
from stepformer.translator.tokenizer import SubwordTokenizer


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
