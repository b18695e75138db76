"""Publishing: the site is deployed by a workflow that builds it with the README's command, and the course's
repository address is written in one place, _config.yml, which the launch buttons and the notebooks' install
cell both follow."""

import json
import shutil
import subprocess
from pathlib import Path

import nbformat
import yaml

from stepformer.course.sync import CONFIG_URL, GIT_INSTALL, course_install, repository_url, sync

ROOT = Path(__file__).resolve().parents[1]


def _installs(folder: Path) -> dict[str, set[str]]:
    """Every ``git+<address>`` that the notebooks under ``folder`` give to pip, by notebook."""
    return {path.relative_to(folder).as_posix(): {m for c in nbformat.read(path, as_version=4).cells
                                                  if c.cell_type == "code" for m in GIT_INSTALL.findall(c.source)}
            for path in sorted(folder.glob("*/*.ipynb"))}


def test_the_notebooks_and_the_class_edition_install_the_repository_of_config_yml():
    from stepformer.course.edition import COURSE_INSTALL

    install = course_install(ROOT)
    assert install == "git+" + yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].rstrip("/")
    assert COURSE_INSTALL == json.dumps(install)
    for folder in ("solutions", "exercises"):
        installs = _installs(ROOT / folder)
        assert any(installs.values()), f"no notebook in {folder}/ installs the course"
        wrong = {name: found for name, found in installs.items() if found - {install}}
        assert not wrong, f"{folder}/ installs another address than _config.yml's {install}: {wrong} (run `make sync`)"


def test_changing_the_address_in_config_yml_is_flagged_then_synced_into_every_notebook(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    config = (ROOT / "_config.yml").read_text()
    old = repository_url(ROOT)
    new = "https://github.com/a-fork/its-course"
    (tmp_path / "_config.yml").write_text(config.replace(old, new + "/"))
    assert repository_url(tmp_path) == new

    before = _installs(tmp_path / "solutions")
    flagged = {s.notebook.as_posix() for s in sync(tmp_path, check=True) if s.library == CONFIG_URL}
    assert flagged == {f"solutions/{name}" for name, found in before.items() if found}
    assert _installs(tmp_path / "solutions") == before  # --check changes nothing

    sync(tmp_path)
    assert not [s for s in sync(tmp_path, check=True) if s.library == CONFIG_URL]
    after = _installs(tmp_path / "solutions")
    assert {name for name, found in after.items() if found} == {name for name, found in before.items() if found}
    assert all(found == {f"git+{new}"} for found in after.values() if found)


def test_the_pages_workflow_deploys_what_make_book_builds():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "pages.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert "main" in triggers["push"]["branches"]
    assert {"pages": "write", "id-token": "write"}.items() <= workflow["permissions"].items()
    build = workflow["jobs"]["build"]["steps"]
    uses = [step.get("uses", "") for step in build]
    python = next(step for step in build if step.get("uses", "").startswith("actions/setup-python@"))
    assert python["with"]["python-version"] == "3.11"
    # The English site, then the Chinese one, which `make book BOOK_LANG=zh` copies into _build/html/zh.
    assert [step["run"] for step in build if "run" in step and "make book" in step["run"]] == [
        "make book", "make book BOOK_LANG=zh"]
    upload = next(step for step in build if step.get("uses", "").startswith("actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "_build/html"  # where `make book` writes the open edition
    assert uses.index(python["uses"]) < uses.index(upload["uses"])
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert any(step.get("uses", "").startswith("actions/deploy-pages@") for step in deploy["steps"])
    assert f"Open: file://{ROOT}/_build/html/index.html" in _make_book()
    # The Chinese site lands inside the upload.
    assert "cp -r _build/zh/_build/html _build/html/zh" in _make_book("BOOK_LANG=zh")


def test_each_editions_chinese_site_lands_in_its_english_site():
    """The class edition is laid out as the open one: its Chinese site is built apart, then copied under zh/."""
    english, chinese = _make_book("EDITION=class"), _make_book("EDITION=class", "BOOK_LANG=zh")
    assert "--path-output _build/class\n" in english.replace(" \n", "\n")
    assert f"Open: file://{ROOT}/_build/class/_build/html/index.html" in english
    assert "STEPFORMER_EDITION=class STEPFORMER_LANG=zh" in chinese and "--path-output _build/class-zh" in chinese
    assert "cp -r _build/class-zh/_build/html _build/class/_build/html/zh" in chinese
    assert f"Open: file://{ROOT}/_build/class/_build/html/zh/index.html" in chinese


def _make_book(*variables: str) -> str:
    """The commands that ``make book`` with ``variables`` runs (``make -n``), the installation into .venv left out."""
    proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", "book", *variables], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
