"""Tool calls out of the model's text (ToolStream) and tool history into the prompt (render_messages)."""

from __future__ import annotations

import json

import pytest

from kvrelay.server.protocol import ApiError, ChatCompletionRequest
from kvrelay.server.tool_protocol import FunctionDef
from kvrelay.server.tool_stream import ToolStream
from kvrelay.server.tools import ToolPlan, call_text, plan_tools, render_messages

PLAN = ToolPlan((FunctionDef(name="get_weather"), FunctionDef(name="search")), "auto")
ARGS = '{"city": "Paris", "days": {"n": 2}}'


def run(text: str, pieces: int | None = None, finish_reason: str = "stop", plan: ToolPlan = PLAN):
    """Feed ``text`` one character at a time (or in ``pieces`` equal parts); all events and the done fields."""
    stream = ToolStream(plan)
    step = 1 if pieces is None else max(1, len(text) // pieces)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i : i + step])
    last, done = stream.close(finish_reason)
    return events + last, done


def rebuilt(events: list[dict]) -> tuple[str, dict[int, dict]]:
    """What a client accumulates from the deltas: the content and each call by index."""
    content, calls = "", {}
    for e in events:
        if "tool_call" in e:
            piece = e["tool_call"]
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            if piece["id"] is not None:
                assert call["id"] is None, "a call's id and name come once, in its first piece"
                call.update(id=piece["id"], name=piece["name"])
            call["arguments"] += piece["arguments"]
        else:
            content += e["text"]
    return content, calls


@pytest.mark.parametrize("pieces", [None, 3, 1])
def test_two_calls_parse_and_stream_in_pieces(pieces):
    text = call_text("get_weather", ARGS) + "\n" + call_text("search", '{"q": "x}"}')
    events, done = run(text, pieces)
    assert done["finish_reason"] == "tool_calls" and done["text"] == ""
    assert [(c["name"], c["arguments"]) for c in done["tool_calls"]] == [
        ("get_weather", ARGS), ("search", '{"q": "x}"}')]
    content, calls = rebuilt(events)
    assert content == ""  # the newline between the calls is no answer, streamed or not
    assert [(calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)] == \
        [(c["id"], c["name"], c["arguments"]) for c in done["tool_calls"]]
    assert all(c["id"].startswith("call_") for c in done["tool_calls"])
    if pieces is None:  # one character at a time: the arguments arrive in several pieces, not at the end only
        assert sum(1 for e in events if "tool_call" in e and e["tool_call"]["index"] == 0) > 3


def test_text_around_a_call_is_content_and_a_partial_marker_is_held_back():
    events, done = run("Let me look.<tool_call>" + call_text("search", "{}")[len("<tool_call>"):] + " Done <tool")
    assert done["text"] == "Let me look. Done <tool" and [c["name"] for c in done["tool_calls"]] == ["search"]
    assert done["text_runs"] == [(0, "Let me look."), (1, " Done <tool")]  # where each run was generated
    content, _ = rebuilt(events)
    assert content == done["text"]
    stream = ToolStream(PLAN)
    assert stream.feed("Hi <tool_ca") == [{"type": "delta", "text": "Hi "}]  # "<tool_ca" may open a call


@pytest.mark.parametrize(("cut_chars", "arguments"), [
    (8, ARGS), (22, ARGS[:-9]), (len(ARGS) + 12, "{"), (len(ARGS) + 13, "")])
@pytest.mark.parametrize("pieces", [None, 1])
def test_a_call_cut_by_max_tokens_after_its_name_is_the_cut_call_the_stream_announced(cut_chars, arguments, pieces):
    """A stream announces a call once its name is decoded: cut after that, the answer reports the call (its
    arguments so far, finish_reason "length"), never its text as content, so stream and answer agree."""
    text = call_text("get_weather", ARGS)[:-cut_chars]
    events, done = run(text, pieces, finish_reason="length")
    cut = done["cut_call"]
    assert (done["text"], done["tool_calls"], done["finish_reason"]) == ("", [], "length")
    assert (cut["name"], cut["arguments"]) == ("get_weather", arguments)
    content, calls = rebuilt(events)
    assert content == "" and calls == {0: cut}


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_call_a_stop_string_cuts_after_its_name_is_the_cut_call_and_a_stop(mode):
    """A stop string in the arguments cuts the call the stream announced: the answer reports it as max_tokens' cut
    (arguments so far) with finish_reason "stop", and its text is no content; the closed call before it stays."""
    plan = ToolPlan(PLAN.functions, mode)
    first = call_text("search", '{"q": "a"}')
    for pieces in (None, 1):
        events, done = run(first + "\n" + call_text("get_weather", ARGS)[:-22], pieces, "stop", plan)
        assert (done["text"], done["finish_reason"]) == ("", "stop")
        assert [c["arguments"] for c in done["tool_calls"]] == ['{"q": "a"}']
        assert (done["cut_call"]["name"], done["cut_call"]["arguments"]) == ("get_weather", ARGS[:-9])
        content, calls = rebuilt(events)
        assert content == "" and calls == {0: done["tool_calls"][0], 1: done["cut_call"]}


def test_a_stop_string_that_takes_only_the_closing_tag_leaves_a_whole_call():
    events, done = run(call_text("get_weather", ARGS).removesuffix("</tool_call>"), finish_reason="stop")
    assert (done["text"], done["cut_call"], done["finish_reason"]) == ("", None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in done["tool_calls"]] == [("get_weather", ARGS)]
    assert rebuilt(events) == ("", {0: done["tool_calls"][0]})


@pytest.mark.parametrize("mode, forced", [("auto", None), ("required", None), ("named", "search")])
def test_a_call_cut_before_its_name_is_text_under_auto_and_nothing_where_the_turn_is_calls_only(mode, forced):
    """Under "required" or a named tool the grammar allows no text: a second call cut by max_tokens before its name
    is dropped (the first, closed call stays); under "auto" its text is content."""
    plan = ToolPlan(PLAN.functions, mode, forced)
    first = call_text("search", '{"q": "a"}')
    cut = call_text("search", '{"q": "bb"}')[:20]
    events, done = run(first + "\n" + cut, finish_reason="length", plan=plan)
    assert done["text"] == ("\n" + cut if mode == "auto" else "") and done["finish_reason"] == "length"
    assert [(c["name"], c["arguments"]) for c in done["tool_calls"]] == [("search", '{"q": "a"}')]
    assert done["cut_call"] is None
    content, calls = rebuilt(events)
    assert content == done["text"] and list(calls) == [0] and calls[0]["arguments"] == '{"q": "a"}'


def test_where_the_turn_is_calls_only_a_cut_call_opener_is_no_text():
    first = call_text("search", '{"q": "a"}')
    events, done = run(first + "\n\n<t", finish_reason="length", plan=ToolPlan(PLAN.functions, "required"))
    assert done["text"] == "" and rebuilt(events)[0] == ""


@pytest.mark.parametrize(("text", "answer"), [
    (call_text("search", "{}") + "\n Done.", "\n Done."),  # text after a call: its leading newline is the answer's
    ("\n\n", "\n\n"),  # whitespace alone, no call: it is the answer
    ("\n" + call_text("search", "{}") + "\n", ""),  # beside calls, whitespace is no answer
    ("Hi" + call_text("search", "{}") + "\n" + call_text("search", "{}") + "\n", "Hi"),  # after text too
    ("\n" + call_text("search", "{}") + "Done", "Done"),
])
def test_whitespace_is_held_until_it_is_known_to_be_the_answers(text, answer):
    for plan in (PLAN, ToolPlan(PLAN.functions, "required")):
        events, done = run(text, plan=plan)
        assert done["text"] == answer and rebuilt(events)[0] == answer


def assert_stream_is_the_answer(events: list[dict], done: dict) -> None:
    """What a client assembles from the deltas is the answer: its content, and each call at its index."""
    calls = done["tool_calls"] + ([done["cut_call"]] if done["cut_call"] else [])
    assert rebuilt(events) == (done["text"], dict(enumerate(calls)))


NAMED = ToolPlan(PLAN.functions, "named", "search")
MODES = [PLAN, ToolPlan(PLAN.functions, "required"), NAMED]


@pytest.mark.parametrize(("written", "arguments"), [
    ("[1]", "[1]"), ('"x" ', '"x"'), ("5", "5"), ('{"a": 1}', '{"a": 1}'),  # the last with no closing brace
    ('{"a": 1}, "b": 2', '{"a": 1}, "b": 2')])
@pytest.mark.parametrize("plan", MODES)
@pytest.mark.parametrize("pieces", [None, 3, 1])
def test_a_call_announced_is_a_call_whatever_its_arguments(written, arguments, plan, pieces):
    """A schema the grammar reads as any JSON value can give arguments that are no object: the call the stream
    announced stays a call, with the arguments as written, in the stream and the answer alike, never content."""
    events, done = run('<tool_call>{"name": "search", "arguments": ' + written + "}</tool_call>", pieces, plan=plan)
    assert (done["text"], done["finish_reason"], done["cut_call"]) == ("", "tool_calls", None)
    assert [(c["name"], c["arguments"]) for c in done["tool_calls"]] == [("search", arguments)]
    assert_stream_is_the_answer(events, done)


@pytest.mark.parametrize("body", ['{"name": "nope", "arguments": {}}', '{"name": "search"}', "{}"])
@pytest.mark.parametrize("plan", MODES)
def test_markup_naming_no_callable_tool_is_never_announced_and_no_forced_calls_content(body, plan):
    text = "Hi <tool_call>" + body + "</tool_call>"
    for pieces in (None, 1):
        events, done = run(text, pieces, plan=plan)
        assert done["tool_calls"] == [] and done["finish_reason"] == "stop"
        assert done["text"] == (text if plan.mode == "auto" else "Hi ")
        assert not any("tool_call" in e for e in events)
        assert_stream_is_the_answer(events, done)
    # under a named tool another tool's call is markup too
    events, done = run(call_text("get_weather", "{}"), plan=NAMED)
    assert (done["text"], done["tool_calls"]) == ("", []) and not any("tool_call" in e for e in events)


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", **kw)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_history_renders_calls_as_generated_and_results_as_one_user_turn():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    call2 = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    body = _request(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [call, call2]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                              {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
                              {"role": "user", "content": "Thanks"}],
                    tools=[WEATHER])
    messages = render_messages(body, plan_tools(body))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]  # Gemma's alternation holds
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == (call_text("get_weather", '{"city": "Paris"}') + "\n"
                                      + call_text("get_weather", '{"city": "Rome"}'))
    assert messages[3]["content"] == ('<tool_response name="get_weather">\nSunny\n</tool_response>\n'
                                      '<tool_response name="get_weather">\nRain\n</tool_response>\n\nThanks')
    hidden = render_messages(body, None)  # no tools: no tool text in the system message
    assert hidden[0]["content"] == "Be brief."


