"""Chapter 03: multi-head attention, with the heads split and merged by einops."""

from typing import Any

import torch
from beartype import beartype
from einops import rearrange
from jaxtyping import Bool, Float, jaxtyped
from torch import Tensor, nn

from stepformer.attention import scaled_dot_product_attention


@jaxtyped(typechecker=beartype)
def split_heads(x: Float[Tensor, "batch seq d_model"], heads: int) -> Float[Tensor, "batch heads seq d_head"]:
    """Cut each position's ``d_model`` features into ``heads`` slices of ``d_head = d_model // heads``.

    Head ``h`` gets the features ``h * d_head`` to ``(h + 1) * d_head - 1``: ``d_model`` is read as
    ``(heads d_head)``, heads outermost, the layout of ``torch.nn.MultiheadAttention``. The heads
    axis moves before ``seq`` so that attention runs on every head at once.
    """
    return rearrange(x, "batch seq (heads d_head) -> batch heads seq d_head", heads=heads)


@jaxtyped(typechecker=beartype)
def merge_heads(x: Float[Tensor, "batch heads seq d_head"]) -> Float[Tensor, "batch seq d_model"]:
    """Undo :func:`split_heads`: concatenate the heads' outputs into ``d_model = heads * d_head`` features.

    Head ``h``'s features land at ``h * d_head`` to ``(h + 1) * d_head - 1`` (the ``(heads d_head)``
    order), where ``W_O`` expects them.
    """
    return rearrange(x, "batch heads seq d_head -> batch seq (heads d_head)")


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W_O, head_i = Attention(Q W_Q^i, K W_K^i, V W_V^i).

    ``d_model`` must be a multiple of ``heads``; each head works on ``d_head = d_model // heads``
    features. The projections are the attributes ``w_q``, ``w_k``, ``w_v`` and ``w_o``, each an
    ``nn.Linear(d_model, d_model, bias=bias)``: ``w_q`` holds every head's ``W_Q^i`` side by side, in
    the ``(heads d_head)`` order of :func:`split_heads`. ``dropout`` is the probability of dropping an
    attention weight while training (``nn.Dropout`` in the attribute ``dropout``); it does nothing in
    ``eval()`` mode.
    """

    def __init__(self, d_model: int, heads: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        if heads < 1 or d_model % heads != 0:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of heads ({heads})")
        self.heads = heads
        # One d_model x d_model matrix per role holds all the heads' projections: one big matmul
        # instead of `heads` small ones, with the same result.
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, d_model, bias=bias)
        self.w_v = nn.Linear(d_model, d_model, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    @jaxtyped(typechecker=beartype)
    def forward(
        self,
        query: Float[Tensor, "batch q_len d_model"],
        key: Float[Tensor, "batch k_len d_model"],
        value: Float[Tensor, "batch k_len d_model"],
        mask: Bool[Tensor, "#batch #heads #q_len #total"] | Bool[Tensor, "#q_len #total"] | None = None,
        cache: Any = None,
    ) -> Float[Tensor, "batch q_len d_model"]:
        """Every query position reads the key/value positions through ``heads`` attentions at once.

        Self-attention passes the same sequence three times (``mha(x, x, x)``); cross-attention
        takes the queries from one sequence and the keys and values from another, so ``q_len`` and
        ``k_len`` may differ. ``mask`` is boolean, ``True`` = "this query may attend to this key",
        shared by the heads: ``(batch, 1, 1, k_len)`` for padding, ``(q_len, k_len)`` for a causal mask.

        ``cache`` (chapter 09's KV-cache; ``None`` until then) is any object whose
        ``update(k, v)`` takes this call's keys and values, ``(batch, heads, k_len, d_head)`` each,
        and gives back the ``total`` keys and values to attend over: the earlier steps' too. The
        mask then spans all ``total`` keys.
        """
        q = split_heads(self.w_q(query), self.heads)
        k = split_heads(self.w_k(key), self.heads)
        v = split_heads(self.w_v(value), self.heads)
        if cache is not None:
            k, v = cache.update(k, v)  # the keys and values of every step so far, these included
        # Each head scales its scores by sqrt(d_head), the width of its own queries and keys;
        # self.dropout acts on the attention weights (as in the paper's code and in PyTorch).
        heads_out, _ = scaled_dot_product_attention(q, k, v, mask, self.dropout)
        # W_O mixes the heads: each output feature reads every head's features.
        return self.w_o(merge_heads(heads_out))


def from_torch(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """A :class:`MultiHeadAttention` with the weights of a ``torch.nn.MultiheadAttention``.

    PyTorch packs the three input projections into one ``in_proj_weight`` of shape
    ``(3 * d_model, d_model)``, in the order queries, keys, values; its ``out_proj`` is ``w_o``.
    Only the plain layout is supported (no ``kdim``/``vdim``, ``add_bias_kv`` or ``add_zero_attn``).
    The weights do not depend on ``module.batch_first``, so any module converts, but the result
    always takes ``(batch, seq, d_model)``: a ``batch_first=False`` module takes ``(seq, batch,
    d_model)``, so transpose its inputs and outputs to compare the two (chapter 07 converts such
    layers with ``encoder_layer_from_torch``).
    """
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise ValueError("only nn.MultiheadAttention(d_model, heads) with bias on or off and nothing else is supported")
    bias = module.in_proj_bias is not None
    ours = MultiHeadAttention(module.embed_dim, module.num_heads, bias=bias, dropout=module.dropout)
    ours = ours.to(dtype=module.in_proj_weight.dtype, device=module.in_proj_weight.device)
    weights = rearrange(module.in_proj_weight, "(qkv d_out) d_in -> qkv d_out d_in", qkv=3)
    biases = rearrange(module.in_proj_bias, "(qkv d_out) -> qkv d_out", qkv=3) if bias else (None,) * 3
    with torch.no_grad():
        for linear, weight, b in zip((ours.w_q, ours.w_k, ours.w_v), weights, biases, strict=True):
            linear.weight.copy_(weight)
            if bias:
                linear.bias.copy_(b)
        ours.w_o.weight.copy_(module.out_proj.weight)
        if bias:
            ours.w_o.bias.copy_(module.out_proj.bias)
    return ours


def count_parameters(d_model: int, heads: int, bias: bool = True) -> int:
    """The number of learned numbers in ``MultiHeadAttention(d_model, heads, bias)``, counted on the module.

    Measured, not derived: the module is built and the sizes of its parameters are added up.
    """
    module = MultiHeadAttention(d_model, heads, bias=bias)
    return sum(p.numel() for p in module.parameters())
