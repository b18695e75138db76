"""Checks for chapter 09: the KV-cache, a cached attention step, and the cache's memory formula.

There is no built-in KV-cache to compare with, so the checks test the defining properties: the
cache grows along the sequence axis and refuses what does not continue it; attention computed
step by step from the cache equals one causal pass of ``torch.nn.MultiheadAttention`` (the
oracle, with the same weights) over the whole sequence; each step projects only its new
positions (counted by projections that tally the rows they see); the formula's bytes equal the
bytes of the caches that a decoder, built here from PyTorch's pieces, holds after decoding. Every
touch of the student's code goes through :func:`call`, with the small helpers below.
"""

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from stepformer.checks._core import (
    CheckFailure,
    CodeRaised,
    call,
    check,
    close,
    difference,
    distinct_sizes,
    dtype_name,
    expect_tensor,
    kind,
    one_thread,
    passed,
    raised_error,
)
from stepformer.checks._messages import marked, t, tr
from stepformer.checks._modules import error_of as _error_of

AXES = ("batch", "kv_heads", "d_head", "prefill", "steps")


def _sizes(seed: int) -> dict[str, int]:
    """Pairwise-distinct sizes, so that an append along the wrong axis cannot pass."""
    return distinct_sizes(seed, AXES, span=7, fixed=(2, 3, 4, 5, 6))


# -- helpers that touch the student's cache (each through `call`) --------------------------

def _append(cache: Any, keys: Tensor, values: Tensor) -> Any:
    return cache.append(keys, values)


def _store(cache: Any, keys: Tensor, values: Tensor) -> Any:
    return cache.store(keys, values)


def _length(cache: Any) -> Any:
    return len(cache)


def _contents(cache: Any) -> tuple[Any, Any]:
    keys, values = cache.keys, cache.values
    return (keys.detach().clone() if type(keys) is Tensor else keys,
            values.detach().clone() if type(values) is Tensor else values)


def _nbytes(cache: Any) -> Any:
    return cache.nbytes


def _update(cache: Any, keys: Tensor, values: Tensor) -> Any:
    return cache.update(keys, values)


def _append_error(cache: Any, keys: Tensor, values: Tensor) -> str | None:
    return _error_of(cache.append, keys, values)


def _store_error(cache: Any, keys: Tensor, values: Tensor) -> str | None:
    return _error_of(cache.store, keys, values)


APPEND_AXIS = marked(
    "A cache grows along the sequence axis, dim=-2 of (batch, kv_heads, cached, d_head): "
    "torch.cat([self.keys, keys], dim=-2), and the same for the values."
)


def _axis_names() -> dict[int, str]:
    """The axes of (batch, kv_heads, cached, d_head) that are not the sequence's, by dim, as the hints name them."""
    return {0: t("batch (dim=0)"), 1: t("heads (dim=1)"), -1: t("features (d_head, dim=-1)")}


def _appended_along(axis: str) -> str:
    return t("You appended along the {axis} axis, not along the sequence. {how}", axis=axis, how=tr(APPEND_AXIS))


def _wrong_axis(got: Tensor, cached: Tensor, new: Tensor) -> str:
    """Name the axis along which ``got`` glued ``cached`` and ``new`` together, if it did."""
    for dim in (1, -1, 0):
        try:
            glued = torch.cat([cached, new], dim=dim)
        except RuntimeError:  # the shapes do not fit along this axis
            continue
        if got.shape == glued.shape and torch.equal(got, glued):
            return _appended_along(_axis_names()[dim])
    return tr(APPEND_AXIS)


def _axis_in_error(raised: str) -> str:
    """torch.cat names the axis it was asked to glue along when the other axes do not fit: name it too
    (``raised``: what the student's code raised, see :func:`_raised`)."""
    found = re.search(r"except in dimension (-?\d+)", raised)
    dims = {"0": 0, "1": 1, "3": -1, "-1": -1}
    if found and found.group(1) in dims:
        return _appended_along(_axis_names()[dims[found.group(1)]])
    return tr(APPEND_AXIS)


def _raised(failure: CheckFailure) -> str:
    """``"TypeError: ..."``: what the student's code raised, where ``failure`` reports it (else ""). Its text is
    PyTorch's or the student's, the same in either language of the checks: the only text a hint may read."""
    return failure.raised if isinstance(failure, CodeRaised) else ""


def _is_empty(cache: Any) -> bool:
    """Whether the cache holds None for its keys and values (what an empty cache should hold)."""
    try:
        stored = call(_contents, cache)
    except CheckFailure:  # no keys or values attribute at all
        return False
    return all(tensor is None for tensor in stored)


def _sentence(message: str, hint: str, raised: bool = False) -> str:
    """``hint`` as a sentence of its own after ``message`` (an error's text often ends without a full stop).
    ``raised``: the message ends with the text of what the student's code raised (a :class:`CodeRaised`)."""
    if not hint:
        return message
    if message.rstrip().endswith((".", "!", "?")):
        return t("{message} {hint}", message=message, hint=hint.strip())
    if not raised and message.rstrip().endswith(("。", "！", "？")):  # a message of the checks' own, in Chinese
        return message + hint.strip()
    return t("{message}. {hint}", message=message, hint=hint.strip())


