"""The quality guard's core: targets, running estimates with bounds, the ladder of settings and the guard that
moves each (namespace, role) along it. Torch-free bookkeeping; the server runs the shadow references and feeds
their comparisons in (``kvrelay.server.shadow``)."""

from kvrelay.quality.config import DEFAULT_TARGET, QualityConfig, QualityTarget
from kvrelay.quality.estimate import RungEstimate, wilson_bounds
from kvrelay.quality.guard import QualityGuard
from kvrelay.quality.ladder import DEFAULT_LADDER, LadderController, Rung

__all__ = ["DEFAULT_LADDER", "DEFAULT_TARGET", "LadderController", "QualityConfig", "QualityGuard",
           "QualityTarget", "Rung", "RungEstimate", "wilson_bounds"]
