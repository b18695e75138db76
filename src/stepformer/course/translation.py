"""The Chinese exercise notebooks: the English release, with the prose of its markdown cells from the catalogues.

``exercises/01_attention/zh/attention.ipynb`` is ``exercises/01_attention/attention.ipynb`` with each
paragraph, heading, list item and table cell of its markdown cells replaced by its translation in the
exercise page's catalogue (``book/locale/zh_CN/LC_MESSAGES/exercises/01_attention/attention.po``, the
same messages the Chinese site shows). Nothing else changes: code cells, outputs, ``grade_id``\\ s, the
code cells' checksums. Two things are the Chinese notebook's own:

- its metadata says ``"stepformer": {"language": "zh"}``, which makes the checks speak Chinese
  (:mod:`stepformer.checks._messages`) and tells the grader which language a submission is in;
- a translated locked markdown cell carries the checksum of its Chinese text, so that nbgrader's
  Validate does not report the instructions as changed.

Answer cells (markdown solution cells: "YOUR ANSWER HERE") keep nbgrader's placeholder, so that an
unanswered cell reads as unanswered in either language. nbgrader puts a locked cell's source back at
autograde, so the grader translates the graded notebook again before feedback (:func:`translated`):
a Chinese submission's feedback is Chinese.

``stepformer-course release`` writes them with the English release; ``release --check`` fails when
one differs from what the release and the catalogues make.
"""

import copy
from pathlib import Path
from typing import Any

import nbformat

from stepformer.checks.given import TRANSLATION_FOLDER as FOLDER  # the Chinese notebook's folder
from stepformer.course.catalogues import catalogue_dir, load

LANGUAGE = "zh"


class TranslationMissing(LookupError):
    """A message of an English notebook has no translation in its catalogue (run `make catalogues`)."""


def chinese_path(notebook: Path) -> Path:
    """``exercises/01_attention/zh/attention.ipynb`` for ``exercises/01_attention/attention.ipynb``."""
    return notebook.parent / FOLDER / notebook.name


def catalogue_of(root: Path, assignment: str, notebook: str) -> Path:
    """The exercise page's catalogue: ``book/locale/zh_CN/LC_MESSAGES/exercises/<assignment>/<name>.po``."""
    return catalogue_dir(root) / "exercises" / assignment / Path(notebook).with_suffix(".po")


def translations(path: Path) -> dict[str, str]:
    """English message -> Chinese of a catalogue (translated, not fuzzy), with what the class edition's notebooks
    say in their own words (:func:`class_messages`)."""
    found = {m.id: m.string for m in load(path) if m.id and m.string and not m.fuzzy}
    return {**found, **class_messages(found)}


def class_messages(messages: dict[str, str]) -> dict[str, str]:
    """The class edition's prose (stepformer.course.edition.class_notebook), in Chinese: its note above the given
    cells, and each given cells' introduction of ``messages`` without the phrase the class edition takes out."""
    from stepformer.checks._messages import chinese
    from stepformer.course.edition import CLASS_NOTE_TEXT, SOLUTION_PHRASE

    found = {CLASS_NOTE_TEXT: note} if (note := chinese(CLASS_NOTE_TEXT)) else {}
    phrase = chinese(SOLUTION_PHRASE)
    for english, translation in messages.items():
        if phrase and SOLUTION_PHRASE in english and phrase in translation:
            found[english.replace(SOLUTION_PHRASE, "")] = translation.replace(phrase, "")
    return found


def chinese_twin(root: Path, assignment: str, notebook: str, nb: Any) -> Any:
    """The Chinese twin of ``nb``, the released notebook ``<assignment>/<notebook>`` of either edition: its prose from
    the exercise page's catalogue. Raises :class:`TranslationMissing`, and ``FileNotFoundError`` without a catalogue."""
    return translated(nb, translations(catalogue_of(root, assignment, notebook)))


def translated(nb: Any, messages: dict[str, str]) -> Any:
    """A copy of ``nb`` whose prose is Chinese (see the module's docstring); raises :class:`TranslationMissing`."""
    from nbgrader.utils import compute_checksum

    out = copy.deepcopy(nb)
    for cell in out.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "markdown" or meta.get("solution"):
            continue
        cell.source = translate_markdown(cell.source, messages)
        if "checksum" in meta:
            meta["checksum"] = compute_checksum(cell)
    out.metadata.setdefault("stepformer", {})["language"] = LANGUAGE
    return out


