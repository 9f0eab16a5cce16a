"""The shared KV tier: spans on disk or in Redis behind the memory store, shared by every process on it."""