@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "nonsense"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_parameters_name_the_field(kw, param):
    with pytest.raises(ApiError) as err:
        plan_tools(_request(messages=[{"role": "user", "content": "hi"}], **kw))
    assert err.value.status == 400 and err.value.param == param


def test_plans():
    user = [{"role": "user", "content": "hi"}]
    assert plan_tools(_request(messages=user)) is None
    assert plan_tools(_request(messages=user, tool_choice="none")) is None
    assert plan_tools(_request(messages=user, tools=[WEATHER], tool_choice="none")).mode == "none"
    auto = plan_tools(_request(messages=user, tools=[WEATHER]))
    assert (auto.mode, auto.parallel) == ("auto", True)
    single = plan_tools(_request(messages=user, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert (single.mode, single.parallel) == ("required", False)
    named = plan_tools(_request(messages=user, tools=[WEATHER],
                                tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert (named.mode, named.callable_names, named.parallel) == ("named", ("get_weather",), False)
    assert json.loads(json.dumps(named.schema_of("get_weather")))["required"] == ["city"]


@pytest.mark.parametrize(("parameters", "schema"), [
    ({}, {"type": "object"}), ({"properties": {"a": {}}}, {"type": "object", "properties": {"a": {}}}),
    (None, {"type": "object", "properties": {}, "additionalProperties": False}),
    ({"type": "object", "required": []}, {"type": "object", "required": []})])
def test_the_arguments_schema_is_an_object_at_its_top(parameters, schema):
    """A schema without ``type`` (``{}``, which clients send for a tool without parameters) would let the grammar
    write any JSON value as the arguments: it is decoded as an object's."""
    tool = {"type": "function", "function": {"name": "f"} | ({} if parameters is None else {"parameters": parameters})}
    plan = plan_tools(_request(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required"))
    assert plan.schema_of("f") == schema
