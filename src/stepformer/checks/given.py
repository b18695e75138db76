"""Earlier chapters' pieces in a later notebook: the course's copy where it is installed, else the student's own.

A later notebook needs earlier answers (chapter 07's encoder calls chapter 03's attention). The
open edition hands them out as locked cells holding the course's code. The class edition does not
print that code; its locked cell calls :func:`given` instead, which defines the piece in the
notebook's namespace from

- the course's reference library, where it is installed: on the grader's machine, so that a
  mistake in an earlier chapter costs no points in a later one;
- otherwise the student's own answer, read from that chapter's notebook beside this one
  (``../01_attention/attention.ipynb``): in the students' environment, which has the checks only.

Either way the piece becomes a function or class of the notebook, as a locked cell would make it;
nothing is imported from the library into the student's namespace.
"""

import ast
import importlib
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any

from stepformer.checks._messages import t

# A Chinese notebook lies in a zh/ folder inside its assignment's folder (01_attention/zh/attention.ipynb).
TRANSLATION_FOLDER = "zh"


class GivenError(RuntimeError):
    """An earlier piece could not be found: the message says where it was looked for and what to do."""


def given_source(qualified_name: str) -> str:
    """The whole source of the library's ``module.function`` (decorators included), as a locked cell holds it."""
    module_name, _, name = qualified_name.rpartition(".")
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    found = _definition(source, name)
    if found is None:
        raise LookupError(f"{qualified_name}: no top-level function or class {name!r} in {module.__file__}")
    return found


def reference_installed(qualified_name: str) -> bool:
    """Whether the course's reference module of ``module.function`` can be imported here."""
    module_name = qualified_name.rpartition(".")[0]
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a parent package that is not there
        return False


def given(qualified_name: str, notebook: str, namespace: dict[str, Any], *, folder: Path | None = None) -> str:
    """Define ``module.function`` in ``namespace``; say where it came from.

    ``notebook`` is the earlier chapter's notebook as ``"01_attention/attention.ipynb"``, looked
    up in ``folder`` (default: the parent of the working folder, where a course's assignments lie
    side by side, in ``exercises/`` as in nbgrader's fetched assignments). From a Chinese notebook
    (working folder ``07_encoder/zh``) the assignments are two levels up, and the earlier chapter's
    Chinese notebook (``01_attention/zh/attention.ipynb``) is read first, its English one if the
    Chinese one does not answer it.
    """
    name = qualified_name.rpartition(".")[2]
    if reference_installed(qualified_name):
        source, origin = given_source(qualified_name), t("the course's copy")
    else:
        found: tuple[str, str] | None = None
        first_problem: GivenError | None = None
        for shown, path in _candidates(notebook, folder):
            try:
                found = own_answer(path, name), t("your own answer in {notebook}", notebook=shown)
                break
            except GivenError as problem:
                first_problem = first_problem or problem
        if found is None:
            raise first_problem
        source, origin = found
    exec(compile(source, f"<{name}: {origin}>", "exec"), namespace)  # what a locked cell holds, run as one would
    message = f"{name}: {origin}"
    print(message)
    return message


def _candidates(notebook: str, folder: Path | None) -> list[tuple[str, Path]]:
    """Where the earlier chapter's notebook may be, in order: (as messages name it, path)."""
    here = Path.cwd()
    if folder is None and here.name == TRANSLATION_FOLDER:
        chapter, _, file = notebook.rpartition("/")
        translated = f"{chapter}/{TRANSLATION_FOLDER}/{file}"
        return [(translated, here.parent.parent / translated), (notebook, here.parent.parent / notebook)]
    return [(notebook, (folder if folder is not None else here.parent) / notebook)]


def own_answer(path: Path, name: str) -> str:
    """The source of the top-level function or class ``name`` in the notebook at ``path`` (its last definition)."""
    if not path.is_file():
        raise GivenError(t("{name} is an answer of an earlier chapter, and its notebook {path} is not there. Keep the "
                           "course's notebooks side by side (as they were fetched), or ask your instructor.",
                           name=name, path=path))
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GivenError(t("{path} cannot be read as a notebook ({error}): {name} is taken from it.", path=path,
                           error=error, name=name)) from None
    found = None
    for cell in cells:
        if cell.get("cell_type") == "code":
            source = "".join(cell.get("source", []))
            # IPython's magics and shell lines are not Python; blank them out to read the rest.
            python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
            found = _definition(python, name) or found
    if found is None:
        raise GivenError(t("{path} defines no {name}: write it there first (this notebook uses your answer).",
                           path=path, name=name))
    if _unanswered(found):
        raise GivenError(t("{name} in {path} is still the stub that raises NotImplementedError: answer that exercise "
                           "first (this notebook uses your answer).", name=name, path=path))
    return found


def _definition(source: str, name: str) -> str | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    lines = source.splitlines()
    for node in reversed(tree.body):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            return "\n".join(lines[first:node.end_lineno])
    return None


def _unanswered(source: str) -> bool:
    """Whether a function, or any method of a class, is only a docstring and ``raise NotImplementedError``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0]):
                return True
    return False
