"""Chapter 11's checks: they pass on the library's recipe, fail on the stub, and name each realistic mistake
(the graded notebook's fixtures, tests/fixtures/mistakes_translator.py, grade the same mistakes end to end)."""

import math

import pytest
import torch
import torch.nn.functional as F
from beartype import beartype
from einops import rearrange
from jaxtyping import jaxtyped

import stepformer.translator.recipe
from stepformer.checks import CheckFailure
from stepformer.checks._core import RECORD_ENV, replaying
from stepformer.checks.translator import (
    _beam_sizes,
    _loss_sizes,
    _step_sizes,
    _Translator,
    check_beam_step,
    check_inverse_sqrt_lr,
    check_label_smoothed_loss,
    check_label_smoothed_loss_edges,
    check_memorise,
    check_train_step,
    check_train_steps,
)
from tests.fixtures.student import student_copy


def stub(*args, **kwargs):
    raise NotImplementedError()


recipe = student_copy(stepformer.translator.recipe)


def memorise(model, src, tgt, pad_id, steps=150, peak_lr=1e-2, warmup=20, *, train_step=None, schedule=True,
             betas=(0.9, 0.98)):
    """The solution notebook's memorise, with switches for the usual mistakes."""
    train_step = train_step or recipe.train_step
    optimizer = torch.optim.AdamW(model.parameters(), betas=betas)
    return [train_step(model, optimizer, src, tgt, pad_id,
                       recipe.inverse_sqrt_lr(step, peak_lr, warmup) if schedule else peak_lr, smoothing=0.0)
            for step in range(1, steps + 1)]


def test_translator_checks_pass_on_the_solution(capsys):
    for seed, dtype in ((0, torch.float32), (17, torch.float64), (33, torch.float32)):
        check_label_smoothed_loss(recipe.label_smoothed_loss, seed=seed, dtype=dtype)
        check_label_smoothed_loss_edges(recipe.label_smoothed_loss, seed=seed)
        check_inverse_sqrt_lr(recipe.inverse_sqrt_lr, seed=seed)
        check_train_step(recipe.train_step, seed=seed)
        check_train_steps(recipe.train_step, seed=seed)
        check_beam_step(recipe.beam_step, seed=seed, dtype=dtype)
    check_memorise((memorise, recipe.train_step, recipe.inverse_sqrt_lr))
    out = capsys.readouterr().out
    assert out.count("✔") == 19
    assert "zwei kinder spielen im park  →  two children play in the park" in out


@pytest.mark.parametrize("check", [check_label_smoothed_loss, check_label_smoothed_loss_edges, check_inverse_sqrt_lr,
                                   check_train_step, check_train_steps, check_beam_step])
def test_translator_checks_fail_on_the_stub(check):
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stub)


def test_translator_memorise_check_fails_on_the_stubs():
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_memorise((stub, recipe.train_step, recipe.inverse_sqrt_lr))
    # The release's memorise calls the student's train_step: a stub there fails memorise too.
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_memorise((lambda *a, **k: memorise(*a, **k, train_step=stub), stub, recipe.inverse_sqrt_lr))


def test_translator_sizes_are_pairwise_distinct_for_every_seed():
    for seed in range(50):
        for sizes in (_loss_sizes(seed), _step_sizes(seed), _beam_sizes(seed)):
            assert len(set(sizes)) == len(sizes)
        batch, beam, vocab = _beam_sizes(seed)
        assert vocab > 2 * beam


