"""The megatron glm5_next model equals transformers' Glm5NextForConditionalGeneration (text part).

Same random tiny weights, written in the published checkpoint layout by transformers'
``save_pretrained``, converted HF -> Megatron with model.convert; float32 logits compared at 4k
tokens (index_topk=64 of 4096 keys, so the sparse selection is real) for each layer kind and for
the whole tiny preset; then Megatron -> HF gives back bit-identical weights. transformers'
indexer top-k is run with the project's tie rule (``_lower_index_topk``) so that exact ReLU-zero
score ties resolve the same way on both sides.
"""

import pytest
import torch

from model import convert
from model.config import MINIMAL_VISION_CONFIG, preset_hf
from model.glm5_next import build_model
from model.logprobs import token_logprobs

SEQ = 4096


def _lower_index_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` with the project's tie rule (equal values: lower index first).

    transformers' indexer calls ``index_scores.topk``; its ReLU'd pool scores tie exactly (all
    heads negative -> 0), where ``torch.topk`` order is unspecified. A stable sort makes the
    reference follow the rule, so logits can be compared exactly; any order of ties is a valid
    top-k, so this does not change what transformers computes otherwise.
    """
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def hf_logits(hf, ids):
    from unittest import mock

    with mock.patch.object(torch.Tensor, "topk", _lower_index_topk), torch.no_grad():
        return hf(input_ids=ids, use_cache=False).logits


def _hf_model(text: dict, seed: int):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=MINIMAL_VISION_CONFIG))
    # Move every weight off its structured init (zeros/ones) so each one matters in the comparison.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" not in name:
                p.add_(0.05 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return hf.eval().float()


def _variants():
    tiny = preset_hf("tiny")
    kda_dense = dict(tiny, num_hidden_layers=1, layer_types=["linear_attention"], indexer_types=["full"],
                     mlp_layer_types=["dense"])
    dsa_moe = dict(tiny, num_hidden_layers=2, layer_types=["indexed_attention"] * 2, indexer_types=["full", "shared"],
                   mlp_layer_types=["sparse", "sparse"])
    return {"kda+dense": kda_dense, "dsa_full+shared+moe": dsa_moe, "tiny": tiny}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, plain_torch_transformers):
    out = {}
    for i, (name, text) in enumerate(_variants().items()):
        hf = _hf_model(text, seed=i)
        path = tmp_path_factory.mktemp(name.replace("+", "_"))
        hf.save_pretrained(path)
        cfg, hf_text, _ = convert.load_hf_checkpoint(path)
        model = build_model(cfg).eval()
        convert.load_megatron_state(model, convert.hf_to_megatron(hf_text, cfg))
        out[name] = (hf, model, cfg, hf_text)
    return out


@pytest.mark.parametrize("name", list(_variants()))
def test_logits_match_transformers_at_4k_tokens(converted, name):
    hf, model, cfg, _ = converted[name]
    torch.manual_seed(123)
    ids = torch.randint(4, 9, (1, SEQ))
    with torch.no_grad():
        ref = hf_logits(hf, ids)
        ours = model.logits(model.hidden_states(ids)).transpose(0, 1)
        lp = token_logprobs(model, ids, chunk_tokens=1000)
    diff = (ours - ref).abs().max().item()
    print(f"{name}: logits max|diff| = {diff:.3e}")
    assert diff <= 1e-4
    ref_lp = torch.log_softmax(ref.double(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    lp_diff = (lp[0].double() - ref_lp).abs().max().item()
    print(f"{name}: per-token log-prob max|diff| = {lp_diff:.3e}")
    assert lp_diff <= 1e-4


def test_dsa_selection_is_sparse_at_4k(converted):
    """At 4k tokens each late query attends to at most index_width (79) of its thousands of visible keys."""
    from model.parallel import CPContext

    _, model, cfg, _ = converted["tiny"]
    mixer = model.layers[cfg.dsa_layers[0]].mixer
    x = torch.randn(1, SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        topk = mixer.select(x, mixer.q_a_layernorm(mixer.q_a_proj(x)), CPContext(None))
    valid = (topk[0, SEQ // 2:] >= 0).sum(-1)
    assert topk.shape[-1] == cfg.index_width == 79
    assert int(valid.max()) <= cfg.index_width and int(valid.min()) >= cfg.index_topk  # < 4% of 2k+ keys


def test_megatron_to_hf_round_trip_is_bit_identical(converted, tmp_path):
    hf, model, cfg, hf_text = converted["tiny"]
    sd = {k: v for k, v in model.state_dict().items()}
    back = convert.megatron_to_hf([[sd]], cfg)
    assert set(back) == set(hf_text)
    for k, v in hf_text.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    meta = convert.export_metadata("tiny", "ab" * 32)
    convert.save_hf_checkpoint(back, cfg, tmp_path / "export", meta)
    from transformers import Glm5NextForConditionalGeneration

    reloaded = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    ref_sd = hf.state_dict()
    for k, v in reloaded.state_dict().items():
        if "visual" not in k:
            assert torch.equal(v, ref_sd[k]), k
    cfg2, text2, _ = convert.load_hf_checkpoint(tmp_path / "export")
    assert cfg2.layer_types == cfg.layer_types and convert.state_sha256(text2) == convert.state_sha256(hf_text)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert f.metadata()["megabase_preset"] == "tiny"
        assert f.metadata()["megabase_data_manifest_sha256"] == "ab" * 32
