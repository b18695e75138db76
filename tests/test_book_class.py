"""The class edition of the site (``make book EDITION=class``): it builds with warnings as errors, and
no page holds a line of any graded function's body, nor an earlier answer in a later notebook."""

from pathlib import Path

import pytest

from tests.fixtures.answers import answer_lines, page_lines, page_text
from tests.test_book import PAGES, Build, build_book, solution_rubrics, words

pytestmark = pytest.mark.slow

@pytest.fixture(scope="session")
def class_book(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build_book(tmp_path_factory.mktemp("class-book"), "class")


@pytest.fixture(scope="session")
def class_site(class_book: Build) -> Path:
    if class_book.returncode != 0:
        pytest.fail(f"the class edition did not build (exit {class_book.returncode}):\n{class_book.tail()}")
    return class_book.html


def test_class_edition_builds_without_warnings(class_book: Build) -> None:
    assert class_book.returncode == 0, f"the build failed (exit {class_book.returncode}):\n{class_book.tail()}"
    missing = [page for page in PAGES if not (class_book.html / page).is_file()]
    assert not missing, f"pages of _toc.yml missing from the class site: {missing}"


def test_no_page_of_the_class_site_holds_a_line_of_a_graded_body(class_site: Path) -> None:
    lines = answer_lines()
    assert len(lines) > 200  # the graded functions' distinctive lines
    leaked = sorted(f"{path.relative_to(class_site)}: {lines[line]}: {line}"
                    for path in class_site.rglob("*.html") for line in page_lines(path) & lines.keys())
    assert not leaked, "graded code on the class site:\n" + "\n".join(leaked)


def test_class_site_points_to_each_exercise_and_serves_the_students_package(class_site: Path) -> None:
    attention = page_text(class_site / "book" / "01_attention.html")
    assert "writing it is exercise 1 of 01_attention/attention.ipynb" in attention
    gqa = page_text(class_site / "book" / "10_gqa.html")
    assert "left out of the class edition" in gqa
    encoder = page_text(class_site / "exercises" / "07_encoder" / "encoder.html")
    assert 'given("stepformer.multihead.MultiHeadAttention", "03_multihead/multihead.ipynb", globals())' in encoder
    assert "git+https://github.com/stepformer" not in encoder and "stepformer_checks-" in encoder
    assert list((class_site / "_static").glob("stepformer_checks-*-py3-none-any.whl"))
    # No button opens the open edition's notebooks (with their answers) from the class site.
    assert "colab.research.google.com" not in (class_site / "exercises" / "01_attention" / "attention.html").read_text()


def test_the_class_site_shows_no_rubric(class_site: Path) -> None:
    """The rubrics of the answers graded by hand (the open edition folds them after each answer) are left out."""
    marks = solution_rubrics()
    assert len(marks) >= 13
    pages = {path.relative_to(class_site).as_posix(): words(page_text(path)) for path in class_site.rglob("*.html")}
    shown = [f"{page}: the rubric of {grade_id} ({exercise})" for (exercise, grade_id), rubric in marks.items()
             for page, text in pages.items() if words(rubric) in text]
    assert not shown, "\n".join(shown)