def smoothed_loss(*, log=True, spread="all", mask_sum=True, count="real", swap=False, by_hand=False,
                  nan_when_empty=False, validate=True, validate_reduction=True):
    """A label-smoothed loss written apart from the library, with switches for the usual mistakes."""
    def fn(logits, target, pad_id, smoothing=0.1, reduction="mean"):
        if validate and not 0 <= smoothing < 1:
            raise ValueError(smoothing)
        if validate_reduction and reduction not in ("mean", "sum"):
            raise ValueError(reduction)
        reduction = {"sum": "mean", "mean": "sum"}[reduction] if swap else reduction
        if by_hand:
            log_probs = (logits.exp() / logits.exp().sum(-1, keepdim=True)).log()
        else:
            log_probs = torch.log_softmax(logits, -1) if log else torch.softmax(logits, -1)
        nll = -log_probs.gather(-1, target[..., None])[..., 0]
        vocab = logits.shape[-1]
        uniform = (-log_probs.sum(-1) - nll) / (vocab - 1) if spread == "others" else -log_probs.mean(-1)
        per_token = (1 - smoothing) * nll + smoothing * uniform
        real = target != pad_id
        total = (per_token * real).sum() if mask_sum else per_token.sum()
        if reduction == "sum":
            return total
        if nan_when_empty:
            return total / real.sum()
        return total / (real.sum().clamp(min=1) if count == "real" else target.numel())
    return fn


@pytest.mark.parametrize(("mistake", "message"), [
    (smoothed_loss(count="all"), "averaged over padded positions too"),
    (smoothed_loss(mask_sum=False), "sum includes the padded positions"),
    (smoothed_loss(mask_sum=False, count="all"), "ignores padding altogether"),
    (smoothed_loss(spread="others"), "vocab - 1 other tokens. PyTorch's convention"),
    (smoothed_loss(log=False), r"probabilities \(softmax\) where the loss needs log-probabilities"),
    (smoothed_loss(swap=True), r"Your result for reduction='mean' is what reduction='sum' should give"),
])
def test_translator_loss_check_names_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_label_smoothed_loss(mistake)


@pytest.mark.parametrize(("mistake", "message"), [
    (smoothed_loss(by_hand=True), "overflows float32"),
    (smoothed_loss(nan_when_empty=True), "must be 0; yours is nan"),
    (smoothed_loss(validate=False), "should raise a ValueError"),
    (smoothed_loss(validate_reduction=False), r"reduction='none'\) should raise a ValueError"),
])
def test_translator_loss_edges_name_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_label_smoothed_loss_edges(mistake)


def test_translator_loss_edges_check_only_the_edges():
    check_label_smoothed_loss_edges(smoothed_loss(count="all"))  # wrong values, right edges: the other cell's job


def schedule(kind=""):
    def fn(step, peak_lr, warmup):
        if step < 1 or warmup < 1:
            raise ValueError(step)
        step += kind == "from 0"
        rise, decay = step / warmup, math.sqrt(warmup / step)
        if kind == "1/step":
            decay = warmup / step
        if kind == "no warmup":
            rise = 1.0
        if kind == "warmup + 1":
            rise, decay = step / (warmup + 1), math.sqrt((warmup + 1) / step)
        return peak_lr * (max(rise, decay) if kind == "max" else min(rise, decay))
    return fn


@pytest.mark.parametrize(("mistake", "message"), [
    (schedule("from 0"), "Off by one: your rate peaks at step 3999"),
    (schedule("warmup + 1"), "Off by one: your rate peaks at step 4001"),
    (schedule("1/step"), r"falls as 1 / step"),
    (schedule("max"), "above peak_lr: you took the larger"),
    (schedule("no warmup"), "with no warmup"),
    (lambda step, peak_lr, warmup: peak_lr * min(step / warmup, math.sqrt(warmup / step)), "ZeroDivisionError"),
    (lambda step, peak_lr, warmup: torch.tensor(schedule()(step, peak_lr, warmup)), "Python float"),
])
def test_translator_schedule_check_names_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_inverse_sqrt_lr(mistake)


def training_step(*, reads="prefix", clip=True, set_lr="all", zero=True, item=True, loss=None):
    """A training step written apart from the library, with switches for the usual mistakes."""
    loss_fn = loss or smoothed_loss()

    def train_step(model, optimizer, src, tgt, pad_id, lr, smoothing=0.1, clip_norm=1.0):
        if set_lr == "first":
            optimizer.param_groups[0]["lr"] = lr
        elif set_lr == "all":
            for group in optimizer.param_groups:
                group["lr"] = lr
        decoder_in, expected = {"prefix": (tgt[:, :-1], tgt[:, 1:]), "whole": (tgt, tgt),
                                "backwards": (tgt[:, 1:], tgt[:, :-1])}[reads]
        value = loss_fn(model(src, decoder_in), expected, pad_id, smoothing)
        value.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        if zero:
            optimizer.zero_grad()
        return value.item() if item else value
    return train_step


