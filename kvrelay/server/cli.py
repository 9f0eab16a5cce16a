"""``kvrelay serve``: flags and the command (hooked into ``kvrelay/cli.py`` by ``add_serve_parser``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket

from kvrelay.errors import ConfigError
from kvrelay.server.key_files import read_api_keys

STARTUP_FAILURE = 3  # the exit status of a server that could not start (uvicorn's, as uvicorn.run exits)
DEFAULT_METHOD = "epic"  # best measured fidelity for its speed on our workloads (README, "Point your agent...")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to an argparse sub-parser set."""
    from kvrelay.cache.tenancy import TenancyConfig
    from kvrelay.flags import add_dataclass_flags, add_model_flags, finite_float
    from kvrelay.server.json_logs import LOG_FORMATS
    from kvrelay.server.serve_config import (
        DEFAULT_MAX_TOKENS,
        DEFAULT_PREFILL_CHUNK_TOKENS,
        MatchConfig,
        ShutdownConfig,
    )
    from kvrelay.weights.aliases import DEFAULT_MODEL

    p = subparsers.add_parser("serve", help="OpenAI-compatible server that reuses KV across agents automatically")
    add_model_flags(p, DEFAULT_MODEL)
    p.add_argument("--method", default=None,
                   help=f"reuse method for requests that name none while --quality-target is off (default "
                        f"{DEFAULT_METHOD}; with the guard on, each agent's rung picks); a request picks its own with "
                        "{\"kvrelay\": {\"method\": ...}}")
    p.add_argument("--methods", default="",
                   help="more methods requests may ask for, set up at start so that every stored span carries "
                        "the hidden states they need (e.g. relay); comma-separated specs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument("--kv-budget-gb", type=finite_float, default=2.0,
                   help="byte budget of the KV span store (GiB; default 2)")
    add_dataclass_flags(p, TenancyConfig)
    add_dataclass_flags(p, MatchConfig)
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="one API key per line; requests then need 'Authorization: Bearer <key>', and each key "
                        "gets its own cache namespace")
    p.add_argument("--metrics-key", default=None, metavar="FILE",
                   help="a file holding the bearer token /metrics then needs (for a Prometheus scrape job's "
                        "credentials_file); with --api-keys and without it, /metrics is off, since it sums every "
                        "tenant's traffic (docs/tenants.md)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond this get 429 (default 64)")
    p.add_argument("--max-running", type=int, default=8,
                   help="requests decoded together in one batch (default 8)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=DEFAULT_PREFILL_CHUNK_TOKENS,
                   help="chunked prefill: a piece prefilled between two decode steps of the running requests costs "
                        "what this many tokens cost at the start of a prompt (pieces deeper in a long prompt get "
                        f"fewer tokens; a long prompt delays the others by one piece; default "
                        f"{DEFAULT_PREFILL_CHUNK_TOKENS})")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most tokens a chat request without max_tokens or max_completion_tokens (a Responses "
                        "request: without max_output_tokens) gets; it bounds how long such a request holds a slot of "
                        f"the decode batch (default {DEFAULT_MAX_TOKENS}; text completions keep OpenAI's 16)")
    add_quality_flags(p)
    add_dataclass_flags(p, ShutdownConfig)
    p.add_argument("--store", default="memory",
                   help="span store: memory (default), disk:PATH or redis://host:port/db; with a shared tier, "
                        "replicas on the same tier reuse each other's spans (credentials are never printed)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="server log level (default: warning)")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text lines, or json: one JSON object a line with time, level, logger, message and, for "
                        "a request, request_id (the access line adds http: method, path, status, cut, duration_ms and "
                        "client_request_id) "
                        "(default: text)")
    p.set_defaults(fn=cmd_serve)
    return p


def add_quality_flags(p: argparse.ArgumentParser) -> None:
    """``--quality-target``, ``--quality-sample``, ``--quality-shadow-share`` and ``--quality-ladder``: defaults and
    help from ``QualityConfig``."""
    from kvrelay.flags import finite_float
    from kvrelay.quality import QualityConfig
    from kvrelay.quality.ladder import ladder_text

    fields = {f.name: f for f in dataclasses.fields(QualityConfig)}
    defaults = QualityConfig()
    p.add_argument("--quality-target", default=str(defaults.target),
                   help=f"{fields['target'].metadata['help']}: each agent (x-kvrelay-agent or its system prompt) "
                        f"per tenant climbs a ladder of reuse settings to meet it, measured by shadow full "
                        f"references (docs/quality.md; default: {defaults.target})")
    p.add_argument("--quality-sample", type=finite_float, default=defaults.sample_rate,
                   help=f"{fields['sample_rate'].metadata['help']} (default: {defaults.sample_rate:g})")
    p.add_argument("--quality-shadow-share", type=finite_float, default=defaults.shadow_share,
                   help=f"{fields['shadow_share'].metadata['help']} (default: {defaults.shadow_share:g})")
    p.add_argument("--quality-ladder", default=ladder_text(defaults.ladder),
                   help=f"{fields['ladder'].metadata['help']}: method specs or NAME=SPEC, comma-separated; a learning "
                        f"rung (e.g. kvcomm: naive,kvcomm,relay,prefix) learns from the shadow references, no "
                        f"warm-up (docs/quality.md; default: {ladder_text(defaults.ladder)})")


