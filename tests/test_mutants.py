"""The mutation harness of benchmarks/mutants.py: its operators on a toy cell, and a fast sample of its run.

The operators must make the edit they are named for, only between the solution markers, and every edit must
be valid Python that differs from the solution. The sample grades a few mutants of every chapter with the fast
runner (seeded, so always the same ones): each one that is not equivalent on the checks' inputs must lose
points. The full table is benchmarks/mutants.md.
"""

import ast
import random

import pytest

from tests.fixtures.mutant_messages import classify, sentences, states_the_cause
from tests.fixtures.mutant_runs import Options, fork_call, ignore_pattern, sample_run
from tests.fixtures.mutants import (
    OPERATORS,
    ROOT,
    Mutant,
    chapters,
    edits,
    pattern_variants,
    select,
    solution_cells,
    solution_lines,
)

TOY = '''\
class Toy(nn.Module):
    """A toy: 1 + 2 and x.sum(dim=-1) here are documentation, never mutated."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        ### BEGIN SOLUTION
        super().__init__()
        self.eps = eps
        ### END SOLUTION

    def forward(self, x, mask=None, n=3):
        outside = x.sum(dim=-1) + 1  # the frame around the answer: not the student's to change
        ### BEGIN SOLUTION
        scores = einsum(x, x, "batch q_len d, batch k_len d -> batch q_len k_len") / math.sqrt(x.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        weights = torch.softmax(scores, dim=-1).tril(diagonal=1)
        weights = weights.masked_fill(blocked, 0.0)
        total = sum(weights[:, i] for i in range(n))
        heads = rearrange(total, "b (h d) -> b h d", h=2)
        if n < 2 and self.eps > 0:
            raise ValueError(f"n must be at least {2 + 1}")
        return reduce(heads, "b h d -> b d", "mean") - self.eps * heads.transpose(-2, -1).clone().max()
        ### END SOLUTION
'''

# operator -> (original, mutated) pairs that it must make on TOY, among others.
EXPECTED = {
    "swap-axes": [('"batch q_len d, batch k_len d -> batch q_len k_len"',
                   "'batch q_len d, batch k_len d -> batch k_len q_len'"),
                  ('"b (h d) -> b h d"', "'b (d h) -> b h d'")],
    "swap-dim": [("-1", "-2")],
    "swap-args": [("heads.transpose(-2, -1)", "heads.transpose(-1, -2)")],
    "off-by-one": [("range(n)", "range(n - 1)"), ("range(n)", "range(n + 1)"), ("1", "2"), ("1", "0")],
    "comparison": [("n < 2", "n <= 2"), ("self.eps > 0", "self.eps >= 0"), ("mask is not None", "mask is None")],
    "sign": [('reduce(heads, "b h d -> b d", "mean") - self.eps * heads.transpose(-2, -1).clone().max()',
              "reduce(heads, 'b h d -> b d', 'mean') + self.eps * heads.transpose(-2, -1).clone().max()")],
    "mul-div": [("self.eps * heads.transpose(-2, -1).clone().max()",
                 "self.eps / heads.transpose(-2, -1).clone().max()")],
    "drop-term": [('reduce(heads, "b h d -> b d", "mean") - self.eps * heads.transpose(-2, -1).clone().max()',
                   "reduce(heads, 'b h d -> b d', 'mean')")],
    "reduction": [('"mean"', "'sum'"),
                  ("heads.transpose(-2, -1).clone().max()", "heads.transpose(-2, -1).clone().min()")],
    "constant": [("2", "3"), ("0", "1")],
    "drop-call": [("math.sqrt(x.shape[-1])", "x.shape[-1]"),
                  ("heads.transpose(-2, -1).clone()", "heads.transpose(-2, -1)")],
    "drop-arg": [('rearrange(total, "b (h d) -> b h d", h=2)', "rearrange(total, 'b (h d) -> b h d')"),
                 ("torch.softmax(scores, dim=-1)", "torch.softmax(scores)")],
    "masked-fill": [("-math.inf", "0.0"), ("-math.inf", "-1000000000.0"), ("0.0", "-math.inf"),
                    ("blocked", "~blocked")],
    "negate": [("~mask", "mask"), ("n < 2 and self.eps > 0", "not (n < 2 and self.eps > 0)")],
}


