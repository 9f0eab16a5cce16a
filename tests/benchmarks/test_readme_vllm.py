"""README's summary of the vLLM runs spans what the committed runs measured: each range there is the lowest and
the highest value over the runs of 12 problems that BENCHMARKS.md's "On vLLM" section reports."""

from __future__ import annotations

from pathlib import Path

from table_render import load

README = Path(__file__).resolve().parents[2] / "README.md"
# gsm8k-chain3 and mmlu-doc3 through vLLM's OpenAI server, the connector at its default (epic) or on relay
CHAIN_EPIC = ("vllm-chain-cpu-defaults.json", "vllm-chain-cpu-parts.json", "vllm-chain-cpu-parts-b.json",
              "vllm-chain-cpu-layers.json", "vllm-chain-cpu-epic56.json")
CHAIN_RELAY = ("vllm-chain-cpu-relay.json",)
DOC_EPIC = ("vllm-doc-cpu-defaults.json", "vllm-doc-cpu-epic.json")
DOC_RELAY = ("vllm-doc-cpu-relay.json",)


def readme() -> str:
    return " ".join(README.read_text().split())


def connector(files: tuple[str, ...], agents: tuple[str, ...]) -> list[tuple[dict, dict]]:
    """(the agent's row, the connector's numbers on it) per run and agent."""
    return [(row, row["connector"]) for d in map(load, files) for agent, row in d["by_agent"].items()
            if agent in agents]


def span(values, spec: str) -> str:
    return f"{format(min(values), spec)}-{format(max(values), spec)}"


def test_the_chain_summary_spans_its_runs():
    text = readme()
    for agent in ("critic", "finalizer"):
        ratios = [c["ttft_ratio_median"] for _, c in connector(CHAIN_EPIC, (agent,))]
        assert f"{span(ratios, '.2f')}x ({agent})" in text
    epic = connector(CHAIN_EPIC, ("critic", "finalizer"))
    cached = [100 * c["cached_tokens_mean"] / row["prompt_tokens_mean"] for row, c in epic]
    assert f"{span(cached, '.0f')}% of their prompt tokens" in text
    assert f"KL {span([c['kl_first_token_top_mean'] for _, c in epic], '.3f')} against plain vLLM" in text
    relay = [c for _, c in connector(CHAIN_RELAY, ("critic", "finalizer"))]
    kls, ratios = [c["kl_first_token_top_mean"] for c in relay], [c["ttft_ratio_median"] for c in relay]
    assert f"KL {span(kls, '.4f')} at {ratios[0]:.2f}x and {ratios[1]:.2f}x" in text


def test_the_document_flow_summary_spans_its_runs():
    text = readme()
    agents = ("answerer", "checker")
    for files, method in ((DOC_EPIC, "epic"), (DOC_RELAY, "relay")):
        assert f"{span([c['ttft_ratio_median'] for _, c in connector(files, agents)], '.2f')}x (`{method}`)" in text
    kls = [c["kl_first_token_top_mean"] for _, c in connector(DOC_EPIC + DOC_RELAY, agents)]
    assert f"KL {span(kls, '.3f')}" in text
    shorter = [100 * (1 - d["by_side"]["connector"]["chain_ms_total"] / d["by_side"]["plain"]["chain_ms_total"])
               for d in map(load, DOC_EPIC + DOC_RELAY)]
    assert f"the whole flow {span(shorter, '.0f')}% shorter" in text
