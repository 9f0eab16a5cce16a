"""The chat-completions request, checked, rendered and queued: what ``/v1/chat/completions`` and the Responses
API share.

``await queue_chat(body, request, ctx)`` takes a pydantic-valid ``ChatCompletionRequest``, checks the rest (roles,
tool-call history, tools, tool_choice, response_format: an ApiError 400 naming the field), renders the prompt
(tools included), sets up constrained decoding and the tool-call parser, and submits the job (a full queue is
an ApiError 429). It returns a ``QueuedChat``: the job and the asyncio queue its events arrive on; read them
with ``ctx.next_event(request, job, events)`` (None: the client went away, the job is cancelled).

Events: typed, in order any number of ``DeltaEvent`` (content text, or a piece of a tool call), then one
``DoneEvent`` or one ``ErrorEvent`` (kvrelay.server.events).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvrelay.cache.tenancy import tenant_of
from kvrelay.errors import ContextLengthError
from kvrelay.reuse import role_key
from kvrelay.server.call_answers import check_chat_calls_answered
from kvrelay.server.chat_template_params import template_params
from kvrelay.server.context import AppContext, agent_of, digest
from kvrelay.server.grammar_cache import grammar_key
from kvrelay.server.prompting import chat_ids
from kvrelay.server.protocol import ROLES, ApiError, ChatCompletionRequest, RefusalPart
from kvrelay.server.respond import CompletionRender, include_usage, respond
from kvrelay.server.responses import Reply
from kvrelay.server.scheduler import Job
from kvrelay.server.schema_limits import check_request_schemas
from kvrelay.server.structured_outputs import structured_constraint, structured_of
from kvrelay.server.tool_stream import ToolStream
from kvrelay.server.tools import ToolPlan, answer_schema, check_tool_messages, plan_tools, render_messages


@dataclass
class QueuedChat:
    job: Job
    events: asyncio.Queue
    tools: ToolPlan | None  # None: the request has no tools


def _check_messages(body: ChatCompletionRequest, answers_follow_calls: bool) -> None:
    if not body.messages:
        raise ApiError(400, "messages must hold at least one message", param="messages", code="empty_messages")
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                           param=f"messages.{i}.role", code="invalid_value")
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"messages[{i}] has no content", param=f"messages.{i}.content",
                           code="invalid_value")
        for j, part in enumerate(m.content if isinstance(m.content, list) and m.role != "assistant" else []):
            if isinstance(part, RefusalPart):  # OpenAI takes a refusal part from an assistant only
                raise ApiError(400, f"messages[{i}].content[{j}]: a refusal part belongs to an assistant message, "
                               f"not a {m.role} one", param=f"messages.{i}.content.{j}.type", code="invalid_value")
    check_tool_messages(body)
    if answers_follow_calls:
        check_chat_calls_answered(body.messages)


async def _tool_plan(body: ChatCompletionRequest, namespace: str, ctx: AppContext) -> ToolPlan | None:
    """The request's checked tool plan. Validating the tools' schemas takes up to a fraction of a second
    (jsonschema): on the tenant's compile turn, off the event loop, which serves every tenant. A namespace that sent
    the same tools and choice before takes its plan from the cache without waiting for the turn (an agent sends
    its tools with every step; a long compile of the same tenant held each step's checks)."""
    key = "plan:" + grammar_key((body.tools, body.functions, body.function_call),
                                (body.tool_choice, body.parallel_tool_calls))
    plan = ctx.grammars.get(namespace, key)
    if plan is None:
        plan = await ctx.compiles.run(tenant_of(namespace), plan_tools, body)
        if plan is not None:  # its size: about the tools' text it holds
            ctx.grammars.put(namespace, key, plan, sum(len(repr(f)) for f in plan.functions))
    return plan


async def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None, namespace: str, ctx: AppContext):
    """The request's compiled grammar (kvrelay.server.grammar), None for free text. Off the event loop, on the
    grammar threads (kvrelay.server.grammar_compiles): the library's first setup and a new schema's compile take
    up to seconds. A request with nothing to compile never waits for those threads; one whose namespace compiled
    the same grammar before takes it from the cache (kvrelay.server.grammar_cache)."""
    if plan is None and answer_schema(body) is None:
        return None
    from kvrelay.server.grammar import constraint_for  # the grammar library loads with the first request

    key = grammar_key(plan, body.response_format)

    def cached_or_compiled():  # on the tenant's turn: a request just before it may have compiled the same grammar
        constraint = ctx.grammars.get(namespace, key)
        if constraint is None:
            constraint = constraint_for(plan, body.response_format, ctx.tokenizer)
            if constraint is not None:
                ctx.grammars.put(namespace, key, constraint, constraint.compiled.memory_size_bytes)
        return constraint

    cached = ctx.grammars.get(namespace, key)
    return cached if cached is not None else await ctx.compiles.run(tenant_of(namespace), cached_or_compiled)


