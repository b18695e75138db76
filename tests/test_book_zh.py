"""The Chinese site (``make book BOOK_LANG=zh``): built from the same sources and from the English build's executed
pages; its catalogues complete, current and true to the glossary; its code and outputs the English site's, byte for
byte; and in Chromium, the same checks as the English site, on the published layout (English at the root, Chinese
under ``zh/``), with a link on every page to the same page in the other language."""

import functools
import os
import re
import shutil
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from stepformer.course.catalogues import (
    PROTECTED,
    Term,
    catalogues,
    differences,
    extract,
    glossary_terms,
    load,
    messages,
    problems,
    statistics,
)
from stepformer.course.translation import chinese_path
from tests.fixtures.answers import page_text
from tests.fixtures.chinese import CJK
from tests.test_book import (
    LEAKS,
    PAGES,
    PHONE,
    REPO,
    REUSE_SITE,
    Build,
    Visit,
    _broken_links,
    _browser_page,
    _download_problems,
    _html,
    _images_without_alt,
    _launch_problems,
    _page_problems,
    _redirect,
    _repository,
    _site_pages,
    build_book,
    console_errors,
    search_misses,
    serve,
    sideways,
    too_small,
    visit_on_a_phone,
)

pytestmark = pytest.mark.slow

# Local iteration only: test a Chinese site built earlier (its _build/html folder); CI never sets it.
REUSE_ZH_SITE = "STEPFORMER_TEST_ZH_SITE"


@pytest.fixture(scope="session")
def zh_book(tmp_path_factory: pytest.TempPathFactory, book: Build) -> Build:
    """Built after the English site (``book``), from its cache of executed pages."""
    if reused := os.environ.get(REUSE_ZH_SITE):
        return Build(0, f"{REUSE_ZH_SITE}={reused}: not built here", Path(reused))
    return build_book(tmp_path_factory.mktemp("zh-book"), lang="zh")


@pytest.fixture(scope="session")
def zh_built(zh_book: Build) -> Path:
    if zh_book.returncode != 0:
        pytest.fail(f"the Chinese site did not build (exit {zh_book.returncode}):\n{zh_book.tail()}")
    return zh_book.html


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory, built: Path, zh_built: Path) -> Path:
    """The site as it is published: the English pages at the root, the Chinese ones under zh/."""
    root = tmp_path_factory.mktemp("published") / "site"
    shutil.copytree(built, root, copy_function=_link_or_copy)
    shutil.copytree(zh_built, root / "zh", copy_function=_link_or_copy)
    return root


@pytest.fixture(scope="session")
def zh_server(published: Path) -> Iterator[str]:
    """The published site served over HTTP; yields the Chinese site's address (``.../zh``)."""
    with serve(published) as address:
        yield f"{address}/zh"


def test_the_chinese_site_builds_from_the_english_sites_executed_pages(zh_book: Build) -> None:
    if os.environ.get(REUSE_ZH_SITE):
        pytest.skip(f"{REUSE_ZH_SITE} is set: testing a site built earlier")
    assert zh_book.returncode == 0, f"the build failed (exit {zh_book.returncode}):\n{zh_book.tail()}"
    missing = [page for page in PAGES if not (zh_book.html / page).is_file()]
    assert not missing, f"pages of _toc.yml missing from the Chinese site: {missing}"
    assert (zh_book.html / "search.html").is_file(), "the Chinese site has no search page"
    if not os.environ.get(REUSE_SITE):  # the English site was built in this session, so every page is cached
        executed = re.findall(r"^(\S+): Executing notebook", zh_book.output, re.MULTILINE)
        assert not executed, f"the Chinese build executed pages again, not reusing the English build's: {executed}"
    print(f"the Chinese site built in {zh_book.seconds:.0f} s")


def test_every_catalogue_is_translated() -> None:
    """No message of any catalogue is untranslated, fuzzy (its English changed since it was translated) or obsolete,
    and every translation keeps the message's code, math, roles and link targets."""
    pages = catalogues()
    assert len(pages) >= len(PAGES)
    found = [f"{page}.po: {problem}" for page, path in pages.items() for problem in problems(load(path))]
    translated, fuzzy, total = statistics()
    print(f"{translated}/{total} messages translated ({100 * translated / total:.0f} %), {fuzzy} fuzzy")
    assert not found, (f"{len(found)} problems in the Chinese catalogues (translated {translated} of {total}); "
                       "see book/locale/README.md:\n" + "\n".join(found[:60]))


