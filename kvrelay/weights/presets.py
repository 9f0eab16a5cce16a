"""``random:<preset>`` shapes: known model configs, for timing with random weights only.

No weights can reach a GPU machine here, and timing does not need them. Their text is noise, so
fidelity numbers on them mean nothing. This module is data only: the loader builds the models
(``kvrelay.weights.loader.build_random``), so the dependency runs one way, loader -> presets.
"""

from __future__ import annotations

from kvrelay.model.config import ModelConfig, gemma3_layer_types

_GEMMA3 = dict(family="gemma3", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_theta=10000.0,
               tie_word_embeddings=True, qk_norm=True, max_position_embeddings=32768, bos_token_id=2,
               eos_token_ids=(1,))
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(family="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                        max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "smollm2-135m": ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-1b": ModelConfig(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                             max_position_embeddings=131072, rope_theta=500000.0,
                             rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True),
    "llama3-8b": ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             max_position_embeddings=131072, rope_theta=500000.0,
                             rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    # Gemma 3's architecture in small: 2 of every 3 layers local with a 16-token window (tests' prompts
    # are longer), the vocabulary of the default tokenizer
    "gemma3-tiny": ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=6,
                               num_heads=4, num_kv_heads=1, head_dim=16, sliding_window=16,
                               layer_types=gemma3_layer_types(6, pattern=3), query_pre_attn_scalar=16.0, **_GEMMA3),
    "gemma3-270m": ModelConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                               num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512,
                               layer_types=gemma3_layer_types(18), query_pre_attn_scalar=256.0, **_GEMMA3),
}
