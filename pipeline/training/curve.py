"""A training run's learning curve as a PNG: the rollouts' mean reward at every step, and the
held-out strict score at every scoring (`heldout.jsonl`), on one chart. `memstream train`
redraws it in the run folder after each step and scoring (`learning_curve.png`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

CURVE_FILE = "learning_curve.png"


def plot_learning_curve(
    metrics: Sequence[dict[str, Any]], heldout: Sequence[dict[str, Any]], path: Path
) -> None:
    """`metrics`: `metrics.jsonl` lines ({"step", "reward_mean"}); `heldout`: `heldout.jsonl`
    lines ({"step", "strict"}), none for a run scored on no held-out split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(
        [row["step"] for row in metrics],
        [row["reward_mean"] for row in metrics],
        marker="o",
        linewidth=1,
        label="mean reward of the rollouts",
    )
    if heldout:
        axis.plot(
            [row["step"] for row in heldout],
            [row["strict"] for row in heldout],
            marker="s",
            linewidth=1,
            label="held-out strict score",
        )
        axis.legend(loc="upper left", fontsize="small")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel("training step")
    axis.set_ylabel("score")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
