"""Small steps that touch a student's ``nn.Module``; the checks run each through :func:`~stepformer.checks._core.call`,
so that the student's code inside them is watched, recorded and replayed like any other call."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def parameter_shapes(module: nn.Module) -> dict[str, list[int]]:
    """The shape of each named parameter."""
    return {name: list(p.shape) for name, p in module.named_parameters()}


def parameters_of(module: nn.Module) -> dict[str, Tensor]:
    """A detached copy of each named parameter."""
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def load_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Give the module these weights and their dtype, and put it in eval mode."""
    module.to(next(iter(state.values())).dtype)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
    module.eval()


def set_training(module: nn.Module, training: bool) -> None:
    module.train(training)


def error_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """The name of the exception that ``fn(*args, **kwargs)`` raises (building a module, say), or ``None``."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # which exception is the answer
        return type(error).__name__
    return None
