"""Bench plots: x axis = agent names, one legend of method names per figure (read back from matplotlib)."""

from kvrelay.eval.plots import agent_order, fidelity_figure, ttft_by_agent_figure, write_plots
from kvrelay.eval.report import CallRow, summarize


def _result(methods=("full", "prefix", "epic"), agents=("critic", "finalizer")) -> dict:
    rows = []
    for problem in ("p0", "p1"):
        # agents given out of run order: the plot must order them by position, not by first appearance
        for position, agent in sorted(enumerate(agents, start=1), key=lambda pa: -pa[0]):
            for i, m in enumerate(methods):
                rows.append(CallRow(problem, agent, position, m, 100, 10, 50.0 / (i + 1), 50.0, 50.0, 10.0,
                                    100, 10 * i, 10 * i, 0, True, 0.0, i < 2, None, 0.5))
    return {"workload": "gsm8k-chain3", "mode": "agent", "model": "random:tiny", "n": 2,
            "env": {"device": "cpu"}, "fidelity_meaningful": True, "results": summarize(rows)}


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_ttft_x_ticks_are_the_agent_names_in_run_order():
    fig = ttft_by_agent_figure(_result(agents=("solver_b", "critic", "finalizer")))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["solver_b", "critic", "finalizer"]
    _close(fig)


def test_each_figure_has_one_legend_of_the_method_names():
    result = _result()
    for make in (ttft_by_agent_figure, fidelity_figure):
        fig = make(result)
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + fig.legends
        assert len(legends) == 1, make.__name__
        texts = [t.get_text() for t in legends[0].get_texts()]
        assert texts[:3] == ["full", "prefix", "epic"], make.__name__
        _close(fig)


def test_ttft_bars_are_the_medians_and_colors_match_across_figures():
    result = _result()
    ttft, fid = ttft_by_agent_figure(result), fidelity_figure(result)
    bars = ttft.axes[0].containers  # one BarContainer per method, in method order
    assert [round(b.get_height(), 6) for b in bars[2]] == [round(50.0 / 3, 6)] * 2
    ttft_colors = [h.get_facecolor() for h in ttft.axes[0].get_legend().legend_handles]
    fid_colors = [h.get_color() for h in fid.axes[0].get_legend().legend_handles[:3]]
    from matplotlib.colors import to_rgba

    assert [to_rgba(c) for c in ttft_colors] == [to_rgba(c) for c in fid_colors]
    _close(ttft)
    _close(fid)


def test_agent_order_merges_methods():
    result = _result()
    del result["results"]["epic"]["by_agent"]["critic"]
    assert agent_order(result["results"]) == ["critic", "finalizer"]


def test_write_plots_writes_both_pngs(tmp_path):
    paths = write_plots(_result(), tmp_path)
    assert [p.name for p in paths] == ["gsm8k-chain3-agent-ttft-by-agent.png",
                                       "gsm8k-chain3-agent-fidelity-vs-reuse.png"]
    assert all(p.stat().st_size > 0 for p in paths)
