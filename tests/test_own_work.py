"""The own-work rule: what the grader's static scan and the checks' runtime guard catch, and what they let be.

The scan (``trusted.reference_use``) reads the student's cells as text: "tampering" withholds
every point of the notebook, "reference" zeroes one exercise, "review" is a note. The runtime
guard (``_core.call``) fails a check whose student function reaches a forbidden built-in.
"""

import functools
import re
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stepformer.checks._core as core
from stepformer.checks import CheckFailure, check_attention_values
from stepformer.checks.norms import check_layer_norm_values
from stepformer.course.trusted import reference_use
from tests.test_checks import attention, no_scale, student

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = """import math
import gc
import torch
import torch.nn.functional as F
from torch import nn
from stepformer.checks import check_attention_values, check_layer_norm_values"""


def _notebook(tmp_path: Path, solution: str, scratch: str | None = None, check: str = "check_attention_values",
              target: str = "scaled_dot_product_attention") -> Path:
    """A notebook laid out like the released ones: locked imports, one solution cell, its graded check."""
    def meta(grade_id: str, *, solution: bool = False, grade: bool = False, locked: bool = False) -> dict:
        nbgrader = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
                    "solution": solution, "task": False}
        if grade:
            nbgrader["points"] = 2
        return {"nbgrader": nbgrader}

    cells = [
        nbformat.v4.new_code_cell("import importlib.util\nimport sys", metadata=meta("setup", locked=True)),
        nbformat.v4.new_code_cell(IMPORTS, metadata=meta("imports", locked=True)),
        nbformat.v4.new_code_cell(solution, metadata=meta("ex1-solution", solution=True)),
        nbformat.v4.new_code_cell(f"{check}({target})", metadata=meta("ex1-values", grade=True, locked=True)),
    ]
    if scratch is not None:
        cells.append(nbformat.v4.new_code_cell(scratch))
    path = tmp_path / "student.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def _findings(tmp_path, solution, scratch=None, **kwargs):
    return [(f.exercise, f.kind) for f in reference_use(_notebook(tmp_path, solution, scratch, **kwargs))]


HONEST_SDPA = '''def scaled_dot_product_attention(q, k, v, mask=None):
    """Like torch.nn.functional.scaled_dot_product_attention, written by hand."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = F.softmax(scores, dim=-1)
    return weights @ v, weights
'''

# -- honest code: no finding ------------------------------------------------------------------

HONEST_SOLUTIONS = {
    "modules": HONEST_SDPA + '''
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self._cache = None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                torch.nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
                m.weight.data.mul_(0.5)
        names = [name for name, _ in self.named_modules()]
        layer = getattr(self, "ops")
        layer.extra = names
        setattr(self, "_seen", len(names))

    def forward(self, x):
        for op in self.ops:
            x = nn.functional.softmax(op(x), dim=-1)
        return x
''',
    "gc_and_inspect": HONEST_SDPA + "import inspect\nprint(inspect.signature(scaled_dot_product_attention))\n"
                                    "gc.collect()",
    "own_helper_named_like_the_machinery": HONEST_SDPA + "def _current(x):\n    return x\n_session = _current(1)",
    "own_variable_named_like_a_builtin": HONEST_SDPA + "multi_head_attention_forward = 3\n"
                                                       "print(multi_head_attention_forward)",
    "own_variable_named_gc": HONEST_SDPA + "gc = 0.5\nprint(gc * 2)\nimport gcsfs_like_name_only as inspector",
}
HONEST_SCRATCH = {
    "model_modules": "model = nn.Sequential(nn.Linear(2, 2))\nprint(sum(1 for m in model.modules()))\n"
                     "print([n for n, _ in model.named_modules()])\nprint(model[0].weight.data)",
    "kernel_killers": "import os, faulthandler\nif False:\n    os._exit(1)\n    faulthandler._sigsegv()",
    "gc_collect": "import gc\ngc.collect()\ntorch.cuda.empty_cache()",
    "ipython_magics": "%timeit scaled_dot_product_attention(*[torch.randn(2, 3)] * 3)\n!echo done\n%matplotlib inline",
    "eval_mode_and_compile": "model = nn.Linear(2, 2).eval()\nfast = torch.compile(model)\nmodel.train(False)",
    "eval_of_a_literal": "print(eval('2*3'))\nexec('x = 1\\nprint(x)')\ncode = compile('1 + 1', '<s>', 'eval')",
    "importlib_reload": "import importlib\nimport my_helpers\nimportlib.reload(my_helpers)\n"
                        "from importlib import reload\nreload(my_helpers)",
    "gc_memory": "import gc\nprint(sum(torch.is_tensor(o) for o in gc.get_objects()), gc.get_count())\ngc.collect()",
    "inspect_reading": "import inspect\nprint(inspect.getsource(scaled_dot_product_attention))\n"
                       "print(inspect.signature(scaled_dot_product_attention).parameters)\n"
                       "print(inspect.getfullargspec(scaled_dot_product_attention), inspect.isfunction(print))",
    "matplotlib": "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.imshow(torch.rand(3, 3))\n"
                  "ax.set_title('weights')\nplt.show()",
    "timeit_and_time": "%timeit -n 3 scaled_dot_product_attention(*[torch.randn(2, 3)] * 3)\n"
                       "%time _ = torch.randn(3)",
    "timeit_cell": "%%timeit\nscaled_dot_product_attention(*[torch.randn(2, 3)] * 3)",
    "helper_functions": "def show(t):\n    return t.shape\n\ndef _scratch(x):\n    return x * 2\n"
                        "print(show(_scratch(torch.ones(2))))",
}