def _empty_cache_hint(raised: str, cache: Any, what: str) -> str:
    """Name a failure on an empty cache that comes from using its None keys or values as tensors, when the error
    (``raised``: what the student's code raised, see :func:`_raised`) says so (an attribute of None, or None handed
    to torch.cat) and the cache does hold None."""
    attribute = re.search(r"'NoneType' object has no attribute '(\w+)'", raised)
    concatenated = re.search(r"expected Tensor as element \d+ in argument \d+, but got NoneType", raised)
    if not attribute and not concatenated:
        return ""
    try:
        stored = call(_contents, cache)
    except CheckFailure:  # no keys or values attribute: nothing to say about them
        return ""
    if type(stored[0]) is Tensor and stored[1] is None:
        return t(" After the failed {what} self.keys holds a tensor and self.values is still None: the values were "
                 "used as a tensor while the cache was empty (store the new values as they are while self.values is "
                 "None, else concatenate).", what=what)
    if not all(tensor is None for tensor in stored):
        return ""
    if attribute:
        return t(" The cache is empty, so self.keys and self.values are None (as they should be), and your {what} "
                 "reads .{attribute} of one of them: when self.keys is None there is nothing to measure or "
                 "compare (an empty cache has length 0 and nbytes 0, and its first append stores the keys and values "
                 "as they are).", what=what, attribute=attribute.group(1))
    return t(" The cache is empty, so self.keys and self.values are None (as they should be), and your {what} "
             "handed None to torch.cat: while self.keys is None, store the new keys and values as they are; "
             "concatenate only once the cache holds tensors.", what=what)


def _empty_length_hint(got: Any, cache: Any, what: str = "__len__") -> str:
    """A count of 1 for an empty cache whose keys and values are None, as they should be."""
    if got != 1 or type(got) is not int or not _is_empty(cache):
        return ""
    return t(" Your {what} gives 1, one too many, for a cache whose keys and values are None (as they should be): "
             "a cache with no keys holds 0 positions and 0 bytes.", what=what)


# -- exercise 1: the cache -----------------------------------------------------------------

