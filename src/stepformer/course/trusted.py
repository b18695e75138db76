"""The grader's own verdict on each graded cell, reached without running student code.

Each graded cell of the autograded notebook (nbgrader has restored its source, hidden checks
included) is run again here, in the grader's process, with the student's objects replaced by
placeholders: the checks replay the results that the student's kernel recorded (see
``stepformer.checks._core``). Patching in the student's kernel cannot reach this process.

The student's own cells are also read as text: one that reaches for a reference
implementation by name (the course library, PyTorch's built-in attention) loses the points of
its exercise, even where the kernel-side tripwires were dodged.
"""

import ast
import builtins
import importlib
import math
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import torch

import stepformer.checks
from stepformer.checks._core import CheckFailure, replaying

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


def recheck(notebook: Path, records: Path) -> dict[str, Verdict]:
    """Re-run every graded cell's checks from the records under ``records/<grade_id>``."""
    nb = nbformat.read(notebook, as_version=4)
    verdicts = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade"):
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
    kind: str  # "reference": that exercise scores 0; "tampering": everything scores 0; "review": a note
    what: str


def reference_use(notebook: Path) -> list[Finding]:
    """What the student's own cells reach for that a solution has no business using."""
    nb = nbformat.read(notebook, as_version=4)
    student_cells = []
    exercise = "*"
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade_id") and meta.get("solution"):
            exercise = exercise_of(meta["grade_id"])
        # The course's own (locked) cells may name anything; the student's may not.
        if cell.cell_type == "code" and not meta.get("locked") and not meta.get("grade"):
            student_cells.append((exercise if meta.get("solution") else "*", cell.source))
    own = set()
    for _, source in student_cells:
        own |= _defined(source)
    forbidden = _forbidden_by_exercise(nb)
    everything = {name: label for names in forbidden.values() for name, label in names.items()}
    findings = []
    for exercise, source in student_cells:
        tree = _parse(source)
        if tampering := _tampering(tree):
            findings.append(Finding(exercise, "tampering", tampering))
        elif what := _suspect(source, tree, own, forbidden.get(exercise, everything if exercise == "*" else {})):
            # Comparing with PyTorch in a scratch cell is honest; inside a solution it is not.
            findings.append(Finding(exercise, "reference" if exercise != "*" else "review", what))
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


# Reaching into the checks' machinery has no honest use in a solution.
TAMPER_ATTRS = {"__globals__", "__code__", "__closure__", "__wrapped__", "__builtins__", "modules", "__kwdefaults__",
                "__defaults__"}


def _tampering(tree: ast.Module | None) -> str | None:
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.startswith(ALLOWED_MODULES) or module == "builtins":
                    return f"imports {module}, the grading machinery"
        if isinstance(node, ast.Attribute) and node.attr in TAMPER_ATTRS:
            return f"reaches into .{node.attr}"
    return None


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None  # IPython magics and the like


def _defined(source: str) -> set[str]:
    tree = _parse(source)
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)} if tree else set()


DYNAMIC = {"getattr", "__import__", "import_module", "eval", "exec", "compile"}


def _suspect(source: str, tree: ast.Module | None, own: set[str], names: dict[str, str]) -> str | None:
    """The first forbidden built-in (``names``) or library module that ``source`` reaches for."""
    if tree is None:
        for name, label in names.items():
            if re.search(rf"\b{name}\b", source):
                return f"{name} ({label})"
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.startswith(SUSPECT_MODULES) and not module.startswith(ALLOWED_MODULES):
                    return f"{module} (the course's reference library)"
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name in names:
                        return f"{alias.name} ({names[alias.name]})"
        if isinstance(node, ast.Attribute) and node.attr in names:
            return f"{node.attr} ({names[node.attr]})"
        if isinstance(node, ast.Name) and node.id in names and node.id not in own:
            return f"{node.id} ({names[node.id]})"
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in DYNAMIC:
                # A name built from strings at run time: look at the pieces.
                text = " ".join(c.value for a in node.args for c in ast.walk(a)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                squashed = text.replace(" ", "")
                for suspect in (*names, *SUSPECT_MODULES):
                    if suspect in squashed and "stepformer.checks" not in squashed:
                        return f"{suspect} (reached by name through {func})"
    return None
