"""One-off notices of the weights layer (a conversion starting, a cache rebuilt), written where the process writes
its logs.

A command line without logging set up (``kvrelay demo``, ``kvrelay bench``) gets the notice as a plain line on
stderr; a process that set up logging (``kvrelay serve``, whose ``--log-format json`` makes every line a JSON
object) gets it as a record of logger ``kvrelay.weights``, so a log collector never meets a line it cannot parse.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("kvrelay.weights")


def notice(message: str) -> None:
    """``message`` as a warning-level record when logging has a handler for it, else ``kvrelay: message`` on stderr.

    Warning level: a conversion takes seconds to minutes of the start-up, which an operator at the default log level
    should see."""
    if logger.hasHandlers():
        logger.warning(message)
    else:
        print(f"kvrelay: {message}", file=sys.stderr, flush=True)

