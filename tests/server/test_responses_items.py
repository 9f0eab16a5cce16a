"""``GET /v1/responses/{id}/input_items`` through the official client's ``responses.input_items.list``: the items a
stored response was generated from, paged as OpenAI pages them, and only in the namespace that stored it."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvrelay.server.responses_items import input_items
from tests.server.conftest import MODEL
from tests.server.test_responses_api import create, salt

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"city": "Oslo"}'}
INPUT = [{"role": "developer", "content": "Answer briefly."},
         {"role": "user", "content": [{"type": "input_text", "text": "What time "},
                                      {"type": "input_text", "text": "is it in Oslo?"}]},
         CALL, {"type": "function_call_output", "call_id": "call_1", "output": "09:30"}]


def items_of(server, response_id: str, ns: str, **kw) -> list:
    return list(server.client().responses.input_items.list(response_id, extra_query={"cache_salt": ns}, **kw))


def test_the_items_of_a_response_newest_first_by_default(server):
    ns = salt()
    r = create(server, input=INPUT, salt=ns)
    newest_first = items_of(server, r.id, ns)
    oldest_first = items_of(server, r.id, ns, order="asc")
    assert [i.id for i in newest_first] == [i.id for i in reversed(oldest_first)]
    assert len({i.id for i in oldest_first}) == 4 and all(i.id for i in oldest_first)
    developer, user, call, output = oldest_first
    assert (developer.type, developer.role, developer.content[0].type, developer.content[0].text) == \
        ("message", "developer", "input_text", "Answer briefly.")
    assert [(p.type, p.text) for p in user.content] == [("input_text", "What time "), ("input_text", "is it in Oslo?")]
    assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_1", "get_time",
                                                                     CALL["arguments"])
    assert (output.type, output.call_id, output.output) == ("function_call_output", "call_1", "09:30")
    page = server.client().responses.input_items.list(r.id, extra_query={"cache_salt": ns})
    raw = page.model_dump()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == \
        ("list", newest_first[0].id, newest_first[-1].id, False)


def test_a_continued_response_lists_the_conversation_it_read(server):
    ns = salt()
    first = create(server, input="Hello there.", salt=ns)
    second = create(server, input="And then?", previous_response_id=first.id, salt=ns)
    before = items_of(server, first.id, ns, order="asc")
    items = items_of(server, second.id, ns, order="asc")
    assert [i.id for i in items[:len(before)]] == [i.id for i in before]  # the same items, the same ids
    assert items[len(before)].id == first.output[0].id and items[len(before)].role == "assistant"
    assert items[-1].content[0].text == "And then?" and len(items) == len(before) + len(first.output) + 1


def test_auto_pagination_over_more_items_than_a_page(server):
    ns = salt()
    texts = [f"note {k}" for k in range(25)]
    r = create(server, input=[{"role": "user", "content": t} for t in texts], salt=ns)
    first_page = server.client().responses.input_items.list(r.id, limit=7, order="asc",
                                                            extra_query={"cache_salt": ns})
    assert len(first_page.data) == 7 and first_page.has_more
    pages = list(first_page.iter_pages())
    assert [len(p.data) for p in pages] == [7, 7, 7, 4] and not pages[-1].has_more
    assert [i.content[0].text for i in first_page] == texts  # iterating the page fetches the following ones
    newest = items_of(server, r.id, ns, limit=10)
    assert [i.content[0].text for i in newest] == texts[::-1]


@pytest.mark.parametrize("query,param", [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                                         ({"limit": "many"}, "limit"), ({"order": "up"}, "order"),
                                         ({"include[]": "message.nonsense"}, "include"),
                                         ({"after": "msg_unknown"}, "after"), ({"before": "msg_x"}, "before")])
def test_a_bad_parameter_is_a_400_naming_it(server, query, param):
    ns = salt()
    r = create(server, input="hi", salt=ns)
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().responses.input_items.list(r.id, extra_query={"cache_salt": ns, **query})
    assert exc.value.body["param"] == param, exc.value.body
    assert param in exc.value.body["message"]


def test_documented_includes_are_accepted(server):
    ns = salt()
    r = create(server, input="hi", salt=ns)
    items = items_of(server, r.id, ns, include=["message.output_text.logprobs", "reasoning.encrypted_content"])
    assert [i.content[0].text for i in items] == ["hi"]


def test_another_namespace_sees_an_unknown_id(keyed_server):
    def listing(key: str, response_id: str, ns: str | None = None) -> httpx.Response:
        return httpx.get(f"{keyed_server.url}/v1/responses/{response_id}/input_items",
                         params={"cache_salt": ns} if ns else {}, headers={"Authorization": f"Bearer {key}"},
                         timeout=30)

    r = keyed_server.client("key-a").responses.create(model=MODEL, input="secret", max_output_tokens=2)
    assert listing("key-a", r.id).status_code == 200
    unknown = listing("key-a", "resp_" + "0" * 24)
    for other in (listing("key-b", r.id), listing("key-a", r.id, ns="other-salt")):
        assert other.status_code == unknown.status_code == 404
        assert other.json()["error"] == {**unknown.json()["error"],
                                         "message": unknown.json()["error"]["message"].replace("0" * 24, r.id[5:])}


def test_a_response_not_stored_has_no_items(server):
    ns = salt()
    r = create(server, input="hi", store=False, salt=ns)
    with pytest.raises(openai.NotFoundError):
        items_of(server, r.id, ns)


def test_a_replayed_cut_call_is_listed_as_the_incomplete_item_it_was():
    """As a previous response's output lists it: the model read no such call (kvrelay.server.responses_input)."""
    listed = input_items([CALL, {**CALL, "call_id": "call_2", "status": "incomplete"}])
    assert [(i["call_id"], i["status"]) for i in listed] == [("call_1", "completed"), ("call_2", "incomplete")]
