"""Chapter 06: positional encodings. Sinusoidal, learned, and rotary (RoPE)."""

import torch
from beartype import beartype
from einops import einsum, rearrange, repeat
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor, nn


@jaxtyped(typechecker=beartype)
def sinusoidal_encoding(seq_len: int, d_model: int) -> Float[Tensor, "seq d_model"]:
    """The fixed positional encoding of Vaswani et al. (2017), section 3.5, as float32.

    PE[pos, 2i] = sin(pos / 10000^(2i / d_model)) and PE[pos, 2i + 1] = cos(pos / 10000^(2i / d_model)):
    row ``pos`` (``seq`` axis, 0 ... seq_len - 1) is the code of one position; channels come
    in interleaved (sin, cos) pairs, pair ``i`` turning at frequency 10000^(-2i / d_model).
    Raises ``ValueError`` for an odd ``d_model`` or a size below 1.
    """
    if seq_len < 1 or d_model < 1:
        raise ValueError(f"seq_len and d_model must be at least 1, got seq_len={seq_len}, d_model={d_model}")
    if d_model % 2:
        raise ValueError(f"d_model must be even: channels come in (sin, cos) pairs, got d_model={d_model}")
    # float64 angles: float32 would round pos * frequency by ~1e-7 * pos radians.
    pos = torch.arange(seq_len, dtype=torch.float64)
    i = torch.arange(d_model // 2, dtype=torch.float64)
    frequency = 10000.0 ** (-2 * i / d_model)
    angle = einsum(pos, frequency, "seq, pair -> seq pair")
    pe = rearrange([angle.sin(), angle.cos()], "sin_cos seq pair -> seq (pair sin_cos)")
    return pe.float()


class LearnedPositionalEmbedding(nn.Module):
    """One learned vector per position, as in BERT and GPT-2: a table of ``max_len`` rows.

    ``self.embedding`` is an ``nn.Embedding(max_len, d_model)``. Positions at or past
    ``max_len`` have no row, so they raise a ``ValueError``: the table cannot extrapolate.
    """

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)

    @jaxtyped(typechecker=beartype)
    def forward(self, positions: Int[Tensor, "*batch seq"] | int) -> Float[Tensor, "*batch seq d_model"]:
        """The vectors of ``positions`` (any leading axes), or of 0 ... n - 1 when given an int n."""
        if isinstance(positions, int):
            positions = torch.arange(positions, device=self.embedding.weight.device)
        if positions.numel() and (positions.min() < 0 or positions.max() >= self.max_len):
            raise ValueError(
                f"positions must lie in 0 ... {self.max_len - 1} (max_len={self.max_len}), got "
                f"{positions.min().item()} ... {positions.max().item()}: a learned table has no row past max_len"
            )
        return self.embedding(positions)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021), applied to queries and keys, not values.

    Channels are taken in interleaved pairs (0, 1), (2, 3), ...: pair ``i`` of a vector at
    position ``pos`` is rotated by the angle pos · θ_i, θ_i = base^(-2i / d_head). That is the
    RoFormer paper's convention and the sinusoidal encoding's pairing; GPT-NeoX and LLaMA code
    pairs channel i with i + d_head / 2 instead, which is the same rotation after a fixed
    permutation of the channels. Because a rotation by pos_q · θ and one by pos_k · θ meet in
    a dot product as one rotation by (pos_q - pos_k) · θ, the score of a rotated query and key
    depends on their positions only through the offset. There are no learned parameters;
    ``self.d_head`` and ``self.base`` are stored.
    """

    def __init__(self, d_head: int, base: float = 10000.0) -> None:
        super().__init__()
        if d_head < 2 or d_head % 2:
            raise ValueError(f"d_head must be even and at least 2: channels are rotated in pairs, got {d_head}")
        self.d_head = d_head
        self.base = base

    @jaxtyped(typechecker=beartype)
    def forward(
        self, x: Float[Tensor, "*batch seq d_head"], positions: Int[Tensor, " seq"]
    ) -> Float[Tensor, "*batch seq d_head"]:
        """Rotate each query or key ``x[..., s, :]`` to its position ``positions[s]``.

        ``x`` is (*batch, seq, d_head): any leading axes (batch, heads), one row per token;
        the result has the same shape and dtype.
        """
        if x.shape[-1] != self.d_head:
            raise ValueError(f"x has d_head={x.shape[-1]}, but this RotaryEmbedding was built for {self.d_head}")
        # Angles in at least float32: half precision would blur pos · θ past a few hundred positions.
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        i = torch.arange(self.d_head // 2, dtype=dtype, device=x.device)
        theta = self.base ** (-2 * i / self.d_head)
        angle = einsum(positions.to(dtype), theta, "seq, pair -> seq pair")
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        pairs = rearrange(x, "... seq (pair two) -> ... seq pair two", two=2)
        x_even, x_odd = pairs[..., 0], pairs[..., 1]
        # The 2-D rotation [[cos, -sin], [sin, cos]] applied to every (even, odd) pair.
        rotated = [x_even * cos - x_odd * sin, x_even * sin + x_odd * cos]
        return rearrange(rotated, "two ... seq pair -> ... seq (pair two)")


@jaxtyped(typechecker=beartype)
def scores_by_offset(
    q: Float[Tensor, " d_head"], k: Float[Tensor, " d_head"], seq_len: int
) -> tuple[Float[Tensor, " offset"], Float[Tensor, " offset"]]:
    """Place one query q and one key k at every position 0 ... seq_len - 1, rotate them with
    ``RotaryEmbedding(d_head)``, and score every pair: s[m, n] = rope(q, m) · rope(k, n).

    Returns ``(mean, spread)`` over the pairs with the same offset m - n, for the offsets
    -(seq_len - 1), ..., seq_len - 1 in that order (``offset`` = 2 · seq_len - 1 entries);
    ``spread`` is max - min. RoPE predicts a spread of zero: the score depends only on m - n.
    """
    rope = RotaryEmbedding(q.shape[-1])
    positions = torch.arange(seq_len)
    q_rot = rope(repeat(q, "d_head -> q_len d_head", q_len=seq_len), positions)
    k_rot = rope(repeat(k, "d_head -> k_len d_head", k_len=seq_len), positions)
    scores = einsum(q_rot, k_rot, "q_len d_head, k_len d_head -> q_len k_len")
    # torch.diagonal's offset d holds the entries s[m, m + d], i.e. m - n = -d.
    diagonals = [torch.diagonal(scores, offset=-offset) for offset in range(-(seq_len - 1), seq_len)]
    mean = torch.stack([d.mean() for d in diagonals])
    spread = torch.stack([d.max() - d.min() for d in diagonals])
    return mean, spread
