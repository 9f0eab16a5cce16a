"""Wiring the quality guard into one app: the guard, its shadow runner on the engine worker, its metrics and its
route. ``install_quality`` is all ``create_app`` calls; with no config (the guard off) nothing is installed and
requests run the server's method as before."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvrelay.engine import Engine
from kvrelay.server.context import AppContext
from kvrelay.server.quality_metrics import QualityMetrics
from kvrelay.server.quality_route import quality_router
from kvrelay.server.quality_serving import ServedGuard
from kvrelay.server.shadow import ShadowResult, ShadowRunner


def install_quality(app: FastAPI, ctx: AppContext, engine: Engine, config: Any) -> None:
    """``config``: a ``kvrelay.quality.QualityConfig`` or None. The route is always there (it says when the guard
    is off); the ladder's methods are set up on the engine at start, so every stored span carries what they need."""
    app.include_router(quality_router(ctx))
    if config is None or getattr(config, "target", None) is None:
        return
    from kvrelay.quality import QualityGuard

    served = ServedGuard(QualityGuard(config))
    for spec in ladder_method_specs(config):
        engine.method(spec)
    metrics = QualityMetrics(ctx.metrics.registry, served)
    runner = ShadowRunner(engine, served)

    def on_result(result: ShadowResult) -> None:
        metrics.observe(result)
        metrics.observe_failures(runner.num_failed)

    runner.on_result = on_result
    ctx.worker.quality, ctx.worker.shadows = served, runner
    app.state.quality = served


def ladder_method_specs(config: Any) -> list[str]:
    """The method specs of the config's ladder (cheapest to safest)."""
    return [rung.method_spec for rung in config.ladder]

