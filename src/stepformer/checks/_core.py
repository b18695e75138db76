"""What every check shares: calling the student's code, and failing with a useful message.

Every interaction of a check with the student's code goes through :func:`call`. That single
door gives three things:

- **own work**: while the student's code runs, the course library and the PyTorch built-ins
  that an exercise asks students to write are replaced by tripwires, and the student's function
  is searched for references to them; using one fails the check;
- **record**: when ``STEPFORMER_RECORD`` names a folder (the grader sets it), each call's
  result is saved there;
- **replay**: the grader re-runs the same checks in its own process, where no student code ever
  ran, with :func:`replaying`: ``call`` then returns the recorded results instead of calling
  anything. Whatever a submission patched in its kernel (``torch.allclose``, this module,
  ``builtins``, ``sys.modules``) cannot reach that process, so a wrong answer stays wrong.
"""

import contextlib
import dis
import functools
import hashlib
import importlib
import io
import os
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

RECORD_ENV = "STEPFORMER_RECORD"


class CheckFailure(AssertionError):
    """A check found a mistake; the message says which and where to look."""


def check(fn: Callable[..., None] | None = None, *, forbid: dict[str, str] | None = None):
    """Mark a check: its calls of student code are recorded or replayed under one key.

    ``forbid`` maps dotted names of built-ins that the exercise asks students to write
    themselves (``"torch.nn.functional.layer_norm": "PyTorch's layer norm"``) to a label; the
    course's own library is always forbidden. Use as ``@check`` or ``@check(forbid={...})``.
    """
    if fn is None:
        return functools.partial(check, forbid=forbid)

    @functools.wraps(fn)
    def wrapper(student: Any, *args: Any, **kwargs: Any) -> None:
        key = fn.__name__ + "(" + ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]) + ")"
        with _session(key, forbid or {}):
            fn(student, *args, **kwargs)

    wrapper.forbid = dict(forbid or {})
    return wrapper


def library_modules() -> list[str]:
    """The course's reference modules (every ``stepformer`` module but the checks and the tools)."""
    import stepformer

    folder = Path(stepformer.__file__).parent
    return [f"stepformer.{p.stem}" for p in sorted(folder.glob("*.py")) if not p.stem.startswith("_")]


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the student's ``fn``; turn whatever it raises into a failure that names the call.

    Every touch of a student object goes through here (constructing it, calling it, loading
    weights into it with a helper), so that it can be recorded and replayed. A result that is
    not plain data (a module, say) is replayed as an opaque stand-in, which a check may only
    hand back to ``call``.
    """
    session = _current()
    forbid = session.forbid if session else {}
    if isinstance(session, _Replay):
        return session.next(_digest(args, kwargs))
    try:
        result = _call_own_work(fn, args, kwargs, forbid)
    except CheckFailure as failure:
        if isinstance(session, _Record):
            session.add(_digest(args, kwargs), {"failure": str(failure)})
        raise
    if isinstance(session, _Record):
        session.add(_digest(args, kwargs), {"result": result} if _plain(result) else {"opaque": kind(result)})
    return result


class Opaque:
    """What replay returns for a student object that was not plain data."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"<{self.kind}>"


def kind(value: Any) -> str:
    """What a value is, for messages: ``Tensor``, ``tuple of (AlwaysEqual, Tensor)``, ..."""
    if isinstance(value, Opaque):
        return value.kind
    if type(value) in (tuple, list):
        return f"{type(value).__name__} of ({', '.join(kind(v) for v in value)})"
    return type(value).__name__


def _plain(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, str, Tensor, torch.dtype, torch.Size):
        return True
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def _call_own_work(fn: Callable[..., Any], args: tuple, kwargs: dict, forbid: dict[str, str]) -> Any:
    used = _references_to_forbidden(fn, forbid)
    if used:
        raise CheckFailure(_own_work_message(fn, used[0]))
    tripped: list[str] = []
    try:
        with _tripwires(tripped, forbid):
            result = fn(*args, **kwargs)
    except NotImplementedError as error:
        raise CheckFailure(f"{_name(fn)} is not implemented yet (it raised NotImplementedError).") from error
    except Exception as error:
        shown = ", ".join(describe(a) for a in (*args, *kwargs.values()))
        raise CheckFailure(f"{_name(fn)}({shown}) raised {type(error).__name__}: {error}") from error
    if tripped:
        raise CheckFailure(_own_work_message(fn, tripped[0]))
    return result


