"""stepformer.encoder against torch.nn.TransformerEncoderLayer / TransformerEncoder on random shapes, its
defining properties (padding invariance, the embedding's formula), and the chapter's checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError
from torch import nn

import stepformer.attention
import stepformer.encoder
import stepformer.ffn
import stepformer.multihead
import stepformer.norms
import stepformer.positional
from stepformer.checks._core import RECORD_ENV, CheckFailure, replaying
from stepformer.checks.encoder import (
    _sizes,
    check_add_and_norm,
    check_embedding_learned,
    check_embedding_sinusoidal,
    check_encoder,
    check_encoder_layer_dropout,
    check_encoder_layer_init,
    check_encoder_layer_post_norm,
    check_encoder_layer_pre_norm,
    check_residual_norms,
)
from stepformer.encoder import (
    Embedding,
    Encoder,
    EncoderLayer,
    add_and_norm,
    build_encoder,
    build_encoder_layer,
    encoder_from_torch,
    encoder_layer_from_torch,
    residual_norms,
)
from stepformer.masks import padding_mask
from stepformer.positional import sinusoidal_encoding
from stepformer.transformer import build_transformer
from tests.fixtures.student import student_copy

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}


def _randomise(module, g):
    """Random weights, biases and norm parameters, so that nothing is left at PyTorch's 0/1 defaults."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1 + 0.3 * noise if "norm" in name and name.endswith("weight")
                    else 0.3 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[1]))


def _padding(batch, seq, g):
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    return torch.arange(seq).view(1, 1, 1, seq) < lengths.view(batch, 1, 1, 1)


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


layer_shapes = st.fixed_dictionaries({
    "batch": st.integers(1, 3),
    "seq": st.integers(1, 7),
    "heads": st.integers(1, 4),
    "d_head": st.integers(1, 5),
    "d_ff": st.integers(1, 9),
    "norm_first": st.booleans(),
    "activation": st.sampled_from(["relu", "gelu"]),
    "seed": st.integers(0, 2**31 - 1),
    "dtype": st.sampled_from([torch.float32, torch.float64]),
})


@settings(max_examples=40, deadline=None)
@given(layer_shapes, st.booleans())
def test_layer_matches_pytorch(s, masked):
    g = torch.Generator().manual_seed(s["seed"])
    d_model, dtype = s["heads"] * s["d_head"], s["dtype"]
    theirs = nn.TransformerEncoderLayer(d_model, s["heads"], s["d_ff"], dropout=0.0, activation=s["activation"],
                                        batch_first=True, norm_first=s["norm_first"], dtype=dtype).eval()
    _randomise(theirs, g)
    ours = encoder_layer_from_torch(theirs).eval()
    assert ours.norm_first == s["norm_first"]
    x = torch.randn(s["batch"], s["seq"], d_model, generator=g, dtype=dtype)
    mask = _padding(s["batch"], s["seq"], g) if masked else None
    with torch.no_grad():
        expected = theirs(x, src_key_padding_mask=None if mask is None else ~mask[:, 0, 0, :])
        _assert_close(ours(x, mask), expected, dtype)


@settings(max_examples=15, deadline=None)
@given(layer_shapes, st.integers(1, 3), st.booleans())
def test_stack_matches_pytorch(s, layers, final_norm):
    g = torch.Generator().manual_seed(s["seed"])
    d_model, dtype = s["heads"] * s["d_head"], s["dtype"]
    layer = nn.TransformerEncoderLayer(d_model, s["heads"], s["d_ff"], dropout=0.0, activation=s["activation"],
                                       batch_first=True, norm_first=s["norm_first"], dtype=dtype)
    norm = nn.LayerNorm(d_model, dtype=dtype) if final_norm else None
    theirs = nn.TransformerEncoder(layer, layers, norm=norm, enable_nested_tensor=False).eval()
    _randomise(theirs, g)
    ours = encoder_from_torch(theirs).eval()
    assert isinstance(ours.norm, nn.Identity) != final_norm
    x = torch.randn(s["batch"], s["seq"], d_model, generator=g, dtype=dtype)
    mask = _padding(s["batch"], s["seq"], g)
    with torch.no_grad():
        _assert_close(ours(x, mask), theirs(x, src_key_padding_mask=~mask[:, 0, 0, :]), dtype)


def test_float64_agrees_to_1e12_post_and_pre_norm():
    g = torch.Generator().manual_seed(0)
    for norm_first in (False, True):
        layer = nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=True, norm_first=norm_first,
                                           dtype=torch.float64)
        theirs = nn.TransformerEncoder(layer, 4, norm=nn.LayerNorm(12, dtype=torch.float64),
                                       enable_nested_tensor=False).eval()
        _randomise(theirs, g)
        x = torch.randn(3, 6, 12, generator=g, dtype=torch.float64)
        mask = _padding(3, 6, g)
        with torch.no_grad():
            diff = encoder_from_torch(theirs).eval()(x, mask) - theirs(x, src_key_padding_mask=~mask[:, 0, 0, :])
        assert diff.abs().max() < 1e-12


def test_gradients_match_pytorch():
    g = torch.Generator().manual_seed(1)
    theirs = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True,
                                        dtype=torch.float64).eval()
    _randomise(theirs, g)
    ours = encoder_layer_from_torch(theirs).eval()
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    (grad_ours,) = torch.autograd.grad((ours(x) * upstream).sum(), x)
    (grad_theirs,) = torch.autograd.grad((theirs(x) * upstream).sum(), x)
    _assert_close(grad_ours, grad_theirs, torch.float64)
    _assert_close(ours.ffn.linear1.weight, theirs.linear1.weight, torch.float64)


