"""``kvrelay serve``: an OpenAI-compatible server that reuses KV across agents from plain requests."""