@pytest.fixture(scope="module")
def toy_edits():
    return edits(TOY)


@pytest.mark.parametrize("operator", OPERATORS)
def test_each_operator_makes_its_edit_on_the_toy(toy_edits, operator):
    made = {(e.original, e.mutated) for e in toy_edits if e.operator == operator}
    for pair in EXPECTED[operator]:
        assert pair in made, f"{operator} did not make {pair}; it made {sorted(made)}"


def test_edits_stay_between_the_markers_and_change_nothing_else(toy_edits):
    ranges = solution_lines(TOY)
    assert ranges == [(6, 7), (13, 22)]
    inside = {n for lo, hi in ranges for n in range(lo, hi + 1)}
    frame = [line for n, line in enumerate(TOY.splitlines(), 1) if n not in inside]
    assert len(toy_edits) > 40
    for e in toy_edits:
        assert e.line in inside, e
        lines = e.source.splitlines()
        assert len(lines) == len(TOY.splitlines()), "an edit never adds or removes lines here"
        assert [line for n, line in enumerate(lines, 1) if n not in inside] == frame, e
        assert e.source != TOY
        ast.parse(e.source)
    assert len({e.source for e in toy_edits}) == len(toy_edits), "no two edits give the same cell"


def test_nothing_is_mutated_inside_raise_messages_or_without_markers(toy_edits):
    assert not [e for e in toy_edits if e.line == 21], "the raise statement's line has no edit"
    assert edits(TOY.replace("### BEGIN SOLUTION", "# begin").replace("### END SOLUTION", "# end")) == []


def test_einops_pattern_variants():
    assert pattern_variants("batch seq (heads d_head) -> batch heads seq d_head") == [
        "batch seq (heads d_head) -> heads batch seq d_head",
        "batch seq (heads d_head) -> batch seq heads d_head",
        "batch seq (heads d_head) -> batch heads d_head seq",
        "batch seq (d_head heads) -> batch heads seq d_head",
    ]


def test_select_caps_and_takes_the_operators_in_turn(toy_edits):
    chosen = select(toy_edits, 14, "seed")
    assert len(chosen) == 14 and {e.operator for e in chosen} == set(OPERATORS)
    assert chosen == select(toy_edits, 14, "seed")
    assert select(toy_edits, None, "seed") == toy_edits


def test_every_solution_cell_of_every_chapter_has_mutants():
    found = {}
    for chapter, notebook in chapters(ROOT):
        for cell, source in solution_cells(ROOT, chapter, notebook):
            found[chapter, cell] = len(edits(source))
    assert {c for c, _ in found} == {c for c, _ in chapters(ROOT)} and len(found) >= 50
    assert all(n >= 1 for n in found.values()), {k: n for k, n in found.items() if n < 1}


def test_messages_are_classified_by_the_written_rules():
    row = {"operator": "drop-call", "original": "math.sqrt(d_k)", "mutated": "d_k", "context": "math.sqrt(d_k)"}
    named = {**row, "first_failure": {"ename": "CheckFailure", "message":
             "With random scores, your output differs from PyTorch's: You divided the scores by d_k: divide by "
             "sqrt(d_k). (Your output: largest difference 1.18 at index [1, 0] on sizes q_len=5, k_len=7.)"}}
    assert classify(named)[0] == "names-mutated" and states_the_cause(named)
    recipe = {**row, "first_failure": {"ename": "CheckFailure", "message":
              "Your output differs from PyTorch's. The scores are q · k / math.sqrt(d_k), then a softmax over k_len."}}
    assert classify(recipe)[0] == "names-mutated" and not states_the_cause(recipe)  # mentions it, says nothing done
    generic = {**row, "first_failure": {"ename": "CheckFailure", "message":
               "Your output differs from the oracle's (largest difference 0.21), and matches none of the common "
               "mistakes. Compare your scores with q @ k.transpose(-2, -1) / sqrt(d_k) on a small example."}}
    assert classify(generic)[0] == "generic"
    other = {**row, "first_failure": {"ename": "CheckFailure", "message":
             "Your output differs from PyTorch's. Your mask is inverted: True means 'may attend'."}}
    assert classify(other)[0] == "names-something-else"
    crash = {**row, "first_failure": {"ename": "CheckFailure", "message":
             "f(Tensor(2, 3) float32) raised RuntimeError: The size of tensor a (5) must match the size of b (7)"}}
    assert classify(crash)[0] == "generic"
    assert sentences("A (largest difference 3 at index [0]). B: You did it.") == ["A .", "B:", "You did it."]
    shifted = "For n > 1 your probabilities differ: off by one: your context is the last n tokens."
    unit = {"operator": "drop-term", "original": "n - 1", "mutated": "n", "context": "n - 1",
            "first_failure": {"ename": "CheckFailure", "message": shifted}}
    assert classify(unit)[0] == "names-mutated"  # a "- 1" dropped is an off-by-one
    term = {**unit, "original": "n - k", "mutated": "n", "context": "n - k"}
    assert classify(term)[0] == "names-something-else"  # any other dropped term is not
    flag = {"operator": "constant", "original": "False", "mutated": "True", "context": "False",
            "first_failure": {"ename": "CheckFailure", "message":
                              "Your nucleus differs. You drop the most likely token: that token always stays."}}
    assert classify(flag)[0] == "names-mutated"  # a flag flipped: a decision made the other way
    index = {"operator": "constant", "original": "1", "mutated": "0", "context": "-1",
             "first_failure": {"ename": "CheckFailure", "message": "Your nucleus differs. You keep position 0."}}
    assert classify(index)[0] == "names-mutated"  # a small integer: an index
    assert classify({**index, "original": "512", "mutated": "513", "context": "512"})[0] == "names-something-else"


