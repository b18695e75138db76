"""The grader's own verdict on each graded cell, reached without running student code.

Each graded cell of the autograded notebook (nbgrader has restored its source, hidden checks
included) is run again here, in the grader's process, with the student's objects replaced by
placeholders: the checks replay the results that the student's kernel recorded (see
``stepformer.checks._core``). Patching in the student's kernel cannot reach this process.

The student's own cells are also read as text (:func:`reference_use`):

- a solution cell that reaches for a reference implementation (the course library, a built-in
  that its exercise's checks forbid, PyTorch's internal operators ``torch.ops``/``torch._C``/
  ``torch._VF``), by name, through ``getattr``/``vars``, or spelled in strings (in pieces or
  reversed), loses the points of its exercise, even where the kernel-side tripwires were dodged;
- a cell that reaches for the grading machinery or Python's internals (``stepformer.checks``,
  ``importlib``, ``sys.modules``, ``builtins``, ``gc``, ``inspect``, ``ctypes``, ``__globals__``,
  ``exec`` of code built at run time, ...; their few honest uses, such as ``importlib.reload``,
  ``gc.get_objects`` or ``inspect.signature``, excepted) loses the points of every check that runs
  after it. This is what refuses forged records: the records are written in the student's kernel,
  where a determined student can rewrite them; the grader moves each check's records out of the
  kernel's reach as soon as its cell has run, so checks before the cell keep their points.

The scan reads code, so code it cannot read (names computed from numbers, data loaded from a
file) gets past it; the kernel-side guard and a human look at the flagged cells are the rest.
"""

import ast
import builtins
import contextlib
import importlib
import math
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import torch

import stepformer.checks
from stepformer.checks._core import RECORD_ENV, CheckFailure, replaying
from stepformer.checks._messages import t, tr

SUSPECT_MODULES = ("stepformer",)
ALLOWED_MODULES = ("stepformer.checks",)


@dataclass
class Verdict:
    grade_id: str
    passed: bool
    reason: str = ""


class _Placeholder:
    """Stands in for a student object; a replayed check never calls it."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise CheckFailure(f"{self.__name__} was called outside the student's kernel")


class _Names(dict):
    def __missing__(self, name: str):
        if hasattr(builtins, name):
            return getattr(builtins, name)
        return _Placeholder(name)


def check_namespace() -> dict[str, object]:
    """Every public name of every ``stepformer.checks`` module: what graded cells may call."""
    names: dict[str, object] = {}
    for info in pkgutil.iter_modules(stepformer.checks.__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"stepformer.checks.{info.name}")
            names.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
    names.update({k: v for k, v in vars(stepformer.checks).items() if not k.startswith("_")})
    return names


def calls_course_checks(source: str) -> bool:
    """Whether a test cell calls one of the course's checks (else it is an ordinary nbgrader test cell)."""
    tree = _parse(source)
    names = check_namespace()
    return tree is not None and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names
                                    for n in ast.walk(tree))


def recheck(notebook: Path, records: Path) -> dict[str, Verdict]:
    """Re-run the checks of every graded cell that calls the course's checks, from the records under
    ``records/<grade_id>``.

    An ordinary nbgrader test cell (plain ``assert`` on the student's objects) records nothing and has
    no verdict here: nbgrader's own rule, the cell's points unless it raised, is its grade.
    """
    nb = nbformat.read(notebook, as_version=4)
    verdicts = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or not calls_course_checks(cell.source):
            continue
        grade_id = meta["grade_id"]
        names = _Names(check_namespace())
        names.update(torch=torch, math=math)
        try:
            with replaying(records / grade_id):
                exec(compile(cell.source, f"<graded cell {grade_id}>", "exec"), {"__builtins__": builtins}, names)
        except CheckFailure as failure:
            verdicts[grade_id] = Verdict(grade_id, False, str(failure))
        except Exception as error:
            verdicts[grade_id] = Verdict(grade_id, False, f"{type(error).__name__}: {error}")
        else:
            verdicts[grade_id] = Verdict(grade_id, True)
    return verdicts


def exercise_of(grade_id: str) -> str:
    """``ex1-values`` -> ``ex1``: graded cells and solution cells share the prefix."""
    return re.split(r"[-_]", grade_id, maxsplit=1)[0]


