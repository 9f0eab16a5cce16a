"""The bounded, per-namespace store of ``/v1/responses`` (no server)."""

from __future__ import annotations

import json

import pytest

from kvrelay.server.response_store import ResponseStore, ResponseStoreConfig


def put(store: ResponseStore, namespace: str, rid: str, text: str = "x") -> bool:
    return store.put(namespace, rid, [{"role": "user", "content": text}], {"id": rid})


def test_namespaces_do_not_see_each_other():
    store = ResponseStore()
    put(store, "a", "r1")
    assert store.get("a", "r1").response == {"id": "r1"}
    assert store.get("b", "r1") is None and store.delete("b", "r1") is False
    assert store.delete("a", "r1") is True and store.get("a", "r1") is None and store.num_bytes == 0


def test_one_namespace_evicts_only_its_own_least_recent():
    store = ResponseStore(ResponseStoreConfig(max_per_namespace=2))
    put(store, "other", "keep")
    put(store, "a", "r1")
    put(store, "a", "r2")
    store.get("a", "r1")  # r1 is now the more recent
    put(store, "a", "r3")
    assert store.get("a", "r2") is None and store.get("a", "r1") and store.get("a", "r3")
    assert store.get("other", "keep") is not None and len(store) == 3


def test_the_byte_budget_evicts_least_recent_first_and_refuses_what_cannot_fit():
    one = len(json.dumps([{"role": "user", "content": "x" * 100}])) + len(json.dumps({"id": "r0"})) + len("[]")
    store = ResponseStore(ResponseStoreConfig(max_bytes=2 * one))
    put(store, "a", "r0", "x" * 100)
    put(store, "b", "r1", "x" * 100)
    put(store, "c", "r2", "x" * 100)
    assert store.get("a", "r0") is None and store.get("b", "r1") and store.get("c", "r2")
    assert store.num_bytes <= 2 * one
    assert put(store, "a", "big", "x" * (3 * one)) is False and store.get("a", "big") is None


def test_replacing_an_id_does_not_count_it_twice():
    store = ResponseStore()
    put(store, "a", "r")
    before = store.num_bytes
    put(store, "a", "r")
    assert store.num_bytes == before and len(store) == 1


def test_config_is_validated():
    with pytest.raises(ValueError):
        ResponseStoreConfig(max_per_namespace=0)


def test_the_input_items_count_in_a_responses_bytes():
    messages, response = [{"role": "user", "content": "x"}], {"id": "r"}
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "y" * 500}]}]
    store = ResponseStore()
    store.put("a", "without", messages, response)
    store.put("b", "with", messages, response, items)
    assert store.get("b", "with").input_items == items
    assert store.get("b", "with").num_bytes - store.get("a", "without").num_bytes == len(json.dumps(items)) - len("[]")
    assert store.num_bytes == store.get("a", "without").num_bytes + store.get("b", "with").num_bytes
    assert not ResponseStore(ResponseStoreConfig(max_bytes=500)).put("a", "r", messages, response, items)
