"""Two vLLM servers, each with kvrelay's connector on one real Redis: an agent's call to the first, then a
downstream call quoting its output to the second, which loads the first's span from Redis. Driven by the
``openai`` client over vLLM's own OpenAI server; a gsm8k-chain3 problem (solver, then critic).

Slow (two vLLM servers start, in parallel; minutes on a loaded 2-core machine): ``make vllm-test``, not CI.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

# the span's announcement reaches Redis after the first server answers (its store runs in the background)
PUBLISH_TIMEOUT_S = 300.0
MAX_TOKENS = {"solver": 48, "critic": 16}


@pytest.fixture(scope="module")
def redis_url():
    from tests.tier.conftest import RedisServer

    server = RedisServer(maxmemory="512mb").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def servers(vllm_server_factory, redis_url):
    config = {"kv_connector": "KVRelayConnector", "kv_connector_module_path": "kvrelay.vllm.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"method": "epic", "store": redis_url}}
    with ThreadPoolExecutor(2) as pool:  # waits for both starts; every server started is stopped by the factory
        starts = [pool.submit(vllm_server_factory, config, extra_args=("--enable-prompt-tokens-details",))
                  for _ in range(2)]
        return [start.result() for start in starts]


def wait_published(redis_url: str, salt: str) -> None:
    """Until a span of ``salt``'s namespace is announced in Redis (the tier's key for the announcements)."""
    import redis

    from kvrelay.vllm.connector import namespace_of

    pattern = f"kvrelay:v1-{hashlib.sha256(namespace_of(salt).encode()).hexdigest()[:16]}-*-published"
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    deadline = time.monotonic() + PUBLISH_TIMEOUT_S
    try:
        while not any(client.scan_iter(match=pattern)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no span announced for the salt within {PUBLISH_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
    finally:
        client.close()


def test_a_span_stored_by_one_vllm_server_is_loaded_by_another_through_redis(servers, redis_url):
    from benchmarks.vllm_chain import chat
    from kvrelay.pipeline.workloads import gsm8k_chain3

    first, second = servers
    workload = gsm8k_chain3()
    values = {"question": workload.problems(None, 1)[0].inputs["question"]}

    def messages(name: str) -> list[dict[str, str]]:
        agent = workload.spec.agent(name)
        return [{"role": "system", "content": agent.system}, {"role": "user", "content": agent.user.format(**values)}]

    salt = uuid.uuid4().hex
    solver = chat(first.client(), first.model, messages("solver"), MAX_TOKENS["solver"], salt)
    assert solver["cached_tokens"] == 0  # nothing stored in this salt yet
    values["solver"] = solver["text"]
    wait_published(redis_url, salt)
    critic = messages("critic")
    # the second server has seen no request of this salt: what it reports cached is the first server's span
    out = chat(second.client(), second.model, critic, MAX_TOKENS["critic"], salt)
    assert out["cached_tokens"] >= 16, out
    # the same messages in another salt: nothing of the first salt's spans is found
    assert chat(second.client(), second.model, critic, 1, uuid.uuid4().hex)["cached_tokens"] == 0
