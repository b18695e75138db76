"""One constructor per layer: chapters 07 and 08's builders and chapter 10's assembly give the same layers.

Each layer class has one ``__init__``, which takes its parts; chapters 07 and 08's builders give it chapters
03-05's parts, ``stepformer.parts`` gives it the parts a ``ModelConfig`` names. Built both ways for the same
model, the layers must have the same parameters under the same names, and compute the same function.
"""

import pytest
import torch
from torch import nn

import stepformer.parts
from stepformer.encoder import build_encoder, build_encoder_layer
from stepformer.ffn import FeedForward, SwiGLU
from stepformer.gqa import GroupedQueryAttention
from stepformer.masks import causal_mask
from stepformer.parts import (
    ComplexRotaryEmbedding,
    ModelConfig,
    configured_transformer,
    decoder_layer,
    decoder_stack,
    encoder_layer,
    encoder_stack,
    make_ffn,
)
from stepformer.positional import RotaryEmbedding
from stepformer.transformer import build_decoder, build_decoder_layer, build_transformer

D_MODEL, HEADS, D_FF, LAYERS, VOCAB = 12, 3, 20, 2, 17


def _config(norm_first: bool, activation: str, fast: bool = False) -> ModelConfig:
    return ModelConfig.original(VOCAB, d_model=D_MODEL, heads=HEADS, layers=LAYERS, d_ff=D_FF, dropout=0.0,
                                placement="pre" if norm_first else "post", ffn=activation, fast=fast)


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def _pairs(norm_first: bool, activation: str, fast: bool) -> dict[str, tuple[nn.Module, nn.Module]]:
    """What chapters 07 and 08 build (left) and what the assembly builds from the same model's config (right)."""
    c = _config(norm_first, activation, fast)
    plain = dict(dropout=0.0, norm_first=norm_first, activation=activation)
    return {
        "encoder layer": (build_encoder_layer(D_MODEL, HEADS, D_FF, **plain), encoder_layer(c)),
        "decoder layer": (build_decoder_layer(D_MODEL, HEADS, D_FF, **plain), decoder_layer(c)),
        "decoder-only block": (build_decoder_layer(D_MODEL, HEADS, D_FF, **plain, cross_attention=False),
                               decoder_layer(c, cross_attention=False)),
        "encoder": (build_encoder(D_MODEL, HEADS, D_FF, LAYERS, **plain), encoder_stack(c)),
        "decoder": (build_decoder(D_MODEL, HEADS, D_FF, LAYERS, **plain), decoder_stack(c)),
        "decoder-only stack": (build_decoder(D_MODEL, HEADS, D_FF, LAYERS, **plain, cross_attention=False),
                               decoder_stack(c, cross_attention=False)),
        "transformer": (build_transformer(VOCAB, VOCAB, D_MODEL, HEADS, LAYERS, LAYERS, D_FF, **plain),
                        configured_transformer(c)),
    }


