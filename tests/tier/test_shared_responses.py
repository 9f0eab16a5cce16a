"""Stored responses on a shared tier: two server apps (replicas) on one real Redis, driven by the official openai
client; a response stored by one is continued, read, listed and deleted by the other, in its namespace only."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import openai
import pytest
from starlette.testclient import TestClient

from kvrelay.cache.tenancy import namespace_for
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.context import digest
from kvrelay.tier.tiered import open_store
from kvrelay.weights.loader import load_model

MODEL = "random:tiny"


@contextmanager
def replicas(url: str, count: int = 2) -> Iterator[list[tuple[openai.OpenAI, object]]]:
    """``count`` apps on the store ``url``, each as (openai client, app)."""
    lm = load_model(MODEL)
    with ExitStack() as stack:
        out = []
        for _ in range(count):
            store = open_store(url, 1 << 26, fingerprint=lm.fingerprint)
            catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode)
            app = create_app(Engine(lm, store, methods=("full",)), catalog, ServerSettings(method="full"))
            http = stack.enter_context(TestClient(app, base_url="http://testserver"))
            out.append((openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                      max_retries=0), app))
        yield out


def create(client: openai.OpenAI, salt: str, **kw):
    extra = {"cache_salt": salt, "kvrelay": {"debug": True}}
    return client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, extra_body=extra, **kw)


def test_a_response_stored_on_one_replica_is_continued_read_and_listed_on_the_other(redis_url):
    with replicas(redis_url) as [(a, app_a), (b, app_b)]:
        ns = uuid.uuid4().hex
        r1 = create(a, ns, instructions="Be brief.", input="Name a colour.")
        on_b = create(b, ns, input="And another?", previous_response_id=r1.id)
        on_a = create(a, ns, input="And another?", previous_response_id=r1.id)
        # the conversation b built is the one a builds: the same messages, the same prompt
        assert on_b.model_extra["kvrelay"]["debug"]["prompt_ids"] == on_a.model_extra["kvrelay"]["debug"]["prompt_ids"]
        namespace = namespace_for(None, digest(ns))  # the store's namespace of cache_salt ``ns``
        kept_b, kept_a = app_b.state.responses.get(namespace, on_b.id), app_a.state.responses.get(namespace, on_a.id)
        assert kept_b.messages[:-1] == kept_a.messages[:-1] and len(kept_a.messages) == 4
        assert b.responses.retrieve(r1.id, extra_query={"cache_salt": ns}).model_dump() == r1.model_dump()
        items_b = b.responses.input_items.list(r1.id, extra_query={"cache_salt": ns})
        items_a = a.responses.input_items.list(r1.id, extra_query={"cache_salt": ns})
        assert [i.model_dump() for i in items_b.data] == [i.model_dump() for i in items_a.data] != []
        # a streamed response is stored before its last event: the other replica knows it at once
        events = list(a.responses.create(model=MODEL, input="Hi.", max_output_tokens=3, stream=True,
                                         extra_body={"cache_salt": ns}))
        assert events[-1].type in ("response.completed", "response.incomplete")
        streamed = events[-1].response
        assert b.responses.retrieve(streamed.id, extra_query={"cache_salt": ns}).id == streamed.id


def test_delete_on_one_replica_makes_the_response_unknown_on_both(redis_url):
    with replicas(redis_url) as [(a, _), (b, _)]:
        ns = uuid.uuid4().hex
        r1 = create(a, ns, input="Name a colour.")
        assert a.responses.retrieve(r1.id, extra_query={"cache_salt": ns}).id == r1.id  # a's local copy
        assert b.responses.delete(r1.id, extra_query={"cache_salt": ns}) is None
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(r1.id, extra_query={"cache_salt": ns})
        with pytest.raises(openai.BadRequestError) as err:
            create(a, ns, input="more", previous_response_id=r1.id)
        assert err.value.body["code"] == "previous_response_not_found"
        for client in (a, b):
            with pytest.raises(openai.NotFoundError):
                client.responses.delete(r1.id, extra_query={"cache_salt": ns})


def _errors(client: openai.OpenAI, salt: str, response_id: str) -> list[tuple[int, dict]]:
    """Each route's error for ``response_id`` in namespace ``salt``, the id itself replaced by a placeholder."""
    calls = [lambda: client.responses.retrieve(response_id, extra_query={"cache_salt": salt}),
             lambda: client.responses.input_items.list(response_id, extra_query={"cache_salt": salt}),
             lambda: client.responses.delete(response_id, extra_query={"cache_salt": salt}),
             lambda: create(client, salt, input="more", previous_response_id=response_id)]
    out = []
    for call in calls:
        with pytest.raises(openai.APIStatusError) as err:
            call()
        out.append((err.value.status_code, eval(repr(err.value.body).replace(response_id, "ID"))))
    return out