def test_add_and_norm_is_the_two_placements():
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    norm = nn.LayerNorm(6, dtype=torch.float64)
    _randomise(nn.ModuleDict({"norm": norm}), torch.Generator().manual_seed(2))
    f, keep = torch.tanh, nn.Identity()
    _assert_close(add_and_norm(x, f, norm, keep, norm_first=False), norm(x + f(x)), torch.float64)
    _assert_close(add_and_norm(x, f, norm, keep, norm_first=True), x + f(norm(x)), torch.float64)
    drop = nn.Dropout(1.0).train()
    _assert_close(add_and_norm(x, f, norm, drop, norm_first=False), norm(x), torch.float64)
    _assert_close(add_and_norm(x, f, norm, drop, norm_first=True), x, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_embedding_is_scaled_tokens_plus_positions(dtype):
    torch.manual_seed(3)
    tokens = torch.randint(0, 11, (2, 7))
    sinus = Embedding(11, 8).to(dtype).eval()
    rows = sinus.tokens.weight[tokens]
    _assert_close(sinus(tokens), rows * math.sqrt(8) + sinusoidal_encoding(7, 8).to(dtype), dtype)
    _assert_close(sinus(tokens, start=4), rows * math.sqrt(8) + sinusoidal_encoding(11, 8)[4:].to(dtype), dtype)
    learned = Embedding(11, 8, "learned", max_len=12).to(dtype).eval()
    expected = learned.tokens.weight[tokens] * math.sqrt(8) + learned.positions.embedding.weight[3:10]
    _assert_close(learned(tokens, start=3), expected, dtype)
    rope = Embedding(11, 8, "rope").to(dtype).eval()
    _assert_close(rope(tokens), rope.tokens.weight[tokens] * math.sqrt(8), dtype)
    assert [n for n, _ in sinus.named_parameters()] == ["tokens.weight"]
    with pytest.raises(ValueError, match="learned table"):
        learned(tokens, start=6)
    with pytest.raises(ValueError, match="positional"):
        Embedding(11, 8, "absolute")


def test_embedding_dropout_only_in_training():
    tokens = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(4))
    emb = Embedding(11, 8, dropout=1.0)
    assert torch.equal(emb.train()(tokens), torch.zeros(2, 7, 8))
    expected = emb.tokens.weight[tokens] * math.sqrt(8) + sinusoidal_encoding(7, 8)
    torch.testing.assert_close(emb.eval()(tokens), expected)


def test_the_scale_brings_small_token_vectors_to_the_size_of_the_code():
    """With entries of std 1/sqrt(d_model) (a table shared with the output layer) the scale makes them as long as
    the code."""
    d_model = 256
    emb = Embedding(1000, d_model)
    nn.init.normal_(emb.tokens.weight, std=d_model**-0.5)
    tokens = torch.arange(1000).view(1, 1000)
    length = torch.linalg.vector_norm(emb.tokens(tokens) * math.sqrt(d_model), dim=-1).mean()
    code = torch.linalg.vector_norm(sinusoidal_encoding(64, d_model), dim=-1).mean()
    assert abs(code - math.sqrt(d_model / 2)) < 1e-3  # d_model / 2 (sin, cos) pairs of length 1
    assert 1.2 < length / code < 1.6  # sqrt(2): the same order, neither drowns the other
    assert torch.linalg.vector_norm(emb.tokens(tokens), dim=-1).mean() < 1.1  # unscaled: 1, drowned by ~11


@pytest.mark.parametrize(("vocab", "low", "high"), [(40, 1.2, 2.0), (4000, 0.2, 0.3)])
def test_glorot_tables_of_the_full_model_are_as_long_as_the_code_only_for_small_vocabularies(vocab, low, high):
    """As the Embedding docstring and chapter 07 say: scaled Glorot rows / code = 2 sqrt(d_model/(vocab + d_model))."""
    torch.manual_seed(0)
    d_model = 64
    model = build_transformer(vocab, vocab, d_model, 4, 1, 1, 32, dropout=0.0)
    length = torch.linalg.vector_norm(model.src_embed.tokens.weight * math.sqrt(d_model), dim=-1).mean()
    code = torch.linalg.vector_norm(sinusoidal_encoding(64, d_model), dim=-1).mean()
    ratio = (length / code).item()
    assert abs(ratio - 2 * math.sqrt(d_model / (vocab + d_model))) < 0.05
    assert low < ratio < high


@pytest.mark.parametrize("norm_first", [False, True])
def test_real_positions_do_not_see_appended_padding(norm_first):
    torch.manual_seed(5)
    pad = 0
    emb = Embedding(20, 16, dropout=0.0).double().eval()
    enc = build_encoder(16, 4, 32, 3, 0.0, norm_first).double().eval()
    short = torch.tensor([[5, 6, 7, 8, pad], [9, 3, pad, pad, pad]])
    for extra in (1, 4, 9):
        longer = torch.cat([short, torch.full((2, extra), pad)], dim=1)
        with torch.no_grad():
            a = enc(emb(short), padding_mask(short, pad))
            b = enc(emb(longer), padding_mask(longer, pad))
            c = enc(emb(longer), None)
        real = padding_mask(short, pad)[:, 0, 0, :]
        assert (a - b[:, :5])[real].abs().max() < 1e-12
        assert (a - c[:, :5])[real].abs().max() > 1e-3  # without the mask the padding is read


