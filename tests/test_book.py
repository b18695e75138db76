"""The published site: it builds with warnings as errors, and its pages render in a real browser."""

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pytest
import yaml

from tests.fixtures.prerequisites import missing

# One build serves every test here; `make test` runs a file's tests on one worker, so it happens once.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
JUPYTER_BOOK = Path(sys.executable).parent / "jupyter-book"

def _toc_pages() -> dict[str, bool]:
    """Every page of _toc.yml as built HTML -> whether its source has math to typeset."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]
    pages = {}
    for name in files:
        source = next(p for p in (REPO / f"{name}.md", REPO / f"{name}.ipynb") if p.exists())
        pages[f"{name}.html"] = "$" in source.read_text()
    return pages


PAGES = _toc_pages()
LEAKS = ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


class Build:
    def __init__(self, returncode: int, output: str, html: Path, seconds: float = 0.0) -> None:
        self.returncode, self.output, self.html, self.seconds = returncode, output, html, seconds

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def build_book(out: Path, edition: str = "open", lang: str = "en") -> Build:
    """Build the site of one edition (``open`` or ``class``) in one language (``en`` or ``zh``) under ``out``."""
    # The build executes the chapters: the kernel must be this environment's Python.
    # Every build executes the same chapters: built one after the other (one xdist group), they share
    # one cache of executed pages beside their folders, so only the first executes anything.
    env = {**os.environ, "PATH": f"{JUPYTER_BOOK.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "STEPFORMER_EDITION": edition, "STEPFORMER_LANG": lang,
           "STEPFORMER_EXECUTION_CACHE": str(out.parent / "executed-pages")}
    start = time.monotonic()
    proc = subprocess.run(
        [
            str(JUPYTER_BOOK),
            "build",
            str(REPO),
            "--warningiserror",
            "--keep-going",
            "--path-output",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # 750-850 s on 2 cores shared with the graded runs; a hang still ends well inside CI's 90 minutes
    )
    return Build(proc.returncode, proc.stdout + proc.stderr, out / "_build" / "html", time.monotonic() - start)


# Local iteration only: test a site built earlier (its _build/html folder) instead of building one.
# The build's own test is skipped then; CI never sets it.
REUSE_SITE = "STEPFORMER_TEST_SITE"


# The English site's build, `book`, and `built`, its HTML folder, are fixtures of tests/conftest.py: the
# Chinese site's tests (tests/test_book_zh.py) compare with it and build from its executed pages.


def test_book_builds_without_warnings(book: Build) -> None:
    if os.environ.get(REUSE_SITE):
        pytest.skip(f"{REUSE_SITE} is set: testing a site built earlier")
    assert book.returncode == 0, f"the build failed (exit {book.returncode}):\n{book.tail()}"
    missing = [page for page in PAGES if not (book.html / page).is_file()]
    assert not missing, f"pages of _toc.yml missing from the site: {missing}"
    assert (book.html / "search.html").is_file(), "the site has no search page"


def test_no_solution_on_the_site(built: Path) -> None:
    """Neither the pages nor the files the site serves (sources, downloads) hold a solution."""
    leaked = [
        f"{path.relative_to(built)}: {marker}"
        for path in built.rglob("*")
        if path.is_file() and path.suffix in {".html", ".ipynb", ".md", ".txt", ".js"}
        for marker in LEAKS
        if marker in path.read_text(encoding="utf-8", errors="replace")
    ]
    assert not leaked, f"solution markers on the published site: {leaked}"


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """``folder`` served over HTTP on a free local port, for the block: yields its address."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session")
def server(built: Path) -> Iterator[str]:
    with serve(built) as address:
        yield address


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass


# The article's visible text with code blocks hidden: code may hold a literal "$" (a
# matplotlib label), prose must not, since a "$" left there is math that was not typeset.
PROSE_TEXT = """(article) => {
    const code = Array.from(article.querySelectorAll("pre, code, .highlight"));
    const saved = code.map((e) => e.style.display);
    code.forEach((e) => { e.style.display = "none"; });
    const text = article.innerText;
    code.forEach((e, i) => { e.style.display = saved[i]; });
    return text;
}"""

