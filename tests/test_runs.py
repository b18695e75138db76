"""The run plumbing that chapters 11 and 12 share (``stepformer.runs``): the training loop, its reads from the
device, resuming, each process's random states, and processes under ``torchrun`` that must stop together and
resume to the weights of a run that never stopped."""

import contextlib
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stepformer import runs
from stepformer.runs import Budget, Distributed, Position, StepResult, restore_rng_states, rng_state, training_loop

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# One thread per process: two processes on a shared 2-core machine only wait for each other with more.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


# --- the loop, in one process ---------------------------------------------------------------------------------


def four_batches(epoch: int) -> list[tuple[int, int]]:
    return [(epoch, i) for i in range(4)]


def recording_step(seen: list):
    """A step that records its batch and rate, and reports tensors, as a step on a GPU does."""

    def step(batch, lr: float) -> StepResult:
        seen.append((batch, lr))
        epoch, i = batch
        return StepResult(torch.tensor(10.0 * epoch + i), torch.tensor(4.0 + i), torch.tensor(0.5), torch.tensor(2.0))

    return step


def test_the_loop_logs_every_step_in_order_and_reads_the_device_only_every_log_every_steps(monkeypatch):
    reads, records, hooked = [], [], []
    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append(len(records))
        return tolist(self)

    def never(self, *args):
        raise AssertionError("the loop read a tensor on its own: every read waits for the device")

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    monkeypatch.setattr(torch.Tensor, "item", never)
    monkeypatch.setattr(torch.Tensor, "__float__", never)

    def hook(at: Position) -> None:
        # A hook (an evaluation, a checkpoint) comes after the records of every step up to its own.
        hooked.append((at.step, records[-1]["step"]))

    seen = []
    end = training_loop(Budget(max_steps=10), four_batches, lambda number, spent: number / 100, recording_step(seen),
                        records.append, log_every=4, every=((5, hook),))
    monkeypatch.undo()
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["epoch"] for r in records] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert [r["lr"] for r in records] == [n / 100 for n in range(1, 11)]
    assert records[5] | {"tokens_per_s": 0, "elapsed_s": 0} == {
        "step": 6, "epoch": 2, "loss": 11.0 / 2.0, "lr": 0.06, "tokens": 5, "grad_norm": 0.5, "tokens_per_s": 0,
        "elapsed_s": 0}
    assert list(records[0]) == ["step", "epoch", "loss", "lr", "tokens", "grad_norm", "tokens_per_s", "elapsed_s"]
    # One read of the device after steps 4 and 8 (log_every) and before each hook (5, 10); none per step.
    assert reads == [0, 4, 5, 8]
    assert hooked == [(5, 5), (10, 10)]
    assert (end.step, end.epoch, end.batch_in_epoch, end.epochs) == (10, 2, 2, 2.5)


@pytest.mark.parametrize("stop", [6, 8])  # mid-epoch, and at an epoch's end
def test_a_run_resumed_from_its_position_takes_the_batches_and_rates_of_one_that_never_stopped(stop):
    def run(steps: int, position: Position | None = None) -> tuple[list, Position]:
        seen = []
        end = training_loop(Budget(max_steps=steps), four_batches, lambda number, spent: number / 10,
                            recording_step(seen), lambda record: None, position=position)
        return seen, end

    whole, _ = run(11)
    first, stopped = run(stop)
    saved = Position.from_checkpoint(json.loads(json.dumps(stopped.to_checkpoint())))
    rest, end = run(11, saved)
    assert first + rest == whole
    assert (end.step, end.epoch, end.batch_in_epoch) == (11, 2, 3)


def test_a_budget_in_epochs_ends_at_an_epochs_end():
    seen = []
    end = training_loop(Budget(max_epochs=2), four_batches, lambda number, spent: spent, recording_step(seen),
                        lambda record: None)
    assert [batch for batch, _ in seen] == four_batches(0) + four_batches(1)
    assert [lr for _, lr in seen] == [n / 8 for n in range(8)]  # the fraction of the budget spent before each step
    assert (end.step, end.epochs) == (8, 2.0)


