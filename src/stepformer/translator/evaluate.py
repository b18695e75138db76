"""Chapter 11: translating with a trained checkpoint, and scoring it the way results are compared today.

The score is sacreBLEU's (Post 2018): detokenized, cased output against the raw references,
its own 13a tokenization, printed with its signature so that anyone can compute the same
number. Older papers on Multi30k tokenized and lowercased both sides themselves first and ran
``multi-bleu.perl``; that number is higher and depends on their tokenizer, so it is reported
beside, labelled, for comparison only. chrF (Popović 2015) scores character n-grams, kinder to
German's long compounds.

A score of one test set is one draw: sacreBLEU's bootstrap resamples the test sentences (Koehn
2004) and gives each score a 95% interval, which every reported score carries. Runs that differ
only in their seed are summarised by the mean and sample standard deviation of their scores.
"""

import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stepformer.runs import load_checkpoint
from stepformer.transformer import Transformer
from stepformer.translator.batching import Encoded, encode_pairs
from stepformer.translator.config import TranslatorConfig, pick_device
from stepformer.translator.data import load_split
from stepformer.translator.model import build_model
from stepformer.translator.search import translate_encoded
from stepformer.translator.tokenizer import SubwordTokenizer


@dataclass
class Translator:
    """A trained model with its tokenizer and settings, ready to translate."""

    model: Transformer
    tokenizer: SubwordTokenizer
    config: TranslatorConfig
    device: torch.device
    checkpoint: dict

    @classmethod
    def load(cls, path: Path | str, device: torch.device | None = None,
             tokenizer: SubwordTokenizer | None = None) -> "Translator":
        """Load a checkpoint; with ``tokenizer``, refuse it unless it is the checkpoint's own vocabulary."""
        state = load_checkpoint(path)
        config = TranslatorConfig.from_dict(state["config"])
        own = SubwordTokenizer.from_json(state["tokenizer"])
        if tokenizer is not None and tokenizer.fingerprint != state["fingerprint"]:
            raise ValueError(f"{path} was trained with another vocabulary (fingerprint {state['fingerprint']}, "
                             f"given {tokenizer.fingerprint})")
        device = device or pick_device()
        model = build_model(config, own.vocab_size, own.pad_id)
        model.load_state_dict(state["model"])
        return cls(model.to(device).eval(), own, config, device, state)

    def translate(self, texts: list[str], beam: int | None = None, length_penalty: float | None = None,
                  use_cache: bool = True, max_tokens: int = 3000, progress: bool = False) -> list[str]:
        """Translations of ``texts``, in their order. ``beam=1`` is greedy; ``None`` takes the checkpoint's settings.

        Decoding runs in float32 whatever the training's precision: with one token per hypothesis a
        step is bound by the calls, not the arithmetic, so bf16 gains little, and float32 gives the
        same translations with and without the KV-cache (bf16 rounds the two paths differently).
        """
        beam = self.config.beam if beam is None else beam
        length_penalty = self.config.length_penalty if length_penalty is None else length_penalty
        # Targets are unknown: encode the sources twice so that batching sorts by source length.
        data = encode_pairs(self.tokenizer, texts, texts, self.config.model.max_len)
        data = Encoded(data.src, [[] for _ in texts])
        tok, config = self.tokenizer, self.config
        ids = translate_encoded(self.model, data, tok.pad_id, tok.bos_id, tok.eos_id, max_tokens, beam,
                                length_penalty, config.max_len_a, config.max_len_b, config.model.max_len, use_cache,
                                progress)
        return tok.decode(ids)


N_BOOTSTRAP = 1000  # resampled test sets per interval: sacreBLEU's default for --confidence
BOOTSTRAP_SEED = 12345  # sacreBLEU's own default seed (its SACREBLEU_SEED)


