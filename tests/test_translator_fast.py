"""The translator's fast pieces (``stepformer.translator.fast``) against the plain ones and PyTorch:
the blocked label-smoothed loss (value and gradient) and dropout drawn from packed random bits."""

import math

import jaxtyping
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from stepformer.translator import train as trainer
from stepformer.translator.config import preset
from stepformer.translator.fast import PackedDropout, fused_label_smoothed_loss, packed_dropout
from stepformer.translator.model import build_model
from stepformer.translator.recipe import label_smoothed_loss


def _case(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    batch, tgt_len = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
    vocab = int(torch.randint(3, 300, (1,), generator=g))
    pad_id = int(torch.randint(0, vocab, (1,), generator=g))
    logits = (torch.randn(batch, tgt_len, vocab, generator=g, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, vocab, (batch, tgt_len), generator=g)
    target[0, -1] = pad_id  # at least one padded position
    return logits, target, pad_id


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_fused_loss_is_label_smoothed_loss_and_pytorchs_value_and_gradient(seed, dtype, tolerance):
    logits, target, pad_id = _case(seed, dtype)
    for smoothing in (0.0, 0.1, 0.3):
        for reduction in ("mean", "sum"):
            for rows in (1, 3, 1000):  # one row per block, blocks that do not divide the rows, one block
                ours = logits.clone().requires_grad_()
                fused = fused_label_smoothed_loss(ours, target, pad_id, smoothing, reduction, rows)
                (fused * 1.7).backward()
                plain = logits.clone().requires_grad_()
                expected = label_smoothed_loss(plain, target, pad_id, smoothing, reduction)
                (expected * 1.7).backward()
                assert fused.dtype == expected.dtype and ours.grad.dtype == dtype
                torch.testing.assert_close(fused, expected, rtol=tolerance, atol=tolerance)
                torch.testing.assert_close(ours.grad, plain.grad, rtol=tolerance, atol=tolerance)
                assert torch.all(ours.grad[target == pad_id] == 0)  # padding gets no gradient at all
        # PyTorch's own: cross_entropy with ignore_index and label_smoothing (the mean over real tokens).
        theirs = F.cross_entropy(rearrange(logits, "b t v -> (b t) v").double(), rearrange(target, "b t -> (b t)"),
                                 ignore_index=pad_id, label_smoothing=smoothing)
        fused = fused_label_smoothed_loss(logits, target, pad_id, smoothing)
        torch.testing.assert_close(fused.double(), theirs, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("seed", range(3))
def test_the_fused_loss_from_bfloat16_logits_is_the_plain_loss_and_keeps_the_gradient_in_bfloat16(seed):
    logits, target, pad_id = _case(seed, torch.bfloat16)
    ours, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fused = fused_label_smoothed_loss(ours, target, pad_id, 0.1, "sum", rows=2)
    expected = label_smoothed_loss(plain, target, pad_id, 0.1, "sum")
    fused.backward()
    expected.backward()
    assert fused.dtype == torch.float32 and ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours.grad, plain.grad, rtol=1e-2, atol=1e-3)  # each rounded once to bfloat16


def test_the_fused_loss_at_the_edges():
    logits = torch.randn(2, 5, 11) + 100.0  # exp(100) overflows float32 unless the maximum is taken out first
    target = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 0, 0, 0]])
    expected = label_smoothed_loss(logits, target, 0)
    assert torch.isfinite(expected)
    torch.testing.assert_close(fused_label_smoothed_loss(logits, target, 0), expected)
    changed = logits.clone()
    changed[target == 0] = 1e4  # whatever sits at padding changes nothing
    assert fused_label_smoothed_loss(changed, target, 0) == fused_label_smoothed_loss(logits, target, 0)
    empty = logits.clone().requires_grad_()
    loss = fused_label_smoothed_loss(empty, torch.zeros_like(target), 0)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(empty.grad == 0)  # all padding: no tokens, 0, no gradient
    with pytest.raises(ValueError, match="smoothing"):
        fused_label_smoothed_loss(logits, target, 0, 1.0)
    with pytest.raises(ValueError, match="reduction"):
        fused_label_smoothed_loss(logits, target, 0, 0.1, "none")


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5, 0.9])
def test_packed_dropout_keeps_each_element_with_probability_one_minus_p_and_scales_the_kept(p):
    torch.manual_seed(int(100 * p))
    x = torch.rand(257, 129) + 0.5  # no zeros, an odd number of elements (not a multiple of four)
    y = PackedDropout(p).train()(x)
    kept = y != 0
    n, p_exact = x.numel(), round(p * 65536) / 65536
    assert abs(p_exact - p) < 1e-5
    # Within five standard deviations of the binomial: fails for a wrong threshold or sign.
    assert abs(kept.float().mean().item() - (1 - p_exact)) < 5 * math.sqrt(p_exact * (1 - p_exact) / n)
    torch.testing.assert_close(y[kept], x[kept] / (1 - p_exact), rtol=1e-6, atol=0)
    # Independent elements: neighbours (which share one 64-bit draw) are kept together no more often than chance.
    pairs = (kept[:, :-1] & kept[:, 1:]).float().mean().item()
    assert abs(pairs - (1 - p_exact) ** 2) < 5 * math.sqrt((1 - p_exact) ** 2 * (1 - (1 - p_exact) ** 2) / n)


