"""Chapter 12's family table against the configurations that Hugging Face `transformers` ships.

Rows with a config class are read back from its defaults, and the model it builds is counted on
the meta device (no memory, no download). Every decoder-only row is also rebuilt as a
LlamaConfig/MistralConfig from its own numbers, so that its parameter count agrees with its sizes.
"""

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "book"))  # the table's data sits beside the book's figures: only the book uses it

from families import FAMILIES, PARTS, SIZES, Family, table_markdown  # noqa: E402

FFN_NAMES = {"gelu_new": "GELU (tanh)", "gelu": "GELU", "relu": "ReLU", "silu": "SwiGLU"}


def _read(config: object, *names: str) -> object:
    return next(getattr(config, n) for n in names if getattr(config, n, None) is not None)


def _count(model_class: type, config: object) -> float:
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for p in model.parameters()) / 1e6


MODEL_CLASSES = {"BertConfig": "BertForMaskedLM", "GPT2Config": "GPT2LMHeadModel",
                 "T5Config": "T5ForConditionalGeneration", "LlamaConfig": "LlamaForCausalLM",
                 "MistralConfig": "MistralForCausalLM"}  # fmt: skip


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.config], ids=lambda f: f.name)
def test_the_row_is_what_transformers_ships(family: Family) -> None:
    config = getattr(transformers, family.config)()
    layers = _read(config, "num_hidden_layers", "n_layer", "num_layers")
    expected_layers = f"{layers} + {config.num_decoder_layers}" if family.shape == "encoder-decoder" else str(layers)
    d_model = _read(config, "hidden_size", "n_embd", "d_model")
    heads = _read(config, "num_attention_heads", "n_head", "num_heads")
    found = {
        "vocab": config.vocab_size,
        "layers": expected_layers,
        "d_model": d_model,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        # GPT-2's n_inner is None: four times d_model
        "d_ff": next((getattr(config, n) for n in ("intermediate_size", "d_ff", "n_inner") if getattr(config, n, None)),
                     4 * d_model),
        "ffn": FFN_NAMES[_read(config, "hidden_act", "activation_function", "feed_forward_proj")],
    }
    if family.context is not None:
        found["context"] = _read(config, "max_position_embeddings", "n_positions")
    for key, value in found.items():
        ours = getattr(family, key)
        assert ours == value, f"{family.name}: {key} is {ours!r}, {family.config} has {value!r}"
    params = _count(getattr(transformers, MODEL_CLASSES[family.config]), config)
    assert abs(params - family.params) < 0.1, f"{family.name}: {family.params}M in the table, {params:.1f}M counted"


def test_mistrals_window_and_llama_1s_mha_are_in_the_configs() -> None:
    assert transformers.MistralConfig().sliding_window == 4096
    assert transformers.LlamaConfig().num_key_value_heads == transformers.LlamaConfig().num_attention_heads


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.ffn == "SwiGLU"], ids=lambda f: f.name)
def test_each_llama_like_rows_numbers_give_its_parameter_count(family: Family) -> None:
    """The cited rows (Llama 2 and 3) are checked for consistency: their sizes build a model of their parameters."""
    config = transformers.LlamaConfig(vocab_size=family.vocab, hidden_size=family.d_model,
                                      num_hidden_layers=int(family.layers), num_attention_heads=family.heads,
                                      num_key_value_heads=family.kv_heads, intermediate_size=family.d_ff)
    params = _count(transformers.LlamaForCausalLM, config)
    assert abs(params - family.params) < 0.1, f"{family.name}: {family.params}M in the table, {params:.1f}M counted"


def test_the_chapter_shows_this_table_and_cites_every_row() -> None:
    chapter = (REPO / "book" / "12_models.md").read_text()
    for columns in (PARTS, SIZES):
        assert table_markdown(columns) in chapter, f"book/12_models.md must hold table_markdown({columns}) verbatim"
    keys = set(re.findall(r"^@\w+\{([^,]+),", (REPO / "book" / "references.bib").read_text(), re.MULTILINE))
    assert {f.cite for f in FAMILIES} <= keys, f"not in references.bib: {sorted({f.cite for f in FAMILIES} - keys)}"