@check
def check_kv_cache_append(cls: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """append grows the cache along the sequence axis and returns every cached position; len counts them."""
    s = _sizes(seed)
    b, kv, d_head = s["batch"], s["kv_heads"], s["d_head"]
    g = torch.Generator().manual_seed(seed + 1)
    cache = call(cls)
    try:
        length = call(_length, cache)
    except CheckFailure as failure:
        raise CheckFailure(_sentence(str(failure), _empty_cache_hint(_raised(failure), cache, "__len__"),
                                     raised=bool(_raised(failure)))) from None
    if length != 0:
        raise CheckFailure(t("A new KVCache() should hold no position: len(cache) should be 0 (keys and values None), "
                             "got {length!r}.{hint}", length=length, hint=_empty_length_hint(length, cache)))
    all_keys = torch.randn(b, kv, s["prefill"] + s["steps"] + 2, d_head, generator=g, dtype=dtype)
    all_values = torch.randn(b, kv, s["prefill"] + s["steps"] + 2, d_head, generator=g, dtype=dtype)
    # The prefill's positions at once, then one per step, then two at once.
    chunks = [s["prefill"], *([1] * s["steps"]), 2]
    total = 0
    for new in chunks:
        keys, values = all_keys[:, :, total:total + new], all_values[:, :, total:total + new]
        previous = (all_keys[:, :, :total], all_values[:, :, :total])
        try:
            returned = call(_append, cache, keys, values)
        except CheckFailure as failure:
            if total == 0:
                raise CheckFailure(_sentence(str(failure), _empty_cache_hint(_raised(failure), cache, "append"),
                                             raised=bool(_raised(failure)))) from None
            if raised_error(failure) == "ValueError":
                # These keys continue the cache by construction: the check that refused them is too eager.
                raise CheckFailure(t(
                    "Appending {new} position(s) to a cache of {total} failed. {failure} These keys continue the "
                    "cache: batch, kv_heads and d_head are those of the cached keys, only the sequence axis is "
                    "new. Your append refused them: raise the ValueError only when keys.shape[:2] or keys.shape[-1] "
                    "is not that of self.keys.", new=new, total=total, failure=failure)) from None
            hint = _axis_in_error(_raised(failure))
            raise CheckFailure(t("Appending {new} position(s) to a cache of {total} failed. {failure} {hint}",
                                 new=new, total=total, failure=failure, hint=hint)) from None
        if type(returned) is not tuple or len(returned) != 2:
            raise CheckFailure(t("append should return the tuple (keys, values) of every cached position, got "
                                 "{kind}.", kind=kind(returned)))
        total += new
        for name, got, before, added, expected in ((t("keys"), returned[0], previous[0], keys,
                                                    all_keys[:, :, :total]),
                                                   (t("values"), returned[1], previous[1], values,
                                                    all_values[:, :, :total])):
            if type(got) is not Tensor:
                raise CheckFailure(t("append should return tensors, got {kind} for the {name}.", kind=kind(got),
                                     name=name))
            if tuple(got.shape) != tuple(expected.shape) or not torch.equal(got, expected):
                hint = _wrong_axis(got, before, added) if total > new else t(
                    "The first append should return the keys and values it was given.")
                fields = dict(before=total - new, new=new, name=name, b=b, kv=kv, total=total, d_head=d_head,
                              shape=tuple(got.shape), hint=hint)
                if tuple(got.shape) != tuple(expected.shape):
                    raise CheckFailure(t(
                        "After appending {before} and then {new} position(s), append should return the {name} of "
                        "shape (batch={b}, kv_heads={kv}, cached={total}, d_head={d_head}) in order; it returned "
                        "{shape}. {hint}", **fields))
                raise CheckFailure(t(
                    "After appending {before} and then {new} position(s), append should return the {name} of "
                    "shape (batch={b}, kv_heads={kv}, cached={total}, d_head={d_head}) in order; it returned "
                    "{shape} with other values. {hint}", **fields))
        length = call(_length, cache)
        if length != total:
            raise CheckFailure(t("After {total} appended positions len(cache) is {length}: __len__ should count the "
                                 "positions, the size of the sequence axis (dim=-2), not of another axis.",
                                 total=total, length=length))
    stored = call(_contents, cache)
    if not all(type(tensor) is Tensor for tensor in stored) or not (
            torch.equal(stored[0], all_keys[:, :, :total]) and torch.equal(stored[1], all_values[:, :, :total])):
        raise CheckFailure(t("After the appends, cache.keys and cache.values should hold every position so far (keep "
                             "the concatenated tensors in self.keys and self.values)."))
    for what, keys in ((f"batch={b + 1}", torch.randn(b + 1, kv, 1, d_head, generator=g, dtype=dtype)),
                       (f"kv_heads={kv + 1}", torch.randn(b, kv + 1, 1, d_head, generator=g, dtype=dtype)),
                       (f"d_head={d_head + 1}", torch.randn(b, kv, 1, d_head + 1, generator=g, dtype=dtype))):
        error = call(_append_error, cache, keys, keys.clone())
        fields = dict(what=what, b=b, kv=kv, total=total, d_head=d_head, error=error)
        if error is None:
            raise CheckFailure(t(
                "Appending keys with {what} to a cache of (batch={b}, kv_heads={kv}, cached={total}, "
                "d_head={d_head}) should raise a ValueError (they do not continue the cached positions); it raised "
                "no error. Compare batch, kv_heads and d_head with the cached keys before concatenating.", **fields))
        if error != "ValueError":
            raise CheckFailure(t(
                "Appending keys with {what} to a cache of (batch={b}, kv_heads={kv}, cached={total}, "
                "d_head={d_head}) should raise a ValueError (they do not continue the cached positions); it raised "
                "a {error}. Compare batch, kv_heads and d_head with the cached keys before concatenating.", **fields))
    passed(t("append grows the cache along the sequence axis (prefill of {prefill}, then single positions, then "
             "two), returns every cached position, and refuses keys that do not continue it ({dtype})",
             prefill=s["prefill"], dtype=dtype_name(dtype)))


@check
def check_kv_cache_fixed(cls: Callable[..., Any], seed: int = 0) -> None:
    """A fixed cache is stored once and refuses append; a growing one refuses store; nbytes counts both tensors."""
    s = _sizes(seed)
    b, kv, d_head = s["batch"], s["kv_heads"], s["d_head"]
    g = torch.Generator().manual_seed(seed + 2)
    src_len = s["prefill"] + s["steps"]
    keys, values = (torch.randn(b, kv, src_len, d_head, generator=g) for _ in range(2))
    fixed = call(cls, fixed=True)
    call(_store, fixed, keys, values)
    stored = call(_contents, fixed)
    if not all(type(tensor) is Tensor for tensor in stored) or not (torch.equal(stored[0], keys)
                                                                     and torch.equal(stored[1], values)):
        raise CheckFailure(t("After store(keys, values) a fixed cache should hold exactly those keys and values in "
                             "self.keys and self.values."))
    if call(_length, fixed) != src_len:
        raise CheckFailure(t("A fixed cache storing {length} positions should have len {length}.", length=src_len))
    error = call(_append_error, fixed, keys[:, :, :1], values[:, :, :1])
    if error is None:
        raise CheckFailure(t(
            "A fixed (cross-attention) cache holds the encoder's memory, which does not grow: append should raise a "
            "ValueError on it; it raised no error. Check self.fixed at the start of append."))
    if error != "ValueError":
        raise CheckFailure(t(
            "A fixed (cross-attention) cache holds the encoder's memory, which does not grow: append should raise a "
            "ValueError on it; it raised a {error}. Check self.fixed at the start of append.", error=error))
    error = call(_store_error, call(cls), keys, values)
    if error is None:
        raise CheckFailure(t("store on a growing (self-attention) cache should raise a ValueError; it raised no "
                             "error."))
    if error != "ValueError":
        raise CheckFailure(t("store on a growing (self-attention) cache should raise a ValueError; it raised a "
                             "{error}.", error=error))
    _check_update(cls, keys, values)
    # nbytes: 0 when empty; keys and values both counted, whatever the dtype.
    empty = call(cls)
    try:
        nbytes = call(_nbytes, empty)
    except CheckFailure as failure:
        raise CheckFailure(_sentence(str(failure), _empty_cache_hint(_raised(failure), empty, "nbytes"),
                                     raised=bool(_raised(failure)))) from None
    if nbytes != 0:
        raise CheckFailure(t("An empty cache holds no tensor: its nbytes should be 0, got {nbytes!r}.{hint}",
                             nbytes=nbytes, hint=_empty_length_hint(nbytes, empty, "nbytes")))
    for dtype in (torch.float32, torch.float64):
        growing = call(cls)
        k = torch.randn(b, kv, s["prefill"], d_head, generator=g, dtype=dtype)
        call(_append, growing, k, k.clone())
        got = call(_nbytes, growing)
        expected = 2 * k.numel() * k.element_size()
        if type(got) is not int or got != expected:
            if got == expected // 2:
                hint = t("That is half: count the values as well as the keys.")
            elif got == 2 * k.numel():
                hint = t("That counts numbers, not bytes: multiply by element_size() (4 for float32, 8 for float64).")
            else:
                hint = t("Add keys.numel() * keys.element_size() and the same for the values, as a Python int.")
            raise CheckFailure(t("A cache of {shape} keys and values in {dtype} holds {expected:,} bytes; nbytes gave "
                                 "{got!r}. {hint}", shape=tuple(k.shape), dtype=dtype_name(dtype), expected=expected,
                                 got=got, hint=hint))
    passed(t("a fixed cache stores its keys and values once and refuses append; a growing one refuses store; update "
             "appends to a growing cache and stores once in a fixed one; nbytes counts the bytes of the keys and the "
             "values"))


def _same(got: Any, keys: Tensor, values: Tensor) -> bool:
    return (type(got) is tuple and len(got) == 2 and all(type(t) is Tensor for t in got)
            and got[0].shape == keys.shape and torch.equal(got[0], keys) and torch.equal(got[1], values))


def _twice(cache: Any, method: str, first: tuple[Tensor, Tensor], later: tuple[Tensor, Tensor]) -> dict[str, Any]:
    """``cache.<method>(*first)`` then ``cache.<method>(*later)``: what the second call returned, or its error."""
    try:
        getattr(cache, method)(*first)
        got = getattr(cache, method)(*later)
    except Exception as error:
        return {"got": None, "error": f"{type(error).__name__}: {error}"}
    if type(got) is tuple:
        got = tuple(t.detach().clone() if type(t) is Tensor else kind(t) for t in got)
    return {"got": got if type(got) is tuple else kind(got), "error": ""}


def _agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["error"] or b["error"]:
        return a["error"] == b["error"]
    x, y = a["got"], b["got"]
    return (type(x) is tuple and type(y) is tuple and len(x) == len(y)
            and all(type(s) is Tensor and type(t) is Tensor and s.shape == t.shape and torch.equal(s, t)
                    for s, t in zip(x, y, strict=True)))


def _check_update(cls: Callable[..., Any], keys: Tensor, values: Tensor) -> None:
    """update(k, v), what an attention layer calls: a growing cache does what append does (so a mistake in append
    costs the append check only); a fixed one stores at its first call and returns the stored keys and values ever
    after."""
    first, later = (keys[:, :, :2], values[:, :, :2]), (keys[:, :, 2:], values[:, :, 2:])
    by_update = call(_twice, call(cls), "update", first, later)
    by_append = call(_twice, call(cls), "append", first, later)
    if not (_agree(by_update, by_append) or _same(by_update["got"], keys, values)):
        got = by_update["error"] or kind(by_update["got"])
        if not by_update["error"] and _same(by_update["got"], *later):
            got = t("only the 2nd call's keys and values: return every cached position (self.keys, self.values)")
        raise CheckFailure(t("update on a growing cache, called with 2 positions and then {later}, should do what "
                             "append does and return the keys and values of all {total}, in order; it gave {got}.",
                             later=keys.shape[2] - 2, total=keys.shape[2], got=got))
    fixed = call(cls, fixed=True)
    got = call(_update, fixed, keys, values)
    if not _same(got, keys, values):
        raise CheckFailure(t("update on an empty fixed cache should store the keys and values it is given (store) "
                             "and return them; it returned {kind}.", kind=kind(got)))
    again = call(_update, fixed, *later)
    if not _same(again, keys, values):
        stored = call(_contents, fixed)
        if _same(tuple(stored), *later):
            raise CheckFailure(t("A fixed cache's second update should return the keys and values stored at the first "
                                 "(the encoder's memory does not change), whatever it is given; it returned others, "
                                 "and the cache now holds them."))
        raise CheckFailure(t("A fixed cache's second update should return the keys and values stored at the first "
                             "(the encoder's memory does not change), whatever it is given; it returned others, "
                             "though the cache kept the first."))


# -- exercise 2: one cached attention step ---------------------------------------------------

class _CountingLinear(nn.Linear):
    """An nn.Linear that tallies how many positions (rows) it has projected."""

    rows = 0

    def forward(self, x: Tensor) -> Tensor:
        self.rows += x.shape[:-1].numel()
        return super().forward(x)


class _Attention(nn.Module):
    """Chapter 03's attributes (heads, w_q, w_k, w_v, w_o) with counting projections and given weights."""

    def __init__(self, oracle: nn.MultiheadAttention, heads: int) -> None:
        super().__init__()
        d_model, dtype = oracle.embed_dim, oracle.in_proj_weight.dtype
        self.heads = heads
        self.w_q, self.w_k, self.w_v, self.w_o = (_CountingLinear(d_model, d_model, dtype=dtype) for _ in range(4))
        self.dropout = nn.Dropout(0.0)
        weights = rearrange(oracle.in_proj_weight.detach(), "(qkv d_out) d_in -> qkv d_out d_in", qkv=3)
        biases = rearrange(oracle.in_proj_bias.detach(), "(qkv d_out) -> qkv d_out", qkv=3)
        with torch.no_grad():
            for i, linear in enumerate((self.w_q, self.w_k, self.w_v)):
                linear.weight.copy_(weights[i])
                linear.bias.copy_(biases[i])
            self.w_o.weight.copy_(oracle.out_proj.weight)
            self.w_o.bias.copy_(oracle.out_proj.bias)
        self.eval()


def _take_rows(module: nn.Module) -> dict[str, int]:
    """The rows each projection has seen since the last reading."""
    rows = {}
    for name in ("w_q", "w_k", "w_v"):
        linear = getattr(module, name)
        rows[name], linear.rows = linear.rows, 0
    return rows


def _attention_setup(s: dict[str, int], dtype: torch.dtype, seed: int) -> tuple[nn.MultiheadAttention, _Attention,
                                                                                  Tensor, Tensor]:
    """PyTorch's attention with seeded weights (biases too), the same weights in a counting module, the
    inputs and the oracle's causal self-attention over all of them."""
    heads, d_head = s["kv_heads"], s["d_head"]
    d_model = heads * d_head
    g = torch.Generator().manual_seed(seed + 11)
    # PyTorch's initialisation would move the student's RNG: the modules are built on a forked one.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        oracle = nn.MultiheadAttention(d_model, heads, batch_first=True, dtype=dtype).eval()
        for param in (oracle.in_proj_weight, oracle.out_proj.weight):
            param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) / math.sqrt(d_model))
        for param in (oracle.in_proj_bias, oracle.out_proj.bias):
            param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) * 0.5)
        module = _Attention(oracle, heads)
        length = s["prefill"] + s["steps"] + 2
        x = torch.randn(s["batch"], length, d_model, generator=g, dtype=dtype)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        expected = oracle(x, x, x, attn_mask=~causal, need_weights=False)[0]  # PyTorch's True = "ignore"
    return oracle, module, x, expected


