"""The captions: chapter 11's data layer and tokenizer, one caption a sequence ``<s> caption </s>``, batched
by tokens."""

from dataclasses import dataclass
from pathlib import Path

from beartype import beartype
from jaxtyping import Int, jaxtyped
from torch import Tensor

from stepformer.lm.config import RunConfig
from stepformer.translator.batching import Encoded, pad, token_batches
from stepformer.translator.data import DataError, load_split
from stepformer.translator.tokenizer import SubwordTokenizer

MASK = "<mask>"


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
        raise ValueError(f"this tokenizer has no {MASK} token: train it with stepformer.lm.data.train_tokenizer")
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
    tokenizer = train_tokenizer(en + de, run.model.vocab)
    encode = lambda texts: encode_captions(tokenizer, texts, run.model.max_len)  # noqa: E731
    return Data(tokenizer, encode(en), encode(en_val), encode(de), encode(de_val), en_val, eval_split)
