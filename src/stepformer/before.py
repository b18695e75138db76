"""Chapter 00: what came before the Transformer. A language model from n-gram counts, embeddings as
one-hot × matrix, a recurrent network, and additive (Bahdanau) attention."""

import math
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from beartype import beartype
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float, Int, jaxtyped
from torch import Tensor, nn


def ngram_counts(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    """How often each n-gram (a run of ``n`` consecutive tokens, as a tuple) occurs in ``tokens``.

    A text of ``T`` tokens holds ``T - n + 1`` n-grams: the last one starts at position ``T - n``.
    """
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def context_counts(counts: Counter[tuple[str, ...]]) -> Counter[tuple[str, ...]]:
    """How often each context (an n-gram without its last token) is followed by a token.

    Summed from the n-gram counts, so that a context's count is the sum of its n-grams' counts:
    the last ``n - 1`` tokens of a text are nobody's context, and are not counted.
    """
    contexts: Counter[tuple[str, ...]] = Counter()
    for gram, count in counts.items():
        contexts[gram[:-1]] += count
    return contexts


def ngram_probability(
    word: str,
    history: Sequence[str],
    counts: Counter[tuple[str, ...]],
    contexts: Counter[tuple[str, ...]],
    *,
    n: int,
    vocab_size: int,
    alpha: float = 1.0,
) -> float:
    """P(word | history) under an n-gram model with add-``alpha`` smoothing.

    Only the last ``n - 1`` tokens of ``history`` count (none for ``n = 1``): that is the context.
    ``counts`` holds the n-gram counts and ``contexts`` the contexts' counts (see
    :func:`context_counts`). With ``C`` the counts,

        P(word | context) = (C(context, word) + alpha) / (C(context) + alpha · vocab_size),

    which sums to 1 over a vocabulary of ``vocab_size`` words, seen or not.
    """
    # history[-(n - 1):] would be the whole history for n = 1, since -0 == 0.
    context = tuple(history[len(history) - (n - 1) :]) if n > 1 else ()
    # Without alpha an n-gram never seen in training gets probability 0, and a text that holds one
    # gets probability 0 however well the rest fits; alpha gives every word a share.
    return (counts[(*context, word)] + alpha) / (contexts[context] + alpha * vocab_size)


@jaxtyped(typechecker=beartype)
def one_hot_embed(
    tokens: Int[Tensor, "*batch seq"], weight: Float[Tensor, "vocab d_model"]
) -> Float[Tensor, "*batch seq d_model"]:
    """Embed token ids as one-hot vectors times a matrix: row ``tokens[..., i]`` of ``weight``.

    ``weight`` is ``(vocab, d_model)``, the layout of ``nn.Embedding.weight``; the result has the
    dtype of ``weight``. It equals ``nn.Embedding`` with that weight, which skips the one-hot
    product and reads the rows directly.
    """
    # num_classes = vocab, not the largest id in this batch plus one: a batch need not hold every word.
    one_hot = F.one_hot(tokens, num_classes=weight.shape[0]).to(weight.dtype)  # (*batch, seq, vocab)
    return einsum(one_hot, weight, "... seq vocab, vocab d_model -> ... seq d_model")


class RNN(nn.Module):
    """An Elman recurrent network: h_t = tanh(W_ih x_t + b_ih + W_hh h_(t-1) + b_hh), with h_(-1) = 0.

    ``w_ih`` maps ``d_in -> d_hidden`` and ``w_hh`` maps ``d_hidden -> d_hidden``, both with a
    bias: the computation of ``torch.nn.RNN`` (one layer, tanh), so its weights copy across.
    """

    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.w_ih = nn.Linear(d_in, d_hidden)
        self.w_hh = nn.Linear(d_hidden, d_hidden)

    @jaxtyped(typechecker=beartype)
    def forward(
        self, x: Float[Tensor, "batch seq d_in"], h: Float[Tensor, "batch d_hidden"] | None = None
    ) -> Float[Tensor, "batch seq d_hidden"]:
        """The hidden state after each position, from the initial state ``h`` (zeros if None)."""
        # The input half of every step is one parallel product over all positions; only the
        # recurrence, which needs the previous state, runs one position after another.
        inputs = self.w_ih(x)  # (batch, seq, d_hidden)
        h = torch.zeros_like(inputs[:, 0]) if h is None else h
        states = []
        for t in range(x.shape[1]):
            h = torch.tanh(inputs[:, t] + self.w_hh(h))
            states.append(h)
        return rearrange(states, "seq batch d_hidden -> batch seq d_hidden")


@jaxtyped(typechecker=beartype)
def masked_softmax(
    scores: Float[Tensor, "*batch q_len k_len"],
    mask: Bool[Tensor, "*#batch #q_len #k_len"] | None = None,
) -> Float[Tensor, "*batch q_len k_len"]:
    """The softmax of each query's scores over the keys it may attend to: every attention's weights.

    ``mask`` is boolean, ``True`` = "this query may attend to this key" (the convention of
    ``torch.nn.functional.scaled_dot_product_attention``), and broadcasts against
    ``(*batch, q_len, k_len)``; ``None`` lets every query attend to every key. A masked key gets
    weight exactly 0 and the kept weights of a row sum to 1. A row with no key left gets all-zero
    weights, where ``softmax`` of ``-inf`` everywhere would give NaN (0 / 0).
    """
    if mask is None:
        return torch.softmax(scores, dim=-1)
    # -inf gives masked keys exactly zero weight. A row with no key left is softmaxed as zeros
    # instead (a finite, ignored result) and then zeroed, so no NaN is ever computed.
    has_key = mask.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~mask, -math.inf).masked_fill(~has_key, 0.0)
    return torch.softmax(scores, dim=-1).masked_fill(~has_key, 0.0)


