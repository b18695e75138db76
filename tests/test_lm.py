"""Chapter 12's models trained here (``stepformer.lm``): data, training, BERT's masking, LoRA, the command line.

Small models on a few hundred real Multi30k captions (``../shared/data/multi30k``), on one thread:
each test takes seconds.
"""

import io
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from stepformer.kvcache import cache_bytes
from stepformer.lm.cli import main
from stepformer.lm.config import PRESETS, bert_config, llama_config
from stepformer.lm.data import (
    MASK,
    Captions,
    caption_batches,
    collate_captions,
    encode_captions,
    mask_id,
    train_tokenizer,
)
from stepformer.lm.loop import cosine_lr, train_loop
from stepformer.lm.measure import (
    DECODINGS,
    PROMPTS,
    decoding_speed,
    kv_cache_bytes_per_token,
    kv_cache_comparison,
    state_hash,
)
from stepformer.lm.objectives import (
    evaluate_lm,
    evaluate_mlm,
    frequent_ids,
    is_long_word,
    lm_loss,
    long_word_ids,
    mask_tokens,
    maskable_positions,
    masked_lm_loss,
    mlm_step_loss,
    ordinary_ids,
)
from stepformer.models import EncoderModel, LanguageModel, LoRALinear, add_lora, generate, merge_lora
from stepformer.runs import Budget
from stepformer.translator.data import load_split

TINY = replace(PRESETS["tiny"], eval_every=1000)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def texts(real_data) -> dict[str, list[str]]:
    en, de = load_split("train", "en", "de", real_data, progress=False)
    en_val, de_val = load_split("val", "en", "de", real_data, progress=False)
    return {"en": en[:400], "de": de[:400], "en_val": en_val[:100], "de_val": de_val[:100]}


@pytest.fixture(scope="module")
def tokenizer(texts):
    return train_tokenizer(texts["en"] + texts["de"], 400)


@pytest.fixture(scope="module")
def captions(tokenizer, texts) -> dict[str, Captions]:
    return {name: encode_captions(tokenizer, lines, TINY.model.max_len) for name, lines in texts.items()}


