"""Chapter 11's precision by capability: bf16 where the GPU has it natively, fp16 with a gradient scaler
where it would only emulate bf16 (a T4 or V100), whatever is asked for explicitly, and the CPU as before.

No GPU is needed: the tests stand in for CUDA's capability query, as PyTorch answers it on each card.
"""

import pytest
import torch

from stepformer.runs import load_checkpoint
from stepformer.translator.config import autocast_dtype, preset
from stepformer.translator.train import train

CUDA, CPU, MPS = torch.device("cuda"), torch.device("cpu"), torch.device("mps")


def native_bf16(including_emulation: bool = True) -> bool:
    """An A100 or H100 (compute capability 8.0 and 9.0): bf16 in its tensor cores."""
    return True


def emulated_bf16(including_emulation: bool = True) -> bool:
    """A T4 (7.5) or V100 (7.0): PyTorch can emulate bf16 there, so the default query says yes."""
    return including_emulation


def test_a_gpu_with_native_bf16_trains_in_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", native_bf16)
    assert autocast_dtype("auto", CUDA) is torch.bfloat16


def test_a_t4_like_gpu_trains_in_fp16_not_in_emulated_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated_bf16)
    assert autocast_dtype("auto", CUDA) is torch.float16, (
        "a T4 only emulates bf16: ask torch.cuda.is_bf16_supported(including_emulation=False)")


@pytest.mark.parametrize("query", [native_bf16, emulated_bf16])
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("device", [CUDA, CPU, MPS], ids=str)
def test_an_explicit_precision_is_obeyed_on_any_device(monkeypatch, query, precision, dtype, device):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", query)
    assert autocast_dtype(precision, device) is dtype


def test_the_cpu_uses_bf16_only_with_bf16_matrix_units_and_mps_stays_in_float32():
    has_units = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert autocast_dtype("auto", CPU) is (torch.bfloat16 if has_units else None)
    assert autocast_dtype("auto", MPS) is None


def test_fp16_trains_with_a_gradient_scaler_and_the_run_says_so(tmp_path, real_data, capsys):
    # The trainer enables its scaler exactly when the dtype is fp16; on a CPU fp16 autocast and the
    # scaler are real, so two steps show the branch that a T4 takes.
    config = preset("tiny").with_overrides({"max_steps": "2", "precision": "fp16", "checkpoint_every": "2",
                                            "eval_every": "1000", "max_tokens": "1024", "keep_checkpoints": "1"})
    averaged = train(config, tmp_path / "run", real_data, progress=False, device=CPU)
    assert "precision float16 with a gradient scaler" in capsys.readouterr().err
    assert load_checkpoint(averaged)["precision"] == "float16"
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "step_0000002.pt")["precision"] == "float16"


def test_float32_runs_say_so_without_a_scaler(tmp_path, real_data, capsys):
    config = preset("tiny").with_overrides({"max_steps": "1", "checkpoint_every": "1", "eval_every": "1000",
                                            "max_tokens": "1024", "keep_checkpoints": "1"})
    averaged = train(config, tmp_path / "run", real_data, progress=False, device=CPU)
    log = capsys.readouterr().err
    assert "precision float32;" in log and "gradient scaler" not in log
    assert load_checkpoint(averaged)["precision"] == "float32"
