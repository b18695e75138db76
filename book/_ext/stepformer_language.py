"""The book's two languages: English (the default) and Chinese (``STEPFORMER_LANG=zh``, ``make book BOOK_LANG=zh``).

Both sites are built from the same sources. In the Chinese build Sphinx replaces every message (paragraph,
heading, list item, caption, admonition and dropdown title, alt text) by its translation from the page's
catalogue, ``book/locale/zh_CN/LC_MESSAGES/<page>.po``; code cells, their comments and their outputs are not
messages, and the executed pages come from the same cache, so the code is the English site's to the byte.

This extension, in the Chinese build:

- sets the language (``zh_CN``), the tag ``zh`` (``{only} zh`` and ``{only} not zh`` blocks) and Sphinx's Chinese
  search, which cuts the text into words with jieba; the glossary's Chinese terms are added to jieba's words,
  so that a term such as 键值缓存 is one word of the index, not two;
- loads the interface strings of Sphinx and of the theme in Chinese (they were loaded for English before any
  extension could change the language);
- gives the site its Chinese title, from the catalogue of the book's first page;
- lets a translated paragraph paste the numbers its page computed (``{glue:text}``), as the English one does;
- translates the captions of the book's parts in the navigation, which sphinx-external-toc adds after Sphinx's
  translation.

Its exercise pages download, and launch on Binder and Colab, the Chinese exercise notebooks
(``exercises/<assignment>/zh/``). The Chinese class site (``STEPFORMER_EDITION=class``) has no launch buttons, and its
exercise pages show and download the class notebooks' Chinese twins (book/_ext/stepformer_edition.py).

In both builds it puts in the top bar of every page a link to the same page in the other language. The published
site holds the English pages at its root and the Chinese ones under ``zh/``: ``book/01_attention.html`` and
``zh/book/01_attention.html``; the class edition's site is laid out the same way.
"""

import gettext
import json
import os
from pathlib import Path
from typing import Any

from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ExtensionError
from sphinx.locale import init as init_locale
from sphinx.transforms import SphinxTransform
from sphinx.util.i18n import docname_to_domain

LANGUAGES = ("en", "zh")
ROOT = Path(__file__).resolve().parents[2]
ZH_FOLDER = "zh"  # where the Chinese site lives inside the published one
LOCALE = "zh_CN"

# The text this project's extensions write into pages (book/_ext/stepformer_edition.py), in Chinese.
CHINESE = {
    "The library's version of {target} (open after exercise {number})":
        "课程库中 {target} 的实现（做完练习 {number} 后再展开）",
    "The library's version of ": "课程库中 ",
    " is folded after exercise {number}, at the end of this page: ":
        " 的实现折叠在本页末尾的练习 {number} 之后：请先自己写完，再",
    "open it there": "到那里展开查看",
    " once you have written your own.": "。",
    "The code of a cell close to an exercise's answer (open after the exercise)":
        "接近练习答案的单元格代码（做完练习后再展开）",
    "The code behind the next output shows much of an exercise's answer: it is folded after the exercise, at the "
    "end of this page (":
        "下面这个输出背后的代码透露了练习答案的大部分，因此折叠在本页末尾的练习之后（请先自己写完，再",
    " once you have written your own).": "）。",
    "Try first, then see: the library's code for what this chapter's ": "先尝试，再看答案：本章",
    "exercise": "练习",
    " asks you to write is folded at the end of the page, after the exercise. Write your own first, let the checks "
    "teach you, then open the library's version to compare.":
        "要求你编写的代码，课程库中的版本折叠在页面末尾的练习之后。先自己写，让检查告诉你哪里不对，再展开课程库中的版本对照。",
    # The class edition's notes: a graded object's code left out, a hide-in-class cell's code left out.
    "The code of {target} is not shown in this edition: writing it is {exercise}.":
        "课堂版不展示 {target} 的代码：它留给你在 {exercise} 中编写。",
    "exercise {number} of {notebook}": "{notebook} 的练习 {number}",
    "The code of the next cell is left out of the class edition: it shows much of an exercise's answer. "
    "Its output is kept.":
        "课堂版略去了下一个单元格的代码，因为它透露了练习答案的大部分；它的输出仍然保留。",
}


def language(config: Config) -> str:
    """``en`` or ``zh``: the language of the site being built."""
    return config.stepformer_lang


def text(config: Config, english: str, **fields: Any) -> str:
    """``english`` (with ``fields`` filled in) in the language of the site being built."""
    if language(config) == "zh":
        if english not in CHINESE:
            raise ExtensionError(f"no Chinese for the extension's text {english!r}: add it to CHINESE")
        english = CHINESE[english]
    return english.format(**fields)


