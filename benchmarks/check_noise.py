"""The noise behind every statistical comparison in the checks, and the effect of each mistake it must catch.

    .venv/bin/python benchmarks/check_noise.py                      # all parts, about 15 minutes on one idle core
    .venv/bin/python benchmarks/check_noise.py --only entropy top_weight --seeds 300   # a quicker look

A check that compares a noisy statistic (a mean over random draws, a share of dropped units, a loss after
training) with a reference must allow for the noise, and no more: a tolerance chosen by eye can be wider than
the effect of a wrong argument. For each such comparison this script measures, under correct code, the
statistic's spread over many seeds, derives the tolerance by the rule of ``stepformer.checks._noise`` (the
correct code fails with probability below 1e-6 per check call), and measures the effect of each plausible mistake
against that tolerance. The numbers written in the checks' comments come from here; the results go to
``benchmarks/results/check_noise.json`` (``--out``), with the settings, the commit and the time taken.

Parts (``--only``):

- ``entropy``: chapter 01's ``check_entropy_measurement``, mean attention entropy, per (d_k, scale) cell;
- ``top_weight``: chapter 00's ``check_top_weight_measurement``, mean largest attention weight, per
  (d_k, additive) cell;
- ``ffn_dropout``: chapter 04's ``check_feedforward_dropout``, the share of hidden units dropped;
- ``residual_dropout``: chapter 05's ``check_residual_dropout``, the share of the sublayer's outputs dropped;
- ``memorise``: chapter 11's ``check_memorise``, the loss after 150 steps (the slow part: ``--memorise-seeds``).

Per-sample statistics are drawn in bulk (one draw of ``q_len`` queries, ``k_len`` keys and, for additive
attention, the weights, is one sample, as in the exercises); a check's value is the mean of ``samples`` of them,
so its spread is the per-sample standard deviation over sqrt(samples), which the script also confirms on the
library's own functions called with ``--seeds`` seeds. Not a test.
"""

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from stepformer.checks._noise import ALPHA, SPREAD_CALLS, SPREAD_THRESHOLD, Z, binomial_bounds, normal_tolerance  # noqa: E402

CHUNK = 2048  # samples per bulk draw


def _sd(x: torch.Tensor) -> float:
    return x.double().std(correction=1).item()


# -- entropy and top weight: means over random draws -------------------------------------------------------------

