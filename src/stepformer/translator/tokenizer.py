"""Chapter 11: a joint subword vocabulary for both languages, trained on the training split only.

Byte-level BPE from Hugging Face ``tokenizers`` (Sennrich et al. 2016; Radford et al. 2019):
every sentence is first a sequence of UTF-8 bytes, so no character is ever unknown and decoding
gives back the exact text, accents, capitals, spaces and all (the tests check every line of
every split). ``tokenizers`` trains the 8,000 merges on 58,000 sentences in about a second,
and one JSON string holds the whole tokenizer, which the checkpoint stores beside the weights.
(SentencePiece would serve too, but normalises text with NFKC by default, so its round trip is
not exact without changing its settings.)
"""

import hashlib
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)


class SubwordTokenizer:
    """Text ↔ token ids with one vocabulary shared by both languages.

    ``pad_id``, ``bos_id`` and ``eos_id`` are 0, 1 and 2. :meth:`encode` gives ids without
    any special token; the batching adds ``<s>`` and ``</s>`` where the model needs them.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = [tokenizer.token_to_id(t) for t in SPECIALS]
        if ids != [0, 1, 2]:
            raise ValueError(f"this tokenizer's special tokens {SPECIALS} have ids {ids}, not 0, 1, 2")
        self.pad_id, self.bos_id, self.eos_id = ids

    @classmethod
    def train(cls, texts: list[str], vocab_size: int = 8000, min_frequency: int = 2) -> "SubwordTokenizer":
        """Learn byte-level BPE merges from ``texts`` (both languages' training sentences)."""
        if vocab_size < 256 + len(SPECIALS):
            raise ValueError(f"vocab_size must be at least {256 + len(SPECIALS)} (the 256 bytes and the specials)")
        tokenizer = Tokenizer(models.BPE())
        # GPT-2's pre-tokenizer: words keep their leading space as a byte, so spacing decodes back exactly.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
        return cls(tokenizer)

    @classmethod
    def from_json(cls, text: str) -> "SubwordTokenizer":
        return cls(Tokenizer.from_str(text))

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def fingerprint(self) -> str:
        """A short hash of the vocabulary and merges: a checkpoint runs only with the tokenizer it was trained with."""
        model = json.loads(self.to_json())["model"]
        canonical = json.dumps({"vocab": model["vocab"], "merges": model["merges"]}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Texts from token ids; special tokens (padding, ``<s>``, ``</s>``) are dropped."""
        return self.tokenizer.decode_batch(ids, skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        """The subword pieces of one text, readable (``Ġ`` marks a leading space, as bytes are shown by GPT-2)."""
        return self.tokenizer.encode(text, add_special_tokens=False).tokens
