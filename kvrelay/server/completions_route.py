"""``POST /v1/completions``: a text (or token-id) prompt, continued without a chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvrelay.errors import ContextLengthError
from kvrelay.server.context import AppContext, agent_of
from kvrelay.server.prompting import PromptBuild, completion_ids
from kvrelay.server.protocol import ApiError, CompletionRequest
from kvrelay.server.respond import CompletionRender, include_usage, respond
from kvrelay.server.responses import Reply
from kvrelay.server.structured_outputs import structured_constraint, structured_of

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


def checked_prompt(body: CompletionRequest, tokenizer) -> str | list[int]:
    """The one prompt of ``body``: text, or token ids in the vocabulary; an ApiError 400 otherwise."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "a list of several prompts is not supported: send one request each",
                           param="prompt", code="unsupported")
        prompt = prompt[0]
    if isinstance(prompt, list):
        vocab = tokenizer.vocab_size
        if not prompt or any(t < 0 or t >= vocab for t in prompt):
            raise ApiError(400, f"token-id prompts must be non-empty with ids in [0, {vocab})", param="prompt",
                           code="invalid_value")
    elif not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo", code="unsupported")
    if body.suffix:  # an insertion: the text must lead into the suffix, which a plain continuation does not
        raise ApiError(400, "suffix is not supported: this server continues the prompt, it does not insert text "
                       "before a suffix", param="suffix", code="unsupported")
    if body.best_of not in (None, 1):  # the answer would be the likeliest of several, not one sample
        raise ApiError(400, "best_of other than 1 is not supported: send separate requests and compare their "
                       "logprobs", param="best_of", code="unsupported")
    return prompt


def completions_router(ctx: AppContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        namespace, method = ctx.check_common(body, request)
        prompt = checked_prompt(body, ctx.tokenizer)
        structured = structured_of(body)
        constraint = await structured_constraint(structured, namespace, ctx) if structured is not None else None
        agent = agent_of(request, "completion")
        catalog = ctx.catalog

        def build():
            catalog.learn_published(namespace)  # spans and completions other replicas published to the tier
            if isinstance(prompt, list):
                return PromptBuild(list(prompt), []), agent
            try:
                return completion_ids(ctx.tokenizer, prompt, catalog.registry, namespace,
                                      ctx.worker.context_tokens), agent
            except ContextLengthError as exc:  # refused from its length before its ids become Python objects
                raise ApiError(400, str(exc), param="prompt", code="context_length_exceeded") from exc

        job, events = ctx.make_job(body, namespace, method, build, body.max_tokens, _DEFAULT_MAX_TOKENS,
                                   body.logprobs, prompt_param="prompt", constraint=constraint)
        ctx.worker.submit(job)
        render = CompletionRender(Reply(ctx.model_id, False, body.logprobs is not None), include_usage(body))
        return await respond(ctx, request, job, events, body.stream, render)

    return router