def test_the_catalogues_hold_the_books_current_messages(book: Build, tmp_path: Path) -> None:
    """The book's messages extracted again (Sphinx's gettext builder on the executed pages) are, page by page,
    the messages of the page's catalogue: an English change that `make catalogues` has not brought in fails."""
    cache = book.html.parents[2] / "executed-pages"
    if os.environ.get(REUSE_SITE):
        if not os.environ.get("STEPFORMER_EXECUTION_CACHE"):
            pytest.skip(f"{REUSE_SITE} is set: set STEPFORMER_EXECUTION_CACHE to that build's executed pages")
        cache = Path(os.environ["STEPFORMER_EXECUTION_CACHE"])
    templates = extract(tmp_path / "gettext", env={"STEPFORMER_EXECUTION_CACHE": str(cache)})
    stale = differences(templates)
    assert not stale, ("the catalogues are not the book's current messages: run `make catalogues`, then translate "
                       "(book/locale/README.md):\n" + "\n".join(stale[:60]))


# Where a glossary term may be written otherwise, and why: the English name -> the other Chinese forms accepted.
OTHER_FORMS = {
    "cache": (("缓存",), "alone, 'cache' is the KV-cache of the sentence, which the Chinese calls 缓存 as well"),
    "causal": (("因果",), "'causal' alone qualifies attention or a model as well as a mask"),
    "memory": (("内存", "显存", "存储"), "also a computer's memory, not only the encoder's output"),
    "greedy": (("贪心",), "'greedy' alone qualifies a search or a choice as well as decoding"),
    "greedy generation": (("贪心生成",), "generation, 生成, as the English says"),
    "head": (("头",), "the glossary's 'head' is an attention head, 注意力头; alone, 头 says the same"),
    "norm": (("范数", "归一化"), "'norm' is also a vector's length, 范数"),
    "residual": (("残差",), "'residual' alone qualifies a stream, a sum or a connection"),
    "score": (("分数", "得分", "评分", "打分"), "a translation's BLEU score as well as an attention score; to score"),
    "generation": (("生成",), "generation of text in general, not only decoding"),
    "decoding": (("解码",), "decoding in general"),
    "prompt": (("提示",), "a prompt as well as prompting"),
    "pool": (("池",), "a pool of memory blocks or a pooling"),
    "patch": (("补丁", "块"), "a patch of an image, or of code"),
    "padding": (("填充",), "padding in general"),
    "signature": (("签名",), "a function's signature as well as sacreBLEU's"),
    "interleaved": (("交错",), "interleaved in general"),
    "layer": (("层",), "any layer"),
    "base": (("基础",), "the paper's base model (基础模型) as well as RoPE's base"),
    "overflow": (("溢出",), "溢出 is the usual word; 上溢 where it stands against underflow (下溢)"),
    "leak": (("泄露",), "the leak of a later token, 泄露, as in 信息泄露"),
    "tied embeddings": (("共享嵌入",), "tied embeddings are shared ones, 共享嵌入"),
    "kernel": (("内核", "核"), "PyTorch's kernels (内核) and a convolution's kernel (卷积核)"),
    "recomputation": (("重算", "重复计算"), "重算 and 重复计算 say the same"),
    "decoder self-attention": (("解码器自注意力", "解码器的自注意力"), "named after where it is, the decoder"),
    "key/value head": (("键/值头",), "the slash of the English kept"),
    "translator": (("翻译",), "the translator of the course, or translation in general"),
    "query block": (("查询块",), "a tile of queries: the glossary's own Chinese for it, in the entry of 分块"),
    "key block": (("键块",), "a tile of keys and values: the glossary's own Chinese for it, in the entry of 分块"),
}