# Images below the fold may be lazy: load them all, and give up on any after 15 s.
BROKEN_IMAGES = """async (article) => {
    const imgs = Array.from(article.querySelectorAll("img"));
    imgs.forEach((img) => { img.loading = "eager"; });
    const loaded = (img) => img.complete ? null : new Promise((done) => {
        img.addEventListener("load", done);
        img.addEventListener("error", done);
    });
    const timeout = new Promise((done) => setTimeout(done, 15000));
    await Promise.race([Promise.all(imgs.map(loaded)), timeout]);
    return imgs.filter((img) => !(img.complete && img.naturalWidth > 0)).map((img) => img.src);
}"""

UNTYPESET_MATH = """(article) => Array.from(article.querySelectorAll(".math"))
    .filter((e) => !e.querySelector("mjx-container")).map((e) => e.textContent.slice(0, 80))"""

CODE_BLOCKS = "(article) => Array.from(article.querySelectorAll('pre')).map((p) => p.textContent)"

MATHJAX_READY = "window.MathJax && MathJax.startup && MathJax.startup.promise"

# "$" or "\(" is a math delimiter left over; "\sqrt{" is TeX shown as text (a heading's
# math pasted into a cross-reference, say).
RAW_TEX = re.compile(r"\$|\\\(|\\\[|\\[A-Za-z]+\{")


DESKTOP = {"width": 1280, "height": 1000}


@contextlib.contextmanager
def _browser_page(timeout_ms: int, viewport: dict[str, int] | None = None) -> Iterator[Any]:
    """A page of Debian's Chromium (``viewport`` or Playwright's default size), closed with its browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(**({"viewport": viewport} if viewport else {}))
            page.set_default_timeout(timeout_ms)
            yield page
        finally:
            browser.close()


@pytest.mark.browser
def test_pages_render_in_chromium(server: str) -> None:
    problems: list[str] = []
    console: list[str] = []
    with _browser_page(30_000, DESKTOP) as page:

        def on_console(message: Any) -> None:
            if message.type == "error":
                console.append(f"{page.url}: {message.text}")

        page.on("console", on_console)
        page.on("pageerror", lambda error: console.append(f"{page.url}: {error}"))
        page.on("requestfailed", lambda r: console.append(f"{page.url}: no {r.url}"))

        for path, has_math in PAGES.items():
            problems += _page_problems(page, f"{server}/{path}", path, has_math)

        response = page.goto(f"{server}/search.html", wait_until="load")
        if response is None or response.status != 200:
            problems.append("search.html does not load")

    problems += [f"console error about MathJax: {c}" for c in console if "mathjax" in c.lower()]
    assert not problems, "\n".join(problems)


def _page_problems(page: Any, url: str, path: str, has_math: bool) -> list[str]:
    problems: list[str] = []
    response = page.goto(url, wait_until="load")
    if response is None or response.status != 200:
        return [f"{path}: HTTP {response and response.status}"]
    article = page.query_selector("article.bd-article")
    if article is None:
        return [f"{path}: no article element"]

    if has_math:
        page.wait_for_function(MATHJAX_READY)
        page.evaluate("MathJax.startup.promise")
        if not article.query_selector_all("mjx-container"):
            problems.append(f"{path}: no typeset math (mjx-container)")
        untypeset = article.evaluate(UNTYPESET_MATH)
        if untypeset:
            problems.append(f"{path}: math left untypeset: {untypeset[:3]}")

    prose = article.evaluate(PROSE_TEXT)
    raw = RAW_TEX.search(prose)
    if raw:
        at = raw.start()
        problems.append(f"{path}: raw TeX in the text: ...{prose[max(0, at - 60) : at + 60]!r}")

    broken = article.evaluate(BROKEN_IMAGES)
    if broken:
        problems.append(f"{path}: images that did not load: {broken}")

    text = page.evaluate("document.body.textContent")
    problems += [f"{path}: {marker!r} is on the page" for marker in LEAKS if marker in text]

    if path.startswith("book/0"):  # every chapter shows its experiments as figures
        figures = len(article.query_selector_all(".cell_output img"))
        if figures < 3:
            problems.append(f"{path}: {figures} figures, expected at least 3")
        blocks = [_squash(b) for b in article.evaluate(CODE_BLOCKS)]
        included = _included_objects(path)
        if not included:
            problems.append(f"{path}: shows no library code (literalinclude with :pyobject:)")
        for source, name in included:
            library = _squash((REPO / "book" / source).read_text(encoding="utf-8"))
            shown = [b for b in blocks if re.search(rf"(^|\s)(def|class) {name}\b", b)]
            if not shown:
                problems.append(f"{path}: no code block with {name} from {source}")
            elif shown[0] not in library:
                problems.append(f"{path}: its {name} is not the one in {source}")
    if path.startswith("exercises/") and "NotImplementedError" not in text:
        problems.append(f"{path}: no stub (raise NotImplementedError) on the exercise page")
    return problems


def _included_objects(page: str) -> list[tuple[str, str]]:
    """(file, object) of each ``literalinclude`` with ``:pyobject:`` in the page's source."""
    source = (REPO / page).with_suffix(".md").read_text(encoding="utf-8")
    return re.findall(r"```\{literalinclude\} (\S+)\n(?::[^\n]*\n)*?:pyobject: (\w+)", source)


