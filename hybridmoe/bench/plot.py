"""The PNG of `hybridmoe bench serving`: output throughput and latency (TTFT, ITL, E2E p50) against
concurrency. matplotlib is optional (`pip install hybridmoe[bench]`); without it, one line says so."""

from __future__ import annotations


def plot_levels(levels: list[dict], path: str, title: str = "") -> str:
    """Write the PNG; the line to print (where it went, or why there is none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    conc = [r["concurrency"] for r in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(conc, [r["output_throughput"] for r in levels], "o-", label="output tokens/s")
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("tokens/s")
    ax1.set_xscale("log", base=2)
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    for key, label in (("ttft_ms_p50", "TTFT p50"), ("itl_ms_p50", "ITL p50"), ("e2e_ms_p50", "E2E p50")):
        ax2.plot(conc, [r[key] for r in levels], "o-", label=label)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("ms")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"
