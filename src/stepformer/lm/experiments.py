"""The three experiments of ``stepformer-lm``: a LLaMA-style language model, BERT's objective, and LoRA against
full fine-tuning; each returns what it measured, for ``results.json``."""

import copy
from dataclasses import replace

import torch

from stepformer.lm.config import RunConfig, bert_config, llama_config
from stepformer.lm.data import Data, collate_captions
from stepformer.lm.loop import train_loop
from stepformer.lm.measure import DECODINGS, PROMPTS, all_samples, decoding_speed, kv_cache_comparison, state_hash
from stepformer.lm.objectives import evaluate_lm, evaluate_mlm, fill_mask_examples, frequent_ids, lm_loss, mlm_step_loss
from stepformer.models import EncoderModel, LanguageModel, add_lora, merge_lora
from stepformer.runs import Budget


def language_model_experiment(data: Data, run: RunConfig, budget: Budget, device: torch.device, metrics=None,
                              progress: bool = True, log=print) -> tuple[LanguageModel, dict]:
    """Train the LLaMA-style model on the English captions; the model and what was measured before and after."""
    tokenizer = data.tokenizer
    torch.manual_seed(run.seed)
    config = llama_config(tokenizer.vocab_size, run)
    model = LanguageModel(config).to(device)
    evaluate = lambda: evaluate_lm(model, data.en_val, tokenizer.pad_id, run.max_tokens, device)  # noqa: E731
    untrained = evaluate()
    untrained_samples = all_samples(model, tokenizer, run, device)
    log(f"language model: {sum(p.numel() for p in model.parameters()):,} parameters; held-out perplexity "
        f"{untrained['perplexity']:.1f} untrained")
    training = train_loop(model, data.en_train, lambda m, t, g: lm_loss(m, t, tokenizer.pad_id)[0], run, budget,
                          run.peak_lr, tokenizer.pad_id, device, "lm", evaluate=evaluate, metrics=metrics,
                          progress=progress)
    trained = training["evaluations"][-1]
    log(f"language model: held-out perplexity {trained['perplexity']:.1f} after {training['steps']} steps")
    before = state_hash(model)
    trained_samples = all_samples(model, tokenizer, run, device)
    after = state_hash(model)
    prompt = collate_captions(data.en_val, list(range(run.speed_batch)), tokenizer.pad_id)[:, :4].to(device)
    result = {
        "config": config.to_dict(), "parameters": sum(p.numel() for p in model.parameters()),
        **training,
        "perplexity": {"untrained": round(untrained["perplexity"], 2), "trained": round(trained["perplexity"], 2)},
        "loss": {"untrained": round(untrained["loss"], 4), "trained": round(trained["loss"], 4)},
        "held_out_tokens": trained["tokens"],
        "prompts": list(PROMPTS),
        "samples": {"untrained": untrained_samples, "trained": trained_samples},
        "sample_settings": {"max_new_tokens": run.sample_tokens, "seed": run.seed,
                            "decodings": {k: v for k, v in DECODINGS.items()}},
        "prompting_changes_no_weight": {"state_dict_sha256_before": before, "state_dict_sha256_after": after,
                                        "equal": before == after},
        "decoding_speed": decoding_speed(model, prompt, run.speed_tokens),
        "kv_cache": kv_cache_comparison(model, prompt),
    }
    return model, result


def masked_lm_experiment(data: Data, run: RunConfig, budget: Budget, device: torch.device, metrics=None,
                         progress: bool = True, log=print) -> dict:
    """Train a BERT-like encoder with the masked-LM objective on the English captions; accuracy before and after."""
    tokenizer = data.tokenizer
    torch.manual_seed(run.seed)
    config = bert_config(tokenizer.vocab_size, run)
    model = EncoderModel(config).to(device)
    frequent = frequent_ids(data.en_train, tokenizer)
    evaluate = lambda: evaluate_mlm(model, data.en_val, tokenizer, run.max_tokens, device,  # noqa: E731
                                    frequent=frequent)
    untrained = evaluate()
    log(f"masked LM: {sum(p.numel() for p in model.parameters()):,} parameters; held-out masked-token accuracy "
        f"{untrained['accuracy']:.1%} untrained")
    training = train_loop(model, data.en_train, lambda m, t, g: mlm_step_loss(m, t, tokenizer, g, run.mlm_mask),
                          run, budget, run.mlm_lr, tokenizer.pad_id, device, "mlm", evaluate=evaluate, metrics=metrics,
                          progress=progress)
    trained = training["evaluations"][-1]
    log(f"masked LM: held-out masked-token accuracy {trained['accuracy']:.1%} after {training['steps']} steps")
    return {
        "config": config.to_dict(), "parameters": sum(p.numel() for p in model.parameters()), **training,
        "recipe": {"chosen": run.mlm_mask, "chosen_when_evaluated": 0.15,
                   "of_chosen_masked": 0.8, "of_chosen_random": 0.1, "of_chosen_kept": 0.1,
                   "never_chosen": ["<pad>", "<s>", "</s>"]},
        "accuracy": {"untrained": round(untrained["accuracy"], 4), "trained": round(trained["accuracy"], 4),
                     "frequency_baseline": round(trained["frequency_baseline"], 4)},
        "long_words": {"untrained": round(untrained["long_words"]["accuracy"], 4),
                       "trained": round(trained["long_words"]["accuracy"], 4),
                       "frequency_baseline": round(trained["long_words"]["frequency_baseline"], 4),
                       "masked": trained["long_words"]["masked"]},
        "frequent_guesses": {k: tokenizer.decode([[i]])[0].strip() for k, i in frequent.items()},
        "loss": {"untrained": round(untrained["loss"], 4), "trained": round(trained["loss"], 4)},
        "held_out_masked_tokens": trained["masked"],
        "examples": fill_mask_examples(model, tokenizer, data.en_val_texts, device, count=8),
    }