def _check_supported(body: ChatCompletionRequest) -> None:
    """400 for what OpenAI would honour and this server cannot: dropped, the answer would silently differ."""
    if any(m != "text" for m in body.modalities or []) or body.audio is not None:
        param = "audio" if body.audio is not None else "modalities"
        raise ApiError(400, f"{param}: this server answers with text only (no audio output)", param=param,
                       code="unsupported")
    if body.web_search_options is not None:
        raise ApiError(400, "web_search_options is not supported: this server runs no web search; search in the "
                       "client and send the results as messages", param="web_search_options", code="unsupported")
    if body.moderation is not None:
        raise ApiError(400, "moderation is not supported: this server runs no moderation model; moderate in the "
                       "client", param="moderation", code="unsupported")
    if body.verbosity not in (None, "medium"):
        raise ApiError(400, f"verbosity {body.verbosity!r} is not supported: the model is not told how long to "
                       "answer; omit it (or send 'medium') and bound the answer with max_completion_tokens",
                       param="verbosity", code="unsupported")


async def queue_chat(body: ChatCompletionRequest, request: Request, ctx: AppContext,
                     answers_follow_calls: bool = True) -> QueuedChat:
    """Check, render and submit ``body`` (see the module docstring); ApiError on a bad request or a full queue.
    ``answers_follow_calls``: chat's rule that tool messages right after an assistant's calls answer them all
    (kvrelay.server.call_answers); the Responses API checks its items by its own rule and passes False."""
    namespace, method = ctx.check_common(body, request)
    _check_messages(body, answers_follow_calls)
    _check_supported(body)
    if body.top_logprobs is not None and not body.logprobs:  # OpenAI's 400: top_logprobs needs logprobs
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    template = template_params(body, ctx.tokenizer.template_variables())
    answer = answer_schema(body)
    tools = body.tools or []
    check_request_schemas([t.function.parameters for t in tools], answer)  # bounded work, before any is validated
    plan = await _tool_plan(body, namespace, ctx) if tools else plan_tools(body)
    structured = structured_of(body, tools_may_call=plan is not None and plan.may_call)
    constraint = await (structured_constraint(structured, namespace, ctx) if structured is not None
                        else _constraint(body, plan, namespace, ctx))
    messages = render_messages(body, plan)
    system = next((m.text() for m in body.messages if m.role in ("system", "developer")), "")
    agent = agent_of(request, "sys-" + digest(system))
    tokenizer, catalog = ctx.tokenizer, ctx.catalog

    def build():
        catalog.learn_published(namespace)  # completions other replicas returned: splice them as generated
        try:
            return chat_ids(tokenizer, messages, catalog.registry, namespace, ctx.worker.context_tokens,
                            template), agent
        except ContextLengthError as exc:  # refused from its length before its ids become Python objects
            raise ApiError(400, str(exc), param="messages", code="context_length_exceeded") from exc
        except Exception as exc:  # a template that refuses these messages (e.g. roles out of order)
            raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages",
                           code="invalid_value") from exc

    top = (body.top_logprobs or 0) if body.logprobs else None
    job, events = ctx.make_job(body, namespace, method, build, body.max_completion_tokens or body.max_tokens,
                               ctx.settings.default_max_tokens, top,
                               tool_stream=ToolStream(plan) if plan is not None else None,
                               constraint=constraint)
    job.role = role_key(system)
    ctx.worker.submit(job)
    return QueuedChat(job, events, plan)


def chat_router(ctx: AppContext) -> APIRouter:
    """``POST /v1/chat/completions``."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        queued = await queue_chat(body, request, ctx)
        calls_only = queued.tools is not None and queued.tools.mode in ("required", "named")
        render = CompletionRender(Reply(ctx.model_id, True, body.logprobs, calls_only), include_usage(body))
        return await respond(ctx, request, queued.job, queued.events, body.stream, render)

    return router
