"""The library is built in chapter order: a module of chapter n imports only modules of chapters <= n
(stepformer.chapters.CHAPTER), and the checks never import the library."""

import ast
from pathlib import Path

import pytest

from stepformer.chapters import CHAPTER

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stepformer"
SEPARATE = ("checks", "course")  # not chapters: the checks and the course tools
# Forward imports that the layering has not removed yet, each (importer, imported): the list may only
# shrink. Chapter 08's Transformer is still built from chapter 10's configured parts.
NOT_YET: set[tuple[str, str]] = set()


def top(module: str) -> str:
    """``stepformer.translator.train`` -> ``translator``: a package's modules share its chapter."""
    return module.split(".")[1]


def imports(path: Path) -> list[tuple[str, int]]:
    """Every ``stepformer.*`` module that ``path`` imports, anywhere in the file, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("stepformer.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "stepformer":
                found += [(f"stepformer.{a.name}", node.lineno) for a in node.names]
            elif node.module.startswith("stepformer."):
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: a relative import; write stepformer.<module> so it is checked")
    return found



def forward_imports(root: Path = PACKAGE) -> list[tuple[str, str, str]]:
    """``(importer, imported, where)`` for every import of a later chapter's module (or of checks/course)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in SEPARATE or parts == ("__init__",) or parts == ("chapters",):
            continue
        importer = parts[0]
        for module, line in imports(path):
            imported = top(module)
            if imported in SEPARATE or imported not in CHAPTER or CHAPTER[imported] > CHAPTER[importer]:
                found.append((importer, imported, f"{path.relative_to(root.parent)}:{line} imports {module}"))
    return found


def test_every_module_has_a_chapter():
    names = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name != "__init__.py"}
    assert names - set(SEPARATE) - {"chapters"} == set(CHAPTER), "stepformer.chapters.CHAPTER must name every module"


def test_no_module_imports_a_later_chapter():
    found = forward_imports()
    new = [where for importer, imported, where in found if (importer, imported) not in NOT_YET]
    assert not new, "a module imports a later chapter's module (or checks/course):\n" + "\n".join(new)
    gone = NOT_YET - {(importer, imported) for importer, imported, _ in found}
    assert not gone, f"these forward imports are gone: remove them from NOT_YET: {sorted(gone)}"


def test_the_package_itself_imports_nothing():
    assert imports(PACKAGE / "__init__.py") == []


def test_the_checks_never_import_the_library():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted((PACKAGE / "checks").rglob("*.py"))
             for module, line in imports(path) if top(module) != "checks"]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("forward", "imported"), [
    ("from stepformer.gqa import GroupedQueryAttention\n", "gqa"),
    ("import stepformer.scale\n", "scale"),
    ("def f():\n    from stepformer.translator.train import train\n", "translator"),
    ("from stepformer import models\n", "models"),
    ("from stepformer.course.grade import grade\n", "course"),
], ids=["from-import", "import", "inside a function", "from the package", "a course tool"])
def test_a_forward_import_added_to_an_early_chapter_fails(tmp_path, forward, imported):
    copy = tmp_path / "stepformer"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    assert not [f for f in forward_imports(copy) if f[:2] not in NOT_YET]
    (copy / "masks.py").write_text((copy / "masks.py").read_text() + "\n" + forward)
    assert [(i, m) for i, m, _ in forward_imports(copy) if (i, m) not in NOT_YET] == [("masks", imported)]
