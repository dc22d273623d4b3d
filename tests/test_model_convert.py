"""Weight conversion: TP/EP sharding round trips exactly; the in-memory HF state dict; cpu_compat."""

import re

import pytest
import torch

from model import convert, cpu_compat
from model.config import preset
from model.glm5_next import build_model


def test_tp_ep_sharding_round_trip_is_bit_identical():
    cfg = preset("tiny")
    model = build_model(cfg, seed=11)
    hf = convert.megatron_to_hf([[model.state_dict()]], cfg)
    tp, ep = 2, 4
    shards = [[convert.hf_to_megatron(hf, cfg, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep) for t in range(tp)]
              for e in range(ep)]
    # Rank (tp=1, ep=2) holds the second half of a column-parallel weight and experts 4..5 only.
    local = shards[2][1]
    p = "model.language_model.layers."
    assert torch.equal(local["layers.0.mixer.q_proj.weight"], hf[p + "0.self_attn.q_proj.weight"][32:])
    assert torch.equal(local["layers.1.mixer.o_proj.weight"], hf[p + "1.self_attn.o_proj.weight"][:, 64:])
    assert torch.equal(local["layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["model.language_model.layers.1.mlp.experts.5.down_proj.weight"])
    gate = hf["model.language_model.layers.0.mlp.gate_proj.weight"]
    up = hf["model.language_model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(local["layers.0.mlp.linear_fc1.weight"], torch.cat([gate[64:], up[64:]]))
    assert "layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in local
    back = convert.megatron_to_hf(shards, cfg)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_in_memory_hf_state_dict_matches_conversion():
    cfg = preset("tiny")
    model = build_model(cfg, seed=12)
    sd = convert.hf_state_dict(model)
    other = build_model(cfg, seed=13)
    convert.load_hf_into_model(other, sd)
    assert convert.state_sha256(convert.hf_state_dict(other)) == convert.state_sha256(sd)
    assert "lm_head.weight" in sd and "model.language_model.layers.1.mlp.experts.7.up_proj.weight" in sd
    assert convert.state_sha256(sd) == convert.state_sha256(convert.megatron_to_hf([[model.state_dict()]], cfg))


def test_cpu_compat_maps_cuda_calls_and_rng_tracker_forks_on_cpu():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    build_model(preset("tiny"))  # enables the mapping and initialises parallel state
    assert cpu_compat.is_active() and torch.cuda.current_device() == torch.device("cpu")
    model_parallel_cuda_manual_seed(5)
    tracker = get_cuda_rng_tracker()
    before = torch.rand(3)
    with tracker.fork():
        a = torch.rand(3)
    model_parallel_cuda_manual_seed(5)
    with tracker.fork():
        b = torch.rand(3)
    assert torch.equal(a, b) and not torch.equal(a, before)  # the forked stream is reproducible
    assert torch.zeros(2).pin_memory().device.type == "cpu"


SAVE_SCRIPT = """
import sys, torch
from model.convert import save_hf_checkpoint
from model.config import preset
cfg = preset("tiny")
torch.manual_seed(0)
weights = {"model.language_model.embed_tokens.weight": torch.randn(16, 64)}
save_hf_checkpoint(weights, cfg, sys.argv[1], {"megabase_git_commit": "abc", "megabase_preset": "tiny",
                                                "megabase_data_manifest_sha256": "f00", "megabase_x": "1"})
"""


def test_exports_of_the_same_weights_are_byte_identical_across_processes(tmp_path):
    # safetensors orders its header metadata by a per-process hash seed: without the canonical
    # header, two processes writing the same export produce different bytes (and cache keys).
    import subprocess
    import sys

    from safetensors import safe_open

    blobs = []
    for i in range(3):
        out = tmp_path / f"export{i}"
        proc = subprocess.run([sys.executable, "-c", SAVE_SCRIPT, str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        blobs.append((out / "model.safetensors").read_bytes())
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.metadata()["megabase_preset"] == "tiny" and f.metadata()["megabase_x"] == "1"
    assert blobs[0] == blobs[1] == blobs[2]


def test_a_lazy_export_reads_only_what_the_rank_keeps_and_converts_the_same(glm5_next_export):
    """An expert-parallel rank of a large layout reads its share of the routed experts, not the whole export."""
    cfg, eager, vision = convert.load_hf_checkpoint(glm5_next_export)
    _, lazy, lazy_vision = convert.load_hf_checkpoint(glm5_next_export, lazy=True)
    assert isinstance(lazy, convert.LazySafetensors) and sorted(lazy) == sorted(eager)
    assert all(torch.equal(lazy[k], eager[k]) for k in eager)
    assert lazy_vision.keys() == vision.keys() and all(torch.equal(lazy_vision[k], vision[k]) for k in vision)

    class Recording(dict):
        read: set = set()

        def __getitem__(self, key):
            Recording.read.add(key)
            return lazy[key]

    ep_size, ep_rank = 2, 1
    per = cfg.num_moe_experts // ep_size
    shard = convert.hf_to_megatron(Recording(), cfg, ep_rank=ep_rank, ep_size=ep_size)
    expected = convert.hf_to_megatron(eager, cfg, ep_rank=ep_rank, ep_size=ep_size)
    assert shard.keys() == expected.keys() and all(torch.equal(shard[k], expected[k]) for k in expected)
    experts_read = {int(m.group(1)) for k in Recording.read if (m := re.search(r"\.experts\.(\d+)\.", k))}
    assert experts_read == set(range(ep_rank * per, (ep_rank + 1) * per))   # this rank's experts, none of the others
    assert Recording.read < set(eager)


def test_a_lazy_export_names_a_missing_tensor(glm5_next_export):
    cfg, lazy, _ = convert.load_hf_checkpoint(glm5_next_export, lazy=True)
    missing = {k: lazy[k] for k in lazy if "embed_tokens" not in k}
    with pytest.raises(convert.ConversionError, match="embed_tokens"):
        convert.hf_to_megatron(missing, cfg)
