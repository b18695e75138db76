"""The class edition of the site, in English (``make book EDITION=class``) and in Chinese (``BOOK_LANG=zh``): each
builds with warnings as errors; no page and no file that a page downloads holds a line of any graded function's
body, nor an earlier answer in a later notebook; the exercise pages show, and download, the class notebooks in the
site's language. Both are built from one cache of executed pages, after the English open site (tests/test_book.py,
the same xdist group), so that in `make test` neither executes anything."""

import html
import json
import re
from pathlib import Path

import nbformat
import pytest

from stepformer.checks._messages import chinese
from stepformer.course.edition import CLASS_NOTE_TEXT, class_release_notebook, wheel_name
from stepformer.course.translation import catalogue_of, chinese_path, chinese_twin, translations
from tests.fixtures.answers import ANSWERS, answer_lines, page_lines, page_text
from tests.fixtures.chinese import CJK
from tests.test_book import LEAKS, PAGES, REPO, Build, _html, build_book, solution_rubrics, words

pytestmark = pytest.mark.slow

LANGUAGES = ("en", "zh")
BUILDS = {"en": "class_book", "zh": "zh_class_book"}
EXERCISES = [page for page in PAGES if page.startswith("exercises/")]
# What the set-up cells install: the wheel that the site serves (_config.yml sets no html.baseurl, and
# STEPFORMER_PACKAGE_URL no other address).
PACKAGE = f"_static/{wheel_name(REPO)}"