def test_translator_step_checks_pass_on_an_independent_step_in_float64():
    # Its loss stays in float64 where the library's goes through float32: both must pass.
    check_train_step(training_step())
    check_train_steps(training_step())


@pytest.mark.parametrize(("check", "mistake", "message"), [
    (check_train_step, training_step(reads="whole"), "including the token it must predict"),
    (check_train_step, training_step(reads="backwards"), "shifted the wrong way"),
    (check_train_step, training_step(clip=False), "No clipping"),
    (check_train_step, training_step(set_lr="none"), "lr not set"),
    (check_train_step, training_step(set_lr="first"), "lr set on the first parameter group only"),
    (check_train_step, training_step(item=False), r"Python float \(a tensor: return loss.item\(\)\)"),
    (check_train_step, training_step(loss=smoothed_loss(spread="others")), "returned the loss"),
    (check_train_steps, training_step(zero=False), "Gradients accumulate across steps: zero them"),
    (check_train_steps, training_step(set_lr="none"), "lr not set"),
    (check_train_steps, training_step(reads="whole"), "including the token it must predict"),
])
def test_translator_step_checks_name_the_mistake(check, mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check(mistake)


@pytest.mark.parametrize(("check", "mistake"), [
    (check_train_step, training_step(zero=False)),  # one step cannot tell
    (check_train_steps, training_step(clip=False)),  # a clip_norm too large to matter
])
def test_translator_step_checks_test_one_thing_each(check, mistake):
    check(mistake)


def beam(kind=""):
    """A beam step written apart from the library, with switches for the usual mistakes."""
    def fn(scores, log_probs, k):
        batch, beams, vocab = log_probs.shape
        if not 1 <= k <= beams * vocab:
            raise ValueError(k)
        candidates = log_probs if kind == "unscored" else scores[:, :, None] + log_probs
        if kind == "per beam":
            values, tokens = candidates.topk(k, dim=-1)
            return values, torch.arange(beams)[None, :, None].expand(batch, beams, k), tokens
        if kind == "shares":
            share = -(-k // beams)
            values, tokens = candidates.topk(share, dim=-1)
            owner = torch.arange(beams).repeat_interleave(share)[:k].expand(batch, k)
            return values.flatten(1)[:, :k], owner, tokens.flatten(1)[:, :k]
        best, flat = candidates.flatten(1).topk(k, dim=-1)
        if kind == "unscored":
            best = best + scores.gather(1, flat // vocab)
        if kind == "% beam":
            return best, flat // beams, flat % beams
        if kind == "reversed":
            return best.flip(-1), (flat // vocab).flip(-1), (flat % vocab).flip(-1)
        if kind == "int32":
            return best, (flat // vocab).int(), (flat % vocab).int()
        return best, flat // vocab, flat % vocab
    return fn


@pytest.mark.parametrize(("mistake", "message"), [
    (beam("per beam"), r"one top-k per beam"),
    (beam("shares"), r"top candidates of each beam separately"),
    (beam("unscored"), "previous scores were not added"),
    (beam("% beam"), r"with % beam and // beam"),
    (beam("reversed"), "not best first"),
    (beam("int32"), "torch.long"),
    (lambda scores, log_probs, k: beam()(scores, log_probs, max(1, min(k, log_probs[0].numel()))), "ValueError"),
])
def test_translator_beam_check_names_the_mistake(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_beam_step(mistake)


def test_translator_beam_check_passes_on_an_independent_step():
    for seed, dtype in ((0, torch.float32), (5, torch.float64)):
        check_beam_step(beam(), seed=seed, dtype=dtype)


def _memorising(**switches):
    return lambda *args, **kwargs: memorise(*args, **kwargs, **switches)


@pytest.mark.parametrize(("functions", "message"), [
    ((_memorising(schedule=False), recipe.train_step, recipe.inverse_sqrt_lr), "constant learning rate of peak_lr"),
    ((_memorising(betas=(0.9, 0.999)), recipe.train_step, recipe.inverse_sqrt_lr), r"default betas \(0.9, 0.999\)"),
    ((_memorising(train_step=training_step(reads="whole")), training_step(reads="whole"), recipe.inverse_sqrt_lr),
     "greedy decoding does not give the targets back"),
    ((lambda *args, **kwargs: torch.tensor(memorise(*args, **kwargs)), recipe.train_step, recipe.inverse_sqrt_lr),
     "list of the 150 losses"),
    # Arguments that are ignored: the defaults hard-coded.
    ((lambda model, src, tgt, pad_id, steps=150, peak_lr=1e-2, warmup=20: memorise(model, src, tgt, pad_id),
      recipe.train_step, recipe.inverse_sqrt_lr), "it should run `steps` steps, not a fixed number"),
    ((lambda model, src, tgt, pad_id, steps=150, peak_lr=1e-2, warmup=20: memorise(model, src, tgt, pad_id, steps),
      recipe.train_step, recipe.inverse_sqrt_lr), "those of the default peak_lr and warmup"),
])
def test_translator_memorise_check_names_the_mistake(functions, message):
    with pytest.raises(CheckFailure, match=message):
        check_memorise(functions)


def test_translator_memorise_check_does_not_count_the_steps_mistakes_twice():
    # A step without clipping is the step's mistake: memorise with it still learns the batch, and passes.
    step = training_step(clip=False)
    check_memorise((_memorising(train_step=step), step, recipe.inverse_sqrt_lr))


def test_translator_loss_is_own_work_in_every_exercise_that_uses_it():
    def uses_pytorch(logits, target, pad_id, smoothing=0.1, reduction="mean"):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=pad_id,
                               label_smoothing=smoothing, reduction=reduction)

    def uses_the_library(logits, target, pad_id, smoothing=0.1, reduction="mean"):
        return stepformer.translator.recipe.label_smoothed_loss(logits, target, pad_id, smoothing, reduction)

    for cheat in (uses_pytorch, uses_the_library):
        with pytest.raises(CheckFailure, match="Not your own work"):
            check_label_smoothed_loss(cheat)
        with pytest.raises(CheckFailure, match="Not your own work"):
            check_train_step(training_step(loss=cheat))
    with pytest.raises(CheckFailure, match="Not your own work.*train_step"):
        check_train_step(stepformer.translator.recipe.train_step)


def test_translator_models_are_pytorch_and_the_library_stays_watched():
    # The check's model is built from PyTorch's modules: calling it is not a use of the library...
    check_train_step(training_step())
    # ...and the library is watched around it.
    def calls_the_library_after_the_model(model, optimizer, src, tgt, pad_id, lr, smoothing=0.1, clip_norm=1.0):
        model(src, tgt[:, :-1])
        return stepformer.translator.recipe.train_step(model, optimizer, src, tgt, pad_id, lr, smoothing, clip_norm)

    with pytest.raises(CheckFailure, match="Not your own work"):
        check_train_step(calls_the_library_after_the_model)
    assert "Transformer(src_vocab=5, tgt_vocab=6, d_model=8" in repr(_Translator(5, 6, 8, 2, 12, 1))


def test_translator_checks_replay_the_recorded_verdicts(monkeypatch, tmp_path):
    cases = [(check_train_step, recipe.train_step), (check_train_steps, training_step(zero=False)),
             (check_beam_step, recipe.beam_step),
             (check_memorise, (memorise, recipe.train_step, recipe.inverse_sqrt_lr)),
             # Diagnoses that run the student's code again, watch it, or read the line that raised.
             (check_label_smoothed_loss, term_loss("constant smoothing term")),
             (check_label_smoothed_loss, term_loss("second column")),
             (check_train_step, step_with(compares_with=slice(2, None))),
             (check_beam_step, beam_with("batch 1 beam"))]
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    verdicts = []
    for check, fn in cases:
        try:
            check(fn)
            verdicts.append("passed")
        except CheckFailure as failure:
            verdicts.append(str(failure))
    monkeypatch.delenv(RECORD_ENV)
    replayed = []
    with replaying(tmp_path):
        for check, fn in cases:
            try:
                check((object(),) * 3 if type(fn) is tuple else object())
                replayed.append("passed")
            except CheckFailure as failure:
                replayed.append(str(failure))
    assert replayed == verdicts
    assert verdicts[0] == "passed" and "accumulate" in verdicts[1] and verdicts[3] == "passed"
    assert "does not depend on the logits" in verdicts[4] and "The line that raised it" in verdicts[5]
    assert "tgt[:, 2:]" in verdicts[6] and "batch 1 beam" in verdicts[7]


# -- diagnoses verified by running the student's code again (issue 27) --------------------------------------------

def term_loss(kind):
    """The loss with one of its terms dropped or replaced: the targets' term, the smoothing term, or its mean."""
    def fn(logits, target, pad_id, smoothing=0.1, reduction="mean"):
        log_probs = torch.log_softmax(logits, -1)
        nll = -log_probs.gather(-1, target[..., None])[..., 0]
        uniform = -log_probs.mean(-1)
        per_token = {"no smoothing term": lambda: (1 - smoothing) * nll,
                     "no smoothing": lambda: nll,
                     "no target term": lambda: (1 - smoothing) + smoothing * uniform,
                     "constant smoothing term": lambda: (1 - smoothing) * nll + smoothing,
                     "gather over positions": lambda: (1 - smoothing) * -log_probs.gather(-2, target[..., None])[
                         ..., 0] + smoothing * uniform,
                     "uniform transposed": lambda: (1 - smoothing) * nll + smoothing * uniform.transpose(0, 1),
                     "second column": lambda: (1 - smoothing) * -log_probs.gather(-1, target[..., None])[..., 1],
                     }[kind]()
        real = target != pad_id
        total = (per_token * real).sum()
        return total if reduction == "sum" else total / real.sum().clamp(min=1)
    return fn


@pytest.mark.parametrize(("mistake", "message", "not_message"), [
    (term_loss("no smoothing term"), r"the smoothing term, smoothing · \(the mean over the vocabulary of -log p\), is "
     "missing", "does not read"),
    (term_loss("no smoothing"), "Your loss ignores the smoothing", "is missing"),
    (term_loss("no target term"), r"does not read -log p\[target\], so its term .* is missing", "smoothing term"),
    (term_loss("constant smoothing term"), "your smoothing term does not depend on the logits", "does not read"),
    (smoothed_loss(spread="others"), "vocab - 1 other tokens", "does not depend on the logits"),
    (term_loss("gather over positions"), "along dim -2, the positions", "axes are swapped"),
    (term_loss("uniform transposed"), r"whose axes are swapped, \(tgt_len, batch\)", "dim -2"),
    (term_loss("second column"), r"The line that raised it.*: `.*\[\.\.\., 1\]", "batch = tgt_len = vocab"),
])
def test_translator_loss_check_verifies_what_it_names(mistake, message, not_message):
    with pytest.raises(CheckFailure, match=message) as failure:
        check_label_smoothed_loss(mistake)
    assert not_message not in str(failure.value)


def test_translator_loss_edges_name_the_division_by_zero_only_when_the_sum_is_right():
    with pytest.raises(CheckFailure, match=r"'mean' divides that 0 by the number of real tokens, 0.*clamp\(min=1\)"):
        check_label_smoothed_loss_edges(smoothed_loss(nan_when_empty=True))
    with pytest.raises(CheckFailure, match="must be 0") as failure:
        check_label_smoothed_loss_edges(smoothed_loss(mask_sum=False))  # padded positions counted: no 0 / 0
    assert "clamp" not in str(failure.value)


def guarded(step_guard="step < 1", warmup_guard="warmup < 1"):
    def fn(step, peak_lr, warmup):
        if eval(warmup_guard):
            raise ValueError(warmup)
        if eval(step_guard):
            raise ValueError(step)
        return peak_lr * min(step / warmup, math.sqrt(warmup / step))
    return fn


@pytest.mark.parametrize(("mistake", "message", "not_message"), [
    (guarded(step_guard="step <= 1"), "Your guard on step rejects step = 1", "inverted"),
    (guarded(step_guard="not step < 1"), "Your guard on step is inverted", "rejects step = 1"),
    (guarded(warmup_guard="warmup <= 1"), "Your guard on warmup rejects warmup = 1", "guard on step"),
    (lambda step, peak_lr, warmup: schedule()(step, peak_lr, warmup) * (1.5 if warmup == 1 else 1.0),
     "With warmup=1", "guard"),
])
def test_translator_schedule_check_names_the_guard_that_rejects_a_valid_step(mistake, message, not_message):
    with pytest.raises(CheckFailure, match=message) as failure:
        check_inverse_sqrt_lr(mistake)
    assert not_message not in str(failure.value)


label_smoothed_loss = recipe.label_smoothed_loss  # the name train_step finds in its globals, as in the notebook


def step_with(decoder_reads=slice(None, -1), compares_with=slice(1, None), item=True):
    @jaxtyped(typechecker=beartype)
    def train_step(model, optimizer, src, tgt, pad_id, lr, smoothing=0.1, clip_norm=1.0) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = label_smoothed_loss(model(src, tgt[:, decoder_reads]), tgt[:, compares_with], pad_id, smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item() if item else loss
    return train_step


@pytest.mark.parametrize(("mistake", "message", "not_message"), [
    (step_with(decoder_reads=slice(None, -2)), r"fed the decoder tgt\[:, :-2\]", "your loss compared"),
    (step_with(compares_with=slice(2, None)), r"your loss compared its logits with tgt\[:, 2:\]", "fed the decoder"),
    (step_with(item=False), r"returns a tensor where its signature says float: return loss.item\(\)", "decoder"),
])
def test_translator_step_check_watches_what_the_decoder_and_the_loss_read(mistake, message, not_message):
    with pytest.raises(CheckFailure, match=message) as failure:
        check_train_step(mistake)
    assert not_message not in str(failure.value)


def beam_with(kind):
    def fn(scores, log_probs, k):
        batch, beams, vocab = log_probs.shape
        if not 1 <= k <= (vocab if kind == "bound vocab" else beams * vocab):
            raise ValueError(k)
        pattern = {"batch 1 beam": "batch beam -> batch 1 beam", "beam batch 1": "batch beam -> beam batch 1"}
        candidates = rearrange(scores, pattern.get(kind, "batch beam -> batch beam 1"))
        if kind != "scores alone":
            candidates = candidates + log_probs
        if kind == "flat batch last":
            best, flat = rearrange(candidates, "batch beam vocab -> (beam vocab) batch").topk(k, dim=-1)
        else:
            best, flat = rearrange(candidates, "batch beam vocab -> batch (beam vocab)").topk(
                k, dim=-2 if kind == "topk dim -2" else -1)
        return best, flat // vocab, flat % vocab
    return fn


@pytest.mark.parametrize(("mistake", "message"), [
    (beam_with("bound vocab"), "your bound on k is vocab, without the factor beam"),
    (beam_with("scores alone"), "the log_probs were not added"),
    (beam_with("batch 1 beam"), r"added along the vocab axis \(scores broadcast as batch 1 beam\)"),
    (beam_with("beam batch 1"), r"scores transposed, \(beam, batch\)"),
    (beam_with("topk dim -2"), "a topk along the batch axis \\(dim -2"),
    (beam_with("flat batch last"), r"flattened to \(\(beam vocab\), batch\)"),
])
def test_translator_beam_check_names_what_runs_where_the_sizes_coincide(mistake, message):
    with pytest.raises(CheckFailure, match=message) as failure:
        check_beam_step(mistake)
    others = ["without the factor beam", "were not added", "batch 1 beam", "scores transposed", "(dim -2",
              "((beam vocab), batch)"]
    assert sum(other in str(failure.value) for other in others) == 1


def test_translator_beam_check_names_no_axis_for_other_mistakes():
    with pytest.raises(CheckFailure, match=r"with % beam and // beam") as failure:
        check_beam_step(beam("% beam"))
    assert "batch = beam = vocab" not in str(failure.value)


train_step, inverse_sqrt_lr = recipe.train_step, recipe.inverse_sqrt_lr  # the names memorise finds, as in the notebook


def memorise_over(first=1, past_last=1):
    def fn(model, src, tgt, pad_id, steps=150, peak_lr=1e-2, warmup=20):
        optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.98))
        return [train_step(model, optimizer, src, tgt, pad_id, inverse_sqrt_lr(step, peak_lr, warmup), smoothing=0.0)
                for step in range(first, steps + past_last)]
    return fn


@pytest.mark.parametrize(("mistake", "message"), [
    (memorise_over(first=2), r"steps 2, 3, ..., 12 and called train_step 11 times: it starts at step 2, so the "
     "first step, 1, is missing"),
    (memorise_over(past_last=0), "it stops at step 11, so the last step, 12, is missing"),
    (memorise_over(past_last=2), "it runs on to step 13, one step too many"),
    (memorise_over(first=0), r"raised ValueError.*the rate of step 0 and called train_step 0 times: it starts at "
     "step 0, and steps count from 1"),
])
def test_translator_memorise_check_watches_the_steps_of_its_loop(mistake, message):
    with pytest.raises(CheckFailure, match=message):
        check_memorise((mistake, train_step, inverse_sqrt_lr))


def test_translator_memorise_check_watches_no_loop_where_the_count_is_right():
    with pytest.raises(CheckFailure, match="constant learning rate of peak_lr") as failure:
        check_memorise((_memorising(schedule=False), recipe.train_step, recipe.inverse_sqrt_lr))
    assert "Watched" not in str(failure.value)


def non_finite_loss(kind):
    """A loss that is not finite: padded positions filled with -inf, or log of a softmax that underflows."""
    def fn(logits, target, pad_id, smoothing=0.1, reduction="mean"):
        log_probs = torch.log_softmax(logits, -1) if kind == "padding" else torch.softmax(logits, -1).log()
        per_token = (1 - smoothing) * -log_probs.gather(-1, target[..., None])[..., 0] - smoothing * log_probs.mean(-1)
        real = target != pad_id
        per_token = per_token.masked_fill(~real, -math.inf if kind == "padding" else 0.0)
        total = per_token.sum()
        return total if reduction == "sum" else total / real.sum().clamp(min=1)
    return fn


@pytest.mark.parametrize(("kind", "message", "not_message"), [
    ("padding", "every padded target replaced by a real token .*: the padded positions reach the sum", "overflows"),
])
def test_a_loss_that_is_not_finite_is_traced_to_the_padding_only_when_removing_it_helps(kind, message, not_message):
    with pytest.raises(CheckFailure, match=message) as failure:
        check_label_smoothed_loss(non_finite_loss(kind))
    assert not_message not in str(failure.value)


def test_a_loss_that_is_not_finite_without_padding_names_no_cause_it_did_not_see():
    from stepformer.checks.translator import _non_finite_loss

    logits = torch.tensor([[[1000.0, 0.0, -1000.0], [0.0, 1.0, 2.0]]])
    target = torch.tensor([[2, 1]])  # no padding (pad_id 0 is not a target here)
    got = non_finite_loss("underflow")(logits, target, 0)
    assert not torch.isfinite(got)
    message = _non_finite_loss(non_finite_loss("underflow"), logits, target, 0, 0.1, "mean", got)
    assert "divided by 100" in message and "padded positions reach the sum" not in message
    always = lambda *args, **kwargs: torch.tensor(math.nan)  # noqa: E731
    message = _non_finite_loss(always, logits, target, 0, 0.1, "mean", torch.tensor(math.nan))
    assert "not finite either" in message and "log_softmax" not in message
