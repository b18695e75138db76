"""Where the course lives on disk."""

import os
from pathlib import Path


class CourseNotFound(RuntimeError):
    """Raised when no course checkout can be found."""


def course_root(start: Path | None = None) -> Path:
    """The checkout holding ``solutions/`` and ``autograder/nbgrader_config.py``.

    ``STEPFORMER_COURSE_ROOT`` wins; otherwise the current folder and its parents are searched.
    """
    if env := os.environ.get("STEPFORMER_COURSE_ROOT"):
        candidates = [Path(env)]
    else:
        here = (start or Path.cwd()).resolve()
        candidates = [here, *here.parents]
    for folder in candidates:
        if (folder / "autograder" / "nbgrader_config.py").is_file() and (folder / "solutions").is_dir():
            return folder
    raise CourseNotFound(
        "No course checkout found: run this inside the repository (the folder with solutions/ "
        "and autograder/), or set STEPFORMER_COURSE_ROOT."
    )


def assignments(root: Path) -> list[str]:
    """Assignment names (``01_attention``, ...) in the order of the syllabus."""
    return sorted(p.name for p in (root / "solutions").iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def notebook_names(root: Path) -> dict[str, list[str]]:
    """Each assignment's notebooks' file names (nbgrader releases them under the same names)."""
    return {name: sorted(p.name for p in (root / "solutions" / name).glob("*.ipynb")) for name in assignments(root)}
