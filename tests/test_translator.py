"""Chapter 11's translator: the recipe against PyTorch and the definitions, subwords, batches, decoding
(cached == uncached, beam search == exhaustive search where it can be), training that resumes after a
kill and that gives the same losses on two processes, scores against sacreBLEU, and the command line.

Training runs use the ``tiny`` preset on the real Multi30k files (``../shared/data/multi30k``).
"""

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from stepformer.parts import ModelConfig, configured_transformer
from stepformer.runs import budget_fraction, commit
from stepformer.transformer import Transformer, generate
from stepformer.translator.batching import Encoded, collate, encode_pairs, token_batches
from stepformer.translator.config import preset
from stepformer.translator.data import load_split
from stepformer.translator.evaluate import gpu_readme_row, gpu_rows
from stepformer.translator.model import build_model
from stepformer.translator.recipe import beam_step, inverse_sqrt_lr, label_smoothed_loss
from stepformer.translator.search import beam_search, best_extensions, greedy_search
from stepformer.translator.tokenizer import SubwordTokenizer
from stepformer.translator.train import scheduled_lr

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "stepformer.translator.cli"]


# --- the recipe -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_label_smoothed_loss_equals_pytorch_with_padding_ignored(seed):
    g = torch.Generator().manual_seed(seed)
    batch, tgt_len, vocab = (int(x) for x in torch.randint(2, 9, (3,), generator=g))
    vocab += 3
    pad_id = int(torch.randint(0, vocab, (1,), generator=g))
    logits = torch.randn(batch, tgt_len, vocab, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (batch, tgt_len), generator=g)
    target[0, -1] = pad_id  # at least one padded position
    for smoothing in (0.0, 0.1, 0.3):
        theirs = F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), rearrange(target, "b t -> (b t)"),
                                 ignore_index=pad_id, label_smoothing=smoothing)
        ours = label_smoothed_loss(logits, target, pad_id, smoothing)
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-6)
        real = int((target != pad_id).sum())
        ours_sum = label_smoothed_loss(logits, target, pad_id, smoothing, "sum")
        torch.testing.assert_close(ours_sum.double(), theirs * real, rtol=1e-6, atol=1e-6)


def test_label_smoothed_loss_ignores_whatever_sits_at_padding():
    logits = torch.randn(2, 5, 11)
    target = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 0, 0, 0]])
    changed = logits.clone()
    changed[target == 0] = 1e4  # huge logits at padded positions must change nothing
    assert torch.equal(label_smoothed_loss(logits, target, 0), label_smoothed_loss(changed, target, 0))
    assert label_smoothed_loss(logits, torch.zeros_like(target), 0).item() == 0.0  # all padding: no tokens, 0
    with pytest.raises(ValueError, match="smoothing"):
        label_smoothed_loss(logits, target, 0, 1.0)


