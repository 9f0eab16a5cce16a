"""``POST /v1/responses`` (OpenAI's Responses API, the OpenAI Agents SDK's default), ``GET``/``DELETE``
of stored responses and ``GET`` of their input items.

A request is translated into a chat-completions request (kvrelay.server.responses_input) and runs through
the very same job path as ``/v1/chat/completions``: the same namespace, reuse method, output registry,
tool prompt and constrained decoding, and the same ``kvrelay`` extension object on the response. The
worker's events are rendered as a response object or the Responses SSE events
(kvrelay.server.responses_events). ``store`` (default true) keeps the conversation under the caller's
namespace so a later ``previous_response_id`` continues it (kvrelay.server.response_store); its KV is
found again like any other quoted output. On a shared tier (``--store redis://...``) stored responses are the
replicas' (kvrelay.server.shared_responses); every store call then may wait on the tier, so it runs off the event
loop, and a created response is stored before its last line reaches the client: the next call may go to any replica.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from kvrelay.server.call_answers import check_input_calls_answered
from kvrelay.server.chat_route import queue_chat
from kvrelay.server.context import AppContext
from kvrelay.server.events import DeltaEvent, DoneEvent, ErrorEvent
from kvrelay.server.protocol import ApiError, ChatCompletionRequest, validation_message
from kvrelay.server.respond import respond
from kvrelay.server.response_store import ResponseStore, StoredResponse
from kvrelay.server.responses import tool_call_json
from kvrelay.server.responses_events import ResponseRender, said_unstored
from kvrelay.server.responses_input import ResponsesRequest, chat_body, check_call_outputs, input_messages
from kvrelay.server.responses_items import DEFAULT_PAGE_ITEMS, MAX_PAGE_ITEMS, check_includes, input_items, item_page

# chat-completions parameter names, as the Responses request spells them (for 400s raised after translation)
_PARAM_NAMES = ((re.compile(r"(tools(?:\.\d+|\[\d+\]))\.function\."), r"\1."),
                (re.compile(r"response_format\.json_schema\."), "text.format."),
                (re.compile(r"response_format"), "text.format"),
                (re.compile(r"tool_choice\.function\."), "tool_choice."),
                (re.compile(r"max_completion_tokens"), "max_output_tokens"),
                (re.compile(r"^messages$"), "input"))  # the whole prompt (its length): an index would not map


def responses_param(text: str | None) -> str | None:
    """A chat-completions parameter path (or a message naming one) in the Responses request's terms."""
    if text is None:
        return None
    for pattern, replacement in _PARAM_NAMES:
        text = pattern.sub(replacement, text)
    return text


def _in_responses_terms(exc: ApiError) -> ApiError:
    return ApiError(exc.status, responses_param(exc.message), exc.type, responses_param(exc.param), exc.code,
                    exc.headers)


