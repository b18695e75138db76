"""Solution notebooks are the library's code; exercises are a fresh nbgrader release with nothing leaked.

That each solution notebook runs and earns every point is tested where it is graded as a student's
(tests/test_chapter_mistakes.py, tests/test_corpus.py for chapter 01); how long each takes is measured by
benchmarks/notebooks.py."""

import json
from pathlib import Path

import nbformat
import pytest

from stepformer.course.paths import assignments
from stepformer.course.release import differences
from stepformer.course.sync import BEGIN, END, sync

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = assignments(ROOT)
pytestmark = pytest.mark.slow


def _notebooks(folder: str) -> list[Path]:
    return sorted((ROOT / folder).glob("*/*.ipynb"))


def test_solution_cells_are_the_library_code():
    stale = sync(ROOT, check=True)
    assert not stale, "run `make sync`: " + ", ".join(f"{s.notebook}:{s.library}" for s in stale)


def test_exercises_are_a_fresh_nbgrader_release():
    assert differences(ROOT) == []


@pytest.mark.parametrize("path", _notebooks("exercises"), ids=lambda p: p.parent.name)
def test_exercises_leak_no_solution_and_no_hidden_test(path):
    text = path.read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text
    source = nbformat.read(ROOT / "solutions" / path.parent.name / path.name, as_version=4)
    released = nbformat.read(path, as_version=4)
    released_code = "\n".join(c.source for c in released.cells)
    for cell in source.cells:
        # Only the lines between each BEGIN and END pair are hidden (a class shows its methods' signatures).
        hidden, inside = [], False
        for line in cell.source.splitlines():
            stripped = line.strip()
            if stripped in (BEGIN, END):
                inside = stripped == BEGIN
            elif inside and stripped and not stripped.startswith(("#", '"""', ")")):
                hidden.append(stripped)
        leaked = [x for x in hidden if len(x) > 12 and x in released_code]
        assert not leaked, f"solution lines in the release: {leaked}"
    stubs = [c for c in released.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    assert stubs and all("raise NotImplementedError()" in c.source for c in stubs if c.cell_type == "code")
    # Answers graded by hand: an empty answer, and nothing of the rubric.
    assert all(c.source == "YOUR ANSWER HERE" for c in stubs if c.cell_type == "markdown")


@pytest.mark.parametrize("path", _notebooks("solutions") + _notebooks("exercises"), ids=str)
def test_notebooks_are_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    assert not [c for c in nb["cells"] if c["cell_type"] == "code" and (c["outputs"] or c["execution_count"])]


@pytest.mark.parametrize("path", _notebooks("solutions"), ids=lambda p: p.parent.name)
def test_every_graded_exercise_states_difficulty_and_time(path):
    nb = nbformat.read(path, as_version=4)
    headings = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Exercise")]
    assert len(headings) >= 3
    for heading in headings:
        first = heading.splitlines()[0]
        assert "★" in first and "min" in first and "point" in first, first