def test_residual_norms_post_norm_stays_pre_norm_grows():
    torch.manual_seed(6)
    x = torch.randn(2, 5, 32)
    post = residual_norms(build_encoder(32, 4, 64, 12, 0.0, norm_first=False).layers, x)
    pre = residual_norms(build_encoder(32, 4, 64, 12, 0.0, norm_first=True).layers, x)
    assert post.shape == pre.shape == (13,)
    assert post[0] == pre[0] == torch.linalg.vector_norm(x, dim=-1).mean()
    torch.testing.assert_close(post[1:], torch.full((12,), math.sqrt(32)), rtol=1e-4, atol=1e-4)
    assert pre[-1] > 1.5 * pre[0] and (pre.diff() > 0).float().mean() > 0.8


def test_check_plain_refuses_what_cannot_be_copied():
    with pytest.raises(ValueError, match="activation"):
        encoder_layer_from_torch(nn.TransformerEncoderLayer(8, 2, 16, activation=nn.SiLU()))
    with pytest.raises(ValueError, match="eps"):
        encoder_layer_from_torch(nn.TransformerEncoderLayer(8, 2, 16, layer_norm_eps=1e-6))
    tanh = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=nn.GELU(approximate="tanh"), batch_first=True)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        fast_path, trained = tanh.eval()(x), tanh.train()(x)  # the reason it is refused: two functions, one layer
    assert not torch.allclose(fast_path, trained, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="exact GELU in eval"):
        encoder_layer_from_torch(tanh)


def test_wrong_shapes_fail_naming_the_axis():
    layer = build_encoder_layer(8, 2, 16)
    with pytest.raises(TypeCheckError):
        layer(torch.randn(5, 8))  # no batch axis
    with pytest.raises(TypeCheckError):
        layer(torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeCheckError):
        Embedding(11, 8)(torch.randn(2, 5))


def test_the_layer_is_given_its_parts_and_refuses_one_norm_for_both():
    attn, ffn = stepformer.multihead.MultiHeadAttention(8, 2), stepformer.ffn.FeedForward(8, 16)
    norm1, norm2 = stepformer.norms.LayerNorm(8), stepformer.norms.LayerNorm(8)
    layer = EncoderLayer(attn, ffn, norm1, norm2, dropout=0.25, norm_first=True)
    assert (layer.self_attn, layer.ffn, layer.norm1, layer.norm2) == (attn, ffn, norm1, norm2)
    assert layer.dropout1.p == layer.dropout2.p == 0.25 and layer.norm_first
    with pytest.raises(ValueError, match="norm1 and norm2 are the same module"):
        EncoderLayer(attn, ffn, norm1, norm1)


def test_the_builders_make_fresh_parts_and_pass_the_options_on():
    layer = build_encoder_layer(8, 2, 16, dropout=0.25, norm_first=True, activation="gelu")
    assert layer.norm1 is not layer.norm2 and layer.norm_first
    assert isinstance(layer.ffn.activation, nn.GELU) and layer.ffn.linear1.out_features == 16
    dropouts = {name: m.p for name, m in layer.named_modules() if isinstance(m, nn.Dropout)}
    assert dropouts == {"self_attn.dropout": 0.25, "ffn.dropout": 0.25, "dropout1": 0.25, "dropout2": 0.25}
    encoder = build_encoder(8, 2, 16, 3, final_norm=False)
    assert len({id(layer) for layer in encoder.layers}) == 3 and isinstance(encoder.norm, nn.Identity)
    assert isinstance(build_encoder(8, 2, 16, 1).norm, stepformer.norms.LayerNorm)
    assert isinstance(Encoder([]).norm, nn.Identity)


# -- the checks ------------------------------------------------------------------------------

def _student_encoder():
    """The library's encoder as a student's notebook has it: its own copy, with the given pieces as copies too."""
    multihead = student_copy(stepformer.multihead)
    multihead.scaled_dot_product_attention = student_copy(stepformer.attention).scaled_dot_product_attention
    positional = student_copy(stepformer.positional)
    copy = student_copy(stepformer.encoder)
    copy.MultiHeadAttention = multihead.MultiHeadAttention
    copy.FeedForward = student_copy(stepformer.ffn).FeedForward
    copy.LayerNorm = student_copy(stepformer.norms).LayerNorm
    copy.sinusoidal_encoding = positional.sinusoidal_encoding
    copy.LearnedPositionalEmbedding = positional.LearnedPositionalEmbedding
    return copy


student = _student_encoder()
BUILT_LAYER_CHECKS = [check_encoder_layer_post_norm, check_encoder_layer_pre_norm, check_encoder_layer_dropout]
LAYER_CHECKS = [check_encoder_layer_init, *BUILT_LAYER_CHECKS]


def run_layer_check(check, cls, build, **kwargs):
    """A layer check as the notebook calls it: the init check takes the class and the builder, the rest the builder."""
    if check is check_encoder_layer_init:
        return check((cls, build), **kwargs)
    return check(build, **kwargs)


def builder_of(cls, *, norms=2, fixed_activation=None, fixed_dropout=None):
    """build_encoder_layer written for the layer class ``cls``, with its usual slips: one norm for both sublayers
    (``norms=1``), an activation or a layer dropout fixed instead of the one asked for."""
    def build(d_model, heads, d_ff, dropout=0.1, norm_first=False, activation="relu"):
        norm = student.LayerNorm(d_model)
        return cls(student.MultiHeadAttention(d_model, heads, dropout=dropout),
                   student.FeedForward(d_model, d_ff, fixed_activation or activation, dropout),
                   norm, norm if norms == 1 else student.LayerNorm(d_model),
                   dropout if fixed_dropout is None else fixed_dropout, norm_first)
    return build


