"""kvrelay: reuse KV caches across the agents of a multi-agent LLM pipeline."""

__version__ = "0.1.0"