# The CI sample: a few seeded mutants per chapter through the fast runner.
PER_CHAPTER = 2
CANDIDATES = 6  # tried in notebook order until PER_CHAPTER are not equivalent on the checks' inputs
SLOW_EXERCISES = {("11_translator", "ex5")}  # trains a model for 150 steps per run (13 s): the full run covers it
# Sampled mutants that the checks do not catch yet (benchmarks/mutants.md lists every survivor): the test says so
# as an expected failure, and fails outright once they are caught (take them out here) or if another survives.
KNOWN_SURVIVORS = {
    # float32 frequencies (arange without dtype=torch.float64): off by ~1e-6 at the sizes checked, ~1e-3 at
    # positions in the thousands; check_sinusoidal_values compares short encodings at float32 tolerance.
    "06_positional": {"06_positional/ex1-solution/drop-arg/L17/e365d04c"},
}


def _sample(chapter: str, notebook: str) -> list[Mutant]:
    pool = [Mutant(chapter, notebook, cell, e) for cell, source in solution_cells(ROOT, chapter, notebook)
            for e in edits(source) if (chapter, cell.split("-")[0]) not in SLOW_EXERCISES]
    random.Random(f"ci/{chapter}").shuffle(pool)
    return pool[:CANDIDATES]


@pytest.mark.slow
@pytest.mark.parametrize(("chapter", "notebook"), chapters(ROOT), ids=[c for c, _ in chapters(ROOT)])
def test_sampled_mutants_of_each_chapter_lose_points(chapter, notebook, tmp_path):
    ignore_pattern(ROOT)  # read nbgrader's configuration here, once, rather than in every forked run
    options = Options(mutant_seconds=120)
    result = fork_call(lambda: {"rows": sample_run(ROOT, chapter, notebook, _sample(chapter, notebook), PER_CHAPTER,
                                                   options)}, tmp_path / "sample.json", 600)
    assert "rows" in result, f"the sample run failed: {result.get('why')}\n{result.get('error')}"
    rows = result["rows"]
    tried = [r for r in rows if not r["equivalent"]]
    assert len(tried) == PER_CHAPTER, f"only {len(tried)} non-equivalent mutants among {CANDIDATES}: {rows}"
    survivors = {r["key"]: r["records_differ"] for r in tried if not r["caught"]}
    known = KNOWN_SURVIVORS.get(chapter, set())
    assert set(survivors) <= known, "mutants that lose no points although the checks' inputs tell them apart: " + \
        "; ".join(f"{key} ({why})" for key, why in survivors.items() if key not in known)
    assert set(survivors) == known, (f"no longer survivors of this sample (caught now, or not sampled): "
                                     f"{sorted(known - set(survivors))}; take them out of KNOWN_SURVIVORS")
    for r in tried:
        if r["caught"]:
            assert r["first_failure"]["message"] or r["first_failure"]["ename"], r
    if survivors:
        pytest.xfail(f"known survivors, see benchmarks/mutants.md: {sorted(survivors)}")