@jaxtyped(typechecker=beartype)
def additive_attention(
    q: Float[Tensor, "*batch q_len d_q"],
    k: Float[Tensor, "*batch k_len d_k"],
    v: Float[Tensor, "*batch k_len d_v"],
    w_q: Float[Tensor, "d_attn d_q"],
    w_k: Float[Tensor, "d_attn d_k"],
    v_a: Float[Tensor, " d_attn"],
    mask: Bool[Tensor, "*#batch #q_len #k_len"] | None = None,
) -> tuple[Float[Tensor, "*batch q_len d_v"], Float[Tensor, "*batch q_len k_len"]]:
    """Additive attention (Bahdanau et al. 2015): score(q_i, k_j) = v_aᵀ tanh(W_q q_i + W_k k_j).

    The weights are the softmax of the scores over ``k_len``; the output is their weighted sum of
    ``v``. ``w_q`` and ``w_k`` are ``(d_attn, d_in)`` like ``nn.Linear.weight``. Leading axes
    (``*batch``) are carried through. ``mask`` is boolean, ``True`` = "this query may attend to
    this key", and broadcasts against ``(*batch, q_len, k_len)``; a query whose keys are all
    masked gets zero weights and a zero output instead of NaN.

    Returns ``(output, weights)``.
    """
    query = einsum(q, w_q, "... q_len d_q, d_attn d_q -> ... q_len d_attn")
    key = einsum(k, w_k, "... k_len d_k, d_attn d_k -> ... k_len d_attn")
    # Every (query, key) pair gets its own d_attn-wide hidden vector: a small feed-forward
    # network scores each pair, where dot-product attention needs one product per pair.
    hidden = torch.tanh(rearrange(query, "... q_len d_attn -> ... q_len 1 d_attn")
                        + rearrange(key, "... k_len d_attn -> ... 1 k_len d_attn"))  # (..., q_len, k_len, d_attn)
    scores = einsum(hidden, v_a, "... q_len k_len d_attn, d_attn -> ... q_len k_len")
    weights = masked_softmax(scores, mask)
    output = einsum(weights, v, "... q_len k_len, ... k_len d_v -> ... q_len d_v")
    return output, weights


def mean_top_weight(
    d_k: int, *, additive: bool, q_len: int = 16, k_len: int = 16, d_attn: int = 32, samples: int = 64, seed: int = 0
) -> float:
    """How peaked attention is for random unit-variance queries and keys of width ``d_k``: the mean,
    over ``samples`` draws of ``q_len`` queries and ``k_len`` keys, of each query's largest weight.

    ``1 / k_len`` means every query reads all keys equally; 1 means each reads one key only.
    ``additive=False`` scores with unscaled dot products q·k; ``additive=True`` with
    :func:`additive_attention`, with new weights for each sample, drawn so that W_q q, W_k k and the
    score have a size that does not depend on ``d_k``.
    """
    generator = torch.Generator().manual_seed(seed)
    tops = []
    for _ in range(samples):
        q = torch.randn(q_len, d_k, generator=generator, dtype=torch.float64)
        k = torch.randn(k_len, d_k, generator=generator, dtype=torch.float64)
        if additive:
            # Entries of variance 1/d_k give W_q q and W_k k unit variance, the aim of the usual
            # initialisations; v_a's 1/d_attn does the same for the score. One draw per sample:
            # the measurement is about random models, not about one of them.
            w_q = torch.randn(d_attn, d_k, generator=generator, dtype=torch.float64) / math.sqrt(d_k)
            w_k = torch.randn(d_attn, d_k, generator=generator, dtype=torch.float64) / math.sqrt(d_k)
            v_a = torch.randn(d_attn, generator=generator, dtype=torch.float64) / math.sqrt(d_attn)
            _, weights = additive_attention(q, k, k, w_q, w_k, v_a)
        else:
            weights = torch.softmax(einsum(q, k, "q_len d_k, k_len d_k -> q_len k_len"), dim=-1)
        tops.append(reduce(weights, "q_len k_len -> q_len", "max").mean())
    return torch.stack(tops).mean().item()
