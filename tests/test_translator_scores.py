"""Chapter 11's statistics: every score with sacreBLEU's bootstrap 95% interval, the summary of runs
that differ only in their seed, and how a results row is shown with and without an interval."""

import os
import random
import statistics

import pytest
import sacrebleu

from stepformer.translator.evaluate import (
    interval95,
    interval_text,
    rerun_command,
    scores,
    seed_summary,
    seed_summary_text,
)

WORDS = ("a man woman dog child in on the red blue shirt is are running sitting standing near street water "
         "ball grass two three people with of at playing holding looking black white small large").split()


def corpus(sentences: int, seed: int) -> tuple[list[str], list[str]]:
    """References of 6 to 15 random words, and hypotheses that get about a quarter of each one's words wrong."""
    rng = random.Random(seed)
    references = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 15))) + "." for _ in range(sentences)]
    hypotheses = [" ".join(w if rng.random() > 0.25 else rng.choice(WORDS) for w in r[:-1].split()) + "."
                  for r in references]
    return hypotheses, references


@pytest.mark.parametrize("metric", ["bleu", "chrf"])
def test_the_interval_holds_the_score_and_is_sacrebleus_own(metric, monkeypatch):
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)
    hypotheses, references = corpus(400, seed=1)
    low, high = interval95(metric, hypotheses, references)
    score = {"bleu": sacrebleu.corpus_bleu, "chrf": sacrebleu.corpus_chrf}[metric](hypotheses, [references]).score
    assert low <= score <= high, f"the corpus score {score:.2f} lies outside its interval [{low}, {high}]"
    assert 0 < high - low < 20
    # The same numbers sacreBLEU prints as "μ = ... ± ..." with its default seed, 12345.
    kind = {"bleu": sacrebleu.metrics.BLEU, "chrf": sacrebleu.metrics.CHRF}[metric]()
    own = kind.corpus_score(hypotheses, [references], n_bootstrap=1000)
    assert [low, high] == [round(own._mean - own._ci, 2), round(own._mean + own._ci, 2)]


def test_the_interval_follows_its_seed_and_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)
    hypotheses, references = corpus(300, seed=2)
    first = interval95("bleu", hypotheses, references, seed=7)
    assert interval95("bleu", hypotheses, references, seed=7) == first, "the same seed must draw the same test sets"
    assert interval95("bleu", hypotheses, references, seed=8) != first
    assert "SACREBLEU_SEED" not in os.environ
    monkeypatch.setenv("SACREBLEU_SEED", "99")
    interval95("bleu", hypotheses, references, seed=7)
    assert os.environ["SACREBLEU_SEED"] == "99"


def test_the_interval_narrows_as_the_test_set_grows():
    hypotheses, references = corpus(1600, seed=3)
    low_small, high_small = interval95("bleu", hypotheses[:100], references[:100])
    low_large, high_large = interval95("bleu", hypotheses, references)
    # The width falls as one over the square root of the sentences: about 4x from 100 to 1,600.
    assert (high_large - low_large) < 0.5 * (high_small - low_small)


def test_scores_keep_the_plain_corpus_score_and_its_signature_beside_the_intervals():
    hypotheses, references = corpus(200, seed=4)
    result = scores(hypotheses, references, "en", n_bootstrap=200, seed=5)
    assert result["bleu"] == round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2)
    assert result["bleu_signature"] == "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"
    assert result["bleu_ci95"] == interval95("bleu", hypotheses, references, 200, 5)
    assert result["chrf_ci95"] == interval95("chrf", hypotheses, references, 200, 5)
    assert result["n_bootstrap"] == 200 and result["bootstrap_seed"] == 5
    with pytest.raises(ValueError, match="at least 2"):
        interval95("bleu", hypotheses, references, n_bootstrap=1)


def test_seed_summary_is_the_mean_and_the_sample_standard_deviation():
    bleus = [44.0, 44.5, 43.6]
    summary = seed_summary(bleus)
    assert summary == {"mean": round(statistics.mean(bleus), 2), "sd": round(statistics.stdev(bleus), 2), "n": 3}
    assert summary["sd"] == 0.45, "the sample standard deviation divides by n - 1, not by n"
    assert seed_summary_text(summary) == "44.03 ± 0.45 (mean ± sd of 3 seeds)"
    assert seed_summary([42.5]) == {"mean": 42.5, "sd": None, "n": 1}
    assert seed_summary_text(seed_summary([42.5])) == "42.50 (one seed: no spread measured)"
    with pytest.raises(ValueError, match="no scores"):
        seed_summary([])


def test_a_row_shows_its_intervals_or_says_how_to_measure_them():
    scored = {"preset": "gpu", "direction": "de→en", "bleu": 44.1, "bleu_ci95": [42.8, 45.37], "chrf": 63.0,
              "chrf_ci95": [62.1, 63.9], "n_bootstrap": 1000, "bootstrap_seed": 12345}
    assert interval_text(scored) == "42.80–45.37 / 62.10–63.90"
    older = {"preset": "cpu", "direction": "en→de", "bleu": 40.28, "chrf": 64.15}
    assert rerun_command(older) == "python benchmarks/translator_quality.py --preset cpu --directions en-de"
    assert interval_text(older) == ("interval not measured (translations not kept; rerun "
                                    "`python benchmarks/translator_quality.py --preset cpu --directions en-de`)")
    assert interval_text(older, rerun="make it").endswith("rerun `make it`)")
