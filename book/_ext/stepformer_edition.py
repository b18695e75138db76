"""The book's two editions: ``open`` (the default, answers folded after the exercise) and ``class`` (no graded code).

In the open edition, a graded object's code (a ``literalinclude`` of a function or class that an exercise
asks students to write) and the code of a chapter cell tagged ``hide-in-class`` are folded into
collapsed blocks ("The library's version of ... (open after exercise N)") placed at the end of the
chapter's "Exercise" section, after the link to the exercise; where the code stood, a line points there,
and a tip at the end of the chapter's opening says once to do the exercise first. The same list of graded
objects (:func:`stepformer.course.edition.graded_answers`) drives both editions. The open edition's exercise
pages also fold, after each answer graded by hand, its rubric, read from ``solutions/`` at build time
(:func:`stepformer.course.edition.open_notebook`); the class edition leaves the rubrics out.

``STEPFORMER_EDITION=class`` (``make book EDITION=class``) builds the class edition:

- a ``literalinclude`` of a graded function or class (an exercise asks students to write it)
  becomes a note that names the exercise;
- a chapter's code cell tagged ``hide-in-class`` (teaching code close to an answer) keeps its
  output and loses its code (myst-nb's ``remove-input``), after a note that says so;
- the exercise pages are the class edition's notebooks (:func:`stepformer.course.edition.class_release_notebook`):
  earlier answers are loaded from the student's own notebooks, never printed; their download buttons serve the
  same notebooks, the ones nbgrader releases from the class edition's source (not the open edition's, which
  Sphinx copies);
- the students' package (the checks without the answers) is built into ``_static/``, and the
  exercise pages' set-up cell installs it (from ``STEPFORMER_PACKAGE_URL`` when given, else from
  the site's ``html_baseurl``);
- the launch buttons (Binder, Colab) are left out: they would open the open edition's notebooks.

The Chinese site (``STEPFORMER_LANG=zh``) serves the same students' wheel, for readers who cannot reach GitHub:
its set-up page links to it with ``{stepformer-wheel}`` (book/setup.md). The text this extension writes into pages
is in the site's language (book/_ext/stepformer_language.py). The Chinese class site's exercise pages show, and
download, the class notebooks' Chinese twins (:func:`stepformer.course.translation.chinese_twin`): the notebooks
that a Chinese class student gets from ``stepformer-course class-edition``.
"""

import functools
import os
import re
from pathlib import Path
from typing import Any

import nbformat
from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.directives.code import LiteralInclude
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective, SphinxRole
from stepformer_language import language, text  # book/_ext, beside this file: the text it writes, in the language

from stepformer.course.edition import (
    build_student_dist,
    class_release_notebook,
    graded_answers,
    open_notebook,
    wheel_name,
)
from stepformer.course.translation import TranslationMissing, chinese_twin

EDITIONS = ("open", "class")
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _answers() -> dict:
    return graded_answers(ROOT)


class answer_block(nodes.General, nodes.Element):  # noqa: N801 (docutils names its node classes so)
    """A collapsed block (HTML ``<details>``) holding code that gives an exercise's answer away.

    Attributes: ``title`` (its summary line), ``order`` (where it goes among the chapter's blocks).
    """


def _visit_answer_html(self: Any, node: answer_block) -> None:
    self.body.append(self.starttag(node, "details", CLASS="stepformer-answer"))
    self.body.append(f"<summary>{self.encode(node['title'])}</summary>\n")


def _depart_answer_html(self: Any, node: answer_block) -> None:
    self.body.append("</details>\n")


def _pass(self: Any, node: nodes.Node) -> None:
    pass


def _number(answer: Any) -> int:
    found = re.match(r"ex(\d+)", answer.grade_id)
    return int(found.group(1)) if found else 0


