"""``import kvrelay`` gives the Python API's names, each imported on first use (the package import loads no torch)."""

import subprocess
import sys

import pytest

import kvrelay


def test_the_python_api_is_importable_from_the_package():
    from kvrelay.engine import Engine
    from kvrelay.errors import KvRelayError, SpanRefError
    from kvrelay.reuse.base import SpanRef

    assert kvrelay.Engine is Engine and kvrelay.SpanRef is SpanRef and kvrelay.SpanRefError is SpanRefError
    for name in kvrelay.__all__:
        assert getattr(kvrelay, name) is not None, name
    assert all(issubclass(getattr(kvrelay, n), KvRelayError) for n in kvrelay.__all__ if n.endswith("Error"))
    assert {"Engine", "load_model", "chat_prompt_ids", "CallInput", "KVStore"} <= set(dir(kvrelay))
    with pytest.raises(AttributeError, match="module 'kvrelay' has no attribute 'Engin'"):
        kvrelay.Engin  # noqa: B018


def test_importing_the_package_loads_no_torch():
    code = "import sys, kvrelay; print('torch' in sys.modules, 'kvrelay.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
