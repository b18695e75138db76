"""What chapter 12 measures on its models: the bytes a training step holds, samples by each decoding rule,
decoding speed with and without the KV-cache, the cache's bytes per token with and without GQA."""

import hashlib
import math
import time
from dataclasses import replace

import torch
from beartype import beartype
from jaxtyping import Int, jaxtyped
from torch import Tensor, nn

from stepformer.kvcache import cache_bytes, new_cache
from stepformer.lm.config import RunConfig
from stepformer.models import LanguageModel, generate
from stepformer.translator.tokenizer import SubwordTokenizer


def _bytes(tensors) -> int:
    """The bytes of distinct tensors (a tied weight counts once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def step_bytes(model, optimizer, tokens, step_loss, generator, clip_norm, device) -> tuple:
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


def state_hash(model: nn.Module) -> str:
    """A sha256 of every tensor of the state dict (names, shapes, dtypes, values): equal means the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
