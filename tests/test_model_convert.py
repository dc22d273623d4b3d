"""Weight conversion: TP/EP sharding round trips exactly; the in-memory HF state dict; cpu_compat."""

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