def stub(*args, **kwargs):
    raise NotImplementedError()


class Stub(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError()


def test_checks_pass_on_the_solution(capsys):
    for seed in (0, 17):
        check_embedding_sinusoidal(student.Embedding, seed=seed)
        check_embedding_learned(student.Embedding, seed=seed)
        check_add_and_norm(student.add_and_norm, seed=seed)
        for layer_check in LAYER_CHECKS:
            run_layer_check(layer_check, student.EncoderLayer, student.build_encoder_layer, seed=seed)
        check_encoder((student.Encoder, student.build_encoder), seed=seed)
        check_residual_norms(student.residual_norms, seed=seed)
    out = capsys.readouterr().out
    assert out.count("✔") == 2 * 9


def test_checks_pass_in_float64():
    check_embedding_sinusoidal(student.Embedding, seed=3, dtype=torch.float64)
    check_embedding_learned(student.Embedding, seed=3, dtype=torch.float64)
    check_add_and_norm(student.add_and_norm, seed=3, dtype=torch.float64)
    check_encoder_layer_post_norm(student.build_encoder_layer, seed=3, dtype=torch.float64)
    check_encoder_layer_pre_norm(student.build_encoder_layer, seed=3, dtype=torch.float64)
    check_encoder((student.Encoder, student.build_encoder), seed=3, dtype=torch.float64)
    check_residual_norms(student.residual_norms, seed=3, dtype=torch.float64)


@pytest.mark.parametrize("check", [check_embedding_sinusoidal, check_embedding_learned])
def test_module_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(Stub)


@pytest.mark.parametrize("check", LAYER_CHECKS)
def test_layer_checks_fail_on_the_stubs(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        run_layer_check(check, Stub, stub)
    # The class written, its builder not yet.
    with pytest.raises(CheckFailure, match="build_encoder_layer is not implemented yet|stub is not implemented yet"):
        run_layer_check(check, student.EncoderLayer, stub)


def test_encoder_check_fails_on_the_stubs():
    for cls, build in ((Stub, stub), (student.Encoder, stub)):
        with pytest.raises(CheckFailure, match="not implemented yet"):
            check_encoder((cls, build))


@pytest.mark.parametrize("check", [check_add_and_norm, check_residual_norms])
def test_function_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stub)


def test_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(60):
        s = _sizes(seed)
        assert len(set(s.values())) == len(s) and s["d_head"] % 2 == 0, s


# Mistakes, written the way a student would write them.

class MistakenEmbedding(student.Embedding):
    mistake = ""

    def forward(self, tokens, start=0):
        scale = {"no scale": 1.0, "scale d": self.d_model}.get(self.mistake, math.sqrt(self.d_model))
        x = self.tokens(tokens)
        seq = tokens.shape[1]
        first = 0 if self.mistake == "ignores start" else start
        if self.positional == "sinusoidal":
            pe = student.sinusoidal_encoding(first + seq, self.d_model)[first:].to(x)
        elif self.positional == "learned":
            pe = self.positions(torch.arange(first, first + seq))
        else:
            pe = torch.zeros_like(x)
        if self.mistake == "no positions":
            pe = torch.zeros_like(x)
        out = (x + pe) * scale if self.mistake == "scale positions" else x * scale + pe
        return self.dropout(out)


def embedding_mistake(name):
    return type(name.replace(" ", "_"), (MistakenEmbedding,), {"mistake": name})


@pytest.mark.parametrize(
    ("check", "name", "message"),
    [
        (check_embedding_sinusoidal, "no scale", "did not scale the token vectors"),
        (check_embedding_sinusoidal, "scale d", r"scaled the token vectors by d_model; the scale is sqrt"),
        (check_embedding_sinusoidal, "scale positions", "scaled the positions too"),
        (check_embedding_sinusoidal, "ignores start", "start at 0 whatever `start` is"),
        (check_embedding_sinusoidal, "no positions", "adds no positions"),
        (check_embedding_learned, "ignores start", "start at 0 whatever `start` is"),
        (check_embedding_learned, "scale positions", "scaled the positions too"),
    ],
)
def test_embedding_checks_name_the_mistake(check, name, message):
    with pytest.raises(CheckFailure, match=message):
        check(embedding_mistake(name))


class MistakenLayer(nn.Module):
    """An encoder layer given its parts, with switches for the usual mistakes (not the library's code). With the
    mistake "shared norm" it keeps one norm handed in for both sublayers instead of refusing it."""

    mistake = ""

    def __init__(self, self_attn, ffn, norm1, norm2, dropout=0.1, norm_first=False):
        super().__init__()
        if norm1 is norm2 and self.mistake != "shared norm":
            raise ValueError("one norm for both sublayers")
        self.norm_first = norm_first and self.mistake != "ignores norm_first"
        self.self_attn = self_attn
        self.ffn = student.FeedForward(8, 8) if self.mistake == "own ffn" else ffn
        self.norm1, self.norm2 = norm1, norm2
        if self.mistake != "no dropout1":
            self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def sublayer(self, x, f, norm, dropout):
        if self.mistake == "no dropout":
            dropout = nn.Identity()
        if self.norm_first:
            if self.mistake == "normed residual":
                x = norm(x)
                return x + dropout(f(x))
            return x + dropout(f(norm(x)))
        if self.mistake == "norm before add":
            return x + dropout(norm(f(x)))
        if self.mistake == "dropout on residual":
            return norm(dropout(x + f(x)))
        return norm(x + dropout(f(x)))

    def forward(self, x, mask=None):
        mask = None if self.mistake == "no mask" else mask
        h = self.sublayer(x, lambda t: self.self_attn(t, t, t, mask), self.norm1,
                          getattr(self, "dropout1", nn.Identity()))
        norm2 = self.norm1 if self.mistake == "norm1 twice" else self.norm2
        return self.sublayer(x if self.mistake == "ffn reads x" else h, self.ffn, norm2, self.dropout2)


def layer_mistake(name):
    return type(name.replace(" ", "_"), (MistakenLayer,), {"mistake": name})


def layer_builder(name):
    """The builder of a mistaken layer; "shared norm" is a builder that hands one norm to both sublayers."""
    return builder_of(layer_mistake(name), norms=1 if name == "shared norm" else 2)


def test_layer_checks_pass_on_the_mistake_free_layer():
    for layer_check in LAYER_CHECKS:
        run_layer_check(layer_check, MistakenLayer, builder_of(MistakenLayer), seed=5)


@pytest.mark.parametrize(
    ("check", "name", "message"),
    [
        (check_encoder_layer_post_norm, "no mask", "ignores the padding mask"),
        (check_encoder_layer_pre_norm, "no mask", "ignores the padding mask"),
        (check_encoder_layer_post_norm, "norm before add", "the norm comes after the residual add"),
        (check_encoder_layer_pre_norm, "ignores norm_first", r"ignores norm_first=True"),
        (check_encoder_layer_pre_norm, "normed residual", "normalised the residual stream itself"),
        (check_encoder_layer_post_norm, "norm1 twice", "normalise both sublayers with norm1"),
        (check_encoder_layer_post_norm, "ffn reads x", "reads the layer's input x"),
        (check_encoder_layer_init, "shared norm", r"EncoderLayer\(self_attn, ffn, norm, norm\).*should raise a "
                                                  "ValueError"),
        (check_encoder_layer_post_norm, "shared norm", "norm1 and norm2 are one and the same module"),
        (check_encoder_layer_init, "no dropout1", "has no dropout1"),
        (check_encoder_layer_init, "own ffn", r"holds another object as self.ffn: keep each part"),
        (check_encoder_layer_dropout, "no dropout", "ignores dropout"),
        (check_encoder_layer_dropout, "dropout on residual", "never on the residual stream"),
    ],
)
def test_layer_checks_name_the_mistake(check, name, message):
    with pytest.raises(CheckFailure, match=message):
        run_layer_check(check, layer_mistake(name), layer_builder(name))


@pytest.mark.parametrize("check", LAYER_CHECKS)
def test_a_builder_that_shares_one_norm_fails_on_the_students_own_value_error(check):
    """The library's layer refuses one norm for both sublayers: the builder's error is shown as raised."""
    with pytest.raises(CheckFailure, match=r"raised ValueError: norm1 and norm2 are the same module"):
        run_layer_check(check, student.EncoderLayer, builder_of(student.EncoderLayer, norms=1))


def test_layer_checks_name_the_dropout_that_the_builder_does_not_pass_on():
    kept = builder_of(student.EncoderLayer, fixed_dropout=0.1)  # EncoderLayer's default, whatever dropout says
    with pytest.raises(CheckFailure, match=r"gives a layer whose dropout1.p is 0.1, although your "
                                           r"EncoderLayer\(..., dropout=0.25\) sets 0.25"):
        check_encoder_layer_init((student.EncoderLayer, kept))
    with pytest.raises(CheckFailure, match=r"has dropout1.p = 0.1: pass dropout on from build_encoder_layer"):
        check_encoder_layer_dropout(kept)

    def no_attention_dropout(d_model, heads, d_ff, dropout=0.1, norm_first=False, activation="relu"):
        return student.EncoderLayer(student.MultiHeadAttention(d_model, heads),
                                    student.FeedForward(d_model, d_ff, activation, dropout),
                                    student.LayerNorm(d_model), student.LayerNorm(d_model), dropout, norm_first)

    with pytest.raises(CheckFailure, match="self_attn.dropout should drop with p=0.25"):
        check_encoder_layer_init((student.EncoderLayer, no_attention_dropout))


def test_add_and_norm_check_names_the_mistake():
    def norm_before_add(x, sublayer, norm, dropout, norm_first):
        return x + dropout(sublayer(norm(x))) if norm_first else x + dropout(norm(sublayer(x)))

    def always_pre(x, sublayer, norm, dropout, norm_first):
        return x + dropout(sublayer(norm(x)))

    def normed_residual(x, sublayer, norm, dropout, norm_first):
        if norm_first:
            x = norm(x)
            return x + dropout(sublayer(x))
        return norm(x + dropout(sublayer(x)))

    def dropout_on_sum(x, sublayer, norm, dropout, norm_first):
        return dropout(x + sublayer(norm(x))) if norm_first else norm(dropout(x + sublayer(x)))

    for wrong, message in ((norm_before_add, "normalised before the residual add"),
                           (always_pre, "pre-norm form x \\+ f\\(norm\\(x\\)\\) for norm_first=False"),
                           (normed_residual, "added the normalised x back"),
                           (dropout_on_sum, "Dropout must act on the sublayer's output only")):
        with pytest.raises(CheckFailure, match=message):
            check_add_and_norm(wrong)


class MistakenEncoder(student.Encoder):
    mistake = ""

    def forward(self, x, mask=None):
        for i, layer in enumerate(self.layers):
            x = layer(x, None if self.mistake == "no mask" or (self.mistake == "mask only first" and i) else mask)
            if self.mistake == "norm every layer":
                x = self.norm(x)
        return x if self.mistake in ("no final norm", "norm every layer") else self.norm(x)


def stack_builder(cls=None, *, layer=None, repeated=False, fixed_activation=None, fixed_dropout=None,
                  final_norm_for_post_norm=False):
    """build_encoder written for the stack class ``cls`` and the layer builder ``layer``, with its usual slips."""
    cls, layer = cls or student.Encoder, layer or student.build_encoder_layer

    def build(d_model, heads, d_ff, layers, dropout=0.1, norm_first=False, activation="relu", final_norm=True):
        def one():
            return layer(d_model, heads, d_ff, fixed_dropout if fixed_dropout is not None else dropout, norm_first,
                         fixed_activation or activation)
        stack = [one()] * layers if repeated else [one() for _ in range(layers)]
        final_norm = final_norm or (final_norm_for_post_norm and not norm_first)
        return cls(stack, student.LayerNorm(d_model) if final_norm else None)
    return build


@pytest.mark.parametrize(
    ("name", "message"),
    [("no final norm", "leaves out the final LayerNorm"), ("no mask", "ignores the padding mask"),
     ("mask only first", "Only your first layer gets the padding mask"),
     ("norm every layer", "final norm after every layer")],
)
def test_encoder_check_names_the_mistake(name, message):
    cls = type(name.replace(" ", "_"), (MistakenEncoder,), {"mistake": name})
    with pytest.raises(CheckFailure, match=message) as failure:
        check_encoder((cls, stack_builder(cls)))
    assert "Encoder(the check's layers" in str(failure.value)  # caught on the check's own layers


def test_encoder_check_tells_the_layers_mistake_from_the_stacks():
    with pytest.raises(CheckFailure, match=r"built by build_encoder.*Your Encoder hands the padding mask to its layers "
                                           r"\(it does with the check's own layers\), but the layers that "
                                           r"build_encoder makes ignore it"):
        check_encoder((student.Encoder, stack_builder(layer=layer_builder("no mask"))))


def test_encoder_check_names_one_layer_listed_many_times():
    with pytest.raises(CheckFailure, match=r"layers.0 and layers.1 are one and the same layer object, so every layer "
                                           r"of the stack shares one set of weights \(\[layer\] \* n"):
        check_encoder((student.Encoder, stack_builder(repeated=True)))


def test_encoder_check_needs_a_module_list_and_a_norm():
    def no_final_norm(*args, final_norm=True, **kwargs):
        return student.build_encoder(*args, final_norm=False, **kwargs)

    with pytest.raises(CheckFailure, match="has no parameter norm.weight"):
        check_encoder((student.Encoder, no_final_norm))


def test_residual_norms_check_names_the_mistake():
    def after_each_layer_only(layers, x, mask=None):
        return student.residual_norms(layers, x, mask)[1:]

    def squared(layers, x, mask=None):
        return student.residual_norms(layers, x, mask) ** 2

    def without_mask(layers, x, mask=None):
        return student.residual_norms(layers, x)

    def summed(layers, x, mask=None):
        return student.residual_norms(layers, x, mask) * x.shape[0] * x.shape[1]

    def as_list(layers, x, mask=None):
        return student.residual_norms(layers, x, mask).tolist()

    for wrong, message in ((after_each_layer_only, "measured after each layer only"),
                           (without_mask, "did not pass the mask on"), (summed, "added the lengths up"),
                           (as_list, "should return a torch.Tensor")):
        with pytest.raises(CheckFailure, match=message):
            check_residual_norms(wrong)
    with pytest.raises(CheckFailure, match="differ from the expected"):
        check_residual_norms(squared)


class UsesPyTorch(nn.Module):
    def __init__(self, d_model, heads, d_ff, dropout=0.1, norm_first=False, activation="relu"):
        super().__init__()
        self.inner = nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout, batch_first=True, norm_first=norm_first)

    def forward(self, x, mask=None):
        return self.inner(x, src_key_padding_mask=None if mask is None else ~mask[:, 0, 0, :])


