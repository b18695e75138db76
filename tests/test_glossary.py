"""The glossary, the chapter summaries and the appendix of questions keep up with the chapters.

- Every term that a chapter introduces, in a heading or in **bold**, has an entry in the
  glossary (book/glossary.md), where it stands beside its Chinese term.
- Every chapter of _toc.yml has a summary in English and in Chinese (book/summaries.md).
- Every question of a chapter's "Questions learners ask" has a label and is linked from
  book/appendix_questions.md.

A term is found where a reader meets it: in a chapter's prose (code cells and code blocks are
skipped), as a heading that is not a question, cut into phrases at ":", ",", "(", " and ",
" vs ", ..., or as a bold phrase of at most four words that is not a sentence, not code and not
the label of a list item ("- **Built**: ..."). A bold modifier counts with the word after it
("**additive** attention" is found under "additive attention"). Terms are compared without case,
articles, possessives, hyphens or plural endings. What a chapter sets in bold or in a heading but
is no term ("every", "by hand", "the library's version") is listed in NOT_TERMS: adding a phrase
there is a decision, reviewed like any other change.
"""

import re
from pathlib import Path

import pytest
import yaml

from tests.fixtures.chinese import CJK

REPO = Path(__file__).resolve().parents[1]
GLOSSARY = REPO / "book" / "glossary.md"
SUMMARIES = REPO / "book" / "summaries.md"

# Phrases that a chapter sets in bold or uses in a heading but that name no concept: emphasis
# ("every", "by hand"), the titles of a page's steps ("seeing a leak", "the module") and the
# furniture of every chapter ("exercise", "summary").
NOT_TERMS = {
    # emphasis
    "every", "no", "first", "last", "random", "by hand", "fixed", "finished", "learned", "live",
    "future", "in every layer", "only through the offset", "training split only", "padding ignored",
    # titles of a page's steps
    "module", "stack", "data", "recipe", "examples", "good", "bad", "tiny example", "small run",
    "small experiment", "seeing a leak", "change the future", "watch the outputs", "checked against PyTorch",
    "counting the parameters", "equal parameters", "longer than seen", "the cache object", "scoring",
    "looking at the weights", "the pipeline in PyTorch", "the library's version", "and as fast",
    "from its definition", "the full model", "the full results", "measured speed", "decoding speed",
    "three families", "words as vectors", "before the Transformer", "both masks", "once", "trained",
    "every choice", "named once", "trained here", "family table", "on this model", "counting the bytes", "on a GPU",
    "attention at scale",
    # the furniture of every chapter
    "exercise", "summary", "references", "check your understanding", "questions learners ask",
}
# A heading that opens with one of these is a question, even without its "?".
QUESTION_WORDS = {"why", "what", "how", "when", "where", "which", "who", "does", "do", "is", "are", "can"}
# A phrase with one of these is a clause ("generation is not"), not a name.
CLAUSE_WORDS = {"is", "are", "does", "do", "can", "has", "have", "not"}
LEADING = {"the", "a", "an", "one", "two", "three", "four"}  # dropped from the front of a phrase
MAX_WORDS = 4  # a bold phrase longer than this emphasises a clause; it does not name a term
# Fences whose content is prose (bold and headings there count); every other fence is code.
PROSE_DIRECTIVES = {"{admonition}", "{note}", "{tip}", "{warning}", "{important}", "{hint}", "{seealso}",
                    "{dropdown}", "{figure}", "{margin}", "{sidebar}", "{epigraph}", "{attention}", "{caution}"}


def chapters() -> list[Path]:
    """The chapter pages, in the order of _toc.yml's part "Chapters"."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text(encoding="utf-8"))
    part = next(p for p in toc["parts"] if p.get("caption") == "Chapters")
    return [REPO / f"{entry['file']}.md" for entry in part["chapters"]]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the prose of a MyST page: the front matter and code fences left out."""
    lines = text.splitlines()
    start = 0
    if lines and lines[0].strip() == "---":  # the jupytext front matter
        start = next(i for i in range(1, len(lines)) if lines[i].strip() == "---") + 1
    kept, fences = [], []  # fences: (backticks, is_code) of the open fences, outermost first
    for number, line in enumerate(lines[start:], start=start + 1):
        opening = re.match(r"^\s*(`{3,}|~{3,})\s*(\S*)", line)
        if opening:
            marks, info = opening.groups()
            if fences and marks == fences[-1][0] and not info:
                fences.pop()
                continue
            if not fences or not fences[-1][1]:
                fences.append((marks, info not in PROSE_DIRECTIVES))
                continue
        if any(is_code for _, is_code in fences):
            continue
        if fences and line.lstrip().startswith(":"):  # a directive's option, such as ":class: dropdown"
            continue
        kept.append((number, line))
    return kept