def _schedule(s: dict[str, int]) -> list[int]:
    """The lengths of x at each call: the prefill, then one more position per step, then two more."""
    lengths = [s["prefill"] + t for t in range(s["steps"] + 1)]
    return [*lengths, lengths[-1] + 2]


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1).nan_to_num() @ v


def _step_variants(module: _Attention, x: Tensor, cached: int) -> dict[str, Tensor]:
    """What the usual mistakes give for the new positions x[:, cached:], to name them."""
    heads = module.heads

    def split(t: Tensor) -> Tensor:
        return rearrange(t, "batch seq (heads d_head) -> batch heads seq d_head", heads=heads)

    def out(heads_out: Tensor) -> Tensor:
        return torch.nn.functional.linear(rearrange(heads_out, "batch heads seq d_head -> batch seq (heads d_head)"),
                                          module.w_o.weight, module.w_o.bias)

    with torch.no_grad():
        q = split(torch.nn.functional.linear(x[:, cached:], module.w_q.weight, module.w_q.bias))
        k = split(torch.nn.functional.linear(x, module.w_k.weight, module.w_k.bias))
        v = split(torch.nn.functional.linear(x, module.w_v.weight, module.w_v.bias))
        new, total = x.shape[1] - cached, x.shape[1]
        first_rows = torch.ones(total, total, dtype=torch.bool).tril()[:new]
        upper_left = torch.ones(new, new, dtype=torch.bool).tril()
        return {
            "first rows": out(_attend(q, k, v, first_rows)),
            "no mask": out(_attend(q, k, v, None)),
            "new keys only": out(_attend(q, k[:, :, cached:], v[:, :, cached:], upper_left)),
            "new keys only, no mask": out(_attend(q, k[:, :, cached:], v[:, :, cached:], None)),
            "no w_o": rearrange(_attend(q, k, v, torch.ones(total, total, dtype=torch.bool).tril()[cached:]),
                                "batch heads seq d_head -> batch seq (heads d_head)"),
        }