def _run(name: str, module: nn.Module, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(2, 5, D_MODEL, generator=g, dtype=torch.float64)
    memory = torch.randn(2, 4, D_MODEL, generator=g, dtype=torch.float64)
    if name == "transformer":
        src, tgt = torch.randint(1, VOCAB, (2, 6), generator=g), torch.randint(1, VOCAB, (2, 5), generator=g)
        return module(src, tgt)
    if name.startswith("encoder"):
        return module(x)
    if name.startswith("decoder-only"):
        return module(x, None, tgt_mask=causal_mask(5))
    return module(x, memory, tgt_mask=causal_mask(5))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_both_ways_give_the_same_parameters_and_the_same_function(norm_first: bool, activation: str,
                                                                   fast: bool) -> None:
    for name, (chapters, assembled) in _pairs(norm_first, activation, fast).items():
        assert _shapes(chapters) == _shapes(assembled), name
        assert list(chapters.state_dict()) == list(assembled.state_dict()), f"{name}: the order of the keys"
        chapters, assembled = chapters.double().eval(), assembled.double().eval()
        assembled.load_state_dict(chapters.state_dict())
        torch.testing.assert_close(_run(name, assembled, torch.Generator().manual_seed(3)),
                                   _run(name, chapters, torch.Generator().manual_seed(3)), msg=name)


def test_a_decoder_only_block_has_no_middle_sublayer_either_way() -> None:
    """One state_dict layout for one architecture: no norm2 or dropout2 without cross-attention."""
    for block in (build_decoder_layer(D_MODEL, HEADS, D_FF, cross_attention=False),
                  decoder_layer(_config(True, "gelu"), cross_attention=False)):
        assert block.cross_attn is None and block.norm2 is None and block.dropout2 is None
        assert not any(name.startswith("norm2") for name in block.state_dict())


def test_the_same_seed_builds_the_same_weights_both_ways() -> None:
    """The assembly draws its random numbers in the chapters' order: a seeded model is the same model."""
    torch.manual_seed(5)
    chapters = build_transformer(VOCAB, VOCAB, D_MODEL, HEADS, LAYERS, LAYERS, D_FF, dropout=0.0)
    torch.manual_seed(5)
    assembled = configured_transformer(_config(False, "relu"))
    for (name, ours), theirs in zip(chapters.state_dict().items(), assembled.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name


def test_the_original_config_is_the_papers_base_model() -> None:
    c = ModelConfig.original(37000)
    assert (c.d_model, c.heads, c.layers, c.d_ff, c.dropout) == (512, 8, 6, 2048, 0.1)
    assert (c.norm, c.placement, c.ffn, c.positions, c.scale_embeddings, c.tie_embeddings) == (
        "layer", "post", "relu", "sinusoidal", True, False)
    assert ModelConfig.original(100, kv_heads=2).kv_heads == 2


def test_each_builder_refuses_what_its_parts_cannot_do() -> None:
    with pytest.raises(ValueError, match="configured_transformer"):
        build_transformer(VOCAB, VOCAB, D_MODEL, HEADS, 1, 1, D_FF, positional="rope")
    plain = ModelConfig(vocab=VOCAB, d_model=D_MODEL, heads=HEADS, layers=1, d_ff=D_FF)
    with pytest.raises(ValueError, match="scale_embeddings=True"):
        configured_transformer(plain)  # a language model's config: unscaled embeddings


@pytest.mark.parametrize("fast", [False, True])
def test_rotary_positions_and_grouped_heads_come_from_the_config_at_construction(monkeypatch, fast: bool) -> None:
    """Nothing swapped after construction: the attention the config names is there from the start, its rotation
    given to it (``fast``: the complex-product one) rather than set afterwards."""
    built = []

    class Recorded(GroupedQueryAttention):
        def __init__(self, *args, rope=False, **kwargs) -> None:
            super().__init__(*args, rope=rope, **kwargs)
            built.append((self, rope, self.rope))  # the rope passed, and the part that __init__ left

    monkeypatch.setattr(stepformer.parts, "GroupedQueryAttention", Recorded)
    model = configured_transformer(ModelConfig.original(VOCAB, d_model=D_MODEL, heads=HEADS, layers=1, d_ff=D_FF,
                                                        kv_heads=1, positions="rope", fast=fast))
    layer = model.decoder.layers[0]
    assert layer.self_attn.kv_heads == 1 and layer.cross_attn.kv_heads == 1
    assert layer.cross_attn.rope is None  # cross-attention's queries and keys lie on two sentences
    assert isinstance(layer.norm1, nn.LayerNorm) == fast  # fast: PyTorch's fused norm, else chapter 05's
    self_attention = [model.encoder.layers[0].self_attn, layer.self_attn]
    assert {id(attention) for attention, _, _ in built} == {id(m) for m in (*self_attention, layer.cross_attn)}
    for attention, rope, at_init in built:
        assert attention.rope is at_init  # the module built is the module kept
        if attention in self_attention:
            assert type(at_init) is (ComplexRotaryEmbedding if fast else RotaryEmbedding)
            assert at_init.d_head == D_MODEL // HEADS and (at_init is rope) == fast


def test_the_config_describes_an_encoder_decoder_whole() -> None:
    """Source vocabulary and encoder depth live in the config: the model it builds is the model it describes."""
    config = ModelConfig.original(VOCAB, d_model=D_MODEL, heads=HEADS, layers=2, d_ff=D_FF, src_vocab=VOCAB + 4,
                                  encoder_layers=3)
    model = configured_transformer(config)
    assert model.src_embed.tokens.num_embeddings == VOCAB + 4 and model.tgt_embed.tokens.num_embeddings == VOCAB
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (3, 2)
    assert ModelConfig(**config.to_dict()) == config  # what a checkpoint stores rebuilds the same model
    for name in ("src_vocab", "encoder_layers"):
        with pytest.raises(ValueError, match=name):
            ModelConfig.original(VOCAB, **{name: 0})


@pytest.mark.parametrize(("ffn", "approximate"), [("relu", None), ("gelu", "none"), ("gelu_tanh", "tanh")])
def test_make_ffn_builds_chapter_04s_network_with_its_activation(ffn: str, approximate: str | None) -> None:
    """The config's activation is FeedForward's own argument: nothing is swapped after construction."""
    part = make_ffn(_config(False, ffn))
    assert type(part) is FeedForward
    if approximate is None:
        assert isinstance(part.activation, nn.ReLU)
    else:
        assert isinstance(part.activation, nn.GELU) and part.activation.approximate == approximate
    torch.manual_seed(0)
    reference = FeedForward(D_MODEL, D_FF, ffn)
    part.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, D_MODEL)
    torch.testing.assert_close(part(x), reference(x), rtol=0, atol=0)
    assert type(make_ffn(_config(False, "swiglu"))) is SwiGLU
