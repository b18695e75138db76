"""No result is typed into the prose: a number that a run measured reaches a page through `glue`.

The results of the course's runs live in ``book/results/*.json``; the pages read them (or run the
experiment) and glue the numbers into their text with ``{glue:text}``, so that a new run cannot
leave an old number behind. This guard reads every page's prose (outside code cells, code blocks,
inline code, glue roles and directives, and math) and fails on a decimal number that equals,
at the precision written, a measured value of a results file. A page's prose is also where a
comparison against an older run would be typed by hand: that is what it catches.

Settings (a run's configuration, seeds, versions) are not results and are not compared. A few
numbers are written as themselves and happen to equal some measured value; each is allowed on
its page with its reason, below.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
RESULTS = BOOK / "results"

# Keys whose values describe how a run was made, not what it measured.
NOT_MEASURED = {"settings", "overrides", "config", "seed", "seeds", "bootstrap_seed", "torch", "python", "commit",
                "train_commit", "eval_commit", "length_penalty", "beam", "label_smoothing", "dropout",
                "cooldown", "peak_lr", "warmup", "date", "command", "sides", "argv", "args", "recipe", "mask_rate",
                "chosen_when_evaluated"}

# (page, number as written): why it is not a measured result.
ALLOWED = {
    ("00_before.md", "0.01"): "the smoothing constant alpha that the page chooses, a setting",
    ("12_models.md", "7.24"): "Mistral's parameter count, computed from its published configuration",
    ("12_models.md", "6.74"): "LLaMA 7B's parameter count, computed from its published configuration",
    ("12_models.md", "0.39"): "an answer's arithmetic: 65,536 of 16,777,216 parameters",
    ("12_models.md", "0.15"): "a probability that a question gives",
    ("appendix_questions.md", "0.09"): "the variance of the experiment's noise, 0.3 squared: a setting",
    ("setup.md", "3.11"): "Python's version",
}

DECIMAL = re.compile(r"(?<![\w.$\\^_-])(\d+\.\d+)(?![\w.]*\d)(\s*%)?")


def measured_values(node, key=None):
    """Every float in a results file, outside the keys that describe settings."""
    if key in NOT_MEASURED:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            yield from measured_values(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from measured_values(v, key)
    elif isinstance(node, float):
        yield node


def all_measured() -> list[float]:
    values = []
    for path in sorted(RESULTS.glob("*.json")):
        values += measured_values(json.loads(path.read_text(encoding="utf-8")))
    return values


FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\{[\w-]+\})?.*?^\1\s*$", re.MULTILINE | re.DOTALL)
PROSE_DIRECTIVES = {"{dropdown}", "{note}", "{admonition}", "{tip}", "{warning}", "{important}", "{seealso}",
                    "{hint}", "{caution}", "{attention}"}


def prose(text: str) -> str:
    """The page without what is not prose: front matter, code, glue, math, roles' targets, labels."""
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.DOTALL)

    def fence(match: re.Match) -> str:
        directive = match.group(2)
        if directive in PROSE_DIRECTIVES:
            body = match.group(0).split("\n", 1)[1].rsplit("\n", 1)[0]
            body = re.sub(r"^:\w[\w-]*:.*$", "", body, flags=re.MULTILINE)  # the directive's options
            return "\n" + prose(body) + "\n"
        return "\n"

    text = FENCE.sub(fence, text)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.DOTALL)
    text = re.sub(r"(?<![\\$])\$[^$\n]+\$", " ", text)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", " ", text)  # roles: {glue:text}`name`, {math}`...`, {doc}`...`
    text = re.sub(r"`[^`\n]*`", " ", text)  # inline code: commands, options, identifiers
    text = re.sub(r"^\(.*\)=\s*$", "", text, flags=re.MULTILINE)  # labels
    return text


def typed_results(name: str, text: str, values: list[float]) -> list[str]:
    found = []
    for match in DECIMAL.finditer(prose(text)):
        written, percent = match.group(1), match.group(2)
        if (name, written) in ALLOWED:
            continue
        places = len(written.split(".")[1])
        if places < 2 and len(written.replace(".", "").lstrip("0")) < 3:
            continue  # "3.5", "0.2": too coarse to say which value, if any, it quotes
        target = float(written)
        candidates = values if not percent else [100 * v for v in values] + values
        if any(round(v, places) == target for v in candidates):
            found.append(written + (percent or "").strip())
    return found


def pages() -> list[Path]:
    return sorted(BOOK.glob("*.md"))


@pytest.fixture(scope="module")
def values() -> list[float]:
    return all_measured()


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_no_measured_number_is_typed_into_the_prose(page, values):
    found = typed_results(page.name, page.read_text(encoding="utf-8"), values)
    assert not found, (f"{page.name} types numbers that a results file measured: {', '.join(found)}; glue them "
                       "from the results file (myst_nb's glue and {glue:text}), or say in ALLOWED why one is not a "
                       "result")


def test_the_guard_sees_a_typed_number_and_not_a_glued_one():
    values = [42.5312, 0.119]
    glued = "The model reaches {glue:text}`bleu_de_en` BLEU, $x = 42.53$, `--x 42.53`.\n"
    assert typed_results("x.md", glued, values) == []
    assert typed_results("x.md", "The model reaches 42.53 BLEU.", values) == ["42.53"]
    assert typed_results("x.md", "It reaches 42.5 BLEU and an MFU of 11.9%.", values) == ["42.5", "11.9%"]
    code = "```{code-cell} ipython3\nprint(42.53)\n```\n```{dropdown} Q\nIt scored 42.53.\n```\n"
    assert typed_results("x.md", code, values) == ["42.53"]


def test_allowed_numbers_are_still_on_their_pages():
    for (name, written), reason in ALLOWED.items():
        assert reason, f"{name}: {written} is allowed without a reason"
        assert written in prose((BOOK / name).read_text(encoding="utf-8")), f"{name} no longer writes {written}"