def tiny_lm(vocab: int, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(llama_config(vocab, TINY))


def train_tiny(model, data: Captions, tokenizer, steps: int, run=TINY, metrics=None, **options) -> dict:
    return train_loop(model, data, lambda m, t, g: lm_loss(m, t, tokenizer.pad_id)[0], run, Budget(max_steps=steps),
                      run.peak_lr, tokenizer.pad_id, torch.device("cpu"), "test", metrics=metrics, progress=False,
                      **options)


# --- data ---------------------------------------------------------------------------------------------


def test_captions_are_bos_caption_eos_cut_to_max_len_and_padded_on_the_right(tokenizer, texts):
    encoded = encode_captions(tokenizer, texts["en"][:50], max_len=12)
    ids = tokenizer.encode(texts["en"][:50])
    for sequence, original in zip(encoded.sequences, ids, strict=True):
        assert sequence == [tokenizer.bos_id, *original[:10], tokenizer.eos_id]
    assert encoded.truncated == sum(len(i) > 10 for i in ids) > 0
    batch = collate_captions(encoded, [0, 1, 2], tokenizer.pad_id)
    for row, i in enumerate([0, 1, 2]):
        n = len(encoded.sequences[i])
        assert batch[row, :n].tolist() == encoded.sequences[i]
        assert (batch[row, n:] == tokenizer.pad_id).all()


def test_the_tokenizer_has_mask_last_and_the_translators_specials(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert mask_id(tokenizer) == tokenizer.vocab_size - 1
    assert tokenizer.decode([[5, mask_id(tokenizer), 6]]) == tokenizer.decode([[5, 6]])


def test_batches_hold_every_caption_once_within_the_token_budget_and_follow_the_seed(captions):
    data = captions["en"]
    batches = caption_batches(data, 300, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    assert all(len(b) * max(len(data.sequences[i]) for i in b) <= 300 for b in batches)
    assert batches == caption_batches(data, 300, seed=3, epoch=0)
    assert batches != caption_batches(data, 300, seed=3, epoch=1)


# --- the language model's training -------------------------------------------------------------------


def test_the_loss_of_a_tiny_lm_falls_on_a_few_hundred_captions(tokenizer, captions):
    model = tiny_lm(tokenizer.vocab_size)
    before = evaluate_lm(model, captions["en_val"], tokenizer.pad_id, 1024, torch.device("cpu"))
    record = train_tiny(model, captions["en"], tokenizer, 120)
    after = evaluate_lm(model, captions["en_val"], tokenizer.pad_id, 1024, torch.device("cpu"))
    first, last = record["loss_curve"][0][1], record["loss_curve"][-1][1]
    assert first > math.log(tokenizer.vocab_size) - 0.5, "an untrained model should be near-uniform"
    assert last < first - 1.5, f"the training loss fell only from {first:.2f} to {last:.2f}"
    assert after["perplexity"] < 0.5 * before["perplexity"], (before, after)
    assert record["steps"] == 120 and record["tokens"] > 0


@pytest.mark.parametrize("objective", ["next token", "masked LM"])
def test_the_same_seed_gives_the_same_losses_and_another_seed_other_ones(tokenizer, captions, objective):
    def losses(seed: int) -> list[float]:
        log, run = io.StringIO(), replace(TINY, seed=seed)
        torch.manual_seed(seed)
        if objective == "next token":
            model, step_loss = LanguageModel(llama_config(tokenizer.vocab_size, run)), None
        else:  # dropout and the masks draw random numbers too
            model = EncoderModel(bert_config(tokenizer.vocab_size, run))
            step_loss = lambda m, t, g: mlm_step_loss(m, t, tokenizer, g)  # noqa: E731
        train_loop(model, captions["en"], step_loss or (lambda m, t, g: lm_loss(m, t, tokenizer.pad_id)[0]), run,
                   Budget(max_steps=15), run.peak_lr, tokenizer.pad_id, torch.device("cpu"), "test", metrics=log,
                   progress=False)
        return [json.loads(line)["loss"] for line in log.getvalue().splitlines()]

    first = losses(1)
    assert len(first) == 15
    assert losses(1) == first
    assert losses(2) != first


def test_padding_changes_neither_the_logits_nor_the_loss_of_the_real_tokens(tokenizer, captions):
    model = tiny_lm(tokenizer.vocab_size).eval()
    data = captions["en_val"]
    indices = [0, 1, 2, 3]
    batch = collate_captions(data, indices, tokenizer.pad_id)
    assert (batch == tokenizer.pad_id).any(), "the batch should hold captions of different lengths"
    total, count = 0.0, 0
    with torch.no_grad():
        padded_logits = model(batch)
        for row, i in enumerate(indices):
            alone = torch.tensor([data.sequences[i]])
            n = alone.shape[1]
            torch.testing.assert_close(padded_logits[row, :n], model(alone)[0], atol=1e-5, rtol=1e-5)
            loss, targets = lm_loss(model, alone, tokenizer.pad_id)
            total, count = total + float(loss) * targets, count + targets
        batch_loss, batch_targets = lm_loss(model, batch, tokenizer.pad_id)
    assert batch_targets == count == sum(len(data.sequences[i]) - 1 for i in indices)
    assert float(batch_loss) == pytest.approx(total / count, rel=1e-5)


def test_the_learning_rate_warms_up_then_falls_along_a_cosine_to_its_floor():
    peak, warmup, floor = 1e-3, 10, 0.1
    assert cosine_lr(1, 0.0, peak, warmup, floor) == pytest.approx(peak / warmup)
    assert cosine_lr(warmup, 0.1, peak, warmup, floor) == pytest.approx(peak)
    assert cosine_lr(warmup + 1, 0.5, peak, warmup, floor) == pytest.approx(peak * (floor + (1 - floor) / 2))
    assert cosine_lr(500, 1.0, peak, warmup, floor) == pytest.approx(peak * floor)
    rates = [cosine_lr(11 + s, s / 100, peak, warmup, floor) for s in range(101)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    with pytest.raises(ValueError, match="count from 1"):
        cosine_lr(0, 0.0, peak, warmup, floor)


def test_prompting_changes_no_weight_and_the_hash_sees_any_change(tokenizer):
    model = tiny_lm(tokenizer.vocab_size)
    before = state_hash(model)
    generate(model, torch.tensor([[tokenizer.bos_id, 5, 6]]), 10, temperature=1.0, top_p=0.9)
    assert state_hash(model) == before
    with torch.no_grad():
        model.decoder.layers[0].self_attn.w_q.weight[0, 0] += 1e-6
    assert state_hash(model) != before


def test_the_kv_cache_holds_heads_over_kv_heads_times_fewer_bytes_with_gqa(tokenizer, captions):
    model = tiny_lm(tokenizer.vocab_size)
    config = model.config
    tokens = collate_captions(captions["en_val"], [0, 1, 2], tokenizer.pad_id)
    result = kv_cache_comparison(model, tokens)
    d_head = config.d_model // config.heads
    assert result["bytes_per_token_gqa"] == cache_bytes(config.layers, config.kv_heads, d_head, 1)
    assert result["bytes_per_token_mha"] == cache_bytes(config.layers, config.heads, d_head, 1)
    assert result["bytes_per_token_mha"] / result["bytes_per_token_gqa"] == config.heads / config.kv_heads
    assert kv_cache_bytes_per_token(model, tokens[:, :5]) == result["bytes_per_token_gqa"]


def test_decoding_with_and_without_the_cache_gives_the_same_tokens(tokenizer, captions):
    model = tiny_lm(tokenizer.vocab_size)
    prompt = collate_captions(captions["en_val"], [0, 1], tokenizer.pad_id)[:, :3]
    speed = decoding_speed(model, prompt, 6, repeats=1)
    assert speed["same_tokens"] and speed["batch"] == 2 and speed["new_tokens"] == 6
    assert speed["with_cache_tokens_per_s"] > 0 and speed["without_cache_tokens_per_s"] > 0


# --- BERT's objective ---------------------------------------------------------------------------------


def test_the_masking_recipe_chooses_15_percent_then_80_10_10_and_never_a_special_token():
    generator = torch.Generator().manual_seed(0)
    pad_id, bos_id, eos_id, mask = 0, 1, 2, 999  # mask last, as in train_tokenizer
    tokens = torch.randint(3, mask, (256, 300), generator=generator)
    lengths = torch.randint(2, 301, (256,), generator=generator)
    positions = torch.arange(300)
    tokens[:, 0] = bos_id
    tokens[positions >= lengths[:, None] - 1] = eos_id
    tokens[positions >= lengths[:, None]] = pad_id
    maskable = (tokens != pad_id) & (tokens != bos_id) & (tokens != eos_id)
    inputs, chosen = mask_tokens(tokens, maskable, mask, (3, mask), generator)

    assert not (chosen & ~maskable).any(), "padding, <s> or </s> was chosen"
    assert torch.equal(inputs[~chosen], tokens[~chosen]), "a position that was not chosen was changed"
    assert float(chosen.sum() / maskable.sum()) == pytest.approx(0.15, abs=0.005)
    n = float(chosen.sum())
    masked = float((inputs[chosen] == mask).sum()) / n
    kept = float((inputs[chosen] == tokens[chosen]).sum()) / n
    randomised = float(((inputs[chosen] != mask) & (inputs[chosen] != tokens[chosen])).sum()) / n
    assert masked == pytest.approx(0.8, abs=0.01)
    # A random token equals the original one time in 996: those count as kept.
    assert kept == pytest.approx(0.1, abs=0.01) and randomised == pytest.approx(0.1, abs=0.01)
    random_ids = inputs[chosen & (inputs != mask) & (inputs != tokens)]
    assert random_ids.min() >= 3 and random_ids.max() < mask, "random tokens must be ordinary word pieces"
    # About 580 draws from 996 ids cover about 440 distinct ones when uniform.
    assert len(set(random_ids.tolist())) > 350, "random tokens should spread over the vocabulary"
    draw = lambda seed: mask_tokens(tokens, maskable, mask, (3, mask), torch.Generator().manual_seed(seed))[0]  # noqa: E731
    assert torch.equal(draw(7), draw(7)) and not torch.equal(draw(7), draw(8))


def test_the_masked_lm_loss_counts_the_chosen_positions_only():
    torch.manual_seed(0)
    batch, seq, vocab = 3, 7, 11
    logits = torch.randn(batch, seq, vocab)
    tokens = torch.randint(0, vocab, (batch, seq))
    chosen = torch.rand(batch, seq) < 0.4
    chosen[0, 0], chosen[0, 1] = True, False
    expected = F.cross_entropy(logits[chosen], tokens[chosen])
    torch.testing.assert_close(masked_lm_loss(logits, tokens, chosen), expected)
    elsewhere = logits.clone()
    elsewhere[0, 1] = 100 * torch.randn(vocab)
    torch.testing.assert_close(masked_lm_loss(elsewhere, tokens, chosen), expected)
    there = logits.clone()
    there[0, 0] = 100 * torch.randn(vocab)
    assert not torch.isclose(masked_lm_loss(there, tokens, chosen), expected)
    assert float(masked_lm_loss(logits, tokens, torch.zeros_like(chosen))) == 0.0


def test_masked_lm_training_raises_the_held_out_accuracy(tokenizer, captions):
    torch.manual_seed(0)
    model = EncoderModel(bert_config(tokenizer.vocab_size, TINY))
    device = torch.device("cpu")
    before = evaluate_mlm(model, captions["en_val"], tokenizer, 1024, device)
    again = evaluate_mlm(model, captions["en_val"], tokenizer, 1024, device)
    assert before == again, "the held-out masks must be the same at every evaluation"
    train_loop(model, captions["en"], lambda m, t, g: mlm_step_loss(m, t, tokenizer, g), TINY,
               Budget(max_steps=150), 3e-3, tokenizer.pad_id, device, "mlm", progress=False)
    after = evaluate_mlm(model, captions["en_val"], tokenizer, 1024, device)
    assert after["accuracy"] > before["accuracy"] + 0.05, (before, after)
    assert after["loss"] < before["loss"] - 1.0


def test_a_long_word_is_a_piece_that_starts_a_word_of_five_letters_or_more():
    assert is_long_word(" woman") and is_long_word(" people")
    assert not is_long_word(" with") and not is_long_word("eople") and not is_long_word(" 12345")


def test_too_small_a_vocabulary_for_long_words_is_an_error(tokenizer, captions):
    # The module's 400 pieces hold no English word of five letters.
    with pytest.raises(ValueError, match="too small to measure long words"):
        frequent_ids(captions["en"], tokenizer)


def test_the_frequency_baseline_is_the_share_of_masked_pieces_that_are_the_most_frequent_one(texts):
    tokenizer = train_tokenizer(texts["en"] + texts["de"], 800)  # enough pieces for English words of 5+ letters
    captions = {name: encode_captions(tokenizer, texts[name], TINY.model.max_len) for name in ("en", "en_val")}
    frequent = frequent_ids(captions["en"], tokenizer)
    pieces = [i for s in captions["en"].sequences for i in s[1:-1]]
    assert pieces.count(frequent["any"]) == max(pieces.count(i) for i in set(pieces))
    long = long_word_ids(tokenizer)
    assert long[frequent["long"]] and not long[frequent["any"]]  # the most frequent piece is short ("a")
    model = EncoderModel(bert_config(tokenizer.vocab_size, TINY))
    result = evaluate_mlm(model, captions["en_val"], tokenizer, 1024, torch.device("cpu"), frequent=frequent)
    # The same corruption drawn again, counted one position at a time.
    generator, hits, long_hits, long_count = torch.Generator().manual_seed(0), 0, 0, 0
    for indices in caption_batches(captions["en_val"], 1024, 0, 0, shuffle=False):
        tokens = collate_captions(captions["en_val"], indices, tokenizer.pad_id)
        _, chosen = mask_tokens(tokens, maskable_positions(tokens, tokenizer), mask_id(tokenizer),
                                   ordinary_ids(tokenizer), generator)
        for token, is_chosen in zip(tokens.flatten().tolist(), chosen.flatten().tolist(), strict=True):
            if is_chosen:
                hits += token == frequent["any"]
                long_count += bool(long[token])
                long_hits += token == frequent["long"]
    assert result["frequency_baseline"] == hits / result["masked"]
    assert result["long_words"]["masked"] == long_count
    assert result["long_words"]["frequency_baseline"] == long_hits / long_count


# --- LoRA ---------------------------------------------------------------------------------------------


def test_lora_training_changes_only_the_lora_weights_and_merging_keeps_the_logits(tokenizer, captions):
    model = tiny_lm(tokenizer.vocab_size)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapped = add_lora(model, ("w_q", "w_v"), r=4, alpha=8)
    assert len(wrapped) == 2 * TINY.model.layers
    record = train_tiny(model, captions["de"], tokenizer, 10, measure_memory=True)
    d_model, kv_width = TINY.model.d_model, TINY.model.kv_heads * TINY.model.d_model // TINY.model.heads
    assert record["trainable_parameters"] == TINY.model.layers * 4 * ((d_model + d_model) + (d_model + kv_width))
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        original = name.replace(".base.", ".")
        assert torch.equal(p, base[original]), f"{original} changed although only LoRA's weights train"
    lora_b = [m.lora_b.weight for m in model.modules() if isinstance(m, LoRALinear)]
    assert all(b.abs().sum() > 0 for b in lora_b), "LoRA's B starts at zero and should have been trained"
    memory = record["step_memory"]
    assert memory["gradients_bytes"] == 4 * record["trainable_parameters"]
    assert memory["adamw_state_bytes"] >= 2 * memory["gradients_bytes"]

    probe = collate_captions(captions["de_val"], [0, 1, 2], tokenizer.pad_id)
    model.eval()
    with torch.no_grad():
        adapted = model(probe)
        assert merge_lora(model) == 2 * TINY.model.layers
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(probe), adapted, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(tiny_lm(tokenizer.vocab_size)(probe), adapted, atol=1e-4)


def test_full_fine_tuning_holds_a_gradient_and_two_adam_moments_for_every_weight(tokenizer, captions):
    model = tiny_lm(tokenizer.vocab_size)
    record = train_tiny(model, captions["de"], tokenizer, 2, measure_memory=True)
    memory = record["step_memory"]
    weights = sum(p.numel() for p in model.parameters())  # the tied embedding counts once
    assert record["trainable_parameters"] == weights
    assert memory["parameters_bytes"] == memory["gradients_bytes"] == 4 * weights
    # exp_avg and exp_avg_sq per weight, and a one-number step count per tensor
    assert 8 * weights <= memory["adamw_state_bytes"] < 8 * weights + 8 * len(list(model.parameters()))
    assert memory["saved_activations_bytes"] > 0


# --- the command line ---------------------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--no-progress", "--threads", "1"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_all_writes_every_result_and_refuses_to_overwrite_without_replace(tmp_path, real_data, capsys):
    out = tmp_path / "lm"
    code, _, err = run_cli(capsys, "all", "--preset", "tiny", "--steps", "4", "--adapt-steps", "3",
                           "--mask-rate", "0.3", "--data-dir", str(real_data), "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["seed"] == 1234 and results["commit"] and "threads" in results["hardware"]
    assert results["tokenizer"]["vocab_size"] == PRESETS["tiny"].model.vocab + 1  # <mask>
    language_model = results["language_model"]
    assert language_model["steps"] == 4 and language_model["config"]["kv_heads"] < language_model["config"]["heads"]
    for state in ("untrained", "trained"):
        assert set(language_model["samples"][state]) == set(DECODINGS)
        assert all(len(texts) == len(PROMPTS) for texts in language_model["samples"][state].values())
        assert language_model["samples"][state]["greedy"][0].startswith(PROMPTS[0])
    assert language_model["decoding_speed"]["same_tokens"]
    assert language_model["prompting_changes_no_weight"]["equal"]
    assert language_model["kv_cache"]["bytes_per_token_mha"] > language_model["kv_cache"]["bytes_per_token_gqa"]
    assert set(language_model["perplexity"]) == {"untrained", "trained"}
    masked = results["masked_lm"]
    assert masked["steps"] == 4 and set(masked["accuracy"]) == {"untrained", "trained", "frequency_baseline"}
    assert results["settings"]["mlm_mask"] == masked["recipe"]["chosen"] == 0.3
    assert masked["recipe"]["chosen_when_evaluated"] == 0.15
    assert 0 < masked["accuracy"]["frequency_baseline"] < 1 and set(masked["frequent_guesses"]) == {"any", "long"}
    assert set(masked["long_words"]) == {"untrained", "trained", "frequency_baseline", "masked"}
    assert masked["examples"] and all(MASK in e["masked"] and len(e["top5"]) == 5 for e in masked["examples"])
    lora, full = results["adaptation"]["lora"], results["adaptation"]["full"]
    assert lora["steps"] == full["steps"] == 3
    assert lora["trainable_parameters"] < full["trainable_parameters"]
    assert lora["step_memory"]["counted_total_bytes"] < full["step_memory"]["counted_total_bytes"]
    assert lora["merged_logits_max_abs_difference"] < 1e-4
    phases = {json.loads(line)["phase"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert phases == {"lm", "mlm", "lora", "full"}

    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--steps", "2", "--data-dir", str(real_data),
                           "--out", str(out))
    assert code == 2 and "already exists" in err and "--replace" in err
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--steps", "2", "--data-dir", str(real_data),
                           "--out", str(out), "--replace")
    assert code == 0, err
    replaced = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert "masked_lm" not in replaced and replaced["language_model"]["steps"] == 2
    assert {json.loads(line)["phase"] for line in (out / "metrics.jsonl").read_text().splitlines()} == {"lm"}


@pytest.mark.parametrize(("args", "message"), [
    (["--eval-split", "dev"], "unknown held-out split 'dev'"),
    (["--eval-split", "train"], "unknown held-out split 'train'"),
    (["--preset", "huge"], "unknown preset 'huge'; the presets are tiny, cpu"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--minutes", "-1"], "--minutes must be positive"),
    (["--data-dir", "/nonexistent/multi30k"], "the data folder /nonexistent/multi30k does not exist"),
])
def test_command_line_errors_are_one_clear_line(tmp_path, capsys, args, message):
    code, out, err = run_cli(capsys, "train", "--out", str(tmp_path / "out"), *args)
    assert code == 2
    assert err.strip().count("\n") == 0, err
    assert err.startswith("stepformer-lm train: error: ") and message in err, err
    assert not (tmp_path / "out").exists(), "a failed command must not leave an output folder"


@pytest.mark.parametrize("rate", ["0", "1", "1.5"])
def test_a_mask_rate_outside_zero_to_one_is_one_clear_line(tmp_path, capsys, rate):
    code, _, err = run_cli(capsys, "mlm", "--mask-rate", rate, "--out", str(tmp_path / "out"))
    assert code == 2 and err.startswith("stepformer-lm mlm: error: --mask-rate must lie between 0 and 1"), err
    assert not (tmp_path / "out").exists()


def test_a_data_folder_without_the_files_is_named_in_the_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "mlm", "--data-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert code == 2 and "train.en.gz: missing" in err and err.strip().count("\n") == 0
    assert not (tmp_path / "out").exists()


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for command in ("train", "mlm", "lora", "all", "--data-dir", "--threads 1"):
        assert command in text