def _squash(code: str) -> str:
    """Code with runs of whitespace made one space: HTML rendering may alter blank lines."""
    return re.sub(r"\s+", " ", code).strip()


def test_the_open_edition_shows_the_answers_that_the_class_edition_hides(built: Path) -> None:
    """The open edition prints each chapter's finished code: the lines that the class edition's test
    looks for are there to be found (so that test can fail)."""
    from tests.fixtures.answers import answer_lines, page_lines

    lines = answer_lines()
    shown = {lines[line] for path in (built / "book").glob("*.html") for line in page_lines(path) & lines.keys()}
    for answer in ("stepformer.attention.scaled_dot_product_attention", "stepformer.norms.LayerNorm",
                   "stepformer.gqa.from_multihead", "stepformer.translator.recipe.train_step"):
        assert answer in shown, answer


# Try first, then see. Per code block of a chapter page: its text, whether a reader sees it without a click, and
# the links of the chapter's "Exercise" section that come before it in the document.
CODE_AND_EXERCISE_LINKS = """(article) => {
    const section = article.querySelector("section#exercise");
    const links = section ? Array.from(section.querySelectorAll("a[href]")) : [];
    return Array.from(article.querySelectorAll("pre")).map((pre) => ({
        text: pre.textContent,
        visible: pre.checkVisibility({visibilityProperty: true, opacityProperty: true}),
        after: links.filter((a) => a.compareDocumentPosition(pre) & Node.DOCUMENT_POSITION_FOLLOWING)
                    .map((a) => a.getAttribute("href")),
    }));
}"""
# Opens each collapsed block (<details>) that holds a hidden code block with an answer's line, as a reader's
# click on its summary does, and says whether every such code block is visible then.
OPEN_AND_SEE = """(article, indices) => {
    const blocks = Array.from(article.querySelectorAll("pre"));
    for (const i of indices) {
        const summary = blocks[i].closest("details")?.querySelector(":scope > summary");
        if (summary && !blocks[i].checkVisibility()) summary.click();
    }
    return indices.filter((i) => !blocks[i].checkVisibility());
}"""
CHAPTER = re.compile(r"book/\d\d_\w+\.html$")
TRY_FIRST = "Try first, then see"  # what a chapter says once, near its top


@pytest.mark.browser
def test_graded_code_is_folded_after_its_exercise(server: str) -> None:
    """On every chapter page no line of a graded function's body is visible before a click, each block
    holding one comes after the link to its exercise in the chapter's "Exercise" section, and one click opens it."""

    from tests.fixtures.answers import ANSWERS, answer_lines, body_lines

    lines = answer_lines()
    # Each line -> the exercise pages ("01_attention/attention.html") of every graded function that holds it.
    exercises: dict[str, set[str]] = {line: set() for line in lines}
    for name, answer in ANSWERS.items():
        for line in body_lines(name) & lines.keys():
            exercises[line].add(f"{answer.assignment}/{Path(answer.notebook).stem}.html")
    chapters = [path for path in PAGES if CHAPTER.match(path)]
    problems, folded = [], 0
    with _browser_page(30_000, DESKTOP) as page:
        for path in chapters:
            page.goto(f"{server}/{path}", wait_until="load")
            article = page.query_selector("article.bd-article")
            hidden = []
            for i, block in enumerate(article.evaluate(CODE_AND_EXERCISE_LINKS)):
                given = [line.strip() for line in block["text"].splitlines() if line.strip() in lines]
                if not given:
                    continue
                if block["visible"]:
                    problems.append(f"{path}: visible before a click, {lines[given[0]]}'s line {given[0]!r}")
                else:
                    hidden.append(i)
                after = {"/".join(urlsplit(href).path.split("/")[-2:]) for href in block["after"]}
                # A line that two answers share (a softmax over the keys, say) may follow either's exercise.
                late = [line for line in given if not exercises[line] & after]
                if late:
                    problems.append(f"{path}: {lines[late[0]]}'s line {late[0]!r} comes before the link to "
                                    f"its exercise ({' or '.join(sorted(exercises[late[0]]))}) in the "
                                    "Exercise section")
            folded += len(hidden)
            if hidden and article.inner_text().count(TRY_FIRST) != 1:
                problems.append(f"{path}: folds graded code but does not say once, {TRY_FIRST!r}")
            if hidden and (closed := article.evaluate(OPEN_AND_SEE, hidden)):
                problems.append(f"{path}: {len(closed)} folded code blocks do not open with a click")
    assert not problems, "\n".join(problems)
    assert folded >= 40, f"only {folded} folded code blocks with a graded body were found on {len(chapters)} chapters"