# English phrases in which a glossary term's word is not the term, and why: left out before the terms are looked for.
NOT_THE_TERM = {
    r"\bvalues? of\b": "the value of a quantity, not attention's values",
    r"\bscores? (?=\$|\{glue|\d)": "to score a number (a model scores 2.30), a verb",
    r"\b(?:19|20)\d\d, \*[^*]+\*": "a paper's title in italics after its year (2016, *Deep Residual Learning...*), "
                                     "which the Chinese cites as published",
    r"\((?:heads d_head|d_head heads)\)|\bheads / kv_heads\b": "einops axis names written out of code marks, "
                                                               "kept as written, not the word 'head'",
    r"\btiles(?= the whole block\b)": "what Tensor.repeat does to a block of heads, not tiled attention's tile",
    r"^slot$|\bfills each slot\b": "chapter 12's table of a model's parts, a place that a part fills, not a "
                                   "PagedAttention slot",
    r"\baxis vocabulary\b": "the course's names of axes, not a model's vocabulary of tokens",
    r"\bthe parameter count of the plain network\b": "the plain (ungated) feed-forward network that SwiGLU is "
                                                      "set against, not a network without residual connections",
    r"\bcode bases?\b": "a codebase, not RoPE's base",
    r"\byour block\b": "the decoder block (a layer) that an exercise builds, not a PagedAttention block",
}


def _english_prose(text: str) -> str:
    """A message without the pieces a translation keeps unchanged (code, math, roles, link targets)."""
    return PROTECTED.sub(" ", text)


@functools.cache
def _name_pattern(name: str) -> re.Pattern[str]:
    flags = 0 if sum(ch.isupper() for ch in name) >= 2 else re.IGNORECASE  # GLU, MHA, BPE: as written
    return re.compile(rf"(?<![\w-]){re.escape(name)}(?:s|es)?(?![\w-])", flags)


def _kept_as_written(name: str, term: Term) -> bool:
    """Whether Chinese text may write the term's English name as it is: a symbol (d_model), an acronym (MHA, GLU),
    a name in code's style (LayerNorm), or a name that the glossary's Chinese holds (top-k in top-k 采样)."""
    return ("_" in name or (name.isupper() and len(name) <= 5) or bool(re.fullmatch(r"\w*[a-z][A-Z]\w*", name))
            or any(name.lower() in form.lower() for form in term.chinese))


def terminology_problems(terms: list[Term], pages: dict[str, Path]) -> list[str]:
    """Each translated message whose English names a glossary term and whose Chinese uses none of its forms.

    The longest names are looked for first, and what they match is not looked at again: "Add & Norm" is one term,
    not also "norm"; "rotary embeddings" is RoPE, not also "embedding"."""
    names = sorted(((name, term) for term in terms for name in term.english), key=lambda pair: -len(pair[0]))
    found = []
    for page, path in pages.items():
        for _, message in messages(load(path)):
            if not message.string or message.fuzzy or message.string == message.id:  # an equation, a name
                continue
            english = _english_prose(message.id)
            for phrase in NOT_THE_TERM:
                english = re.sub(phrase, " ", english, flags=re.IGNORECASE)
            chinese = message.string.lower().replace("{", "").replace("}", "")  # $d_{head}$ is d_head
            named: dict[Term, str] = {}
            for name, term in names:
                english, hits = _name_pattern(name).subn(" ", english)
                if hits:
                    named.setdefault(term, name)
            for term, name in named.items():
                forms = {*term.chinese, *OTHER_FORMS.get(name, ((), ""))[0]}
                forms |= {other for other in term.english if _kept_as_written(other, term)}
                if not any(form.lower() in chinese for form in forms):
                    found.append(f"{page}.po: {name!r} -> {' / '.join(term.chinese)}: {message.id[:70]!r}")
    return found


def test_translations_use_the_glossarys_terms() -> None:
    """Wherever an English message holds a term of the glossary (book/glossary.md), its translation uses that term's
    Chinese (or its English name, where that is a symbol, an acronym or a name in code's style), or one of the other
    forms OTHER_FORMS allows with a reason."""
    terms = glossary_terms(REPO / "book" / "glossary.md")
    assert len(terms) > 100
    found = terminology_problems(terms, catalogues())
    assert not found, f"{len(found)} translations that do not use the glossary's term:\n" + "\n".join(found[:60])


