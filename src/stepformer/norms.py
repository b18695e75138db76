"""Chapter 05: residual connections and normalisation (LayerNorm, RMSNorm, Add & Norm)."""

import torch
from beartype import beartype
from einops import reduce
from jaxtyping import Float, jaxtyped
from torch import Tensor, nn


class LayerNorm(nn.Module):
    """Layer normalisation (Ba et al., 2016) over the last axis, ``d_model``.

    Each position's vector is shifted to mean 0 and scaled to variance 1, then stretched by a
    learned ``weight`` (initialised to ones) and shifted by a learned ``bias`` (zeros), both of
    shape ``(d_model,)``. The variance is the biased one (divide by ``d_model``, not
    ``d_model - 1``) and ``eps`` sits inside the square root, as in ``torch.nn.LayerNorm``,
    whose state dict loads into this module.
    """

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        # Ones and zeros: at initialisation the layer only normalises.
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Normalise each position of ``x`` over ``d_model``; leading axes (batch, seq) are kept."""
        mean = reduce(x, "... d_model -> ... 1", "mean")
        # Centring first, then averaging the squares, stays exact when the mean is large
        # (x + 100); E[x²] - E[x]² would cancel catastrophically.
        centred = x - mean
        variance = reduce(centred**2, "... d_model -> ... 1", "mean")
        # eps inside the sqrt bounds the scale by 1/sqrt(eps) for a constant vector.
        return centred / torch.sqrt(variance + self.eps) * self.weight + self.bias


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang and Sennrich, 2019) over the last axis, ``d_model``.

    LayerNorm without the centring and without the bias: each position's vector is divided by
    its root mean square, then scaled by a learned ``weight`` of shape ``(d_model,)``
    (initialised to ones). ``eps`` sits inside the square root, as in ``torch.nn.RMSNorm``,
    whose state dict loads into this module. The default ``eps=1e-6`` is LLaMA's, not
    PyTorch's: ``nn.RMSNorm``'s default ``eps=None`` means ``torch.finfo(x.dtype).eps``
    (about 1.2e-7 in float32), so this module equals ``nn.RMSNorm(d_model, eps=1e-6)``.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Divide each position of ``x`` by its root mean square over ``d_model``."""
        # No mean is subtracted: one reduction instead of two, and the re-centring turned out
        # not to matter for training.
        mean_square = reduce(x**2, "... d_model -> ... 1", "mean")
        return x / torch.sqrt(mean_square + self.eps) * self.weight


class Residual(nn.Module):
    """A sublayer wrapped in a residual connection and a LayerNorm: "Add & Norm".

    Post-norm (``norm_first=False``, the original Transformer): ``norm(x + dropout(sublayer(x)))``.
    Pre-norm (``norm_first=True``, GPT-2 and most models since): ``x + dropout(sublayer(norm(x)))``,
    which leaves the residual stream ``x`` itself untouched.

    Attributes: ``sublayer`` (any module mapping ``(*batch, d_model)`` to ``(*batch, d_model)``),
    ``norm`` (a ``LayerNorm(d_model)``), ``dropout`` (an ``nn.Dropout``, applied to the
    sublayer's output only) and ``norm_first``.
    """

    def __init__(self, d_model: int, sublayer: nn.Module, norm_first: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.sublayer = sublayer
        self.norm = LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Apply the sublayer with its residual connection; the shape is kept."""
        if self.norm_first:
            # The identity path x -> x + ... carries the gradient to earlier layers unscaled.
            return x + self.dropout(self.sublayer(self.norm(x)))
        return self.norm(x + self.dropout(self.sublayer(x)))


def parameter_gradient_norms(
    blocks: nn.ModuleList, x: Float[Tensor, "*batch d_model"], upstream: Float[Tensor, "*batch d_model"]
) -> Float[Tensor, " layer"]:
    """The gradient norm of each block's parameters, for one backward pass through the stack.

    ``x`` runs through ``blocks`` in order; ``upstream`` is the gradient of the loss with
    respect to the last output (the loss is ``(output * upstream).sum()``). Entry ``i`` is
    ``sqrt(sum of squared gradient entries over all parameters of blocks[i])``. Gradients are
    computed with ``torch.autograd.grad``, so nothing accumulates in ``.grad``.
    """
    out = x
    for block in blocks:
        out = block(out)
    params = [list(block.parameters()) for block in blocks]
    grads = torch.autograd.grad(out, [p for ps in params for p in ps], upstream, allow_unused=True)
    norms, start = [], 0
    for ps in params:
        squares = [(g**2).sum() for g in grads[start:start + len(ps)] if g is not None]
        norms.append(torch.stack(squares).sum().sqrt() if squares else x.new_zeros(()))
        start += len(ps)
    return torch.stack(norms).detach()