def words(text: str) -> str:
    """The words of a text (three letters or more), as one string: Markdown and its HTML compare equal."""
    return " " + " ".join(re.findall(r"[A-Za-z]{3,}", text)) + " "


def solution_rubrics() -> dict[tuple[str, str], str]:
    """(exercise page, grade_id) -> the rubric of each answer graded by hand, read from solutions/."""
    import nbformat

    from stepformer.course.edition import rubrics

    return {(f"exercises/{path.parent.name}/{path.stem}.html", grade_id): rubric
            for path in sorted((REPO / "solutions").glob("*/*.ipynb"))
            for grade_id, rubric in rubrics(nbformat.read(path, as_version=4)).items()}


CLOSED_DETAILS = re.compile(r"<details\b(?![^>]*\bopen\b)[^>]*>(.*?)</details>", re.DOTALL)


def test_each_rubric_is_folded_after_its_answer(built: Path) -> None:
    """Self-learners can grade their own "prediction, checked" answers: on the exercise page, right after the
    answer's cell, a collapsed block holds the rubric from solutions/, and the rubric is nowhere else on the page."""
    marks = solution_rubrics()
    assert len(marks) >= 13
    problems = []
    for (path, grade_id), rubric in marks.items():
        html = (built / path).read_text(encoding="utf-8")
        wanted = words(rubric)
        folded = [m for m in CLOSED_DETAILS.finditer(html) if wanted in words(page_text_of(m.group(1)))]
        if not folded:
            problems.append(f"{path}: no collapsed block holds the rubric of {grade_id}")
            continue
        before = page_text_of(html[:folded[0].start()])
        if not before.rstrip().endswith("YOUR ANSWER HERE"):
            problems.append(f"{path}: the rubric of {grade_id} does not follow the answer's cell")
        if words(page_text_of(html)).count(wanted) != len(folded):
            problems.append(f"{path}: the rubric of {grade_id} is also shown outside its collapsed block")
    assert not problems, "\n".join(problems)


def page_text_of(html: str) -> str:
    import html as entities

    return entities.unescape(re.sub(r"<[^>]+>", "", html))


# Every page of the site as readers and students meet it: links, figures, search, the buttons of an
# exercise page, the console, a phone's screen. Links and images are read from the HTML files; the rest
# runs in Chromium against the site served over HTTP.

PHONE = {"width": 390, "height": 844}  # an iPhone 12 to 15's screen, in CSS pixels
IMAGE_FILE = re.compile(r"\.(png|jpe?g|gif|svg|webp)$", re.IGNORECASE)


def _site_pages(site: Path) -> list[Path]:
    """Every HTML page of the site: the book's, the index, search and bibliography pages (not the theme's files)."""
    return sorted(p for p in site.rglob("*.html") if not p.relative_to(site).parts[0].startswith("_"))


