"""The class edition: the course without its answers, for a class whose grades must measure the students' work.

Built from the same sources as the open edition:

- :func:`class_notebook`: a notebook whose "given" cells (earlier chapters' answers, printed in
  full in the open edition) load the student's own earlier answer instead, or the course's copy
  where it is installed (the grader's machine: see :mod:`stepformer.checks.given`), and whose
  set-up cell installs the students' package rather than the whole course;
- :func:`build_student_dist`: that package, ``stepformer-checks``: the exercise checks without
  the reference implementations (``import stepformer.attention`` fails where only it is installed);
- :func:`write_class_course`: both, as an instructor's nbgrader ``source/`` folder, its
  ``release/`` (the students' copies), and the wheel to hand out (a hub's image, or a web
  address for Colab);
- :func:`class_release_notebook`: :func:`class_notebook` of a released notebook, with nbgrader's checksums
  (what that release holds): the class site's exercise pages show and download it;
- the book's extension (``book/_ext/stepformer_edition.py``) uses :func:`graded_answers` to replace each
  graded function's code by a note pointing to its exercise (the open edition folds it after the exercise),
  and, in the open edition only, :func:`open_notebook` to show each hand-graded answer's rubric, folded.
"""

import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import nbformat

from stepformer.checks._messages import marked
from stepformer.course.paths import assignments
from stepformer.course.sync import GIT_INSTALL, course_install

DIST_NAME = "stepformer-checks"
# The open edition's set-up cell installs the whole course from its repository, whose address has one
# place, _config.yml's repository.url (`stepformer-course sync` fills the notebooks from it). COURSE_INSTALL,
# read from this checkout's _config.yml when first used, is that argument as the cell quotes it.
QUOTED_INSTALL = re.compile(f'"{GIT_INSTALL.pattern}"')
# What the checks and the notebooks import; the translator's own packages serve the full library only.
STUDENT_DEPENDENCIES = ("torch", "einops", "jaxtyping", "beartype", "matplotlib", "numpy", "tqdm", "babel")
# The class edition's own prose in its notebooks (their Chinese twins read it from the catalogue `edition.po`):
# the note above the given cells, and the phrase it takes out of their introduction.
CLASS_NOTE_TEXT = marked(
    "**Class edition.** The cells below define your own answers from the earlier chapters' notebooks, "
    "which must lie beside this one's folder as you fetched them. When your work is graded, the course's "
    "versions are used instead, so a mistake there costs no points here."
)
CLASS_NOTE = CLASS_NOTE_TEXT + "\n\n"
SOLUTION_PHRASE = marked(" (this is the course's solution; run the cell)")


class EditionError(RuntimeError):
    """The class edition cannot be built as asked; the message says why."""


@dataclass(frozen=True)
class Answer:
    """A graded function or class: its library name, and the exercise that asks for it."""

    library: str  # "stepformer.attention.scaled_dot_product_attention"
    assignment: str  # "01_attention"
    notebook: str  # "attention.ipynb"
    grade_id: str  # "ex1-solution"

    @property
    def name(self) -> str:
        return self.library.rpartition(".")[2]

    @property
    def exercise(self) -> str:
        number = re.match(r"ex(\d+)", self.grade_id)
        where = f"{self.assignment}/{self.notebook}"
        return f"exercise {number.group(1)} of {where}" if number else where


def graded_answers(root: Path) -> dict[str, Answer]:
    """Every library function or class that a solution cell hands to students to write, by library name."""
    found: dict[str, Answer] = {}
    for assignment in assignments(root):
        for path in sorted((root / "solutions" / assignment).glob("*.ipynb")):
            for cell in nbformat.read(path, as_version=4).cells:
                meta = cell.metadata.get("stepformer", {})
                if meta.get("library") and not meta.get("given"):
                    grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "")
                    found.setdefault(meta["library"], Answer(meta["library"], assignment, path.name, grade_id))
    return found