STEP_HINTS = {  # mistake -> hint, shown with tr()
    "first rows": marked("Your mask hides the cached keys from the new queries: it is the *first* `new` rows of the "
                         "causal mask (a triangle aligned to the first key, as torch.ones(new, total).tril() gives). "
                         "The new queries are the last `new` positions: align the triangle to the last key, "
                         ".tril(diagonal=total - new), so that new query i reads keys 0 ... cached + i."),
    "no mask": marked("Your output ignores the causal mask: the new positions of one call must not read each other's "
                      "future (a (new, total) mask, True on and below the diagonal aligned to the last key)."),
    "new keys only": marked("Your new queries read only the new keys: attend over every key and value the cache "
                            "returns (what cache.append gives back), not only the ones you just projected."),
    "new keys only, no mask": marked("Your new queries read only the new keys, without a mask: attend over every key "
                                     "and value the cache returns, under the causal mask."),
    "no w_o": marked("You return the concatenated heads without the output projection: apply attention.w_o."),
}


def _step_error_hint(raised: str) -> str:
    """What an error raised inside the step (``raised``: see :func:`_raised`) says for itself: tril refuses a tensor
    of fewer than two axes."""
    if "tril: input tensor must have at least 2 dimensions" in raised:
        return t("The tensor your step passed to tril has fewer than two axes: the causal mask is (new, total), "
                 "torch.ones(new, total, dtype=torch.bool).tril(diagonal=total - new), both sizes passed.")
    return ""


def _heads_for_positions(fn: Callable[..., Any], cache_cls: Callable[..., Any], s: dict[str, int],
                         dtype: torch.dtype, seed: int) -> str:
    """A prefill that fails on these sizes but is right when it has as many positions as heads: a size taken
    from the heads axis where the sequence's is meant (the two coincide there)."""
    square = {**s, "prefill": s["kv_heads"]}
    _, module, x, expected = _attention_setup(square, dtype, seed + 7)
    heads = square["kv_heads"]
    try:
        got = call(fn, module, x[:, :heads], call(cache_cls))
    except CheckFailure:
        return ""
    if type(got) is not Tensor or not close(got, expected[:, :heads], dtype):
        return ""
    return t("With a prefill of {heads} positions, as many as heads, your step gives the right output, and with "
             "{prefill} it does not: a size that your step uses for the positions (new or total, for the mask "
             "say) is read from the heads axis, dim=-3 of q or k (batch, heads, seq, d_head), not from the sequence "
             "axis, dim=-2.", heads=heads, prefill=s["prefill"])