def test_using_the_reference_is_not_own_work():
    for cheat in (UsesPyTorch, stepformer.encoder.build_encoder_layer, builder_of(stepformer.encoder.EncoderLayer)):
        with pytest.raises(CheckFailure, match="Not your own work"):
            check_encoder_layer_post_norm(cheat)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_encoder_layer_init((stepformer.encoder.EncoderLayer, student.build_encoder_layer))
    for cls, build in ((stepformer.encoder.Encoder, student.build_encoder),
                       (student.Encoder, stepformer.encoder.build_encoder)):
        with pytest.raises(CheckFailure, match="Not your own work"):
            check_encoder((cls, build))
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_residual_norms(stepformer.encoder.residual_norms)


def test_replay_of_a_module_check_needs_no_module(monkeypatch, tmp_path):
    for folder, build in ((tmp_path / "right", student.build_encoder_layer),
                          (tmp_path / "wrong", layer_builder("no mask"))):
        monkeypatch.setenv(RECORD_ENV, str(folder))
        try:
            check_encoder_layer_post_norm(build, seed=2)
        except CheckFailure:
            pass
        monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path / "right"):
        check_encoder_layer_post_norm(object(), seed=2)  # the object is never touched
    with replaying(tmp_path / "wrong"), pytest.raises(CheckFailure, match="ignores the padding mask"):
        check_encoder_layer_post_norm(object(), seed=2)