def _assistant_message(done: DoneEvent) -> dict:
    """The response's output as the chat message a later turn's history holds."""
    calls = [tool_call_json(c) for c in done.tool_calls]
    message: dict = {"role": "assistant", "content": done.text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_request(store: ResponseStore, body: ResponsesRequest, namespace: str
                  ) -> tuple[ChatCompletionRequest, list[dict], list[dict]]:
    """The chat-completions request ``body`` stands for, the conversation it continues (its history, then its
    input as chat messages) and the items it is generated from (what ``input_items`` lists)."""
    history: list[dict] = []
    history_items: list[dict] = []
    if body.previous_response_id:
        previous = store.get(namespace, body.previous_response_id)
        if previous is None:
            raise ApiError(400, f"previous response {body.previous_response_id!r} not found: it was not stored "
                           "(store=false), was evicted, or belongs to another namespace (API key, cache_salt)",
                           param="previous_response_id", code="previous_response_not_found")
        history = previous.messages
        history_items = previous.input_items + previous.response.get("output", [])
    messages = input_messages(body.input)
    check_call_outputs(body.input, history)
    check_input_calls_answered(body.input, history)
    if not history and not messages:
        raise ApiError(400, "input is empty", param="input", code="invalid_value")
    try:
        chat = ChatCompletionRequest.model_validate(chat_body(body, history, messages))
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(400, responses_param(message), param=responses_param(param), code="invalid_value") from exc
    return chat, history + messages, history_items + input_items(body.input)


class _ResponsesAnswer:
    """The job's events as a response object or the Responses SSE events (an ``EventRender``); with ``store``
    (the default), the finished response and its conversation are kept for a later ``previous_response_id``."""

    def __init__(self, body: ResponsesRequest, model_id: str, store: ResponseStore, namespace: str,
                 conversation: list[dict], items: list[dict]) -> None:
        self.render = ResponseRender(body, model_id)
        self.body, self.store, self.namespace, self.conversation = body, store, namespace, conversation
        self.items = items
        self._unkept: tuple | None = None  # the ``store.put`` arguments of the finished response, until ``keep``
        self.response: dict | None = None  # the finished response object (not streamed)
        # ``store`` asked for but not done (a shared tier down, or over the store's byte bound): the response says
        # ``store: false``, so a client does not learn it only from a later previous_response_id's 400
        self.unstored = False

    def _keep(self, done: DoneEvent, response: dict) -> None:
        if self.body.store is not False:
            self._unkept = (self.namespace, response["id"], self.conversation + [_assistant_message(done)], response,
                            self.items)

    async def keep(self) -> None:
        """Store the finished response (off the event loop: a shared store writes to its tier), once."""
        unkept, self._unkept = self._unkept, None
        if unkept is not None and not await run_in_threadpool(self.store.put, *unkept):
            self.unstored = True

    async def kept_before_last_lines(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """The stream's lines, the response stored before the first of its closing lines goes out."""
        try:
            async for line in lines:
                await self.keep()
                yield said_unstored(line) if self.unstored else line
        finally:
            await lines.aclose()  # its own cleanup: a stream cut short cancels the job

    def full(self, deltas: list[DeltaEvent], done: DoneEvent) -> dict:
        self.response = self.render.full(deltas, done)
        self._keep(done, self.response)
        return self.response

    def head(self, first: DeltaEvent | DoneEvent) -> Iterable[str]:
        return self.render.start()

    def delta_lines(self, delta: DeltaEvent) -> Iterable[str]:
        return _delta_events(self.render, delta)

    def done_lines(self, done: DoneEvent) -> Iterable[str]:
        lines = self.render.finish(done)
        self._keep(done, self.render.envelope(self.render.status_of(done), done))
        return lines

    def error_of(self, error: ErrorEvent) -> ApiError:
        return _in_responses_terms(error.api_error())

    def error_line(self, err: ApiError) -> str:
        return self.render.error(err.status, err.message, err.param, err.code)


def responses_router(ctx: AppContext, store: ResponseStore | None = None) -> APIRouter:
    """The routes; ``store``: where ``store: true`` responses live (a fresh bounded one by default)."""
    router = APIRouter()
    store = store if store is not None else ResponseStore()

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        namespace = ctx.namespace_of(request, body.cache_salt)
        chat, conversation, items = await run_in_threadpool(_chat_request, store, body, namespace)
        try:
            queued = await queue_chat(chat, request, ctx, answers_follow_calls=False)  # checked in _chat_request
        except ApiError as exc:
            raise _in_responses_terms(exc) from exc
        answer = _ResponsesAnswer(body, ctx.model_id, store, namespace, conversation, items)
        response = await respond(ctx, request, queued.job, queued.events, bool(body.stream), answer)
        if isinstance(response, StreamingResponse):
            response.body_iterator = answer.kept_before_last_lines(response.body_iterator)
        else:
            await answer.keep()
            if answer.unstored:
                response = JSONResponse({**answer.response, "store": False})
        return response

    def stored(request: Request, response_id: str, cache_salt: str | None) -> tuple[str, StoredResponse]:
        namespace = ctx.namespace_of(request, cache_salt)
        entry = store.get(namespace, response_id)
        if entry is None:
            raise ApiError(404, f"response {response_id!r} not found in this namespace", param="response_id",
                           code="not_found")
        return namespace, entry

    # plain functions, which FastAPI runs off the event loop: a shared store's lookup waits on its tier
    @router.get("/v1/responses/{response_id}")
    def retrieve(response_id: str, request: Request, cache_salt: str | None = None) -> dict:
        return stored(request, response_id, cache_salt)[1].response

    @router.get("/v1/responses/{response_id}/input_items")
    def list_input_items(response_id: str, request: Request, cache_salt: str | None = None,
                               limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ITEMS)] = DEFAULT_PAGE_ITEMS,
                               order: Literal["asc", "desc"] = "desc", after: str | None = None,
                               before: str | None = None, include: Annotated[list[str], Query()] = (),
                               include_brackets: Annotated[list[str], Query(alias="include[]")] = ()) -> dict:
        # include[]: the openai client's spelling of a list in a query
        check_includes([*include, *include_brackets])
        if before is not None:
            raise ApiError(400, "before is not supported: page with after (the openai client does)", param="before",
                           code="unsupported")
        return item_page(stored(request, response_id, cache_salt)[1].input_items, limit, order, after)

    @router.delete("/v1/responses/{response_id}")
    def delete(response_id: str, request: Request, cache_salt: str | None = None) -> dict:
        namespace, _ = stored(request, response_id, cache_salt)
        if not store.delete(namespace, response_id):  # gone meanwhile, or a shared tier that did not answer
            raise ApiError(404, f"response {response_id!r} not found in this namespace", param="response_id",
                           code="not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router


def _delta_events(render: ResponseRender, event: DeltaEvent) -> list[str]:
    """SSE events of one chat delta event."""
    call = event.tool_call
    if call is not None:
        return render.call_piece(call.index, call.id, call.name, call.arguments)
    return render.text(event.text, event.logprobs)
