"""PNG plots of a comparison: latency CDFs of the headline runs, goodput against rate."""
from __future__ import annotations

from pathlib import Path

_STYLE = {"disaggregated": ("tab:blue", "-"), "conditional": ("tab:green", "-"),
          "colocated": ("tab:red", "-"), "colocated_1x2": ("tab:orange", ":"),
          "colocated_2x1": ("tab:purple", ":")}


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        color, line = _STYLE.get(label, ("gray", "-"))
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], line, color=color, label=label)


def plot_all(result: dict, raw: dict, out_dir: Path) -> list[Path]:
    """Write `latency_cdf.png` and `goodput_<workload>.png`; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax_itl, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for label, s in raw.items():
        if label == "colocated":
            continue  # drawn as its variant, once
        _cdf(ax_itl, s["itl_ms"], label)
        _cdf(ax_ttft, s["ttft_ms"], label)
    for ax, what in ((ax_itl, "inter-token latency (ms)"), (ax_ttft, "time to first token (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of samples")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['workload']} at {result['rate']} req/s, {result['cores']} cores")
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    workloads = sorted({r["workload"] for r in result["runs"] if r["workload"] != "random_1024"})
    mixes = list(result["slo_mixes"])
    for wl in workloads:
        fig, axes = plt.subplots(1, len(mixes), figsize=(4 * len(mixes), 3.6), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for label in _STYLE:
                pts = sorted((r["rate"], r["goodput"][mix]) for r in result["runs"]
                             if r["workload"] == wl and r["deployment"] == label)
                if pts:
                    color, line = _STYLE[label]
                    ax.plot(*zip(*pts), line, marker="o", color=color, label=label)
            slo = result["slo_mixes"][mix]
            ax.set_title(f"{mix} (TTFT≤{slo['ttft_ms']:g} ms, ITL≤{slo['itl_ms']:g} ms)",
                         fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("goodput (req/s)")
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"goodput vs rate: {wl}")
        fig.tight_layout()
        paths.append(out_dir / f"goodput_{wl}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths
