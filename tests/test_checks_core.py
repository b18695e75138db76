"""What the checks share (``stepformer.checks._core``): the failure that says the student's code raised, kept
through record and replay, and the pairwise-distinct sizes of the fixtures."""

import copy
import importlib

import pytest
import torch

import stepformer.masks
from stepformer.checks._core import (
    RECORD_ENV,
    CheckFailure,
    CodeRaised,
    _key_file,
    call,
    check,
    distinct_sizes,
    draw_sizes,
    replaying,
)
from stepformer.checks.masks import check_causal_mask_arguments
from tests.fixtures.student import student_copy

# -- CodeRaised -------------------------------------------------------------------------------

caught: list[CheckFailure] = []


@check
def _check_calls(fn, seed: int = 0) -> None:
    """A check that calls the student's ``fn`` once and keeps a copy of its failure, as the checks' hints see it
    (what leaves the check is the same object, made a plain CheckFailure)."""
    try:
        call(fn, torch.ones(2, 3), seed)
    except CheckFailure as failure:
        caught.append(copy.copy(failure))
        raise


def _refuses(x, seed):
    raise ValueError(f"seed {seed} is not welcome")


def _stub(x, seed):
    raise NotImplementedError


def _failure_of(fn, seed: int = 0) -> tuple[CheckFailure, CheckFailure]:
    """(what the check saw inside, what left it)."""
    caught.clear()
    with pytest.raises(CheckFailure) as left:
        _check_calls(fn, seed)
    return caught[-1], left.value


def test_code_raised_names_the_error_and_its_text():
    inside, left = _failure_of(_refuses, 3)
    assert isinstance(inside, CodeRaised)
    assert (inside.error, inside.text, inside.raised) == ("ValueError", "seed 3 is not welcome",
                                                          "ValueError: seed 3 is not welcome")
    assert str(inside) == "_refuses(Tensor(2, 3) float32, 3) raised ValueError: seed 3 is not welcome"
    # It leaves the check as the CheckFailure that notebooks and feedback have always named, same message.
    assert type(left) is CheckFailure and str(left) == str(inside)


def test_a_stub_is_not_code_raised():
    inside, _ = _failure_of(_stub)
    assert type(inside) is CheckFailure
    assert str(inside) == "_stub is not implemented yet (it raised NotImplementedError)."


def test_a_reworded_failure_keeps_its_class_and_what_was_raised():
    raised = CodeRaised("f(1) raised KeyError: 'a'", "KeyError", "'a'")
    again = raised.reworded(f"For one sentence: {raised} Look at the keys.")
    assert isinstance(again, CodeRaised) and (again.error, again.text) == ("KeyError", "'a'")
    assert str(again) == "For one sentence: f(1) raised KeyError: 'a' Look at the keys."
    plain = CheckFailure("differs").reworded("differs: a hint")
    assert type(plain) is CheckFailure and str(plain) == "differs: a hint"


def _record(monkeypatch, folder, fn, seed: int = 0) -> None:
    monkeypatch.setenv(RECORD_ENV, str(folder))
    _failure_of(fn, seed)
    monkeypatch.delenv(RECORD_ENV)


def test_a_recorded_code_raised_replays_as_one(monkeypatch, tmp_path):
    _record(monkeypatch, tmp_path, _refuses, 3)
    recorded = caught[-1]
    with replaying(tmp_path):
        replayed, left = _failure_of(object(), 3)  # the object is never called
    assert type(replayed) is CodeRaised
    assert (replayed.error, replayed.text, str(replayed)) == (recorded.error, recorded.text, str(recorded))
    assert type(left) is CheckFailure and str(left) == str(recorded)


def test_other_failures_and_older_records_replay_as_plain_failures(monkeypatch, tmp_path):
    _record(monkeypatch, tmp_path / "stub", _stub)
    with replaying(tmp_path / "stub"):
        replayed, _ = _failure_of(object())
    assert type(replayed) is CheckFailure
    assert str(replayed) == "_stub is not implemented yet (it raised NotImplementedError)."
    # A record written before the error's class and text were kept holds the message alone.
    _record(monkeypatch, tmp_path / "old", _refuses, 3)
    path = tmp_path / "old" / f"{_key_file('_check_calls(3)')}-0.pt"
    entries = torch.load(path, weights_only=True)
    assert entries[0].pop("raised") == ["ValueError", "seed 3 is not welcome"]
    torch.save(entries, path)
    with replaying(tmp_path / "old"):
        replayed, _ = _failure_of(object(), 3)
    assert type(replayed) is CheckFailure
    assert str(replayed) == "_refuses(Tensor(2, 3) float32, 3) raised ValueError: seed 3 is not welcome"


def test_a_check_that_expects_a_value_error_passes_on_replay(monkeypatch, tmp_path):
    # check_causal_mask_arguments passes because the solution raises ValueError: under replay it learns that from
    # the recorded class, where no code runs.
    solution = student_copy(stepformer.masks).causal_mask
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    check_causal_mask_arguments(solution, seed=2)
    monkeypatch.delenv(RECORD_ENV)
    with replaying(tmp_path):
        check_causal_mask_arguments(object(), seed=2)


# -- sizes ------------------------------------------------------------------------------------