@pytest.mark.parametrize("code", HONEST_SOLUTIONS.values(), ids=HONEST_SOLUTIONS.keys())
def test_honest_solutions_have_no_finding(tmp_path, code):
    assert _findings(tmp_path, code) == []


@pytest.mark.parametrize("code", HONEST_SCRATCH.values(), ids=HONEST_SCRATCH.keys())
def test_honest_scratch_cells_have_no_finding(tmp_path, code):
    assert _findings(tmp_path, HONEST_SDPA, scratch=code) == []


def test_comparing_with_pytorch_in_a_scratch_cell_is_a_note_only(tmp_path):
    scratch = "q = k = v = torch.randn(2, 3, 4)\nprint(F.scaled_dot_product_attention(q, k, v))"
    assert _findings(tmp_path, HONEST_SDPA, scratch=scratch) == [("*", "review")]


@pytest.mark.parametrize("notebook", sorted([*ROOT.glob("solutions/*/*.ipynb"), *ROOT.glob("exercises/*/*.ipynb")]),
                         ids=lambda p: f"{p.parents[1].name}/{p.parent.name}")
def test_every_solution_and_released_notebook_is_clean(notebook):
    # A solution notebook is what a student with the model answers hands in; a released one,
    # what a student who wrote nothing hands in. The course's own cells must never be flagged.
    assert reference_use(notebook) == []


# -- tampering: every point withheld ------------------------------------------------------------

FORGE = '''core = importlib.import_module("stepformer.checks._core")
R = [v for n, v in vars(importlib.import_module(core.library_modules()[0])).items() if n.startswith("scaled")][0]
core._call_own_work = lambda fn, a, k, f: R(*a, **k)
'''
TAMPERING = {
    "forges_call_own_work": FORGE,
    "imports_importlib": "import importlib\nm = importlib.import_module('torch')",
    "checks_by_dynamic_import": "m = __import__('stepformer.checks._core', fromlist=['x'])",
    "checks_reversed": "m = __import__('eroc_.skcehc.remrofpets'[::-1], fromlist=['x'])",
    "checks_attribute_chain": "import stepformer\nstepformer.checks.attention.call = print",
    "checks_via_getattr": "m = getattr(__import__('stepformer'), 'che' + 'cks')",
    "sys_modules": "sys.modules['torch'].allclose = lambda *a, **k: True",
    "sys_modules_dynamic": "__import__('sys').modules['torch'].allclose = print",
    "sys_modules_getattr": "getattr(sys, 'modules')['torch'].allclose = print",
    "sys_modules_from_import": "from sys import modules",
    "globals_reversed": "g = getattr(check_attention_values, '__slabolg__'[::-1])",
    "globals_pieces": "name = '__glo'\nname = name + 'bals__'\ng = getattr(check_attention_values, name)",
    "wrapped": "f = check_attention_values.__wrapped__",
    "module_name": "m = __import__(check_attention_values.__module__, fromlist=['x'])\nm.call = print",
    "gc_referrers": "print(gc.get_referrers(check_attention_values))",
    "gc_by_name": "g = __import__('cg'[::-1])",
    "inspect_frames": "import inspect\nframe = inspect.currentframe()",
    "ctypes": "import ctypes\nctypes.pythonapi",
    "builtins_import": "import builtins\nbuiltins.isinstance = lambda *a: True",
    "dunder_builtins": "__builtins__.isinstance = lambda *a: True",
    "private_of_dynamic_module": "m = __import__('stepformer.attention', fromlist=['x'])\nprint(m._helper)",
    "frame_globals": "import sys\nsys._getframe(1).f_globals['x'] = 1",
    "core_private_name_in_string": "name = '_call_own' + '_work'",
    "writes_the_records": "import os\nfolder = os.environ['STEPFORMER_' + 'RECORD']",
    "exec": "exec(bytes.fromhex('7072696e74283129').decode())",
    "eval": "f = eval('F.' + 'scaled')",
    "eval_of_a_literal_that_tampers": "eval(\"__import__('sys').modules['torch']\")",
    "exec_of_a_literal_that_imports_the_checks": "exec('import stepformer.checks._core as c')",
    "importlib_import_module_from": "from importlib import import_module\nm = import_module('torch')",
    "gc_referents": "import gc\nprint(gc.get_referents(check_attention_values))",
    "inspect_getmodule": "import inspect\nm = inspect.getmodule(check_attention_values)",
    "hidden_in_a_line_magic": "%time m = importlib.import_module('torch')",
    "hidden_in_a_cell_magic": "%%capture\nsys.modules['torch'].allclose = print",
}


