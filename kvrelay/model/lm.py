"""``LoadedModel``: a model with its tokenizer, config and the fingerprint that says whose KV a
stored entry is. Built by ``kvrelay.weights.loader``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from kvrelay.model.config import ModelConfig
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.model.transformer import Transformer


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    fingerprint: str  # whose KV a cache entry is: architecture, weights, dtype, tokenizer
    source: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def fingerprint_of(config: ModelConfig, weights_id: str, dtype: torch.dtype, tokenizer_id: str) -> str:
    blob = json.dumps([config.to_dict(), weights_id, str(dtype), tokenizer_id], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