def _draw(n: int, q_len: int, k_len: int, d_k: int, g: torch.Generator, uniform: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if uniform:
        return (torch.rand(n, q_len, d_k, generator=g, dtype=torch.float64),
                torch.rand(n, k_len, d_k, generator=g, dtype=torch.float64))
    return (torch.randn(n, q_len, d_k, generator=g, dtype=torch.float64),
            torch.randn(n, k_len, d_k, generator=g, dtype=torch.float64))


def _entropy_of(weights: torch.Tensor) -> torch.Tensor:
    return -torch.where(weights > 0, weights * weights.log(), 0.0).sum(-1)


def entropy_samples(n: int, d_k: int, scale: bool, q_len: int, k_len: int, g: torch.Generator,
                    mistake: str = "correct") -> torch.Tensor:
    """Per-sample mean attention entropy (over the q_len queries), ``n`` samples, for the solution or a mistake."""
    if mistake == "keys drawn with the query count":
        k_len = q_len
    if mistake == "k_len ignored (the default 16)":
        k_len = 16
    if mistake == "scale ignored (always scaled)":
        scale = True
    if mistake == "scale inverted":
        scale = not scale
    out = []
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        q, k = _draw(m, q_len, k_len, d_k, g, uniform=mistake == "uniform draws (torch.rand)")
        divisor = 1.0
        if scale:
            divisor = d_k if mistake == "divided by d_k, not sqrt(d_k)" else math.sqrt(d_k)
        scores = q @ k.transpose(-2, -1) / divisor
        weights = torch.softmax(scores, dim=-2 if mistake == "softmax over the queries" else -1)
        entropy = _entropy_of(weights)
        if mistake == "log base 2":
            entropy = entropy / math.log(2)
        out.append(entropy.mean(-1))
    return torch.cat(out)


def top_weight_samples(n: int, d_k: int, additive: bool, q_len: int, k_len: int, d_attn: int, g: torch.Generator,
                       mistake: str = "correct", scaled: bool = False) -> torch.Tensor:
    """Per-sample mean largest weight (over the q_len queries), ``n`` samples, for the solution or a mistake."""
    if mistake == "keys drawn with the query count":
        k_len = q_len
    if mistake == "k_len ignored (the default 16)":
        k_len = 16
    if mistake == "d_attn ignored (the default 32)":
        d_attn = 32
    out = []
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        q, k = _draw(m, q_len, k_len, d_k, g, uniform=mistake == "uniform draws (torch.rand)")
        if additive:
            w_scale = 1.0 if mistake == "w_q, w_k not divided by sqrt(d_k)" else 1 / math.sqrt(d_k)
            v_scale = 1.0 if mistake == "v_a not divided by sqrt(d_attn)" else 1 / math.sqrt(d_attn)
            w_q = torch.randn(m, d_attn, d_k, generator=g, dtype=torch.float64) * w_scale
            w_k = torch.randn(m, d_attn, d_k, generator=g, dtype=torch.float64) * w_scale
            v_a = torch.randn(m, d_attn, generator=g, dtype=torch.float64) * v_scale
            if mistake == "one set of weights for all samples":
                w_q, w_k, v_a = w_q[:1].expand_as(w_q), w_k[:1].expand_as(w_k), v_a[:1].expand_as(v_a)
            query, key = q @ w_q.transpose(-2, -1), k @ w_k.transpose(-2, -1)
            hidden = torch.tanh(query[:, :, None, :] + key[:, None, :, :])  # (m, q_len, k_len, d_attn)
            scores = (hidden * v_a[:, None, None, :]).sum(-1)
        else:
            divisor = math.sqrt(d_k) if (scaled or mistake == "divided by sqrt(d_k)") else 1.0
            scores = q @ k.transpose(-2, -1) / divisor
        weights = torch.softmax(scores, dim=-2 if mistake == "softmax over the queries" else -1)
        top = weights.mean(-1) if mistake == "mean weight, not the largest" else weights.amax(-1)
        out.append(top.mean(-1))
    return torch.cat(out)


ENTROPY_MISTAKES = ("keys drawn with the query count", "k_len ignored (the default 16)",
                    "scale ignored (always scaled)", "scale inverted", "divided by d_k, not sqrt(d_k)",
                    "uniform draws (torch.rand)", "log base 2",
                    "softmax over the queries")
TOP_WEIGHT_MISTAKES = ("keys drawn with the query count", "k_len ignored (the default 16)", "divided by sqrt(d_k)",
                       "d_attn ignored (the default 32)", "w_q, w_k not divided by sqrt(d_k)",
                       "v_a not divided by sqrt(d_attn)", "mean weight, not the largest", "uniform draws (torch.rand)",
                       "softmax over the queries", "one set of weights for all samples")
# Mistakes that move no cell's expected value: they change only how noisy the mean is. The means do not depend
# on q_len or samples (every query and every sample is drawn alike); the check calls with other values where
# the answer is exact (k_len = 1) or compares the spread of single draws to see that they are used.
SAME_MEAN = ("q_len ignored (the default 16)", "samples ignored (the default 64)", "seed ignored")


def measure_means(name: str, cells: list[tuple[int, bool]], sampler: Callable[..., torch.Tensor],
                  mistakes: tuple[str, ...], library: Callable[..., float], reference: Callable[..., float],
                  settings: dict, seeds: int, bulk: int) -> dict:
    """Per cell: the per-sample spread, the spread of (check value - fresh reference) under the library's own
    function over ``seeds`` seeds, the tolerance by the rule, and each mistake's effect on the expected value."""
    samples, reference_samples = settings["samples"], settings["reference_samples"]
    g = torch.Generator().manual_seed(1234)
    results = {"settings": settings, "cells": {}}
    comparisons = len(cells)
    for d_k, flag in cells:
        correct = sampler(bulk, d_k, flag, g)
        mean, sd1 = correct.mean().item(), _sd(correct)
        sd_value, sd_reference = sd1 / math.sqrt(samples), sd1 / math.sqrt(reference_samples)
        sd_diff = math.hypot(sd_value, sd_reference)
        tolerance = normal_tolerance(sd_diff, comparisons)
        started = time.perf_counter()
        diffs = torch.tensor([library(d_k, flag, seed) - reference(d_k, flag, seed) for seed in range(seeds)])
        library_seconds = time.perf_counter() - started
        effects = {}
        for mistake in mistakes:
            wrong = sampler(bulk, d_k, flag, g, mistake=mistake)
            effect = wrong.mean().item() - mean
            sd_wrong = math.hypot(_sd(wrong) / math.sqrt(samples), sd_reference)
            # Caught with probability above 1 - 1e-6 when the effect exceeds the tolerance by Z of the
            # mistake's own spread (one-sided, so a little more than needed).
            margin = (abs(effect) - tolerance) / sd_wrong if sd_wrong > 0 else math.inf
            effects[mistake] = {"effect": effect, "sd_of_difference": sd_wrong, "margin_in_sd": margin,
                                "caught": margin >= Z}
        key = f"d_k={d_k}, {name}={flag}"
        results["cells"][key] = {
            "mean": mean, "sd_per_sample": sd1, "sd_value": sd_value, "sd_reference": sd_reference,
            "sd_difference": sd_diff, "tolerance": tolerance,
            "library": {"seeds": seeds, "mean_difference": diffs.mean().item(), "sd_difference": _sd(diffs),
                        "largest_abs_difference": diffs.abs().max().item(),
                        "largest_in_sd": (diffs.abs().max() / sd_diff).item(), "seconds": library_seconds},
            "mistakes": effects,
        }
        print(f"  {key:24s} mean {mean:.4f}  sd/sample {sd1:.4f}  sd(value - ref) {sd_diff:.4f} "
              f"(library over {seeds} seeds: {_sd(diffs):.4f}, largest {diffs.abs().max().item():.4f})  "
              f"tolerance {tolerance:.4f}", flush=True)
        for mistake, e in effects.items():
            print(f"      {mistake:42s} effect {e['effect']:+.4f}  margin {e['margin_in_sd']:6.1f} sd  "
                  f"{'caught' if e['caught'] else '-'}", flush=True)
    caught = {m: [c for c, r in results["cells"].items() if r["mistakes"][m]["caught"]] for m in mistakes}
    results["caught_by"] = caught
    results["same_mean"] = list(SAME_MEAN)
    return results


def part_entropy(seeds: int, bulk: int) -> dict:
    from stepformer.attention import mean_attention_entropy

    q_len, k_len, samples, reference_samples = 12, 9, 48, 256  # check_entropy_measurement's values

    def sampler(n: int, d_k: int, scale: bool, g: torch.Generator, mistake: str = "correct") -> torch.Tensor:
        return entropy_samples(n, d_k, scale, q_len, k_len, g, mistake)

    def library(d_k: int, scale: bool, seed: int) -> float:
        return mean_attention_entropy(d_k, scale=scale, q_len=q_len, k_len=k_len, samples=samples, seed=seed)

    def reference(d_k: int, scale: bool, seed: int) -> float:
        # The check's fresh sample, with its generator (seed + 7).
        g = torch.Generator().manual_seed(seed + 7)
        q = torch.randn(reference_samples, q_len, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(reference_samples, k_len, d_k, generator=g, dtype=torch.float64)
        scores = q @ k.transpose(-2, -1) / (math.sqrt(d_k) if scale else 1.0)
        return torch.distributions.Categorical(logits=scores).entropy().mean().item()

    settings = {"q_len": q_len, "k_len": k_len, "samples": samples, "reference_samples": reference_samples,
                "bulk_samples": bulk}
    cells = [(d_k, scale) for d_k in (4, 64, 256) for scale in (True, False)]
    results = measure_means("scale", cells, sampler, ENTROPY_MISTAKES, library, reference, settings, seeds, bulk)
    results["single_draws"] = single_draw_spread(lambda n, g: entropy_samples(n, 4, False, 1, 2, g), "entropy")
    return results


def part_top_weight(seeds: int, bulk: int) -> dict:
    from stepformer.before import mean_top_weight
    from stepformer.checks.before import _reference_top_weight

    q_len, k_len, d_attn, samples, reference_samples = 20, 5, 12, 48, 256  # check_top_weight_measurement's

    def sampler(n: int, d_k: int, additive: bool, g: torch.Generator, mistake: str = "correct") -> torch.Tensor:
        return top_weight_samples(n, d_k, additive, q_len, k_len, d_attn, g, mistake)

    def library(d_k: int, additive: bool, seed: int) -> float:
        return mean_top_weight(d_k, additive=additive, q_len=q_len, k_len=k_len, d_attn=d_attn, samples=samples,
                               seed=seed)

    def reference(d_k: int, additive: bool, seed: int) -> float:
        return _reference_top_weight(d_k, additive, q_len, k_len, d_attn, torch.Generator().manual_seed(seed + 11),
                                     samples=reference_samples)

    settings = {"q_len": q_len, "k_len": k_len, "d_attn": d_attn, "samples": samples,
                "reference_samples": reference_samples, "bulk_samples": bulk}
    cells = [(d_k, additive) for d_k in (4, 64, 256) for additive in (False, True)]
    results = measure_means("additive", cells, sampler, TOP_WEIGHT_MISTAKES, library, reference, settings, seeds, bulk)
    # The hint "you divided by sqrt(d_k)" compares with the scaled dot product's mean: its spread, per d_k.
    g = torch.Generator().manual_seed(99)
    scaled = {}
    for d_k in (4, 64, 256):
        values = top_weight_samples(bulk, d_k, False, q_len, k_len, d_attn, g, scaled=True)
        sd_diff = math.hypot(_sd(values) / math.sqrt(samples), _sd(values) / math.sqrt(reference_samples))
        scaled[f"d_k={d_k}"] = {"mean": values.mean().item(), "sd_difference": sd_diff,
                                "tolerance": normal_tolerance(sd_diff, 6)}
    results["scaled_hint"] = scaled
    results["single_draws"] = single_draw_spread(lambda n, g: top_weight_samples(n, 4, False, 1, 2, 2, g),
                                                 "top weight")
    return results


def single_draw_spread(draw: Callable[[int, torch.Generator], torch.Tensor], what: str,
                       calls: int = SPREAD_CALLS, repetitions: int = 20000) -> dict:
    """The argument check for samples and seed: ``calls`` calls with samples = 1, q_len = 1 and k_len = 2 at
    different seeds are single draws, and their sample standard deviation is near the single-draw one (sd1). A
    function that ignores samples returns means of 64 draws (the default), whose spread is sd1 / 8; one that
    ignores seed returns one value ``calls`` times. The statistic is (sample sd of the calls) / sd1; its lower
    tail under correct code and its upper tail when samples is ignored, over many repetitions, bound the
    threshold. (A function that ignores q_len alone is not caught this way: one draw's queries share their keys,
    and their mean is hardly less spread, a ratio of 0.43 ± 0.03 in the same simulation.)"""
    g = torch.Generator().manual_seed(4321)
    pool = draw(repetitions * calls, g)
    sd1 = _sd(pool)
    correct = pool.reshape(repetitions, calls).std(-1) / sd1
    picks = torch.randint(0, len(pool), (repetitions // 10, calls, 64), generator=g)
    ignored = pool[picks].mean(-1).std(-1) / sd1
    result = {"calls": calls, "repetitions": repetitions, "sd_single": sd1, "threshold": SPREAD_THRESHOLD,
              "correct": {"mean": correct.mean().item(), "sd": _sd(correct), "min": correct.min().item(),
                          "low_bound": correct.mean().item() - Z * _sd(correct)},
              "samples_ignored": {"mean": ignored.mean().item(), "sd": _sd(ignored), "max": ignored.max().item(),
                                  "high_bound": ignored.mean().item() + Z * _sd(ignored)}}
    print(f"  single draws ({what}): sd1 {sd1:.4f}; sd of {calls} calls / sd1: correct {correct.mean().item():.3f} "
          f"± {_sd(correct):.3f} (min {correct.min().item():.3f}, mean - z·sd {result['correct']['low_bound']:.3f}); "
          f"samples ignored {ignored.mean().item():.3f} ± {_sd(ignored):.3f} (max {ignored.max().item():.3f}, "
          f"mean + z·sd {result['samples_ignored']['high_bound']:.3f}); threshold {SPREAD_THRESHOLD}", flush=True)
    return result


# -- dropout shares: binomial counts -----------------------------------------------------------------------------

def _rate_mistakes(n: int, p: float, low: int, high: int) -> dict:
    """Drop rates that a mistake with the right scale 1/(1 - p) gives (only the rate is left to the share check),
    and how many of their own binomial standard deviations they lie beyond the allowed interval."""
    rates = {"1 - p (a hand-made keep mask inverted)": 1 - p, "2p": 2 * p, "p / 2": p / 2}
    found = {}
    for name, rate in rates.items():
        sd = math.sqrt(rate * (1 - rate) / n)
        beyond = (rate * n - high) / (sd * n) if rate > p else (low - rate * n) / (sd * n)
        found[name] = {"rate": rate, "beyond_bound_in_sd": beyond, "caught": beyond >= Z}
    return found


def part_ffn_dropout(seeds: int) -> dict:
    from stepformer.checks.ffn import ACTIVATIONS, _ffn_state, _input, _oracle_layer, _reaching_linear2, _sizes
    from stepformer.ffn import FeedForward

    p = 0.25
    results = {"p": p, "cases": {}}
    for check_seed in (0, 303):  # the notebook's calls
        base = _sizes(check_seed)
        s = {"batch": 12, "seq": 10, "d_model": base["d_ff"], "d_ff": base["d_model"]}
        x = _input(s, check_seed, torch.float64)
        for activation in ACTIVATIONS:
            layer = _oracle_layer(s, activation, check_seed, torch.float64)
            module = FeedForward(s["d_model"], s["d_ff"], activation=activation, dropout=p).double()
            module.load_state_dict(_ffn_state(layer))
            module.eval()
            with torch.no_grad():
                reference = module(x)
                hidden, _ = _reaching_linear2(layer, reference)
                live = hidden.abs() > 1e-3
                n = int(live.sum())
                module.train()
                shares = []
                for seed in range(seeds):
                    torch.manual_seed(seed)
                    reached, _ = _reaching_linear2(layer, module(x))
                    shares.append((reached[live].abs() <= 1e-8 * (1 + hidden.abs().max())).double().mean().item())
            key = f"seed={check_seed}, {activation}"
            results["cases"][key] = _share_case(shares, n, p, "live_units", key, comparisons=len(ACTIVATIONS))
    return results


def _share_case(shares: list[float], n: int, p: float, units: str, key: str, comparisons: int = 2) -> dict:
    """The spread of the dropped share over the seeds against the check's binomial interval, printed and returned;
    ``comparisons``: how many such shares one call of the check compares (they share its ALPHA)."""
    shares_t = torch.tensor(shares)
    low, high = binomial_bounds(n, p, ALPHA / comparisons)
    case = {
        units: n, "mean_share": shares_t.mean().item(), "sd_share": _sd(shares_t),
        "binomial_sd": math.sqrt(p * (1 - p) / n), "min_share": shares_t.min().item(),
        "max_share": shares_t.max().item(), "bounds": [low / n, high / n],
        "mistakes": _rate_mistakes(n, p, low, high),
    }
    print(f"  {key}: {n} {units.replace('_', ' ')}, share over {len(shares)} seeds {case['mean_share']:.3f} "
          f"± {case['sd_share']:.3f} (binomial {case['binomial_sd']:.3f}), range {case['min_share']:.3f}.."
          f"{case['max_share']:.3f}; allowed {low / n:.3f}..{high / n:.3f}", flush=True)
    _print_rates(case["mistakes"])
    return case


def _print_rates(mistakes: dict) -> None:
    for name, e in mistakes.items():
        print(f"      drops {name:40s} {e['rate']:.3f}: {e['beyond_bound_in_sd']:5.1f} sd beyond the interval "
              f"{'caught' if e['caught'] else '-'}", flush=True)


def part_residual_dropout(seeds: int) -> dict:
    from stepformer.checks.norms import DROPOUT_P, _Identity, _mlp, _sizes
    from stepformer.norms import Residual

    p = DROPOUT_P
    results = {"p": p, "cases": {}}
    for check_seed in (0, 808):
        s = _sizes(check_seed)
        x = torch.randn(16, s["seq"], s["d_model"], generator=torch.Generator().manual_seed(check_seed + 9),
                        dtype=torch.float64)  # the check's batch of 16 sentences in training
        for norm_first in (False, True):
            module = Residual(s["d_model"], _mlp(s["d_model"], check_seed + 3), dropout=p, norm_first=norm_first)
            module.norm = _Identity()
            module.train()
            n = x.numel()
            shares = []
            with torch.no_grad():
                for seed in range(seeds):
                    torch.manual_seed(seed)
                    shares.append(((module(x) - x).abs() <= 1e-12).double().mean().item())
            key = f"seed={check_seed}, norm_first={norm_first}"
            results["cases"][key] = _share_case(shares, n, p, "entries", key)
    return results


# -- memorise: the loss after training ---------------------------------------------------------------------------

def part_memorise(seeds: int) -> dict:
    """The final loss of memorise over model and data seeds, for the recipe and for the variants the fixtures
    grade (a train_step or schedule mistake that still memorises must pass; one that cannot learn must fail)."""
    from stepformer.checks.translator import _MEMORISE, _PAD, _memorise_batch, _memorise_model
    from stepformer.translator import recipe

    def schedule(step: int, peak_lr: float, warmup: int) -> float:
        return recipe.inverse_sqrt_lr(step, peak_lr, warmup)

    def one_over_step(step: int, peak_lr: float, warmup: int) -> float:  # fixture lr_decays_as_one_over_step
        return peak_lr * min(step / warmup, warmup / step)

    def run(seed: int, *, lr_fn: Callable = schedule, set_lr: bool = True, zero_grad: bool = True,
            step: bool = True) -> float:
        _, _, src, tgt = _memorise_batch(seed)
        model = _memorise_model(seed)
        optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.98))
        loss = math.nan
        for s in range(1, _MEMORISE["steps"] + 1):
            if set_lr:
                for group in optimizer.param_groups:
                    group["lr"] = lr_fn(s, _MEMORISE["peak_lr"], _MEMORISE["warmup"])
            logits = model(src, tgt[:, :-1])
            value = recipe.label_smoothed_loss(logits, tgt[:, 1:], _PAD, 0.0)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step:
                optimizer.step()
            if zero_grad:
                optimizer.zero_grad(set_to_none=True)
            loss = value.item()
        return loss

    variants = {
        "recipe (correct)": ({}, seeds, "pass"),
        "lr never set: AdamW's default 1e-3 (fixture lr_not_set)": ({"set_lr": False}, max(seeds // 2, 3), "pass"),
        "lr decays as 1/step (fixture lr_decays_as_one_over_step)": ({"lr_fn": one_over_step}, max(seeds // 2, 3),
                                                                       "pass"),
        "gradients never cleared": ({"zero_grad": False}, max(seeds // 4, 3), "either"),
        "optimizer.step() missing": ({"step": False}, 3, "fail"),
    }
    results = {"steps": _MEMORISE["steps"], "variants": {}}
    for name, (options, count, verdict) in variants.items():
        started = time.perf_counter()
        losses = torch.tensor([run(seed, **options) for seed in range(count)], dtype=torch.float64)
        logs = losses.log10()
        results["variants"][name] = {
            "seeds": count, "verdict": verdict, "losses": losses.tolist(), "largest": losses.max().item(),
            "smallest": losses.min().item(), "log10_mean": logs.mean().item(), "log10_sd": _sd(logs),
            "log10_bound": logs.mean().item() + Z * _sd(logs), "seconds": time.perf_counter() - started,
        }
        print(f"  {name}: over {count} seeds final loss {losses.min().item():.2e}..{losses.max().item():.2e}; "
              f"log10 {logs.mean().item():.2f} ± {_sd(logs):.2f}, "
              f"upper bound 10^{logs.mean().item() + Z * _sd(logs):.2f} = "
              f"{10 ** (logs.mean().item() + Z * _sd(logs)):.3g}", flush=True)
    return results


# -- main ---------------------------------------------------------------------------------------------------------

PARTS = ("entropy", "top_weight", "ffn_dropout", "residual_dropout", "memorise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=PARTS, default=list(PARTS))
    parser.add_argument("--seeds", type=int, default=1000, help="seeds for the library's own functions")
    parser.add_argument("--bulk", type=int, default=50_000, help="per-sample draws per cell and mistake")
    parser.add_argument("--memorise-seeds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "check_noise.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = dict(previous.get("parts", {}))
    for part in args.only:
        print(f"{part}:", flush=True)
        t = time.perf_counter()
        if part == "entropy":
            results[part] = part_entropy(args.seeds, args.bulk)
        elif part == "top_weight":
            results[part] = part_top_weight(args.seeds, args.bulk)
        elif part == "ffn_dropout":
            results[part] = part_ffn_dropout(args.seeds)
        elif part == "residual_dropout":
            results[part] = part_residual_dropout(args.seeds)
        else:
            results[part] = part_memorise(args.memorise_seeds)
        results[part]["seconds"] = time.perf_counter() - t
        results[part]["commit"] = commit
    report = {
        "rule": {"z": Z, "text": "tolerance = z · sd, z chosen so that a normal difference exceeds it with "
                                 "probability below 1e-6 over all of a check's comparisons; shares: the exact "
                                 "binomial interval with tails below 1e-6"},
        "parts": results,
        "provenance": {"commit": commit, "python": platform.python_version(), "torch": torch.__version__,
                       "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
                       "wall_seconds": time.perf_counter() - started},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