class GradedLiteralInclude(LiteralInclude):
    """``literalinclude``, except for a graded object's code: folded after the exercise in the open edition,
    a note naming the exercise in the class edition."""

    def run(self) -> list[nodes.Node]:
        config = self.env.config
        target = self.options.get("pyobject")
        if not target:
            return super().run()
        path = Path(self.env.relfn2path(self.arguments[0])[1]).resolve()
        try:
            module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts)
        except ValueError:
            return super().run()
        answer = _answers().get(f"{module}.{target}")
        if answer is None:
            return super().run()
        if config.stepformer_edition != "class":
            return self._folded(target, answer)
        number, notebook = _number(answer), f"{answer.assignment}/{answer.notebook}"
        exercise = text(config, "exercise {number} of {notebook}", number=number, notebook=notebook) if number \
            else notebook
        note = nodes.note()
        note += nodes.paragraph(text=text(config, "The code of {target} is not shown in this edition: writing it is "
                                                  "{exercise}.", target=target, exercise=exercise))
        return [note]

    def _folded(self, target: str, answer: Any) -> list[nodes.Node]:
        """The open edition: a line that points to the block, and the block (moved after the exercise later)."""
        config = self.env.config
        number = _number(answer)
        block = answer_block(title=text(config, "The library's version of {target} (open after exercise {number})",
                                        target=target, number=number),
                             order=(number, target))
        block["ids"].append(nodes.make_id(f"library-{target}"))
        block.extend(super().run())
        # Written in the site's language here, with its link: a translation from the catalogue would lose the link.
        pointer = nodes.paragraph(translatable=False)
        pointer += nodes.Text(text(config, "The library's version of "))
        pointer += nodes.literal(text=target)
        pointer += nodes.Text(text(config, " is folded after exercise {number}, at the end of this page: ",
                                   number=number))
        pointer += nodes.reference("", text(config, "open it there"), internal=True, refid=block["ids"][0])
        pointer += nodes.Text(text(config, " once you have written your own."))
        return [pointer, block]


class Folded(SphinxDirective):
    """``stepformer-folded``: its content in a collapsed block, its argument the block's summary line."""

    required_arguments = 1
    final_argument_whitespace = True
    has_content = True

    def run(self) -> list[nodes.Node]:
        block = answer_block(title=self.arguments[0], order=(0, ""))
        block["classes"].append("stepformer-rubric")
        self.state.nested_parse(self.content, self.content_offset, block)
        return [block]


HIDDEN_CELL_TITLE = "The code of a cell close to an exercise's answer (open after the exercise)"


def _fold_answer_cells(config: Config, doctree: nodes.document) -> list[answer_block]:
    """Each ``hide-in-class`` cell's code (its output stays) as a block, with a line that points there."""
    blocks = []
    for n, cell in enumerate([c for c in doctree.findall(nodes.container) if "tag_hide-in-class" in c["classes"]]):
        code = next(child for child in cell.children if "cell_input" in child.get("classes", []))
        block = answer_block(title=text(config, HIDDEN_CELL_TITLE), order=(10_000, str(n)))
        block["ids"].append(f"answer-cell-{n + 1}")
        pointer = nodes.paragraph()
        pointer += nodes.Text(text(config, "The code behind the next output shows much of an exercise's answer: it is "
                                           "folded after the exercise, at the end of this page ("))
        pointer += nodes.reference("", text(config, "open it there"), internal=True, refid=block["ids"][0])
        pointer += nodes.Text(text(config, " once you have written your own)."))
        cell.remove(code)
        block += code
        cell.parent.insert(cell.parent.index(cell), pointer)
        blocks.append(block)
    return blocks


def _exercise_section(doctree: nodes.document) -> nodes.section | None:
    """The chapter's "Exercise" section: found by the id of its English title, which the Chinese site keeps."""
    for section in doctree.findall(nodes.section):
        if section.next_node(nodes.title).astext().strip() == "Exercise" or "exercise" in section["ids"]:
            return section
    return None


