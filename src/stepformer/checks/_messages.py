"""The checks' messages in the reader's language: English, or Chinese from a message catalogue.

Every sentence a check prints or raises is written as ``t("English template {name}", name=value)``
(or kept in a constant as ``marked("...")`` and shown with ``tr(constant)``).
The English template is the message's id: :func:`t` looks it up in the Chinese catalogue of the
checks (``locale/zh_CN/LC_MESSAGES/<module>.po`` beside this file, one catalogue per checks module,
gettext's format) when the reader reads Chinese, and fills in the values with ``str.format``, so
that numbers, shapes and code are formatted by the same format specifications in both languages.

The language, first found wins:

1. ``STEPFORMER_LANG`` (``en`` or ``zh``): what the grader sets for a submission's kernel and for its
   own re-check;
2. the notebook the kernel runs: JupyterLab names it in ``JPY_SESSION_NAME``, and a Chinese notebook
   says ``"stepformer": {"language": "zh"}`` in its metadata;
3. the notebooks in the working folder, when every one of them says the same language (nbgrader's
   Validate runs a notebook in a fresh kernel in its own folder, without a session name);
4. English.

``python -m stepformer.course.catalogues checks`` lists the templates that lack a Chinese entry; the
test suite fails on any.
"""

import functools
import json
import os
import string
from pathlib import Path
from typing import Any

LANGUAGE_ENV = "STEPFORMER_LANG"
LANGUAGES = ("en", "zh")
CATALOGUES = Path(__file__).parent / "locale" / "zh_CN" / "LC_MESSAGES"


def t(message: str, /, **values: Any) -> str:
    """``message`` (an English ``str.format`` template) in the reader's language, its fields filled from ``values``."""
    return _translate(message, values)


def marked(message: str, /) -> str:
    """``message`` unchanged, marked for the catalogue: for a template kept in a constant (a label, a hint) that is
    translated where it is shown, with :func:`tr`. A constant is set at import, before the language may be known."""
    return message


def tr(message: str, /, **values: Any) -> str:
    """:func:`t` for a template held in a variable, one that :func:`marked` put in the catalogue."""
    return _translate(message, values)


def _translate(message: str, values: dict[str, Any]) -> str:
    template = _chinese().get(message, message) if language() == "zh" else message
    return template.format(**values)


def chinese(message: str, /) -> str | None:
    """The Chinese entry of a template (whatever the reader's language), or None where it has none."""
    return _chinese().get(message)


def language() -> str:
    """``"en"`` or ``"zh"``: the language the checks speak in this process (see the module's docstring)."""
    chosen = os.environ.get(LANGUAGE_ENV, "")
    if chosen:
        if chosen not in LANGUAGES:
            raise ValueError(f"{LANGUAGE_ENV}={chosen!r}: the checks speak {' or '.join(LANGUAGES)}")
        return chosen
    return _notebook_language(os.environ.get("JPY_SESSION_NAME", ""), os.getcwd())


def notebook_language(notebook: dict[str, Any]) -> str:
    """The language a notebook's metadata states (``"en"`` where it states none)."""
    found = (notebook.get("metadata") or {}).get("stepformer", {}).get("language", "en")
    return found if found in LANGUAGES else "en"


@functools.lru_cache(maxsize=8)
def _notebook_language(session: str, cwd: str) -> str:
    paths = [Path(session)] if session.endswith(".ipynb") else sorted(Path(cwd).glob("*.ipynb"))
    found = set()
    for path in paths:
        try:
            found.add(notebook_language(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, AttributeError):
            return "en"
    return found.pop() if len(found) == 1 else "en"


def fields(template: str) -> list[str]:
    """The names of a template's fields with their format specifications, in order: ``["n", "gap:.3g"]``."""
    return [name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            for _, name, spec, conversion in string.Formatter().parse(template) if name is not None]


@functools.cache
def _chinese() -> dict[str, str]:
    from babel.messages.pofile import read_po

    entries: dict[str, str] = {}
    for path in sorted(CATALOGUES.glob("*.po")):
        with path.open("rb") as f:
            for message in read_po(f):
                if message.id and message.string and not message.fuzzy:
                    entries[message.id] = message.string
    return entries