class _Code(HTMLParser):
    """A page's code cells and outputs (myst-nb's ``cell_input`` and ``cell_output`` blocks), each as the list of its
    tags and text; an image's alt text is prose, translated, so it is left out."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[list[tuple]] = []
        self._depth = 0

    def _start(self, tag: str, attrs: list[tuple[str, str | None]], void: bool) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if not self._depth and tag == "div" and {"cell_input", "cell_output"} & set(classes):
            self.blocks.append([])
        if self.blocks and (self._depth or tag == "div" and {"cell_input", "cell_output"} & set(classes)):
            self.blocks[-1].append((tag, sorted((k, v) for k, v in attrs if k != "alt")))
            if tag == "div" and not void:
                self._depth += 1

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs, False)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs, True)

    def handle_endtag(self, tag: str) -> None:
        if self._depth:
            self.blocks[-1].append(("/" + tag,))
            if tag == "div":
                self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._depth:
            self.blocks[-1].append(data)


def _code_blocks(page: Path) -> list[list[tuple]]:
    parser = _Code()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.blocks


def test_code_and_outputs_are_the_english_sites(built: Path, zh_built: Path) -> None:
    """Every code cell and every output of every page is the English site's, byte for byte (images too)."""
    differ, cells = [], 0
    for path in PAGES:
        english, chinese = _code_blocks(built / path), _code_blocks(zh_built / path)
        cells += len(english)
        if len(english) != len(chinese):
            differ.append(f"{path}: {len(english)} code cells and outputs in English, {len(chinese)} in Chinese")
            continue
        for n, (a, b) in enumerate(zip(english, chinese, strict=True)):
            if a != b:
                first = next(i for i, (x, y) in enumerate(zip(a + [None], b + [None], strict=False)) if x != y)
                differ.append(f"{path}: block {n + 1} differs at {a[first:first + 3]!r} / {b[first:first + 3]!r}")
    images = [p.relative_to(built / "_images") for p in (built / "_images").rglob("*") if p.is_file()]
    differ += [f"_images/{name}: not the English image" for name in images
               if (built / "_images" / name).read_bytes() != (zh_built / "_images" / name).read_bytes()]
    assert cells > 300, f"only {cells} code cells and outputs found"
    assert not differ, "\n".join(differ[:40])


def test_every_page_links_to_itself_in_the_other_language(published: Path) -> None:
    """A reader goes from any English page to its Chinese page and back: one link each way, to the same page."""
    problems_found = []
    for english in _site_pages(published):
        path = english.relative_to(published)
        if path.parts[0] == "zh" or _redirect(english):
            continue
        chinese = published / "zh" / path
        for page, other in ((english, chinese), (chinese, english)):
            links = _html(page).language_links
            anchors = [href for href in links if not href.startswith(("http:", "https:"))]
            targets = {Path(os.path.normpath(page.parent / href.split("#")[0])) for href in anchors}
            if targets != {other}:
                problems_found.append(f"{page.relative_to(published)}: language links {links}, not to "
                                      f"{other.relative_to(published)}")
    assert not problems_found, "\n".join(problems_found[:40])


def test_every_internal_link_and_anchor_of_the_chinese_site_resolves(published: Path) -> None:
    pages = _site_pages(published / "zh")
    assert len(pages) >= len(PAGES)
    broken = _broken_links(published / "zh", published)
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken[:40])


def test_the_chinese_site_holds_no_solution(zh_built: Path) -> None:
    leaked = [f"{path.relative_to(zh_built)}: {marker}" for path in zh_built.rglob("*")
              if path.is_file() and path.suffix in {".html", ".ipynb", ".md", ".txt", ".js"}
              for marker in LEAKS if marker in path.read_text(encoding="utf-8", errors="replace")]
    assert not leaked, f"solution markers on the Chinese site: {leaked}"


def test_every_figure_of_the_chinese_site_has_chinese_alt_text(zh_built: Path) -> None:
    missing_alt = _images_without_alt(zh_built)
    assert not missing_alt, "figures without alt text:\n" + "\n".join(missing_alt)
    english = [f"{page.relative_to(zh_built).as_posix()}: {img.get('alt', '')[:70]!r}"
               for page in _site_pages(zh_built) for img in _html(page).images
               if "/_static/" not in f"/{img.get('src', '')}" and not CJK.search(img.get("alt") or "")]
    assert not english, "figures whose alt text is not Chinese:\n" + "\n".join(english[:40])


def test_the_chinese_site_is_chinese(zh_built: Path) -> None:
    """The pages say they are Chinese, and the theme's own words (search, navigation) are Chinese too."""
    intro = (zh_built / "book" / "intro.html").read_text(encoding="utf-8")
    assert '<html lang="zh-CN"' in intro or '<html lang="zh_CN"' in intro, intro[:300]
    assert "搜索" in intro, "the theme's search box is not in Chinese"
    chapter = page_text(zh_built / "book" / "02_masks.html")
    assert len(CJK.findall(chapter)) > 1000, "chapter 02 has almost no Chinese"


