"""Chapter 11: every setting of a translator run in one dataclass, and the named presets.

The whole configuration is printed when a run starts and saved in every checkpoint, so a
score can always be traced to the settings that produced it.
"""

import types
import typing
from dataclasses import asdict, dataclass, fields, replace

import torch

from stepformer import runs
from stepformer.parts import ModelConfig

# The translator's model: chapter 08's Transformer as the course trains it on Multi30k, one encoder-decoder
# description (parts.ModelConfig) that builds it; the presets change it with dataclasses.replace.
MODEL = ModelConfig(
    vocab=8000,  # joint BPE for both languages; 8k suits 29k sentence pairs (the model takes the tokenizer's count)
    d_model=256,
    heads=4,
    layers=3,  # encoder layers = decoder layers (encoder_layers None)
    d_ff=1024,
    kv_heads=None,  # multi-head attention; fewer: GQA (chapter 10)
    norm="layer",
    placement="pre",  # pre-norm trains stably with a large learning rate and short warmup
    final_norm=True,
    ffn="relu",
    positions="sinusoidal",
    max_len=128,  # positions; longer sentences are cut (and counted): Multi30k's longest has 54 tokens
    tie_embeddings=True,  # one table for source, target and output: a joint vocabulary (Press and Wolf 2017)
    scale_embeddings=True,  # chapter 07's embeddings, the 2017 paper's sqrt(d_model)
    dropout=0.2,  # a small corpus overfits: more than the paper's 0.1
    fast=True,  # PyTorch's fused attention and LayerNorm inside the course's modules (tested equal)
)

# The settings of checkpoints and results written before the model became one ModelConfig, and where each went.
FORMER_MODEL_KEYS = {
    "vocab_size": "vocab", "max_len": "max_len", "d_model": "d_model", "heads": "heads", "layers": "layers",
    "d_ff": "d_ff", "kv_heads": "kv_heads", "dropout": "dropout", "norm_first": "placement", "activation": "ffn",
    "fast": "fast",
}