def _try_first(app: Sphinx, doctree: nodes.document) -> None:
    """The open edition: the answers' code folded after the exercise's link, and a tip to try first."""
    if app.config.stepformer_edition != "open" or not app.env.docname.startswith("book/"):
        return
    blocks = [block for block in doctree.findall(answer_block)] + _fold_answer_cells(app.config, doctree)
    if not blocks:
        return
    exercise = _exercise_section(doctree)
    links = [x for x in (exercise.findall(addnodes.pending_xref) if exercise else [])
             if x.get("reftype") == "doc" and "exercises/" in x.get("reftarget", "")]
    if exercise is None or not links:
        raise ExtensionError(f"{app.env.docname}: graded code to fold, but no \"Exercise\" section that links to "
                             "the exercise to fold it after")
    for block in blocks:
        if block.parent is not None:
            block.parent.remove(block)
    first_subsection = next((i for i, child in enumerate(exercise.children) if isinstance(child, nodes.section)),
                            len(exercise.children))
    for offset, block in enumerate(sorted(blocks, key=lambda b: b["order"])):
        exercise.insert(first_subsection + offset, block)
    if not exercise["ids"]:
        exercise["ids"].append("exercise")
    chapter = doctree.next_node(nodes.section)
    tip = nodes.tip()
    words = nodes.paragraph()
    words += nodes.Text(text(app.config, "Try first, then see: the library's code for what this chapter's "))
    words += nodes.reference("", text(app.config, "exercise"), internal=True, refid=exercise["ids"][0])
    words += nodes.Text(text(app.config, " asks you to write is folded at the end of the page, after the exercise. "
                                         "Write your own first, let the checks teach you, then open the library's "
                                         "version to compare."))
    tip += words
    # At the end of the chapter's opening, before its first section.
    chapter.insert(next((i for i, child in enumerate(chapter.children) if isinstance(child, nodes.section)),
                        len(chapter.children)), tip)


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


# A hidden code cell: its opening line and its option lines (":tags: [...]", ":mystnb: ...", in any order), then
# its code, up to the closing fence.
HIDDEN_CELL = re.compile(r"^(?P<head>```\{code-cell\}[^\n]*\n(?:[: ][^\n]*\n)*?"
                         r":tags: \[[^\]\n]*\bhide-in-class\b[^\]\n]*\][^\n]*\n(?:[: ][^\n]*\n)*)(?P<code>.*?)^```",
                         re.MULTILINE | re.DOTALL)
HIDDEN_NOTE_TEXT = ("The code of the next cell is left out of the class edition: it shows much of an exercise's "
                    "answer. Its output is kept.")
HIDDEN_NOTE = f":::{{note}}\n{HIDDEN_NOTE_TEXT}\n:::\n\n"


def hide_answer_cells(page: str, note: str = HIDDEN_NOTE, *, keep_code: bool = True) -> str:
    """A chapter's MyST text with ``note`` before each ``hide-in-class`` cell, whose output is kept and whose code is
    hidden (myst-nb's ``remove-input``) or, without ``keep_code``, left out of the text.

    The page keeps the code in its text, so that its cached outputs still match it; the text that the site serves
    for download leaves it out."""
    return HIDDEN_CELL.sub(lambda m: note + m["head"].replace("hide-in-class", "remove-input")
                           + (m["code"] if keep_code else "") + "```", page)


def class_exercise(config: Config, docname: str) -> nbformat.NotebookNode:
    """The notebook that the class site's exercise page ``docname`` shows and downloads: the class edition's release
    of ``<docname>.ipynb``; on the Chinese site, its Chinese twin (both as ``stepformer-course class-edition`` writes
    them)."""
    assignment, name = docname.removeprefix("exercises/").split("/")
    nb = class_release_notebook(nbformat.read(ROOT / f"{docname}.ipynb", as_version=4), _answers(),
                                _package_url(config))
    if language(config) != "zh":
        return nb
    try:
        return chinese_twin(ROOT, assignment, f"{name}.ipynb", nb)
    except (TranslationMissing, FileNotFoundError) as error:
        raise ExtensionError(f"{docname}: the Chinese class notebook cannot be written: {error} (run `make "
                             "catalogues`, then translate what it lists: book/locale/README.md)") from error


