"""The translator's model as the trainer runs it: chapter 08's Transformer, configured (chapter 10's attention, fused
kernels if asked) with tied embeddings, compiled for batches of every shape if asked."""

from dataclasses import replace

import torch
from torch import Tensor

from stepformer.parts import configured_transformer
from stepformer.runs import shape_checks
from stepformer.transformer import Transformer
from stepformer.translator.config import TranslatorConfig
from stepformer.translator.fast import packed_dropout


def build_model(config: TranslatorConfig, vocab_size: int, pad_id: int) -> Transformer:
    """Chapter 08's Transformer with one embedding matrix shared by source, target and output layer.

    Tying the three (Press and Wolf 2017; section 3.4 of the paper) fits a joint vocabulary: a
    subword is the same row whichever language it comes from, and the model has a third fewer
    parameters to learn from 29,000 sentences. ``config.model`` describes the whole model
    (:class:`~stepformer.parts.ModelConfig`); its ``vocab`` is the size the tokenizer was asked for and
    ``vocab_size`` the one it has. With ``config.packed_dropout`` its dropout draws its masks
    four elements per random number (:class:`.fast.PackedDropout`).
    """
    # The tokenizer's count, which BPE may round away from the size asked for (config.model.vocab).
    model = configured_transformer(replace(config.model, vocab=vocab_size), pad_id)
    return packed_dropout(model) if config.packed_dropout else model


def compile_model(model: torch.nn.Module):
    """``model`` compiled for batches of every shape: one graph, no recompiles as batch sizes and lengths vary.

    The returned ``forward(src, tgt_in)`` marks the batch's size and its two lengths dynamic before each
    call, since only those vary between steps; ``dynamic=True`` would make every number symbolic, the
    dropout rates and norm epsilons too, and Dynamo would then trace the model a second time to make
    them constants again (benchmarks/step_overhead.py: the compile's time, cold and from the cache).
    Sizes that happen to be equal in the first batch (15 sentences of 15 tokens) are not to be assumed
    equal ever after, so PyTorch's "duck sizing" (one symbol for equal sizes) is off inside the compiled
    call; the shape checks are off there too: the compiler cannot trace them. Both settings are as they
    were outside the call.
    """
    from torch.fx.experimental import _config as shape_config

    compiled = torch.compile(model)

    def forward(src: Tensor, tgt_in: Tensor) -> Tensor:
        for tensor in (src, tgt_in):  # (batch, length)
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        with shape_checks(False), shape_config.patch(use_duck_shape=False):
            return compiled(src, tgt_in)

    return forward
