"""`treadle sim scale --plot DIR`: a sweep's figures as PNG files (matplotlib, headless).

    utilisation.png   each component's utilisation against the fleet's GPUs (the pools that
                      grow with it and the shared ones that do not), the saturation line, and
                      the trained tokens per second per GPU against the first size
    weight_sync.png   seconds until the last replica holds a new 7B and a 235B version, per
                      fan-out (store, relay, broadcast), against the rollout replicas

Drawn from `scale.sweep`'s result only, so a figure shows exactly what the JSON says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle_sim.scale import FANOUTS, SATURATED, SYNC_MODELS


def write(result: dict[str, Any], directory: Path) -> list[Path]:
    """The sweep's figures into `directory` (created); their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    directory.mkdir(parents=True, exist_ok=True)
    return [
        _utilisation(result, directory / "utilisation.png"),
        _weight_sync(result, directory / "weight_sync.png"),
    ]


def _utilisation(result: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    gpus = [r["gpus"] for r in rows]
    title = f"{result['scenario']} (fan-out {result['fanout']}, seed {result['seed']})"
    fig, (used_ax, per_gpu_ax) = plt.subplots(
        2, 1, figsize=(7, 7), sharex=True, height_ratios=(3, 1.2)
    )
    for name in rows[0]["utilisation"]:
        values = [r["utilisation"][name] for r in rows]
        used_ax.plot(gpus, values, marker="o", label=name)
    used_ax.axhline(SATURATED, color="grey", linestyle="--", linewidth=1)
    used_ax.text(gpus[0], SATURATED, f" saturated ({SATURATED})", va="bottom", color="grey")
    first = result.get("first_saturating")
    if first is not None and result["saturates_at_gpus"].get(first):
        at = result["saturates_at_gpus"][first]
        used_ax.set_title(f"{title}\nfirst to saturate: {first} at ~{at:,} GPUs", fontsize=10)
    else:
        used_ax.set_title(f"{title}\nnothing saturates at these sizes", fontsize=10)
    used_ax.set_ylabel("utilisation")
    used_ax.legend(fontsize=8, ncol=3)
    used_ax.grid(alpha=0.3)
    per_gpu = [r["tokens_per_gpu_vs_first"] or 0.0 for r in rows]
    per_gpu_ax.plot(gpus, per_gpu, marker="o", color="k")
    per_gpu_ax.set_ylim(0, max(1.1, max(per_gpu) * 1.1))  # from 0: a drop reads as its size
    per_gpu_ax.set_ylabel("tokens/s per GPU\nvs the first size")
    per_gpu_ax.set_xlabel("GPUs")
    per_gpu_ax.grid(alpha=0.3)
    _sizes_axis(per_gpu_ax, gpus)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _weight_sync(result: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    replicas = [r["rollout_replicas"] for r in rows]
    fig, axes = plt.subplots(1, len(SYNC_MODELS), figsize=(9, 3.8))
    for ax, model in zip(axes, SYNC_MODELS, strict=True):
        for fanout in FANOUTS:
            seconds = [r["weight_sync_s"][model][fanout]["sync_s"] for r in rows]
            ax.plot(replicas, seconds, marker="o", label=fanout)
        ax.set_title(f"{model.upper()} (bf16), a full version", fontsize=10)
        ax.set_xlabel("rollout replicas")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        _sizes_axis(ax, replicas)
    axes[0].set_ylabel("seconds until the last replica holds it")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"weight sync, {result['scenario']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sizes_axis(ax: Any, sizes: list[int]) -> None:
    """An x axis ticked at the sizes simulated (logarithmic over a tenfold range or more)."""
    if len(sizes) > 1 and max(sizes) / min(sizes) >= 10:
        ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.minorticks_off()
