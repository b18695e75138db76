"""Chapter 07: the encoder. Embeddings, the encoder layer (self-attention and FFN in residual sublayers), the stack.

Every piece comes from an earlier chapter: attention (01, 03), masks (02), the feed-forward
network (04), LayerNorm and the residual sublayer (05), positions (06). Parameter names follow
``torch.nn.TransformerEncoderLayer``, so its weights copy across (``encoder_from_torch``).
"""

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from beartype import beartype
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn

from stepformer.ffn import FeedForward
from stepformer.multihead import MultiHeadAttention
from stepformer.multihead import from_torch as attention_from_torch
from stepformer.norms import LayerNorm
from stepformer.positional import LearnedPositionalEmbedding, sinusoidal_encoding

POSITIONALS = ("sinusoidal", "learned", "rope")
# A mask is boolean, True = may attend, broadcast against the scores (batch, heads, queries, keys).
SelfMask = Bool[Tensor, "#batch #heads #seq #seq"] | Bool[Tensor, "#seq #seq"] | None


def add_and_norm(
    x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module, dropout: nn.Module, norm_first: bool
) -> Tensor:
    """One residual sublayer (chapter 05).

    Post-norm: ``norm(x + dropout(f(x)))``; pre-norm: ``x + dropout(f(norm(x)))``.
    """
    if norm_first:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


class Embedding(nn.Module):
    """Token embeddings scaled by sqrt(d_model), plus positions, then dropout.

    ``positional`` is ``"sinusoidal"`` (the fixed code of chapter 06, computed for any
    length), ``"learned"`` (a table of ``max_len`` rows) or ``"rope"`` (nothing is added here:
    the attention rotates queries and keys instead). The scale (section 3.4 of the paper) makes
    token vectors with entries of about 1/sqrt(d_model), as in a table shared with the output
    layer, about as long as the positional code they are added to. The full model initialises
    its tables with Glorot's std sqrt(2 / (vocab + d_model)) instead: as long as the code for small
    vocabularies, shorter for large ones (0.23 times at vocab 37000, d_model 512).
    """

    def __init__(
        self, vocab: int, d_model: int, positional: str = "sinusoidal", max_len: int = 512, dropout: float = 0.0
    ) -> None:
        super().__init__()  # first: the submodules assigned below register with nn.Module
        if positional not in POSITIONALS:
            raise ValueError(f"positional must be one of {POSITIONALS}, got {positional!r}")
        self.d_model, self.positional = d_model, positional
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = LearnedPositionalEmbedding(max_len, d_model) if positional == "learned" else None
        # The code of the first max_len positions, computed once and moved with the model: rebuilding it
        # on the CPU and copying it to the GPU at every call would cost a transfer per forward and per
        # decoding step. Not persistent: it is a function of the shape, not a weight to save. (An odd
        # d_model has no code; a model that never embeds with it, as when it is compared layer by layer
        # with PyTorch's, may still be built.)
        has_code = positional == "sinusoidal" and d_model % 2 == 0
        self.register_buffer("sinusoids", sinusoidal_encoding(max_len, d_model) if has_code else None,
                             persistent=False)
        self.dropout = nn.Dropout(dropout)  # on the sum of tokens and positions, section 5.4 of the paper

    @jaxtyped(typechecker=beartype)
    def forward(self, tokens: Int[Tensor, "batch seq"], start: int = 0) -> Float[Tensor, "batch seq d_model"]:
        """Embed ``tokens`` at positions ``start ... start + seq - 1`` (``start > 0``: decoding with a cache)."""
        x = self.tokens(tokens) * math.sqrt(self.d_model)
        seq = tokens.shape[1]
        if self.positional == "sinusoidal":
            # Past max_len (the code is defined for any position) the table is extended for this call.
            table = self.sinusoids
            if table is None or start + seq > len(table):
                table = sinusoidal_encoding(start + seq, self.d_model)
            x = x + table[start : start + seq].to(x)
        elif self.positional == "learned":
            x = x + self.positions(torch.arange(start, start + seq, device=tokens.device))
        return self.dropout(x)