def given_cell_source(answer: Answer) -> str:
    """What a class edition's given cell runs instead of printing the answer."""
    return (f"# {answer.name}: your answer to {answer.exercise} (the grader uses the course's copy).\n"
            "from stepformer.checks.given import given\n\n"
            f'given("{answer.library}", "{answer.assignment}/{answer.notebook}", globals())')


def class_notebook(nb: nbformat.NotebookNode, answers: dict[str, Answer], package: str) -> nbformat.NotebookNode:
    """The class edition of a notebook (a copy): given answers loaded, not printed; the students' package installed.

    ``package`` is what the set-up cell gives to pip: the wheel's web address, or its file name.
    """
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        meta = cell.metadata.get("stepformer", {})
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "")
        if meta.get("given") and meta.get("library") in answers:
            cell.source = given_cell_source(answers[meta["library"]])
            cell.outputs, cell.execution_count = [], None
        elif grade_id == "given-intro" and cell.cell_type == "markdown":
            cell.source = CLASS_NOTE + cell.source.replace(SOLUTION_PHRASE, "")
        elif grade_id == "setup" and (install := QUOTED_INSTALL.search(cell.source)):
            cell.source = cell.source.replace(
                "this installs the course's\n# checks",
                "this installs the course's\n# checks (the class edition's package: the checks without the answers)",
            ).replace(install.group(), json.dumps(package))
    return nb


def class_release_notebook(nb: nbformat.NotebookNode, answers: dict[str, Answer],
                           package: str) -> nbformat.NotebookNode:
    """The class edition of a released notebook (``exercises/``): :func:`class_notebook`, with nbgrader's checksum
    of each locked cell it changed computed again. It is the notebook that nbgrader releases from the class
    edition's source (what :func:`write_class_course` hands out), which the class site serves."""
    from nbgrader.utils import compute_checksum

    out = class_notebook(nb, answers, package)
    for before, cell in zip(nb.cells, out.cells, strict=True):
        meta = cell.metadata.get("nbgrader", {})
        # A stale checksum would make nbgrader's Validate report the cell as changed by the student.
        if "checksum" in meta and cell.source != before.source:
            meta["checksum"] = compute_checksum(cell)
    return out


SOLUTION = re.compile(r"^### BEGIN SOLUTION\n(.*?)^### END SOLUTION", re.MULTILINE | re.DOTALL)
RUBRIC_TITLE = "What a full-mark answer contains (open once you have written yours)"


