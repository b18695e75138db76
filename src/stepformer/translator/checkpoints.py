"""Chapter 11's checkpoints: what one holds (everything a resumed run needs to continue exactly, and a
translation needs to run) and which settings a resumed run may change."""

import os
from pathlib import Path

import torch

from stepformer.runs import Position, commit, hardware, save_checkpoint
from stepformer.translator.config import TranslatorConfig, autocast_dtype


def write_checkpoint(out_dir: Path, model, optimizer, config, tokenizer, position: Position, rng: list[dict]) -> Path:
    """Everything a resumed run needs to continue exactly (``rng``: each process's random states, by rank), and
    a translation needs to run; older ones beyond ``keep_checkpoints`` are removed."""
    return save_checkpoint({
        "config": config.to_dict(), "tokenizer": tokenizer.to_json(), "fingerprint": tokenizer.fingerprint,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), **position.to_checkpoint(), "rng": rng,
        "commit": commit(), "torch": torch.__version__, "hardware": hardware(next(model.parameters()).device),
        "precision": str(autocast_dtype(config.precision, next(model.parameters()).device)
                         or torch.float32).removeprefix("torch."),
        # The machine's load when the checkpoint was written: a run that shared its cores says so.
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }, out_dir, position.step, config.keep_checkpoints)


BUDGET_FIELDS = ("max_steps", "max_epochs", "max_minutes")


# Settings that change how a run reports, never what it computes: a resumed run may change them too.
REPORTING_FIELDS = ("log_every",)


def resumed_config(saved: TranslatorConfig, given: TranslatorConfig) -> TranslatorConfig:
    """The saved run's settings with the budget given now (a run may be extended); any other
    difference is refused, since it would silently make the resumed run another run."""
    now = given.settings()
    differences = [f"{k}: saved {v!r}, given {now[k]!r}" for k, v in saved.settings().items()
                   if k not in BUDGET_FIELDS + REPORTING_FIELDS and now[k] != v]
    if differences:
        raise ValueError("resuming with other settings than the saved run's: " + "; ".join(differences))
    return given
