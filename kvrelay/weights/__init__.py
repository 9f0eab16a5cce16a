"""Model files: finding them (aliases, paths), converting GGUF once, checking the converted cache,
and building a ``LoadedModel`` from them. The forward itself lives in ``kvrelay.model``."""