def _own_work_message(fn: Callable[..., Any], what: str) -> str:
    return (
        f"Not your own work: {_name(fn)} uses {what}. This exercise asks you to write it yourself; "
        "a function that calls the reference scores zero."
    )


def _forbidden_objects(forbid: dict[str, str]) -> dict[int, str]:
    found = {}
    for dotted, label in forbid.items():
        module, _, attr = dotted.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            found[id(getattr(importlib.import_module(module), attr))] = f"{dotted} ({label})"
    for module_name in library_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if callable(value) and getattr(value, "__module__", None) == module_name:
                found[id(value)] = f"{module_name}.{name} (the course's reference library)"
    return found


def _references_to_forbidden(fn: Any, forbid: dict[str, str]) -> list[str]:
    """Forbidden objects that ``fn`` reaches through its globals, defaults, closure or attributes.

    Catches a reference taken before the tripwires were set, e.g. ``from torch.nn.functional
    import scaled_dot_product_attention as sdpa`` at the top of a cell, also when it is used
    by another of the student's functions that ``fn`` calls.
    """
    forbidden = _forbidden_objects(forbid)
    found: list[str] = []
    seen: set[int] = set()
    pending = [fn]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if id(item) in forbidden:
            found.append(forbidden[id(item)])
            continue
        for f in _functions_of(item):
            globals_used, attributes_used = _names(f.__code__)
            candidates = [f.__globals__.get(n) for n in globals_used]
            candidates += list(f.__defaults__ or ()) + list((f.__kwdefaults__ or {}).values())
            candidates += [c.cell_contents for c in (f.__closure__ or ()) if _has_contents(c)]
            for value in candidates:
                if id(value) in forbidden:
                    found.append(forbidden[id(value)])
                elif isinstance(value, types.ModuleType):
                    # Only names read as attributes (``nn.LayerNorm``), not the student's own globals
                    # that happen to share a name with something in the module.
                    found += [forbidden[id(a)] for a in (getattr(value, n, None) for n in attributes_used)
                              if a is not None and id(a) in forbidden]
                elif _written_by_student(value, f):
                    pending.append(value)
    return found


def _functions_of(item: Any) -> list[types.FunctionType]:
    """The plain functions behind a function, a decorated function or a class."""
    inner = getattr(item, "__wrapped__", item)
    if isinstance(inner, types.FunctionType):
        return [inner]
    cls = item if isinstance(item, type) else type(item)
    return [v for v in vars(cls).values() if isinstance(v, types.FunctionType)]


def _written_by_student(value: Any, beside: types.FunctionType) -> bool:
    """A function or class defined where ``beside`` was (the notebook), not in a library."""
    inner = getattr(value, "__wrapped__", value)
    return isinstance(inner, types.FunctionType | type) and getattr(inner, "__module__", None) == beside.__module__


def _names(code: types.CodeType) -> tuple[set[str], set[str]]:
    """(global names read, attribute names read) by ``code`` and the code nested in it."""
    globals_used: set[str] = set()
    attributes_used: set[str] = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globals_used.add(instruction.argval)
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM"):
            attributes_used.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_globals, inner_attributes = _names(const)
            globals_used |= inner_globals
            attributes_used |= inner_attributes
    return globals_used, attributes_used


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises ValueError)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _tripwires(tripped: list[str], forbid: dict[str, str]) -> Iterator[None]:
    """Replace forbidden module attributes by wrappers that note their use, then put them back."""
    saved = []
    targets = [(dotted.rpartition(".")[0], dotted.rpartition(".")[2], f"{dotted} ({label})")
               for dotted, label in forbid.items()]
    for module_name in library_modules():
        module = importlib.import_module(module_name)
        targets += [(module_name, name, f"{module_name}.{name} (the course's reference library)")
                    for name, value in vars(module).items()
                    if callable(value) and getattr(value, "__module__", None) == module_name]
    for module_name, attr, label in targets:
        with contextlib.suppress(ImportError, AttributeError):
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
            saved.append((module, attr, original))
            setattr(module, attr, _wire(original, label, tripped))
    try:
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


