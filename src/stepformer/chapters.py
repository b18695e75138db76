"""Which chapter each module of the library belongs to: the library is built in chapter order.

A module of chapter *n* imports only modules of chapters ≤ *n* (``tests/test_layering.py`` parses
every import and enforces it), so the model a chapter prints is built from what the reader has met
so far. A package's modules share its chapter. The checks (``stepformer.checks``) and the course
tools (``stepformer.course``) are not chapters: the checks never import the library, and the tools
sit beside both.
"""

CHAPTER = {
    "before": 0,
    "attention": 1,
    "masks": 2,
    "multihead": 3,
    "ffn": 4,
    "norms": 5,
    "positional": 6,
    "encoder": 7,
    "transformer": 8,
    "kvcache": 9,
    "decoding": 9,
    "gqa": 10,
    "parts": 10,  # the configured parts (GQA, RoPE, fused kernels) above chapters 04-10
    "runs": 11,  # run plumbing: provenance, budgets, checkpoints, the training loop; chapter 12 and benchmarks share it
    "translator": 11,
    "models": 12,
    "huggingface": 12,
    "lm": 12,
    "scale": 13,
}