class EncoderLayer(nn.Module):
    """Self-attention then the feed-forward network, each in a residual sublayer (Add & Norm).

    The layer is its wiring: it is given its parts and only decides how they connect.
    ``self_attn`` is called as ``self_attn(x, x, x, mask)`` (chapter 03's
    :class:`~stepformer.multihead.MultiHeadAttention`, or any attention with that call), ``ffn``
    as ``ffn(x)`` (chapter 04), ``norm1`` and ``norm2`` are two separate norms (chapter 05), one
    per sublayer: one module handed in for both raises ``ValueError``. ``dropout`` acts on each
    sublayer's output before the residual add (``dropout1``, ``dropout2``); the parts bring their
    own dropout inside. ``norm_first`` chooses pre-norm. Attribute names are
    ``torch.nn.TransformerEncoderLayer``'s, so its weights copy across;
    :func:`build_encoder_layer` builds PyTorch's layer from this course's parts.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        ffn: nn.Module,
        norm1: nn.Module,
        norm2: nn.Module,
        dropout: float = 0.1,
        norm_first: bool = False,
    ) -> None:
        super().__init__()  # first: the submodules assigned below register with nn.Module
        if norm1 is norm2:
            raise ValueError("norm1 and norm2 are the same module: each sublayer needs a norm of its own")
        self.norm_first = norm_first
        self.self_attn, self.ffn = self_attn, ffn
        self.norm1, self.norm2 = norm1, norm2
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)

    @jaxtyped(typechecker=beartype)
    def forward(
        self, x: Float[Tensor, "batch seq d_model"], mask: SelfMask = None
    ) -> Float[Tensor, "batch seq d_model"]:
        """``mask``: ``True`` = may attend; a padding mask ``(batch, 1, 1, seq)`` keeps padding unread."""
        x = add_and_norm(x, lambda h: self.self_attn(h, h, h, mask), self.norm1, self.dropout1, self.norm_first)
        return add_and_norm(x, self.ffn, self.norm2, self.dropout2, self.norm_first)


def build_encoder_layer(
    d_model: int, heads: int, d_ff: int, dropout: float = 0.1, norm_first: bool = False, activation: str = "relu"
) -> EncoderLayer:
    """``torch.nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout, activation, norm_first=...)`` from the
    course's parts: multi-head attention (03), the feed-forward network (04), two LayerNorms (05).

    ``dropout`` goes where PyTorch puts it: the attention weights, the FFN's hidden units, and each
    sublayer's output; ``activation`` goes to the FFN.
    """
    return EncoderLayer(
        MultiHeadAttention(d_model, heads, dropout=dropout),
        FeedForward(d_model, d_ff, activation, dropout),
        LayerNorm(d_model),
        LayerNorm(d_model),
        dropout,
        norm_first,
    )


class Encoder(nn.Module):
    """A stack of layers, each called as ``layer(x, mask)``, then a final norm (``norm``; none: ``nn.Identity``).

    The final norm is needed with pre-norm, whose residual stream is never normalised;
    ``torch.nn.Transformer`` has one in both cases. Each layer must be its own module: the same
    layer listed twice (``[layer] * n``) would be one set of weights applied twice.
    """

    def __init__(self, layers: Iterable[nn.Module], norm: nn.Module | None = None) -> None:
        super().__init__()  # first: the submodules assigned below register with nn.Module
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Identity() if norm is None else norm

    @jaxtyped(typechecker=beartype)
    def forward(
        self, x: Float[Tensor, "batch seq d_model"], mask: SelfMask = None
    ) -> Float[Tensor, "batch seq d_model"]:
        """The encoder's memory: one vector per source position, every layer reading the same padding ``mask``."""
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


def build_encoder(
    d_model: int,
    heads: int,
    d_ff: int,
    layers: int,
    dropout: float = 0.1,
    norm_first: bool = False,
    activation: str = "relu",
    final_norm: bool = True,
) -> Encoder:
    """``torch.nn.TransformerEncoder`` of ``layers`` :func:`build_encoder_layer` layers, with a final LayerNorm if
    ``final_norm``.

    Each layer is built afresh, with its own weights; ``dropout``, ``norm_first`` and ``activation`` go to every one.
    """
    return Encoder(
        (build_encoder_layer(d_model, heads, d_ff, dropout, norm_first, activation) for _ in range(layers)),
        LayerNorm(d_model) if final_norm else None,
    )