def scores(hypotheses: list[str], references: list[str], target_language: str, n_bootstrap: int = N_BOOTSTRAP,
           seed: int = BOOTSTRAP_SEED) -> dict:
    """sacreBLEU BLEU and chrF with their signatures and bootstrap 95% intervals, and the older lowercased
    tokenized BLEU, labelled. The scores are plain ``corpus_score``: the intervals are beside them, not instead."""
    import sacrebleu
    from sacremoses import MosesTokenizer

    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    moses = MosesTokenizer(lang=target_language)

    def tokenized(texts: list[str]) -> list[str]:
        return [moses.tokenize(t.lower(), return_str=True, escape=False) for t in texts]

    old_style = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    old_score = old_style.corpus_score(tokenized(hypotheses), [tokenized(references)])
    return {
        "bleu": round(bleu_score.score, 2), "bleu_signature": str(bleu.get_signature()),
        "bleu_ci95": interval95("bleu", hypotheses, references, n_bootstrap, seed),
        "chrf": round(chrf_score.score, 2), "chrf_signature": str(chrf.get_signature()),
        "chrf_ci95": interval95("chrf", hypotheses, references, n_bootstrap, seed),
        "n_bootstrap": n_bootstrap, "bootstrap_seed": seed,
        "bleu_lowercased_moses_tokenized": round(old_score.score, 2),
        "bleu_lowercased_moses_tokenized_note": "lowercased, Moses-tokenized (sacremoses) both sides, then BLEU "
        "with tokenize=none: the convention of older Multi30k papers (multi-bleu.perl); for comparison only",
    }


def interval95(metric: str, hypotheses: list[str], references: list[str], n_bootstrap: int = N_BOOTSTRAP,
               seed: int = BOOTSTRAP_SEED) -> list[float]:
    """sacreBLEU's bootstrap 95% interval ``[low, high]`` of a corpus BLEU or chrF (``metric``: ``bleu``, ``chrf``).

    sacreBLEU scores ``n_bootstrap`` test sets drawn with replacement from the sentences and reports
    μ ± h: the mean of those scores, and half the distance between their 2.5th and 97.5th
    percentiles; the interval is [μ - h, μ + h]. The same seed draws the same test sets.
    """
    import sacrebleu

    kinds = {"bleu": sacrebleu.metrics.BLEU, "chrf": sacrebleu.metrics.CHRF}
    if metric not in kinds:
        raise ValueError(f"metric must be one of {sorted(kinds)}, got {metric!r}")
    if n_bootstrap < 2:
        raise ValueError(f"an interval needs at least 2 resampled test sets, got n_bootstrap={n_bootstrap}")
    scorer = kinds[metric]()
    with _sacrebleu_seed(seed):
        score = scorer.corpus_score(hypotheses, [references], n_bootstrap=n_bootstrap)
    # sacreBLEU leaves the mean out when every resample scores 0 (then the interval is [0, 0]).
    reported = json.loads(score.format(width=4, signature=str(scorer.get_signature()), is_json=True))
    mean, half = reported.get("confidence_mean", 0.0), reported.get("confidence_var", 0.0)
    return [round(mean - half, 2), round(mean + half, 2)]


@contextlib.contextmanager
def _sacrebleu_seed(seed: int) -> Iterator[None]:
    """sacreBLEU takes its bootstrap's seed from the environment variable ``SACREBLEU_SEED``, read at each call."""
    before = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if before is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = before


def seed_summary(values: Sequence[float]) -> dict:
    """``{"mean", "sd", "n"}`` of one score over runs that differ only in their training seed.

    ``sd`` is the sample standard deviation (divided by n - 1), the spread one more seed would
    show; None for a single run, which has no spread to show.
    """
    if not values:
        raise ValueError("no scores to summarise")
    return {"mean": round(statistics.mean(values), 2),
            "sd": round(statistics.stdev(values), 2) if len(values) > 1 else None, "n": len(values)}


def seed_summary_text(summary: dict) -> str:
    """``44.10 ± 0.31 (mean ± sd of 3 seeds)``, as the book and the README print it."""
    if summary["sd"] is None:
        return f"{summary['mean']:.2f} (one seed: no spread measured)"
    return f"{summary['mean']:.2f} ± {summary['sd']:.2f} (mean ± sd of {summary['n']} seeds)"


def rerun_command(row: dict) -> str:
    """The command that trains (or, where its run folder is kept, only scores again) the run of a results row."""
    src, tgt = row["direction"].split("→")
    return f"python benchmarks/translator_quality.py --preset {row['preset']} --directions {src}-{tgt}"


