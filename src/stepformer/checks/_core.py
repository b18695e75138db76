"""What every check shares: calling the student's code, and failing with a useful message."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class CheckFailure(AssertionError):
    """A check found a mistake; the message says which and where to look."""


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the student's ``fn``; turn whatever it raises into a failure that names the call."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as error:
        raise CheckFailure(f"{_name(fn)} is not implemented yet (it raised NotImplementedError).") from error
    except Exception as error:
        shown = ", ".join(describe(a) for a in (*args, *kwargs.values()))
        raise CheckFailure(
            f"{_name(fn)}({shown}) raised {type(error).__name__}: {error}"
        ) from error


def describe(x: Any) -> str:
    """A short description of an argument: shape and dtype for a tensor, repr otherwise."""
    if isinstance(x, Tensor):
        return f"Tensor{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return repr(x)


def expect_tensor(x: Any, what: str, shape: tuple[int, ...], axes: str, dtype: torch.dtype) -> Tensor:
    """Fail unless ``x`` is a plain tensor of exactly this shape and dtype.

    ``type(x) is Tensor`` (not isinstance) so that an object pretending to be a tensor,
    e.g. one whose ``__eq__`` always says True, cannot pass.
    """
    if type(x) is not Tensor:
        raise CheckFailure(f"{what} should be a torch.Tensor, got {type(x).__name__}.")
    if tuple(x.shape) != shape:
        named = ", ".join(f"{a}={n}" for a, n in zip(axes.split(), shape, strict=True))
        raise CheckFailure(
            f"{what} should have shape ({named}), got {tuple(x.shape)}. "
            "Check which axes your einsum pattern keeps and in what order."
        )
    if x.dtype != dtype:
        raise CheckFailure(f"{what} should have dtype {dtype} like its inputs, got {x.dtype}.")
    return x


def close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> bool:
    """Equal up to a tolerance stated per dtype (float32 rounding grows with the sum length)."""
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    return actual.shape == expected.shape and bool(
        torch.allclose(actual, expected, rtol=tolerance, atol=tolerance, equal_nan=False)
    )


def show(x: Tensor) -> str:
    """Print a tensor only when it is small enough to read."""
    return str(x.detach()) if x.numel() <= 12 else f"a tensor of shape {tuple(x.shape)}"


def passed(message: str) -> None:
    print(f"✔ {message}")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
