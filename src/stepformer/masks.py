"""Chapter 02: the masks that decide which keys a query may read, and how to see a leak."""

import torch
from beartype import beartype
from einops import rearrange, reduce
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor

from stepformer.attention import scaled_dot_product_attention


@jaxtyped(typechecker=beartype)
def padding_mask(tokens: Int[Tensor, "batch k_len"], pad_id: int) -> Bool[Tensor, "batch 1 1 k_len"]:
    """Which keys are real tokens: ``True`` = "may attend", ``False`` = padding.

    ``tokens`` holds the token ids of a batch of sentences padded to a common length
    ``k_len`` with ``pad_id``. The mask has shape ``(batch, 1, 1, k_len)``: one row per
    sentence, broadcast over the ``heads`` and ``q_len`` axes of the scores
    ``(batch, heads, q_len, k_len)``, since padding hides a key from every head and every query.
    """
    # The two 1-axes line the key axis up with the scores' last axis; without them a
    # (batch, k_len) mask would broadcast batch against q_len.
    return rearrange(tokens != pad_id, "batch k_len -> batch 1 1 k_len")


@jaxtyped(typechecker=beartype)
def causal_mask(
    q_len: int, k_len: int | None = None, device: torch.device | str | None = None
) -> Bool[Tensor, "q_len k_len"]:
    """Which keys each query may read in a decoder: ``True`` on and below the diagonal.

    Query ``i`` may read keys ``0 ... i + k_len - q_len``: the queries are the *last*
    ``q_len`` positions of a sequence of ``k_len``. With ``k_len = q_len`` (the default) that
    is the usual lower triangle; with ``k_len > q_len`` (incremental decoding, where earlier
    keys are cached) the triangle is aligned to the last key. The mask broadcasts against the
    scores ``(batch, heads, q_len, k_len)``; ``device`` is where it is created.
    """
    k_len = q_len if k_len is None else k_len
    if q_len < 1:
        raise ValueError(f"q_len must be a positive integer, got {q_len}")
    if k_len < q_len:
        raise ValueError(
            f"k_len ({k_len}) must be at least q_len ({q_len}): the queries are the last q_len of the k_len positions"
        )
    # diagonal=k_len - q_len shifts the triangle right, so the last query sees every key.
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


@jaxtyped(typechecker=beartype)
def which_outputs_change(
    x: Float[Tensor, "seq d_model"], mask: Bool[Tensor, "seq seq"] | None = None
) -> Bool[Tensor, "seq seq"]:
    """Measure which outputs of self-attention move when one input token changes.

    Runs ``scaled_dot_product_attention(x, x, x, mask)`` once as it is, then once per position
    ``j`` with ``x[j]`` changed (1 added to each of its entries). ``changed[i, j]`` is
    ``True`` when output ``i`` differs, in any entry, from the unchanged run: output ``i``
    can see input ``j``. Rows are outputs (queries), columns are the changed inputs (keys).
    """
    seq = x.shape[0]
    base, _ = scaled_dot_product_attention(x, x, x, mask)
    columns = []
    for j in range(seq):
        changed_x = x.clone()
        changed_x[j] += 1.0
        # In self-attention token j is a query, a key and a value at once: change all three.
        out, _ = scaled_dot_product_attention(changed_x, changed_x, changed_x, mask)
        # Exact comparison: a masked key gets weight exactly 0, so an output that cannot see
        # x[j] does not move by even one bit; any difference at all is a leak.
        columns.append(reduce(out != base, "q_len d_model -> q_len", "any"))
    return rearrange(columns, "k_len q_len -> q_len k_len")