@check
def check_cached_attention(functions: tuple[Callable[..., Any], Callable[..., Any]], seed: int = 0,
                           dtype: torch.dtype = torch.float32) -> None:
    """A prefill, then one position at a time, then two: equal to one causal pass of torch.nn.MultiheadAttention.

    ``functions`` is ``(cached_self_attention, KVCache)``: the student's step and the cache class
    its signature names (both the student's objects, so they travel together).
    """
    fn, cache_cls = functions
    s = _sizes(seed)
    _, module, x, expected = _attention_setup(s, dtype, seed)
    b, d_model = s["batch"], x.shape[-1]
    cache = call(cache_cls)
    cached = 0
    for length in _schedule(s):
        new = length - cached
        if cached == 0:
            what = t("the prefill (empty cache, {new} new)", new=new)
        else:
            what = t("a step with {cached} cached positions ({new} new)", cached=cached, new=new)
        try:
            got = call(fn, module, x[:, :length], cache)
        except CheckFailure as failure:
            hint = _step_error_hint(_raised(failure))
            if not hint and cached == 0:
                hint = _heads_for_positions(fn, cache_cls, s, dtype, seed)
            raise CheckFailure(_sentence(t("{failure} (during {what}; if the error comes from cache.append, your "
                                           "KVCache of exercise 1 needs fixing first)", failure=failure, what=what),
                                         hint)) from None
        if type(got) is Tensor and got.dim() == 3 and got.shape[::2] == (b, d_model) and got.shape[1] != new:
            held = call(_length, cache)
            raise CheckFailure(t(
                "For {what} your step returned {returned} positions, and len(cache) is {held} after it "
                "(it was {cached}). The new positions are the {new} of x after the {cached} cached ones: "
                "x[:, len(cache):], taken before appending; return one output row for each of them.", what=what,
                returned=got.shape[1], held=held, cached=cached, new=new))
        got = expect_tensor(got, t("the output for {what}", what=what), (b, new, d_model), "batch new d_model", dtype)
        want = expected[:, cached:length]
        if not close(got, want, dtype):
            variants = _step_variants(module, x[:, :length], cached)
            hint = next((tr(STEP_HINTS[name]) for name, value in variants.items() if close(got, value, dtype)),
                        (cached == 0 and _heads_for_positions(fn, cache_cls, s, dtype, seed)) or
                        t("Project x[:, len(cache):] with w_q, w_k and w_v, split the heads, append k and v to the "
                          "cache, attend with the keys and values it returns under a (new, total) causal mask "
                          "aligned to the last key, merge the heads and apply w_o."))
            sizes = dict(batch=b, heads=module.heads, d_model=d_model, cached=cached, new=new)
            raise CheckFailure(t(
                "For {what}, your output differs from the same positions of one causal pass of "
                "torch.nn.MultiheadAttention over the whole sequence ({difference}). {hint}", what=what,
                difference=difference(got, want, sizes), hint=hint))
        cached = length
    keys, values = call(_contents, cache)
    heads, d_head = module.heads, d_model // module.heads
    for name, tensor in ((t("keys"), keys), (t("values"), values)):
        if type(tensor) is not Tensor or tuple(tensor.shape) != (b, heads, cached, d_head):
            shape = tuple(tensor.shape) if type(tensor) is Tensor else kind(tensor)
            raise CheckFailure(t(
                "After decoding {cached} positions the cache's {name} should have shape (batch={b}, heads={heads}, "
                "cached={cached}, d_head={d_head}), got {shape}: append each call's new keys and values (split into "
                "heads) once.", cached=cached, name=name, b=b, heads=heads, d_head=d_head, shape=shape))
    passed(t("prefill of {prefill}, {steps} single steps and a step of two equal one causal pass of "
             "torch.nn.MultiheadAttention; the cache holds every position once ({dtype})", prefill=s["prefill"],
             steps=s["steps"], dtype=dtype_name(dtype)))


@check
def check_projects_new_only(functions: tuple[Callable[..., Any], Callable[..., Any]], seed: int = 0) -> None:
    """Each call projects only its new positions: the rows through w_q, w_k and w_v do not grow with the prefix."""
    fn, cache_cls = functions
    s = _sizes(seed)
    _, module, x, _ = _attention_setup(s, torch.float32, seed + 50)
    b = s["batch"]
    cache = call(cache_cls)
    cached = 0
    for length in _schedule(s):
        new = length - cached
        call(fn, module, x[:, :length], cache)
        rows = call(_take_rows, module)
        for name in ("w_k", "w_v", "w_q"):
            if rows.get(name) == b * new:
                continue
            if rows.get(name) == b * length:
                raise CheckFailure(t(
                    "With {cached} cached positions and {new} new, {name} projected all {length} positions of each "
                    "sequence ({rows} rows for a batch of {batch}): your step re-projects the whole prefix every "
                    "time, so its cost grows with the length, which is what the cache is there to avoid. The "
                    "values may be right, but project only the new positions, x[:, len(cache):], and take the "
                    "earlier keys and values from the cache.", cached=cached, new=new, name=name, length=length,
                    rows=rows[name], batch=b))
            raise CheckFailure(t("With {cached} cached positions and {new} new, {name} projected {rows} rows "
                                 "for a batch of {batch}; it should project the {new} new position(s) of each sequence "
                                 "once: {expected} rows.", cached=cached, new=new, name=name, rows=rows.get(name),
                                 batch=b, expected=b * new))
        cached = length
    passed(t("every call projects only its new positions ({prefill} for the prefill, then 1 per step, then 2): "
             "the prefix is never projected again", prefill=s["prefill"]))


# -- exercise 3: predict, then measure -------------------------------------------------------