def interval_text(row: dict, rerun: str | None = None) -> str:
    """A results row's 95% intervals as text (``41.30–43.75 / 60.90–62.48``: BLEU / chrF), or, for a row scored
    before they were measured, why it has none and the command (``rerun``, else :func:`rerun_command`) that would
    give them."""
    if "bleu_ci95" not in row:
        return f"interval not measured (translations not kept; rerun `{rerun or rerun_command(row)}`)"
    return " / ".join(f"{row[key][0]:.2f}–{row[key][1]:.2f}" for key in ("bleu_ci95", "chrf_ci95") if key in row)


def evaluate(checkpoint: Path | str, split: str = "test_2016_flickr", data_dir: Path | str | None = None,
             beam: int | None = None, length_penalty: float | None = None, use_cache: bool = True,
             progress: bool = True, device: torch.device | None = None, limit: int | None = None) -> dict:
    """Translate a split (its first ``limit`` sentences, for a quick look) with a checkpoint and score it
    against the raw references; everything a result needs."""
    from stepformer.runs import commit, hardware

    translator = Translator.load(checkpoint, device)
    config = translator.config
    sources, references = load_split(split, config.src_lang, config.tgt_lang, data_dir, progress=progress)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        sources, references = sources[:limit], references[:limit]
    started = time.perf_counter()
    hypotheses = translator.translate(sources, beam, length_penalty, use_cache, progress=progress)
    seconds = time.perf_counter() - started
    result = scores(hypotheses, references, config.tgt_lang)
    state = translator.checkpoint
    result.update({
        "direction": f"{config.src_lang}→{config.tgt_lang}", "split": split, "sentences": len(sources),
        "beam": config.beam if beam is None else beam,
        "length_penalty": config.length_penalty if length_penalty is None else length_penalty,
        "kv_cache": use_cache, "decode_seconds": round(seconds, 1), "decode_hardware": hardware(translator.device),
        "checkpoint": Path(checkpoint).name, "averaged": state.get("averaged", []), "steps": state["step"],
        "train_minutes": round(state["elapsed_s"] / 60, 1), "seed": config.seed, "train_commit": state["commit"],
        "train_hardware": state.get("hardware", "not recorded"), "train_load_average": state.get("load_average"),
        "train_precision": state.get("precision", "not recorded"),
        "eval_commit": commit(), "torch": torch.__version__, "settings": config.to_dict(),
    })
    result["hypotheses"] = hypotheses
    return result


def gpu_rows(report: dict, split: str = "test_2016_flickr") -> list[dict]:
    """One row per direction of a ``benchmarks/gpu_run.py`` results file (``book/results/gpu.json``):
    BLEU and chrF as mean ± sd over the seeds, each seed's BLEU interval, and the run's provenance."""
    rows = []
    for direction, summary in report["summary"].get(split, {}).items():
        runs = [r for r in report["runs"] if r["direction"] == direction and f"averaged/{split}" in r["scores"]]
        scored = [r["scores"][f"averaged/{split}"] for r in runs]
        rows.append({
            "direction": direction, "split": split, "hardware": report["hardware"], "torch": report["torch"],
            "commit": report["commit"], "seeds": [r["seed"] for r in runs], "bleu": summary["bleu"],
            "chrf": summary["chrf"], "bleu_ci95": [s["bleu_ci95"] for s in scored],
            "bleu_signature": scored[0]["bleu_signature"], "chrf_signature": scored[0]["chrf_signature"],
            "train_minutes": max(r["train_minutes"] for r in runs), "epochs": [r["epochs"] for r in runs],
            "steps": [r["steps"] for r in runs], "length_penalty": scored[0]["length_penalty"],
            "beam": scored[0]["beam"], "overrides": report.get("overrides", {}),
        })
    return rows


def gpu_readme_row(row: dict) -> str:
    """The README's table row for one :func:`gpu_rows` row."""
    intervals = ", ".join(f"{low:.2f}–{high:.2f}" for low, high in row["bleu_ci95"])
    epochs = f"{min(row['epochs'])}–{max(row['epochs'])}" if len(set(row["epochs"])) > 1 else f"{row['epochs'][0]}"
    return (f"| gpu | {row['direction']} | {seed_summary_text(row['bleu'])} | "
            f"{row['chrf']['mean']:.2f} ± {row['chrf']['sd']:.2f} | BLEU per seed: {intervals} | {row['hardware']} | "
            f"{row['train_minutes']:g} min, {epochs} epochs | {', '.join(map(str, row['seeds']))} | {row['commit']} |")
