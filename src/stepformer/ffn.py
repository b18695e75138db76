"""Chapter 04: the position-wise feed-forward network (ReLU or either GELU), SwiGLU, and parameter counts."""

import torch.nn.functional as F
from beartype import beartype
from jaxtyping import Float, jaxtyped
from torch import Tensor, nn


class FeedForward(nn.Module):
    """FFN(x) = linear2(dropout(activation(linear1(x)))), applied to every position alone.

    ``linear1`` maps ``d_model -> d_ff`` and ``linear2`` maps ``d_ff -> d_model``, both with a
    bias (the names and the order are those of ``torch.nn.TransformerEncoderLayer``, so weights
    copy across). ``activation`` is ``"relu"``, ``"gelu"`` (the exact, erf-based GELU) or
    ``"gelu_tanh"``, GELU's tanh approximation 0.5 z (1 + tanh(sqrt(2/π) (z + 0.044715 z³))), which
    GPT-2 was trained with (its ``gelu_new``). The two GELUs differ by up to about 5e-4: a model
    trained with one computes another function with the other. ``dropout`` acts on the ``d_ff``
    hidden activations during training only.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        activations = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh")}
        if activation not in activations:
            raise ValueError(f"activation must be 'relu', 'gelu' or 'gelu_tanh', got {activation!r}")
        self.linear1 = nn.Linear(d_model, d_ff)
        self.activation = activations[activation]()
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        """``x``: ``batch`` sequences of ``seq`` positions, each a ``d_model`` vector; same shape out.

        nn.Linear acts on the last axis only, so no position ever sees another one.
        """
        hidden = self.activation(self.linear1(x))  # (batch, seq, d_ff)
        return self.linear2(self.dropout(hidden))


class SwiGLU(nn.Module):
    """SwiGLU(x) = w_down(silu(w_gate(x)) * w_up(x)), Shazeer 2020, "GLU Variants Improve Transformer".

    ``w_gate`` and ``w_up`` map ``d_model -> d_ff``, ``w_down`` maps ``d_ff -> d_model``, all
    three without bias (as in the paper, and in LLaMA).
    """

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    @jaxtyped(typechecker=beartype)
    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        """``x``: ``batch`` sequences of ``seq`` positions, each a ``d_model`` vector; same shape out."""
        # The gate decides, per hidden unit and per position, how much of w_up(x) passes:
        # silu(z) = z · sigmoid(z) is the "Swish" that gives SwiGLU its name.
        gate = F.silu(self.w_gate(x))  # (batch, seq, d_ff)
        return self.w_down(gate * self.w_up(x))


def matching_swiglu_hidden(d_model: int, d_ff: int) -> int:
    """The SwiGLU hidden size whose parameter count is closest to ``FeedForward(d_model, d_ff)``'s.

    Measured by counting the parameters of the two modules, not from a formula.
    """
    target = sum(p.numel() for p in FeedForward(d_model, d_ff).parameters())
    # Without biases, SwiGLU's count is exactly proportional to its hidden size: one hidden
    # unit costs what SwiGLU(d_model, 1) has, so the nearest count is the rounded ratio.
    per_unit = sum(p.numel() for p in SwiGLU(d_model, 1).parameters())
    return round(target / per_unit)