def test_replay_of_the_checks_that_take_a_class_and_its_builder(monkeypatch, tmp_path):
    """The pair travels as one argument, so the record's key names no student object."""
    for check, answers in ((check_encoder_layer_init, (student.EncoderLayer, student.build_encoder_layer)),
                           (check_encoder, (student.Encoder, student.build_encoder))):
        monkeypatch.setenv(RECORD_ENV, str(tmp_path / check.__name__))
        check(answers, seed=2)
        monkeypatch.delenv(RECORD_ENV)
        with replaying(tmp_path / check.__name__):
            check((object(), object()), seed=2)


# Options the checks once left unexercised (the check audit's gaps 3, 4, 19, 23, 24, 31): each mistake below passed
# the earlier checks.

# The builder that builds its FFN with ReLU whatever `activation` says.
HARD_CODED_RELU = builder_of(student.EncoderLayer, fixed_activation="relu")


class TwoDimensionalMaskAsPadding(student.EncoderLayer):
    """Reads any 2-D mask as a (batch, seq) padding mask."""

    def forward(self, x, mask=None):
        if mask is not None and mask.dim() == 2:
            mask = mask[:, None, None, :]
        return super().forward(x, mask)


@pytest.mark.parametrize("check", [check_encoder_layer_post_norm, check_encoder_layer_pre_norm])
def test_layer_checks_catch_an_activation_that_is_not_passed_on(check):
    with pytest.raises(CheckFailure, match="activation='gelu': in build_encoder_layer, pass activation on") as failure:
        check(HARD_CODED_RELU)
    assert "largest difference" in str(failure.value) and "on sizes batch=" in str(failure.value)


