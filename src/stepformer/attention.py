"""Chapter 01: scaled dot-product attention, and how to measure what scaling does to it."""

import math

import torch
from beartype import beartype
from einops import einsum, reduce
from jaxtyping import Bool, Float, jaxtyped
from torch import Tensor, nn

from stepformer.before import masked_softmax


@jaxtyped(typechecker=beartype)
def scaled_dot_product_attention(
    q: Float[Tensor, "*batch q_len d_k"],
    k: Float[Tensor, "*batch k_len d_k"],
    v: Float[Tensor, "*batch k_len d_v"],
    mask: Bool[Tensor, "*#batch #q_len #k_len"] | None = None,
    dropout: nn.Module | None = None,
) -> tuple[Float[Tensor, "*batch q_len d_v"], Float[Tensor, "*batch q_len k_len"]]:
    """Attention(Q, K, V) = softmax(Q Kᵀ / sqrt(d_k)) V, with an optional mask and dropout.

    Leading axes (``*batch``: batch, heads, ...) are carried through unchanged.
    ``mask`` is boolean with ``True`` = "this query may attend to this key" (the convention
    of ``torch.nn.functional.scaled_dot_product_attention``); it broadcasts against
    ``(*batch, q_len, k_len)``. A query row whose keys are all masked gets zero weights and
    a zero output instead of NaN. ``dropout`` (an ``nn.Dropout``), if given, acts on the
    weights before the weighted sum of the values, where the paper's code and PyTorch's
    ``dropout_p`` put it; in ``eval()`` mode it does nothing.

    Returns ``(output, weights)``: ``weights[..., i, j]`` is how much query ``i`` reads key
    ``j``, before dropout; each unmasked row sums to 1 over ``k_len``.
    """
    d_k = q.shape[-1]
    # Dividing by sqrt(d_k) keeps the scores' variance near 1 whatever d_k is, so the
    # softmax does not saturate and its gradient does not vanish.
    scores = einsum(q, k, "... q_len d_k, ... k_len d_k -> ... q_len k_len") / math.sqrt(d_k)
    # Chapter 00's masked softmax: masked keys get weight 0, a row with no key left zeros, not NaN.
    weights = masked_softmax(scores, mask)
    # The weights returned are the undropped ones, which sum to 1 and are what plots and
    # entropies read; dropout's random mask is training noise on this step's sum only.
    dropped = weights if dropout is None else dropout(weights)
    output = einsum(dropped, v, "... q_len k_len, ... k_len d_v -> ... q_len d_v")
    return output, weights


@jaxtyped(typechecker=beartype)
def attention_entropy(weights: Float[Tensor, "*batch q_len k_len"]) -> Float[Tensor, "*batch q_len"]:
    """The entropy, in nats, of each query's attention distribution over the keys.

    ``log(k_len)`` means the query reads every key equally; 0 means it reads a single key.
    Zero weights contribute nothing (0 · log 0 = 0), so masked keys and fully masked rows
    are fine.
    """
    plogp = torch.where(weights > 0, weights * weights.log(), 0.0)
    return -reduce(plogp, "... q_len k_len -> ... q_len", "sum")


def mean_attention_entropy(
    d_k: int, *, scale: bool, q_len: int = 16, k_len: int = 16, samples: int = 64, seed: int = 0
) -> float:
    """Mean attention entropy for random unit-variance queries and keys of width ``d_k``.

    With ``scale=False`` the scores are divided by 1 instead of sqrt(d_k). The mean runs over
    ``samples`` independent draws of ``q_len`` queries and ``k_len`` keys.
    """
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(samples, q_len, d_k, generator=generator, dtype=torch.float64)
    k = torch.randn(samples, k_len, d_k, generator=generator, dtype=torch.float64)
    v = torch.zeros(samples, k_len, 1, dtype=torch.float64)
    # Undo the library's division by sqrt(d_k) to see the unscaled softmax.
    q = q if scale else q * math.sqrt(d_k)
    _, weights = scaled_dot_product_attention(q, k, v)
    return attention_entropy(weights).mean().item()
