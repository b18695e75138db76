"""The figure a training run leaves beside its metrics: ``curves.png``."""

import json
from pathlib import Path


def plot_curves(metrics: Path, out: Path) -> Path | None:
    """The training loss (smoothed), the validation loss and the validation BLEU against steps, in one figure."""
    # A Figure of its own, not pyplot: a notebook that calls train() keeps its own plotting backend.
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_bleu" in r]
    if not train_rows:
        return None
    fig = Figure(figsize=(10, 3.6))
    ax_loss, ax_bleu = fig.subplots(1, 2)
    steps = [r["step"] for r in train_rows]
    window = max(1, len(train_rows) // 50)
    losses = [r["loss"] for r in train_rows]
    smoothed = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                for i in range(len(losses))]
    ax_loss.plot(steps, smoothed, label="training (label-smoothed)")
    if val_rows:
        ax_loss.plot([r["step"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", label="validation (plain)")
        ax_bleu.plot([r["step"] for r in val_rows], [r["val_bleu"] for r in val_rows], "o-", color="C2")
    ax_loss.set(xlabel="step", ylabel="cross-entropy per token (nats)", title="loss")
    ax_loss.legend()
    ax_bleu.set(xlabel="step", ylabel="BLEU", title="validation BLEU (greedy, sample)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out