def _plain(text: str) -> str:
    """Inline code and math become markers that no term contains; roles and links keep their text."""
    text = re.sub(r"`[^`]*`(?!`)", " CODE ", re.sub(r"\{[a-z:-]+\}`([^`<]*?)\s*(<[^>]*>)?`", r"\1", text))
    text = re.sub(r"\$[^$]*\$", " MATH ", text)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def _stem(word: str) -> str:
    """One form for "cache" and "caches", "query" and "queries": compared, never shown."""
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("s") and not word.endswith(("ss", "us", "is", "as")) and len(word) > 3:
        word = word[:-1]
    return word[:-1] if word.endswith("e") and len(word) > 3 else word


def normalise(phrase: str) -> str:
    """Lower case; no markup, possessive, hyphen or plural ending; no leading article or number word."""
    text = re.sub(r"[*`]", "", phrase).lower().replace("’", "'")
    words = re.sub(r"'s\b", "", text).strip(" .,:;!?\"'").split()
    while words and words[0] in LEADING:  # "one-hot" keeps its "one": it is a single word here
        words.pop(0)
    return " ".join(_stem(w) for w in re.sub(r"[-/]", " ", " ".join(words)).split())


SKIPPED = {normalise(phrase) for phrase in NOT_TERMS}
# A heading is cut into phrases at these; "Add & Norm" keeps its "&".
_HEADING_CUT = re.compile(r"\s*(?:[:,;·()\u2014\u2013]|\b(?:and|vs\.?|or|then)\b)\s*", re.IGNORECASE)


def heading_terms(title: str) -> list[str]:
    """The term candidates of one heading: none for a question, else its short phrases."""
    title = re.sub(r"^\d+\s*·\s*", "", _plain(title)).strip()  # "01 · Attention" -> "Attention"
    if not title or "?" in title or title.split()[0].lower() in QUESTION_WORDS:
        return []
    # "Grouped-query and multi-query attention": two hyphenated modifiers share the noun.
    shared = re.match(r"^(\S+-\S+) and (\S+-\S+ .*?(\S+))$", title)
    if shared:
        title = f"{shared[1]} {shared[3]}, {shared[2]}"
    phrases = [p.strip() for p in _HEADING_CUT.split(title) if p and p.strip()]
    return [p for p in phrases if "CODE" not in p and "MATH" not in p and normalise(p)
            and not normalise(p)[0].isdigit() and not CLAUSE_WORDS & set(p.lower().split())
            and len(normalise(p).split()) <= 3]


def bold_terms(paragraph: str) -> list[tuple[str, str]]:
    """(phrase, phrase and the word after it) for each bold phrase of a paragraph that can be a term."""
    found = []
    text = _plain(paragraph)
    for match in re.finditer(r"\*\*(.+?)\*\*(:?)[ \t]*([A-Za-z][\w-]*)?", text, flags=re.DOTALL):
        phrase, colon, after = match.groups()
        line_start = text[text.rfind("\n", 0, match.start()) + 1:match.start()]
        if colon and re.fullmatch(r"\s*(?:[-*+]|\d+[.)])\s*", line_start):
            continue  # "- **Built**: ...": the label of a list item
        if phrase.rstrip().endswith((".", ":", "!")) or "CODE" in phrase or "MATH" in phrase or "=" in phrase:
            continue
        if len(normalise(phrase).split()) <= MAX_WORDS:
            found.append((phrase, f"{phrase} {after}" if after and not colon else phrase))
    return found


def chapter_terms(path: Path) -> dict[str, tuple[str, set[str]]]:
    """Normalised term -> (where it was found, the forms any of which the glossary may hold)."""
    terms: dict[str, tuple[str, set[str]]] = {}
    paragraph: list[tuple[int, str]] = []

    def note(phrase: str, number: int, forms: set[str]) -> None:
        key = normalise(phrase)
        if key and key not in SKIPPED:
            where = f"{path.relative_to(REPO)}:{number} {' '.join(phrase.split())!r}"
            terms.setdefault(key, (where, {key, *map(normalise, forms)}))

    def flush() -> None:
        if paragraph:
            for phrase, longer in bold_terms("\n".join(line for _, line in paragraph)):
                note(phrase, paragraph[0][0], {longer})
            paragraph.clear()

    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*)", line)
        if heading:
            flush()
            for phrase in heading_terms(heading[1]):
                note(phrase, number, set())
        elif line.strip():
            paragraph.append((number, line))
        else:
            flush()
    flush()
    return terms


def glossary_terms() -> set[str]:
    """The normalised terms of book/glossary.md's glossary directives (their unindented lines)."""
    terms, inside = set(), False
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        if re.match(r"^`{3,}\{glossary\}", line):
            inside = True
        elif inside and re.match(r"^`{3,}\s*$", line):
            inside = False
        elif inside and line.strip() and not line[0].isspace() and not line.startswith(":"):
            terms.add(normalise(line))
    return terms