@pytest.mark.parametrize(("d_model", "warmup"), [(512, 4000), (256, 500), (64, 7)])
def test_inverse_sqrt_lr_is_the_papers_schedule(d_model, warmup):
    peak = (d_model * warmup) ** -0.5  # the paper's peak, reached at step == warmup
    for step in [1, 2, warmup // 2 + 1, warmup, warmup + 1, 3 * warmup, 100 * warmup]:
        paper = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert inverse_sqrt_lr(step, peak, warmup) == pytest.approx(paper, rel=1e-12)
    rates = [inverse_sqrt_lr(s, 1.0, warmup) for s in range(1, 3 * warmup)]
    assert max(rates) == pytest.approx(1.0) and rates.index(max(rates)) == warmup - 1
    with pytest.raises(ValueError, match="from 1"):
        inverse_sqrt_lr(0, 1.0, warmup)


def test_the_cooldown_takes_the_rate_linearly_to_zero_over_the_budgets_last_part():
    config = preset("tiny").with_overrides({"max_steps": "1000", "warmup": "100", "cooldown": "0.2"})
    rates = [scheduled_lr(config, s, budget_fraction(config, s - 1, 0.0, 0.0)) for s in range(1, 1001)]
    # Before the last fifth it is the paper's schedule, untouched.
    assert rates[:800] == [inverse_sqrt_lr(s, config.peak_lr, config.warmup) for s in range(1, 801)]
    # Then the paper's rate times (budget left) / (cooldown): halfway through the cooldown, half of it.
    assert rates[899] == pytest.approx(0.5 * inverse_sqrt_lr(900, config.peak_lr, config.warmup), rel=0.01)
    assert all(b < a for a, b in itertools.pairwise(rates[800:])) and 0 < rates[-1] < rates[0]
    # The limit that ends first sets the fraction: 45 of 50 minutes is 90 % even at step 10 of 1000.
    timed = config.with_overrides({"max_minutes": "50"})
    assert budget_fraction(timed, 10, 0.0, 45 * 60) == pytest.approx(0.9)
    assert budget_fraction(config.with_overrides({"max_epochs": "4"}), 10, 3.0, 0.0) == pytest.approx(0.75)
    off = config.with_overrides({"cooldown": "0"})
    assert scheduled_lr(off, 990, 0.99) == inverse_sqrt_lr(990, off.peak_lr, off.warmup)
    with pytest.raises(ValueError, match="cooldown"):
        config.with_overrides({"cooldown": "1.5"})


@pytest.mark.parametrize("seed", range(5))
def test_beam_step_keeps_the_k_best_of_all_extensions(seed):
    g = torch.Generator().manual_seed(seed)
    batch, beam, vocab = 3, 4, 7
    scores = torch.randn(batch, beam, generator=g, dtype=torch.float64)
    scores[0, 2:] = -torch.inf  # unused slots never win
    log_probs = torch.log_softmax(torch.randn(batch, beam, vocab, generator=g, dtype=torch.float64), -1)
    k = 2 * beam
    best, from_beam, token = beam_step(scores, log_probs, k)
    for b in range(batch):
        everything = sorted(((float(scores[b, i] + log_probs[b, i, t]), i, t)
                             for i in range(beam) for t in range(vocab)), reverse=True)
        assert [round(s, 9) for s, _, _ in everything[:k]] == [round(float(x), 9) for x in best[b]]
        for rank in range(k):  # each winner is the pair it says it is
            i, t = int(from_beam[b, rank]), int(token[b, rank])
            assert float(scores[b, i] + log_probs[b, i, t]) == pytest.approx(float(best[b, rank]))
    assert set(from_beam[0].tolist()) <= {0, 1}


@pytest.mark.parametrize("seed", range(5))
def test_best_extensions_from_each_beams_top_tokens_equal_beam_step_over_everything(seed):
    g = torch.Generator().manual_seed(seed)
    batch, beam, vocab = 4, 4, 50
    scores = torch.randn(batch, beam, generator=g, dtype=torch.float64)
    scores[0, 1:] = -torch.inf  # the first step: one real beam supplies all k winners
    scores[1, 2] = 100.0  # one beam far ahead supplies all of them too
    log_probs = torch.log_softmax(torch.randn(batch, beam, vocab, generator=g, dtype=torch.float64), -1)
    for k in (1, 2 * beam, 3 * beam):
        expected = beam_step(scores, log_probs, k)
        found = best_extensions(scores, log_probs, k)
        for want, got in zip(expected, found, strict=True):
            assert torch.equal(want, got)
    assert set(found[1][1].tolist()) == {2}
    small = log_probs[..., :3]  # fewer tokens than k: every token of every beam competes
    (want_best, *want_pairs), (got_best, *got_pairs) = beam_step(scores, small, 5), best_extensions(scores, small, 5)
    assert torch.equal(want_best, got_best)
    real = want_best > -torch.inf  # the -inf places of the first row are ties, in any order
    assert all(torch.equal(want[real], got[real]) for want, got in zip(want_pairs, got_pairs, strict=True))


# --- subwords and batches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(real_data):
    src, tgt = load_split("train", "de", "en", real_data, progress=False)
    return SubwordTokenizer.train(src + tgt, 8000)


def test_subwords_give_back_every_line_of_every_split_exactly(tokenizer, real_data):
    for split in ("train", "val", "test_2016_flickr"):
        for src_lang, tgt_lang in (("de", "en"), ("fr", "en")):
            for lines in load_split(split, src_lang, tgt_lang, real_data, progress=False):
                decoded = tokenizer.decode(tokenizer.encode(lines))
                wrong = [(a, b) for a, b in zip(lines, decoded, strict=True) if a != b]
                assert not wrong, f"{split}: {len(wrong)} lines change, e.g. {wrong[0]}"
    assert tokenizer.vocab_size == 8000
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)


