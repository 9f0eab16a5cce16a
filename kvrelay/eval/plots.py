"""Bench plots (matplotlib, PNG): TTFT by agent; fidelity against reuse.

Each figure has one legend, of method names, with one color per method shared by both figures.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    """matplotlib.pyplot on the file backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def agent_order(results: dict[str, dict]) -> list[str]:
    """The downstream agents of a result, in run order (by position; every method's agents merged)."""
    position: dict[str, int] = {}
    for s in results.values():
        for agent, b in s["by_agent"].items():
            position.setdefault(agent, b["position"])
    return sorted(position, key=position.__getitem__)


def ttft_by_agent_figure(result: dict):
    """Grouped bars: x = the agent names, one bar per method (median TTFT), one legend of methods."""
    plt = _pyplot()
    results = result["results"]
    agents = agent_order(results)
    colors = method_colors(list(results))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(results)
    for i, (method, s) in enumerate(results.items()):
        xs = [a + (i - (len(results) - 1) / 2) * width for a in range(len(agents))]
        ys = [s["by_agent"][a]["ttft_ms_median"] if a in s["by_agent"] else 0.0 for a in agents]
        bars = ax.bar(xs, ys, width, color=colors[method], label=method)
        speedups = [f"{s['by_agent'][a]['speedup_vs_full']:.1f}x" if a in s["by_agent"] else "" for a in agents]
        ax.bar_label(bars, labels=speedups, fontsize=7, padding=1)
    ax.set_xticks(range(len(agents)), agents)
    ax.set_xlabel("agent (downstream calls; bar label: speedup vs full)")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(f"{result['workload']} on {result['model']} ({result['env']['device']}, {result['n']} problems)")
    ax.legend(title="method", ncols=min(len(results), 4), fontsize=8, loc="upper left")
    ax.margins(y=0.2)  # room above the bars for the legend and the speedup labels
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def fidelity_figure(result: dict):
    """Fidelity against reuse: one point per method and measure (o greedy@G, x first token), one legend."""
    from matplotlib.lines import Line2D

    plt = _pyplot()

    results = result["results"]
    colors = method_colors(list(results))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, s in results.items():
        ax.scatter(s["reuse_rate"], s["greedy_match_rate"], marker="o", s=60, color=colors[method])
        ax.scatter(s["reuse_rate"], s["first_token_agreement"], marker="x", s=60, color=colors[method])
    handles = [Line2D([], [], color=colors[m], marker="s", linestyle="", label=m) for m in results]
    handles += [Line2D([], [], color="gray", marker="o", linestyle="", label="greedy match"),
                Line2D([], [], color="gray", marker="x", linestyle="", label="first token")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_xlabel("reuse rate (token-layers)")
    ax.set_ylabel("fidelity vs full")
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"fidelity vs reuse: {result['workload']} ({result['model']}, {result['n']} problems)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def method_colors(methods: list[str]) -> dict[str, tuple]:
    cmap = _pyplot().get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['workload']}-{result['mode']}".replace(":", "-")  # copy-agents:5 -> copy-agents-5
    figures = [("ttft-by-agent", ttft_by_agent_figure(result))]
    if result.get("fidelity_meaningful", True) and result["mode"] == "agent":
        figures.append(("fidelity-vs-reuse", fidelity_figure(result)))
    paths = []
    for name, fig in figures:
        paths.append(out_dir / f"{stem}-{name}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
