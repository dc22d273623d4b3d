"""HF Glm5NextTextConfig <-> megatron TransformerConfig mapping, presets and parameter counts."""

import pytest
import torch

from model.config import (
    HF_TEXT_DEFAULTS,
    MINIMAL_VISION_CONFIG,
    ConfigError,
    from_hf,
    hf_config_dict,
    parameter_count,
    preset,
    preset_hf,
    to_hf,
)


def _hf_text_params(text: dict) -> int:
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    with torch.device("meta"):
        hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=MINIMAL_VISION_CONFIG))
    return sum(p.numel() for name, p in hf.named_parameters() if not name.startswith("model.visual."))


def test_defaults_equal_transformers():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    ref = Glm5NextTextConfig()
    for k, v in HF_TEXT_DEFAULTS.items():
        assert getattr(ref, k) == v, k


@pytest.mark.parametrize("name", ["tiny", "small", "full"])
def test_round_trip_hf_megatron_hf(name):
    hf = preset_hf(name)
    back = to_hf(from_hf(hf))
    for k, v in hf.items():
        assert back[k] == v, k


def test_full_preset_is_the_published_shape_and_its_parameter_count():
    """The real GLM-5.3-Flash config.json (transformers' defaults, written here) -> TransformerConfig."""
    cfg = from_hf(hf_config_dict(preset("full")))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_moe_experts, cfg.moe_router_topk) == (45, 4096, 288, 8)
    assert cfg.layer_types.count("indexed_attention") == 11 and cfg.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]
    counts = parameter_count(cfg)
    total, active = counts["total"], counts["active"]
    print(f"full: total {total:,} parameters ({total / 1e9:.2f} B), active {active / 1e9:.2f} B")
    assert counts["total"] == _hf_text_params(preset_hf("full"))  # transformers' model on the meta device
    assert 300e9 < counts["total"] < 330e9


def test_tiny_preset_has_every_layer_kind_and_counts_like_the_model():
    from model.glm5_next import build_model

    cfg = preset("tiny")
    assert {"linear_attention", "indexed_attention"} == set(cfg.layer_types)
    assert {"full", "shared"} <= {cfg.indexer_types[i] for i in cfg.dsa_layers}
    assert {"dense", "sparse"} == set(cfg.mlp_layer_types)
    assert cfg.kv_lora_rank in (320, 512, 576) and cfg.vocab_size == 16
    assert cfg.index_topk < 4096 // 8  # selection is sparse at 4k tokens
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == parameter_count(cfg)["total"] == _hf_text_params(preset_hf("tiny"))


def test_config_json_loads_in_transformers():
    from transformers import Glm5NextConfig

    d = hf_config_dict(preset("tiny"))
    assert d["architectures"] == ["Glm5NextForConditionalGeneration"] and d["model_type"] == "glm5_next"
    for k in ("mhc", "mla_use_nope", "topk_method", "scoring_func", "indexer_rope_interleave"):
        assert k in d["text_config"]
    assert Glm5NextConfig(**{k: v for k, v in d.items() if k != "architectures"}).text_config.layer_types == preset(
        "tiny").layer_types


@pytest.mark.parametrize(
    "change, match",
    [
        ({"qk_rope_head_dim": 64}, "NoPE"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 8}, "top 2"),
        ({"indexer_types": ["full", "shared", "full", "full"]}, "shared-indexer"),
    ],
)
def test_unsupported_configs_raise(change, match):
    with pytest.raises(ConfigError, match=match):
        from_hf({**preset_hf("tiny"), **change})


def test_unknown_dsa_dkv_path_raises():
    with pytest.raises(ConfigError, match="dsa_dkv"):
        preset("tiny", dsa_dkv="atomics")


@pytest.mark.parametrize("field", ["kda_conv", "dsa_kl", "moe_permute", "hc_gemm", "dsa_fwd"])
def test_unknown_kernel_path_raises_naming_the_field(field):
    with pytest.raises(ConfigError, match=f"{field}='fused'"):
        preset("tiny", **{field: "fused"})
