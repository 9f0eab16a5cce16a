"""`kvrelay run PIPELINE --method relay`: every relayed span carries its hidden state at L_start.

RelayCaching recomputes a relayed span from L_start on, entering from the hidden state the upstream call
carried into that layer while it decoded. A runner built without the method's capture layers publishes
spans without those states, so relay silently recomputes them from layer 0 (``stats.note`` says how many
tokens): correct output, but the reuse the method exists for is lost.
"""


from kvrelay import cli
from kvrelay.pipeline import runner as runner_module

PIPELINE = """\
name: chain3
inputs: [question]
agents:
  - name: solver
    system: You solve problems.
    user: "{question}"
    max_new_tokens: 12
  - name: critic
    system: You check solutions.
    user: "Problem: {question}\\nSolution: {solver}\\nCheck it."
    max_new_tokens: 12
  - name: finalizer
    user: "Problem: {question}\\nSolution: {solver}\\nReview: {critic}\\nFinal answer?"
    max_new_tokens: 6
"""
RELAY = "relay[band=1:2:3]"  # random:tiny has 4 layers and no profile: the layers are given


def test_kvrelay_run_with_relay_recomputes_nothing_from_layer_0(tmp_path, monkeypatch, capsys):
    path = tmp_path / "chain3.yaml"
    path.write_text(PIPELINE)
    runs = []
    real_run = runner_module.PipelineRunner.run

    def recording_run(self, *args, **kwargs):
        results = real_run(self, *args, **kwargs)
        runs.append(results)
        return results

    monkeypatch.setattr(runner_module.PipelineRunner, "run", recording_run)
    code = cli.main(["run", str(path), "--method", RELAY, "--model", "random:tiny",
                     "--input", "question=Tom has 3 apples and buys 4 more. How many?"])
    assert code == 0
    out = capsys.readouterr().out
    assert all(f"=== {name} [{RELAY}:" in out for name in ("solver", "critic", "finalizer"))
    (results,) = runs
    downstream = [results[name].output.stats for name in ("critic", "finalizer")]
    assert all(s.num_reused_tokens > 0 for s in downstream)  # there is something to relay
    assert [s.note for s in downstream] == [None, None], "relay recomputed spans from layer 0"
