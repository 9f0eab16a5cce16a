"""``kvrelay`` on a GPU machine that has no model package: random presets get the default model's tokenizer from
a converted folder (``tokenizer.json`` + ``tokenizer_meta.json``) instead.

Usage: python research/gpu_cli.py --tokenizer DIR bench --model random:llama3-8b --device cuda ...
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvrelay.weights import loader


def use_tokenizer(folder: str) -> None:
    """Every tokenizer load (``loader.load_tokenizer``, whatever model it names) returns the one in ``folder``
    (the default model's, converted): for random presets, which borrow that tokenizer."""
    from kvrelay.model.tokenizer import Tokenizer

    tok = Tokenizer.load(Path(folder))
    loader.load_tokenizer = lambda ref=loader.DEFAULT_MODEL: tok


if __name__ == "__main__":
    from kvrelay.cli import main

    args = sys.argv[1:]
    if args[:1] == ["--tokenizer"] and len(args) > 1:
        use_tokenizer(args[1])
        args = args[2:]
    sys.exit(main(args))