def hand_graded(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    """A notebook's answers graded by hand: its markdown cells that nbgrader marks as graded solutions."""
    return [cell for cell in nb.cells if cell.cell_type == "markdown"
            and cell.metadata.get("nbgrader", {}).get("grade") and cell.metadata["nbgrader"].get("solution")]


def rubrics(solution: nbformat.NotebookNode) -> dict[str, str]:
    """grade_id -> the rubric of each hand-graded answer: the solution of its cell in ``solutions/``."""
    found = {}
    for cell in hand_graded(solution):
        if match := SOLUTION.search(cell.source):
            found[cell.metadata["nbgrader"]["grade_id"]] = match.group(1).strip()
    return found


def open_notebook(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The open edition of an exercise notebook for the site (a copy): after each hand-graded answer, its rubric
    from the solution notebook, in a collapsed block (the book's ``stepformer-folded`` directive)."""
    nb, marks = copy.deepcopy(nb), rubrics(solution)
    for cell in reversed(hand_graded(nb)):
        rubric = marks.get(cell.metadata["nbgrader"]["grade_id"])
        if rubric:
            folded = nbformat.v4.new_markdown_cell(f"::::{{stepformer-folded}} {RUBRIC_TITLE}\n{rubric}\n::::")
            nb.cells.insert(nb.cells.index(cell) + 1, folded)
    return nb


def wheel_name(root: Path) -> str:
    """The file name of the students' wheel that :func:`build_student_dist` builds from ``root``."""
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    return f"{DIST_NAME.replace('-', '_')}-{version}-py3-none-any.whl"


def build_student_dist(root: Path, out: Path) -> Path:
    """Build the students' wheel (``stepformer-checks``: the checks, no reference code) into ``out``; its path."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if re.split(r"[=<>~!\[ ]", d, maxsplit=1)[0] in STUDENT_DEPENDENCIES]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stepformer-checks-") as tmp:
        work = Path(tmp)
        package = work / "src" / "stepformer"
        shutil.copytree(root / "src" / "stepformer" / "checks", package / "checks",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (package / "__init__.py").write_text(
            '"""Transformers, Step by Step, class edition: the exercise checks, without the reference '
            'implementations."""\n')
        shutil.copy(root / "LICENSE", work / "LICENSE")
        (work / "pyproject.toml").write_text("\n".join([
            "[build-system]",
            'requires = ["setuptools>=68"]',
            'build-backend = "setuptools.build_meta"',
            "",
            "[project]",
            f'name = "{DIST_NAME}"',
            f'version = "{project["version"]}"',
            'description = "Transformers, Step by Step: the exercise checks of the class edition, without the '
            'answers"',
            f'requires-python = "{project["requires-python"]}"',
            'license = "MIT"',
            'license-files = ["LICENSE"]',
            f"dependencies = {json.dumps(pins)}",
            "",
            "[tool.setuptools.packages.find]",
            'where = ["src"]',
            "",
            "[tool.setuptools.package-data]",
            '"stepformer.checks" = ["locale/zh_CN/LC_MESSAGES/*.po"]',
            "",
        ]))
        # No build isolation: setuptools is already here, and nothing needs downloading.
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                               "--wheel-dir", str(out), str(work)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise EditionError(f"pip could not build the students' wheel:\n{proc.stdout}{proc.stderr}")
    wheel = out / wheel_name(root)
    if not wheel.is_file():
        raise EditionError(f"pip built no {wheel.name} in {out}")
    return wheel


def write_class_course(root: Path, out: Path, package_url: str | None = None, names: list[str] | None = None,
                       *, replace: bool = False) -> tuple[Path, Path]:
    """The class edition's nbgrader ``source/`` and ``release/`` (of ``names``, default all) and the students'
    wheel, under ``out``; returns the source folder and the wheel.

    ``package_url`` is where students' set-up cells fetch the wheel (say, the class site's copy); without it
    the cells name the wheel's file, to install on the hub's image or beside the notebooks. An assignment's
    folder already in ``source/`` or ``release/`` is refused (it may hold an instructor's edits) unless
    ``replace``.
    """
    known = assignments(root)
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        raise EditionError(f"no such assignment: {', '.join(unknown)} (known: {', '.join(known)})")
    source, release_folder = out / "source", out / "release"
    there = [f"{folder.name}/{name}" for folder in (source, release_folder) for name in names or known
             if (folder / name).exists()]
    if there and not replace:
        raise EditionError(f"{out} already has {', '.join(there)}: nothing was written. Pass --replace to "
                           "overwrite them with the class edition, or choose another --out.")
    wheel = build_student_dist(root, out)
    answers = graded_answers(root)
    for assignment in names or known:
        target = source / assignment
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(root / "solutions" / assignment, target,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        for path in sorted(target.glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            nbformat.write(class_notebook(nb, answers, package_url or wheel.name), path)
    # The students' copies (nbgrader's release of that source): what a class without the exchange hands out.
    from stepformer.course.release import release

    for assignment in names or known:
        if (release_folder / assignment).exists():
            shutil.rmtree(release_folder / assignment)
    release(root, release_folder, names or known, source=source)
    return source, wheel


def __getattr__(name: str) -> str:
    if name == "COURSE_INSTALL":  # the checkout holding this module: src/stepformer/course/ -> the repository
        return json.dumps(course_install(Path(__file__).resolve().parents[3]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
