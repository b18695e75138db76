"""The student's path in a real JupyterLab, started by `make lab` and driven in Chromium.

A student opens an exercise, runs every cell and sees the first check fail because nothing is
written yet; types an answer, runs again and sees that exercise's checks pass (the next one still
fails); presses nbgrader's Validate button and reads its verdict. The instructors' nbgrader tools
(formgrader, the create-assignment panel, the course and assignment lists) are not there. The same
walk on the Chinese notebook (``01_attention/zh/``) reads every check's message in Chinese.
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest

from stepformer.course.sync import BEGIN, END
from tests.fixtures.prerequisites import missing

pytestmark = [pytest.mark.slow, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[1]
ASSIGNMENT, NOTEBOOK = "01_attention", "attention.ipynb"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# Generous: a kernel that imports torch on a busy 2-core machine takes a while.
START, RUN, VALIDATE = 120, 180, 300  # seconds


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """`make lab` on a copy of exercises/, on a loopback port with a token, with no user settings of its own."""
    if shutil.which("chromium") is None:
        missing("chromium not installed: apt-get install chromium")
    if shutil.which("make") is None:
        missing("make not installed (the README's prerequisite): apt-get install make")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "exercises"
    shutil.copytree(REPO / "exercises", root)
    port, token = _free_port(), secrets.token_hex(16)
    flags = ["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={token}", "--LabApp.news_url=None"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers: Jupyter refuses root unless told
        flags.append("--allow-root")
    # A fresh student: no user-level Jupyter config, settings or workspaces of whoever runs the tests.
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
    env.pop("JUPYTER_CONFIG_PATH", None)
    log = tmp / "lab.log"
    # The Makefile's own target; -o: never reinstall .venv from here; BIN: this test's environment.
    command = ["make", "-s", "-o", ".venv/.installed", "lab", f"BIN={Path(sys.executable).parent}",
               f"LAB_DIR={root}", f"LAB_FLAGS={' '.join(flags)}"]
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`make lab` exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer in {START} s:\n{log.read_text()[-4000:]}")
                time.sleep(0.5)
        yield Lab(url, token, root, log)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop make, JupyterLab and its kernels: the process group that this test started."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # kernels left behind, if any
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _cells(notebook: str) -> tuple[list[Any], list[tuple[int, str]]]:
    """The exercise's cells, and its first exercise's answer cells (all those before its first graded check:
    chapter 01's masked_softmax, then its attention), each with its answer as a student would type it."""
    cells = nbformat.read(REPO / "exercises" / ASSIGNMENT / notebook, as_version=4).cells
    source = nbformat.read(REPO / "solutions" / ASSIGNMENT / NOTEBOOK, as_version=4).cells
    first = next(i for i, c in enumerate(cells) if c.cell_type == "code" and _meta(c).get("solution"))
    answers = []
    for i in range(first, len(cells)):
        if cells[i].cell_type == "code" and _meta(cells[i]).get("grade"):
            break
        if cells[i].cell_type == "code" and _meta(cells[i]).get("solution"):
            solution = next(c.source for c in source if _meta(c).get("grade_id") == _meta(cells[i])["grade_id"])
            answers.append((i, "\n".join(line for line in solution.splitlines() if line.strip() not in (BEGIN, END))))
    return cells, answers


def _meta(cell: Any) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _checks(cells: list[Any], start: int) -> list[int]:
    """The graded check cells after the answer cell ``start``, up to the next answer cell."""
    found = []
    for i in range(start + 1, len(cells)):
        if _meta(cells[i]).get("solution"):
            break
        if cells[i].cell_type == "code" and _meta(cells[i]).get("grade"):
            found.append(i)
    return found


# The English notebook, and its Chinese twin (exercises/01_attention/zh/): the checks speak the notebook's language.
WALKS = {"en": (NOTEBOOK, "not implemented yet"), "zh": (f"zh/{NOTEBOOK}", "尚未实现")}


@pytest.mark.parametrize("language", list(WALKS))
def test_a_student_runs_answers_and_validates_an_exercise_without_instructor_tools(lab: Lab, language: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    notebook, not_yet = WALKS[language]
    cells, answers = _cells(notebook)
    answer_at = answers[-1][0]
    checks = _checks(cells, answer_at)
    assert checks, "the first exercise has no graded check"
    next_answer = next(i for i in range(answer_at + 1, len(cells))
                       if cells[i].cell_type == "code" and _meta(cells[i]).get("solution"))
    next_check = _checks(cells, next_answer)[0]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(RUN * 1000)
            # A workspace of its own per walk: the other walk's notebook is not reopened beside this one.
            page.goto(f"{lab.url}/lab/workspaces/walk-{language}/tree/{ASSIGNMENT}/{notebook}?token={lab.token}")
            panel = page.locator(".jp-NotebookPanel")
            dom_cells = panel.locator(".jp-Notebook .jp-Cell")
            expect(dom_cells).to_have_count(len(cells), timeout=START * 1000)
            idle = panel.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
            _wait_for_kernel(lab, f"{ASSIGNMENT}/{notebook}")
            idle.wait_for(timeout=START * 1000)

            # No instructor tools: nbgrader's own package is loaded (its Validate button is here)...
            validate = panel.locator(".jp-NotebookPanel-toolbar .validate-button")
            expect(validate).to_be_visible()
            # ...but not its menu (Formgrader, Create assignment, Course/Assignment List) nor its panels.
            menus = page.locator("#jp-menu-panel .lm-MenuBar-itemLabel").all_inner_texts()
            assert "File" in menus and "Nbgrader" not in menus, menus
            tabs = [t.get_attribute("title") or "" for t in page.locator(".lm-TabBar-tab").all()]
            assert not [t for t in tabs if "Create Assignment" in t or "Formgrader" in t], tabs
            # Nor their server side (with the instructors' set-up: 302, 200 and 200).
            for path in ("formgrader", "formgraders", "courses"):
                with pytest.raises(urllib.error.HTTPError) as answer_of:
                    urllib.request.urlopen(f"{lab.url}/{path}?token={lab.token}", timeout=30)
                assert answer_of.value.code == 404, f"/{path} is served to students"

            # Run everything: the first check fails, saying the function is not written yet.
            _run_all(page)
            first_check = dom_cells.nth(checks[0]).locator(".jp-OutputArea")
            # The kernel imports torch and the checks first: wait as long as a run may take, not expect's 5 s.
            expect(first_check).to_contain_text(not_yet, timeout=RUN * 1000)
            expect(first_check).not_to_contain_text("✔")
            idle.wait_for()

            # Type the answers over the stubs, as a student would.
            for at, answer in answers:
                dom_cells.nth(at).locator(".cm-content").click()
                page.keyboard.press("Control+a")
                page.keyboard.insert_text(answer)
                page.keyboard.press("Escape")
                expect(dom_cells.nth(at).locator(".cm-content")).to_contain_text(answer.splitlines()[-1].strip())

            # Run again: every check of this exercise passes, the next exercise's first check fails.
            _run_all(page)
            for i in checks:
                expect(dom_cells.nth(i).locator(".jp-OutputArea")).to_contain_text("✔", timeout=RUN * 1000)
                if language == "zh":  # the ✔ lines speak Chinese too
                    # expect retries: the notebook may render a cell's output area again while it is read once.
                    expect(dom_cells.nth(i).locator(".jp-OutputArea")).to_contain_text(
                        re.compile(r"✔ .*[\u4e00-\u9fff]"), timeout=RUN * 1000)
            expect(dom_cells.nth(next_check).locator(".jp-OutputArea")).to_contain_text(not_yet, timeout=RUN * 1000)
            idle.wait_for()

            # Validate: nbgrader saves the notebook, runs it afresh and lists the cells that fail.
            validate.click()
            message = page.locator(".jp-Dialog #validation-message")
            message.wait_for(timeout=VALIDATE * 1000)
            verdict = message.inner_text()
            assert "validation-failed" in (message.get_attribute("class") or ""), verdict[:2000]
            assert _first_line(cells[next_check].source) in verdict and not_yet in verdict, verdict[:2000]
            wrong = [_first_line(cells[i].source) for i in checks if _first_line(cells[i].source) in verdict]
            assert not wrong, f"Validate reports checks of the answered exercise as failing: {wrong}"
            page.locator(".jp-Dialog").get_by_role("button", name="Ok").click()
        finally:
            browser.close()
    saved = nbformat.read(lab.root / ASSIGNMENT / notebook, as_version=4)
    for at, answer in answers:
        assert saved.cells[at].source.strip() == answer.strip(), "Validate did not save the typed answers"


def _wait_for_kernel(lab: Lab, path: str) -> None:
    """Wait until the server reports the notebook's kernel started and idle. The page's execution indicator says
    "idle" before any kernel is connected, and a Run All given then runs nothing: every prompt stays [ ]."""
    deadline = time.monotonic() + START
    while True:
        with urllib.request.urlopen(f"{lab.url}/api/sessions?token={lab.token}", timeout=30) as answer:
            sessions = json.load(answer)
        states = [(s.get("kernel") or {}).get("execution_state") for s in sessions if s.get("path") == path]
        if "idle" in states:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"no idle kernel for {path} after {START} s (sessions: {sessions}):\n"
                        f"{lab.log.read_text()[-4000:]}")
        time.sleep(0.5)


def _run_all(page: Any) -> None:
    """Run > Run All Cells, through the menu bar; then wait until the first code cell has left its [ ] prompt
    (queued or run), so that a Run All the page dropped fails here, saying so."""
    from playwright.sync_api import expect

    page.locator("#jp-menu-panel .lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
    first = page.locator(".jp-NotebookPanel .jp-Notebook .jp-CodeCell .jp-InputArea-prompt").first
    expect(first, "Run All did not start the notebook's cells").not_to_have_text("[ ]:", timeout=START * 1000)


def _first_line(source: str) -> str:
    """The first line of a cell's code, which the Validate dialog prints with the failing cell."""
    return next(line for line in source.splitlines() if line.strip())