def translate_markdown(text: str, messages: dict[str, str]) -> str:
    """``text`` (MyST markdown) with each translatable block's text replaced by its translation.

    A message is what Sphinx's gettext builder extracts: a paragraph (also one in a list item), a heading or a
    table cell, its lines joined by spaces. Display math and code are not messages and stay. A translated
    paragraph takes one line (Chinese has no spaces to wrap at), after the first line's list marker or indent.
    """
    tokens = _parser().parse(text)
    lines = text.split("\n")
    replacements: dict[int, tuple[int, str]] = {}  # first line -> (end line, new text)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.type in ("paragraph_open", "heading_open") and token.map:
            inline = tokens[i + 1]
            start, end = token.map
            english = inline.content
            first = english.split("\n", 1)[0]
            prefix = lines[start][: lines[start].index(first)] if first in lines[start] else ""
            replacements[start] = (end, prefix + _message(english, messages))
        elif token.type == "tr_open" and token.map:
            cells, j = [], i + 1
            while tokens[j].type != "tr_close":
                if tokens[j].type == "inline":
                    cells.append(_message(tokens[j].content, messages) if tokens[j].content.strip() else "")
                j += 1
            start = token.map[0]
            replacements[start] = (start + 1, "| " + " | ".join(cells) + " |")
            i = j
        i += 1
    out, n = [], 0
    while n < len(lines):
        if n in replacements:
            end, new = replacements[n]
            out.append(new)
            n = end
        else:
            out.append(lines[n])
            n += 1
    return "\n".join(out)


def _message(english: str, messages: dict[str, str]) -> str:
    key = " ".join(english.split("\n"))
    if key in messages:
        return messages[key]
    if not any(c.isalpha() for c in key):  # a number, a star rating: Sphinx extracts no message for it
        return key
    raise TranslationMissing(f"no translation for {key[:100]!r}")


_md = None


def _parser() -> Any:
    """The markdown parser of the book's pages (MyST, with Jupyter Book's extensions), so that blocks are cut
    where Sphinx cut its messages."""
    global _md
    if _md is None:
        from markdown_it.renderer import RendererHTML
        from myst_parser.config.main import MdParserConfig
        from myst_parser.parsers.mdit import create_md_parser

        extensions = {"colon_fence", "dollarmath", "linkify", "substitution", "tasklist"}
        _md = create_md_parser(MdParserConfig(enable_extensions=extensions), RendererHTML)
    return _md


def write_chinese(root: Path, notebook: Path, *, check: bool = False) -> list[str]:
    """Write (or with ``check``, compare) the Chinese notebook of the English release ``notebook``
    (``<release>/<assignment>/<name>.ipynb``); returns the problems found (``check``: a differing file)."""
    assignment = notebook.parent.name
    catalogue = catalogue_of(root, assignment, notebook.name)
    shown = f"{assignment}/{notebook.name}"
    if not catalogue.is_file():
        return [f"{shown}: no catalogue {catalogue.relative_to(root)}"]
    english = nbformat.read(notebook, as_version=4)
    try:
        chinese = chinese_twin(root, assignment, notebook.name, english)
    except TranslationMissing as error:
        return [f"{shown}: {error} in {catalogue.relative_to(root)} (run `make catalogues`, then translate what it "
                "lists)"]
    target = chinese_path(notebook)
    text = nbformat.writes(chinese) + "\n"
    if check:
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            return [f"{assignment}/{FOLDER}/{notebook.name} is not the Chinese of {shown}: run "
                    f"`stepformer-course release --assignment {assignment}`"]
        return []
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    return []


def write_release_chinese(root: Path, release: Path, names: list[str]) -> list[str]:
    """The Chinese notebooks of every notebook of the assignments ``names`` in ``release``; what could not be
    written (a message without translation), after writing the others."""
    problems = []
    for name in names:
        for notebook in sorted((release / name).glob("*.ipynb")):
            problems += write_chinese(root, notebook)
    return problems