class _Html(HTMLParser):
    """What one page holds: its ids (the anchors a link may name), its links and its images; apart, its links to
    the same page in the other language (``hreflang``), which lead out of a site built alone."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.language_links: list[str] = []
        self.images: list[dict[str, str | None]] = []
        self.title = ""
        self._in_h1 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if tag in ("a", "link", "area") and a.get("href") is not None:
            (self.language_links if a.get("hreflang") else self.links).append(a["href"])
        if tag in ("img", "script", "source", "iframe", "embed") and a.get("src"):
            self.links.append(a["src"])
        if tag == "img":
            self.images.append(a)
        self._in_h1 = self._in_h1 or (tag == "h1" and not self.title)

    def handle_endtag(self, tag: str) -> None:
        if tag == "h1":
            self._in_h1 = False

    def handle_data(self, data: str) -> None:
        if self._in_h1:
            self.title += data


@functools.cache
def _html(path: Path) -> _Html:
    parser = _Html()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _resolve(page: Path, href: str) -> tuple[Path | None, str]:
    """The file a link of ``page`` points to and its #anchor; None for another site (http:, mailto:, ...)."""
    parts = urlsplit(href)
    if parts.scheme or parts.netloc:
        return None, ""
    path = unquote(parts.path)
    target = page if not path else Path(os.path.normpath(page.parent / path))
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def _broken_links(site: Path, root: Path | None = None) -> list[str]:
    """The links of ``site``'s pages whose file or anchor is missing, or that lead out of ``root`` (the site itself,
    or the published site that holds it)."""
    broken = []
    for page in _site_pages(site):
        where = page.relative_to(site).as_posix()
        for href in _html(page).links:
            target, anchor = _resolve(page, href)
            if target is None:
                continue
            if not target.is_relative_to(root or site):
                broken.append(f"{where}: {href} leaves the site")
            elif not target.is_file():
                broken.append(f"{where}: {href}: there is no {target.relative_to(root or site).as_posix()}")
            elif anchor and target.suffix == ".html" and anchor not in _html(target).ids:
                broken.append(f"{where}: {href}: {target.relative_to(root or site).as_posix()} has no #{anchor}")
    return broken


def test_every_internal_link_and_anchor_resolves(built: Path) -> None:
    pages = _site_pages(built)
    assert len(pages) >= len(PAGES)
    assert sum(len(_html(p).links) for p in pages) > 100 * len(PAGES)  # the parser does see the links
    broken = _broken_links(built)
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken[:40])


def _images_without_alt(site: Path) -> list[str]:
    """Content images (not the theme's icons) whose alt text is missing or only a file name, as docutils
    writes it for an image (a code cell's figure, say) given none."""
    found = []
    for page in _site_pages(site):
        for img in _html(page).images:
            src = img.get("src") or ""
            target, _ = _resolve(page, src)
            if target is not None and target.is_relative_to(site / "_static"):
                continue
            alt = (img.get("alt") or "").strip()
            if not alt or IMAGE_FILE.search(alt) or Path(alt).name == Path(unquote(src)).name:
                found.append(f"{page.relative_to(site).as_posix()}: {src} (alt={alt!r})")
    return found


def test_every_figure_has_alt_text(built: Path) -> None:
    images = [img for p in _site_pages(built) for img in _html(p).images]
    assert len(images) >= 3 * len([p for p in PAGES if p.startswith("book/0")])
    missing_alt = _images_without_alt(built)
    assert not missing_alt, (
        f"{len(missing_alt)} figures without alt text (a code cell's figure gets it from its options, "
        "`:mystnb: {image: {alt: ...}}`):\n" + "\n".join(missing_alt))


def _chromium() -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        missing("chromium not installed: apt-get install chromium")
    return chromium


@dataclass
class Visit:
    """What one page did in Chromium at a phone's width."""

    console: list[str]
    overflow: list[str]
    figures: list[dict[str, Any]]


