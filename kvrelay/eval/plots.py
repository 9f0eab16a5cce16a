"""Bench plots (matplotlib, PNG): TTFT by agent position; fidelity against reuse."""

from __future__ import annotations

from pathlib import Path


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['workload']}-{result['mode']}".replace(":", "-")  # copy-agents:5 -> copy-agents-5
    results = result["results"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, s in results.items():
        agents = sorted(s["by_agent"].values(), key=lambda b: b["position"])
        ax.plot([b["position"] + 1 for b in agents], [b["ttft_ms_median"] for b in agents], marker="o", label=method)
    ax.set_xlabel("agent position")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(f"{result['workload']} on {result['model']} ({result['env']['device']})")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(out_dir / f"{stem}-ttft-by-agent.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if result.get("fidelity_meaningful", True) and result["mode"] == "agent":
        fig, ax = plt.subplots(figsize=(9, 4.5))
        colors = plt.get_cmap("tab20")
        for i, (method, s) in enumerate(results.items()):
            color = colors(i % 20)
            ax.scatter(s["reuse_rate"], s["greedy_match_rate"], marker="o", s=60, color=color,
                       label=f"{method}: greedy@G (o), 1st token (x)")
            ax.scatter(s["reuse_rate"], s["first_token_agreement"], marker="x", s=60, color=color)
        ax.set_xlabel("reuse rate (token-layers)")
        ax.set_ylabel("fidelity vs full")
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"fidelity vs reuse: {result['workload']} ({result['model']}, {result['n']} problems)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        ax.grid(alpha=0.3)
        paths.append(out_dir / f"{stem}-fidelity-vs-reuse.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
