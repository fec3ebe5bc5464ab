"""The two figures the README embeds: throughput per case, and step time against its three bounds."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

COLORS = {"ceiling": "#999999", "ceiling-recompute": "#bbbbbb", "plain": "#4c72b0", "ds2": "#dd8452", "ds3": "#c44e52",
          "slide": "#55a868"}


def _ran(records: list[dict]) -> list[dict]:
    """Cases with a throughput, grouped by model and shape so each comparison sits together."""
    ran = [r for r in records if r["ok"] and r.get("tokens_per_s")]
    return sorted(ran, key=lambda r: (r["params"], r["tokens_per_step"], r["system_key"]))


def plot_throughput(records: list[dict], path: Path) -> None:
    """Horizontal bars of tokens/s, one per case, coloured by system."""
    ran = _ran(records)
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(ran) + 1.5))
    labels = [r["case"] for r in ran]
    values = [r["tokens_per_s"] for r in ran]
    ax.barh(labels, values, color=[COLORS.get(r["system_key"], "#333333") for r in ran])
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:,.0f}", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (real tokens, steady state)")
    ax.set_title("Throughput per case (same run, same data)")
    _legend(ax, {r["system_key"]: r["system"] for r in ran})
    _save(fig, path)


def plot_bounds(records: list[dict], path: Path) -> None:
    """Per offload case: measured step time beside the GPU, PCIe and CPU-Adam bounds and the compute
    stream's idle time (exposed transfer + update)."""
    ran = [r for r in _ran(records) if r.get("bounds_s") and r["system_key"] in ("ds2", "ds3", "slide")]
    series = {
        "measured step": lambda r: r["step_s_mean"],
        "GPU compute bound": lambda r: r["bounds_s"].get("gpu_compute"),
        "PCIe bound": lambda r: r["bounds_s"].get("pcie"),
        "CPU-Adam bound": lambda r: r["bounds_s"].get("cpu_update"),
        "model's compute idle (profiled)": lambda r: (r.get("exposed_s") or {}).get("total"),
    }
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(ran) + 1.5))
    height = 0.8 / len(series)
    for i, (label, get) in enumerate(series.items()):
        values = [get(r) or 0.0 for r in ran]
        ax.barh([y + i * height for y in range(len(ran))], values, height=height, label=label)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(ran))], [r["case"] for r in ran], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title("Step time against the efficiency condition's three bounds (same run)")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def _legend(ax: plt.Axes, labels: dict[str, str]) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS.get(key, "#333333")) for key in labels]
    ax.legend(handles, list(labels.values()), fontsize=8, loc="lower right")


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
