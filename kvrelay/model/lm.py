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
    # Decode on 4-bit stand-ins (``--int4-decode``): e.g. "int4 (120 of 120 weights)". Its prefill is the fp32
    # path's, and relay then uses the layer profile calibrated on that path (fp32 decoding), found under its
    # fingerprint.
    decode_weights: str = "fp32"
    # the fingerprint relay's profile is found under when it is another model's: the fp32 path's (int4 decode), or
    # the model a Hugging Face folder was exported from (``kvrelay.weights.hf_export``)
    prefill_fingerprint: str | None = None

    @property
    def profile_fingerprint(self) -> str:
        """The fingerprint relay's layer profile is stored and found under."""
        return self.prefill_fingerprint or self.fingerprint

    @property
    def matmuls(self) -> str:
        """What runs the matmuls (``kvrelay.model.packed``): e.g. "oneDNN packed (121 weights)"."""
        return self.model.matmuls

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def fingerprint_of(config: ModelConfig, weights_id: str, dtype: torch.dtype, tokenizer_id: str) -> str:
    blob = json.dumps([config.to_dict(), weights_id, str(dtype), tokenizer_id], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
