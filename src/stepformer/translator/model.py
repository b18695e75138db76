"""The translator's model as the trainer runs it: chapter 08's Transformer, configured (chapter 10's attention, fused
kernels if asked) with tied embeddings, compiled for batches of every shape if asked."""

import torch
from torch import Tensor

from stepformer.parts import ModelConfig, configured_transformer
from stepformer.runs import shape_checks
from stepformer.transformer import Transformer
from stepformer.translator.config import TranslatorConfig
from stepformer.translator.fast import packed_dropout


def build_model(config: TranslatorConfig, vocab_size: int, pad_id: int) -> Transformer:
    """Chapter 08's Transformer with one embedding matrix shared by source, target and output layer.

    Tying the three (Press and Wolf 2017; section 3.4 of the paper) fits a joint vocabulary: a
    subword is the same row whichever language it comes from, and the model has a third fewer
    parameters to learn from 29,000 sentences. With ``config.fast`` its dropout draws its masks
    four elements per random number (:class:`.fast.PackedDropout`).
    """
    model = configured_transformer(
        ModelConfig(
            vocab=vocab_size, d_model=config.d_model, heads=config.heads, layers=config.layers, d_ff=config.d_ff,
            kv_heads=config.kv_heads, norm="layer", placement="pre" if config.norm_first else "post",
            final_norm=True, ffn=config.activation, positions="sinusoidal", max_len=config.max_len,
            tie_embeddings=True, scale_embeddings=True, dropout=config.dropout, fast=config.fast,
        ),
        pad_id=pad_id,
    )  # fmt: skip
    return packed_dropout(model) if config.fast else model


def compile_model(model: torch.nn.Module):
    """``model`` compiled for batches of every shape: one graph, no recompiles as batch sizes and lengths vary.

    The returned ``forward(src, tgt_in)`` marks the batch's size and its two lengths dynamic before each
    call, since only those vary between steps; ``dynamic=True`` would make every number symbolic, the
    dropout rates and norm epsilons too, and Dynamo would then trace the model a second time to make
    them constants again (benchmarks/step_overhead.py: the compile's time, cold and from the cache).
    Sizes that happen to be equal in the first batch (15 sentences of 15 tokens) are not assumed equal
    ever after: PyTorch's "duck sizing" is switched off for this process, or the next batch would
    compile again. The shape checks are off inside the compiled call: the compiler cannot trace them.
    """
    from torch.fx.experimental import _config as shape_config

    shape_config.use_duck_shape = False
    compiled = torch.compile(model)

    def forward(src: Tensor, tgt_in: Tensor) -> Tensor:
        for tensor in (src, tgt_in):  # (batch, length)
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        with shape_checks(False):
            return compiled(src, tgt_in)

    return forward