def test_each_intro_says_that_the_other_edition_exists(built: Path, zh_built: Path) -> None:
    english, chinese = page_text(built / "book" / "intro.html"), page_text(zh_built / "book" / "intro.html")
    assert "also published in Chinese" in english
    assert "英文" in chinese and "also published in Chinese" not in chinese


def test_the_chinese_set_up_page_installs_without_github(zh_built: Path, built: Path) -> None:
    """The Chinese set-up page installs from a PyPI mirror and the course's checks from a wheel that the site serves
    (the one its link and its commands name), and says how to run the notebooks locally."""
    setup = zh_built / "book" / "setup.html"
    html = setup.read_text(encoding="utf-8")
    assert "https://pypi.tuna.tsinghua.edu.cn/simple" in html
    wheels = set(re.findall(r"stepformer_checks-[\w.]+-py3-none-any\.whl", html))
    assert len(wheels) == 1, wheels
    served = zh_built / "_static" / wheels.pop()
    assert served.is_file(), f"the set-up page names {served.name}, which the site does not serve"
    assert any(href.endswith(f"_static/{served.name}") for href in _html(setup).links)
    assert "jupyter lab" in page_text(setup)
    assert "pypi.tuna" not in (built / "book" / "setup.html").read_text(encoding="utf-8")


@pytest.mark.browser
def test_chinese_pages_render_in_chromium(zh_server: str) -> None:
    problems_found: list[str] = []
    with _browser_page(30_000, {"width": 1280, "height": 1000}) as page:
        for path, has_math in PAGES.items():
            problems_found += _page_problems(page, f"{zh_server}/{path}", path, has_math)
    assert not problems_found, "\n".join(problems_found)


@pytest.fixture(scope="session")
def zh_phone_visits(zh_server: str, zh_built: Path) -> dict[str, Visit]:
    return visit_on_a_phone(zh_server, zh_built)


@pytest.mark.browser
def test_no_chinese_page_logs_a_console_error(zh_phone_visits: dict[str, Visit]) -> None:
    errors = console_errors(zh_phone_visits)
    assert not errors, "\n".join(errors[:40])


@pytest.mark.browser
def test_every_chinese_page_reads_on_a_phone_without_scrolling_sideways(zh_phone_visits: dict[str, Visit]) -> None:
    wide = sideways(zh_phone_visits)
    assert not wide, f"at {PHONE['width']}px wide:\n" + "\n".join(wide[:40])
    small = too_small(zh_phone_visits)
    assert not small, "\n".join(small[:40])


# What a Chinese reader searches for, and the chapter that teaches it.
CHINESE_SEARCHES = {
    "注意力": "book/01_attention.html",
    "掩码": "book/02_masks.html",
    "多头注意力": "book/03_multihead.html",
    "层归一化": "book/05_norms.html",
    "位置编码": "book/06_positional.html",
    "键值缓存": "book/09_kvcache.html",
    "分组查询注意力": "book/10_gqa.html",
    "束搜索": "book/11_translator.html",
}


@pytest.mark.browser
def test_the_chinese_search_finds_the_chapters_that_teach_a_term(zh_server: str) -> None:
    """Sphinx's Chinese search, its words cut by jieba (the glossary's terms among them): a term finds its chapter."""
    misses = search_misses(zh_server, [(term, path, "the chapter that teaches it")
                                       for term, path in CHINESE_SEARCHES.items()])
    assert not misses, "\n".join(misses)


@pytest.mark.browser
def test_chinese_exercise_pages_download_and_launch_the_exercise_notebook(zh_server: str) -> None:
    repository, branch = _repository()
    problems_found = []
    with _browser_page(60_000, {"width": 1280, "height": 1000}) as page:
        for path in [path for path in PAGES if path.startswith("exercises/")]:
            # The Chinese notebook: its instructions, and its checks' messages, in Chinese.
            notebook = chinese_path(Path(path).with_suffix(".ipynb")).as_posix()
            page.goto(f"{zh_server}/{path}", wait_until="load")
            problems_found += _download_problems(page, path, notebook)
            problems_found += _launch_problems(page, path, notebook, repository, branch)
    assert not problems_found, "\n".join(problems_found)