# At a phone's width, what makes the reader scroll sideways: the page itself wider than the screen,
# or a block of text (not a code block, table or equation, which may scroll inside themselves) that
# sticks out of the screen or out of its own box.
OVERFLOW = """() => {
    const width = document.documentElement.clientWidth;
    const found = [];
    const page = document.scrollingElement;
    if (page.scrollWidth > width + 1) found.push(`the page is ${page.scrollWidth}px wide on a ${width}px screen`);
    const scrollsItself = (e) => {
        for (let p = e; p && p !== document.body; p = p.parentElement) {
            const o = getComputedStyle(p).overflowX;
            if (o === "auto" || o === "scroll") return true;
        }
        return false;
    };
    const article = document.querySelector("article.bd-article") || document.body;
    const text = "p, li, dt, dd, h1, h2, h3, h4, h5, h6, blockquote, figcaption, caption, .admonition-title";
    for (const e of article.querySelectorAll(text)) {
        const box = e.getBoundingClientRect();
        if ((box.width === 0 && box.height === 0) || scrollsItself(e)) continue;
        const over = Math.max(box.right - width, e.scrollWidth - e.clientWidth);
        if (over > 1) found.push(`${e.tagName.toLowerCase()} sticks out by ${Math.round(over)}px: ` +
                                 JSON.stringify(e.textContent.trim().slice(0, 70)));
    }
    // Math (MathJax's mjx-container, inline or display) that is cut off: its box sticks out of a box that
    // hides what overflows before any box that scrolls holds it, or out of the screen with no box to scroll.
    const mathText = (e) => {
        const mml = e.querySelector("mjx-assistive-mml");
        return JSON.stringify((mml ? mml.textContent : e.textContent).trim().slice(0, 70));
    };
    for (const e of article.querySelectorAll("mjx-container")) {
        const box = e.getBoundingClientRect();
        if (box.width === 0 && box.height === 0) continue;
        let cut = 0, scrolls = false;
        for (let p = e.parentElement; p && p !== document.documentElement; p = p.parentElement) {
            const o = getComputedStyle(p).overflowX;
            if (o === "auto" || o === "scroll") { scrolls = true; break; }
            if (o === "hidden" || o === "clip") {
                const edge = p.getBoundingClientRect();
                cut = Math.max(box.right - edge.right, edge.left - box.left);
                if (cut > 1) break;
            }
        }
        if (cut <= 1 && !scrolls) cut = box.right - width;
        if (cut > 1) found.push(`math cut off by ${Math.round(cut)}px: ${mathText(e)}`);
    }
    return found;
}"""

# At a phone's width, each figure of a cell's output and the size it is shown at against its own (a figure
# shrunk to a third of its size has tick labels 3px tall).
FIGURE_SCALES = """() => Array.from(document.querySelectorAll("article.bd-article .cell_output img"))
    .filter((img) => img.complete && img.naturalWidth > 0)
    .map((img) => ({src: img.getAttribute("src"), alt: img.alt, natural: img.naturalWidth,
                    scale: img.getBoundingClientRect().width / img.naturalWidth}))"""
# Below this a figure's text is too small to read: shown at half its size, a 10px label is 5px tall.
LEGIBLE_SCALE = 0.5

HAS_MATH = "() => document.querySelector('.math') !== null"
# Images below the fold may be lazy: load them all (15 s at most) so that their sizes are known.
EAGER_IMAGES = """async () => {
    const imgs = Array.from(document.querySelectorAll("article.bd-article img"));
    imgs.forEach((img) => { img.loading = "eager"; });
    const loaded = (img) => img.complete ? null : new Promise((done) => {
        img.addEventListener("load", done);
        img.addEventListener("error", done);
    });
    await Promise.race([Promise.all(imgs.map(loaded)), new Promise((done) => setTimeout(done, 15000))]);
}"""
# Console errors of the theme's own versions (pinned by Jupyter Book 1), harmless to readers, each matched exactly.
KNOWN_CONSOLE_ERRORS = {
    # Sphinx 7.4 writes sphinx-thebe's configuration script twice (an asset registered with filename None is not
    # recognised as already there when the page's assets are collected again); the first copy defines everything.
    "uncaught: Identifier 'THEBE_JS_URL' has already been declared":
        "Sphinx 7.4 adds sphinx-thebe's configuration script twice",
    # pydata-sphinx-theme 0.17 on a reader's first visit (nothing in localStorage yet): no default mode is set.
    "console.error: Got invalid theme mode: . Resetting to auto.":
        "pydata-sphinx-theme 0.17 on a first visit",
}


@pytest.fixture(scope="session")
def phone_visits(server: str, built: Path) -> dict[str, Visit]:
    return visit_on_a_phone(server, built)