def test_packed_dropout_like_nn_dropout_in_every_other_respect():
    x = torch.randn(6, 7, 10, dtype=torch.bfloat16)
    layer = PackedDropout(0.3)
    torch.manual_seed(1)
    first = layer(x)
    torch.manual_seed(1)
    assert torch.equal(layer(x), first)  # the seed decides the mask
    assert not torch.equal(layer(x), first)  # and the next draw is a new one
    assert first.dtype == torch.bfloat16 and first.shape == x.shape
    layer.eval()
    assert torch.equal(layer(x), x)  # evaluation: the identity
    assert torch.equal(PackedDropout(0.0).train()(x), x)
    assert torch.all(PackedDropout(1.0).train()(x) == 0)
    # The gradient is the mask times the scale, as for nn.Dropout.
    leaf = torch.randn(40, 50, dtype=torch.float64).requires_grad_()
    out = PackedDropout(0.25).train()(leaf)
    out.sum().backward()
    torch.testing.assert_close(leaf.grad, (out / leaf).detach())
    # A transposed (non-contiguous) input gives an output of the same layout, dropped element by element.
    wide = torch.ones(30, 20).t()
    dropped = PackedDropout(0.5).train()(wide)
    assert dropped.shape == (20, 30) and set(dropped.unique().tolist()) <= {0.0, 2.0}


@pytest.mark.parametrize("fast", [True, False])
def test_the_translator_uses_packed_dropout_exactly_when_asked(fast):
    config = preset("tiny").with_overrides({"packed_dropout": str(fast)})
    model = build_model(config, 50, 0)
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == config.model.dropout for m in dropouts)
    assert all(isinstance(m, PackedDropout) for m in dropouts) == fast
    assert any(isinstance(m, PackedDropout) for m in dropouts) == fast
    plain = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.4), nn.Sequential(nn.Dropout(0.1)))
    replaced = packed_dropout(plain)
    assert [type(m) for m in replaced.modules() if isinstance(m, nn.Dropout)] == [PackedDropout, PackedDropout]
    assert [m.p for m in replaced.modules() if isinstance(m, nn.Dropout)] == [0.4, 0.1]


def test_the_trainer_checks_shapes_in_its_first_step_only_and_leaves_the_setting_as_it_was(
    tmp_path, real_data, monkeypatch
):
    seen = []
    plain_step = trainer.train_step

    def spy(*args, **kwargs):
        seen.append(not jaxtyping.config.jaxtyping_disable)
        return plain_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", spy)
    before = jaxtyping.config.jaxtyping_disable
    config = preset("tiny").with_overrides({"max_steps": "3", "checkpoint_every": "3", "eval_every": "1000",
                                            "max_tokens": "1024", "keep_checkpoints": "1"})
    trainer.train(config, tmp_path / "run", real_data, progress=False, device=torch.device("cpu"))
    assert seen == [True, False, False], (
        f"checks on in the steps: {seen}; expected the first step checked (a wrong shape names its axis), "
        "the later ones not (the checks are a fifth of an eager step's host time)")
    assert jaxtyping.config.jaxtyping_disable == before, "train() must leave jaxtyping's setting as it found it"
