"""Compiled grammars are cached per namespace (kvrelay.server.grammar_cache) and nowhere else: a namespace's repeat
takes its own compiled grammar, another namespace compiles its own (so its latency says nothing of what others
compiled), the grammar library keeps no cache of its own, and the cache is bounded in bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

import kvrelay.server.grammar as grammar
from kvrelay.server.grammar_cache import GrammarCache, grammar_key
from kvrelay.server.tool_protocol import FunctionDef
from kvrelay.server.tools import ToolPlan
from tests.server.inproc import MODEL, make_app

FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_app(default_max_tokens=2), raise_server_exceptions=False) as c:
        yield c



def _ask(client: TestClient, salt: str, **body) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt,
            **body}
    r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [{"response_format": FORMAT}, {"tools": TOOLS},
                                  {"tools": TOOLS, "tool_choice": "required", "response_format": FORMAT}],
                         ids=["response_format", "tools", "both"])
def test_a_namespace_reuses_its_own_grammar_and_no_other_s(client, compiled, body):
    salt = f"grammar-cache-{len(json.dumps(body))}"
    _ask(client, salt + "-a", **body)
    _ask(client, salt + "-a", **body)
    assert len(compiled) == 1  # the repeat took the namespace's own compiled grammar
    _ask(client, salt + "-b", **body)
    assert len(compiled) == 2  # another namespace compiled its own
    assert grammar.vocabulary(client.app.state.context.tokenizer).compiler.get_cache_size_bytes() == 0


def test_a_different_grammar_is_compiled_anew(client, compiled):
    _ask(client, "grammar-cache-formats", response_format=FORMAT)
    _ask(client, "grammar-cache-formats", response_format={"type": "json_object"})
    _ask(client, "grammar-cache-formats", tools=TOOLS, tool_choice="required")
    assert len(compiled) == 3


def test_the_cache_is_bounded_in_bytes_least_recently_used_first_out():
    cache = GrammarCache(max_bytes=100)
    cache.put("a", "k1", "g1", 40)
    cache.put("b", "k1", "g2", 40)
    assert cache.get("a", "k1") == "g1" and cache.get("b", "k2") is None and cache.get("c", "k1") is None
    cache.put("c", "k3", "g3", 40)  # over the bound: b's entry, the least recently used, goes
    assert cache.get("b", "k1") is None and cache.get("a", "k1") == "g1" and cache.get("c", "k3") == "g3"
    assert cache.num_bytes == 80 and len(cache) == 2
    cache.put("d", "k4", "g4", 101)  # alone over the bound: not kept, nothing dropped for it
    assert cache.get("d", "k4") is None and len(cache) == 2


def test_a_key_is_a_fixed_size_digest_whatever_the_tools_descriptions():
    """Keys are not counted in the byte bound: a key holding the tools' text would let long descriptions grow it."""
    long_plan = ToolPlan((FunctionDef(name="f", description="d" * 100_000),), "auto")
    short_plan = ToolPlan((FunctionDef(name="f", description="d"),), "auto")
    assert len(grammar_key(long_plan, None)) == len(grammar_key(short_plan, None)) == 64
    assert grammar_key(long_plan, None) != grammar_key(short_plan, None)


def test_a_namespace_s_repeated_tools_skip_the_compile_turn(client, monkeypatch):
    """An agent sends its tools with every step: the first step's checked plan is its namespace's, so a later step
    waits for no compile turn (a long compile of the same tenant held every step's schema checks); another
    namespace, or another tool_choice, checks its own."""
    turns = []
    real = client.app.state.context.compiles.run
    monkeypatch.setattr(client.app.state.context.compiles, "run", lambda *a: turns.append(a[1]) or real(*a))
    for salt, choice in (("a", "auto"), ("a", "auto"), ("b", "auto"), ("a", "required")):
        _ask(client, f"plan-cache-{salt}", tools=TOOLS, tool_choice=choice)
    names = [getattr(fn, "__name__", "") for fn in turns]
    assert names.count("plan_tools") == 3, names