@dataclass
class Finding:
    exercise: str  # "ex1", ... or "*" for a cell outside the exercises
    kind: str  # "reference": that exercise scores 0; "tampering": every later check scores 0; "review": a note
    what: str
    cell: int = 0  # the cell's index in the notebook


def reference_use(notebook: Path) -> list[Finding]:
    """What the student's own cells reach for that a solution has no business using."""
    nb = nbformat.read(notebook, as_version=4)
    student_cells = []
    exercise = "*"
    for index, cell in enumerate(nb.cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade_id") and meta.get("solution"):
            exercise = exercise_of(meta["grade_id"])
        # The course's own (locked) cells may name anything; the student's may not.
        if cell.cell_type == "code" and not meta.get("locked") and not meta.get("grade"):
            student_cells.append((exercise if meta.get("solution") else "*", cell.source, index))
    own, bound = set(), set()
    for _, source, _ in student_cells:
        own |= _defined(source)
        bound |= _bound_by_student(_parse(source))
    torch_names = frozenset({"torch"} | {a.asname or a.name for cell in nb.cells if cell.cell_type == "code"
                                         and (tree := _parse(cell.source)) for n in ast.walk(tree)
                                         if isinstance(n, ast.Import) for a in n.names if a.name == "torch"})
    forbidden = _forbidden_by_exercise(nb)
    everything = {name: label for names in forbidden.values() for name, label in names.items()}
    findings = []
    for exercise, source, index in student_cells:
        tree = _parse(source)
        if tampering := _tampering(tree, bound):
            findings.append(Finding(exercise, "tampering", tampering, index))
        elif what := _suspect(source, tree, own | bound, forbidden.get(exercise, everything if exercise == "*" else {}),
                              torch_names):
            # Comparing with PyTorch in a scratch cell is honest; inside a solution it is not.
            findings.append(Finding(exercise, "reference" if exercise != "*" else "review", what, index))
    return findings


def _forbidden_by_exercise(nb: nbformat.NotebookNode) -> dict[str, dict[str, str]]:
    """Exercise -> {short name: label} of the built-ins its checks forbid (``@check(forbid=...)``)."""
    found: dict[str, dict[str, str]] = {}
    checks = check_namespace()
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or (tree := _parse(cell.source)) is None:
            continue
        names = found.setdefault(exercise_of(meta["grade_id"]), {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                for dotted, label in getattr(checks.get(node.func.id), "forbid", {}).items():
                    names[dotted.rpartition(".")[2]] = label
    return found


# Reaching into the checks' machinery (or into Python's own) has no honest use in a student cell.
# ``modules`` is not here: ``model.modules()`` is everyday PyTorch; ``sys.modules`` is caught apart.
TAMPER_ATTRS = {"__globals__", "__code__", "__closure__", "__wrapped__", "__builtins__", "__kwdefaults__",
                "__defaults__", "__subclasses__", "f_globals", "f_locals", "f_back", "f_builtins", "tb_frame",
                "gi_frame", "cr_frame", "_getframe", "__module__"}
# Modules whose every use is tampering, and the few honest uses of two of them.
TAMPER_MODULES = ("stepformer.checks", "builtins", "importlib", "ctypes", "gc", "inspect")
HONEST_USES = {
    # Counting and freeing memory; not get_referrers/get_referents, which lead from a check to its internals.
    "gc": {"collect", "get_objects", "get_count", "get_stats", "isenabled", "enable", "disable", "get_threshold",
           "set_threshold"},
    # Reading signatures and source; not currentframe/getmodule/getmembers, which lead to a check's internals.
    "inspect": {"signature", "getsource", "getsourcelines", "getsourcefile", "getfile", "getdoc", "cleandoc",
                "getfullargspec", "isfunction", "isclass", "ismethod", "ismodule", "isbuiltin", "Parameter",
                "Signature"},
    # Reloading a module of one's own after editing it; not import_module, the way to the machinery by name.
    "importlib": {"reload"},
}
# Found inside string constants (pieces joined, and reversed): names with no honest use in a string.
TAMPER_TEXT = ("stepformer.checks", "__globals__", "__builtins__", "__wrapped__", "__code__", "__closure__",
               "__kwdefaults__", "__defaults__", "__subclasses__", "sys.modules", "f_globals", "_getframe",
               RECORD_ENV)  # where the kernel writes the records: writing them by hand is forging them
TAMPER_WORDS = ("builtins", "importlib", "ctypes", "_core")
# PyTorch's internal operators: the same computation as a forbidden function, reached around its name.
TORCH_INTERNALS = {"_C", "_VF", "_refs", "_decomp", "_prims", "aten"}
IMPORTERS = {"__import__", "import_module"}
RUNTIME_CODE = {"exec", "eval", "compile"}
ATTRIBUTE_GETTERS = {"getattr", "setattr", "hasattr", "delattr"}


def _core_private_names() -> set[str]:
    """The checks' private machinery (``_call_own_work``, ``_tripwires``, ...): a student cell never names it."""
    from stepformer.checks import _core

    return {n for n in vars(_core) if n.startswith("_") and not n.startswith("__") and len(n) >= 7}


def _static_str(node: ast.AST) -> str | None:
    """The value of a string built from constants: ``"a" + "b"``, ``"ba"[::-1]``, ``"".join(["a", "b"])``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _static_str(node.left), _static_str(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.JoinedStr):
        parts = [_static_str(v) for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and (text := _static_str(node.value)):
        with contextlib.suppress(Exception):
            return text[slice(*(ast.literal_eval(p) if p is not None else None
                                for p in (node.slice.lower, node.slice.upper, node.slice.step)))]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and (glue := _static_str(node.func.value)) is not None and len(node.args) == 1
            and isinstance(node.args[0], ast.List | ast.Tuple)):
        parts = [_static_str(e) for e in node.args[0].elts]
        return None if None in parts else glue.join(parts)
    return None


def _attribute_accesses(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """(object, attribute name) for ``x.a``, ``getattr(x, "a")`` and ``vars(x)["a"]`` / ``x.__dict__["a"]``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.append((node.value, node.attr))
        elif isinstance(node, ast.Call) and _called(node) in ATTRIBUTE_GETTERS and len(node.args) >= 2:
            if (name := _static_str(node.args[1])) is not None:
                found.append((node.args[0], name))
        elif isinstance(node, ast.Subscript) and (name := _static_str(node.slice)) is not None:
            holder = node.value
            if isinstance(holder, ast.Call) and _called(holder) == "vars" and holder.args:
                found.append((holder.args[0], name))
            elif isinstance(holder, ast.Attribute) and holder.attr == "__dict__":
                found.append((holder.value, name))
    return found


def _called(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def _strings(tree: ast.Module) -> list[str]:
    """The cell's string constants in source order, docstrings left out (they describe, never run)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    constants = [n for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]
    return [n.value for n in sorted(constants, key=lambda n: (n.lineno, n.col_offset))]


def _readings(tree: ast.Module) -> list[str]:
    """Every way the cell's strings could be read as a name: each piece and all of them joined,
    with white space squashed, forwards and reversed."""
    pieces = ["".join(p.split()) for p in _strings(tree)]
    texts = [*pieces, "".join(pieces)]
    return texts + [t[::-1] for t in texts]


def _dynamic_modules(tree: ast.Module) -> set[str]:
    """Names bound to a module imported at run time (``m = importlib.import_module(...)``, ``__import__``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            if any(isinstance(c, ast.Call) and _called(c) in IMPORTERS for c in ast.walk(node.value)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names


def _within(module: str, packages: tuple[str, ...]) -> bool:
    """``module`` is one of ``packages`` or inside one (``gc`` and ``gc.x``, not ``gcsfs``)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def _is_sys(node: ast.AST, sys_names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in sys_names
    return (isinstance(node, ast.Call) and _called(node) in IMPORTERS and bool(node.args)
            and _static_str(node.args[0]) == "sys")


def _bound_by_student(tree: ast.Module | None) -> set[str]:
    """Names the student's code gives a value: functions, classes, variables, ``self.<attr>``."""
    if tree is None:
        return set()
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node.value):
            bound.add(node.attr)
    return bound


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _tampering(tree: ast.Module | None, own: set[str] = frozenset()) -> str | None:
    """The first reach into the grading machinery, Python's internals or ``sys.modules``, if any.

    ``own``: names the student's cells bind themselves (a helper called ``_current`` is theirs).
    """
    if tree is None:
        return None
    private = _core_private_names() - set(own)
    sys_names = {"sys"} | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                           for a in n.names if a.name == "sys"}
    dynamic = _dynamic_modules(tree)
    honest_reads = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.attr in HONEST_USES.get(n.value.id, ())}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            if isinstance(node, ast.Import):
                imported = [(a.name, None) for a in node.names]
            else:
                imported = [(node.module or "", a.name) for a in node.names]
            for module, name in imported:
                if module == "sys" and name in ("modules", "_getframe"):
                    return t("imports sys.{name}", name=name)
                if module.split(".")[0] in HONEST_USES and (name is None or name in HONEST_USES[module.split(".")[0]]):
                    continue  # ``import gc`` then ``gc.collect()``: its uses are judged below
                if module == "stepformer" and name == "checks":
                    module = "stepformer.checks"
                if _within(module, TAMPER_MODULES):
                    return t("imports {module}, the grading machinery or Python's internals", module=module)
        elif isinstance(node, ast.Name):
            if node.id in ("__builtins__", "ctypes", "builtins") or node.id in private:
                return t("uses {name}", name=node.id)
            if node.id in HONEST_USES and id(node) not in honest_reads and node.id not in own:
                return t("uses {name} (only {allowed} is allowed)", name=node.id,
                         allowed=", ".join(sorted(HONEST_USES[node.id])))
    for node in ast.walk(tree):
        # Code compiled at run time cannot be read here: a solution has no use for it.
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in RUNTIME_CODE
                and not getattr(node, "code_was_read", False)):
            return t("runs code built at run time ({call})", call=node.func.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "run_cell", "run_code", "run_source", "runcode", "runsource"):
            return t("runs code built at run time ({call})", call=node.func.attr)
    for holder, attr in _attribute_accesses(tree):
        if attr in TAMPER_ATTRS:
            return t("reaches into .{attr}", attr=attr)
        if attr == "modules" and _is_sys(holder, sys_names):
            return t("reaches into sys.modules")
        if attr in ("checks", "_core") and not _on_self(holder):
            return t("reaches into .{attr}, the grading machinery", attr=attr)
        if attr in private and not _on_self(holder):
            return t("reaches into .{attr}, the grading machinery", attr=attr)
        fetched = (isinstance(holder, ast.Name) and holder.id in dynamic) or (
            isinstance(holder, ast.Call) and _called(holder) in IMPORTERS)
        if fetched and attr.startswith("_") and not attr.startswith("__") and attr not in TORCH_INTERNALS:
            return t("reaches into .{attr} of a module fetched at run time", attr=attr)
    for node in ast.walk(tree):
        # Rebinding something inside a module fetched at run time: how a check's helpers are swapped.
        target = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            target = node.value
        elif isinstance(node, ast.Call) and _called(node) in ("setattr", "delattr") and node.args:
            target = node.args[0]
        if target is not None and not _on_self(target) and (
                (isinstance(target, ast.Name) and target.id in dynamic)
                or (isinstance(target, ast.Call) and _called(target) in IMPORTERS)):
            return t("rebinds an attribute of a module fetched at run time")
    for text in _readings(tree):
        for word in TAMPER_TEXT:
            if word in text:
                return t("names {word} in a string", word=word)
        for word in (*TAMPER_WORDS, *private):
            if re.search(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", text):
                return t("names {word} in a string", word=word)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) in IMPORTERS and node.args:
            name = _static_str(node.args[0]) or ""
            for text in (name, name[::-1]):
                if _within(text, TAMPER_MODULES) or text == "sys.modules":
                    return t("imports {text} by name, the grading machinery or Python's internals", text=text)
    return None


def _parse(source: str) -> ast.Module | None:
    """The cell as Python: IPython's syntax (``%time``, ``!ls``, ``%%capture``) translated as the
    kernel does, and the code that a magic runs (``%time f()``, a ``%%capture`` body) read as code too."""
    with contextlib.suppress(Exception):
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(source)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None  # the kernel cannot run it either
    for node in list(ast.walk(tree)):
        if isinstance(node, ast.Call) and _called(node) in ("run_line_magic", "run_cell_magic"):
            for arg in node.args[1:]:
                if (text := _static_str(arg)) and (inner := _parse(_without_options(text))) is not None:
                    tree.body.extend(inner.body)
                    if isinstance(arg, ast.Constant):
                        arg.value = ""  # read as code now, not again as a string
        # ``eval("2 * 3")``: code written out in one literal is as readable as any other line.
        # Only code assembled at run time (``eval("F." + name)``) stays unreadable.
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in RUNTIME_CODE
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (inner := _parse(node.args[0].value)) is not None):
            tree.body.extend(inner.body)
            node.args[0].value = ""
            node.code_was_read = True  # see _tampering
    return tree


def _without_options(line: str) -> str:
    """A magic's code without its leading options: ``-n 3 -r 2 f(x)`` -> ``f(x)`` (``%timeit``, ``%prun``)."""
    words = line.split(" ")
    while words and re.fullmatch(r"-\w+", words[0]):
        words = words[1:]
        if words and re.fullmatch(r"[\w.]+", words[0]) and words[0][:1].isdigit():
            words = words[1:]  # the option's value
    return " ".join(words)


def _defined(source: str) -> set[str]:
    tree = _parse(source)
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)} if tree else set()


