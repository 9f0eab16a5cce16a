"""Wiring the quality guard into one app: the guard, its shadow runner on the engine worker, its metrics and its
route. ``install_quality`` is all ``create_app`` calls; with no config (the guard off) nothing is installed and
requests run the server's method as before."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fastapi import FastAPI

from kvrelay.engine import Engine
from kvrelay.errors import ConfigError, KvRelayError
from kvrelay.reuse import get_method
from kvrelay.server.context import AppContext
from kvrelay.server.quality_metrics import QualityMetrics
from kvrelay.server.quality_route import quality_router
from kvrelay.server.quality_serving import ServedGuard
from kvrelay.server.shadow import ShadowRunner
from kvrelay.server.shadow_pacer import ShadowPacer
from kvrelay.server.shadow_teacher import ShadowTeacher

log = logging.getLogger("kvrelay.server")


def install_quality(app: FastAPI, ctx: AppContext, engine: Engine, config: Any) -> None:
    """``config``: a ``kvrelay.quality.QualityConfig`` or None. The route is always there (it says when the guard
    is off); the ladder's methods are set up on the engine at start, so every stored span carries what they need."""
    app.include_router(quality_router(ctx))
    if config is None or config.target is None:
        return
    from kvrelay.quality import QualityGuard

    config = servable_config(engine, config)
    served = ServedGuard(QualityGuard(config))
    # the ladder's learning rungs (kvcomm) learn from the shadows, in the shadow's namespace: no warm-up flag
    teacher = ShadowTeacher(engine, [r.method_spec for r in config.ladder], ctx.worker.catalog.view)
    runner = ShadowRunner(engine, served, teacher=teacher, pacer=ShadowPacer(config.shadow_share))
    runner.on_result = QualityMetrics(ctx.metrics.registry, served, runner).observe
    ctx.worker.quality, ctx.worker.shadows = served, runner
    app.state.quality = served


def servable_config(engine: Engine, config: Any) -> Any:
    """``config`` with its ladder cut to the rungs this engine can run, each set up now (so every stored span
    carries the hidden states its method needs). A rung that cannot run on this model (e.g. ``relay`` without a
    layer profile for it) is left out with a warning, as the ladder is built on the settings that exist; a ladder
    left empty is a ConfigError."""
    rungs = []
    for rung in config.ladder:
        try:
            get_method(rung.method_spec).capture_layers(engine.lm)  # a trial object: the engine keeps no broken one
            engine.method(rung.method_spec)
        except KvRelayError as exc:
            log.warning("quality guard: rung %r (%s) left out of the ladder: %s", rung.name, rung.method_spec, exc)
            continue
        rungs.append(rung)
    if not rungs:
        raise ConfigError("quality guard: no rung of the ladder can run on this model "
                          f"({', '.join(r.method_spec for r in config.ladder)}); give --quality-target off")
    start = config.start if config.start in {r.name for r in rungs} else None
    return dataclasses.replace(config, ladder=tuple(rungs), start=start)

