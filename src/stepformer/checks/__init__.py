"""Checks that the exercise notebooks call, one line per graded cell.

Each check takes the student's object, runs it on seeded inputs with pairwise-distinct sizes
(so a swapped axis cannot pass), compares with an oracle, and fails with a message that says
what is probably wrong and where to look. The oracles are PyTorch's own modules and functions
where PyTorch has one, and otherwise the defining formula or property written out in the check
(SwiGLU, the sinusoids, RoPE, greedy decoding, the cache's growth); never the course's reference
code, which the class edition's students do not have.
"""

from stepformer.checks._core import CheckFailure
from stepformer.checks.attention import (
    check_attention_dropout,
    check_attention_entropy,
    check_attention_mask,
    check_attention_shapes,
    check_attention_values,
    check_entropy_measurement,
)

__all__ = [
    "CheckFailure",
    "check_attention_dropout",
    "check_attention_entropy",
    "check_attention_mask",
    "check_attention_shapes",
    "check_attention_values",
    "check_entropy_measurement",
]
