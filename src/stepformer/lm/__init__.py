"""Chapter 12, trained here: a LLaMA-style language model, BERT's masked-LM objective and LoRA, on Multi30k captions.

The models are :mod:`stepformer.models`'s; this package gives them data and a training step, which
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

The package, one concern a module: :mod:`~stepformer.lm.config` (the settings and the two models'
configurations), :mod:`~stepformer.lm.data` (captions and their batches), :mod:`~stepformer.lm.objectives`
(the two losses and their held-out measures), :mod:`~stepformer.lm.loop` (training),
:mod:`~stepformer.lm.measure` (memory, samples, speed, the cache), :mod:`~stepformer.lm.experiments` (the
three runs) and :mod:`~stepformer.lm.cli` (the command).
"""