def test_another_namespace_sees_nothing_and_keys_name_no_tenant(redis_url, redis_server):
    with replicas(redis_url) as [(a, _), (b, _)]:
        ns, other = uuid.uuid4().hex, uuid.uuid4().hex
        r1 = create(a, ns, input="Name a colour.")
        assert _errors(b, other, r1.id) == _errors(b, other, "resp_" + uuid.uuid4().hex)
        assert [status for status, _ in _errors(b, other, r1.id)] == [404, 404, 404, 400]
        assert b.responses.retrieve(r1.id, extra_query={"cache_salt": ns}).id == r1.id  # still there for its owner
        raw = redis_server.client()
        keys = [k.decode() for k in raw.keys("*")]
        names = (ns, other, r1.id, namespace_for(None, digest(ns)), namespace_for(None, digest(other)))
        assert keys and not any(name in k for name in names for k in keys)


def test_redis_down_is_a_503_for_stored_ids_and_they_are_known_again_once_it_is_back(own_redis, caplog):
    import signal

    with replicas(own_redis.url) as [(a, app_a), (b, app_b)]:
        ns = uuid.uuid4().hex
        r1 = create(a, ns, input="Name a colour.")
        own_redis.proc.send_signal(signal.SIGSTOP)  # it still holds r1, and answers nothing
        try:
            with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
                errors = _errors(a, ns, r1.id) + _errors(b, ns, r1.id)  # a's own local copy too: not the tier's word
                fresh = create(b, ns, input="Still serving?")  # a response is served, not stored, and says so
                assert fresh.status in ("completed", "incomplete") and fresh.store is False
                events = list(b.responses.create(model=MODEL, input="Hi.", max_output_tokens=3, stream=True,
                                                 extra_body={"cache_salt": ns}))
                assert events[0].response.store is True  # asked for; known to fail only once it is tried
                assert events[-1].type in ("response.completed", "response.incomplete")
                assert events[-1].response.store is False
                with pytest.raises(openai.InternalServerError) as err:
                    b.responses.retrieve(fresh.id, extra_query={"cache_salt": ns})
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        assert [status for status, _ in errors] == [503] * 8
        assert {body["code"] for _, body in errors} == {"tier_unavailable"}
        assert {body["type"] for _, body in errors} == {"server_error"}
        assert "shared tier" in errors[0][1]["message"] and "ID" not in errors[0][1]["message"]
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "5"
        assert caplog.text.count("unavailable") == 2  # once per replica's outage, never per request
        for app in (app_a, app_b):  # each replica's prober finds Redis answering again
            health = app.state.responses.records.health
            health.probe_thread.join(30.0)
            assert health.up
        for client in (a, b):  # the tier still held r1: known again on both
            assert client.responses.retrieve(r1.id, extra_query={"cache_salt": ns}).id == r1.id
        with pytest.raises(openai.NotFoundError):  # created while the tier was down: never stored
            b.responses.retrieve(fresh.id, extra_query={"cache_salt": ns})
