"""Where the course lives on disk."""

import os
from pathlib import Path


class CourseNotFound(RuntimeError):
    """Raised when no course checkout can be found."""


def _is_course(folder: Path) -> bool:
    return (folder / "autograder" / "nbgrader_config.py").is_file() and (folder / "solutions").is_dir()


def course_root(start: Path | None = None) -> Path:
    """The checkout holding ``solutions/`` and ``autograder/nbgrader_config.py``.

    ``STEPFORMER_COURSE_ROOT`` wins; otherwise the current folder and its parents are searched, then the
    checkout this package was installed from (``pip install -e``), so that commands run in an nbgrader
    course folder elsewhere (way B of the guide) still find the course.
    """
    if env := os.environ.get("STEPFORMER_COURSE_ROOT"):
        if _is_course(Path(env)):
            return Path(env).resolve()
        raise CourseNotFound(f"STEPFORMER_COURSE_ROOT={env} is not a course checkout (it needs solutions/ and "
                             "autograder/nbgrader_config.py)")
    here = (start or Path.cwd()).resolve()
    installed = Path(__file__).resolve().parents[3]  # src/stepformer/course/paths.py -> the checkout
    for folder in [here, *here.parents, installed]:
        if _is_course(folder):
            return folder
    raise CourseNotFound(
        f"No course checkout found in {here} or its parents, nor where stepformer is installed from "
        f"({installed}): run this inside the repository (the folder with solutions/ and autograder/), "
        "or set STEPFORMER_COURSE_ROOT."
    )


def assignments(root: Path) -> list[str]:
    """Assignment names (``01_attention``, ...) in the order of the syllabus."""
    return sorted(p.name for p in (root / "solutions").iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def notebook_names(root: Path) -> dict[str, list[str]]:
    """Each assignment's notebooks' file names (nbgrader releases them under the same names)."""
    return {name: sorted(p.name for p in (root / "solutions" / name).glob("*.ipynb")) for name in assignments(root)}