def test_random_states_are_refused_by_a_run_with_another_number_of_processes():
    states = [rng_state(torch.device("cpu")) for _ in range(2)]
    with pytest.raises(ValueError, match=r"random states of 2 process\(es\) but this run has 1.*--nproc_per_node 2"):
        restore_rng_states(states, Distributed())
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    saved = rng_state(torch.device("cpu"))  # a checkpoint of one process before the states were kept by rank
    torch.rand(5)
    restore_rng_states(saved, Distributed())
    assert torch.equal(torch.rand(3), expected)


# --- two processes --------------------------------------------------------------------------------------------

def processes_under(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun starts its workers in sessions of their own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill_all(process: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers at once, as a lost machine would (a worker left behind could wait for
    its peer for half an hour)."""
    for pid in (process.pid, *processes_under(process.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def torchrun(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run``, except that a run past ``timeout`` (a hang) takes torchrun's workers down with it."""
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(process)
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


# Two processes on a run of 5-batch epochs with a budget of SECONDS; rank 0 is held up for longer than the
# budget by a hook (a slow checkpoint write) at the end of the first epoch. Each step sums a tensor over the
# processes, as DDP's gradients do, so a process that stopped while the other went on would leave it waiting.
AGREEMENT = """
import json, sys, time
import torch, torch.distributed as dist
from stepformer.runs import Budget, StepResult, init_distributed, training_loop

seconds, held = float(sys.argv[1]), float(sys.argv[2])
world = init_distributed(torch.device("cpu"))

def step(batch, lr):
    total = torch.ones(1)
    dist.all_reduce(total)
    time.sleep(0.01)
    return StepResult(0.0, 1, 0.0)

def slow_checkpoint(at):
    if world.main and at.step == 5:
        time.sleep(held)

end = training_loop(Budget(max_minutes=seconds / 60), lambda epoch: list(range(5)), lambda number, spent: 1.0,
                    step, lambda record: None, world=world, every=((5, slow_checkpoint),))
with open(f"end_{world.rank}.json", "w") as file:  # one file each: lines printed at once can interleave
    json.dump([end.step, end.epoch, end.batch_in_epoch], file)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_stop_together_when_one_is_held_up_past_the_budget(tmp_path):
    script = tmp_path / "agreement.py"
    script.write_text(AGREEMENT)
    result = torchrun([*TORCHRUN, str(script), "2", "3"], tmp_path, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    ends = [json.loads((tmp_path / f"end_{rank}.json").read_text()) for rank in (0, 1)]
    assert ends[0] == ends[1], ends


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, real_data) -> Path:
    """The first 200 training and 50 validation pairs of Multi30k (de, en) with their own SHA256SUMS:
    epochs of a few batches, so that a short run crosses several of them."""
    folder = tmp_path_factory.mktemp("multi30k-small")
    sums = []
    for split, count in (("train", 200), ("val", 50)):
        for language in ("de", "en"):
            name = f"{split}.{language}.gz"
            lines = gzip.decompress((real_data / name).read_bytes()).split(b"\n")[:count]
            data = gzip.compress(b"\n".join(lines) + b"\n", mtime=0)
            (folder / name).write_bytes(data)
            sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    (folder / "SHA256SUMS").write_text("".join(sums))
    return folder


def train_command(out: Path, data: Path, *extra: str, program: tuple[str, ...] = ("-m", "stepformer.translator.cli"),
                  ) -> list[str]:
    # The tiny preset keeps its dropout (0.1): each process draws its own masks, which a resume must continue.
    return [*TORCHRUN, *program, "train", "--out", str(out), "--preset", "tiny", "--no-progress", "--set",
            "model.vocab=300", "--set", "max_tokens=1024", "--set", "eval_every=1000", "--data-dir", str(data), *extra]


@pytest.mark.slow
def test_two_processes_killed_and_resumed_end_with_the_weights_of_two_that_never_stopped(tmp_path, small_data):
    args = ["--steps", "40", "--set", "checkpoint_every=4", "--set", "keep_checkpoints=20"]
    whole = torchrun(train_command(tmp_path / "whole", small_data, *args), ROOT, timeout=120)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = tmp_path / "killed"
    process = subprocess.Popen(train_command(killed, small_data, *args), cwd=ROOT, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    try:
        while not (killed / "checkpoints" / "step_0000012.pt").exists() and process.poll() is None:
            assert time.time() < deadline, "the run wrote no checkpoint in two minutes"
            time.sleep(0.02)
    finally:
        kill_all(process)
    assert not (killed / "averaged.pt").exists(), "the run finished before it could be killed"
    newest = sorted((killed / "checkpoints").glob("step_*.pt"))[-1]
    assert 12 <= int(newest.stem.split("_")[1]) < 40
    resumed = torchrun(train_command(killed, small_data, *args, "--resume"), ROOT, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def final(run: str) -> dict:
        return torch.load(tmp_path / run / "checkpoints" / "step_0000040.pt", map_location="cpu", weights_only=False)

    assert final("whole")["epoch"] >= 2, "the run should cross epochs, whose ends a resume must handle too"
    assert len(final("killed")["rng"]) == 2  # each process's own random states
    for name, value in final("whole")["model"].items():
        torch.testing.assert_close(final("killed")["model"][name], value, rtol=0, atol=1e-6, msg=name)
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))


# Chapter 11's command line with rank 0's first checkpoint at the batch ``sys.argv[2]`` of an epoch (0: its
# end) held up for ``sys.argv[1]`` seconds, longer than the budget.
HELD_UP = """
import sys, time
import stepformer.translator.train as train
from stepformer.translator.cli import main

written = train.write_checkpoint
seconds, batch = float(sys.argv[1]), int(sys.argv[2])

def held_up(out_dir, model, optimizer, config, tokenizer, position, rng):
    at = position.batch_in_epoch == (batch or position.epoch_batches)
    if at and not getattr(held_up, "done", False):
        held_up.done = True
        time.sleep(seconds)
    return written(out_dir, model, optimizer, config, tokenizer, position, rng)

train.write_checkpoint = held_up
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("batch", [0, 3], ids=["at an epoch's end", "mid-epoch"])
def test_a_wall_clock_budget_that_runs_out_while_rank_0_writes_a_checkpoint_ends_both_processes(
        tmp_path, small_data, batch):
    script = tmp_path / "held_up.py"
    script.write_text(HELD_UP)
    command = train_command(tmp_path / "run", small_data, "--minutes", str(6 / 60), "--set", "checkpoint_every=1",
                            "--set", "keep_checkpoints=2", program=(str(script), "8", str(batch)))
    result = torchrun(command, ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in metrics]
    assert steps == list(range(1, len(steps) + 1))
    # Held up at the end of the first epoch, rank 0 is waited for before the second begins, and both stop
    # there; held up mid-epoch, it is waited for at the next step, after which both see the budget spent.
    if batch:
        assert steps[-1] == batch + 1
    else:
        assert json.loads(metrics[-1])["epoch"] == 1


def test_adamw_decays_matrices_not_norms_or_biases_unless_asked():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)  # a frozen table is left out of the optimiser
    decays = {id(p): group["weight_decay"] for group in runs.adamw(model, 1e-3, (0.9, 0.95), 0.1).param_groups
              for p in group["params"]}
    assert decays == {id(model[2].weight): 0.1, id(model[1].weight): 0.0, id(model[1].bias): 0.0,
                      id(model[2].bias): 0.0}
    every = runs.adamw(model, 1e-3, (0.9, 0.95), 0.1, decay_norms_and_biases=True).param_groups
    assert len(every) == 1 and every[0]["weight_decay"] == 0.1
    assert [id(p) for p in every[0]["params"]] == [id(p) for p in model.parameters() if p.requires_grad]


def test_preset_names_the_presets_there_are():
    assert runs.preset({"cpu": 1, "gpu": 2}, "gpu") == 2
    with pytest.raises(ValueError, match="unknown preset 'tpu'; the presets are cpu, gpu"):
        runs.preset({"cpu": 1, "gpu": 2}, "tpu")
