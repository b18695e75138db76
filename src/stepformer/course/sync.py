"""Solution cells are generated from the library, never edited by hand.

A solution cell carries ``metadata.stepformer.library = "module.function"``. Its text is that
function's source from ``src/``: decorators, signature and docstring are what the student sees;
the body becomes the ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block that nbgrader
replaces with a stub in the release. A class's solution is everything after its docstring.

A locked cell with ``metadata.stepformer = {"library": ..., "given": true}`` holds the whole
source of an earlier chapter's piece, so a notebook can use it without importing the library
(which the own-work rule forbids inside graded code).

The course's repository address has one place, ``repository.url`` in ``_config.yml`` (where the
site's launch buttons read it): every ``git+<address>`` that a solution notebook's code gives to
pip (the set-up cell's install, on Colab) is filled from it too.
"""

import ast
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat

from stepformer.checks.given import given_source

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
# A pip install from a git repository, as the notebooks' code spells it: the course's own package.
GIT_INSTALL = re.compile(r"git\+https?://[^\s\"']+")
CONFIG_URL = "_config.yml's repository.url"


def repository_url(root: Path) -> str:
    """The course's repository address: ``repository.url`` in ``root/_config.yml``, the one place it is written."""
    import yaml  # installed with Jupyter Book (the course's tools), not with the library

    path = root / "_config.yml"
    if not path.is_file():
        raise ValueError(f"{path} is missing: the course's repository address (repository.url) is read from it")
    config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    url = (config.get("repository") or {}).get("url")
    if not isinstance(url, str) or not re.fullmatch(r"https?://\S+", url.strip()):
        raise ValueError(f"{path}: repository.url must be the repository's web address, got {url!r}")
    return url.strip().rstrip("/")


def course_install(root: Path) -> str:
    """What the set-up cells give pip to install the whole course: ``git+`` and the repository's address."""
    return f"git+{repository_url(root)}"


def solution_source(qualified_name: str) -> str:
    """The solution cell text for ``module.function`` (or ``module.Class``: each method's body hidden)."""
    module_name, _, name = qualified_name.rpartition(".")
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            break
    else:
        raise LookupError(f"{qualified_name}: no top-level function or class {name!r} in {module.__file__}")
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    if isinstance(node, ast.FunctionDef):
        return "\n".join(_hide_body(node, lines, first))
    out = lines[first:node.body[0].lineno - 1]
    position = node.body[0].lineno - 1
    for child in node.body:
        start = min([child.lineno, *(d.lineno for d in getattr(child, "decorator_list", []))]) - 1
        out += lines[position:start]  # blank lines and comments between members
        if isinstance(child, ast.FunctionDef):
            out += _hide_body(child, lines, start)
        else:
            out += lines[start:child.end_lineno]
        position = child.end_lineno
    return "\n".join(out)


def _hide_body(node: ast.FunctionDef, lines: list[str], first: int) -> list[str]:
    """Decorators, signature and docstring as they are; the rest between nbgrader's markers."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        header_end, body = body[0].end_lineno, body[1:]
    else:
        header_end = node.body[0].lineno - 1
    if not body:
        raise LookupError(f"{node.name} has no body to hide")
    indent = " " * body[0].col_offset
    return [*lines[first:header_end], indent + BEGIN, *lines[header_end:node.end_lineno], indent + END]


@dataclass
class Stale:
    notebook: Path
    cell_id: str
    library: str


def sync(root: Path, check: bool = False, names: list[str] | None = None) -> list[Stale]:
    """Rewrite every library-backed solution cell under ``root/solutions`` (of the assignments ``names``, or all),
    and every course install (``git+<address>``) in their code cells from ``_config.yml``'s ``repository.url``.

    With ``check=True`` nothing is written; the stale cells are returned.
    """
    stale: list[Stale] = []
    install = course_install(root)
    paths = sorted((root / "solutions").glob("*/*.ipynb"))
    for path in [p for p in paths if names is None or p.parent.name in names]:
        nb = nbformat.read(path, as_version=4)
        changed = False
        for cell in nb.cells:
            if cell.cell_type == "code" and (wanted := GIT_INSTALL.sub(install, cell.source)) != cell.source:
                stale.append(Stale(path.relative_to(root), cell.get("id", "?"), CONFIG_URL))
                cell.source = wanted
                changed = True
            library = cell.metadata.get("stepformer", {}).get("library")
            if not library:
                continue
            given = cell.metadata.get("stepformer", {}).get("given", False)
            wanted = given_source(library) if given else solution_source(library)
            if cell.source != wanted:
                stale.append(Stale(path.relative_to(root), cell.get("id", "?"), library))
                cell.source = wanted
                changed = True
        if changed and not check:
            nbformat.write(nb, path)
    return stale


def describe(stale: list[Stale]) -> str:
    return textwrap.indent(
        "\n".join(f"{s.notebook} cell {s.cell_id}: differs from {s.library}" for s in stale), "  "
    )
