"""Training step time of chapter 12's LLaMA-style model against Hugging Face's ``LlamaForCausalLM``.

    .venv/bin/python benchmarks/lm_training_step.py [--d-model 256] [--layers 4] [--heads 8] [--kv-heads 2]
                                                    [--batch 16] [--len 64] [--steps 20] [--device cpu]

Both models have one configuration (RMSNorm, pre-norm, RoPE, SwiGLU, grouped-query attention,
no biases, untied output layer) and the same weights: ours is converted from theirs by
``stepformer.huggingface.from_llama``. One step is forward, next-token cross-entropy (with
right padding ignored), backward, gradient clipping and an AdamW step, on the same batches in the
same order; the losses of the first step are printed side by side (they must agree). Ours runs
with ``fast=True`` (PyTorch's fused attention and RMSNorm, and RoPE as complex products: the
library's default for chapter 12's models) and once more with the didactic parts
(``fast=False``); theirs with its default attention (``sdpa``). The steps alternate between the
models (ours, theirs, ours, ...) so that a machine that slows down during the run slows both
alike; the median of ``--steps`` timed steps after ``--warmup`` is kept. The runtime shape checks
(jaxtyping with beartype) are off for the timed steps: the script sets ``JAXTYPING_DISABLE=1``
before importing stepformer. Not a test.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("JAXTYPING_DISABLE", "1")  # before stepformer is imported: jaxtyping reads it then
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from stepformer.huggingface import from_llama  # noqa: E402
from stepformer.models import next_token_loss  # noqa: E402

PAD = 0


def batches(count: int, batch: int, length: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of token ids with right padding, and their masks (``True`` = a real token)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(1, vocab, (batch, length), generator=g)
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
        real = torch.arange(length)[None, :] < lengths[:, None]
        out.append((tokens.masked_fill(~real, PAD), real))
    return out


def step_ours(model, optimizer, tokens, real) -> float:
    loss = next_token_loss(model(tokens, real), tokens, pad_id=PAD)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def step_theirs(model, optimizer, tokens, real) -> float:
    logits = model(input_ids=tokens, attention_mask=real.long()).logits
    loss = next_token_loss(logits, tokens, pad_id=PAD)  # the same loss function for both
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-ff", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.d_ff,
        max_position_embeddings=args.len, pad_token_id=PAD,
    )  # fmt: skip
    theirs = transformers.LlamaForCausalLM(config).to(args.device).train()
    models = {
        "ours (fast)": from_llama(theirs, fast=True).train(),
        "ours (didactic parts)": from_llama(theirs, fast=False).train(),
        "LlamaForCausalLM": theirs,
    }
    steps = {name: (step_theirs if name == "LlamaForCausalLM" else step_ours) for name in models}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    data = [(t.to(args.device), r.to(args.device))
            for t, r in batches(args.warmup + args.steps, args.batch, args.len, args.vocab, seed=1)]

    first_losses = {name: steps[name](m, optimizers[name], *data[0]) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for i, (tokens, real) in enumerate(data[1:], start=1):
        for name, model in models.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            steps[name](model, optimizers[name], tokens, real)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - started)

    parameters = sum(p.numel() for p in theirs.parameters())
    print(f"LLaMA-style model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, {args.kv_heads} "
          f"key/value heads, d_ff {args.d_ff}, vocab {args.vocab}, {parameters / 1e6:.2f}M parameters; batch "
          f"{args.batch} x {args.len} tokens, right-padded; {args.device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("first-step loss: " + ", ".join(f"{name} {loss:.6f}" for name, loss in first_losses.items()))
    reference = statistics.median(times["LlamaForCausalLM"])
    print("\n| model | median step (ms) | tokens/s | speed vs LlamaForCausalLM |\n| --- | --- | --- | --- |")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median * 1000:.1f} | {args.batch * args.len / median:,.0f} | {reference / median:.2f}x |")


if __name__ == "__main__":
    main()
