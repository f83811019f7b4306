"""Loss curves of one or more runs, from the pretrain entry point's run log (``--log-json``).

``plot_loss_curves`` draws every run on the same axes, one colour per run:

- train loss of every iteration, faint, and its moving average (centred, ``2 * half_width + 1``
  iterations, fewer at the ends), solid: a trailing mean would lag behind the first iterations'
  steep fall;
- validation loss at each evaluation (markers joined by a dashed line), the final one a star;
- a caption line under the axes with each run's final figures (``final_figures``: train loss as
  the mean of the last ``SMOOTHING_WINDOW`` iterations).

The loss axis starts at the curves' highest point after the first few iterations: the first
iterations (loss ln 256 = 5.5 for bytes) would otherwise flatten everything after them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["moving_average", "final_figures", "plot_loss_curves", "SMOOTHING_WINDOW"]

# Train losses of single iterations vary with the sequences a batch happens to hold; the final
# train figure is the mean of this many iterations, the plotted curve about as many.
SMOOTHING_WINDOW = 20


def moving_average(values: Sequence[float], half_width: int) -> list[float]:
    """Element ``i``: the mean of ``values[max(0, i - half_width) : i + half_width + 1]``."""
    if half_width < 0:
        raise ValueError(f"half_width must be at least 0, got {half_width}")
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    means = []
    for index in range(len(values)):
        low, high = max(0, index - half_width), min(len(values), index + half_width + 1)
        means.append((prefix[high] - prefix[low]) / (high - low))
    return means


def final_figures(run: Mapping[str, Any], window: int = SMOOTHING_WINDOW) -> dict[str, float]:
    """A run's last iteration, its train loss (mean of the last ``window`` iterations) and its
    last validation loss (the final evaluation's), from a run log's ``train``/``valid`` records.

    Raises:
        ValueError: the run logged no train loss or no validation loss.
    """
    train, valid = run["train"], run["valid"]
    if not train or not valid:
        raise ValueError("the run log has no train or no validation records")
    last = [r["train_loss"] for r in train[-window:]]
    return {
        "final_iteration": train[-1]["iteration"],
        "final_train_loss": sum(last) / len(last),
        "final_valid_loss": valid[-1]["valid_loss"],
    }


def _one_per_iteration(valid: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The evaluations to draw: the final one replaces a periodic one at its iteration."""
    if valid and valid[-1].get("final"):
        final = valid[-1]
        return [r for r in valid[:-1] if r["iteration"] != final["iteration"]] + [final]
    return list(valid)


def plot_loss_curves(
    runs: Mapping[str, Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    details: Mapping[str, str] | None = None,
    validation_label: str = "validation loss (held-out data)",
    half_width: int = SMOOTHING_WINDOW // 2,
    colors: Sequence[str] = ("tab:red", "tab:blue", "tab:green", "tab:purple"),
) -> None:
    """Writes a PNG of the runs' loss curves (module docstring) to ``path``.

    Args:
        runs: a short name (legend and caption) -> run log (``{"train": [...], "valid": [...]}``).
        path: the PNG to write.
        title: the axes' title.
        details: a short name -> what the legend adds in parentheses (``"peak lr 0.003"``).
        validation_label: what the legend says the validation points are.
        half_width: the smoothed train curve averages ``2 * half_width + 1`` iterations.
        colors: one per run, in order.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    details = details or {}
    figure, axis = plt.subplots(figsize=(10, 6.4))
    shown: list[float] = []  # the values the loss axis must show
    caption, handles = [], []
    for (name, run), color in zip(runs.items(), colors, strict=False):
        iterations = [r["iteration"] for r in run["train"]]
        losses = [r["train_loss"] for r in run["train"]]
        smooth = moving_average(losses, half_width)
        axis.plot(iterations, losses, color=color, linewidth=0.7, alpha=0.3)
        axis.plot(iterations, smooth, color=color, linewidth=2.2)
        valid = _one_per_iteration(run["valid"])
        valid_x, valid_y = [r["iteration"] for r in valid], [r["valid_loss"] for r in valid]
        axis.plot(valid_x, valid_y, color=color, linestyle="--", linewidth=1.2, marker="o")
        if valid:
            axis.plot(
                valid_x[-1],
                valid_y[-1],
                marker="*",
                markersize=17,
                color=color,
                markeredgecolor="black",
                linestyle="none",
                zorder=5,
            )
            axis.annotate(
                f"{valid_y[-1]:.3f}",
                (valid_x[-1], valid_y[-1]),
                xytext=(9, -4),
                textcoords="offset points",
                color=color,
                fontweight="bold",
            )
        # the first iterations' steep fall (from ln 256 = 5.5 for bytes) stays off the axis
        shown += smooth[max(1, len(smooth) // 10) :] + valid_y
        label = f"{name} ({details[name]})" if name in details else name
        handles.append(Line2D([], [], color=color, linewidth=6, label=label))
        if valid and losses:
            figures = final_figures(run)
            caption.append(
                f"{name} train {figures['final_train_loss']:.3f}, "
                f"validation {figures['final_valid_loss']:.3f}"
            )
    if shown and max(shown) > min(shown):
        margin = 0.08 * (max(shown) - min(shown))
        axis.set_ylim(min(shown) - 2 * margin, max(shown) + margin)
    handles += [
        Line2D([], [], color="gray", linewidth=0.7, alpha=0.6, label="train loss, each iteration"),
        Line2D(
            [],
            [],
            color="gray",
            linewidth=2.2,
            label=f"train loss, moving average ({2 * half_width + 1} iterations)",
        ),
        Line2D([], [], color="gray", linestyle="--", marker="o", label=validation_label),
        Line2D(
            [],
            [],
            color="gray",
            marker="*",
            markersize=14,
            markeredgecolor="black",
            linestyle="none",
            label="final validation loss",
        ),
    ]
    axis.set_xlabel("iteration")
    axis.set_ylabel("cross-entropy loss (nats per token)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    last = max((r["iteration"] for run in runs.values() for r in run["train"]), default=0)
    axis.set_xlim(0, 1.1 * last if last else None)  # room for the final values' labels
    # under the axes: inside, some curve would always run under it
    figure.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.05),
        ncol=3,
        fontsize=9,
        frameon=False,
    )
    if caption:
        text = f"Iteration {last}: " + "; ".join(caption)
        text += f" (train: mean of the last {SMOOTHING_WINDOW} iterations)"
        figure.text(0.5, 0.015, text, ha="center", va="bottom", fontsize=10)
    figure.tight_layout(rect=(0, 0.15, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)