@pytest.fixture(scope="session")
def class_book(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build_book(tmp_path_factory.mktemp("class-book"), "class")


@pytest.fixture(scope="session")
def zh_class_book(tmp_path_factory: pytest.TempPathFactory, class_book: Build) -> Build:
    """Built after the English class site, from the executed pages it used or made."""
    return build_book(tmp_path_factory.mktemp("zh-class-book"), "class", "zh")


@pytest.fixture(params=LANGUAGES)
def lang(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def class_build(lang: str, request: pytest.FixtureRequest) -> Build:
    """The class site in ``lang``, each built once per session."""
    return request.getfixturevalue(BUILDS[lang])


@pytest.fixture
def class_site(class_build: Build, lang: str) -> Path:
    if class_build.returncode != 0:
        pytest.fail(f"the {lang} class site did not build (exit {class_build.returncode}):\n{class_build.tail()}")
    return class_build.html


def test_class_edition_builds_without_warnings(class_build: Build, lang: str) -> None:
    assert class_build.returncode == 0, f"the build failed (exit {class_build.returncode}):\n{class_build.tail()}"
    missing = [page for page in PAGES if not (class_build.html / page).is_file()]
    assert not missing, f"pages of _toc.yml missing from the class site: {missing}"
    if lang == "zh":  # the English class site was built first, so every page is cached
        executed = re.findall(r"^(\S+): Executing notebook", class_build.output, re.MULTILINE)
        assert not executed, f"the Chinese class build executed pages again: {executed}"
    print(f"the {lang} class site built in {class_build.seconds:.0f} s")


def _file_lines(path: Path) -> set[str]:
    """A page's text (:func:`page_lines`), or a downloadable file's lines (a notebook's: its cells'), stripped."""
    if path.suffix == ".html":
        return page_lines(path)
    if path.suffix == ".ipynb":
        return {line.strip() for cell in nbformat.read(path, as_version=4).cells for line in cell.source.splitlines()}
    return {line.strip() for line in path.read_text(encoding="utf-8").splitlines()}


def test_no_page_or_download_of_the_class_site_holds_a_line_of_a_graded_body(class_site: Path) -> None:
    """Neither the pages nor the sources they download (``_sources/``: the exercise notebooks, the chapters' text)."""
    lines = answer_lines()
    assert len(lines) > 200  # the graded functions' distinctive lines
    files = [*class_site.rglob("*.html"), *(class_site / "_sources").rglob("*.*")]
    assert len([f for f in files if f.suffix == ".ipynb"]) == len(EXERCISES)
    leaked = sorted(f"{path.relative_to(class_site)}: {lines[line]}: {line}"
                    for path in files for line in _file_lines(path) & lines.keys())
    assert not leaked, "graded code on the class site:\n" + "\n".join(leaked)


# What the class edition writes into the chapters, in each language: a graded function's code left out (chapter 01),
# a hide-in-class cell's code left out (chapter 10).
NOTES = {
    "en": ("The code of scaled_dot_product_attention is not shown in this edition: writing it is exercise 1 of "
           "01_attention/attention.ipynb.",
           "The code of the next cell is left out of the class edition: it shows much of an"),  # Sphinx curls "'"
    "zh": ("课堂版不展示 scaled_dot_product_attention 的代码：它留给你在 01_attention/attention.ipynb 的练习 1 "
           "中编写。",
           "课堂版略去了下一个单元格的代码，因为它透露了练习答案的大部分；它的输出仍然保留。"),
}


def test_class_site_points_to_each_exercise_and_serves_the_students_package(class_site: Path, lang: str) -> None:
    other = "zh" if lang == "en" else "en"
    attention = page_text(class_site / "book" / "01_attention.html")
    gqa = page_text(class_site / "book" / "10_gqa.html")
    assert NOTES[lang][0] in attention and NOTES[other][0] not in attention
    assert NOTES[lang][1] in gqa and NOTES[other][1] not in gqa
    encoder = page_text(class_site / "exercises" / "07_encoder" / "encoder.html")
    assert 'given("stepformer.multihead.MultiHeadAttention", "03_multihead/multihead.ipynb", globals())' in encoder
    assert "git+https://github.com/stepformer" not in encoder and "stepformer_checks-" in encoder
    assert (class_site / PACKAGE).is_file(), f"the class site does not serve {PACKAGE}"
    # No button opens the open edition's notebooks (with their answers) from the class site.
    launching = [page for page in EXERCISES if re.search(r"colab\.research\.google\.com|mybinder\.org",
                                                         (class_site / page).read_text(encoding="utf-8"))]
    assert not launching, f"launch buttons on the class site: {launching}"


def test_the_class_site_shows_no_rubric(class_site: Path) -> None:
    """The rubrics of the answers graded by hand (the open edition folds them after each answer) are left out."""
    marks = solution_rubrics()
    assert len(marks) >= 13
    pages = {path.relative_to(class_site).as_posix(): words(page_text(path)) for path in class_site.rglob("*.html")}
    shown = [f"{page}: the rubric of {grade_id} ({exercise})" for (exercise, grade_id), rubric in marks.items()
             for page, text in pages.items() if words(rubric) in text]
    assert not shown, "\n".join(shown)


def _download(site: Path, page: str) -> Path:
    """The notebook that the page's download button serves."""
    links = [href for href in _html(site / page).links if "/_sources/" in href and href.endswith(".ipynb")]
    assert len(links) == 1, f"{page}: download links {links}"
    return (site / page).parent / links[0]


def _checksum_problems(nb: nbformat.NotebookNode) -> list[str]:
    from nbgrader.utils import compute_checksum

    return [cell.metadata["nbgrader"]["grade_id"] for cell in nb.cells
            if "checksum" in cell.metadata.get("nbgrader", {})
            and cell.metadata["nbgrader"]["checksum"] != compute_checksum(cell)]


def test_each_exercise_page_downloads_the_class_notebook_in_its_language(class_site: Path, lang: str) -> None:
    """The download is the class notebook that ``stepformer-course class-edition`` hands out, in the site's language:
    its given cells load the student's own answers, its set-up cell installs the students' wheel, its checksums are
    nbgrader's (Validate finds nothing changed), and it holds no solution and no rubric; never the open edition's."""
    problems = []
    for page in EXERCISES:
        release = REPO / Path(page).with_suffix(".ipynb")
        served = nbformat.read(_download(class_site, page), as_version=4)
        text = nbformat.writes(served)
        expected = class_release_notebook(nbformat.read(release, as_version=4), ANSWERS, PACKAGE)
        if lang == "zh":
            expected = chinese_twin(REPO, release.parent.name, release.name, expected)
        if served.metadata.get("stepformer", {}).get("language", "en") != lang:
            problems.append(f"{page}: the download's language is not {lang}")
        if served == nbformat.read(chinese_path(release) if lang == "zh" else release, as_version=4):
            problems.append(f"{page}: the download is the open edition's notebook")
        if served != expected:
            problems.append(f"{page}: the download is not the class notebook")
        given = [c for c in served.cells if c.metadata.get("stepformer", {}).get("library") in ANSWERS
                 and c.metadata["stepformer"].get("given")]
        if any("given(" not in cell.source for cell in given):
            problems.append(f"{page}: a given cell prints its answer")
        setup = next(c.source for c in served.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "setup")
        if json.dumps(PACKAGE) not in setup:
            problems.append(f"{page}: the set-up cell does not install the students' wheel")
        problems += [f"{page}: the download holds {marker!r}" for marker in LEAKS if marker in text]
        problems += [f"{page}: stale nbgrader checksum of {cell}" for cell in _checksum_problems(served)]
        problems += [f"{page}: the download holds the rubric of {grade_id}"
                     for (exercise, grade_id), rubric in solution_rubrics().items()
                     if exercise == page and words(rubric) in words(text)]
    assert not problems, "\n".join(problems)


def _prose(path: Path) -> str:
    """A page's text without its code blocks (``<pre>``): code and its comments are English on either site."""
    page = re.sub(r"<pre\b.*?</pre>", " ", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.parametrize("lang", ["zh"])
def test_the_chinese_class_sites_exercise_pages_are_chinese(class_site: Path) -> None:
    """Each exercise page shows its Chinese class notebook: no English paragraph of the class notebook is left (the
    class edition's own note and changed introductions included), and each page whose notebook has given cells
    shows the class edition's note in Chinese."""
    left, notes = [], []
    for page in EXERCISES:
        assignment, name = Path(page).parent.name, Path(page).with_suffix(".ipynb").name
        prose = words(_prose(class_site / page))
        messages = translations(catalogue_of(REPO, assignment, name))
        left += [f"{page}: {english[:80]!r}" for english, chinese_text in messages.items()
                 if CJK.search(chinese_text) and len(words(english).split()) >= 4 and words(english) in prose]
        if chinese(CLASS_NOTE_TEXT).replace("**", "") in page_text(class_site / page):
            notes.append(page)
    assert not left, "English prose on the Chinese class site's exercise pages:\n" + "\n".join(left)
    given = [page for page in EXERCISES if any(c.metadata.get("nbgrader", {}).get("grade_id") == "given-intro"
                                               for c in nbformat.read(REPO / Path(page).with_suffix(".ipynb"),
                                                                      as_version=4).cells)]
    assert len(given) >= 5 and notes == given, f"the Chinese class note is on {notes}, not on {given}"
    encoder = page_text(class_site / "exercises" / "07_encoder" / "encoder.html")
    assert "前面各章的组件已经给出" in encoder and len(CJK.findall(encoder)) > 1000