def resolve_method(args: argparse.Namespace, guard_on: bool) -> None:
    """``args.method`` set (``DEFAULT_METHOD`` where the flag was not given); a ``--method`` given while the quality
    guard is on serves only requests that name it, so the start says so instead of leaving the flag silently idle."""
    from kvrelay.reuse import get_method

    if args.method is None:
        args.method = DEFAULT_METHOD
    elif guard_on:
        get_method(args.method)  # a spec that is no method is refused, not warned about first
        logging.getLogger("kvrelay.server").warning(
            "--method %s serves requests that name no method only with --quality-target off; with the quality "
            "guard on, each agent's rung picks its method (a request may still name %s)", args.method, args.method)


def quality_config(args: argparse.Namespace):
    """The guard's config from the flags; None with ``--quality-target off``."""
    from kvrelay.quality import QualityConfig
    from kvrelay.quality.ladder import ladder_text, parse_ladder
    from kvrelay.reuse import get_method

    target = QualityConfig.parse_target(args.quality_target)
    text = getattr(args, "quality_ladder", None)  # None: a caller's namespace without the flag
    ladder = parse_ladder(ladder_text(QualityConfig().ladder) if text is None else text)
    for rung in ladder:  # checked with the guard off too: a typo there is refused, not kept for when it is on
        try:
            get_method(rung.method_spec)  # a bad spec fails here, before the model loads
        except ConfigError as exc:  # named as the ladder's: --method and --methods take specs too
            raise ConfigError(f"quality ladder rung {rung.name!r}: {exc}") from None
    if target is None:
        return None
    share = getattr(args, "quality_shadow_share", QualityConfig().shadow_share)  # a caller's namespace without it
    return QualityConfig(target=target, sample_rate=args.quality_sample, shadow_share=share, ladder=ladder)


def serving_methods(args: argparse.Namespace, ladder: tuple | None = None) -> str:
    """What the startup line says runs a request that names no method: with the quality guard on, its agent's rung
    of the ladder, not ``--method`` (which runs them only with ``--quality-target off``). ``ladder``: the rungs the
    app runs (those this model can run), when known."""
    from kvrelay.quality.ladder import ladder_text

    config = quality_config(args)
    if config is None:
        return f"with method {args.method}"
    rungs = ladder_text(ladder if ladder is not None else config.ladder)
    return f"with each agent at its quality-guard rung ({rungs}; target {args.quality_target})"


