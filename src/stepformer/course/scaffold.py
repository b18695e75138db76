"""``stepformer-course new-assignment NAME``: an instructor's own assignment, ready for nbgrader.

The notebook it writes is an ordinary nbgrader source notebook, in the course's shape: an intro
with the rules, one exercise whose solution cell the release turns into a stub, a test cell of
plain ``assert`` statements (visible tests, then hidden ones), and a manually graded answer whose
solution is the rubric. Edit it, run ``make release``, and grade it like the course's own.
"""

import re
from pathlib import Path

import nbformat

from stepformer.course.paths import assignments

NAME = re.compile(r"^[0-9]{2}_[a-z][a-z0-9_]*$")


class ScaffoldError(ValueError):
    """The name is not usable or the assignment exists already."""


def _meta(grade_id: str, *, grade: bool = False, solution: bool = False, locked: bool = False,
          points: float | None = None) -> dict:
    nbgrader = {"grade_id": grade_id, "grade": grade, "solution": solution, "locked": locked, "schema_version": 3}
    if points is not None:
        nbgrader["points"] = points
    return {"nbgrader": nbgrader}


def new_assignment(root: Path, name: str) -> Path:
    """Write ``solutions/<name>/<topic>.ipynb`` (``12_tokens`` -> ``tokens.ipynb``) and return its path."""
    if not NAME.match(name):
        raise ScaffoldError(f"{name!r}: an assignment name is two digits, an underscore and a lower-case topic "
                            "(letters, digits, underscores), e.g. 12_tokenizers")
    if name in assignments(root) or (root / "solutions" / name).exists():
        raise ScaffoldError(f"solutions/{name} exists already; nothing was written")
    topic = name.split("_", 1)[1]
    v4 = nbformat.v4
    cells = [
        v4.new_markdown_cell(
            f"# {name[:2]} · {topic.replace('_', ' ').capitalize()} — graded exercises\n\n"
            "| exercise | what | points |\n| --- | --- | --- |\n| 1 | `add` | 2 |\n| 2 | predict first | 1 |\n\n"
            "**How to work.** Replace each `raise NotImplementedError()` with your code, then run the test cell "
            "below it. Do not edit or delete the test cells; when your notebook is graded they run again, with "
            "hidden tests added.\n\n"
            "**Own work.** Each exercise's function must be your own code: one that calls a library function "
            "that does the exercise's work scores 0 for that exercise (in scratch cells, printing, plotting, "
            "timing and helpers are all fine). A cell that reaches into the grader or Python's internals "
            "(`stepformer.checks`, `sys.modules`, `builtins`, code built from strings for `eval`/`exec`) "
            "costs the points of every check after it, because the grader can no longer trust what those "
            "checks record.",
            metadata=_meta("intro", locked=True)),
        v4.new_code_cell("import math", metadata=_meta("imports", locked=True)),
        v4.new_markdown_cell("## Exercise 1 · `add` (2 points)\n\nReturn the sum of `a` and `b`.",
                             metadata=_meta("ex1-prompt", locked=True)),
        v4.new_code_cell("def add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION",
                         metadata=_meta("ex1-solution", solution=True)),
        v4.new_code_cell('"""add returns the sum."""\nassert add(2, 2) == 4\nassert add(-1, 1) == 0\n'
                         "### BEGIN HIDDEN TESTS\nassert add(0.5, 0.25) == 0.75\nassert math.isclose(add(0.1, 0.2), "
                         "0.3)\n### END HIDDEN TESTS",
                         metadata=_meta("ex1-tests", grade=True, locked=True, points=2)),
        v4.new_markdown_cell("## Exercise 2 · predict first (1 point, graded by hand)\n\n"
                             "Before you run it: what does `add('2', '2')` return, and why?",
                             metadata=_meta("ex2-prompt", locked=True)),
        v4.new_markdown_cell("### BEGIN SOLUTION\nRubric (1 point): `'22'` — `+` joins strings (0.5); the function "
                             "never converts its arguments to numbers (0.5).\n### END SOLUTION",
                             metadata=_meta("ex2-answer", grade=True, solution=True, points=1)),
    ]
    nb = v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    folder = root / "solutions" / name
    folder.mkdir(parents=True)
    path = folder / f"{topic}.ipynb"
    nbformat.write(nb, path)
    return path