def visit_on_a_phone(server: str, built: Path) -> dict[str, Visit]:
    """Every page of the site opened once in Chromium at a phone's width, all scripts run (MathJax too)."""
    from playwright.sync_api import sync_playwright

    visits: dict[str, Visit] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True)
            page = context.new_page()
            page.set_default_timeout(60_000)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"console.{m.type}: {m.text}")
                    if m.type == "error" and not _favicon(m.location.get("url", "")) else None)
            page.on("pageerror", lambda error: console.append(f"uncaught: {error}"))
            page.on("requestfailed", lambda r: console.append(f"request failed: {r.url} ({r.failure})"))
            page.on("response", lambda r: console.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
            for path in [p.relative_to(built).as_posix() for p in _site_pages(built) if not _redirect(p)]:
                console.clear()
                page.goto(f"{server}/{path}", wait_until="load")
                if page.evaluate(HAS_MATH):
                    page.wait_for_function(MATHJAX_READY)
                    page.evaluate("MathJax.startup.promise")
                page.evaluate(EAGER_IMAGES)
                visits[path] = Visit(list(console), page.evaluate(OVERFLOW), page.evaluate(FIGURE_SCALES))
        finally:
            browser.close()
    return visits


def _favicon(url: str) -> bool:
    """The icon that a browser asks the server's root for by itself: not a file of the site (on GitHub Pages
    that root is not even the site's)."""
    return urlsplit(url).path == "/favicon.ico"


def _redirect(page: Path) -> bool:
    """Whether the page only sends the browser elsewhere (the site's index.html does)."""
    return '<meta http-equiv="Refresh"' in page.read_text(encoding="utf-8")[:2000]


def console_errors(visits: dict[str, Visit]) -> list[str]:
    """What the visited pages logged to the console, the known harmless lines aside."""
    assert len(visits) >= len(PAGES)
    return [f"{path}: {line}" for path, visit in visits.items() for line in visit.console
            if line not in KNOWN_CONSOLE_ERRORS]


def sideways(visits: dict[str, Visit]) -> list[str]:
    """What makes a visited page scroll sideways, sticks out of its box or cuts an equation off."""
    return [f"{path}: {line}" for path, visit in visits.items() for line in visit.overflow[:5]]


def too_small(visits: dict[str, Visit]) -> list[str]:
    """The figures that a phone's width shrinks below LEGIBLE_SCALE of their size."""
    return [f"{path}: {figure['alt'][:60]!r} ({figure['natural']}px) shown at {figure['scale']:.2f} of its size"
            for path, visit in visits.items() for figure in visit.figures if figure["scale"] < LEGIBLE_SCALE]


@pytest.mark.browser
def test_no_page_logs_a_console_error(phone_visits: dict[str, Visit]) -> None:
    errors = console_errors(phone_visits)
    assert not errors, "\n".join(errors[:40])


@pytest.mark.browser
def test_every_page_reads_on_a_phone_without_scrolling_sideways(phone_visits: dict[str, Visit]) -> None:
    """Nothing makes the page scroll sideways, no text sticks out of its box, no equation is cut off."""
    wide = sideways(phone_visits)
    assert not wide, f"at {PHONE['width']}px wide:\n" + "\n".join(wide[:40])


@pytest.mark.browser
def test_figures_stay_legible_on_a_phone(phone_visits: dict[str, Visit]) -> None:
    """At a phone's width a wide figure is not shrunk below half its size (it scrolls inside its box instead)."""
    figures = [(path, figure) for path, visit in phone_visits.items() for figure in visit.figures]
    assert len(figures) >= 3 * len([p for p in PAGES if CHAPTER.match(p)])
    small = too_small(phone_visits)
    assert not small, f"at {PHONE['width']}px wide, {len(small)} figures too small to read:\n" + "\n".join(small[:40])


# Sphinx's search page writes its summary ("Search finished, found ...") once the results are listed.
SEARCH_DONE = """() => {
    const summary = document.querySelector("#search-results .search-summary");
    return summary !== null && summary.textContent.trim().length > 0;
}"""


def _search_term(title: str) -> str:
    """The longest word of a page's title: what a reader who remembers the page would type."""
    words = re.findall(r"[A-Za-z][a-z]{2,}", title)
    return max(words, key=len).lower() if words else ""


@pytest.mark.browser
def test_the_search_page_finds_every_page_of_the_book(server: str, built: Path) -> None:
    """Through the site's own search page (Sphinx's searchindex.js, run in Chromium): a word of each page's
    title finds that page."""

    pages = [path for path in PAGES if path.startswith("book/")]
    terms = {path: _search_term(_html(built / path).title) for path in pages}
    assert all(terms.values()), f"pages without a word in their title to search for: {terms}"
    not_found = search_misses(server, [(term, path, f"from {path}'s title") for path, term in terms.items()])
    assert not not_found, "\n".join(not_found)


def search_misses(site_url: str, searches: list[tuple[str, str, str]]) -> list[str]:
    """Each (term, page, why) whose search on the site's search page does not list the page."""
    not_found = []
    with _browser_page(60_000) as page:
        for term, path, why in searches:
            page.goto(f"{site_url}/search.html?q={quote(term)}", wait_until="load")
            page.wait_for_function(SEARCH_DONE)
            found = [urlsplit(href).path for href in page.locator("#search-results ul.search li > a")
                     .evaluate_all("links => links.map((a) => a.getAttribute('href'))")]
            if path not in found:
                summary = page.locator("#search-results .search-summary").inner_text()
                not_found.append(f"{term!r} ({why}) finds {found[:8] or summary}")
    return not_found


LAUNCHER = re.compile(r"https://(mybinder\.org|colab\.research\.google\.com)/")


def _repository() -> tuple[str, str]:
    """(owner/name, branch) of the repository in _config.yml, which the launch buttons name."""
    config = yaml.safe_load((REPO / "_config.yml").read_text())["repository"]
    return urlsplit(config["url"]).path.strip("/"), config.get("branch", "main")


@pytest.mark.browser
def test_exercise_pages_download_and_launch_the_exercise_notebook(server: str, built: Path) -> None:
    """On each exercise page the download button serves the student notebook with its nbgrader metadata (never a
    solution), and the launch buttons open that notebook (exercises/, never solutions/) in Binder and Colab, from
    the repository of _config.yml."""

    repository, branch = _repository()
    exercises = [path for path in PAGES if path.startswith("exercises/")]
    assert exercises
    problems = []
    with _browser_page(60_000, DESKTOP) as page:
        for path in exercises:
            notebook = Path(path).with_suffix(".ipynb").as_posix()
            page.goto(f"{server}/{path}", wait_until="load")
            problems += _download_problems(page, path, notebook)
            problems += _launch_problems(page, path, notebook, repository, branch)
    # No page at all (a chapter's launch buttons open its Markdown source) opens a solution.
    problems += [f"{page.relative_to(built).as_posix()}: {href}" for page in _site_pages(built)
                 for href in _html(page).links if LAUNCHER.match(href) and "solutions/" in href]
    assert not problems, "\n".join(problems)


def _download_problems(page: Any, path: str, notebook: str) -> list[str]:
    """The page's download menu, opened as a reader opens it, offers one .ipynb: the exercise notebook."""
    page.locator(".dropdown-download-buttons > button").click()
    link = page.locator(".dropdown-download-buttons a", has_text=".ipynb")
    if link.count() != 1 or not link.is_visible():
        return [f"{path}: the download menu shows no .ipynb"]
    response = page.request.get(link.evaluate("(a) => a.href"))
    page.keyboard.press("Escape")
    if not response.ok:
        return [f"{path}: the .ipynb download answers HTTP {response.status}"]
    text = response.text()
    problems = [f"{path}: the downloaded notebook holds {marker!r}" for marker in LEAKS if marker in text]
    served = json.loads(text)
    graded = [c for c in served["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id")]
    if not graded or served.get("metadata", {}).get("kernelspec") is None:
        problems.append(f"{path}: the downloaded notebook has no nbgrader metadata or no kernel")
    if served != json.loads((REPO / notebook).read_text(encoding="utf-8")):
        problems.append(f"{path}: the download is not {notebook}")
    return problems


def _launch_problems(page: Any, path: str, notebook: str, repository: str, branch: str) -> list[str]:
    page.locator(".dropdown-launch-buttons > button").click()
    links = page.locator(".dropdown-launch-buttons a").evaluate_all("links => links.map((a) => a.href)")
    page.keyboard.press("Escape")
    problems = [f"{path}: a launch button opens solutions: {href}" for href in links if "solutions/" in href]
    wanted = {
        "Binder": f"https://mybinder.org/v2/gh/{repository}/{branch}?urlpath=lab/tree/{notebook}",
        "Colab": f"https://colab.research.google.com/github/{repository}/blob/{branch}/{notebook}",
    }
    problems += [f"{path}: no {name} button for {url} (buttons: {links})"
                 for name, url in wanted.items() if url not in links]
    return problems