def check_can_listen(host: str, port: int) -> None:
    """ConfigError unless ``host:port`` can be bound now, as uvicorn will bind it (its family rule, SO_REUSEADDR):
    a port in use was uvicorn's error after the model had loaded (and after the "serving on" line). A port taken
    between this check and uvicorn's bind still fails there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def build_app(args: argparse.Namespace):
    """Model, store, engine and the FastAPI app for ``args``."""
    from kvrelay.cache.tenancy import TenancyConfig
    from kvrelay.engine import Engine
    from kvrelay.flags import dataclass_from_args, load_model_from
    from kvrelay.reuse import PIPELINE_METHODS, get_method, split_method_specs
    from kvrelay.server.access import read_metrics_key
    from kvrelay.server.app import ServerSettings, create_app
    from kvrelay.server.catalog import MatchConfig, SpanCatalog
    from kvrelay.server.serve_config import ShutdownConfig
    from kvrelay.tier.store_url import parse_store_url
    from kvrelay.tier.tiered import open_store

    if not 0 <= args.port <= 65535:  # else uvicorn's OverflowError, once the model has loaded
        raise ConfigError(f"--port must be a TCP port in [0, 65535], got {args.port}")
    if args.kv_budget_gb <= 0:
        raise ConfigError(f"--kv-budget-gb must be positive, got {args.kv_budget_gb}")
    if args.max_queue < 1 or args.max_running < 1:
        raise ConfigError("--max-queue and --max-running must be >= 1")
    extra_methods = split_method_specs(args.methods)
    quality = quality_config(args)  # a bad target fails here, before the model loads
    given = (args.method,) if args.method is not None else ()  # None: the default, resolved below
    for flag, specs in (("--method", given), ("--methods", extra_methods)):
        for spec in specs:
            if get_method(spec).name not in PIPELINE_METHODS:  # a bad spec fails here, before the model loads
                raise ConfigError(f"{flag} {spec}: plans branches (kvrelay bench --workload gsm8k-branches), not a "
                                  f"server's single calls; serve takes {', '.join(PIPELINE_METHODS)}")
    resolve_method(args, guard_on=quality is not None)
    keys = read_api_keys(args.api_keys)
    metrics_key = read_metrics_key(args.metrics_key)
    tenancy = dataclass_from_args(TenancyConfig, args)
    match = dataclass_from_args(MatchConfig, args)
    shutdown = dataclass_from_args(ShutdownConfig, args)  # a negative grace fails here, before the model loads
    # its checks (--default-max-tokens, --prefill-chunk-tokens) run here, before the model loads
    settings = ServerSettings(method=args.method, api_keys=keys, max_queue=args.max_queue,
                              max_running=args.max_running, prefill_chunk_tokens=args.prefill_chunk_tokens,
                              default_max_tokens=args.default_max_tokens, metrics_key=metrics_key, quality=quality,
                              shutdown=shutdown)
    try:  # a URL open_store would refuse, refused now: it was refused only after the model had loaded
        parse_store_url(args.store)
    except ConfigError as exc:
        raise ConfigError(f"--store: {exc}") from None
    # last before the model loads: a bad flag is named whatever holds the port (a test's app, never bound, too)
    check_can_listen(args.host, args.port)
    lm = load_model_from(args, progress=args.log_format == "text")  # a bar on stderr would break JSON lines
    try:  # what only opening it finds (a directory that cannot be made, as under /proc) names the flag too
        store = open_store(args.store, int(args.kv_budget_gb * (1 << 30)), fingerprint=lm.fingerprint,
                           namespace_budget_bytes=tenancy.namespace_budget_bytes)
    except ConfigError as exc:
        raise ConfigError(f"--store: {exc}") from None
    store.set_namespace_idle_s(tenancy.idle_s)
    engine = Engine(lm, store, methods=(args.method, "full", *extra_methods))
    for spec in (args.method, *extra_methods):  # what a method resolves from the model (a layer past the last one,
        engine.method(spec).settings(lm)       # a missing profile) is refused now, not in every request's 400
    catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, match=match, decode=lm.tokenizer.decode)
    return create_app(engine, catalog, settings)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvrelay.errors import KvRelayError
    from kvrelay.server.json_logs import announce, configure_logging

    configure_logging(args.log_level, args.log_format)
    try:
        app = build_app(args)
    except KvRelayError as exc:
        announce(f"kvrelay serve: error: {exc}", args.log_format, logging.ERROR)
        return 2
    import gc

    import torch

    from kvrelay.tier.backends.base import redact

    # The model, tokenizer and imported modules live as long as the process: out of the collector's sight, a full
    # collection no longer re-scans their ~200K objects (about 130 ms on the 2-core VM), a pause that lands on
    # whichever request's lookup or decode step triggers it.
    gc.collect()
    gc.freeze()

    lm = app.state.worker.engine.lm
    quality = getattr(app.state, "quality", None)  # its ladder: the rungs this model can run
    ladder = quality.guard.config.ladder if quality is not None else None
    announce(f"kvrelay serve: {args.model} {serving_methods(args, ladder)} on http://{args.host}:{args.port}/v1 "
             f"(store: {redact(args.store)}; decode weights: {lm.decode_weights}; matmuls: {lm.matmuls}; "
             f"threads: {torch.get_num_threads()})", args.log_format)
    from kvrelay.server.graceful import graceful_server
    from kvrelay.server.http_protocol import JsonErrorH11Protocol
    from kvrelay.server.key_reload import KeyReloader
    from kvrelay.server.shutdown_log import install_cut_off_filter

    install_cut_off_filter()  # a request uvicorn still cancels at the end: one line, not its traceback

    # http: uvicorn's h11 protocol with its own 400s (unparsable requests) in OpenAI's error JSON; access_log off:
    # kvrelay.server.request_ids writes the access line, with the request's id (--log-level info shows it)
    # log_config None with --log-format json: uvicorn's own lines go to the root handler, as JSON like the others
    # SIGTERM / SIGINT: queued requests answered 503 at once, running ones get --shutdown-grace-s (graceful)
    json_logs = {"log_config": None} if args.log_format == "json" else {}
    # SIGHUP: the --api-keys and --metrics-key files read again (kvrelay.server.key_reload), no restart
    reloader = KeyReloader(app.state.context.settings, args.api_keys, args.metrics_key)
    server = graceful_server(app, on_hangup=reloader.reload, host=args.host, port=args.port,
                             log_level=args.log_level, http=JsonErrorH11Protocol, access_log=False, **json_logs)
    try:
        server.run()
    except KeyboardInterrupt:  # as uvicorn.run: a Ctrl-C uvicorn re-raises once it has shut down
        pass
    return 0 if server.started else STARTUP_FAILURE
