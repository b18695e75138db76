"""The catalogue tools of the Chinese edition (stepformer.course.catalogues), on small catalogues: reading the
glossary's terms, finding where the catalogues are not the book's messages, and merging new messages in."""

from pathlib import Path

from babel.messages.catalog import Catalog

from stepformer.course.catalogues import (
    LANGUAGE,
    PROJECT,
    Term,
    catalogue_dir,
    differences,
    glossary_terms,
    load,
    save,
    statistics,
    update,
)

GLOSSARY = """# Glossary

```{glossary}
:sorted:

beam search
  **束搜索（集束搜索）**. Decoding that keeps the best few outputs. 保留若干个最好的输出。 {doc}`11_translator`

KV-cache
key-value cache
  **键值缓存（KV 缓存）**. The keys and values kept between steps. 在各步之间保存的键和值。 {doc}`09_kvcache`

unigram
bigram
  **一元语法、二元语法**. The n-grams of one and two words. 一个词和两个词的 n 元语法。 {doc}`00_before`
```
"""


def test_the_glossary_gives_each_terms_english_names_and_chinese_forms(tmp_path: Path) -> None:
    (tmp_path / "glossary.md").write_text(GLOSSARY, encoding="utf-8")
    assert glossary_terms(tmp_path / "glossary.md") == [
        Term(("beam search",), ("束搜索", "集束搜索")),
        Term(("KV-cache", "key-value cache"), ("键值缓存", "KV 缓存")),
        Term(("unigram", "bigram"), ("一元语法", "二元语法")),
    ]


def _catalogue(path: Path, messages: dict[str, str]) -> Path:
    catalog = Catalog(locale=LANGUAGE if path.suffix == ".po" else None)
    for english, chinese in messages.items():
        catalog.add(english, chinese)
    path.parent.mkdir(parents=True, exist_ok=True)
    save(catalog, path)
    return path


def test_the_catalogues_differ_from_the_book_where_a_message_is_new_gone_or_a_page_has_none(tmp_path: Path) -> None:
    pots = tmp_path / "gettext"
    _catalogue(pots / "book" / "01_attention.pot", {"Attention": "", "A new paragraph.": ""})
    _catalogue(pots / "book" / "02_masks.pot", {"Masks": ""})
    po = catalogue_dir(tmp_path) / "book"
    _catalogue(po / "01_attention.po", {"Attention": "注意力", "An old paragraph.": "旧段落。"})
    _catalogue(po / "99_gone.po", {"Gone": "没了"})
    assert differences(pots, tmp_path) == [
        f"book/02_masks: no catalogue (book/locale/{LANGUAGE}/LC_MESSAGES/book/02_masks.po)",
        "book/99_gone: a catalogue, but no such page in the book",
        "book/01_attention: new message, not in the catalogue: 'A new paragraph.'",
        "book/01_attention: the catalogue's message is no longer on the page: 'An old paragraph.'",
    ]


def test_an_update_brings_new_messages_in_marks_changed_ones_fuzzy_and_drops_the_rest(tmp_path: Path) -> None:
    pots = tmp_path / "gettext"
    _catalogue(pots / "book" / "01_attention.pot", {
        "Attention": "",
        "Every query reads every key, weighted by its score.": "",  # was "... by the score."
        "Then come masks: two kinds.": "",
    })
    _catalogue(pots / "book" / "02_masks.pot", {"Masks": ""})
    po = catalogue_dir(tmp_path) / "book"
    _catalogue(po / "01_attention.po", {
        "Attention": "注意力",
        "Every query reads every key, weighted by the score.": "每个查询按分数读取每个键。",
        "A paragraph that was removed.": "一个被删掉的段落。",
    })
    _catalogue(po / "99_gone.po", {"Gone": "没了"})
    changed = update(pots, tmp_path)
    assert sorted(changed) == ["book/01_attention: updated", "book/02_masks: new catalogue",
                               "book/99_gone: removed (no such page)"]
    assert differences(pots, tmp_path) == []
    catalog = load(po / "01_attention.po")
    assert catalog.get("Attention").string == "注意力"
    changed_message = catalog.get("Every query reads every key, weighted by its score.")
    assert changed_message.fuzzy and changed_message.string == "每个查询按分数读取每个键。"
    assert not catalog.get("Then come masks: two kinds.").string
    assert not catalog.obsolete and catalog.project == PROJECT
    assert statistics(tmp_path) == (1, 1, 4)  # translated, fuzzy, total
    assert update(pots, tmp_path) == []  # nothing new: nothing written