def _set_language(app: Sphinx, config: Config) -> None:
    if config.stepformer_lang not in LANGUAGES:
        raise ExtensionError(f"STEPFORMER_LANG={config.stepformer_lang!r}: the languages are {', '.join(LANGUAGES)}")
    # The catalogues are extracted (gettext builder) from the outputs the site shows: myst-nb would otherwise give
    # that builder the text version of each figure, and the figures' alt text would never be translated.
    from myst_nb.core.render import base_render_priority

    html = base_render_priority()["html"]
    config.nb_mime_priority_overrides = [*config.nb_mime_priority_overrides,
                                         *(("gettext", mime, rank) for mime, rank in html.items())]
    if config.stepformer_lang != "zh":
        return
    config.language = LOCALE
    config.html_search_language = "zh"
    config.html_search_options = {**(config.html_search_options or {}), "dict": str(_jieba_words(app))}
    app.tags.add("zh")
    config.html_title = _translated_title(config.html_title)
    config.author = f"《{config.html_title}》编写组"
    config.html_theme_options = {**config.html_theme_options, "search_bar_text": "搜索本书……", "toc_title": "目录"}
    # myst-nb's button on a folded code cell (hide-input; the course folds nothing else)
    config.nb_code_prompt_show, config.nb_code_prompt_hide = "显示代码", "隐藏代码"
    _load_interface_strings(app)
    _glue_in_translations(app)


def _jieba_words(app: Sphinx) -> Path:
    """A jieba dictionary of the glossary's Chinese terms (one a line), written beside the build's doctrees."""
    from stepformer.course.catalogues import glossary_terms

    words = sorted({form for term in glossary_terms(ROOT / "book" / "glossary.md") for form in term.chinese
                    if any("\u4e00" <= ch <= "\u9fff" for ch in form) and " " not in form})
    path = Path(app.doctreedir) / "jieba-words.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{word}\n" for word in words), encoding="utf-8")
    return path


def _translated_title(title: str) -> str:
    """The book's title as the catalogue of its first page translates it (the title itself while untranslated)."""
    from stepformer.course.catalogues import load

    catalogue = ROOT / "book" / "locale" / LOCALE / "LC_MESSAGES" / "book" / "intro.po"
    message = load(catalogue).get(title) if catalogue.is_file() else None
    return message.string if message is not None and message.string and not message.fuzzy else title


def _load_interface_strings(app: Sphinx) -> None:
    """Sphinx and the theme's extensions load their interface strings ("Search", "Contents", the buttons' tooltips)
    when they start, for the language that _config.yml names; load them again for the language just set."""
    import pydata_sphinx_theme
    import sphinx_book_theme
    import sphinx_togglebutton
    from sphinx import locale

    locale.translators.clear()
    app._init_i18n()  # Sphinx's own strings and the project's locale_dirs
    book_theme, toggle = sphinx_book_theme, sphinx_togglebutton
    catalogues = [
        (Path(pydata_sphinx_theme.__file__).parent / "locale", "sphinx"),
        (Path(book_theme.get_html_theme_path()) / "static" / "locales", book_theme.MESSAGE_CATALOG_NAME),
        (Path(toggle.__file__).parent / "translations" / "locales", toggle.MESSAGE_CATALOG_NAME),
    ]
    for folder, catalogue in catalogues:
        locale.init([str(folder)], app.config.language, catalogue)
    # The themes' Chinese lacks some of their words, and says others in Taiwan's usage: these come first.
    for catalogue in ("sphinx", book_theme.MESSAGE_CATALOG_NAME):
        words = _Words(THEME_WORDS)
        words.add_fallback(locale.translators[("general", catalogue)])
        locale.translators[("general", catalogue)] = words
    app.translator = locale.translators[("general", "sphinx")]  # what the templates' _() use


class _Words(gettext.NullTranslations):
    def __init__(self, words: dict[str, str]) -> None:
        super().__init__()
        self.words = words

    def gettext(self, message: str) -> str:
        return self.words[message] if message in self.words else super().gettext(message)


# The theme's interface words (pydata-sphinx-theme, sphinx-book-theme) in Simplified Chinese.
THEME_WORDS = {
    "Color mode": "颜色模式",
    "Light": "浅色",
    "Dark": "深色",
    "System Settings": "跟随系统",
    "Launch interactive content": "在线运行",
    "Launch on": "启动",
    "Source repositories": "源代码仓库",
    "Source repository": "源代码仓库",
    "Repository": "仓库",
    "Open issue": "提交问题",
    "Open an issue": "提交问题",
    "Download this page": "下载本页",
    "Download source file": "下载源文件",
    "Download notebook file": "下载 Notebook 文件",
    "Print to PDF": "打印为 PDF",
    "Fullscreen mode": "全屏模式",
    "By": "作者：",
    "Link to this heading": "链接到此标题",
    "Link to this definition": "链接到此定义",
    "Link to this code": "链接到此代码",
    "Link to this image": "链接到此图片",
    "Link to this table": "链接到此表格",
    "Link to this equation": "链接到此公式",
}