def _wire(original: Any, label: str, tripped: list[str]) -> Any:
    if isinstance(original, type):
        class Wired(original):  # a subclass, so isinstance checks elsewhere keep working
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                tripped.append(label)
                super().__init__(*args, **kwargs)

        Wired.__name__ = Wired.__qualname__ = original.__name__
        return Wired

    @functools.wraps(original)
    def wired(*args: Any, **kwargs: Any) -> Any:
        tripped.append(label)
        return original(*args, **kwargs)

    return wired


# -- record and replay ---------------------------------------------------------------------

class _Record:
    def __init__(self, folder: Path, key: str, occurrence: int, forbid: dict[str, str]) -> None:
        self.forbid = forbid
        self.path = folder / f"{_key_file(key)}-{occurrence}.pt"
        self.entries: list[dict[str, Any]] = []

    def add(self, digest: str, entry: dict[str, Any]) -> None:
        self.entries.append({"digest": digest, **entry})

    def close(self) -> None:
        buffer = io.BytesIO()
        try:
            torch.save(self.entries, buffer)
        except Exception as error:  # an unpicklable result: replay will report it
            buffer = io.BytesIO()
            torch.save([{"digest": "", "failure": f"the result could not be saved ({type(error).__name__})"}], buffer)
        self.path.write_bytes(buffer.getvalue())


class _Replay:
    def __init__(self, folder: Path, key: str, occurrence: int, forbid: dict[str, str]) -> None:
        self.forbid = forbid
        path = folder / f"{_key_file(key)}-{occurrence}.pt"
        self.entries: list[dict[str, Any]] | None = None
        self.problem = ""
        if not path.is_file():
            self.problem = "the graded run of your notebook left no result for this check (did it run to the end?)"
            return
        try:
            self.entries = torch.load(path, weights_only=True)
        except Exception:
            # weights_only refuses anything but plain tensors and containers: a tensor subclass
            # or any other object was returned, which a check never accepts.
            self.problem = "your function returned something other than plain tensors and numbers"

    def next(self, digest: str) -> Any:
        if self.entries is None:
            raise CheckFailure(self.problem)
        if not self.entries:
            raise CheckFailure("the graded run of your notebook recorded fewer calls than this check makes")
        entry = self.entries.pop(0)
        if "failure" in entry:
            raise CheckFailure(entry["failure"])
        if entry["digest"] != digest:
            raise CheckFailure("the recorded call does not match this check's inputs (was the check changed?)")
        return Opaque(entry["opaque"]) if "opaque" in entry else entry["result"]


_state: dict[str, Any] = {"session": None, "replay": None, "counts": defaultdict(int)}


class _Plain:
    """A check run outside grading: nothing recorded."""

    def __init__(self, forbid: dict[str, str]) -> None:
        self.forbid = forbid


def _current() -> "_Record | _Replay | _Plain | None":
    return _state["session"]


@contextlib.contextmanager
def _session(key: str, forbid: dict[str, str]) -> Iterator[None]:
    folder = _state["replay"] or os.environ.get(RECORD_ENV)
    # Occurrences are counted per folder: the n-th run of a check in a notebook is replayed
    # against the n-th record.
    count = _state["counts"][str(folder), key]
    _state["counts"][str(folder), key] += 1
    if _state["replay"] is not None:
        session: _Record | _Replay | _Plain = _Replay(_state["replay"], key, count, forbid)
    elif folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        session = _Record(Path(folder), key, count, forbid)
    else:
        session = _Plain(forbid)
    previous, _state["session"] = _state["session"], session
    try:
        yield
    finally:
        _state["session"] = previous
        if isinstance(session, _Record):
            session.close()


@contextlib.contextmanager
def replaying(folder: Path) -> Iterator[None]:
    """Within this block, checks read the student's results from ``folder`` and call nothing."""
    saved = dict(_state)
    _state.update(session=None, replay=Path(folder), counts=defaultdict(int))
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def _key_file(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _digest(args: tuple, kwargs: dict) -> str:
    """A fingerprint of a call's inputs, so replay can tell that it answers the same question."""
    h = hashlib.sha256()
    for value in (*args, *(v for _, v in sorted(kwargs.items()))):
        if not _plain(value):
            h.update(b"opaque")  # a student object, or its stand-in under replay
        elif isinstance(value, Tensor):
            h.update(f"T{tuple(value.shape)}{value.dtype}".encode())
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


# -- helpers for writing checks ------------------------------------------------------------

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
