"""``python -m kvrelay.server [flags]``: the same as ``kvrelay serve``."""

from __future__ import annotations

import argparse
import sys

from kvrelay.server.cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.server")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