def test_layer_checks_catch_a_causal_mask_read_as_padding():
    with pytest.raises(CheckFailure, match=r"causal mask \(seq, seq\)"):
        check_encoder_layer_post_norm(builder_of(TwoDimensionalMaskAsPadding))


def _encoder_with(mistake):
    return stack_builder(fixed_activation="relu" if mistake == "activation not passed on" else None,
                         fixed_dropout=0.1 if mistake == "dropout not passed on" else None,
                         final_norm_for_post_norm=mistake == "post-norm always has a final norm")


@pytest.mark.parametrize(("mistake", "message"), [
    ("activation not passed on", "build_encoder must pass activation on to build_encoder_layer"),
    ("dropout not passed on", r"dropout1 has p=0.1: build_encoder must pass dropout on to build_encoder_layer"),
    ("post-norm always has a final norm", r"build_encoder\(final_norm=False\) builds has unexpected parameters"),
])
def test_encoder_check_catches_options_that_are_not_passed_on(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_encoder((student.Encoder, _encoder_with(mistake)))


def test_embedding_check_catches_dropout_left_out_of_the_learned_branch():
    class NoDropoutForLearned(student.Embedding):
        def forward(self, tokens, start=0):
            out = super().forward(tokens, start)
            if self.positional == "learned":  # the learned branch returns before the dropout
                return self.tokens(tokens) * math.sqrt(self.d_model) + self.positions(
                    torch.arange(start, start + tokens.shape[1]))
            return out

    with pytest.raises(CheckFailure, match="positional='learned' and dropout=1.0 in training mode"):
        check_embedding_learned(NoDropoutForLearned)


def test_embedding_check_catches_a_squeeze_that_drops_a_batch_of_one():
    class Squeezed(student.Embedding):
        def forward(self, tokens, start=0):
            return super().forward(tokens, start).squeeze()

    with pytest.raises(CheckFailure, match=r"should have shape \(batch=1, "):
        check_embedding_sinusoidal(Squeezed)


def test_failure_messages_give_the_sizes_and_the_largest_difference():
    for check, args in ((check_encoder_layer_post_norm, (layer_builder("no mask"),)),
                        (check_encoder_layer_dropout, (layer_builder("dropout on residual"),)),
                        (check_encoder, ((student.Encoder, _encoder_with("activation not passed on")),))):
        with pytest.raises(CheckFailure) as failure:
            check(*args)
        assert "largest difference" in str(failure.value) and "on sizes batch=" in str(failure.value), failure.value


# -- issue 27: each named diagnosis is verified on its own mistake and withheld from a similar one ----------

class TableEmbedding(student.Embedding):
    """The embedding with its sinusoidal table of max_len rows; ``rows(start, seq)`` picks the rows it adds."""

    rows = staticmethod(lambda start, seq: slice(start, start + seq))
    arange = staticmethod(lambda start, seq: torch.arange(start, start + seq))
    extend = True
    sign = 1.0

    def forward(self, tokens, start=0):
        x = self.tokens(tokens) * math.sqrt(self.d_model)
        seq = tokens.shape[1]
        if self.positional == "sinusoidal":
            table = self.sinusoids
            if self.extend and start + seq > len(table):
                table = student.sinusoidal_encoding(start + seq, self.d_model)
            x = x + self.sign * table[self.rows(start, seq)].to(x)
        elif self.positional == "learned":
            x = x + self.positions(self.arange(start, seq))
        return self.dropout(x)


def table_embedding(**changes):
    return type("TableEmbedding_edited", (TableEmbedding,),
                {k: staticmethod(v) if callable(v) else v for k, v in changes.items()})


@pytest.mark.parametrize(
    ("check", "changes", "message"),
    [
        (check_embedding_sinusoidal, dict(extend=False), r"with start=13 \(past max_len=14.*Past max_len your "
                                                         r"positions stop: every token got the row of position start"),
        (check_embedding_sinusoidal, dict(sign=-1.0), "You subtracted the positions"),
        (check_embedding_sinusoidal, dict(rows=lambda start, seq: slice(start + 1, start + seq)),
         r"4 rows of positions met seq = 5 token vectors at start = 0 .* and 4 at start = 6: always one fewer"),
        (check_embedding_sinusoidal, dict(rows=lambda start, seq: slice(start, start + seq + 1)),
         "always one more than the tokens"),
        (check_embedding_learned, dict(arange=lambda start, seq: torch.arange(start)),
         r"0 rows of positions met seq = 5 token vectors at start = 0.* and 6 at start = 6: always start \(what "
         r"torch.arange\(start\) gives"),
        (check_embedding_learned, dict(arange=lambda start, seq: torch.arange(start, start)),
         "always none at any start"),
    ],
)
def test_embedding_checks_name_a_one_line_slip(check, changes, message):
    with pytest.raises(CheckFailure, match=message):
        check(table_embedding(**changes))


def test_embedding_checks_withhold_names_that_do_not_fit():
    check_embedding_sinusoidal(TableEmbedding)
    check_embedding_learned(TableEmbedding)
    # A table that stops at max_len + 1 rows still fails past it, without the one-row name.
    with pytest.raises(CheckFailure, match="Your positions have the wrong number of rows") as failure:
        check_embedding_sinusoidal(table_embedding(extend=False, rows=lambda start, seq: (
            slice(start - 1, start + seq) if start > 6 else slice(start, start + seq))))
    assert "always" not in str(failure.value) and "every token got the row" not in str(failure.value)
    # Positions that ignore start keep their own name, not the past-max_len one.
    with pytest.raises(CheckFailure, match="start at 0 whatever `start` is") as failure:
        check_embedding_sinusoidal(table_embedding(rows=lambda start, seq: slice(0, seq)))
    assert "Past max_len" not in str(failure.value)


def test_embedding_check_points_at_the_axis_of_a_shape_read_past_its_end():
    class ThirdAxis(student.Embedding):
        def forward(self, tokens, start=0):
            tokens.shape[2]
            return super().forward(tokens, start)

    with pytest.raises(CheckFailure, match=r"raised IndexError: tuple index out of range An index ran past the end "
                                           r"of a tuple: if it is a shape, tokens has two axes"):
        check_embedding_sinusoidal(ThirdAxis)


def _with_sinusoids(how):
    """The library's embedding with its positional table kept another way: ``how(module, table)``."""
    class Kept(student.Embedding):
        def __init__(self, vocab, d_model, positional="sinusoidal", max_len=512, dropout=0.0):
            super().__init__(vocab, d_model, positional, max_len, dropout)
            table = self.sinusoids
            del self.sinusoids
            how(self, table)
    return Kept


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (lambda m, t: m.register_buffer("sinusoids", t), r"state_dict\(\) holds 'sinusoids', so the buffer was "
                                                          r"registered as persistent.*persistent=False"),
        (lambda m, t: m.register_buffer("sinusoids", t, persistent=True), "registered as persistent"),
        (lambda m, t: setattr(m, "sinusoids", t), "self.sinusoids is a plain attribute \\(a Tensor\\), not a buffer"),
        (lambda m, t: m.register_buffer("code", t, persistent=False), "has no buffer sinusoids"),
        (lambda m, t: m.register_buffer("sinusoids", t[:-1], persistent=False), "the buffer sinusoids has shape"),
    ],
)
def test_embedding_check_wants_the_code_in_a_buffer_left_out_of_the_state_dict(how, message):
    with pytest.raises(CheckFailure, match=message):
        check_embedding_sinusoidal(_with_sinusoids(how))


