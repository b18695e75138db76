"""Every entry of the appendix of misconceptions states, corrects and links, as the page promises.

An entry is a "## " section of book/appendix_misconceptions.md. Each must
- state the misconception as it is commonly written: its heading is a quotation in double quotes;
- correct it with a line of mathematics (a $$ display) or a cell that shows the truth ({code-cell});
- send the reader to the chapter that builds the thing: a {doc} link to a chapter page;
- name only targets that exist: every {doc} page and every {ref} label (a "(label)=" line of a page).

An entry that corrects a name, where there is nothing to compute, quotes its source instead and is
listed in NAMES_ONLY: adding one there is a decision, reviewed like any other change.
"""

import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
APPENDIX = BOOK / "appendix_misconceptions.md"
CHAPTER_DOC = re.compile(r"\{doc\}`(?:[^`<]*<)?(\d\d_\w+)>?`")
DOC = re.compile(r"\{doc\}`(?:[^`<]*<)?([^`<>]+)>?`")
REF = re.compile(r"\{ref\}`(?:[^`<]*<)?([^`<>]+)>?`")
NAMES_ONLY = {'"T5 stands for Transfer Text-to-Text Transformer"'}


def entries(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each "## " section of a page."""
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return [(section.split("\n", 1)[0].strip(), section.split("\n", 1)[1] if "\n" in section else "")
            for section in sections]


def labels() -> set[str]:
    return {label for page in BOOK.glob("*.md")
            for label in re.findall(r"^\((\S+)\)=\s*$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)}


def problems(heading: str, body: str, known_labels: set[str]) -> list[str]:
    """What an entry lacks, in words; empty when it states, corrects and links."""
    found = []
    if not re.fullmatch(r'"[^"]+"', heading):
        found.append("its heading is not the misconception quoted in double quotes")
    if "$$" not in body and "```{code-cell}" not in body and heading not in NAMES_ONLY:
        found.append("no line of mathematics ($$ ... $$) and no {code-cell} shows the correction")
    if not CHAPTER_DOC.search(body):
        found.append("no {doc} link to the chapter that builds the thing")
    found += [f"{{doc}}`{doc}` names no page of the book" for doc in DOC.findall(body)
              if not (BOOK / f"{doc}.md").is_file()]
    found += [f"{{ref}}`{label}` names no label of the book" for label in REF.findall(body)
              if label not in known_labels]
    return found


def test_the_appendix_has_its_entries():
    assert len(entries(APPENDIX.read_text(encoding="utf-8"))) >= 21  # a merge that drops an entry fails here


@pytest.mark.parametrize(("heading", "body"), entries(APPENDIX.read_text(encoding="utf-8")),
                         ids=lambda value: value[:40] if value.startswith('"') else "")
def test_each_entry_states_corrects_and_links(heading: str, body: str):
    found = problems(heading, body, labels())
    assert not found, f"the entry {heading} of {APPENDIX.name}: " + "; ".join(found)


@pytest.mark.parametrize(("heading", "body", "lacks"), [
    ('"Masks are optional"', "True.\n\nBuilt in {doc}`02_masks`.", "no line of mathematics"),
    ("Masks are optional", "$$M = 0$$\n\nBuilt in {doc}`02_masks`.", "heading"),
    ('"Masks are optional"', "$$M = 0$$\n\nBuilt in the chapter on masks.", "no {doc} link"),
    ('"Masks are optional"', "$$M = 0$$\n\nBuilt in {doc}`02_mask`.", "names no page"),
    ('"Masks are optional"', "```{code-cell} ipython3\nx = 1\n```\n\nSee {ref}`no-such-label`, {doc}`02_masks`.",
     "names no label"),
])
def test_the_check_finds_an_entry_that_does_not_state_correct_or_link(heading, body, lacks):
    assert any(lacks in problem for problem in problems(heading, body, labels())), problems(heading, body, labels())
