"""The book's two editions: ``open`` (the default, answers shown) and ``class`` (no graded code).

``STEPFORMER_EDITION=class`` (``make book EDITION=class``) builds the class edition:

- a ``literalinclude`` of a graded function or class (an exercise asks students to write it)
  becomes a note that names the exercise;
- a chapter's code cell tagged ``hide-in-class`` (teaching code close to an answer) keeps its
  output and loses its code (myst-nb's ``remove-input``), after a note that says so;
- the exercise pages are the class edition's notebooks (:func:`stepformer.course.edition.class_notebook`):
  earlier answers are loaded from the student's own notebooks, never printed;
- the students' package (the checks without the answers) is built into ``_static/``, and the
  exercise pages' set-up cell installs it (from ``STEPFORMER_PACKAGE_URL`` when given, else from
  the site's ``html_baseurl``);
- the launch buttons (Binder, Colab) are left out: they would open the open edition's notebooks.
"""

import functools
import os
import re
from pathlib import Path

import nbformat
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.directives.code import LiteralInclude
from sphinx.errors import ExtensionError

from stepformer.course.edition import build_student_dist, class_notebook, graded_answers, wheel_name

EDITIONS = ("open", "class")
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _answers() -> dict:
    return graded_answers(ROOT)


class GradedLiteralInclude(LiteralInclude):
    """``literalinclude``, except that in the class edition a graded object's code becomes a note."""

    def run(self) -> list[nodes.Node]:
        config = self.env.config
        target = self.options.get("pyobject")
        if config.stepformer_edition != "class" or not target:
            return super().run()
        path = Path(self.env.relfn2path(self.arguments[0])[1]).resolve()
        try:
            module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts)
        except ValueError:
            return super().run()
        answer = _answers().get(f"{module}.{target}")
        if answer is None:
            return super().run()
        note = nodes.note()
        note += nodes.paragraph(
            text=f"The code of {target} is not shown in this edition: writing it is {answer.exercise}.")
        return [note]


def _check(app: Sphinx, config: Config) -> None:
    if config.stepformer_edition not in EDITIONS:
        raise ExtensionError(f"STEPFORMER_EDITION={config.stepformer_edition!r}: the editions are "
                             f"{', '.join(EDITIONS)}")
    # One cache of executed pages for several builds (the tests build both editions, one after the other).
    if cache := os.environ.get("STEPFORMER_EXECUTION_CACHE"):
        config.nb_execution_cache_path = cache
    if config.stepformer_edition == "class":
        options = dict(config.html_theme_options)
        options["launch_buttons"] = {}
        config.html_theme_options = options


def _package_url(config: Config) -> str:
    if config.stepformer_package_url:
        return config.stepformer_package_url
    base = (config.html_baseurl or "").rstrip("/")
    return f"{base}/_static/{wheel_name(ROOT)}" if base else f"_static/{wheel_name(ROOT)}"


# A code cell's opening line and its option lines (":tags: [...]", ":mystnb: ...", in any order).
HIDDEN_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(?:[: ][^\n]*\n)*?:tags: \[[^\]\n]*\bhide-in-class\b[^\]\n]*\]",
                         re.MULTILINE)
HIDDEN_NOTE = (":::{note}\nThe code of the next cell is left out of the class edition: it shows much of an exercise's "
               "answer. Its output is kept.\n:::\n\n")


def hide_answer_cells(page: str) -> str:
    """A chapter's MyST text with each ``hide-in-class`` cell's code removed (its output kept), after a note."""
    return HIDDEN_CELL.sub(lambda m: HIDDEN_NOTE + m.group(0).replace("hide-in-class", "remove-input"), page)


def _class_source(app: Sphinx, docname: str, source: list[str]) -> None:
    """In the class edition: exercise pages show the class notebooks; chapters' answer-like cells lose their code."""
    if app.config.stepformer_edition != "class":
        return
    if docname.startswith("exercises/"):
        nb = nbformat.reads(source[0], as_version=4)
        source[0] = nbformat.writes(class_notebook(nb, _answers(), _package_url(app.config)))
    else:
        source[0] = hide_answer_cells(source[0])


def _students_wheel(app: Sphinx, error: Exception | None) -> None:
    if error is None and app.config.stepformer_edition == "class" and app.builder.format == "html":
        build_student_dist(ROOT, Path(app.outdir) / "_static")


def setup(app: Sphinx) -> dict[str, object]:
    app.add_config_value("stepformer_edition", os.environ.get("STEPFORMER_EDITION", "open") or "open", "env")
    app.add_config_value("stepformer_package_url", os.environ.get("STEPFORMER_PACKAGE_URL", ""), "env")
    app.connect("config-inited", _check)
    app.connect("source-read", _class_source)
    app.connect("build-finished", _students_wheel)
    app.add_directive("literalinclude", GradedLiteralInclude, override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
