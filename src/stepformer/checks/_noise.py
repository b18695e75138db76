"""Tolerances for the checks that compare a noisy statistic, derived from its measured spread.

A check that compares a mean over random draws, or a share of dropped units, with what it should be must allow
for the noise of correct code, and no more: a tolerance chosen by eye can be wider than the effect of a mistake.
The rule, for every such comparison: a correct solution fails one call of a check by chance with probability
below ``ALPHA`` = 1e-6, all of that check's comparisons together.

- A difference that is (nearly) normal, a mean of many draws minus a fresh reference: the tolerance is ``z`` times
  its standard deviation measured over many seeds, ``z`` the two-sided normal quantile of ALPHA split over the
  check's comparisons (:func:`normal_tolerance`; 5.23 for six of them).
- A count of Bernoulli(p) events among n (a share of units dropped): the exact binomial interval whose two tails
  each hold at most ALPHA / 2 (:func:`binomial_bounds`).

``benchmarks/check_noise.py`` measures the spreads and the effect of each mistake against these tolerances;
the checks state the numbers where they use them.
"""

import math
from statistics import NormalDist

from stepformer.checks._messages import t

ALPHA = 1e-6


def z_for(comparisons: int, alpha: float = ALPHA) -> float:
    """The two-sided normal quantile that ``comparisons`` differences all stay within with probability 1 - alpha."""
    return NormalDist().inv_cdf(1 - alpha / (2 * comparisons))


Z = z_for(1)  # 4.89: one comparison, or a one-sided margin


def normal_tolerance(sd: float, comparisons: int = 1) -> float:
    """The tolerance for a normal difference of standard deviation ``sd``, one of ``comparisons`` in a check."""
    return z_for(comparisons) * sd


def binomial_bounds(n: int, p: float, alpha: float = ALPHA) -> tuple[int, int]:
    """(low, high): a Binomial(n, p) count lies in low ... high except with probability at most ``alpha``
    (each tail at most alpha / 2), the narrowest such interval with equal tail budgets."""
    if not 0 < p < 1:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    log_pmf = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
               + (n - k) * math.log1p(-p) for k in range(n + 1)]
    pmf = [math.exp(v) for v in log_pmf]
    low, tail = 0, 0.0
    while low < n and tail + pmf[low] <= alpha / 2:
        tail += pmf[low]
        low += 1
    high, tail = n, 0.0
    while high > 0 and tail + pmf[high] <= alpha / 2:
        tail += pmf[high]
        high -= 1
    return low, high


def dropped_count_problem(count: int, n: int, p: float, comparisons: int = 2) -> str | None:
    """``None`` if ``count`` units dropped of ``n`` fits dropout with probability ``p`` (the binomial interval of
    :func:`binomial_bounds`, ALPHA shared by a call's ``comparisons``); else the message's end that says why not."""
    low, high = binomial_bounds(n, p, ALPHA / comparisons)
    if low <= count <= high:
        return None
    return t("dropping each with probability {p} drops {low} to {high} of them, but for one time in a million: look "
             "at the p your nn.Dropout gets (dropout, the probability of dropping).", p=p, low=low, high=high)


# The argument check of the measurement exercises (chapters 00 and 01): SPREAD_CALLS calls with samples = 1 at
# different seeds must be single draws, spread like one. benchmarks/check_noise.py ("single draws"): over 20000
# repetitions the ratio (sample sd of the calls) / (single-draw sd) is 0.996 ± 0.091 for correct code (entropy,
# lowest 0.561; top weight 0.995 ± 0.100, lowest 0.490), and 0.123 ± 0.018 for a function that ignores samples (a
# mean of the default 64 draws), highest 0.192: the threshold lies 6.5 (top weight) to 7.1 (entropy) standard
# deviations below the first and 12 above the second.
SPREAD_CALLS = 24
SPREAD_THRESHOLD = 0.35