def test_drawn_sizes_are_pairwise_distinct_and_in_range():
    for seed in range(1, 200):
        for span, first, axes in ((5, 2, "a b c d e"), (9, 2, "a b c"), (6, 6, "a b")):
            sizes = draw_sizes(torch.Generator().manual_seed(seed), axes.split(), span, first)
            assert list(sizes) == axes.split()
            assert len(set(sizes.values())) == len(sizes)
            assert all(first <= n < first + span for n in sizes.values())


def test_distinct_sizes_keeps_seed_0_accepts_and_computes_products():
    axes = ("batch", "heads", "q_len", "d_head")
    product = {"d_model": ("heads", "d_head")}
    assert distinct_sizes(0, axes, span=8, fixed=(2, 3, 5, 4), products=product) == \
        {"batch": 2, "heads": 3, "q_len": 5, "d_head": 4, "d_model": 12}
    for seed in range(1, 200):
        sizes = distinct_sizes(seed, axes, span=8, products=product, accept=lambda s: s["d_head"] % 2 == 0)
        assert list(sizes) == [*axes, "d_model"]
        assert len(set(sizes.values())) == len(sizes)
        assert sizes["d_head"] % 2 == 0 and sizes["d_model"] == sizes["heads"] * sizes["d_head"]


# Each sizes function's sizes for seeds 0, 1 and 7, drawn by the code each module had before the shared helpers
# (seeds 1 and 7 draw again in the loops of decoder, encoder, multihead and gqa): the fixtures' sizes, which the
# graded messages and points depend on, in order.
SIZES = {
    "attention._sizes": ("batch heads q_len k_len d_k d_v",
                        {0: (2, 3, 5, 7, 4, 6), 1: (7, 6, 4, 8, 9, 5), 7: (9, 2, 5, 6, 3, 7)}),
    "decoder._sizes": ("batch tgt_len src_len heads d_head d_ff d_model",
                      {0: (3, 5, 7, 2, 4, 11, 8), 1: (4, 13, 7, 5, 8, 9, 40), 7: (2, 7, 3, 5, 4, 10, 20)}),
    "encoder._sizes": ("batch seq heads d_head d_ff vocab start d_model",
                      {0: (2, 5, 3, 4, 9, 13, 6, 12), 1: (5, 6, 4, 8, 3, 2, 11, 32), 7: (2, 4, 5, 10, 11, 12, 7, 50)}),
    "ffn._sizes": ("batch seq d_model d_ff", {0: (2, 3, 5, 7), 1: (7, 8, 3, 4), 7: (7, 2, 5, 6)}),
    "gqa._sizes": ("batch kv_heads group q_len k_len d_head heads d_model",
                  {0: (3, 2, 4, 5, 7, 6, 8, 48), 1: (6, 3, 4, 2, 5, 8, 12, 96), 7: (7, 2, 4, 6, 5, 3, 8, 24)}),
    "kvcache._sizes": ("batch kv_heads d_head prefill steps",
                      {0: (2, 3, 4, 5, 6), 1: (2, 8, 3, 5, 7), 7: (7, 2, 5, 3, 4)}),
    "masks._sizes": ("batch heads q_len k_len d_k", {0: (2, 3, 4, 7, 5), 1: (7, 6, 4, 8, 9), 7: (9, 2, 5, 6, 3)}),
    "multihead._sizes": ("batch heads q_len k_len d_head d_model",
                        {0: (2, 3, 5, 7, 4, 12), 1: (7, 6, 4, 8, 9, 54), 7: (9, 6, 2, 8, 4, 24)}),
    "norms._sizes": ("batch seq d_model", {0: (2, 5, 12), 1: (3, 7, 9), 7: (5, 2, 14)}),
    "positional._sizes": ("batch heads seq d_head", {0: (2, 3, 5, 8), 1: (2, 8, 3, 16), 7: (7, 2, 5, 16)}),
    "before._attention_sizes": ("batch q_len k_len d_q d_k d_v d_attn",
                               {0: (2, 3, 5, 4, 6, 7, 8), 1: (6, 2, 8, 7, 9, 4, 10), 7: (2, 7, 10, 3, 9, 4, 5)}),
    "scale._tile_sizes": ("batch heads q_block k_block d_k d_v",
                         {0: (3, 2, 7, 4, 9, 6), 1: (9, 8, 6, 3, 2, 5), 7: (7, 4, 3, 8, 9, 2)}),
    "models._block_sizes": ("batch seq kv_heads group d_head d_ff heads d_model",
                           {0: (3, 5, 2, 4, 6, 7, 8, 48), 1: (10, 6, 3, 4, 8, 5, 12, 96),
                            7: (8, 11, 3, 2, 4, 7, 6, 24)}),
    "models._vocab_sizes": ("batch seq vocab", {0: (3, 2, 11), 1: (5, 2, 13), 7: (3, 4, 9)}),
    "models._lora_sizes": ("batch seq d_in d_out r", {0: (2, 3, 7, 5, 4), 1: (5, 2, 7, 11, 4), 7: (3, 5, 6, 10, 4)}),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_every_sizes_function_draws_the_sizes_it_always_drew(name):
    module, _, function = name.partition(".")
    sizes = getattr(importlib.import_module(f"stepformer.checks.{module}"), function)
    axes, by_seed = SIZES[name]
    for seed, values in by_seed.items():
        assert list(sizes(seed).items()) == list(zip(axes.split(), values, strict=True)), seed