DYNAMIC = {"getattr", "__import__", "import_module", "eval", "exec", "compile"}


def _torch_internals(tree: ast.Module, torch_names: set[str]) -> str | None:
    """``torch.ops.aten.x``, ``torch._C._nn.x``, ``torch._VF.x``, ... (also fetched by name)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                modules = [f"torch.{a.name}" for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "torch" and len(parts) > 1 and (parts[1] in TORCH_INTERNALS or parts[1] == "ops"):
                    return t("{name} (PyTorch's internal operators)", name=module)
    for holder, attr in _attribute_accesses(tree):
        if attr in TORCH_INTERNALS and not _on_self(holder):
            return t("{name} (PyTorch's internal operators)", name=attr)
        on_torch = (isinstance(holder, ast.Name) and holder.id in torch_names) or (
            isinstance(holder, ast.Call) and _called(holder) in (*IMPORTERS, "getattr"))
        if attr == "ops" and on_torch:
            return t("{name} (PyTorch's internal operators)", name="torch.ops")
    return None


def _star_imported(module: str, names: dict[str, str]) -> str | None:
    """The first of ``names`` that ``from module import *`` brings in (only PyTorch's modules are looked at)."""
    if module.split(".")[0] != "torch":
        return None
    try:
        imported = importlib.import_module(module)
    except Exception:
        return None
    public = getattr(imported, "__all__", None) or [n for n in vars(imported) if not n.startswith("_")]
    return next((name for name in names if name in public), None)


def _suspect(source: str, tree: ast.Module | None, own: set[str], names: dict[str, str],
             torch_names: frozenset[str] = frozenset({"torch"})) -> str | None:
    """The first forbidden built-in (``names``), library module or PyTorch internal that ``source`` reaches for."""
    if tree is None:
        for name, label in names.items():
            if re.search(rf"\b{name}\b", source):
                return t("{name} ({label})", name=name, label=tr(label))
        return None
    if internal := _torch_internals(tree, set(torch_names)):
        return internal
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.startswith(SUSPECT_MODULES) and not module.startswith(ALLOWED_MODULES):
                    return t("{name} (the course's reference library)", name=module)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name in names:
                        return t("{name} ({label})", name=alias.name, label=tr(names[alias.name]))
                    if alias.name == "*" and (star := _star_imported(node.module or "", names)):
                        return t("{name} ({label}, imported with *)", name=star, label=tr(names[star]))
        if isinstance(node, ast.Name) and node.id in names and node.id not in own:
            return t("{name} ({label})", name=node.id, label=tr(names[node.id]))
        if isinstance(node, ast.Call) and (func := _called(node)) in DYNAMIC:
            # A name built from strings at run time: look at the pieces.
            text = "".join("".join(c.value.split()) for a in node.args for c in ast.walk(a)
                           if isinstance(c, ast.Constant) and isinstance(c.value, str))
            for suspect in (*names, *SUSPECT_MODULES):
                if suspect in text or suspect in text[::-1]:
                    return t("{name} (reached by name through {call})", name=suspect, call=func)
    for _, attr in _attribute_accesses(tree):
        if attr in names:
            return t("{name} ({label})", name=attr, label=tr(names[attr]))
    # A forbidden name anywhere in the cell's strings, joined or reversed: ``vars(F)["...."[::-1]]``.
    for text in _readings(tree):
        for name, label in names.items():
            if name in text:
                return t("{name} ({label}, named in a string)", name=name, label=tr(label))
    return None
