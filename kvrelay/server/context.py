"""The app's shared objects and the request plumbing every route uses (tenant, common checks, jobs, events).

One ``AppContext`` per app: the chat, completions and Responses routes all resolve the tenant, check the
common parameters, queue a ``Job`` and read its events the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvrelay.cache.tenancy import namespace_for
from kvrelay.errors import KvRelayError
from kvrelay.reuse import PIPELINE_METHODS, get_method
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.events import Event
from kvrelay.server.grammar_cache import GrammarCache
from kvrelay.server.grammar_compiles import GrammarCompiles
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.penalty_check import penalties_of
from kvrelay.server.protocol import ApiError
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.server.vllm_params import vllm_sampling

if TYPE_CHECKING:
    from kvrelay.server.app import ServerSettings

DISCONNECT_POLL_S = 0.1


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: the longest ``x-kvrelay-agent``, as a body's ``cache_salt``: the name is a key the quality guard keeps per role
#: (up to ``kvrelay.quality.guard.MAX_ROLES`` a tenant) and echoes in every response, so a 60 KB header would be
#: kept 10,000 times over
MAX_AGENT_CHARS = 256


def agent_of(request: Request, fallback: str) -> str:
    """The request's agent: its ``x-kvrelay-agent`` header, else ``fallback``; a 400 naming the header when it is
    too long."""
    agent = request.headers.get("x-kvrelay-agent")
    if agent and len(agent) > MAX_AGENT_CHARS:
        raise ApiError(400, f"the x-kvrelay-agent header has {len(agent)} characters, over {MAX_AGENT_CHARS}",
                       param="x-kvrelay-agent", code="invalid_value")
    return agent or fallback


@dataclass
class AppContext:
    worker: EngineWorker
    catalog: SpanCatalog
    metrics: ServerMetrics
    settings: ServerSettings
    tokenizer: Any
    model_id: str
    compiles: GrammarCompiles = field(default_factory=GrammarCompiles)  # requests' grammars (tools, formats)
    grammars: GrammarCache = field(default_factory=GrammarCache)  # compiled ones, per namespace

    def namespace_of(self, request: Request, cache_salt: str | None) -> str:
        """The tenant's namespace: its API key's digest (when keys are set) and its ``cache_salt``'s."""
        key_digest = None
        if self.settings.api_keys:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if key not in self.settings.api_keys:
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                               "authentication_error", code="invalid_api_key")
            key_digest = digest(key)
        return namespace_for(key_digest, digest(cache_salt) if cache_salt else None)

    def check_common(self, body, request: Request) -> tuple[str, str]:
        """The request's namespace and reuse method, after the checks every generating route shares."""
        namespace = self.namespace_of(request, body.cache_salt)
        if body.model != self.model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, "n > 1 is not supported: send n separate requests", param="n", code="unsupported")
        if body.stream_options is not None and not body.stream:  # OpenAI's 400: the options of a stream only
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")
        if len(body.stop_list()) > 4:
            raise ApiError(400, "at most 4 stop sequences", param="stop", code="invalid_value")
        method = (body.kvrelay.method if body.kvrelay and body.kvrelay.method else self.settings.method).strip()
        try:
            name = get_method(method).name
        except KvRelayError as exc:
            raise ApiError(400, str(exc), param="kvrelay.method", code="invalid_value") from exc
        if name not in PIPELINE_METHODS:
            raise ApiError(400, f"method {name!r} cannot serve single calls; use one of {', '.join(PIPELINE_METHODS)}",
                           param="kvrelay.method", code="invalid_value")
        return namespace, method

    def make_job(self, body, namespace: str, method: str, build, max_tokens: int | None, default_max_tokens: int,
                 num_top_logprobs: int | None, **extra: Any) -> tuple[Job, asyncio.Queue]:
        """A job for ``body`` and the asyncio queue its events arrive on; ``extra``: more ``Job`` fields. A bad
        ``logit_bias`` key or vLLM parameter is an ApiError 400 here, before anything is queued."""
        # a token id has a logit only where both agree (a padded lm_head has rows no token decodes to)
        vocab_size = min(self.tokenizer.vocab_size, self.worker.engine.lm.config.vocab_size)
        vllm = vllm_sampling(body, self.tokenizer, vocab_size, default_max_tokens if max_tokens is None else max_tokens)
        penalties = penalties_of(body, vocab_size, vllm.repetition_penalty, vllm.min_tokens, vllm.min_tokens_stop_ids)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        job = Job(build, namespace, method, max_tokens, default_max_tokens, body.temperature, body.top_p,
                  secrets.randbits(63) if body.seed is None else body.seed, body.stop_list(), num_top_logprobs,
                  bool(body.kvrelay and body.kvrelay.debug), emit,
                  cache_output=not body.kvrelay or body.kvrelay.cache_output,
                  first_token_logprobs=bool(body.kvrelay and body.kvrelay.first_token_logprobs),
                  method_named=bool(body.kvrelay and body.kvrelay.method and body.kvrelay.method.strip()),
                  penalties=penalties, vllm=vllm, **extra)
        return job, events

    async def next_event(self, request: Request, job: Job, events: asyncio.Queue) -> Event | None:
        """The job's next event, or None when the client disconnected (the job is then cancelled).

        The connection is checked every ``DISCONNECT_POLL_S`` whether or not events keep coming, since
        a decoding job emits faster than that.
        """
        while True:
            now = time.monotonic()
            if now - job.disconnect_checked_s >= DISCONNECT_POLL_S:
                job.disconnect_checked_s = now
                if await request.is_disconnected():
                    self.worker.cancel(job)
                    return None
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
