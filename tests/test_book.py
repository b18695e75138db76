"""The published site: it builds with warnings as errors, and its pages render in a real browser."""

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    def __init__(self, returncode: int, output: str, html: Path) -> None:
        self.returncode, self.output, self.html = returncode, output, html

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def build_book(out: Path, edition: str = "open") -> Build:
    """Build the site of one edition (``open`` or ``class``) under ``out``."""
    # The build executes the chapters: the kernel must be this environment's Python.
    # Both editions execute the same chapters: built one after the other (one xdist group), they share
    # one cache of executed pages beside their folders, so the second build executes nothing.
    env = {**os.environ, "PATH": f"{JUPYTER_BOOK.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "STEPFORMER_EDITION": edition, "STEPFORMER_EXECUTION_CACHE": str(out.parent / "executed-pages")}
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
        timeout=900,
    )
    return Build(proc.returncode, proc.stdout + proc.stderr, out / "_build" / "html")


@pytest.fixture(scope="session")
def book(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build_book(tmp_path_factory.mktemp("book"))


@pytest.fixture(scope="session")
def built(book: Build) -> Path:
    if book.returncode != 0:
        pytest.fail(f"the book did not build (exit {book.returncode}):\n{book.tail()}")
    return book.html


def test_book_builds_without_warnings(book: Build) -> None:
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


@pytest.fixture(scope="session")
def server(built: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(built))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


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


@pytest.mark.browser
def test_pages_render_in_chromium(server: str) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        missing("chromium not installed: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    console: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(30_000)

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
        finally:
            browser.close()

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
