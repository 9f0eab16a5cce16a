"""Two `kvrelay serve` replicas on one shared disk tier: an agent served by one reuses what an agent served
by the other returned, spliced as its generated ids, from its first request on."""

import uuid

from tests.server.conftest import MODEL, start_servers
from tests.server.test_reuse import QUESTION


def test_a_replica_splices_and_reuses_the_others_completion(tmp_path):
    store = f"disk:{tmp_path / 'tier'}"
    a, b = start_servers(("--store", store, "--method", "naive"), ("--store", store, "--method", "naive"))
    try:
        ns = uuid.uuid4().hex
        extra = {"cache_salt": ns, "kvrelay": {"debug": True}}
        solver = [{"role": "system", "content": "You are a careful math solver."},
                  {"role": "user", "content": QUESTION}]
        r1 = a.client().chat.completions.create(model=MODEL, messages=solver, max_tokens=24, temperature=0,
                                                extra_body=extra)
        d1 = r1.model_extra["kvrelay"]["debug"]
        critic = [{"role": "system", "content": "You check math solutions and point out errors."},
                  {"role": "user", "content": f"Problem:\n{QUESTION}\n\nSolution:\n{r1.choices[0].message.content}"
                                              "\n\nIs it right?"}]
        r2 = b.client().chat.completions.create(model=MODEL, messages=critic, max_tokens=8, temperature=0,
                                                extra_body=extra)  # b's first request in this namespace
        d2 = r2.model_extra["kvrelay"]["debug"]
        outputs = [ref for ref in d2["refs"] if ref["kind"] == "output"]
        assert [(ref["span_id"], ref["src_start"]) for ref in outputs] == [(d1["span_id"], len(d1["prompt_ids"]))]
        ref = outputs[0]
        assert d2["prompt_ids"][ref["start"]:ref["end"]] == d1["output_ids"][:ref["end"] - ref["start"]]
        assert r2.usage.prompt_tokens_details.cached_tokens >= ref["end"] - ref["start"]
        other = b.client().chat.completions.create(  # another tenant on b finds nothing of a's
            model=MODEL, messages=critic, max_tokens=4, temperature=0,
            extra_body={"cache_salt": uuid.uuid4().hex, "kvrelay": {"debug": True}})
        assert other.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        a.stop()
        b.stop()