def test_embedding_check_takes_a_non_persistent_buffer_and_withholds_the_persistence_name():
    check_embedding_sinusoidal(_with_sinusoids(lambda m, t: m.register_buffer("sinusoids", t, persistent=False)))
    # Another persistent buffer is reported as what it is, not as the table's persistence.
    with pytest.raises(CheckFailure, match=r"holds \['steps'\] besides the parameters") as failure:
        check_embedding_sinusoidal(_with_sinusoids(lambda m, t: (m.register_buffer("sinusoids", t, persistent=False),
                                                                 m.register_buffer("steps", torch.zeros(())))))
    assert "persistent=False" not in str(failure.value)


def test_embedding_check_builds_a_second_width_for_the_buffer():
    """A table kept only for some widths (here d_model a multiple of 3, as the graded sizes' 12 is) is caught at the
    second width, where the table is missing."""
    class SomeWidths(student.Embedding):
        def __init__(self, vocab, d_model, positional="sinusoidal", max_len=512, dropout=0.0):
            super().__init__(vocab, d_model, positional, max_len, dropout)
            if d_model % 3:
                self.sinusoids = None
    with pytest.raises(CheckFailure, match=r"d_model=\d+, max_len=\d+\) has no buffer sinusoids"):
        check_embedding_sinusoidal(SomeWidths)