def _measured_cache_bytes(layers: int, heads: int, kv_heads: int, d_head: int, length: int, batch: int,
                          dtype: torch.dtype, seed: int) -> int:
    """Decode ``length`` tokens with a small decoder built here from PyTorch's pieces; its caches' bytes.

    Each layer projects only the newest token's key and value, appends them to the tensors it keeps, and
    attends over all of them with PyTorch's fused attention (grouped when ``kv_heads < heads``); the
    cross-attention and the feed-forward do not hold a cache, so they are left out.
    """
    with one_thread(), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        vocab, d_model = 11, heads * d_head
        embed = nn.Embedding(vocab, d_model).to(dtype)
        w_q, w_k, w_v, w_o = (
            nn.ModuleList(nn.Linear(d_model, n * d_head).to(dtype) for _ in range(layers))
            for n in (heads, kv_heads, kv_heads, heads))
        generator = nn.Linear(d_model, vocab).to(dtype)
        keys: list[Tensor | None] = [None] * layers
        values: list[Tensor | None] = [None] * layers
        tokens = torch.ones(batch, 1, dtype=torch.long)
        for _ in range(length):
            x = embed(tokens)
            for i in range(layers):
                q = rearrange(w_q[i](x), "batch new (heads d_head) -> batch heads new d_head", d_head=d_head)
                k, v = (rearrange(w(x), "batch new (kv_heads d_head) -> batch kv_heads new d_head", d_head=d_head)
                        for w in (w_k[i], w_v[i]))
                keys[i] = k if keys[i] is None else torch.cat([keys[i], k], dim=2)
                values[i] = v if values[i] is None else torch.cat([values[i], v], dim=2)
                attended = nn.functional.scaled_dot_product_attention(q, keys[i], values[i],
                                                                      enable_gqa=kv_heads != heads)
                x = x + w_o[i](rearrange(attended, "batch heads new d_head -> batch new (heads d_head)"))
            tokens = generator(x[:, -1]).argmax(-1, keepdim=True)
    return sum(k.nbytes + v.nbytes for k, v in zip(keys, values, strict=True))