def _glue_in_translations(app: Sphinx) -> None:
    """A number that a chapter computes and its prose pastes (``{glue:text}`key```) in its translation too.

    Sphinx parses each translation as a document of its own, and myst-nb looks a glued number up in the notebook
    that the document was read from: a translation has none. It finds it, then, in the numbers that myst-nb wrote
    beside the page's executed notebook (``jupyter_execute/<page>.glue.json``) when it read the page."""
    from myst_nb.core.variables import VariableOutput
    from myst_nb.ext.glue import roles
    from myst_nb.ext.glue.utils import RetrievalError
    from myst_nb.sphinx_ext import OUTPUT_FOLDER

    page_glue = roles.retrieve_glue_data

    def retrieve(document: Any, key: str) -> VariableOutput:
        try:
            return page_glue(document, key)
        except RetrievalError:
            if "nb_renderer" in document:  # a page read from its notebook: the key is not there
                raise
            path = Path(app.outdir).parent / OUTPUT_FOLDER / f"{document.settings.env.docname}.glue.json"
            glued = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            if key not in glued:
                raise
            return VariableOutput(data=glued[key]["data"], metadata=glued[key].get("metadata", {}),
                                  nb_renderer=None, vtype="glue")

    roles.retrieve_glue_data = retrieve


class TranslateTocCaptions(SphinxTransform):
    """The captions of the book's parts ("Chapters", "Appendices") in the navigation, translated by the first page's
    catalogue: sphinx-external-toc adds them to that page after Sphinx has translated it."""

    default_priority = 101  # after sphinx-external-toc's InsertToctrees (100), before the table of contents is read

    def apply(self, **kwargs: Any) -> None:
        if language(self.config) != "zh":
            return
        domain = docname_to_domain(self.env.docname, self.config.gettext_compact)
        dirs = [str(Path(self.env.srcdir, folder)) for folder in self.config.locale_dirs]
        catalogue, found = init_locale(dirs, self.config.language, domain)
        if not found:
            return
        for toctree in self.document.findall(addnodes.toctree):
            if toctree.get("caption"):
                toctree["caption"] = catalogue.gettext(toctree["caption"])


def other_language_url(pagename: str, lang: str) -> str:
    """The relative address of ``pagename`` in the other language's site, from ``pagename`` in ``lang``'s."""
    up = "../" * pagename.count("/")
    if lang == "zh":
        return f"{up}../{pagename}.html"
    return f"{up}{ZH_FOLDER}/{pagename}.html"


# The link's words, each in its own language (a reader who cannot read the page still finds the other one).
LINK = {
    "en": {"hreflang": "zh-CN", "text": "中文", "title": "本页的中文版"},
    "zh": {"hreflang": "en", "text": "English", "title": "This page in English"},
}


def _language_link(app: Sphinx, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    if app.builder.format != "html":
        return
    link = {**LINK[language(app.config)], "url": other_language_url(pagename, language(app.config))}
    context["stepformer_language"] = link
    context["metatags"] = (context.get("metatags", "") +
                           f'\n<link rel="alternate" hreflang="{link["hreflang"]}" href="{link["url"]}" />')


def _top_bar(app: Sphinx, config: Config) -> None:
    """The language link at the right of every page's top bar, after the theme's buttons."""
    options = dict(config.html_theme_options)
    options["article_header_end"] = [*options.get("article_header_end", ["article-header-buttons.html"]),
                                     "stepformer-language.html"]
    config.html_theme_options = options
    config.templates_path = [*config.templates_path, str(Path(__file__).parent / "templates")]


def _chinese_notebooks(app: Sphinx, error: Exception | None) -> None:
    """The Chinese open site's exercise pages download the Chinese notebooks (``exercises/<a>/zh/<n>.ipynb``,
    instructions and the checks' messages in Chinese) in place of the English ones the page was built from. (The
    class site's download the class notebooks' twins: book/_ext/stepformer_edition.py.)"""
    if error is not None or language(app.config) != "zh" or app.builder.format != "html":
        return
    if getattr(app.config, "stepformer_edition", "open") == "class":
        return
    sources = Path(app.outdir) / "_sources"
    for chinese in sorted(ROOT.glob("exercises/*/zh/*.ipynb")):
        target = sources / "exercises" / chinese.parent.parent.name / chinese.name
        if target.is_file():
            target.write_bytes(chinese.read_bytes())


def _chinese_launch(app: Sphinx, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    """On the Chinese site, an exercise page's launch buttons (Binder, Colab) open its Chinese notebook."""
    if language(app.config) != "zh" or not pagename.startswith("exercises/"):
        return
    folder, _, name = pagename.rpartition("/")
    english, chinese = f"{pagename}.ipynb", f"{folder}/{ZH_FOLDER}/{name}.ipynb"
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []) if isinstance(group, dict) else []:
            # Launch buttons only (Binder, Colab: absolute addresses); the download button's relative link to
            # _sources/ already serves the Chinese notebook (_chinese_notebooks).
            if isinstance(button.get("url"), str) and button["url"].startswith(("https://", "http://")):
                button["url"] = button["url"].replace(english, chinese)


def setup(app: Sphinx) -> dict[str, object]:
    app.add_config_value("stepformer_lang", os.environ.get("STEPFORMER_LANG", "en") or "en", "env")
    app.connect("build-finished", _chinese_notebooks)
    app.connect("html-page-context", _chinese_launch, priority=900)  # after the theme has made its buttons
    # Before the edition's handler, which reads the language's text.
    app.connect("config-inited", _set_language, priority=400)
    app.connect("config-inited", _top_bar)
    app.connect("html-page-context", _language_link)
    app.add_transform(TranslateTocCaptions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
