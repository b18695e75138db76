"""Solution cells are generated from the library, never edited by hand.

A solution cell carries ``metadata.stepformer.library = "module.function"``. Its text is that
function's source from ``src/``: decorators, signature and docstring are what the student sees;
the body becomes the ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block that nbgrader
replaces with a stub in the release.
"""

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def solution_source(qualified_name: str) -> str:
    """The solution cell text for ``module.function``."""
    module_name, _, function_name = qualified_name.rpartition(".")
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    lines = inspect.getsource(module).splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function_name:
            break
    else:
        raise LookupError(f"{qualified_name}: no top-level function {function_name!r} in {module.__file__}")
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        header_end, body = body[0].end_lineno, body[1:]
    else:
        header_end = node.body[0].lineno - 1
    if not body:
        raise LookupError(f"{qualified_name} has no body to hide")
    # Comments above the first statement belong to the body, not to the header.
    indent = " " * body[0].col_offset
    header = lines[first:header_end]
    solution = lines[header_end:node.end_lineno]
    return "\n".join([*header, indent + BEGIN, *solution, indent + END])


@dataclass
class Stale:
    notebook: Path
    cell_id: str
    library: str


def sync(root: Path, check: bool = False) -> list[Stale]:
    """Rewrite every library-backed solution cell under ``root/solutions``.

    With ``check=True`` nothing is written; the stale cells are returned.
    """
    stale: list[Stale] = []
    for path in sorted((root / "solutions").glob("*/*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        changed = False
        for cell in nb.cells:
            library = cell.metadata.get("stepformer", {}).get("library")
            if not library:
                continue
            wanted = solution_source(library)
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