def test_tokenizer_is_trained_reproducibly_and_its_fingerprint_tells_vocabularies_apart(tokenizer, real_data):
    src, tgt = load_split("train", "de", "en", real_data, progress=False)
    again = SubwordTokenizer.train(src + tgt, 8000)
    assert again.fingerprint == tokenizer.fingerprint
    assert SubwordTokenizer.from_json(tokenizer.to_json()).fingerprint == tokenizer.fingerprint
    assert SubwordTokenizer.train(src[:2000] + tgt[:2000], 1000).fingerprint != tokenizer.fingerprint


def test_token_batches_cover_every_pair_once_within_the_budget_and_follow_the_seed(tokenizer, real_data):
    src, tgt = load_split("val", "de", "en", real_data, progress=False)
    data = encode_pairs(tokenizer, src, tgt, max_len=20)
    assert data.truncated == sum(len(s) > 20 for s in tokenizer.encode(src)) + sum(
        len(t) > 18 for t in tokenizer.encode(tgt))
    assert data.truncated > 0 and max(len(s) for s in data.src) == 20 and max(len(t) for t in data.tgt) == 18
    batches = token_batches(data, 700, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    for b in batches:
        src_t, tgt_t = collate(data, b, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)
        assert src_t.shape[0] * max(src_t.shape[1], tgt_t.shape[1]) <= 700
        assert (tgt_t[:, 0] == tokenizer.bos_id).all()
        for row, i in enumerate(b):  # each target is <s> ... </s> then padding
            assert tgt_t[row, 1:len(data.tgt[i]) + 2].tolist() == [*data.tgt[i], tokenizer.eos_id]
    assert token_batches(data, 700, seed=3, epoch=0) == batches
    assert token_batches(data, 700, seed=3, epoch=1) != batches
    assert token_batches(data, 700, seed=4, epoch=0) != batches
    # Length buckets: a batch's sentences have similar lengths, so little of it is padding.
    padded = sum(len(b) * max(max(len(data.src[i]), len(data.tgt[i]) + 2) for i in b) for b in batches)
    real = sum(max(len(s), len(t) + 2) for s, t in zip(data.src, data.tgt, strict=True))
    assert real / padded > 0.9
    with pytest.raises(ValueError, match="longest"):
        token_batches(data, 10, seed=0, epoch=0)


# --- decoding -------------------------------------------------------------------------------


def random_model(seed: int, vocab: int = 13, kv_heads: int | None = None, fast: bool = False) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig.original(vocab, d_model=16, heads=4, layers=2, d_ff=24, dropout=0.1, tie_embeddings=True,
                                  placement="pre" if seed % 2 == 0 else "post", kv_heads=kv_heads, fast=fast)
    model = configured_transformer(config, pad_id=0).double()
    # Sharper output distributions than at initialisation, so that hypotheses differ clearly.
    with torch.no_grad():
        model.generator.weight.mul_(8)
    return model.eval()


def random_sources(seed: int, vocab: int = 13, batch: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab, (batch, 7), generator=g)
    for row in range(batch):  # pairwise different lengths, padded with 0
        src[row, 7 - row:] = 0
    return src


@pytest.mark.parametrize(("seed", "kv_heads", "fast"), [(0, None, False), (1, 2, False), (2, None, True)])
def test_cached_decoding_gives_the_same_translations_as_recomputing(seed, kv_heads, fast):
    model, src = random_model(seed, kv_heads=kv_heads, fast=fast), random_sources(seed)
    for beam in (1, 3):
        search = greedy_search if beam == 1 else beam_search
        extra = {} if beam == 1 else {"beam": beam, "length_penalty": 0.6}
        cached = search(model, src, 1, 2, max_len_a=1.0, max_len_b=4, use_cache=True, **extra)
        recomputed = search(model, src, 1, 2, max_len_a=1.0, max_len_b=4, use_cache=False, **extra)
        assert cached == recomputed


def test_greedy_search_equals_chapter_08s_generate():
    model, src = random_model(3), random_sources(3)
    ours = greedy_search(model, src, 1, 2, max_len_a=0.0, max_len_b=6)
    tokens, _ = generate(model, src, 6, 1, 2)
    theirs = [[t for t in row[1:] if t not in (0,)] for row in tokens.tolist()]
    theirs = [row[:row.index(2)] if 2 in row else row for row in theirs]
    assert ours == theirs


@torch.no_grad()
def exhaustive_best(model, src_row, eos, max_new, vocab, alpha):
    """The best finished hypothesis of at most ``max_new`` tokens by score / length^alpha, found by trying all."""
    src = src_row[None]
    best = (-math.inf, None)
    for length in range(1, max_new + 1):
        for body in itertools.product(range(3, vocab), repeat=length - 1):
            ended = length < max_new  # at the cap, a hypothesis may end without </s>
            for last in ([eos] if ended else [eos, *range(3, vocab)]):
                seq = [*body, last]
                tgt = torch.tensor([[1, *seq]])
                log_probs = torch.log_softmax(model(src, tgt[:, :-1]), -1)[0]
                score = float(sum(log_probs[i, t] for i, t in enumerate(seq)))
                normalised = score / length**alpha
                if normalised > best[0]:
                    best = (normalised, [t for t in seq if t != eos])
    return best[1]


@pytest.mark.parametrize("seed", range(3))
def test_beam_search_as_wide_as_all_hypotheses_finds_the_exhaustive_best(seed):
    """A beam as wide as the whole search space keeps every hypothesis: it must find the true best."""
    vocab, max_new, alpha = 6, 3, 0.7
    model = random_model(seed + 10, vocab=vocab)
    with torch.no_grad():
        model.generator.bias[0] = -1e4  # no padding or <s> output: only the words and </s> compete
        model.generator.bias[1] = -1e4
    src = random_sources(seed, vocab=vocab, batch=2)
    found = beam_search(model, src, 1, 2, beam=(vocab - 2) ** max_new, length_penalty=alpha, max_len_a=0.0,
                        max_len_b=max_new)
    for row in range(src.shape[0]):
        assert found[row] == exhaustive_best(model, src[row][src[row] != 0], 2, max_new, vocab, alpha)


# --- training -------------------------------------------------------------------------------


def run_cli(*args, check=True, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, env=env, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


TINY = ["--preset", "tiny", "--no-progress", "--set", "eval_every=1000", "--set", "max_tokens=1024"]


def weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.mark.slow
def test_every_preset_builds_the_parameters_that_checkpoints_written_before_the_composition_hold():
    """Checkpoints keep loading: the names and shapes of every preset's parameters as commit 56c7c49 built them
    (chapter 08's Transformer built from its keyword arguments) are the ones the composed model has."""
    before = json.loads((ROOT / "tests" / "fixtures" / "translator_state_56c7c49.json").read_text(encoding="utf-8"))
    for name, shapes in before["presets"].items():
        model = build_model(preset(name), before["vocab"], 0)
        assert {key: list(value.shape) for key, value in model.state_dict().items()} == shapes, name


def test_a_killed_run_resumes_to_the_same_weights(tmp_path, real_data):
    args = [*TINY, "--steps", "30", "--set", "checkpoint_every=5", "--data-dir", str(real_data)]
    run_cli("train", "--out", str(tmp_path / "whole"), *args)
    killed = tmp_path / "killed"
    process = subprocess.Popen([*CLI, "train", "--out", str(killed), *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step_0000015.pt").exists() and process.poll() is None:
        assert time.time() < deadline, "the run wrote no checkpoint in two minutes"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "averaged.pt").exists(), "the run finished before it could be killed"
    newest = sorted((killed / "checkpoints").glob("step_*.pt"))[-1]
    assert 15 <= int(newest.stem.split("_")[1]) < 30
    run_cli("train", "--out", str(killed), *args, "--resume")
    final_whole = weights(tmp_path / "whole" / "checkpoints" / "step_0000030.pt")
    final_resumed = weights(killed / "checkpoints" / "step_0000030.pt")
    for name, value in final_whole.items():
        torch.testing.assert_close(final_resumed[name], value, rtol=0, atol=1e-6, msg=name)
    # The log holds each step once, as if the run had never stopped.
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))
    # Without --resume an existing run is not overwritten.
    refused = run_cli("train", "--out", str(killed), *args, check=False)
    assert refused.returncode == 2 and "--resume" in refused.stderr


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one_on_the_same_global_batch(tmp_path, real_data):
    args = [*TINY, "--steps", "6", "--set", "model.dropout=0", "--set", "checkpoint_every=1000",
            "--data-dir", str(real_data)]
    run_cli("train", "--out", str(tmp_path / "one"), *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "stepformer.translator.cli", "train", "--out", str(tmp_path / "two"), *args]
    result = subprocess.run(torchrun, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    def logged(run, key):
        return [json.loads(line)[key] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    one, two = logged("one", "loss"), logged("two", "loss")
    assert len(one) == len(two) == 6
    assert one[-1] < one[0]  # it learns
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    # Adam hides a wrong gradient scale (it divides it out): the gradients' norm does not.
    for a, b in zip(logged("one", "grad_norm"), logged("two", "grad_norm"), strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    # Adam magnifies float32 rounding in near-zero gradients, so the weights agree less closely.
    for name, value in weights(tmp_path / "one" / "averaged.pt").items():
        torch.testing.assert_close(weights(tmp_path / "two" / "averaged.pt")[name], value, rtol=1e-3, atol=2e-4)


@pytest.mark.slow
def test_train_evaluate_translate_from_the_command_line(tmp_path, real_data):
    out = tmp_path / "run"
    run_cli("train", "--out", str(out), *TINY, "--steps", "120", "--set", "eval_every=60",
            "--set", "eval_sentences=20", "--data-dir", str(real_data))
    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "curves.png", "averaged.pt"):
        assert (out / name).is_file(), name
    evaluations = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                   if "val_bleu" in line]
    assert [e["step"] for e in evaluations] == [60, 120]
    # The rate each step used is the schedule's, cooldown included.
    config = preset("tiny").with_overrides({"max_steps": "120"})
    logged_rates = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()
                    if '"loss"' in line]
    assert logged_rates == pytest.approx([scheduled_lr(config, s, (s - 1) / 120) for s in range(1, 121)], rel=1e-12)
    assert evaluations[1]["val_loss"] < evaluations[0]["val_loss"]
    results = tmp_path / "results.jsonl"
    hyps = tmp_path / "hyps.txt"
    printed = run_cli("evaluate", "--checkpoint", str(out / "averaged.pt"), "--split", "val", "--beam", "2",
                      "--limit", "40", "--results", str(results), "--hypotheses", str(hyps),
                      "--data-dir", str(real_data))
    result = json.loads(results.read_text())
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0" in result["bleu_signature"]
    assert result["bleu_signature"] in printed.stdout and result["chrf_signature"] in printed.stdout
    # The printed score is sacreBLEU's on the written translations against the raw references.
    import sacrebleu

    refs = load_split("val", "de", "en", real_data, progress=False)[1][:40]
    lines = hyps.read_text().splitlines()
    assert len(lines) == 40 and result["sentences"] == 40
    assert result["bleu"] == round(sacrebleu.corpus_bleu(lines, [refs]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(lines, [refs]).score, 2)
    for name, key in (("BLEU", "bleu"), ("chrF", "chrf")):
        low, high = result[f"{key}_ci95"]
        assert low <= result[key] <= high
        assert f"{name} {result[key]:.2f}, 95% interval {low:.2f}–{high:.2f}" in printed.stdout
    assert result["n_bootstrap"] == 1000 and result["bootstrap_seed"] == 12345
    assert result["train_precision"] == "float32"
    assert result["averaged"] == ["step_0000100.pt", "step_0000120.pt"]
    assert result["steps"] == 120 and result["seed"] == 1234 and result["beam"] == 2
    translated = run_cli("translate", "--checkpoint", str(out / "averaged.pt"), "Ein Hund läuft.", "Zwei Männer.")
    assert len(translated.stdout.splitlines()) == 2
    piped = run_cli("translate", "--checkpoint", str(out / "averaged.pt"), input="Ein Hund läuft.\nZwei Männer.\n")
    assert piped.stdout == translated.stdout


def test_command_line_errors_are_one_clear_line(tmp_path):
    unknown = run_cli("train", "--preset", "huge", "--out", str(tmp_path / "x"), check=False)
    assert unknown.returncode == 2 and "unknown preset 'huge'" in unknown.stderr and "tiny, cpu, gpu" in unknown.stderr
    missing_ckpt = run_cli("translate", "--checkpoint", str(tmp_path / "none.pt"), "Hallo", check=False)
    assert missing_ckpt.returncode == 2 and "no checkpoint at" in missing_ckpt.stderr
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    junk = run_cli("evaluate", "--checkpoint", str(tmp_path / "junk.pt"), check=False)
    assert junk.returncode == 2 and "not a readable checkpoint" in junk.stderr
    bad_setting = run_cli("train", "--out", str(tmp_path / "y"), "--set", "warmpu=10", check=False)
    assert bad_setting.returncode == 2 and "unknown setting 'warmpu'" in bad_setting.stderr
    same = run_cli("train", "--out", str(tmp_path / "z"), "--src", "en", "--tgt", "en", check=False)
    assert same.returncode == 2 and "both 'en'" in same.stderr
    assert "Traceback" not in unknown.stderr + missing_ckpt.stderr + junk.stderr + bad_setting.stderr + same.stderr


def test_a_checkpoint_refuses_another_vocabulary(tmp_path, tokenizer):
    from stepformer.runs import average_checkpoints, save_atomically
    from stepformer.translator.evaluate import Translator
    from stepformer.translator.model import build_model

    config = preset("tiny")
    small = SubwordTokenizer.train(["ein hund", "a dog", "zwei hunde", "two dogs"] * 50, 300)
    model = build_model(config.with_overrides({"model.vocab": "300"}), small.vocab_size, small.pad_id)
    state = {"format": 1, "config": config.with_overrides({"model.vocab": "300"}).to_dict(),
             "tokenizer": small.to_json(), "fingerprint": small.fingerprint, "model": model.state_dict(),
             "step": 1, "elapsed_s": 1.0, "commit": "test"}
    save_atomically(state, tmp_path / "a.pt")
    with pytest.raises(ValueError, match="another vocabulary"):
        Translator.load(tmp_path / "a.pt", tokenizer=tokenizer)
    assert Translator.load(tmp_path / "a.pt", tokenizer=small).tokenizer.fingerprint == small.fingerprint
    save_atomically({**state, "fingerprint": tokenizer.fingerprint}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="different vocabularies"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "avg.pt")


FORMER_SETTINGS = {  # the model's settings as checkpoints before the ModelConfig kept them (the gpu preset's)
    "vocab_size": 8000, "max_len": 128, "d_model": 256, "heads": 4, "layers": 3, "d_ff": 1024, "kv_heads": None,
    "dropout": 0.3, "norm_first": True, "activation": "relu", "fast": True,
}


def test_the_model_is_one_model_config_and_a_former_flat_config_reads_into_it():
    from stepformer.translator.config import TranslatorConfig

    gpu = preset("gpu")
    assert isinstance(gpu.model, ModelConfig) and gpu.model.dropout == 0.3 and gpu.model.placement == "pre"
    assert TranslatorConfig.from_dict(gpu.to_dict()) == gpu
    former = {**{k: v for k, v in gpu.to_dict().items() if k not in ("model", "packed_dropout")}, **FORMER_SETTINGS}
    assert TranslatorConfig.from_dict(former) == gpu
    post = TranslatorConfig.from_dict({**former, "norm_first": False, "activation": "gelu", "kv_heads": 2})
    assert (post.model.placement, post.model.ffn, post.model.kv_heads) == ("post", "gelu", 2)
    plain = TranslatorConfig.from_dict({**former, "fast": False})  # one 'fast' chose fused kernels and packed dropout
    assert (plain.model.fast, plain.packed_dropout) == (False, False)
    with pytest.raises(ValueError, match="are the model's"):
        TranslatorConfig.from_dict({**gpu.to_dict(), "d_model": 512})
    with pytest.raises(ValueError, match=r"unknown model settings \['d_modle'\]"):
        TranslatorConfig.from_dict({**gpu.to_dict(), "model": {**gpu.model.to_dict(), "d_modle": 512}})


def test_settings_of_the_model_are_set_by_model_dot_name_and_former_names_are_refused_with_the_new_one():
    config = preset("cpu").with_overrides({"model.dropout": "0.1", "model.kv_heads": "2", "warmup": "800"})
    assert (config.model.dropout, config.model.kv_heads, config.warmup) == (0.1, 2, 800)
    assert preset("cpu").with_overrides({"model.kv_heads": "None"}).model.kv_heads is None
    for former, new in (("dropout", "model.dropout"), ("norm_first", "model.placement"), ("vocab_size", "model.vocab"),
                        ("activation", "model.ffn")):
        with pytest.raises(ValueError, match=f"'{former}' is a setting of the model: {new}"):
            preset("cpu").with_overrides({former: "1"})
    with pytest.raises(ValueError, match="placement must be one of"):
        preset("cpu").with_overrides({"model.placement": "middle"})
    with pytest.raises(ValueError, match="model.heads must be a int"):
        preset("cpu").with_overrides({"model.heads": "four"})


def test_a_resumed_run_refuses_another_model_setting_by_its_name():
    from stepformer.translator.checkpoints import resumed_config

    saved = preset("cpu")
    assert resumed_config(saved, saved.with_overrides({"max_minutes": "90"})).max_minutes == 90
    with pytest.raises(ValueError, match=r"model\.d_ff: saved 1024, given 2048"):
        resumed_config(saved, saved.with_overrides({"model.d_ff": "2048"}))


def test_a_checkpoint_written_with_the_former_flat_config_loads(tmp_path):
    from stepformer.runs import save_atomically
    from stepformer.translator.evaluate import Translator

    small = SubwordTokenizer.train(["ein hund", "a dog", "zwei hunde", "two dogs"] * 50, 300)
    tiny = preset("tiny")
    former = {**{k: v for k, v in tiny.to_dict().items() if k not in ("model", "packed_dropout")}, **FORMER_SETTINGS,
              "vocab_size": 300,
              "d_model": 64, "layers": 2, "d_ff": 128, "dropout": 0.1}
    model = build_model(tiny.with_overrides({"model.vocab": "300"}), small.vocab_size, small.pad_id)
    save_atomically({"format": 1, "config": former, "tokenizer": small.to_json(), "fingerprint": small.fingerprint,
                     "model": model.state_dict(), "step": 1, "elapsed_s": 1.0, "commit": "test"}, tmp_path / "old.pt")
    loaded = Translator.load(tmp_path / "old.pt", device=torch.device("cpu"))
    assert loaded.config.model == replace(tiny.model, vocab=300)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[key], value)


def test_averaging_is_the_mean_of_the_weights(tmp_path):
    from stepformer.runs import average_checkpoints, save_atomically

    states = []
    for i in range(3):
        torch.manual_seed(i)
        states.append({"format": 1, "fingerprint": "f", "model": {"w": torch.randn(4, 3), "n": torch.tensor(i)},
                       "step": i, "optimizer": {}, "rng": {}})
        save_atomically(states[-1], tmp_path / f"step_{i}.pt")
    out = average_checkpoints([tmp_path / f"step_{i}.pt" for i in range(3)], tmp_path / "avg.pt")
    averaged = torch.load(out, weights_only=False)
    torch.testing.assert_close(averaged["model"]["w"], sum(s["model"]["w"] for s in states) / 3)
    assert averaged["step"] == 2 and "optimizer" not in averaged
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_presets_are_named_and_every_setting_is_saved():
    assert set(("tiny", "cpu", "gpu")) <= set(preset.__globals__["PRESETS"])
    cpu = preset("cpu")
    assert cpu.to_dict()["max_minutes"] == 50.0
    assert type(cpu).from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu
    with pytest.raises(ValueError, match="unknown settings"):
        type(cpu).from_dict({**cpu.to_dict(), "colour": "blue"})


def test_collate_pads_with_the_padding_id():
    data = Encoded([[5, 6, 7], [8]], [[9], [10, 11, 12]])
    src, tgt = collate(data, [0, 1], pad_id=0, bos_id=1, eos_id=2)
    assert src.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert tgt.tolist() == [[1, 9, 2, 0, 0], [1, 10, 11, 12, 2]]


def test_commit_is_dirty_for_changed_or_new_files_but_not_for_written_results(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "src").mkdir()
    (tmp_path / "book" / "results").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "book" / "results" / "r.json").write_text("{}\n")
    (tmp_path / ".gitignore").write_text("runs/\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    inside = tmp_path / "src"  # asked from a subfolder, as the package asks
    assert commit(inside) == head
    (tmp_path / "book" / "results" / "r.json").write_text('{"bleu": 1}\n')
    (tmp_path / "book" / "results" / "new.json").write_text("{}\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "ignored.pt").write_text("")
    assert commit(inside) == head, "results and ignored files are not changes to the code"
    (tmp_path / "src" / "b.py").write_text("y = 2\n")
    assert commit(inside) == head + "+dirty", "a new file that git does not ignore changes what runs"
    (tmp_path / "src" / "b.py").unlink()
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert commit(inside) == head + "+dirty"


def readme_row(r: dict) -> str:
    """The README's results row for one result of ``book/results/translator.json``, with or without an interval."""
    from stepformer.translator.evaluate import interval_text

    return (f"| {r['preset']} | {r['direction']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {interval_text(r)} | "
            f"{r.get('train_hardware', 'not recorded')} | {r['train_minutes']:.1f} min, {r['steps']:,} steps | "
            f"{r['seed']} | {r['train_commit']} |")


def test_a_readme_row_shows_the_interval_where_it_was_measured():
    row = {"preset": "gpu", "direction": "de→en", "bleu": 44.12, "chrf": 64.0, "train_hardware": "NVIDIA H100",
           "train_minutes": 4.5, "steps": 1234, "seed": 1, "train_commit": "abc1234"}
    rerun = "python benchmarks/translator_quality.py --preset gpu --directions de-en"
    assert readme_row(row).startswith(f"| gpu | de→en | 44.12 | 64.00 | interval not measured (translations not kept; "
                                      f"rerun `{rerun}`) |")
    measured = {**row, "bleu_ci95": [42.9, 45.31], "chrf_ci95": [63.1, 64.85], "n_bootstrap": 1000,
                "bootstrap_seed": 12345}
    assert readme_row(measured) == ("| gpu | de→en | 44.12 | 64.00 | 42.90–45.31 / 63.10–64.85 | NVIDIA H100 | "
                                    "4.5 min, 1,234 steps | 1 | abc1234 |")


def test_the_readme_quotes_the_results_file():
    results = json.loads((ROOT / "book" / "results" / "translator.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = [r for r in results["runs"] if r["split"] == "test_2016_flickr" and r["variant"] == "averaged, beam 4"]
    assert headline, "the results file has no test score"
    for r in headline:
        assert readme_row(r) in readme, f"README.md should have the row\n{readme_row(r)}"
        assert r["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a") and r["bleu_signature"] in readme
    measured = {(r["preset"], r["direction"]) for r in headline}
    for direction in ("de→en", "en→de"):
        if ("cpu", direction) not in measured:
            assert f"| cpu | {direction} | not measured yet |" in readme
    # The gpu preset's rows: benchmarks/gpu_run.py's results file, mean ± sd over seeds.
    gpu_file = ROOT / "book" / "results" / "gpu.json"
    gpu = gpu_rows(json.loads(gpu_file.read_text(encoding="utf-8"))) if gpu_file.is_file() else []
    for row in gpu:
        assert gpu_readme_row(row) in readme, f"README.md should have the row\n{gpu_readme_row(row)}"
        assert row["bleu_signature"] in readme
    if not gpu:
        assert "| gpu | de→en | not measured yet |" in readme
