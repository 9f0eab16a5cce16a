"""kvrelay's transformer running on vLLM's own modules: the tokens the connector computes, with no second model.

The connector computes some claimed tokens itself (gaps between reused runs, the tokens a repair method
recomputes), in the worker, before vLLM's forward. It does that with kvrelay's scheduled prefill (the
per-layer active set every reuse method is built on), bound to the model vLLM already loaded:

- Linear projections call vLLM's modules (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``). Their
  weights cannot be borrowed as tensors: on the CPU, vLLM moves each linear weight into a oneDNN handle and
  leaves an empty parameter behind (``dispatch_cpu_unquantized_gemm(remove_weight=True)``). Calling the modules
  runs vLLM's own kernels on vLLM's own weights, on any backend. vLLM's fused q/k/v and gate/up outputs are in
  kvrelay's fused order (q, k, v; gate, up), so they split the same way.
- Embeddings, norms and the output head keep their tensors in vLLM, and kvrelay's modules point at them.

vLLM's API gives a connector the paged KV but not the model. The model is found among the live modules of the
worker process: the one module holding, under vLLM's layer names, the attention layers vLLM registered in its
forward context. No vLLM file is patched (LMCache's CacheBlend patches vLLM's worker to hand it the model).
"""

from __future__ import annotations

import gc
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.errors import ConfigError
from kvrelay.model.config import ModelConfig
from kvrelay.model.layers import MLP, Attention, DecoderLayer
from kvrelay.model.transformer import Transformer


def find_model(attention_layers: dict[str, nn.Module]) -> nn.Module:
    """The live module that holds ``attention_layers`` (vLLM's forward context) under their names."""
    if not attention_layers:
        raise ConfigError("kvrelay connector: vLLM registered no attention layers")
    name, layer = next(iter(attention_layers.items()))
    found = []
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        modules = []
        for obj in gc.get_objects():
            try:
                if isinstance(obj, nn.Module):
                    modules.append(obj)
            except ReferenceError:  # a weak proxy whose object is gone
                continue
    for obj in modules:
        try:
            if obj is not layer and obj.get_submodule(name) is layer:
                found.append(obj)
        except Exception:  # noqa: BLE001 - a module that cannot answer is not the model
            continue
    if len(found) != 1:
        raise ConfigError(f"kvrelay connector: found {len(found)} modules holding vLLM's attention layer {name!r}, "
                          "expected the one model")
    return found[0]


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A vLLM linear module's output (they return (output, bias) pairs)."""
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


class VllmAttention(Attention):
    """kvrelay's attention whose q/k/v and output projections are vLLM's modules."""

    def __init__(self, cfg: ModelConfig, vllm_attn: nn.Module) -> None:
        super().__init__(cfg)  # built on the meta device: its own projections hold no memory
        self._vllm = (vllm_attn.qkv_proj, vllm_attn.o_proj)  # a tuple: not registered as kvrelay's children
        if self.qk_norm:
            self.q_norm.weight = vllm_attn.q_norm.weight
            self.k_norm.weight = vllm_attn.k_norm.weight

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> q, k and v side by side, from vLLM's own qkv_proj."""
        return _call(self._vllm[0], x)

    def out(self, attn_out: torch.Tensor) -> torch.Tensor:
        return _call(self._vllm[1], attn_out)


class VllmMLP(MLP):
    """kvrelay's MLP whose gate/up and down projections are vLLM's modules."""

    def __init__(self, cfg: ModelConfig, vllm_mlp: nn.Module) -> None:
        super().__init__(cfg)
        self._vllm = (vllm_mlp.gate_up_proj, vllm_mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _call(self._vllm[0], x).chunk(2, dim=-1)  # [n, inter] each
        # in place, as kvrelay's MLP: the product is a temporary, two fewer [n, inter] tensors a layer
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate, inplace=True)
        return _call(self._vllm[1], act.mul_(up))


_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def bind_transformer(cfg: ModelConfig, vllm_model: nn.Module) -> Transformer:
    """A kvrelay ``Transformer`` for ``cfg`` computing with ``vllm_model``'s modules and tensors (no copy)."""
    try:
        backbone, head = vllm_model.model, vllm_model.lm_head
        vllm_layers = list(backbone.layers)
        with torch.device("meta"):
            model = Transformer(cfg)
            layers = []
            for layer in vllm_layers:
                ours = DecoderLayer(cfg)
                ours.self_attn = VllmAttention(cfg, layer.self_attn)
                ours.mlp = VllmMLP(cfg, layer.mlp)
                layers.append(ours)
        for ours, layer in zip(layers, vllm_layers, strict=True):
            for name in _NORMS:
                if hasattr(ours, name):
                    getattr(ours, name).weight = getattr(layer, name).weight
        model.model.layers = nn.ModuleList(layers)
        model.model.embed_tokens.weight = backbone.embed_tokens.weight
        model.model.norm.weight = backbone.norm.weight
        model.lm_head.weight = head.weight
    except AttributeError as e:
        raise ConfigError(f"kvrelay connector: vLLM's {type(vllm_model).__name__} does not have the module layout "
                          f"kvrelay binds to ({e}); the connector loads spans but computes no token itself") from None
    if len(vllm_layers) != cfg.num_layers:
        raise ConfigError(f"kvrelay connector: vLLM's model has {len(vllm_layers)} layers, its config "
                          f"{cfg.num_layers}")
    model._rope = None
    return model.eval()
