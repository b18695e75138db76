"""Training step time: ``stepformer.Transformer`` against ``torch.nn.Transformer`` of the same size.

    .venv/bin/python benchmarks/training_step.py [--d-model 256] [--layers 3] [--batch 32] [--len 32] [--device cpu]

One step is forward, cross-entropy, backward and an AdamW step on the same batch (with source
padding and the causal target mask). PyTorch's module gets the same embeddings and generator
as ours, so both models have the same parameters and do the same arithmetic. Ours runs twice:
the didactic path (chapter 10's grouped-query attention, ``grouped_attention`` written with
einops, and chapter 05's LayerNorm) and ``fast=True`` (PyTorch's fused
``scaled_dot_product_attention`` and ``nn.LayerNorm``, same parameters); the two are tested
equal, forward and backward, in ``tests/``. Prints the median step time of each after a
warm-up and its speed relative to PyTorch's (above 1: faster). The runtime shape checks
(jaxtyping with beartype) are off for the timed steps: the script sets ``JAXTYPING_DISABLE=1``
before importing stepformer, since jaxtyping reads it at import. Not a test.
"""

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # before stepformer is imported: jaxtyping reads it then

import jaxtyping  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from stepformer.masks import causal_mask  # noqa: E402
from stepformer.parts import ModelConfig, configured_transformer  # noqa: E402
from stepformer.transformer import Transformer, build_transformer  # noqa: E402

PAD = 0


class TorchModel(nn.Module):
    """``torch.nn.Transformer`` with the same embeddings (scaled, sinusoidal positions) and generator as ours."""

    def __init__(self, ours: Transformer, d_model: int, heads: int, layers: int, d_ff: int, dropout: float,
                 norm_first: bool = False) -> None:
        super().__init__()
        self.embed = ours.src_embed.__class__(ours.src_embed.tokens.num_embeddings, d_model, dropout=dropout)
        self.tgt_embed = ours.tgt_embed.__class__(ours.tgt_embed.tokens.num_embeddings, d_model, dropout=dropout)
        self.core = nn.Transformer(d_model, heads, layers, layers, d_ff, dropout, batch_first=True,
                                   norm_first=norm_first)
        self.generator = nn.Linear(d_model, ours.generator.out_features)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        pad_src, pad_tgt = src == PAD, tgt == PAD
        hidden = self.core(
            self.embed(src),
            self.tgt_embed(tgt),
            tgt_mask=~causal_mask(tgt.shape[1], device=tgt.device),
            src_key_padding_mask=pad_src,
            tgt_key_padding_mask=pad_tgt,
            memory_key_padding_mask=pad_src,
        )
        return self.generator(hidden)


def batch(vocab: int, size: int, length: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(1, vocab, (size, length), generator=g)
    tgt = torch.randint(1, vocab, (size, length + 1), generator=g)
    lengths = torch.randint(length // 2, length + 1, (size,), generator=g)
    src[torch.arange(length) >= lengths[:, None]] = PAD  # a padded batch, as in translation
    return src.to(device), tgt.to(device)


def step_times(models: dict[str, nn.Module], src: torch.Tensor, tgt: torch.Tensor, steps: int,
               warmup: int) -> dict[str, float]:
    """Median seconds of one training step of each model, after ``warmup`` unmeasured steps.

    The models take turns, one step each per round, so that a change in the machine's load
    falls on all of them alike.
    """
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(warmup + steps):
        for name, model in models.items():
            model.train()
            if src.is_cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            logits = model(src, tgt[:, :-1])
            loss = loss_fn(logits.flatten(0, 1), tgt[:, 1:].flatten())
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            if src.is_cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"{name}: the loss is not finite, the benchmark's model is broken")
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3, help="encoder layers = decoder layers")
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--len", type=int, default=32, help="source length; the target has one more token")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    ours = build_transformer(args.vocab, args.vocab, d_model=args.d_model, heads=args.heads,
                             n_encoder_layers=args.layers, n_decoder_layers=args.layers, d_ff=args.d_ff,
                             dropout=0.1).to(args.device)
    config = ModelConfig.original(args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers,
                                  d_ff=args.d_ff, dropout=0.1, fast=True)
    fast = configured_transformer(config).to(args.device)
    theirs = TorchModel(ours, args.d_model, args.heads, args.layers, args.d_ff, 0.1).to(args.device)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in
              (("ours", ours), ("fast", fast), ("torch", theirs))}
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"the models differ in size: {counts}")
    src, tgt = batch(args.vocab, args.batch, args.len, args.device)

    models = {"torch.nn.Transformer": theirs, "build_transformer": ours,
              "configured_transformer(fast=True)": fast}
    rows = list(step_times(models, src, tgt, args.steps, args.warmup).items())
    reference = rows[0][1]
    print(f"d_model={args.d_model} heads={args.heads} layers={args.layers}+{args.layers} d_ff={args.d_ff} "
          f"vocab={args.vocab} batch={args.batch} len={args.len} device={args.device} "
          f"threads={torch.get_num_threads()} parameters={counts['ours']:,}")
    checks = "off (JAXTYPING_DISABLE=1)" if jaxtyping.config.jaxtyping_disable else "on"
    print(f"runtime shape checks {checks}; median of {args.steps} steps after {args.warmup}, the models taking turns")
    print("| model | ms per step | speed vs torch.nn.Transformer |")
    print("| --- | --- | --- |")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1000:.1f} | {reference / seconds:.2f} |")


if __name__ == "__main__":
    main()
