"""The Chinese exercise notebooks and the checks' Chinese messages.

Each assignment's Chinese notebook is its English release with the prose of its markdown cells from
the exercise page's catalogue, and nothing else changed; every message a check can show has a
Chinese entry with the same fields; the checks choose their language from the environment, the
notebook a kernel runs, or the notebooks of its folder; the grader's intake takes the twin a student
answered.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from stepformer.checks import _messages
from stepformer.checks._messages import LANGUAGE_ENV, fields, language, t
from stepformer.course.catalogues import check_templates, checks_problems, protected
from stepformer.course.intake import read_submissions
from stepformer.course.translation import (
    TranslationMissing,
    catalogue_of,
    chinese_path,
    translate_markdown,
    translated,
    translations,
    write_chinese,
)
from tests.fixtures.chinese import CJK

ROOT = Path(__file__).resolve().parents[1]
RELEASE = sorted((ROOT / "exercises").glob("*/*.ipynb"))


def test_every_assignment_has_its_chinese_notebook_and_it_is_current():
    assert len(RELEASE) == 14
    problems = [p for notebook in RELEASE for p in write_chinese(ROOT, notebook, check=True)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("notebook", RELEASE, ids=lambda p: p.parent.name)
def test_the_chinese_notebook_differs_from_the_english_in_prose_only(notebook):
    from nbgrader.utils import compute_checksum

    english = nbformat.read(notebook, as_version=4)
    chinese = nbformat.read(chinese_path(notebook), as_version=4)
    assert chinese.metadata == {**english.metadata, "stepformer": {"language": "zh"}}
    assert len(chinese.cells) == len(english.cells)
    translated_cells = 0
    for en, zh in zip(english.cells, chinese.cells, strict=True):
        assert (zh.cell_type, zh.get("id")) == (en.cell_type, en.get("id"))
        meta_en, meta_zh = en.metadata.get("nbgrader", {}), zh.metadata.get("nbgrader", {})
        if en.cell_type == "code" or meta_en.get("solution"):
            assert zh == en, f"cell {en.get('id')} changed"  # code, outputs, grade ids and checksums: untouched
            continue
        assert {k: v for k, v in meta_zh.items() if k != "checksum"} == {
            k: v for k, v in meta_en.items() if k != "checksum"}
        if "checksum" in meta_en:  # nbgrader's Validate finds the instructions unchanged
            assert meta_zh["checksum"] == compute_checksum(zh)
        # What is not prose stays, as the catalogues' check reads it: inline code, math, roles, link targets.
        assert protected(" ".join(zh.source.split())) == protected(" ".join(en.source.split()))
        if re.search(r"[A-Za-z]{4}", re.sub(r"`[^`]+`|\$[^$]+\$", "", en.source)):
            assert CJK.search(zh.source), f"cell {en.get('id')} has English prose left"
            translated_cells += 1
    assert translated_cells >= 5


def test_translation_keeps_structure_and_refuses_a_message_it_lacks():
    text = "# Title\n\nA paragraph\nover two lines.\n\n- an item\n  that wraps\n\n| a | b |\n| --- | --- |\n| 1 | x |\n"
    messages = {"Title": "标题", "A paragraph over two lines.": "一个段落。", "an item that wraps": "一项",
                "a": "甲", "b": "乙", "x": "某"}
    wanted = "# 标题\n\n一个段落。\n\n- 一项\n\n| 甲 | 乙 |\n| --- | --- |\n| 1 | 某 |\n"
    assert translate_markdown(text, messages) == wanted
    with pytest.raises(TranslationMissing, match="over two lines"):
        translate_markdown(text, {"Title": "标题"})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("Title"),
                                         nbformat.v4.new_code_cell("# Title")])
    out = translated(nb, {"Title": "标题"})
    assert [c.source for c in out.cells] == ["标题", "# Title"] and "stepformer" not in nb.metadata


def test_every_check_message_has_a_chinese_entry_with_the_same_fields():
    problems = checks_problems(ROOT)
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} in all)"
    templates, _ = check_templates(ROOT)
    assert sum(len(found) for found in templates.values()) > 500  # every checks module speaks through t()


def test_every_label_of_a_forbidden_built_in_has_a_chinese_entry():
    """"Not your own work: ... uses torch.softmax (PyTorch's softmax)": the label in parentheses is shown in the
    reader's language, so every check's ``forbid`` label is in the catalogue."""
    import importlib
    import pkgutil

    import stepformer.checks

    labels = {label for module in pkgutil.iter_modules(stepformer.checks.__path__)
              for value in vars(importlib.import_module(f"stepformer.checks.{module.name}")).values()
              for label in (getattr(value, "forbid", None) or {}).values()}
    assert len(labels) > 10
    assert not sorted(labels - _messages._chinese().keys())


def test_a_message_is_formatted_by_the_same_fields_in_both_languages(monkeypatch):
    template = "{what} should have shape ({named}), got {shape}. Check which axes your einsum pattern keeps and in " \
               "what order."
    values = {"what": "output", "named": "batch=2, q_len=5", "shape": (2, 4)}
    monkeypatch.setenv(LANGUAGE_ENV, "en")
    english = t(template, **values)
    monkeypatch.setenv(LANGUAGE_ENV, "zh")
    chinese = t(template, **values)
    assert english.startswith("output should have shape (batch=2, q_len=5), got (2, 4).")
    assert CJK.search(chinese) and "(batch=2, q_len=5)" in chinese and "(2, 4)" in chinese
    assert sorted(fields(template)) == sorted(fields(_messages._chinese()[template]))
    monkeypatch.setenv(LANGUAGE_ENV, "fr")
    with pytest.raises(ValueError, match="en or zh"):
        language()


def test_the_language_comes_from_the_environment_the_session_or_the_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(LANGUAGE_ENV, raising=False)
    _messages._notebook_language.cache_clear()
    english = nbformat.v4.new_notebook()
    chinese = nbformat.v4.new_notebook(metadata={"stepformer": {"language": "zh"}})
    (tmp_path / "zh").mkdir()
    nbformat.write(english, tmp_path / "a.ipynb")
    nbformat.write(chinese, tmp_path / "zh" / "a.ipynb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "zh" / "a.ipynb"))  # JupyterLab's kernel
    assert language() == "zh"
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "a.ipynb"))
    assert language() == "en"
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.chdir(tmp_path / "zh")  # nbgrader's Validate: a fresh kernel in the notebook's folder
    assert language() == "zh"
    monkeypatch.setenv(LANGUAGE_ENV, "en")  # the grader's word is final
    assert language() == "en"


def test_intake_grades_the_twin_the_student_answered(tmp_path):
    release = ROOT / "exercises" / "01_attention" / "attention.ipynb"
    english = nbformat.read(release, as_version=4)
    chinese = translated(english, translations(catalogue_of(ROOT, "01_attention", "attention.ipynb")))

    def answered(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
        nb = nbformat.reads(nbformat.writes(nb), as_version=4)
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("solution") and cell.cell_type == "code":
                cell.source = "def f():\n    return 1\n"
        return nb

    for student, (en, zh) in {"works_in_chinese": (english, answered(chinese)),
                              "works_in_english": (answered(english), chinese)}.items():
        folder = tmp_path / "subs" / student / "01_attention"
        (folder / "zh").mkdir(parents=True)
        nbformat.write(en, folder / "attention.ipynb")
        nbformat.write(zh, folder / "zh" / "attention.ipynb")
    intakes, _ = read_submissions(tmp_path / "subs", "01_attention", ["attention.ipynb"], tmp_path / "scratch")
    by_student = {i.student: i for i in intakes}
    for student, language_wanted in (("works_in_chinese", "zh"), ("works_in_english", "en")):
        intake = by_student[student]
        graded = json.loads(intake.notebooks["attention.ipynb"].read_text())
        assert graded["metadata"].get("stepformer", {}).get("language", "en") == language_wanted
        assert [p for p in intake.problems if p.startswith("graded ")], intake.problems
        assert not [p for p in intake.problems if "copies of" in p or "ignored" in p], intake.problems


def test_a_chinese_notebook_takes_earlier_answers_from_the_chinese_notebooks_first(monkeypatch, tmp_path):
    """The class edition's given cells, run from ``07_encoder/zh/``: the earlier chapter's Chinese notebook answers
    first, its English twin where the Chinese one is still the stub."""
    from stepformer.checks.given import given

    def notebook(source: str) -> nbformat.NotebookNode:
        return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])

    stub = "def helper():\n    raise NotImplementedError()\n"
    for folder, english, chinese in (("01_a", "def helper():\n    return 'en'\n", "def helper():\n    return 'zh'\n"),
                                     ("02_b", "def other():\n    return 'en'\n", stub.replace("helper", "other"))):
        (tmp_path / folder / "zh").mkdir(parents=True)
        nbformat.write(notebook(english), tmp_path / folder / "a.ipynb")
        nbformat.write(notebook(chinese), tmp_path / folder / "zh" / "a.ipynb")
    (tmp_path / "07_encoder" / "zh").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "07_encoder" / "zh")
    namespace: dict = {}
    assert "01_a/zh/a.ipynb" in given("not_a_course_module.helper", "01_a/a.ipynb", namespace)
    assert namespace["helper"]() == "zh"
    assert "02_b/a.ipynb" in given("not_a_course_module.other", "02_b/a.ipynb", namespace)
    assert namespace["other"]() == "en"


def test_no_check_translates_at_import_time():
    """A message chosen at import would keep the language of the first reader: the grader's re-check serves students
    of both languages in one process. Imported under Chinese, no module-level value of the checks holds Chinese."""
    program = (
        "import importlib, pkgutil, re, stepformer.checks as c\n"
        "found = []\n"
        "def walk(value, where, depth=0):\n"
        "    if isinstance(value, str):\n"
        "        if re.search(r'[\\u4e00-\\u9fff]', value): found.append(where)\n"
        "    elif isinstance(value, (list, tuple, set, frozenset)) and depth < 3:\n"
        "        for item in value: walk(item, where, depth + 1)\n"
        "    elif isinstance(value, dict) and depth < 3:\n"
        "        for k, v in value.items(): walk(k, where, depth + 1); walk(v, where, depth + 1)\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    module = importlib.import_module('stepformer.checks.' + m.name)\n"
        "    for name, value in vars(module).items():\n"
        "        walk(value, m.name + '.' + name)\n"
        "        walk(getattr(value, 'forbid', None), m.name + '.' + name + '.forbid')\n"
        "print('\\n'.join(found))\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env={**os.environ, LANGUAGE_ENV: "zh"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert not proc.stdout.strip(), proc.stdout
