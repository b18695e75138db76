"""Chapter 12's runs: every setting besides the budget (:class:`RunConfig`), and the two models' configurations."""

from dataclasses import asdict, dataclass, replace

from stepformer.parts import ModelConfig

# The language model: LLaMA's choices at a CPU's size. RMSNorm before each sublayer, RoPE, SwiGLU, GQA, no biases,
# tied embeddings, no dropout (as LLaMA). The masked-LM encoder takes its sizes (bert_config).
LLAMA = ModelConfig(
    vocab=6000,  # one BPE vocabulary for English and German: 29,000 captions each (the model takes the tokenizer's)
    d_model=192,
    heads=6,  # d_head 32
    kv_heads=2,  # GQA: three query heads share each key/value head
    layers=4,
    d_ff=512,  # SwiGLU's hidden size, about 8/3 d_model (LLaMA's rule, rounded to 64)
    norm="rms",
    norm_eps=1e-6,  # LLaMA's
    placement="pre",
    final_norm=True,
    ffn="swiglu",
    positions="rope",
    max_len=64,  # tokens per caption with <s> and </s>; Multi30k's longest English one has 51 (RoPE has no table)
    bias=False,
    tie_embeddings=True,
    dropout=0.0,
)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run besides its budget, saved in its results.

    ``model`` is the language model (:data:`LLAMA` in the presets), and the masked-LM encoder takes its sizes
    (:func:`bert_config`); the optimisation is
    AdamW with ``warmup`` steps of linear warmup, then cosine decay to ``min_lr`` times the peak
    at the end of the budget (:func:`cosine_lr`).
    """

    model: ModelConfig = LLAMA  # the decoder-only model; its vocab is the size the tokenizer is asked for
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
    "tiny": RunConfig(model=replace(LLAMA, vocab=500, d_model=32, heads=4, kv_heads=2, layers=2, d_ff=64), warmup=10,
                      max_tokens=1024, eval_every=20, eval_limit=100, adapt_steps=5, sample_tokens=8, speed_batch=2,
                      speed_tokens=8),
    # This course's 2-core machine or a laptop: the numbers of results/lm.
    "cpu": RunConfig(),
}


def llama_config(vocab: int, run: RunConfig = PRESETS["cpu"]) -> ModelConfig:
    """The run's language model (``run.model``) with the tokenizer's ``vocab``, which BPE may round."""
    return replace(run.model, vocab=vocab)


def bert_config(vocab: int, run: RunConfig = PRESETS["cpu"]) -> ModelConfig:
    """BERT's choices at the same size: LayerNorm after each sublayer, learned positions, GELU, biases,
    a normalised embedding with two segments (every caption is segment 0), dropout, tied embeddings."""
    return ModelConfig(
        vocab=vocab, d_model=run.model.d_model, heads=run.model.heads, layers=run.model.layers,
        d_ff=4 * run.model.d_model,
        norm="layer", norm_eps=1e-12, placement="post", final_norm=False, ffn="gelu", positions="learned",
        max_len=run.model.max_len, bias=True, tie_embeddings=True, embedding_norm=True, segments=2,
        dropout=run.mlm_dropout,
    )