def adaptation_experiment(base: LanguageModel, data: Data, run: RunConfig, budget: Budget, device: torch.device,
                          metrics=None, progress: bool = True, log=print) -> dict:
    """Adapt the English model to German twice, with LoRA on ``w_q`` and ``w_v`` and with every weight trainable.

    Each run starts from a copy of ``base``, trains for ``budget`` (each its own) over the same
    batches of ``run.adapt_max_tokens`` tokens, and reports its trainable parameters, the bytes
    its first step held, its time, and the held-out German and English losses before and after
    (the English one shows how much each forgets). LoRA's update is then merged into the weights
    and the logits compared.
    """
    tokenizer = data.tokenizer
    warmup = max(1, min(run.warmup, (budget.max_steps or run.adapt_steps) // 10))
    results = {}
    for mode in ("lora", "full"):
        torch.manual_seed(run.seed)
        model = copy.deepcopy(base)
        german = lambda m=model: evaluate_lm(m, data.de_val, tokenizer.pad_id, run.max_tokens, device)  # noqa: E731
        english = lambda m=model: evaluate_lm(m, data.en_val, tokenizer.pad_id, run.max_tokens, device)  # noqa: E731
        before_de, before_en = german(), english()
        wrapped = add_lora(model, ("w_q", "w_v"), run.lora_r, run.lora_alpha) if mode == "lora" else []
        training = train_loop(model, data.de_train, lambda m, t, g: lm_loss(m, t, tokenizer.pad_id)[0],
                              replace(run, max_tokens=run.adapt_max_tokens), budget,
                              run.lora_lr if mode == "lora" else run.full_lr, tokenizer.pad_id, device, mode,
                              warmup=warmup, evaluate=lambda g=german: {"german_" + k: v for k, v in g().items()},
                              metrics=metrics, progress=progress, measure_memory=True)
        after_de, after_en = german(), english()
        result = {
            "trainable_parameters": training["trainable_parameters"],
            "all_parameters": sum(p.numel() for p in model.parameters()),
            "steps": training["steps"], "wall_s": training["wall_s"], "peak_lr": training["peak_lr"],
            "step_memory": training["step_memory"],
            "german_loss": {"before": round(before_de["loss"], 4), "after": round(after_de["loss"], 4)},
            "german_perplexity": {"before": round(before_de["perplexity"], 2),
                                  "after": round(after_de["perplexity"], 2)},
            "english_loss": {"before": round(before_en["loss"], 4), "after": round(after_en["loss"], 4)},
            "loss_curve": training["loss_curve"],
        }
        if mode == "lora":
            probe = collate_captions(data.de_val, list(range(min(8, len(data.de_val)))), tokenizer.pad_id).to(device)
            with torch.no_grad():
                model.eval()
                adapted = model(probe)
                merged = merge_lora(model)
                difference = float((model(probe) - adapted).abs().max())
            result.update({"r": run.lora_r, "alpha": run.lora_alpha, "targets": ["w_q", "w_v"],
                           "wrapped_layers": len(wrapped), "merged_layers": merged,
                           "merged_logits_max_abs_difference": difference})
        log(f"{mode}: {result['trainable_parameters']:,} trainable parameters, German held-out loss "
            f"{result['german_loss']['before']:.3f} -> {result['german_loss']['after']:.3f} in "
            f"{result['steps']} steps, {result['wall_s']:.0f} s")
        results[mode] = result
    return results
