"""Command-line output whose reader may go away: ``kvrelay methods | head -1`` or
``python benchmarks/make_tables.py --files | head -1`` stop quietly, as Unix tools do, not with a BrokenPipeError
traceback. ``kvrelay.cli.main`` and the benchmark scripts that print listings share it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def reader_gone() -> int:
    """Call on a ``BrokenPipeError`` from stdout: stdout then writes to /dev/null, so that Python's own flush at exit
    raises nothing; the exit status (0: the reader took what it wanted)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def run_main(main: Callable[[], int | None]) -> int:
    """``main()``'s exit status (None: 0), stdout flushed here rather than at exit so that a reader that went away
    is caught (``reader_gone``) wherever the write failed; for ``sys.exit(run_main(main))``."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()
    return code or 0
