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

Limits, honestly: the records are written by the student's kernel, so code in that kernel can
forge them (patch what ``call`` relies on, or write the files itself). This module makes the
cheap routes fail (its functions read a snapshot of the module taken at import, see
:func:`_seal`, so rebinding ``_core._call_own_work`` from a notebook changes nothing), but
objects it shares with the kernel (``torch``, ``importlib``, classes, ``_state``) stay
patchable there. What refuses a forgery is the grader's static scan of the student's cells
(``stepformer.course.trusted.reference_use``): a cell that reaches for this machinery
(``importlib``, ``sys.modules``, ``__globals__``, the checks' modules, ...) loses every point.
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from stepformer.checks._messages import marked, t, tr

RECORD_ENV = "STEPFORMER_RECORD"


class CheckFailure(AssertionError):
    """A check found a mistake; the message says which and where to look."""

    def reworded(self, message: str) -> "CheckFailure":
        """This failure told by ``message`` instead (its text with a hint after it, say), of the same class."""
        return CheckFailure(message)


class CodeRaised(CheckFailure):
    """The student's code raised an exception: ``error`` is its class's name, ``text`` its message.

    The stub's NotImplementedError is not one (that failure says "not implemented yet"). Checks branch on this class
    and its attributes, never on the message's words; it leaves a check as a plain CheckFailure (see :func:`check`).
    """

    def __init__(self, message: str, error: str, text: str) -> None:
        super().__init__(message)
        self.error, self.text = error, text

    @property
    def raised(self) -> str:
        """``"ValueError: heads must divide d_model"``: what the code raised, as the message shows it."""
        return f"{self.error}: {self.text}"

    def reworded(self, message: str) -> "CodeRaised":
        return CodeRaised(message, self.error, self.text)

    def __reduce__(self) -> tuple[Any, ...]:
        return CodeRaised, (str(self), self.error, self.text)


class NotOwnWork(CheckFailure):
    """The student's code used what the exercise asks them to write (a forbidden built-in, the course's library).

    Checks branch on this class, never on the message's words (which are in the reader's language); like
    :class:`CodeRaised`, it leaves a check as a plain CheckFailure.
    """

    def reworded(self, message: str) -> "NotOwnWork":
        return NotOwnWork(message)


def raised_error(failure: CheckFailure) -> str | None:
    """The name of the exception that the student's code raised, where ``failure`` reports one (not a stub)."""
    return failure.error if isinstance(failure, CodeRaised) else None


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
        try:
            with _session(key, forbid or {}):
                fn(student, *args, **kwargs)
        except (CodeRaised, NotOwnWork) as failure:
            # The notebook and the grader's feedback name the class of what a check raises: "CheckFailure: ...",
            # as ever. CodeRaised and NotOwnWork are for the checks' own use, so they leave as the class they
            # extend, the same object (message, traceback and cause unchanged).
            failure.__class__ = CheckFailure
            raise

    wrapper.forbid = dict(forbid or {})
    return wrapper


def library_modules() -> list[str]:
    """The course's reference modules: every ``stepformer`` module but the checks and the tools, with
    the modules of its packages (the translator, chapter 11; the language-model runs, chapter 12)."""
    import stepformer

    folder = Path(stepformer.__file__).parent
    modules = [f"stepformer.{p.stem}" for p in sorted(folder.glob("*.py")) if not p.stem.startswith("_")]
    for package in sorted(p.parent for p in folder.glob("*/__init__.py")):
        if package.name not in ("checks", "course"):
            modules += [f"stepformer.{package.name}.{p.stem}" for p in sorted(package.glob("*.py"))
                        if not p.stem.startswith("_")]
    return modules


def library_callables() -> list[tuple[Any, str, Any]]:
    """``(module, name, object)`` of every function and class the reference library defines.

    A module that cannot be imported is skipped: the translator's need their packages (e.g. on
    Colab without them), and a module that is not there has nothing a student could call.
    """
    found = []
    for module_name in library_modules():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found += [(module, name, value) for name, value in vars(module).items()
                  if callable(value) and getattr(value, "__module__", None) == module_name]
    return found


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
            session.add(_digest(args, kwargs), _failure_entry(failure))
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
        raise NotOwnWork(_own_work_message(fn, used[0]))
    tripped: list[str] = []
    try:
        with _tripwires(tripped, forbid):
            result = fn(*args, **kwargs)
    except NotImplementedError as error:
        raise CheckFailure(t("{name} is not implemented yet (it raised NotImplementedError).",
                             name=_name(fn))) from error
    except Exception as error:
        # Keywords keep their names: shown by position, dropout=0.25 would read as the next parameter.
        shown = ", ".join([*(describe(a) for a in args), *(f"{key}={describe(a)}" for key, a in kwargs.items())])
        name, text = type(error).__name__, str(error)
        raise CodeRaised(t("{call} raised {error}: {text}", call=f"{_name(fn)}({shown})", error=name, text=text),
                         name, text) from error
    if tripped:
        raise NotOwnWork(_own_work_message(fn, tripped[0]))
    return result


def _own_work_message(fn: Callable[..., Any], what: str) -> str:
    return t("Not your own work: {name} uses {what}. This exercise asks you to write it yourself; "
             "a function that calls the reference scores zero.", name=_name(fn), what=_shown(what))


LIBRARY_LABEL = marked("the course's reference library")


def _shown(what: str) -> str:
    """A forbidden object's label, ``dotted.name (what it is)``, with what it is in the reader's language (the
    labels are made once, in English, and kept)."""
    name, _, label = what.partition(" (")
    return t("{name} ({label})", name=name, label=tr(label[:-1])) if label.endswith(")") else what


# The same operator reached another way: PyTorch's C bindings, the ATen operators behind
# ``torch.ops.aten`` and the private top-level functions. Forbidding the first forbids the rest.
_SDPA_OPS = ("_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
             "_scaled_dot_product_attention_math_for_mps")
EQUIVALENTS: dict[str, tuple[str, ...]] = {
    "torch.nn.functional.scaled_dot_product_attention": (
        "torch._C._nn.scaled_dot_product_attention", "torch.ops.aten.scaled_dot_product_attention",
        *(f"torch.ops.aten.{op}" for op in _SDPA_OPS), *(f"torch.{op}" for op in _SDPA_OPS)),
    "torch.nn.functional.multi_head_attention_forward": (
        "torch._native_multi_head_attention", "torch.ops.aten._native_multi_head_attention",
        "torch._triton_multi_head_attention"),
    "torch.nn.functional.layer_norm": (
        "torch.layer_norm", "torch.native_layer_norm", "torch.ops.aten.layer_norm",
        "torch.ops.aten.native_layer_norm"),
    "torch.nn.functional.rms_norm": (
        "torch.rms_norm", "torch._fused_rms_norm", "torch.ops.aten.rms_norm", "torch.ops.aten._fused_rms_norm"),
    "torch.nn.functional.cross_entropy": ("torch._C._nn.cross_entropy_loss", "torch.ops.aten.cross_entropy_loss"),
    "torch.nn.functional.nll_loss": (
        "torch._C._nn.nll_loss", "torch._C._nn.nll_loss_nd", "torch.ops.aten.nll_loss", "torch.ops.aten.nll_loss_nd"),
}


# The ATen operators that only the forbidden function runs: seen at PyTorch's dispatcher while the
# student's code runs, however the function was reached (a copy taken before the tripwires, a
# table of PyTorch's, the C bindings). ``_safe_softmax``: the math path of fused attention.
DISPATCHED: dict[str, tuple[str, ...]] = {
    "torch.nn.functional.scaled_dot_product_attention": (
        "scaled_dot_product_attention", "_scaled_dot_product_attention_math", "_safe_softmax", *_SDPA_OPS),
    "torch.nn.functional.multi_head_attention_forward": ("_native_multi_head_attention",),
    "torch.nn.functional.layer_norm": ("layer_norm", "native_layer_norm"),
    "torch.nn.functional.rms_norm": ("rms_norm", "_fused_rms_norm"),
    "torch.nn.functional.cross_entropy": ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward"),
    "torch.nn.functional.nll_loss": ("nll_loss", "nll_loss_nd", "nll_loss_forward"),
    # The method ``scores.softmax`` reaches these operators too, past every module-level tripwire.
    # Forbid torch.softmax (and torch.log_softmax) to have them watched, whatever else is forbidden.
    "torch.softmax": ("softmax", "_softmax"),
    "torch.log_softmax": ("log_softmax", "_log_softmax"),
}


def _with_equivalents(forbid: dict[str, str]) -> dict[str, str]:
    """``forbid`` plus the other ways to reach the same operators (see :data:`EQUIVALENTS`)."""
    every = dict(forbid)
    for dotted, label in forbid.items():
        for other in EQUIVALENTS.get(dotted, ()):
            every.setdefault(other, label)
    return every


def _resolve(dotted: str) -> tuple[Any, str]:
    """(owner, attribute) for a dotted name whose owner may be a module or an object in one
    (``torch.ops.aten.rms_norm``: the owner is the ``torch.ops.aten`` namespace)."""
    owner_name, _, attr = dotted.rpartition(".")
    if owner_name not in _owners:
        parts = owner_name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for part in parts[cut:]:
                owner = getattr(owner, part)
            _owners[owner_name] = owner
            break
        else:
            raise ImportError(dotted)
    return _owners[owner_name], attr


_owners: dict[str, Any] = {}


def _forbidden_objects(forbid: dict[str, str]) -> dict[int, str]:
    """id -> label of every forbidden object; computed once per ``forbid`` (the objects are kept
    alive with it, so that their ids stay theirs)."""
    key = tuple(sorted(forbid.items()))
    if key not in _forbidden_cache:
        kept: list[Any] = []
        _forbidden_cache[key] = (_find_forbidden(forbid, kept), kept)
    return _forbidden_cache[key][0]


_forbidden_cache: dict[tuple, tuple[dict[int, str], list[Any]]] = {}


def _find_forbidden(forbid: dict[str, str], kept: list[Any]) -> dict[int, str]:
    found = {}
    for dotted, label in _with_equivalents(forbid).items():
        with contextlib.suppress(ImportError, AttributeError):
            owner, attr = _resolve(dotted)
            value = getattr(owner, attr)
            kept.append(value)
            found.setdefault(id(value), f"{dotted} ({label})")  # F.x and torch._C._nn.x are one object
            if isinstance(value, torch._ops.OpOverloadPacket):  # torch.ops.aten.x.default, ...
                for overload in value.overloads():
                    kept.append(getattr(value, overload))
                    found.setdefault(id(kept[-1]), f"{dotted} ({label})")
    for module, name, value in library_callables():
        kept.append(value)
        found[id(value)] = f"{module.__name__}.{name} ({LIBRARY_LABEL})"
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
            candidates += [inner for value in candidates for inner in _one_level_in(value, f)]
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


def _one_level_in(value: Any, beside: types.FunctionType) -> list[Any]:
    """What a global holds one level down: a container's items, a library function's defaults
    and closure, a partial's function and arguments, a bound method's object, a student class's
    attributes. Catches ``_hidden = [F.scaled_dot_product_attention]`` used as ``_hidden[0](...)``."""
    inner: list[Any] = []
    with contextlib.suppress(Exception):  # a student's odd object must not break the check
        if type(value) in (list, tuple, set, frozenset):
            inner += list(value)[:1000]
        elif type(value) is dict:
            inner += [*list(value.values())[:1000], *list(value.keys())[:1000]]
        elif isinstance(value, functools.partial):
            inner += [value.func, *value.args, *value.keywords.values()]
        elif isinstance(value, types.FunctionType) and not _written_by_student(value, beside):
            inner += list(value.__defaults__ or ()) + list((value.__kwdefaults__ or {}).values())
            inner += [c.cell_contents for c in (value.__closure__ or ()) if _has_contents(c)]
        elif isinstance(value, type) and _written_by_student(value, beside):
            inner += [v for v in vars(value).values() if not isinstance(v, types.FunctionType)]
        for attr in ("__self__", "__func__"):
            if (bound := getattr(value, attr, None)) is not None and not isinstance(bound, types.ModuleType):
                inner.append(bound)
    return inner


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
    # ``torch.ops.aten.*`` is left in place (PyTorch itself looks its operators up there): the
    # dispatcher watch below sees those operators run, however they were reached.
    targets = [(dotted, f"{dotted} ({label})") for dotted, label in _with_equivalents(forbid).items()
               if not dotted.startswith("torch.ops.")]
    targets += [(f"{module.__name__}.{name}", f"{module.__name__}.{name} ({LIBRARY_LABEL})")
                for module, name, _ in library_callables()]
    for dotted, label in targets:
        with contextlib.suppress(ImportError, AttributeError, TypeError):
            owner, attr = _resolve(dotted)
            original = getattr(owner, attr)
            setattr(owner, attr, _wire(original, label, tripped))
            saved.append((owner, attr, original))
    watched = {op: f"{dotted} ({label})" for dotted, label in forbid.items() for op in DISPATCHED.get(dotted, ())}
    try:
        with _OpWatch(watched, tripped) if watched else contextlib.nullcontext():
            yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


class _OpWatch(TorchDispatchMode):
    """Notes every ATen operator in ``ops`` (name -> label) that runs while it is active."""

    def __init__(self, ops: dict[str, str], tripped: list[str]) -> None:
        super().__init__()
        self.ops, self.tripped = ops, tripped

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise PyTorch wraps __torch_dispatch__ in torch._dynamo.disable, whose first call imports
        # torch._dynamo: 1.5 s of CPU in every grading kernel. Dynamo compiles nothing while a dispatch mode
        # is active, and a function compiled with torch.compile is watched all the same (tried on sdpa).
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "aten" and (label := self.ops.get(func.overloadpacket.__name__)):
            self.tripped.append(label)
        return func(*args, **(kwargs or {}))


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
            self.problem = t("the graded run of your notebook left no result for this check (did it run to the end?)")
            return
        try:
            self.entries = torch.load(path, weights_only=True)
        except Exception:
            # weights_only refuses anything but plain tensors and containers: a tensor subclass
            # or any other object was returned, which a check never accepts.
            self.problem = t("your function returned something other than plain tensors and numbers")

    def next(self, digest: str) -> Any:
        if self.entries is None:
            raise CheckFailure(self.problem)
        if not self.entries:
            raise CheckFailure(t("the graded run of your notebook recorded fewer calls than this check makes"))
        entry = self.entries.pop(0)
        if "failure" in entry:
            raise _recorded_failure(entry)
        if entry["digest"] != digest:
            raise CheckFailure(t("the recorded call does not match this check's inputs (was the check changed?)"))
        return Opaque(entry["opaque"]) if "opaque" in entry else entry["result"]


def _failure_entry(failure: CheckFailure) -> dict[str, Any]:
    """A failure as a record keeps it: its message, and for an error from the code what it raised."""
    if isinstance(failure, CodeRaised):
        return {"failure": str(failure), "raised": [failure.error, failure.text]}
    if isinstance(failure, NotOwnWork):
        return {"failure": str(failure), "own_work": True}
    return {"failure": str(failure)}


def _recorded_failure(entry: dict[str, Any]) -> CheckFailure:
    """The failure that ``entry`` records, of its class: a record without "raised" (written before it was kept)
    replays as a plain CheckFailure."""
    raised = entry.get("raised")
    if type(raised) is list and len(raised) == 2 and all(type(part) is str for part in raised):
        return CodeRaised(entry["failure"], *raised)
    if entry.get("own_work") is True:
        return NotOwnWork(entry["failure"])
    return CheckFailure(entry["failure"])


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
    """A short description of an argument, on one line: shape and dtype for a tensor; for a module, its class and
    settings (its repr lists every submodule, a line each); for an object without a repr of its own, its class (its
    address would differ from run to run); repr otherwise."""
    if isinstance(x, Tensor):
        return f"Tensor{tuple(x.shape)} {dtype_name(x.dtype)}"
    try:
        if isinstance(x, torch.nn.Module):
            return f"{type(x).__name__}({x.extra_repr()})"
        if type(x).__repr__ is object.__repr__:
            return f"{type(x).__name__} object"
        return repr(x)
    except Exception:  # a student's class whose repr fails
        return f"{type(x).__name__} object"


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: a dtype as the messages name it."""
    return str(dtype).removeprefix("torch.")


def draw_sizes(g: torch.Generator, axes: Sequence[str], span: int, first: int = 2) -> dict[str, int]:
    """One size per axis, pairwise distinct: ``len(axes)`` of first, ..., first + span - 1, in the order drawn."""
    return dict(zip(axes, (torch.randperm(span, generator=g)[: len(axes)] + first).tolist(), strict=True))


def distinct_sizes(seed: int, axes: Sequence[str], *, span: int, fixed: Sequence[int] | None = None,
                   accept: Callable[[dict[str, int]], bool] | None = None,
                   products: dict[str, tuple[str, str]] | None = None) -> dict[str, int]:
    """A fixture's sizes, pairwise distinct so that a swapped axis changes a shape and cannot pass.

    Seed 0 gives ``fixed``, where there is one (the sizes the book's examples show). Another seed seeds a generator
    and draws :func:`draw_sizes` from it until ``accept(sizes)`` holds and the ``products`` (``{"d_model": ("heads",
    "d_head")}``: computed, never drawn) differ from the drawn sizes and from each other; the products come last.
    """
    def with_products(sizes: dict[str, int]) -> dict[str, int]:
        return {**sizes, **{name: sizes[a] * sizes[b] for name, (a, b) in (products or {}).items()}}

    if seed == 0 and fixed is not None:
        return with_products(dict(zip(axes, fixed, strict=True)))
    g = torch.Generator().manual_seed(seed)
    while True:
        sizes = with_products(draw_sizes(g, axes, span))
        if len(set(sizes.values())) == len(sizes) and (accept is None or accept(sizes)):
            return sizes


def expect_tensor(x: Any, what: str, shape: tuple[int, ...], axes: str, dtype: torch.dtype) -> Tensor:
    """Fail unless ``x`` is a plain tensor of exactly this shape and dtype.

    ``type(x) is Tensor`` (not isinstance) so that an object pretending to be a tensor,
    e.g. one whose ``__eq__`` always says True, cannot pass.
    """
    if type(x) is not Tensor:
        raise CheckFailure(t("{what} should be a torch.Tensor, got {kind}.", what=what, kind=type(x).__name__))
    if tuple(x.shape) != shape:
        named = ", ".join(f"{a}={n}" for a, n in zip(axes.split(), shape, strict=True))
        raise CheckFailure(t(
            "{what} should have shape ({named}), got {shape}. "
            "Check which axes your einsum pattern keeps and in what order.", what=what, named=named,
            shape=tuple(x.shape)))
    if x.dtype != dtype:
        raise CheckFailure(t("{what} should have dtype {dtype} like its inputs, got {got}.", what=what, dtype=dtype,
                             got=x.dtype))
    return x


def refuse_extra_parameters(shapes: dict[str, Any], expected: Sequence[str], bias: bool) -> None:
    """Fail if an attention module learns parameters beyond its four projections (``w_q.weight``, ...)."""
    extra = sorted(set(shapes) - set(expected))
    if extra:
        hint = t(" With bias=False, pass bias=bias to every nn.Linear.") if not bias else ""
        raise CheckFailure(t("Unexpected parameters {extra}: only w_q, w_k, w_v and w_o are learned.{hint}",
                             extra=extra, hint=hint))


def close(actual: Tensor, expected: Tensor, dtype: torch.dtype, tolerance: float | None = None) -> bool:
    """Equal up to a tolerance stated per dtype (float32 rounding grows with the sum length),
    or up to ``tolerance`` where the caller knows the rounding is larger."""
    if tolerance is None:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    return actual.shape == expected.shape and bool(
        torch.allclose(actual, expected, rtol=tolerance, atol=tolerance, equal_nan=False)
    )


def difference(actual: Tensor, expected: Tensor, sizes: dict[str, int] | None = None) -> str:
    """Where and by how much two tensors differ most, and on which sizes: what a failing check reports."""
    where = t(" on sizes {sizes}", sizes=", ".join(f"{k}={v}" for k, v in sizes.items())) if sizes else ""
    if actual.shape != expected.shape:
        return t("shape {actual} instead of {expected}{where}", actual=tuple(actual.shape),
                 expected=tuple(expected.shape), where=where)
    gap = (actual.detach().to(expected.dtype) - expected).abs().nan_to_num(nan=float("inf"))
    index = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape)) if gap.numel() else ()
    value = gap.max().item() if gap.numel() else 0.0
    return t("largest difference {value:.3g} at index {index}{where}", value=value, index=list(index), where=where)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the block: tiny models run fastest so; on a busy machine several threads mostly
    wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def show(x: Tensor) -> str:
    """Print a tensor only when it is small enough to read."""
    return str(x.detach()) if x.numel() <= 12 else t("a tensor of shape {shape}", shape=tuple(x.shape))


def passed(message: str) -> None:
    print("✔ " + message)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


# -- sealing --------------------------------------------------------------------------------

def _seal(namespace: dict[str, Any]) -> None:
    """Make this module's functions read their globals from a snapshot taken now.

    A notebook that rebinds ``stepformer.checks._core._call_own_work`` (or ``_tripwires``,
    ``_references_to_forbidden``, ...) changes the module, not the snapshot, so ``call`` keeps
    using the originals. Mutable objects shared with the kernel stay patchable: this is a
    speed bump, the grader's static scan is the wall (see the module's docstring).
    """
    sealed = dict(namespace)

    def rebuilt(f: types.FunctionType) -> types.FunctionType:
        g = types.FunctionType(f.__code__, sealed, f.__name__, f.__defaults__, f.__closure__)
        g.__kwdefaults__ = f.__kwdefaults__
        g.__dict__.update(f.__dict__)
        for attr in ("__qualname__", "__doc__", "__module__", "__annotations__"):
            setattr(g, attr, getattr(f, attr))
        return g

    here = namespace["__name__"]
    for name, value in list(sealed.items()):
        if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
            sealed[name] = rebuilt(value)
        elif (isinstance(inner := getattr(value, "__wrapped__", None), types.FunctionType)
              and inner.__globals__ is namespace):
            sealed[name] = contextlib.contextmanager(rebuilt(inner))  # the only decorator used here
        elif isinstance(value, type) and value.__module__ == here:
            for attr, method in list(vars(value).items()):
                if isinstance(method, types.FunctionType) and method.__globals__ is namespace:
                    setattr(value, attr, rebuilt(method))
    namespace.update({name: sealed[name] for name in sealed if sealed[name] is not namespace.get(name)})


_seal(globals())