@pytest.mark.parametrize("code", TAMPERING.values(), ids=TAMPERING.keys())
def test_tampering_in_a_solution_cell(tmp_path, code):
    # Appended to an honest solution (a cell magic must open its cell: it goes first).
    cell = code + "\n" + HONEST_SDPA if code.startswith("%%") else HONEST_SDPA + code
    assert ("ex1", "tampering") in _findings(tmp_path, cell)


@pytest.mark.parametrize("code", [TAMPERING["forges_call_own_work"], TAMPERING["sys_modules"],
                                  TAMPERING["hidden_in_a_cell_magic"]])
def test_tampering_in_a_scratch_cell(tmp_path, code):
    assert ("*", "tampering") in _findings(tmp_path, HONEST_SDPA, scratch=code)


# -- the reference: that exercise scores 0 ------------------------------------------------------

REFERENCE = {
    "aten_op": HONEST_SDPA.replace("    return weights @ v, weights",
                                   "    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)"),
    "aten_from_import": "from torch.ops import aten\n" + HONEST_SDPA,
    "ops_from_torch": "from torch import ops\n" + HONEST_SDPA,
    "ops_by_name": "_a = getattr(getattr(torch, 'sp'[::-1]), 'aten')\n" + HONEST_SDPA,
    "c_bindings": HONEST_SDPA.replace("weights = F.softmax(scores, dim=-1)",
                                      "weights = torch._C._nn.scaled_dot_product_attention(q, k, v)"),
    "vf": HONEST_SDPA.replace("F.softmax(scores, dim=-1)", "torch._VF.softmax(scores, -1)"),
    "decomp": "import torch._decomp\n" + HONEST_SDPA,
    "reversed_list_capture": '_x = [vars(F)["noitnetta_tcudorp_tod_delacs"[::-1]]]\n'
                             + HONEST_SDPA.replace("    return weights @ v, weights",
                                                   "    return _x[0](q, k, v, attn_mask=mask), weights"),
    "name_in_pieces": 'a = "scaled_dot_"\nb = "product_attention"\n_f = getattr(F, a + b)\n' + HONEST_SDPA,
    "star_import": "from torch.nn.functional import *\n" + HONEST_SDPA,
    "name_in_a_string": '_f = F.__dict__["scaled_dot_product_attention"]\n' + HONEST_SDPA,
}


@pytest.mark.parametrize("code", REFERENCE.values(), ids=REFERENCE.keys())
def test_reaching_for_the_reference_zeroes_the_exercise(tmp_path, code):
    assert _findings(tmp_path, code) == [("ex1", "reference")]


def test_norm_internals_are_the_reference(tmp_path):
    for forward in ("torch.layer_norm(x, x.shape[-1:])", "torch.rms_norm(x, x.shape[-1:])",
                    "torch.ops.aten.native_layer_norm(x, x.shape[-1:], None, None, 1e-5)[0]",
                    "getattr(torch, 'mron_reyal'[::-1])(x, x.shape[-1:])"):
        code = f"class LayerNorm(nn.Module):\n    def forward(self, x):\n        return {forward}"
        assert _findings(tmp_path, code, check="check_layer_norm_values", target="LayerNorm") == \
            [("ex1", "reference")], forward


