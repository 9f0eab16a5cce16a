"""RKSC's wing: branches over a shared root, batched decode over it, the block cache, ASKS."""
