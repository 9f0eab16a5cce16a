"""A queued job's events as one HTTP answer: a JSON body, or an SSE stream. Chat, completions and the Responses API
read their jobs' events the same way and differ only in how an event is rendered (an ``EventRender``).

The flow: the first event (None: the client went away, a 499); an error first is an ApiError (its JSON body).
Not streaming: deltas until the done or error event, then one body. Streaming: the render's head, each event's
lines, and an error after the head as one error chunk (then ``[DONE]`` for chat and completions; its access line is
``cut``); a client that goes away mid-stream cancels the job (its KV
is freed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrelay.server.context import AppContext
from kvrelay.server.events import DeltaEvent, DoneEvent, ErrorEvent
from kvrelay.server.protocol import ApiError
from kvrelay.server.request_ids import mark_cut
from kvrelay.server.responses import Reply, stream_error_chunk
from kvrelay.server.scheduler import Job

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventRender(Protocol):
    """How one API renders a job's events (kvrelay.server.events)."""

    def full(self, deltas: list[DeltaEvent], done: DoneEvent) -> dict:
        """The whole response body, after the last delta."""

    def head(self, first: DeltaEvent | DoneEvent) -> Iterable[str]:
        """The SSE lines before the ``first`` event's."""

    def delta_lines(self, delta: DeltaEvent) -> Iterable[str]:
        """The SSE lines of one delta event."""

    def done_lines(self, done: DoneEvent) -> Iterable[str]:
        """The SSE lines that end a stream."""

    def error_of(self, error: ErrorEvent) -> ApiError:
        """An error event as this API words it."""

    def error_line(self, err: ApiError) -> str:
        """The SSE line of an error after the stream began."""


def include_usage(body) -> bool:
    """Whether a streamed chat or completion ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(body.stream_options and body.stream_options.include_usage)


class CompletionRender:
    """Chat and text completions: OpenAI's ``chat.completion`` / ``text_completion`` objects and chunks."""

    def __init__(self, reply: Reply, include_usage: bool) -> None:
        self.reply, self.include_usage = reply, include_usage

    def full(self, deltas: list[DeltaEvent], done: DoneEvent) -> dict:
        return self.reply.full(deltas, done)

    def head(self, first: DeltaEvent | DoneEvent) -> Iterable[str]:
        chunk = self.reply.first_chunk(first)
        return [chunk] if chunk else []

    def delta_lines(self, delta: DeltaEvent) -> Iterable[str]:
        return [self.reply.delta_chunk(delta)]

    def done_lines(self, done: DoneEvent) -> Iterable[str]:
        return self.reply.final_chunks(done, self.include_usage)

    def error_of(self, error: ErrorEvent) -> ApiError:
        return error.api_error()

    def error_line(self, err: ApiError) -> str:
        # then [DONE], as vLLM ends a stream that failed: a client reading to [DONE] is not left waiting for more
        return stream_error_chunk(err) + "data: [DONE]\n\n"


async def respond(ctx: AppContext, request: Request, job: Job, events: asyncio.Queue, stream: bool,
                  render: EventRender) -> Response:
    """The submitted ``job``'s answer: one JSON body, or an SSE stream."""
    first = await ctx.next_event(request, job, events)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, ErrorEvent):
        raise render.error_of(first)
    if stream:
        return StreamingResponse(_sse(ctx, request, job, events, first, render), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    deltas, event = [], first
    while isinstance(event, DeltaEvent):
        deltas.append(event)
        event = await ctx.next_event(request, job, events)
        if event is None:
            return Response(status_code=499)
    if isinstance(event, ErrorEvent):
        raise render.error_of(event)
    return JSONResponse(render.full(deltas, event))


async def _sse(ctx: AppContext, request: Request, job: Job, events: asyncio.Queue, first: DeltaEvent | DoneEvent,
               render: EventRender) -> AsyncIterator[str]:
    finished = False
    try:
        for line in render.head(first):
            yield line
        event = first
        while True:
            if isinstance(event, DeltaEvent):
                for line in render.delta_lines(event):
                    yield line
            elif isinstance(event, DoneEvent):
                for line in render.done_lines(event):
                    yield line
                finished = True
                return
            else:
                finished = True
                err = render.error_of(event)
                mark_cut(request.scope, err.status)  # its status said 200: the access line and error counter say more
                yield render.error_line(err)
                return
            event = await events.get()
    finally:
        if not finished:  # the client went away mid-stream: stop decoding, free its KV
            ctx.worker.cancel(job)