@jaxtyped(typechecker=beartype)
def residual_norms(
    layers: nn.ModuleList, x: Float[Tensor, "batch seq d_model"], mask: SelfMask = None
) -> Float[Tensor, " depth"]:
    """How large the residual stream is through a stack: the mean length of a position's vector.

    Entry 0 is for ``x``, entry ``i`` for the output of ``layers[i - 1]``, so ``depth =
    len(layers) + 1``. Each layer is called as ``layer(x, mask)``; the length is the L2 norm over
    ``d_model``, averaged over ``batch`` and ``seq``. Measured without gradients.
    """
    with torch.no_grad():
        lengths = [torch.linalg.vector_norm(x, dim=-1).mean()]
        for layer in layers:
            x = layer(x, mask)
            lengths.append(torch.linalg.vector_norm(x, dim=-1).mean())
    return torch.stack(lengths)


def check_plain(layer: nn.Module) -> tuple[str, float]:
    """The activation and dropout of a PyTorch encoder or decoder layer, if this library can copy it."""
    activation = layer.activation
    if activation is F.relu or isinstance(activation, nn.ReLU):
        name = "relu"
    elif activation is F.gelu or (isinstance(activation, nn.GELU) and activation.approximate == "none"):
        name = "gelu"
    elif isinstance(activation, nn.GELU):
        # Not for want of a part: FeedForward has "gelu_tanh". PyTorch's layer itself has no one function here:
        # its fast path (eval(), no gradients) computes the exact GELU for any nn.GELU it holds.
        raise ValueError(f"a PyTorch layer holding {activation} computes the exact GELU in eval() without gradients "
                         "and the tanh approximation otherwise: it cannot be copied as one function")
    else:
        raise ValueError(f"only activation='relu' or 'gelu' can be copied, got {activation}")
    if abs(layer.norm1.eps - 1e-5) > 1e-12:
        raise ValueError(f"only LayerNorm eps=1e-5 can be copied, got {layer.norm1.eps}")
    return name, layer.dropout.p


def layer_from_torch(layer: nn.Module, build: Callable[..., nn.Module], attention: dict[str, str]) -> nn.Module:
    """``build`` a layer with the sizes of a PyTorch encoder or decoder layer and copy its weights.

    ``build(d_model, heads, d_ff, dropout, norm_first, activation)`` is :func:`build_encoder_layer` or chapter 08's
    ``build_decoder_layer``; ``attention`` maps our attention attributes to PyTorch's (``{"self_attn":
    "self_attn"}``); the FFN's ``linear1``/``linear2`` and every ``norm1``, ``norm2``, ... are copied by name.
    """
    activation, dropout = check_plain(layer)
    first = getattr(layer, next(iter(attention.values())))
    copy = build(first.embed_dim, first.num_heads, layer.linear1.out_features, dropout, layer.norm_first, activation)
    copy = copy.to(dtype=layer.linear1.weight.dtype, device=layer.linear1.weight.device)
    for mine, theirs in attention.items():
        getattr(copy, mine).load_state_dict(attention_from_torch(getattr(layer, theirs)).state_dict())
    copy.ffn.linear1.load_state_dict(layer.linear1.state_dict())
    copy.ffn.linear2.load_state_dict(layer.linear2.state_dict())
    for name, norm in copy.named_children():
        if name.startswith("norm"):
            norm.load_state_dict(getattr(layer, name).state_dict())
    return copy


def stack_from_torch(
    stack: nn.Module, ours: type[nn.Module], copy_layer: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """``ours`` (:class:`Encoder` or chapter 08's ``Decoder``) of PyTorch's ``stack``'s layers and final norm."""
    first = stack.layers[0].linear1.weight
    norm = None
    if stack.norm is not None:
        norm = LayerNorm(stack.norm.normalized_shape[0], stack.norm.eps).to(dtype=first.dtype, device=first.device)
        norm.load_state_dict(stack.norm.state_dict())
    return ours([copy_layer(layer) for layer in stack.layers], norm)


def encoder_layer_from_torch(layer: nn.TransformerEncoderLayer) -> EncoderLayer:
    """An :class:`EncoderLayer` with the weights of a ``torch.nn.TransformerEncoderLayer`` (batch_first or not).

    PyTorch packs the three input projections of its attention into one ``in_proj_weight``
    (chapter 03's ``from_torch`` unpacks it); its ``linear1`` and ``linear2`` are our
    ``ffn.linear1`` and ``ffn.linear2``; the norms keep their names.
    """
    return layer_from_torch(layer, build_encoder_layer, {"self_attn": "self_attn"})


def encoder_from_torch(encoder: nn.TransformerEncoder) -> Encoder:
    """An :class:`Encoder` with the weights of a ``torch.nn.TransformerEncoder`` (its final ``norm`` if it has one)."""
    return stack_from_torch(encoder, Encoder, encoder_layer_from_torch)