@dataclass(frozen=True)
class TranslatorConfig:
    # --- the task
    src_lang: str = "de"
    tgt_lang: str = "en"
    # --- the model (chapter 08's Transformer, configured: parts.ModelConfig; settings model.d_model, ...)
    model: ModelConfig = MODEL
    # --- the optimisation
    label_smoothing: float = 0.1
    peak_lr: float = 1e-3
    warmup: int = 500  # steps
    # The same in epochs (None: use warmup): a preset for hardware whose steps per epoch vary with
    # max_tokens is easier to state in passes over the data. Resolved to steps when a run starts.
    warmup_epochs: float | None = None
    # A fraction of the budget at its end over which the rate falls linearly to 0 (0: none). Off, chosen on
    # val: in a full cpu de→en run it gained 0.43 val BLEU (42.62 against 42.19), one run each, too little to
    # change the recipe for without more seeds.
    cooldown: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)  # the paper's beta2: faster-adapting second moments
    weight_decay: float = 1e-4
    clip_norm: float = 1.0
    max_tokens: int = 4096  # padded positions per batch (counting max(source, target) per sentence)
    # --- the budget: whichever comes first (None: no limit of that kind)
    max_steps: int | None = None
    max_epochs: int | None = None
    max_minutes: float | None = 50.0
    # --- bookkeeping
    seed: int = 1234
    checkpoint_every: int = 100  # steps: the last few, close together, are averaged at the end
    eval_every: int = 500  # steps: validation loss and greedy BLEU on a sample of val
    checkpoint_every_epochs: float | None = None  # in epochs instead (None: checkpoint_every)
    eval_every_epochs: float | None = None  # in epochs instead (None: eval_every)
    eval_sentences: int = 300
    keep_checkpoints: int = 5  # the last N are kept and averaged at the end
    log_every: int = 50  # steps between reads of the losses from the device (each a wait for it); every step is logged
    # --- speed
    precision: str = "auto"  # auto: bf16 where the hardware has it (CUDA, or a CPU with AMX/AVX-512 bf16), else fp32
    compile: bool = False
    # Dropout masks drawn four elements per random number (fast.PackedDropout): the same distribution as
    # nn.Dropout, other masks, faster on a CPU. A way of drawing, like compile's own random numbers, not a part
    # of the model: its parameters and its function in eval() mode are the same either way.
    packed_dropout: bool = True
    # --- decoding
    beam: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.5
    max_len_b: int = 10

    def __post_init__(self) -> None:
        if not 0.0 <= self.cooldown <= 1.0:
            raise ValueError(f"cooldown is a fraction of the budget, from 0 to 1; got {self.cooldown}")
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"source and target language are both {self.src_lang!r}")
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {self.precision!r}")
        if self.max_steps is None and self.max_epochs is None and self.max_minutes is None:
            raise ValueError("a run needs a budget: max_steps, max_epochs or max_minutes")
        for name in ("warmup_epochs", "checkpoint_every_epochs", "eval_every_epochs"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive (or None), got {getattr(self, name)}")

    def in_steps(self, steps_per_epoch: int) -> "TranslatorConfig":
        """A copy whose warmup and cadences given in epochs are set in steps (at least 1 each)."""
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1, got {steps_per_epoch}")
        changes = {}
        for epochs, steps in (("warmup_epochs", "warmup"), ("checkpoint_every_epochs", "checkpoint_every"),
                              ("eval_every_epochs", "eval_every")):
            if getattr(self, epochs) is not None:
                changes[steps] = max(1, round(getattr(self, epochs) * steps_per_epoch))
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Every setting, the model's as a dict under ``"model"``: what checkpoints and results files keep."""
        return asdict(self)

    def settings(self) -> dict[str, object]:
        """Every setting by the name ``--set`` takes: ``peak_lr``, ..., and the model's as ``model.d_model``, ..."""
        flat = {k: v for k, v in self.to_dict().items() if k != "model"}
        return {**flat, **{f"model.{k}": v for k, v in self.model.to_dict().items()}}

    @classmethod
    def from_dict(cls, values: dict) -> "TranslatorConfig":
        """The config :meth:`to_dict` gave, or one written before the model was a ``ModelConfig`` (its model
        settings, ``d_model``, ``norm_first``, ``activation``, ..., read into ``model``)."""
        known = {f.name for f in fields(cls)}
        values = dict(values)
        former = {key: values.pop(key) for key in FORMER_MODEL_KEYS if key in values}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown settings {unknown}; the settings are {sorted(known)}")
        if former:
            if "model" in values:
                raise ValueError(f"settings {sorted(former)} are the model's: give them in 'model' only")
            values["model"] = _former_model(former)
            values.setdefault("packed_dropout", former.get("fast", True))  # one 'fast' chose both
        elif isinstance(values.get("model"), dict):
            model_fields = {f.name for f in fields(ModelConfig)}
            unknown = sorted(set(values["model"]) - model_fields)
            if unknown:
                raise ValueError(f"unknown model settings {unknown}; the model's settings are {sorted(model_fields)}")
            values["model"] = ModelConfig(**values["model"])
        if isinstance(values.get("betas"), list):
            values["betas"] = tuple(values["betas"])
        return cls(**values)

    def with_overrides(self, overrides: dict[str, str]) -> "TranslatorConfig":
        """A copy with settings given as text (``--set warmup=800``, ``--set model.dropout=0.3``), each parsed to its
        field's type."""
        kinds = {f.name: f.type for f in fields(self) if f.name != "model"}
        model_kinds = {f"model.{f.name}": f.type for f in fields(ModelConfig)}
        parsed, model = {}, {}
        for key, text in overrides.items():
            if key in kinds:
                parsed[key] = _parse(text, kinds[key], key)
            elif key in model_kinds:
                model[key.removeprefix("model.")] = _parse(text, model_kinds[key], key)
            elif key in FORMER_MODEL_KEYS:
                raise ValueError(f"{key!r} is a setting of the model: model.{FORMER_MODEL_KEYS[key]}"
                                 + (" (pre or post)" if key == "norm_first" else ""))
            else:
                raise ValueError(f"unknown setting {key!r}; the settings are {sorted(self.settings())}")
        return replace(self, **parsed, **({"model": replace(self.model, **model)} if model else {}))


def _former_model(former: dict) -> ModelConfig:
    """The ``ModelConfig`` that a config written before it held (``vocab_size``, ``d_model``, ``norm_first``, ...)."""
    former = dict(former)
    if "norm_first" in former:
        former["norm_first"] = "pre" if former["norm_first"] else "post"
    return replace(MODEL, **{FORMER_MODEL_KEYS[key]: value for key, value in former.items()})


def _parse(text: str, field_type: object, key: str) -> object:
    """``text`` as a value of ``field_type`` (``int``, ``float | None``, ``tuple[float, float]``, ...)."""
    options = typing.get_args(field_type) if typing.get_origin(field_type) is types.UnionType else (field_type,)
    if text.lower() == "none" and type(None) in options:
        return None
    base = next(t for t in options if t is not type(None))
    try:
        if base is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if typing.get_origin(base) is tuple:
            return tuple(float(x) for x in text.split(","))
        return base(text)
    except ValueError as error:
        raise ValueError(f"{key} must be a {getattr(base, '__name__', base)}, got {text!r}") from error


PRESETS: dict[str, TranslatorConfig] = {
    # Seconds on any CPU: for tests, the book's live run and a first try of the command.
    "tiny": TranslatorConfig(
        model=replace(MODEL, vocab=1000, d_model=64, heads=4, layers=2, d_ff=128, dropout=0.1), warmup=50, peak_lr=2e-3,
        max_tokens=2048, max_minutes=None, max_steps=200, checkpoint_every=100, eval_every=100,
        eval_sentences=100, keep_checkpoints=2, precision="fp32", beam=2,
    ),
    # A laptop or this course's 2-core machine, 50 minutes: about 5,300 steps, so a high peak
    # learning rate (pre-norm takes it) learns faster than the usual 1e-3 (validation loss at step
    # 500: 2.82 against 3.14, same batches).
    "cpu": TranslatorConfig(peak_lr=2e-3),
    # One GPU: the cpu preset's model, which is the right size for 29,000 sentence pairs, with more
    # dropout for the many more epochs a GPU gives in minutes; batches of 16k tokens, compiled; warmup
    # and checkpoints in epochs; the last 10 checkpoints (one per epoch) averaged.
    "gpu": TranslatorConfig(
        model=replace(MODEL, dropout=0.3), peak_lr=3e-3, warmup_epochs=4.0, max_tokens=16384, max_minutes=5.0,
        max_epochs=150, checkpoint_every_epochs=1.0, eval_every_epochs=20.0, keep_checkpoints=10, compile=True,
        length_penalty=1.4,
    ),
}


def preset(name: str) -> TranslatorConfig:
    return runs.preset(PRESETS, name)


def pick_device() -> torch.device:
    """``cuda`` when present, then Apple's ``mps``, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype for ``torch.autocast`` (None: plain float32); an explicit ``bf16``, ``fp16`` or ``fp32`` is obeyed.

    ``auto`` picks bf16 on a CUDA GPU whose tensor cores have it (Ampere and later), else fp16,
    which the trainer pairs with a gradient scaler: a T4 or V100 can *emulate* bf16, and
    ``torch.cuda.is_bf16_supported()`` says yes for that by default, but emulated bf16 is slower
    than fp16 there. On a CPU with bf16 matrix units (AMX or AVX-512 bf16; measured ~6× float32's
    matmul rate on this course's machine) it picks bf16. On Apple's MPS it stays in float32:
    PyTorch's autocast there (fp16, and bf16 from macOS 14) is recent and has not been measured
    on this model, so ``precision=fp16`` asks for it. Elsewhere float32.
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return None
