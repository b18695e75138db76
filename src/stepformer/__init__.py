"""Transformers, Step by Step: the reference implementation of every component in the course.

Each module is one chapter's finished component (``attention`` is chapter 01, and so on);
``checks`` holds the exercise checks that the notebooks call, ``course`` the tools that build
the student release and grade submissions.
"""

from stepformer.attention import scaled_dot_product_attention
from stepformer.transformer import Transformer, generate

__all__ = ["Transformer", "generate", "scaled_dot_product_attention"]