# -- runtime: the checks' own guard -------------------------------------------------------------

_captured_list = [vars(F)["noitnetta_tcudorp_tod_delacs"[::-1]]]
_captured_dict = {"f": F.scaled_dot_product_attention}
_captured_partial = functools.partial(F.scaled_dot_product_attention, dropout_p=0.0)


def list_capture(q, k, v, mask=None):
    return _captured_list[0](q, k, v, attn_mask=mask), attention(q, k, v, mask)[1]


def dict_capture(q, k, v, mask=None):
    return _captured_dict["f"](q, k, v, attn_mask=mask), attention(q, k, v, mask)[1]


def partial_capture(q, k, v, mask=None):
    return _captured_partial(q, k, v, attn_mask=mask), attention(q, k, v, mask)[1]


def aten_math(q, k, v, mask=None):
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)


def aten_by_name(q, k, v, mask=None):
    # Nothing in the function's globals names the operator: only the tripwire sees it.
    ops = getattr(getattr(__import__("torch"), "o" + "ps"), "at" + "en")
    return getattr(ops, "_scaled_dot_product_" + "attention_math").default(q, k, v, mask)


def c_bindings_by_name(q, k, v, mask=None):
    nn_c = getattr(getattr(__import__("torch"), "_" + "C"), "_n" + "n")
    return getattr(nn_c, "scaled_dot_product_" + "attention")(q, k, v, attn_mask=mask), attention(q, k, v, mask)[1]


@pytest.mark.parametrize("cheat", [list_capture, dict_capture, partial_capture, aten_math, aten_by_name,
                                   c_bindings_by_name])
def test_runtime_guard_catches_captured_and_internal_operators(cheat):
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_attention_values(cheat)
    assert torch.ops.aten._scaled_dot_product_attention_math.default(
        *(torch.randn(1, 2, 3),) * 3)[0].shape == (1, 2, 3)  # the tripwire is gone again
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


class AtenLayerNorm(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        op = getattr(getattr(getattr(__import__("torch"), "o" + "ps"), "at" + "en"), "native_" + "layer_norm")
        return op(x, x.shape[-1:], self.weight, self.bias, 1e-5)[0]


def test_runtime_guard_catches_aten_layer_norm():
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_layer_norm_values(AtenLayerNorm)


def test_honest_code_still_passes():
    check_attention_values(student.scaled_dot_product_attention)
    check_attention_values(attention, seed=5)


def test_rebinding_the_machinery_does_not_reach_call(monkeypatch):
    # What the forged-record attack does from the kernel: the checks keep their own copies.
    real = student.scaled_dot_product_attention
    monkeypatch.setattr(core, "_call_own_work", lambda fn, a, k, f: real(*a, **k))
    monkeypatch.setattr(core, "_references_to_forbidden", lambda fn, forbid: [])
    monkeypatch.setattr(core, "_tripwires", lambda tripped, forbid: __import__("contextlib").nullcontext())
    with pytest.raises(CheckFailure, match="did not divide"):
        check_attention_values(no_scale)
    with pytest.raises(CheckFailure, match="Not your own work"):
        check_attention_values(aten_by_name)


def test_the_dispatcher_sees_pytorch_attention_however_it_was_reached():
    # A side channel that no tripwire covers: PyTorch's own table of overridable functions.
    def from_a_table(q, k, v, mask=None):
        table = torch.overrides.get_overridable_functions()[F]
        fused = next(f for f in table if getattr(f, "__name__", "").startswith("scaled_dot"))
        return fused(q, k, v, attn_mask=mask), attention(q, k, v, mask)[1]

    with pytest.raises(CheckFailure, match="Not your own work"):
        check_attention_values(from_a_table)


@pytest.mark.parametrize("notebook", sorted((ROOT / "exercises").glob("*/*.ipynb")), ids=lambda p: p.parent.name)
def test_every_notebook_states_the_own_work_rule_in_two_sentences(notebook):
    intro = nbformat.read(notebook, as_version=4).cells[0].source
    (paragraph,) = [p for p in intro.split("\n\n") if p.startswith("**Own work.**")]
    sentences = re.split(r"(?<=[.)])\.?\s+(?=[A-Z])", paragraph.removeprefix("**Own work.**").strip())
    assert len(sentences) == 2, sentences
    assert "scores 0 for that exercise" in sentences[0] and "every check after it" in sentences[1]