def test_the_command_explains_itself_and_writes_its_table(tmp_path):
    import subprocess
    import sys

    helped = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mutants.py"), "--help"], capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--grade" in helped.stdout and "--chapters" in helped.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mutants.py"), "--table-only", "--out",
                              str(tmp_path / "none.json"), "--table", str(tmp_path / "t.md")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "holds no results yet" in refused.stderr


def test_the_table_counts_caught_equivalent_and_message_classes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants_command", ROOT / "benchmarks" / "mutants.py")
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    base = {"chapter": "01_attention", "cell": "ex1-solution", "line": 3, "col": 0, "context": "",
            "equivalence": "loses points", "points": {}}
    rows = [
        {**base, "key": "a", "operator": "drop-call", "original": "math.sqrt(d_k)", "mutated": "d_k", "caught": True,
         "equivalent": False, "first_failure": {"cell": "ex1-values", "ename": "CheckFailure",
                                                "message": "You did not divide the scores by sqrt(d_k)."}},
        {**base, "key": "b", "operator": "sign", "original": "a - b", "mutated": "a + b", "caught": True,
         "equivalent": False, "first_failure": {"cell": "ex1-values", "ename": "CheckFailure",
                                                "message": "Your mask is inverted: True means 'may attend'."}},
        {**base, "key": "c", "operator": "constant", "original": "0.0", "mutated": "1.0", "caught": False,
         "equivalent": False, "first_failure": None, "equivalence": "more seeds tell it apart: ex1-mask"},
        {**base, "key": "d", "operator": "constant", "original": "1", "mutated": "0", "caught": False,
         "equivalent": True, "first_failure": None, "equivalence": "same results"},
    ]
    data = {"about": {}, "chapters": {}, "mutants": rows, "controls": [], "agreement": {}}
    for row in rows:
        if row["caught"]:
            row["class"], row["class_why"] = classify(row)
            row["states_cause"] = states_the_cause(row)
    table = command.render(data)
    assert "| 01_attention | 4 | 1 | 3 | 2 | 66.7% | 50.0% | 50.0% | 0.0% | 1 |" in table
    assert "## Survivors (1)" in table and "more seeds tell it apart" in table
    assert "## Messages that name something else (1)" in table and "Your mask is inverted" in table


def test_merge_takes_whole_chapters_with_their_commit_and_refuses_other_settings(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("mutants_command", ROOT / "benchmarks" / "mutants.py")
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    about = {"commit": "aaaaaaa", "seed": 27, "cap": 40, "limit": None, "hardware": "CPU A"}
    row = {"chapter": "02_masks", "cell": "ex1-solution", "line": 3, "col": 0, "key": "02_masks/x", "operator": "sign",
           "original": "a - b", "mutated": "a + b", "caught": False, "equivalent": True, "first_failure": None}
    base = {"about": about, "chapters": {"02_masks": {"mutants": 1, "finished": 1, "commit": "aaaaaaa"}},
            "mutants": [row], "controls": [], "agreement": {}}
    later = {"about": {**about, "commit": "bbbbbbb", "hardware": "CPU B"},
             "chapters": {"02_masks": {"mutants": 1, "finished": 1, "date": "2026-11-27 06:00 UTC"}},
             "mutants": [{**row, "key": "02_masks/y"}], "controls": [], "agreement": {}}
    (tmp_path / "later.json").write_text(json.dumps(later))
    command.merge(base, [tmp_path / "later.json"])
    assert [r["key"] for r in base["mutants"]] == ["02_masks/y"]
    assert base["chapters"]["02_masks"]["commit"] == "bbbbbbb"
    assert "02_masks at commit `bbbbbbb`, 2026-11-27 06:00 UTC, on CPU B" in command.render(base)
    (tmp_path / "other_seed.json").write_text(json.dumps({**later, "about": {**later["about"], "seed": 1}}))
    with pytest.raises(SystemExit, match="another seed"):
        command.merge(base, [tmp_path / "other_seed.json"])
    partial = {**later, "chapters": {"02_masks": {"mutants": 2, "finished": 1}}}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    with pytest.raises(SystemExit, match="incomplete"):
        command.merge(base, [tmp_path / "partial.json"])
