"""The class edition: notebooks that load earlier answers instead of printing them, and the students'
package, which holds the checks without the reference code. In an environment with that package
only, the reference modules cannot be imported and every exercise's checks still run and pass."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from stepformer.checks.given import GivenError, given, own_answer
from stepformer.course.edition import (
    CLASS_NOTE,
    COURSE_INSTALL,
    EditionError,
    build_student_dist,
    class_notebook,
    write_class_course,
)
from stepformer.course.paths import assignments
from tests.fixtures.answers import ANSWERS, body_lines

ROOT = Path(__file__).resolve().parents[1]
URL = "https://class.example.org/_static/stepformer_checks-0.1.0-py3-none-any.whl"


def test_every_graded_answer_is_known_with_its_exercise():
    assert len(ANSWERS) >= 40
    attention = ANSWERS["stepformer.attention.scaled_dot_product_attention"]
    assert (attention.assignment, attention.notebook, attention.exercise) == (
        "01_attention", "attention.ipynb", "exercise 1 of 01_attention/attention.ipynb")
    assert ANSWERS["stepformer.translator.recipe.train_step"].assignment == "11_translator"


@pytest.mark.parametrize("assignment", assignments(ROOT))
def test_class_notebooks_print_no_earlier_answer_and_install_the_students_package(assignment):
    for path in sorted((ROOT / "solutions" / assignment).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        open_text = "\n".join(c.source for c in nb.cells)
        out = class_notebook(nb, ANSWERS, URL)
        given_cells = [c for c in out.cells if c.metadata.get("stepformer", {}).get("given")
                       and c.metadata["stepformer"]["library"] in ANSWERS]
        for cell in given_cells:
            library = cell.metadata["stepformer"]["library"]
            assert f'given("{library}", "{ANSWERS[library].assignment}/' in cell.source
            leaked = body_lines(library) & {line.strip() for line in cell.source.splitlines()}
            assert not leaked, (path.name, library, leaked)
        setup = next(c for c in out.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "setup")
        assert json.dumps(URL) in setup.source and COURSE_INSTALL not in setup.source
        assert COURSE_INSTALL in open_text  # the open edition installs the whole course
        intro = [c for c in out.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "given-intro"]
        assert all(c.source.startswith(CLASS_NOTE) and "course's solution" not in c.source for c in intro)
        assert bool(given_cells) == bool(intro), path.name
        # The solutions themselves are untouched: graders and the open edition keep them.
        assert nbformat.read(path, as_version=4) == nb


def _notebook_with(tmp_path: Path, source: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%matplotlib inline\nimport torch"),
                                         nbformat.v4.new_code_cell(source)])
    path = tmp_path / "01_attention" / "attention.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def test_own_answer_is_read_from_the_earlier_notebook_and_a_stub_is_refused(tmp_path):
    _notebook_with(tmp_path, "def double(x):\n    '''Twice x.'''\n    return 2 * x\n\n\ndef unused():\n    pass\n")
    namespace = {}
    given("nowhere.double", "01_attention/attention.ipynb", namespace, folder=tmp_path)
    assert namespace["double"](21) == 42 and "unused" not in namespace
    _notebook_with(tmp_path, "class Half:\n    def __call__(self, x):\n        '''Half x.'''\n"
                             "        raise NotImplementedError()\n")
    with pytest.raises(GivenError, match="still the stub"):
        own_answer(tmp_path / "01_attention" / "attention.ipynb", "Half")
    with pytest.raises(GivenError, match="defines no Third"):
        own_answer(tmp_path / "01_attention" / "attention.ipynb", "Third")
    with pytest.raises(GivenError, match="is not there"):
        own_answer(tmp_path / "02_masks" / "masks.ipynb", "padding_mask")
    (tmp_path / "broken.ipynb").write_text("{not json")
    with pytest.raises(GivenError, match="cannot be read as a notebook"):
        own_answer(tmp_path / "broken.ipynb", "x")


def test_where_the_library_is_installed_the_grader_uses_the_courses_copy(tmp_path, capsys):
    namespace = {}
    exec("import torch\nfrom torch import Tensor, nn\nfrom beartype import beartype\n"
         "from jaxtyping import Bool, Float, jaxtyped\nfrom einops import einsum, rearrange, reduce", namespace)
    given("stepformer.attention.scaled_dot_product_attention", "01_attention/attention.ipynb", namespace,
          folder=tmp_path)  # no notebook there: the course's copy is used
    assert "the course's copy" in capsys.readouterr().out
    import stepformer.attention

    function = namespace["scaled_dot_product_attention"]
    assert function is not stepformer.attention.scaled_dot_product_attention  # a notebook's own function
    assert function.__module__ != "stepformer.attention"


def test_the_class_course_refuses_to_overwrite_an_instructors_source(tmp_path):
    kept = tmp_path / "source" / "01_attention" / "attention.ipynb"
    kept.parent.mkdir(parents=True)
    kept.write_text("my own edits")
    with pytest.raises(EditionError, match="already has source/01_attention: nothing was written"):
        write_class_course(ROOT, tmp_path, URL, ["01_attention", "02_masks"])
    assert kept.read_text() == "my own edits" and not (tmp_path / "source" / "02_masks").exists()
    with pytest.raises(EditionError, match="no such assignment: 99_nope"):
        write_class_course(ROOT, tmp_path, URL, ["99_nope"])
    source, wheel = write_class_course(ROOT, tmp_path, URL, ["01_attention", "02_masks"], replace=True)
    assert wheel.is_file() and nbformat.read(kept, as_version=4).cells
    masks = nbformat.read(source / "02_masks" / "masks.ipynb", as_version=4)
    assert any('given("stepformer.attention.scaled_dot_product_attention"' in c.source for c in masks.cells)
    # The students' copies: stubs, and the earlier answer loaded rather than printed.
    handed_out = (tmp_path / "release" / "02_masks" / "masks.ipynb").read_text()
    assert "raise NotImplementedError()" in handed_out and "BEGIN SOLUTION" not in handed_out
    assert 'given(\\"stepformer.attention.scaled_dot_product_attention\\"' in handed_out
    assert "weights = masked_softmax(scores, mask)" not in handed_out  # a line of the course's attention
    assert "has_key = mask.any(dim=-1, keepdim=True)" not in handed_out  # ... and of its masked_softmax
    # Its Chinese twin: the same code, the class edition's own note in Chinese too.
    english = nbformat.read(tmp_path / "release" / "02_masks" / "masks.ipynb", as_version=4)
    chinese = nbformat.read(tmp_path / "release" / "02_masks" / "zh" / "masks.ipynb", as_version=4)
    assert [c.source for c in chinese.cells if c.cell_type == "code"] == [
        c.source for c in english.cells if c.cell_type == "code"]
    intro = next(c.source for c in chinese.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "given-intro")
    assert intro.startswith("**课堂版。**") and "参考答案" not in intro and "Class edition" not in intro


def test_the_cli_writes_the_class_course(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stepformer.course.cli", "class-edition", "--out", str(tmp_path),
                           "--assignment", "03_multihead", "--package-url", URL],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "source" / "03_multihead" / "multihead.ipynb").is_file()
    assert (tmp_path / "release" / "03_multihead" / "zh" / "multihead.ipynb").is_file()
    assert "not written" not in proc.stdout + proc.stderr
    again = subprocess.run([sys.executable, "-m", "stepformer.course.cli", "class-edition", "--out", str(tmp_path),
                            "--assignment", "03_multihead"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and "Pass --replace" in again.stderr
    # The class site's exercise page shows and downloads the notebooks that the students get, in each language.
    site = _edition_extension()
    for lang, path in (("en", "multihead.ipynb"), ("zh", "zh/multihead.ipynb")):
        served = site.class_exercise(_site_config(lang), "exercises/03_multihead/multihead")
        assert served == nbformat.read(tmp_path / "release" / "03_multihead" / path, as_version=4), lang


# -- the students' environment --------------------------------------------------------------

@pytest.fixture(scope="module")
def student_python(tmp_path_factory) -> Path:
    """A fresh virtual environment with the students' wheel installed by pip and this environment's
    third-party packages (torch, ...) visible, but not the course's library."""
    base = tmp_path_factory.mktemp("student")
    wheel = build_student_dist(ROOT, base / "dist")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # torch and the rest from here, by path: the .pth files there (the course's editable install) are not run.
    third_party = Path(subprocess.run([sys.executable, "-c", "import torch, pathlib; print(pathlib.Path("
                                       "torch.__file__).parents[1])"], capture_output=True, text=True,
                                      check=True).stdout.strip())
    (site / "third_party.pth").write_text(f"{third_party}\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(site), str(wheel)], check=True)
    return python


def test_the_students_wheel_holds_the_checks_and_no_reference_code(tmp_path):
    wheel = build_student_dist(ROOT, tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert "stepformer/checks/attention.py" in packages and "stepformer/checks/given.py" in packages
    assert packages == {n for n in packages if n.startswith("stepformer/checks/")} | {"stepformer/__init__.py"}
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Name: stepformer-checks" in metadata and "Requires-Dist: torch==2.13.0" in metadata


@pytest.mark.slow
def test_in_the_students_environment_the_reference_cannot_be_imported(student_python):
    for module in ("stepformer.attention", "stepformer.transformer", "stepformer.translator.recipe",
                   "stepformer.course"):
        proc = subprocess.run([str(student_python), "-c", f"import {module}"], capture_output=True, text=True)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, module
    checks = [p.stem for p in (ROOT / "src" / "stepformer" / "checks").glob("*.py") if not p.stem.startswith("_")]
    imports = "; ".join(f"import stepformer.checks.{name}" for name in checks)
    proc = subprocess.run([str(student_python), "-c", f"{imports}; import stepformer; print(stepformer.__file__)"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "site-packages" in proc.stdout and "/src/" not in proc.stdout


@pytest.mark.slow
def test_every_exercises_checks_run_in_the_students_environment(student_python, tmp_path):
    """Each assignment's class notebook, with the answers written in, runs top to bottom with the students'
    package only: every check (the hidden ones too) passes, and later notebooks take the earlier answers
    from the notebooks beside them."""
    home = tmp_path / "home"
    for assignment in assignments(ROOT):
        for path in sorted((ROOT / "solutions" / assignment).glob("*.ipynb")):
            target = home / assignment / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(class_notebook(nbformat.read(path, as_version=4), ANSWERS, URL), target)
    runner = (
        "import sys, nbformat\n"
        "from nbclient import NotebookClient\n"
        "path = sys.argv[1]\n"
        "nb = nbformat.read(path, as_version=4)\n"
        "NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': sys.argv[2]}})"
        ".execute()\n"
        "nbformat.write(nb, path)\n"
    )
    for notebook in sorted(home.glob("*/*.ipynb")):
        proc = subprocess.run([str(student_python), "-c", runner, str(notebook), str(notebook.parent)],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{notebook.parent.name}: {proc.stderr[-3000:]}"
        outputs = "".join(o.get("text", "") for c in nbformat.read(notebook, as_version=4).cells
                          if c.cell_type == "code" for o in c.get("outputs", []))
        assert "✔" in outputs, notebook.name
        if any('given("' in c.source for c in nbformat.read(notebook, as_version=4).cells):
            assert "your own answer in" in outputs and "the course's copy" not in outputs, notebook.name


def _edition_extension():
    """The book's extension (book/_ext/stepformer_edition.py) as a module."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import stepformer_edition
    finally:
        sys.path.pop(0)
    return stepformer_edition


def _site_config(lang: str) -> SimpleNamespace:
    """What the extension reads of a class site's Sphinx configuration, in ``lang``."""
    return SimpleNamespace(stepformer_lang=lang, stepformer_edition="class", stepformer_package_url=URL,
                           html_baseurl="")


def test_the_class_site_hides_tagged_cells_whatever_the_order_of_their_options():
    stepformer_edition = _edition_extension()
    page = ("```{code-cell} ipython3\n:mystnb:\n  image:\n    alt: a plot\n:tags: [hide-in-class]\nsecret()\n```\n\n"
            "```{code-cell} ipython3\nshown()\n```\n\n```{code-cell} ipython3\n:tags: [hide-input, hide-in-class]\n"
            "also_secret()\n```\n")
    out = stepformer_edition.hide_answer_cells(page)
    assert out.count(stepformer_edition.HIDDEN_NOTE) == 2 and "hide-in-class" not in out
    assert ":tags: [remove-input]\nsecret()" in out and ":tags: [hide-input, remove-input]\nalso_secret()" in out
    assert "```{code-cell} ipython3\nshown()" in out
    # What the site serves for download leaves the hidden cells' code out; the Chinese site's note is Chinese.
    served = stepformer_edition.hide_answer_cells(page, ":::{note}\n注\n:::\n\n", keep_code=False)
    assert "secret()" not in served and served.count(":::{note}\n注\n:::") == 2 and "shown()" in served
    assert ":tags: [remove-input]\n```" in served
    assert "```{code-cell} ipython3\n:tags: [hide-input, remove-input]\n```" in served


@pytest.mark.parametrize("assignment", assignments(ROOT))
def test_the_class_sites_exercise_pages_are_the_class_notebooks_in_the_sites_language(assignment):
    """An exercise page of the class site, in either language: the class notebook, whose locked cells carry nbgrader's
    checksums of what they now say; the Chinese one has the English one's code, and prose in Chinese, the class
    edition's own note included."""
    from nbgrader.utils import compute_checksum

    from stepformer.checks._messages import chinese
    from stepformer.course.edition import CLASS_NOTE_TEXT

    site = _edition_extension()
    for path in sorted((ROOT / "exercises" / assignment).glob("*.ipynb")):
        docname = f"exercises/{assignment}/{path.stem}"
        english, zh = (site.class_exercise(_site_config(lang), docname) for lang in ("en", "zh"))
        for nb in (english, zh):
            stale = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells
                     if "checksum" in c.metadata.get("nbgrader", {}) and c.metadata["nbgrader"]["checksum"]
                     != compute_checksum(c)]
            assert not stale, (path.name, stale)
        setup = next(c.source for c in english.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "setup")
        assert json.dumps(URL) in setup and COURSE_INSTALL not in setup
        assert zh.metadata["stepformer"]["language"] == "zh"
        assert "language" not in english.metadata.get("stepformer", {})
        assert [c.source for c in zh.cells if c.cell_type == "code"] == [
            c.source for c in english.cells if c.cell_type == "code"]
        intro = [c.source for c in zh.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "given-intro"]
        assert all(text.startswith(chinese(CLASS_NOTE_TEXT)) and "Class edition" not in text for text in intro)


def test_the_open_sites_exercise_pages_fold_each_rubric_after_its_answer():
    """Each hand-graded answer of an exercise notebook is followed, on the open site, by its rubric from solutions/
    (without nbgrader's markers) in a folded block; nothing else changes."""
    from stepformer.course.edition import RUBRIC_TITLE, hand_graded, open_notebook, rubrics

    found = 0
    for solution_path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        solution = nbformat.read(solution_path, as_version=4)
        exercise = nbformat.read(ROOT / "exercises" / solution_path.parent.name / solution_path.name, as_version=4)
        marks = rubrics(solution)
        assert len(marks) == len(hand_graded(solution))
        shown = open_notebook(exercise, solution)
        assert len(shown.cells) == len(exercise.cells) + len(marks)
        for cell in hand_graded(shown):
            folded = shown.cells[shown.cells.index(cell) + 1].source
            rubric = marks[cell.metadata["nbgrader"]["grade_id"]]
            assert folded.startswith(f"::::{{stepformer-folded}} {RUBRIC_TITLE}\n") and rubric in folded
            assert "BEGIN SOLUTION" not in folded and "END SOLUTION" not in folded
            found += 1
    assert found >= 13
