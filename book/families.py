"""Chapter 12's family table: the 2017 Transformer and the models since, part by part.

The data of two tables of ``12_models.md``, which hold ``table_markdown(...)`` verbatim; it sits beside the
book's figures because only the book (and its test) reads it.

Each row is one model's smallest size. Where ``transformers`` ships a configuration class whose
defaults are that model (``GPT2Config()`` is GPT-2 small, ``LlamaConfig()`` is LLaMA 7B, ...),
``config`` names it and tests/test_families.py reads every number of the row back from it and
counts the parameters of the model it builds (on PyTorch's ``meta`` device: no memory, no
download). The other rows cite their paper (``cite``, a key of book/references.bib).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One row: the architecture's parts, then the sizes of the model's smallest published size."""

    name: str
    year: int
    shape: str  # encoder-decoder, encoder-only or decoder-only
    norm: str  # which norm, and where it sits
    ffn: str
    positions: str
    attention: str  # MHA, or GQA with its key/value heads
    vocab: int
    layers: str  # "6 + 6" for an encoder-decoder
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    context: int | None  # positions it was trained on; None where nothing fixes it
    params: float  # millions, of the size whose numbers the row gives
    sizes: str  # every published size
    cite: str
    config: str | None = None  # the transformers config class whose defaults are this row


FAMILIES = [
    Family("Transformer (base)", 2017, "encoder-decoder", "LayerNorm, post", "ReLU", "sinusoidal", "MHA",
           37000, "6 + 6", 512, 8, 8, 2048, None, 65, "65M (base), 213M (big)", "vaswani2017attention"),
    Family("BERT (base)", 2018, "encoder-only", "LayerNorm, post", "GELU", "learned", "MHA",
           30522, "12", 768, 12, 12, 3072, 512, 109.5, "110M (base), 340M (large)", "devlin2019bert",
           "BertConfig"),
    Family("GPT-2 (small)", 2019, "decoder-only", "LayerNorm, pre", "GELU (tanh)", "learned", "MHA",
           50257, "12", 768, 12, 12, 3072, 1024, 124.4, "124M, 355M, 774M, 1.5B", "radford2019language",
           "GPT2Config"),
    Family("T5 (small)", 2019, "encoder-decoder", "RMSNorm (no bias), pre", "ReLU", "relative bias", "MHA",
           32128, "6 + 6", 512, 8, 8, 2048, None, 60.5, "60M, 220M, 770M, 3B, 11B", "raffel2020exploring",
           "T5Config"),
    Family("LLaMA 1 (7B)", 2023, "decoder-only", "RMSNorm, pre", "SwiGLU", "RoPE", "MHA",
           32000, "32", 4096, 32, 32, 11008, 2048, 6738.4, "7B, 13B, 33B, 65B", "touvron2023llama",
           "LlamaConfig"),
    Family("Llama 2 (7B)", 2023, "decoder-only", "RMSNorm, pre", "SwiGLU", "RoPE", "MHA (GQA, 8 kv heads, in 70B)",
           32000, "32", 4096, 32, 32, 11008, 4096, 6738.4, "7B, 13B, 70B", "touvron2023llama2"),
    Family("Llama 3 (8B)", 2024, "decoder-only", "RMSNorm, pre", "SwiGLU", "RoPE (base 500000)", "GQA, 8 kv heads",
           128256, "32", 4096, 32, 8, 14336, 8192, 8030.3, "8B, 70B (3.1: 405B)", "grattafiori2024llama"),
    Family("Mistral (7B)", 2023, "decoder-only", "RMSNorm, pre", "SwiGLU", "RoPE", "GQA, 8 kv heads, window 4096",
           32000, "32", 4096, 32, 8, 14336, None, 7241.7, "7B", "jiang2023mistral", "MistralConfig"),
]  # fmt: skip

COLUMNS = ("model", "year", "shape", "norm", "FFN", "positions", "attention", "vocab", "layers", "d_model",
           "heads (kv)", "d_ff", "context", "parameters", "sizes")  # fmt: skip
# The chapter shows two tables, the parts and then the sizes, each led by the model's name.
PARTS = ("model", "year", "shape", "norm", "FFN", "positions", "attention")
SIZES = ("model", "vocab", "layers", "d_model", "heads (kv)", "d_ff", "context", "parameters", "sizes")


def table_rows() -> list[list[str]]:
    """The table as text cells, in :data:`COLUMNS` order, one list per family."""
    rows = []
    for f in FAMILIES:
        heads = f"{f.heads}" if f.kv_heads == f.heads else f"{f.heads} ({f.kv_heads})"
        params = f"{f.params:,.0f}M" if f.params < 1000 else f"{f.params / 1000:.2f}B"
        rows.append([f.name, str(f.year), f.shape, f.norm, f.ffn, f.positions, f.attention, f"{f.vocab:,}",
                     f.layers, str(f.d_model), heads, f"{f.d_ff:,}", "—" if f.context is None else f"{f.context:,}",
                     params, f.sizes])  # fmt: skip
    return rows


def table_markdown(columns: tuple[str, ...] = COLUMNS) -> str:
    """The family table as Markdown, with ``columns`` (names of :data:`COLUMNS`) and each row's reference cited
    in its first cell."""
    if unknown := [c for c in columns if c not in COLUMNS]:
        raise ValueError(f"no such column {unknown}; the columns are {COLUMNS}")
    keep = [COLUMNS.index(c) for c in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for family, cells in zip(FAMILIES, table_rows(), strict=True):
        cells[0] = f"{cells[0]} {{cite:p}}`{family.cite}`"
        lines.append("| " + " | ".join(cells[i] for i in keep) + " |")
    return "\n".join(lines)
