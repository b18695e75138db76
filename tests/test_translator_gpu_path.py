"""The translator's GPU path, tested on the CPU: the fused loss against chapter 11's, its op count, a step that
never reads a tensor back, the padded table against ``collate``, warmup and cadences in epochs, the positional
table as a buffer, the first 50 losses of a tiny run against the commit before these changes, and the device
script's dry run with the results file that chapter 11 and the README read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stepformer.encoder import Embedding
from stepformer.positional import sinusoidal_encoding
from stepformer.runs import Distributed
from stepformer.translator.batching import Encoded, PaddedTable, collate
from stepformer.translator.config import TranslatorConfig, preset
from stepformer.translator.evaluate import gpu_readme_row, gpu_rows
from stepformer.translator.fast import cross_entropy_sum, fused_label_smoothed_loss, loss_for
from stepformer.translator.model import build_model
from stepformer.translator.recipe import label_smoothed_loss
from stepformer.translator.train import make_optimizer, train_step

ROOT = Path(__file__).resolve().parent.parent
PAD = 0


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched that compute (each is a kernel launch on a GPU); views, which only
    describe memory, are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def padded_targets(generator: torch.Generator, batch: int, tgt_len: int, vocab: int) -> torch.Tensor:
    """Random target ids with a random amount of right padding per row (every row keeps at least one token)."""
    target = torch.randint(1, vocab, (batch, tgt_len), generator=generator)
    lengths = torch.randint(1, tgt_len + 1, (batch,), generator=generator)
    target[torch.arange(tgt_len)[None, :] >= lengths[:, None]] = PAD
    return target


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_the_fused_cross_entropy_equals_chapter_11s_loss_and_its_gradient(seed, smoothing):
    generator = torch.Generator().manual_seed(seed)
    batch, tgt_len, vocab = 3 + seed, 5 + seed, 11 + 2 * seed
    logits = torch.randn(batch, tgt_len, vocab, generator=generator, dtype=torch.float64) * 3
    target = padded_targets(generator, batch, tgt_len, vocab)
    mine = logits.clone().requires_grad_()
    reference = logits.clone().requires_grad_()
    loss = cross_entropy_sum(mine, target, PAD, smoothing)
    expected = label_smoothed_loss(reference, target, PAD, smoothing, reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-10, atol=1e-10)
    assert mine.grad[target == PAD].abs().max() == 0, "padding positions must get no gradient"


def test_the_fused_cross_entropy_takes_bf16_logits_in_float32():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 6, 50, generator=generator).to(torch.bfloat16)
    target = padded_targets(generator, 4, 6, 50)
    loss = cross_entropy_sum(logits, target, PAD, 0.1)
    assert loss.dtype == torch.float32
    expected = label_smoothed_loss(logits.float(), target, PAD, 0.1, reduction="sum")
    torch.testing.assert_close(loss, expected)


def test_the_loss_is_chosen_by_device_and_both_agree():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, 40, generator=generator)
    target = padded_targets(generator, 5, 7, 40)
    cpu, cuda = loss_for(torch.device("cpu")), loss_for(torch.device("cuda"))
    assert cuda is cross_entropy_sum
    torch.testing.assert_close(cpu(logits, target, PAD, 0.1), cuda(logits, target, PAD, 0.1))
    torch.testing.assert_close(cpu(logits, target, PAD, 0.1),
                               fused_label_smoothed_loss(logits, target, PAD, 0.1, "sum"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cuda_loss_is_at_most_ten_ops_forward_for_a_1000_sentence_batch(dtype):
    # The count does not depend on the sizes; a small vocabulary keeps the test light.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, 12, 64, generator=generator).to(dtype)
    target = padded_targets(generator, 1000, 12, 64)
    with OpCounter() as cuda_path:
        cross_entropy_sum(logits, target, PAD, 0.1)
    with OpCounter() as pytorchs:
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=PAD,
                                          label_smoothing=0.1, reduction="sum")
    with OpCounter() as blocked:
        fused_label_smoothed_loss(logits, target, PAD, 0.1, "sum")
    assert len(cuda_path.ops) <= 10, cuda_path.ops
    # The counter sees what the acceptance is about: PyTorch's own call, with the cast, has two more, and the
    # blocked loss launches operations for every block.
    assert len(pytorchs.ops) >= len(cuda_path.ops) + 2 and len(blocked.ops) > 100


def test_the_written_out_loss_equals_pytorchs_label_smoothed_cross_entropy():
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 9, 30, generator=generator, dtype=torch.float64)
    target = padded_targets(generator, 6, 9, 30)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD,
                                                 label_smoothing=0.2, reduction="sum")
    torch.testing.assert_close(cross_entropy_sum(logits, target, PAD, 0.2), expected, rtol=1e-12, atol=1e-12)


def tiny_model_and_batch(seed: int):
    torch.manual_seed(seed)
    config = preset("tiny").with_overrides({"model.d_model": "16", "model.d_ff": "32", "model.vocab": "50"})
    model = build_model(config, 50, PAD)
    generator = torch.Generator().manual_seed(seed)
    data = Encoded([torch.randint(4, 50, (n,), generator=generator).tolist() for n in (3, 7, 5, 6)],
                   [torch.randint(4, 50, (n,), generator=generator).tolist() for n in (4, 2, 6, 5)])
    return config, model, PaddedTable(data, PAD, 1, 2)


def test_a_step_of_the_cuda_path_never_reads_a_tensor_back(monkeypatch):
    config, model, table = tiny_model_and_batch(0)
    optimizer = make_optimizer(model, config, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batch = [0, 1, 2, 3]

    def refuse(self, *args, **kwargs):
        raise AssertionError("the step read a tensor's value: on a GPU that waits for the device")

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss_sum, tokens, grad_norm = train_step(model, model, optimizer, scaler, table, batch, None, PAD, config, 1e-3,
                                             None, cross_entropy_sum, Distributed())
    monkeypatch.undo()
    assert all(isinstance(t, torch.Tensor) for t in (loss_sum, tokens, grad_norm))
    assert int(tokens) == sum(len(t) + 1 for t in table_targets(table, batch))
    # The patch is seen: the same read outside the step fails.
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    with pytest.raises(AssertionError, match="read a tensor"):
        loss_sum.item()


def table_targets(table: PaddedTable, batch: list[int]) -> list[list[int]]:
    return [table.tgt[i, 1: table.tgt_lengths[i] - 1].tolist() for i in batch]


@pytest.mark.parametrize("seed", range(3))
def test_the_padded_table_gives_what_collate_gives(seed):
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 9, (2, 12), generator=generator).tolist()
    data = Encoded([torch.randint(3, 30, (n,), generator=generator).tolist() for n in sizes[0]],
                   [torch.randint(3, 30, (n,), generator=generator).tolist() for n in sizes[1]])
    table = PaddedTable(data, PAD, 1, 2)
    batches = [[3, 0, 7], [11], [5, 2, 9, 1, 4]]
    for batch, index in zip(batches, table.indices(batches), strict=True):
        src, tgt = collate(data, batch, PAD, 1, 2)
        got_src, tgt_in, tgt_out = table.batch(batch, index)
        assert torch.equal(got_src, src) and torch.equal(tgt_in, tgt[:, :-1]) and torch.equal(tgt_out, tgt[:, 1:])
        # Contiguous, so that a compiled model sees the same layout at every step.
        assert got_src.is_contiguous() and tgt_in.is_contiguous() and tgt_out.is_contiguous()
    assert table.indices([]) == []


def test_warmup_and_cadences_in_epochs_become_steps():
    config = TranslatorConfig(warmup_epochs=2.5, checkpoint_every_epochs=1.0, eval_every_epochs=0.01)
    resolved = config.in_steps(40)
    assert (resolved.warmup, resolved.checkpoint_every, resolved.eval_every) == (100, 40, 1)
    plain = TranslatorConfig(warmup=123)
    assert plain.in_steps(40) == plain
    with pytest.raises(ValueError, match="warmup_epochs must be positive"):
        TranslatorConfig(warmup_epochs=0)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        config.in_steps(0)


@pytest.mark.parametrize("start", [0, 3, 30])
def test_the_positional_table_is_a_buffer_with_the_same_values(start):
    embedding = Embedding(20, 8, "sinusoidal", max_len=32)
    assert "sinusoids" not in embedding.state_dict(), "a function of the shape, not a weight to save"
    tokens = torch.randint(0, 20, (2, 5))
    expected = embedding.tokens(tokens) * 8**0.5 + sinusoidal_encoding(start + 5, 8)[start:]
    # Positions 30..34 lie past max_len: the code is defined for any position.
    torch.testing.assert_close(embedding(tokens, start), expected, rtol=0, atol=0)


@pytest.mark.slow
def test_the_tiny_runs_first_50_losses_equal_those_before_the_gpu_path(tmp_path, real_data):
    fixture = json.loads((ROOT / "tests" / "fixtures" / "tiny_losses_89963e4.json").read_text())
    # Recorded with 2 threads; the reductions' order, so the last bits, depend on the thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-m", "stepformer.translator.cli", "train", "--preset", "tiny", "--steps", "50",
                    "--no-progress", "--data-dir", str(real_data), "--out", str(tmp_path / "run")], cwd=ROOT,
                   check=True, capture_output=True, env=env, timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == len(fixture["losses"]) == 50
    for step, (got, expected) in enumerate(zip(losses, fixture["losses"], strict=True), 1):
        assert abs(got - expected) <= 1e-6, f"step {step}: {got} against {expected} at {fixture['commit']}"


@pytest.mark.slow
def test_the_device_scripts_dry_run_writes_what_chapter_11_reads(tmp_path, real_data):
    report = tmp_path / "gpu_run.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), "--dry-run", "--data-dir", str(real_data),
               "--out", str(tmp_path / "runs"), "--report", str(report), "--directions", "de-en", "--seeds", "1,2",
               "--parallel", "2", "--limit", "12"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    raw = json.loads(report.read_text())
    assert raw["dry_run"] and raw["failures"] == [] and set(raw["profile"]) == {"eager"}
    assert {"wall_ms_per_step", "unprofiled_ms_per_step", "host_ms_per_step", "tokens_per_s", "mfu",
            "flops_per_step"} <= set(raw["profile"]["eager"])
    first = raw["runs"][0]["scores"]
    assert set(first) == {"averaged/val", "averaged/test_2016_flickr", "averaged/test_2016_flickr/no_cache"}
    assert len(first["averaged/test_2016_flickr"]["hypotheses"]) == 12
    # The import scores the kept translations again, with intervals, and writes the book's results file.
    results = tmp_path / "book" / "gpu.json"
    imported = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), "--import-report",
                               str(report), "--results", str(results), "--data-dir", str(real_data)], cwd=ROOT,
                              capture_output=True, text=True, env=env, timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
    book = json.loads(results.read_text())
    test = book["runs"][0]["scores"]["averaged/test_2016_flickr"]
    assert "hypotheses" not in test and (results.parent / test["hypotheses_file"]).is_file()
    assert test["bleu_ci95"][0] <= test["bleu"] <= test["bleu_ci95"][1]
    assert book["runs"][0]["scores"]["averaged/test_2016_flickr/no_cache"]["same_translations_as_cached"] is True
    (row,) = gpu_rows(book)
    assert row["direction"] == "de→en" and row["seeds"] == [1, 2] and row["bleu"]["n"] == 2
    assert gpu_readme_row(row).startswith("| gpu | de→en | ")


@pytest.mark.slow
def test_the_compiled_model_takes_every_batch_shape_without_compiling_again():
    import torch._dynamo

    from stepformer.translator.batching import token_batches
    from stepformer.translator.fast import swap_dropout
    from stepformer.translator.model import compile_model

    torch.manual_seed(0)
    config = preset("tiny").with_overrides({"model.d_model": "16", "model.d_ff": "32", "model.vocab": "60"})
    # The model as it runs on a GPU: PyTorch's dropout (PackedDropout's in-place draw breaks the graph on a CPU).
    model = swap_dropout(build_model(config, 60, PAD), torch.nn.Dropout)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 30, (2, 300), generator=generator).tolist()
    data = Encoded([torch.randint(4, 60, (n,), generator=generator).tolist() for n in lengths[0]],
                   [torch.randint(4, 60, (n,), generator=generator).tolist() for n in lengths[1]])
    table = PaddedTable(data, PAD, 1, 2)
    batches = token_batches(data, 256, 0, 0)
    shapes = {tuple(t.shape for t in table.batch(b)[:2]) for b in batches}
    assert len(shapes) > 10, "the batches should differ in size and length"
    import jaxtyping
    from torch.fx.experimental import _config as shape_config

    before = jaxtyping.config.jaxtyping_disable, shape_config.use_duck_shape
    compiled = compile_model(model)
    try:
        # The one compilation, forward and backward, on a first batch whose three sizes happen to be equal
        # (15 sentences of 15 tokens each side): with duck sizing on, every later batch would compile again.
        square = [torch.randint(4, 60, (15, 15), generator=generator) for _ in range(2)]
        compiled(*square).sum().backward()
        torch._dynamo.config.error_on_recompile = True
        for batch in batches[1:]:
            src, tgt_in, _ = table.batch(batch)
            compiled(src, tgt_in).sum().backward()
        # Both settings are the compiled call's own: the process has them as they were.
        assert (jaxtyping.config.jaxtyping_disable, shape_config.use_duck_shape) == before
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
        jaxtyping.config.update("jaxtyping_disable", before[0])
        shape_config.use_duck_shape = before[1]
