"""Translation of Responses requests into chat-completions bodies (no server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvrelay.server.protocol import ApiError, ChatCompletionRequest, validation_message
from kvrelay.server.responses_input import (
    IGNORED_INCLUDES,
    ResponsesRequest,
    chat_body,
    check_call_outputs,
    input_messages,
)


def body(**kw) -> ResponsesRequest:
    return ResponsesRequest(model="m", **kw)


def test_string_input_and_instructions():
    chat = chat_body(body(input="hi", instructions="be brief", max_output_tokens=5, temperature=0), [],
                     input_messages("hi"))
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == 5 and chat["temperature"] == 0 and "top_p" not in chat
    ChatCompletionRequest.model_validate(chat)


def test_tool_loop_items_become_one_assistant_turn_and_a_tool_message():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"city": "Rome"}'},
             {"type": "reasoning", "summary": []},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}]
    messages = input_messages(items)
    assert messages[0] == {"role": "user", "content": "weather?"}
    assert messages[1]["role"] == "assistant" and messages[1]["content"] == "Checking."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"city": "Paris"}'}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                            {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    chat = ChatCompletionRequest.model_validate(chat_body(body(), [], messages))
    assert chat.messages[1].tool_calls[1].function.arguments == '{"city": "Rome"}'


def test_a_call_without_text_opens_its_own_assistant_turn():
    messages = input_messages([{"role": "user", "content": "x"},
                               {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [call]}


CUT = {"type": "function_call", "call_id": "c9", "name": "f", "arguments": '{"ci', "status": "incomplete"}


def test_a_replayed_cut_call_is_left_out_as_the_stored_conversation_leaves_it():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": "completed"}
    messages = input_messages([{"role": "user", "content": "x"}, call, CUT])
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c"] and len(messages) == 2
    # a lone cut call: the empty assistant turn the stored conversation holds for that response
    assert input_messages([{"role": "user", "content": "x"}, CUT])[1:] == [{"role": "assistant", "content": ""}]


def test_tools_tool_choice_and_text_format_in_chat_shapes():
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = chat_body(body(tools=[{"type": "function", "name": "get", "description": "d", "parameters": params,
                                  "strict": True}],
                          tool_choice={"type": "function", "name": "get"}, parallel_tool_calls=False,
                          text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}),
                     [], input_messages("x"))
    assert chat["tools"] == [{"type": "function", "function": {"name": "get", "description": "d",
                                                              "parameters": params, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                              "strict": True}}
    parsed = ChatCompletionRequest.model_validate(chat)
    assert parsed.response_format.json_schema.schema_ == schema
    assert chat_body(body(text={"format": {"type": "json_object"}}), [], [])["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in chat_body(body(text={"format": {"type": "text"}}), [], [])


def test_history_goes_after_instructions_and_before_the_new_input():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat = chat_body(body(instructions="sys"), history, [{"role": "user", "content": "c"}])
    assert [m["content"] for m in chat["messages"]] == ["sys", "a", "b", "c"]


def test_logprobs_through_include():
    chat = chat_body(body(include=["message.output_text.logprobs"], top_logprobs=3), [], [])
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3
    assert "logprobs" not in chat_body(body(include=[]), [], [])


def test_the_includes_openai_documents_are_accepted():
    # each asks for more of an item this server never produces: the answer is the same without them
    chat = chat_body(body(include=list(IGNORED_INCLUDES)), [], [{"role": "user", "content": "x"}])
    assert "logprobs" not in chat
    assert "reasoning.encrypted_content" in IGNORED_INCLUDES and "file_search_call.results" in IGNORED_INCLUDES


@pytest.mark.parametrize("kw, param, named", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "file_search"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "yaml"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"prompt": {"id": "p"}}, "prompt", "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"),
    # an unknown include was ignored: a typo of message.output_text.logprobs silently returned none
    ({"include": ["message.output_text.logprob"]}, "include.0", "message.output_text.logprob"),
    ({"include": ["reasoning.encrypted_content", "usage"]}, "include.1", "usage"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(kw, param, named):
    with pytest.raises(ApiError) as err:
        chat_body(body(**kw), [], [{"role": "user", "content": "x"}])
    assert err.value.status == 400 and err.value.param == param and named in err.value.message


@pytest.mark.parametrize("fmt", ["json_object", ["json_object"], 1])
def test_a_text_format_that_is_no_object_is_a_400_not_a_500(fmt):
    # the body types text as any dict, so its format arrives unchecked: a string was an AttributeError (a 500)
    with pytest.raises(ApiError) as err:
        chat_body(body(text={"format": fmt}), [], [{"role": "user", "content": "x"}])
    assert err.value.status == 400 and err.value.param == "text.format" and "object" in err.value.message


@pytest.mark.parametrize("items, param", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.content.0.type"),
    ([{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
    ([{"role": "tool", "content": "x"}], "input.0.role"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
])
def test_input_items_that_cannot_be_read_are_a_400(items, param):
    with pytest.raises(ApiError) as err:
        input_messages(items)
    assert err.value.status == 400 and err.value.param == param


CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "1"}
STORED = [{"role": "user", "content": "x"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]}]


@pytest.mark.parametrize("items, history", [([CALL, OUTPUT], []), ([OUTPUT], STORED), ("hi", [])])
def test_a_call_output_answers_a_call_in_input_or_the_stored_history(items, history):
    check_call_outputs(items, history)


@pytest.mark.parametrize("items", [[OUTPUT], [OUTPUT, CALL], [CALL, {**OUTPUT, "call_id": "call_2"}],
                                   [{**CALL, "status": "incomplete"}, OUTPUT]])  # a cut call is no call
def test_a_call_output_that_answers_no_call_is_a_400_naming_the_input_item(items):
    # it was the chat check's "messages[0].tool_call_id": a field of a translation the client never sent
    with pytest.raises(ApiError) as err:
        check_call_outputs(items, [])
    at = next(i for i, item in enumerate(items) if item["type"] == "function_call_output")
    assert err.value.status == 400 and err.value.param == f"input.{at}.call_id" and "messages" not in err.value.message


@pytest.mark.parametrize("kw, param", [
    ({"metadata": {"\ud800": "x"}}, "metadata"),
    ({"metadata": {"k": "\udfff"}}, "metadata"),
    ({"instructions": "\ud800"}, "instructions"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "\ud800"}]}]}, "input"),
])
def test_a_lone_surrogate_is_refused_naming_the_responses_field(kw, param):
    # metadata was echoed into the response, whose encoding failed (a 500); the others named the chat message
    # ("messages.0.content") the request was translated into
    with pytest.raises(ValidationError) as err:
        ResponsesRequest.model_validate({"model": "m", "input": "x", **kw})
    message, named = validation_message(err.value.errors())
    assert named == param and "lone surrogate" in message