FORMULA_MISTAKES = [  # (hint, shown with tr(); what the mistaken formula gives, from the right one and the case)
    (marked("That is half: the factor 2 counts the keys *and* the values."), lambda right, c: right // 2),
    (marked("That is one sequence's cache: every sequence of the batch keeps its own, so multiply by batch."),
     lambda right, c: right // c["batch"]),
    (marked("That is one layer's cache: every decoder layer keeps its own, so multiply by layers."),
     lambda right, c: right // c["layers"]),
    (marked("Count bytes, not bits: bytes_per_element is already in bytes (4 for float32)."),
     lambda right, c: right * 8),
    (marked("That counts numbers, not bytes: multiply by bytes_per_element."),
     lambda right, c: right // c["bytes_per_element"]),
]


def _divided_by(results: list[tuple[Any, ...]]) -> list[str]:
    """The sizes that the formula divides by instead of multiplying: for each such size, ``a / size`` gives
    ``measured / size**2`` in every case."""
    if not all(type(got) in (int, float) for _, _, _, got, _ in results):
        return []
    return [name for name in ("layers", "kv_heads", "d_head", "length", "batch", "bytes_per_element")
            if all(math.isclose(got, measured / case[name] ** 2, rel_tol=1e-9)
                   for case, _, _, got, measured in results)]


def _not_int_message(results: list[tuple[Any, ...]], got: str) -> str:
    """A formula gave ``got`` (a kind), not an int; why: a size it divides by (when one alone explains every case),
    or only the type."""
    divided = _divided_by(results)
    if len(divided) == 1:
        case, _, _, value, measured = results[0]
        return t("cache_bytes should return a Python int (a number of bytes), got {got} ({value:g} for {case}, where "
                 "the caches hold {measured:,} bytes, which is {size}² = {square} times more). Your formula divides "
                 "by {size} where it should multiply: every size is a factor, 2 * layers * kv_heads * d_head * "
                 "length * batch * bytes_per_element.", got=got, value=value, case=case, measured=measured,
                 size=divided[0], square=case[divided[0]] ** 2)
    if all(type(value) is float and value == measured for _, _, _, value, measured in results):
        return t("cache_bytes should return a Python int (a number of bytes), got {got}: its values equal the bytes "
                 "measured; return an int (multiply ints, or int(...) at the end).", got=got)
    return t("cache_bytes should return a Python int (a number of bytes), got {got}.", got=got)


@check
def check_cache_formula(fn: Callable[..., Any], seed: int = 0) -> None:
    """The formula's bytes equal those of the self-attention caches of a decoder after decoding."""
    s = _sizes(seed)
    kv, d_head = s["kv_heads"], s["d_head"]
    # Layers and batch sizes that differ from each other and from 2, so that each missing factor shows.
    layers = 3 if s["batch"] != 3 else 4
    cases = [  # (layers, heads, kv_heads, d_head, length, batch, dtype)
        (layers, kv, kv, d_head, s["steps"], s["batch"] + (s["batch"] == 2) * 3, torch.float32),
        (layers + 2, 2 * kv, kv, d_head, s["prefill"], 3 if layers != 3 else 4, torch.float32),
        (1, kv, 1, d_head, s["steps"] + 1, 1, torch.float64),
        (layers, kv, kv, d_head, s["prefill"], 5 if layers != 5 else 6, torch.bfloat16),
    ]
    results = []
    for i, (n_layers, heads, kv_heads, d_head_, length, batch, dtype) in enumerate(cases):
        element = torch.empty((), dtype=dtype).element_size()
        case = dict(layers=n_layers, kv_heads=kv_heads, d_head=d_head_, length=length, batch=batch,
                    bytes_per_element=element)
        got = call(fn, n_layers, kv_heads, d_head_, length, batch, element)
        measured = _measured_cache_bytes(n_layers, heads, kv_heads, d_head_, length, batch, dtype, seed + i)
        results.append((case, heads, dtype, got, measured))
    not_int = next((r for r in results if type(r[3]) is not int), None)
    if not_int is not None:
        raise CheckFailure(_not_int_message(results, kind(not_int[3])))
    wrong = [r for r in results if r[3] != r[4]]
    if not wrong:
        passed(t("the formula 2 · layers · kv_heads · d_head · length · batch · bytes per element equals the "
                 "measured bytes of the caches (float32, float64, bfloat16; MHA, GQA, MQA)"))
        return
    # The mistake that explains every case, not only the first (a batch of 2 alone looks like a missing 2).
    hint = next((tr(h) for h, mistaken in FORMULA_MISTAKES if all(got == mistaken(measured, case)
                                                                  for case, _, _, got, measured in results)),
                t("Each layer keeps keys and values of (batch, kv_heads, length, d_head): multiply it all out."))
    case, heads, dtype, got, measured = wrong[0]
    raise CheckFailure(t(
        "For {case} you predicted {got:,} bytes; a model with {layers} decoder layer(s), {heads} heads and "
        "{kv_heads} key/value heads that decoded {length} tokens for a batch of {batch} in {dtype} holds "
        "{measured:,} bytes of self-attention keys and values. {hint}", case=case, got=got, layers=case["layers"],
        heads=heads, kv_heads=case["kv_heads"], length=case["length"], batch=case["batch"], dtype=dtype_name(dtype),
        measured=measured, hint=hint))


# -- exercise 4: reading a paged cache -------------------------------------------------------

def _paged_case(s: dict[str, int], block_size: int, length: int, dtype: torch.dtype,
                seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """A pool of random blocks, a block table in no particular order, and the sequence it holds."""
    g = torch.Generator().manual_seed(seed)
    kv, d_head = s["kv_heads"], s["d_head"]
    used = -(-length // block_size)
    blocks = used + s["batch"]  # other sequences' blocks are in the pool too
    pool = torch.randn(blocks, kv, block_size, d_head, generator=g, dtype=dtype)
    table = torch.randperm(blocks, generator=g)[:used]
    if used > 1 and bool((table[1:] > table[:-1]).all()):  # a sorted table would hide a sort
        table = table.flip(0)
    expected = torch.stack([pool[table[p // block_size], :, p % block_size] for p in range(length)], dim=1)
    return pool, table, expected


@check
def check_gather_blocks(fn: Callable[..., Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    """The sequence's positions in order, read through the block table; equal to the contiguous cache."""
    s = _sizes(seed)
    kv, d_head = s["kv_heads"], s["d_head"]
    cases = [(s["prefill"], 2 * s["prefill"] + 1 + s["steps"] % (s["prefill"] - 1)),  # a partly filled last block
             (s["steps"], s["steps"] * 3),  # full blocks only
             (1, s["prefill"])]  # one position per block
    for i, (block_size, length) in enumerate(cases):
        pool, table, expected = _paged_case(s, block_size, length, dtype, seed + 31 * i)
        what = t("block_size={block_size}, length={length}, block table {table}", block_size=block_size,
                 length=length, table=table.tolist())
        got = call(fn, pool, table, length)
        if type(got) is Tensor and got.dim() == 3 and got.shape[1] == table.numel() * block_size \
                and got.shape[1] != length:
            raise CheckFailure(t(
                "For {what} you returned {returned} positions, every slot of the table's blocks; the sequence "
                "has {length}. The last block is only partly filled: keep the first `length` positions.", what=what,
                returned=got.shape[1], length=length))
        if type(got) is Tensor and got.dim() == 3 and got.shape[::2] == (kv, d_head) and got.shape[1] != length \
                and torch.equal(got[:, :min(length, got.shape[1])], expected[:, :got.shape[1]]):
            extra = got.shape[1] - length
            if extra == 1:
                count = t("one more than the sequence's length")
            elif extra == -1:
                count = t("one fewer than the sequence's length")
            elif extra > 0:
                count = t("{extra} too many", extra=extra)
            else:
                count = t("{missing} too few", missing=-extra)
            raise CheckFailure(t(
                "For {what} you returned {returned} positions, {count}; the ones you returned are the "
                "sequence's first positions, in order. Keep exactly the first `length` positions: [:, :length].",
                what=what, returned=got.shape[1], count=count))
        got = expect_tensor(got, t("the gathered keys for {what}", what=what), (kv, length, d_head),
                            "kv_heads length d_head", dtype)
        if torch.equal(got, expected):
            continue
        used = pool[table]
        interleaved = rearrange(used, "used kv_heads slot d_head -> kv_heads (slot used) d_head")[:, :length]
        in_pool_order = rearrange(pool[table.sort().values], "used kv_heads slot d_head -> kv_heads (used slot) d_head")
        first_blocks = rearrange(pool[: table.numel()], "used kv_heads slot d_head -> kv_heads (used slot) d_head")
        if torch.equal(got, interleaved):
            hint = t("You laid the positions out as (slot used): slot 0 of every block, then slot 1, ... Position p "
                     "is slot p % block_size of the table's block p // block_size, so the blocks go outermost: "
                     "'used kv_heads slot d_head -> kv_heads (used slot) d_head'.")
        elif torch.equal(got, in_pool_order[:, :length]):
            hint = t("You read the blocks in the pool's order; a sequence's blocks can be anywhere in the pool, in "
                     "any order: read them in the block table's order, pool[table].")
        elif torch.equal(got, first_blocks[:, :length]):
            hint = t("You read the pool's first blocks; read the ones the block table lists: pool[table].")
        else:
            hint = t("Take pool[table] (the sequence's blocks in order), put the slots of each block after each "
                     "other along the sequence, and keep the first `length` positions.")
        raise CheckFailure(t("For {what}, your gathered keys are not the sequence's positions in order. {hint}",
                             what=what, hint=hint))
    passed(t("gather_blocks reads the blocks in the table's order, slots within blocks, and stops at the sequence's "
             "length ({dtype})", dtype=dtype_name(dtype)))