def test_the_extraction_finds_terms_and_leaves_out_sentences_code_and_questions():
    assert normalise("The KV-caches") == normalise("KV cache") == normalise("kv-cache")
    assert normalise("queries") == normalise("Query") and normalise("Biases") == normalise("bias")
    assert normalise("one-hot vectors") == "one hot vector" and normalise("Two layers") == "layer"
    assert heading_terms("06 · Positional encodings") == ["Positional encodings"]
    assert heading_terms("Rotary embeddings (RoPE)") == ["Rotary embeddings", "RoPE"]
    assert heading_terms("Grouped-query and multi-query attention") == ["Grouped-query attention",
                                                                       "multi-query attention"]
    assert heading_terms("Why does the decoder need both masks?") == []
    assert heading_terms("Why LayerNorm and not BatchNorm") == []
    assert heading_terms("Cutting `d_model` into heads") == []
    assert heading_terms("Teacher forcing: why training is parallel and generation is not") == ["Teacher forcing"]
    text = ("a **query**, a **key** and **It is a 1×1 convolution.** and **`True` = may attend**,\n"
            "called **additive** attention\n- **Built**: the rest")
    assert [phrase for phrase, _ in bold_terms(text)] == ["query", "key", "additive"]
    assert bold_terms(text)[2] == ("additive", "additive attention")
    page = "---\nx: 1\n---\n# T\n\n```{code-cell} ipython3\n# not a heading\nx = 2**3**4\n```\n\nA **term**.\n"
    assert [line for _, line in prose_lines(page)] == ["# T", "", "", "A **term**."]


def test_every_chapter_term_is_in_the_glossary():
    glossary = glossary_terms()
    assert len(glossary) > 100, "book/glossary.md should hold a glossary directive with the course's terms"
    found: dict[str, tuple[str, set[str]]] = {}
    for path in chapters():
        for term, entry in chapter_terms(path).items():
            found.setdefault(term, entry)
    assert len(found) > 80, f"the extraction found only {len(found)} terms: is it still reading the chapters?"
    missing = sorted(where for where, forms in found.values() if not forms & glossary)
    assert not missing, (
        f"{len(missing)} of the {len(found)} terms of the chapters are not in book/glossary.md: give each an "
        "entry there (the English term, the Chinese term, where it is defined) or, if it is no term, add it "
        "to NOT_TERMS in tests/test_glossary.py:\n" + "\n".join(missing))




def summaries() -> dict[str, str]:
    """Chapter document ("book/01_attention") -> the text of its section in book/summaries.md."""
    found = {}
    for section in re.split(r"^## ", SUMMARIES.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        for doc in re.findall(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`", section):
            found[f"book/{Path(doc).name}"] = section
    return found


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_every_chapter_has_a_summary_in_english_and_in_chinese(chapter: Path):
    doc = f"book/{chapter.stem}"
    section = summaries().get(doc)
    assert section is not None, f"book/summaries.md has no section (## heading) that links to {{doc}}`{chapter.stem}`"
    paragraphs = [p for p in re.split(r"\n\s*\n", section) if p.strip()]
    english = [p for p in paragraphs if len(re.findall(r"[A-Za-z]+", _plain(p))) >= 60 and not CJK.search(p)]
    chinese = [p for p in paragraphs if len(CJK.findall(p)) >= 100]
    assert english, f"the summary of {doc} has no English paragraph (60 words or more)"
    assert chinese, f"the summary of {doc} has no Chinese paragraph (100 characters or more)"


QUESTIONS = REPO / "book" / "appendix_questions.md"


def chapter_questions(path: Path) -> list[tuple[str, str | None]]:
    """(question, its label or None) for each ### heading of a chapter's "Questions learners ask"."""
    found, inside, previous = [], False, ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            inside = line.startswith("## Questions learners ask")
        elif inside and line.startswith("### "):
            label = re.fullmatch(r"\((\S+)\)=", previous.strip())
            found.append((line[4:].strip(), label[1] if label else None))
        if line.strip():
            previous = line
    return found


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_every_question_of_a_chapter_is_linked_from_the_appendix(chapter: Path):
    appendix = QUESTIONS.read_text(encoding="utf-8")
    questions = chapter_questions(chapter)
    unlabelled = [q for q, label in questions if label is None]
    assert not unlabelled, (f"{chapter.name}: give each question a label line, such as (q{chapter.stem[:2]}-...)=, "
                            f"right above its heading, and link it from book/appendix_questions.md: {unlabelled}")
    unlinked = [f"{q} ({label})" for q, label in questions if f"<{label}>`" not in appendix]
    assert not unlinked, f"book/appendix_questions.md does not link these questions of {chapter.name}: {unlinked}"
