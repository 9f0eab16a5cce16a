"""Model configs: a family's traits are the one place its block differs from Llama's."""

import pytest
import torch

from kvrelay.errors import ConfigError
from kvrelay.model.config import FAMILIES, SUPPORTED_FAMILIES, FamilyTraits
from kvrelay.model.layers import DecoderLayer, RMSNorm
from kvrelay.weights.presets import PRESETS


def test_every_supported_family_has_traits_and_bad_traits_are_refused():
    assert set(SUPPORTED_FAMILIES) == set(FAMILIES)
    with pytest.raises(ConfigError, match="activation"):
        FamilyTraits(activation="relu")


@pytest.mark.parametrize("preset", ["tiny", "gemma3-tiny"])
def test_a_layer_is_built_from_its_familys_traits(preset):
    cfg = PRESETS[preset]
    traits = cfg.traits
    layer = DecoderLayer(cfg)
    assert layer.mlp.gelu == (traits.activation == "gelu_tanh")
    assert hasattr(layer, "post_feedforward_layernorm") == traits.sandwich_norms
    norm = layer.input_layernorm
    assert norm.offset == traits.norm_offset
    # an offset norm holds w in (1 + w): its fresh weights are zeros and it is then the plain normalisation
    x = torch.randn(3, cfg.hidden_size)
    plain = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    torch.testing.assert_close(norm(x), plain(x))