def _edition_source(app: Sphinx, docname: str, source: list[str]) -> None:
    """In the class edition: exercise pages show the class notebooks; chapters' answer-like cells lose their code.
    In the open edition: exercise pages show each hand-graded answer's rubric, folded, after the answer's cell."""
    if app.config.stepformer_edition != "class":
        if docname.startswith("exercises/"):
            nb = nbformat.reads(source[0], as_version=4)
            solution = nbformat.read(ROOT / "solutions" / f"{docname.removeprefix('exercises/')}.ipynb", as_version=4)
            source[0] = nbformat.writes(open_notebook(nb, solution))
        return
    if docname.startswith("exercises/"):
        source[0] = nbformat.writes(class_exercise(app.config, docname))
    else:
        source[0] = hide_answer_cells(source[0], _hidden_note(app.config))


def _hidden_note(config: Config) -> str:
    # Written in the site's language: the catalogues, extracted from the open edition, do not hold the note.
    return f":::{{note}}\n{text(config, HIDDEN_NOTE_TEXT)}\n:::\n\n"


def _class_downloads(app: Sphinx, error: Exception | None) -> None:
    """The class site's pages download their class edition: Sphinx copied the open edition's sources into
    ``_sources/``, whose exercise notebooks print the earlier answers in their given cells and whose chapters hold
    the code of their ``hide-in-class`` cells. An exercise page downloads the notebook it shows
    (:func:`class_exercise`); a chapter, its text without that code."""
    if error is not None or app.config.stepformer_edition != "class" or app.builder.format != "html":
        return
    sources = Path(app.outdir) / "_sources"
    for docname in sorted(app.env.found_docs):
        for target in sources.glob(f"{docname}.*"):
            if docname.startswith("exercises/") and target.suffix == ".ipynb":
                target.write_text(nbformat.writes(class_exercise(app.config, docname)) + "\n", encoding="utf-8")
            elif target.suffix == ".md":
                page = hide_answer_cells(Path(app.env.doc2path(docname)).read_text(encoding="utf-8"),
                                         _hidden_note(app.config), keep_code=False)
                target.write_text(page, encoding="utf-8")


def _serves_wheel(config: Config) -> bool:
    """Whether the site serves the students' wheel: the class edition's exercises install it; the Chinese site
    offers it to readers who cannot reach GitHub (book/setup.md)."""
    return config.stepformer_edition == "class" or config.stepformer_lang == "zh"


def _students_wheel(app: Sphinx, error: Exception | None) -> None:
    if error is None and _serves_wheel(app.config) and app.builder.format == "html":
        build_student_dist(ROOT, Path(app.outdir) / "_static")


class WheelLink(SphinxRole):
    """``{stepformer-wheel}`<file name>```: a link to the students' wheel in the site's ``_static/``. The file name
    is written out, as the install commands beside the link write it: where the wheel has another name (a new
    version), the build fails until the page says the new one."""

    def run(self) -> tuple[list[nodes.Node], list[nodes.system_message]]:
        wheel = wheel_name(ROOT)
        if self.text != wheel:
            raise ExtensionError(f"{self.env.docname}: {{stepformer-wheel}}`{self.text}`, but the wheel the site "
                                 f"serves is {wheel}: write that name there and in the commands beside it")
        url = "../" * self.env.docname.count("/") + f"_static/{wheel}"
        return [nodes.reference(self.rawtext, wheel, refuri=url)], []


def setup(app: Sphinx) -> dict[str, object]:
    app.setup_extension("stepformer_language")  # the language of the text written here
    app.add_config_value("stepformer_edition", os.environ.get("STEPFORMER_EDITION", "open") or "open", "env")
    app.add_config_value("stepformer_package_url", os.environ.get("STEPFORMER_PACKAGE_URL", ""), "env")
    app.connect("config-inited", _check)
    app.connect("source-read", _edition_source)
    app.connect("build-finished", _students_wheel)
    app.connect("build-finished", _class_downloads)
    app.connect("doctree-read", _try_first)
    app.add_node(answer_block, html=(_visit_answer_html, _depart_answer_html), latex=(_pass, _pass),
                 text=(_pass, _pass), man=(_pass, _pass), texinfo=(_pass, _pass))
    app.add_directive("literalinclude", GradedLiteralInclude, override=True)
    app.add_directive("stepformer-folded", Folded)
    app.add_role("stepformer-wheel", WheelLink())
    return {"parallel_read_safe": True, "parallel_write_safe": True}
