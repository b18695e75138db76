"""The pages tell one story, from chapter 00 to chapter 13.

The course once ended with chapter 11's translator; chapters 12 and 13 came after it, and chapter 00
before chapter 01 already trains an attention. A page that calls a chapter "the last" must mean the
last one of _toc.yml, and a page that describes the course's arc must name its first and last
chapters.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(re.findall(r"file: book/(\d\d)_\w+", (ROOT / "_toc.yml").read_text(encoding="utf-8")))
LAST = CHAPTERS[-1]

# "the last chapter('s)", "the final chapter", "the course ends with ...", "最后一章"
LAST_CHAPTER = re.compile(r"\b(?:the\s+)?(?:last|final)\s+chapter\b|\bcourse\s+ends\s+with\b|最后一章", re.IGNORECASE)
# What chapter 00's trained additive attention makes untrue.
FIRST_LEARNED = re.compile(r"first\s+attention\s+in\s+this\s+course|attention\s+maps?\s+so\s+far\s+(?:was|were)\s+"
                           r"(?:random|set)|only\s+thing\s+the\s+model\s+ever\s+learned", re.IGNORECASE)


def wrong_claims(text: str) -> list[str]:
    found = []
    for match in LAST_CHAPTER.finditer(text):
        around = text[max(0, match.start() - 80):match.end() + 120]
        if not re.search(rf"\b{LAST}\b|第 ?{LAST} ?章|attention at scale|大规模注意力", around):
            found.append(" ".join(around.split()))
    found += [" ".join(text[m.start():m.end() + 60].split()) for m in FIRST_LEARNED.finditer(text)]
    return found


@pytest.mark.parametrize("page", sorted(BOOK.glob("*.md")), ids=lambda p: p.name)
def test_no_page_calls_another_chapter_the_last_or_the_first_to_learn(page):
    found = wrong_claims(page.read_text(encoding="utf-8"))
    assert not found, f"{page.name}: claims that chapters 00-{LAST} make untrue: {found}"


def test_the_intro_names_the_whole_arc():
    text = (BOOK / "intro.md").read_text(encoding="utf-8")
    arc = text.split("\n## ", 1)[0]
    for chapter in (CHAPTERS[0], "11", LAST):
        assert re.search(rf"[Cc]hapters? (?:\d\d[–-])?{chapter}\b", arc), \
            f"intro.md's opening does not name chapter {chapter}"


@pytest.mark.parametrize(("text", "wrong"), [
    ("a GPU only makes the last chapter's training fast", True),
    ("最后一章在 Multi30k 上训练", True),
    ("The first attention in this course that has learned something", True),
    (f"Chapter {LAST}, the last chapter, measures attention at scale.", False),
    ("Chapter 11 trains the Transformer of chapter 08", False),
])
def test_the_check_reads_the_claims(text, wrong):
    assert bool(wrong_claims(text)) == wrong
