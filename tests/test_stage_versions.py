"""Stage cache versions tell the truth: a change to anything that changes a stage's output without
changing its inputs (the code it runs, the preset settings it reads, a pinned library) moves the
versions of exactly the stages that depend on it, and of no other.

The expected sets below are written from the stages' documented dependencies, not computed by
the code under test. The changes are made to a copy of the repository.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import shutil

import pytest

from tasks import caching
from tasks.caching import STAGES, stage_version
from tasks.presets import get_preset

ALL = set(STAGES)
ENGINE_STAGES = {"rl", "verify", "evaluate"}


@pytest.fixture()
def repo(tmp_path):
    for package in caching.PROJECT_PACKAGES:
        shutil.copytree(caching.REPO_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def versions(repo, preset) -> dict[str, str]:
    return {stage: stage_version(stage, preset, root=repo) for stage in STAGES}


def moved(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {stage for stage in before if before[stage] != after[stage]}


def append_line(path) -> None:
    path.write_text(path.read_text() + "\n# a changed line\n")


def test_versions_are_reproducible(repo):
    preset = get_preset("local-cpu")
    assert versions(repo, preset) == versions(repo, preset)


@pytest.mark.parametrize("change, expected", [
    (lambda p: dataclasses.replace(p, verify=dataclasses.replace(p.verify, mean_abs_diff_max=1e-1)), {"verify"}),
    (lambda p: dataclasses.replace(p, verify=dataclasses.replace(p.verify, engine_step_tokens=777)), {"verify"}),
    (lambda p: dataclasses.replace(p, evaluate=dataclasses.replace(p.evaluate, context_buckets=(0, 2_048, 4_096))),
     {"evaluate"}),
    (lambda p: dataclasses.replace(p, eval_seq_len=32_768), {"evaluate", "sft"}),   # SFT validates on eval windows
    (lambda p: dataclasses.replace(p, rl=dataclasses.replace(p.rl, kl_per_base=0.5)), {"rl"}),
    (lambda p: dataclasses.replace(p, sft=dataclasses.replace(p.sft, lr=1e-4)), {"sft"}),
    (lambda p: dataclasses.replace(p, engine="transformers"), ENGINE_STAGES),
], ids=["verify-gate", "verify-step-tokens", "evaluate-bucket", "eval-window", "rl-kl", "sft-lr", "engine"])
def test_preset_setting_moves_only_its_stages(repo, change, expected):
    preset = get_preset("local-cpu")
    assert moved(versions(repo, preset), versions(repo, change(preset))) == expected


@pytest.mark.parametrize("source, expected", [
    # vocab (token ids) is read by ingest (validation), pack (tokens), and by every stage that
    # reads shards or scores tokens; the base model is built from the model preset alone and the
    # export converts a checkpoint, neither reads a shard.
    ("tasks/vocab.py", ALL - {"base_model", "export"}),
    ("tasks/pack.py", ALL - {"ingest", "base_model", "export"}),
    ("model/vllm_cpu/layers.py", ENGINE_STAGES),
    ("model/vllm_cpu/platform.py", ENGINE_STAGES),
    ("tasks/grpo.py", {"rl"}),
    ("tasks/verify.py", {"verify"}),
    ("kernels/dsa/sparse_attention.py", ALL - {"ingest", "pack"}),
])
def test_code_change_moves_the_stages_that_run_it(repo, source, expected):
    preset = get_preset("local-cpu")
    before = versions(repo, preset)
    append_line(repo / source)
    assert moved(before, versions(repo, preset)) == expected


def test_presets_module_is_not_code_of_any_stage(repo):
    """A preset edit reaches a stage through the settings it reads (above), not as code: editing
    another preset's entry leaves every version alone."""
    preset = get_preset("local-cpu")
    before = versions(repo, preset)
    append_line(repo / "tasks/presets.py")
    assert moved(before, versions(repo, preset)) == set()


@pytest.mark.parametrize("distribution, expected", [
    ("vllm-cpu", ENGINE_STAGES),
    ("torch", ALL - {"ingest", "pack"}),
    ("pyarrow", {"ingest", "pack"}),
    ("flytekit", ALL),
])
def test_library_version_moves_the_stages_that_use_it(repo, monkeypatch, distribution, expected):
    preset = get_preset("local-cpu")
    before = versions(repo, preset)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.0.0+changed" if name == distribution else real(name))
    assert moved(before, versions(repo, preset)) == expected
