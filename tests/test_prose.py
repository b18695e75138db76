"""The prose has no stale forward reference: nothing is "in preparation" once its chapter exists.

Every "in preparation" (any case) in the book's pages and in the notebooks of solutions/ and
exercises/ must name the chapter it waits for ("chapter 12", "Chapter 13's", {doc}`12_models`),
and that chapter's page must not exist yet.
"""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PENDING = re.compile(r"in preparation", re.IGNORECASE)
# "chapter 02", "Chapters 12 and 13", "{doc}`02_masks`", "{doc}`chapter 02 <02_masks>`"
CHAPTER = re.compile(r"\bchapters?\s+(\d\d)(?:\s*(?:,|and|or)\s*(\d\d))*|`(?:[^`<]*<)?(?:\.\./book/)?(\d\d)_\w+",
                     re.IGNORECASE)
SENTENCE_END = re.compile(r"[.!?](?:\s|$)|\n\s*\n")


def existing_chapters() -> set[str]:
    return {path.name[:2] for path in (ROOT / "book").glob("[0-9][0-9]_*.md")}


def texts() -> list[tuple[str, str]]:
    """(where, text) for every page of the book and every cell of the course's notebooks."""
    found = [(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
             for path in sorted((ROOT / "book").glob("*.md"))]
    for folder in ("solutions", "exercises"):
        for path in sorted((ROOT / folder).glob("*/*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            found += [(f"{path.relative_to(ROOT)}, cell {i}", cell.source) for i, cell in enumerate(nb.cells)]
    return found


def sentence_around(text: str, start: int, end: int) -> str:
    before = [m.end() for m in SENTENCE_END.finditer(text, 0, start)]
    after = SENTENCE_END.search(text, end)
    return text[before[-1] if before else 0:after.start() + 1 if after else len(text)]


def named_chapters(sentence: str) -> set[str]:
    names = set()
    for match in CHAPTER.finditer(sentence):
        names |= {n for n in match.groups() if n}
        names |= set(re.findall(r"\b\d\d\b", match.group(0)))
    return names


def stale_mentions() -> list[str]:
    chapters = existing_chapters()
    problems = []
    for where, text in texts():
        for match in PENDING.finditer(text):
            sentence = sentence_around(text, match.start(), match.end())
            named = named_chapters(sentence)
            shown = " ".join(sentence.split())
            if not named:
                problems.append(f"{where}: 'in preparation' names no chapter: {shown!r}")
            elif named & chapters:
                problems.append(f"{where}: chapter {', '.join(sorted(named & chapters))} exists, yet: {shown!r}")
    return problems


def test_nothing_is_in_preparation_once_its_chapter_exists():
    problems = stale_mentions()
    assert not problems, "stale forward references:\n" + "\n".join(problems)


@pytest.mark.parametrize(("text", "stale"), [
    ("Chapter 02 (in preparation) uses it to ignore padding.", True),
    ("The mask ({doc}`chapter 02 <02_masks>`, in preparation) hides padding.", True),
    ("Chapters 18 and 19 are in preparation.", False),
    ("Chapter 18, in preparation, builds a retriever.", False),
    ("A preset for GPUs is in preparation.", True),
])
def test_the_check_reads_which_chapter_a_sentence_waits_for(text, stale):
    match = PENDING.search(text)
    named = named_chapters(sentence_around(text, match.start(), match.end()))
    assert (not named or bool(named & existing_chapters())) == stale, named
