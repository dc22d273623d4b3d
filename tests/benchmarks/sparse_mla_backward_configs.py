"""The Gluon sparse MLA backward's launch configurations on this GPU: each latent-gradient (``dkv``) and
query-gradient (``dq``) configuration timed and checked outside its autotuner, then the whole op (forward +
backward, ``dsa_bench.bench_attention``) with the shipped configurations and with the fastest of each, in one
process beside the matmul rate.

The two kernels ship one configuration each (:data:`kernels.dsa.sparse_attention_gluon.GLUON_DKV_CONFIGS`,
:data:`kernels.dsa.sparse_attention_gluon.GLUON_DQ_SPLIT_CONFIGS`), chosen on an H100: rows per ``cp.async``
batch (``GATHER_ROWS``), the producer's and consumers' registers, and whether the producer loads a block's indices
ahead (``INDICES_AHEAD``). This script says whether another GPU (an H200: the same SMs and clocks, 1.4x the HBM
rate) wants another, and what it is worth on the op, not on the kernel alone.

    python tests/benchmarks/sparse_mla_backward_configs.py --seq-len 65536 --table-seq-lens 65536 262144

Each row's check is the relative Frobenius difference from the shipped configuration's result (``dq``: the same
products in the same order, expected 0; ``dkv``: float32 atomics in another order, expected ~1e-7).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))   # dsa_check

from dsa_bench import SHAPES, WIDTH, backward_inputs, bench_attention, ceilings, timed  # noqa: E402
from dsa_check import rel_err  # noqa: E402
from kernels.dsa import sparse_attention_gluon as sag  # noqa: E402

DKV_TRIALS = ["GATHER_ROWS=8", "GATHER_ROWS=32", "GATHER_ROWS=64", "PRODUCER_REGS=40", "INDICES_AHEAD=1",
              "GATHER_ROWS=32,INDICES_AHEAD=1", "ATOMIC_WARPS=4", "ATOMIC_WARPS=4,INDICES_AHEAD=1",
              "ATOMIC_WARPS=4,ATOMIC_REGS=56"]
"""Latent-gradient trials over the shipped configuration (``KEY=V,...``; ``INDICES_AHEAD`` is the launch's;
``ATOMIC_WARPS`` 0 the consumers' own atomics over :data:`kernels.dsa.sparse_attention_gluon.GLUON_DKV_CONFIGS`,
4 the atomics partition over :data:`kernels.dsa.sparse_attention_gluon.GLUON_DKV_STAGED_CONFIG`)."""
DQ_TRIALS = ["GATHER_ROWS=8", "GATHER_ROWS=32", "PRODUCER_REGS=40,CONSUMER_REGS=232", "INDICES_AHEAD=0"]
"""Query-gradient trials over the shipped ``"products"`` configuration (its launch has ``INDICES_AHEAD`` on)."""


def parse_trial(text: str, bases: dict[int, triton.Config], ahead: bool, warps: int) -> tuple[triton.Config, bool, int]:
    """A trial's ``(configuration, INDICES_AHEAD, ATOMIC_WARPS)``: ``bases[ATOMIC_WARPS]`` with the ``KEY=V``
    items of ``text`` replaced (``maxnreg`` too); ``INDICES_AHEAD`` and ``ATOMIC_WARPS`` are ``ahead`` and
    ``warps`` (the shipped ones) unless ``text`` sets them. Raises ValueError for a key the configuration does not
    have, or an ``ATOMIC_WARPS`` with no entry in ``bases``."""
    items = [item.split("=") for item in filter(None, text.split(","))]
    warps = next((int(v) for k, v in items if k == "ATOMIC_WARPS"), warps)
    if warps not in bases:
        raise ValueError(f"{text!r}: ATOMIC_WARPS={warps} is not one of {sorted(bases)}")
    base = bases[warps]
    kwargs, maxnreg = dict(base.kwargs), base.maxnreg
    for key, value in items:
        if key == "ATOMIC_WARPS":
            continue
        if key == "INDICES_AHEAD":
            ahead = bool(int(value))
        elif key == "maxnreg":
            maxnreg = int(value)
        elif key in kwargs:
            kwargs[key] = int(value)
        else:
            raise ValueError(f"{text!r}: {key} is not one of {sorted(kwargs)}, INDICES_AHEAD, ATOMIC_WARPS, maxnreg")
    return triton.Config(kwargs, num_warps=base.num_warps, maxnreg=maxnreg), ahead, warps


def shipped_and_bases() -> tuple[dict, dict]:
    """The shipped ``{"dkv": (config, ahead, warps), "dq": ...}`` and each kernel's base configurations by
    ``ATOMIC_WARPS`` (:func:`parse_trial`)."""
    bases = {"dkv": {0: sag.GLUON_DKV_CONFIGS[0], 4: sag.GLUON_DKV_STAGED_CONFIG},
             "dq": {0: sag.GLUON_DQ_SPLIT_CONFIGS[0]}}
    shipped = {"dkv": (bases["dkv"][sag.DKV_ATOMIC_WARPS], sag.DKV_INDICES_AHEAD, sag.DKV_ATOMIC_WARPS),
               "dq": (bases["dq"][0], sag.DQ_INDICES_AHEAD["products"], 0)}
    return shipped, bases


def sweep(seq_len: int, shape: dict, reps: int, dkv_trials, dq_trials) -> tuple[list[dict], dict]:
    """Each configuration's time and difference from the shipped one; returns the rows and the fastest
    ``{"dkv": (config, ahead, warps, trial), "dq": (config, ahead, 0, trial)}`` (the shipped one where nothing beat
    it; ``warps`` the latent gradient's ``ATOMIC_WARPS``)."""
    q, kv, idx, grad, scale, out, lse = backward_inputs(seq_len, shape)
    h, dqk = shape["heads"], shape["dqk"]
    delta = (grad.float() * out.float()).sum(-1)
    per_token = 2 * seq_len * h * WIDTH * dqk

    def run_dkv(cfg, ahead, warps):
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
        sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse, delta, scale, dkv, indices_ahead=ahead, config=cfg,
                                 atomic_warps=warps)
        return dkv

    def run_dq(cfg, ahead, warps):
        return sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse, torch.empty_like(lse), scale, out=out,
                                       indices_ahead=ahead, config=cfg)

    shipped, bases = shipped_and_bases()
    kinds = {"dkv": (run_dkv, dkv_trials, 4 * per_token), "dq": (run_dq, dq_trials, 3 * per_token)}
    rows, best = [], {}
    for kind, (fn, trials, flops) in kinds.items():
        base_cfg, base_ahead, base_warps = shipped[kind]
        reference = fn(base_cfg, base_ahead, base_warps)
        best_s = None
        for text in ["", *trials]:
            cfg, ahead, warps = parse_trial(text, bases[kind], base_ahead, base_warps)
            row = {"kernel": kind, "trial": text or "shipped", "config": dict(cfg.kwargs, maxnreg=cfg.maxnreg),
                   "indices_ahead": ahead, "atomic_warps": warps}
            try:
                row["seconds"], _ = timed(lambda: fn(cfg, ahead, warps), reps)
                row["tflops"] = flops / row["seconds"] / 1e12
                row["rel_diff"] = rel_err(fn(cfg, ahead, warps), reference)
                if best_s is None or row["seconds"] < best_s:
                    best_s, best[kind] = row["seconds"], (cfg, ahead, warps, row["trial"])
            except Exception as exc:   # a configuration that does not compile or fit: its row says why
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append(row)
            print(row, flush=True)
    return rows, best


def with_configs(best: dict):
    """Set the two kernels' single configurations, the producers' ``INDICES_AHEAD`` and the latent gradient's
    ``ATOMIC_WARPS`` to ``best``'s for this process; returns the function that puts the shipped ones back."""
    saved = (sag.sparse_mla_dkv_gluon_kernel.configs, sag.GLUON_DKV_STAGED_CONFIG, sag.DKV_ATOMIC_WARPS,
             sag.sparse_mla_dq_split_kernel.configs, sag.DKV_INDICES_AHEAD, sag.DQ_INDICES_AHEAD["products"])
    dkv_cfg, sag.DKV_INDICES_AHEAD, sag.DKV_ATOMIC_WARPS, _ = best["dkv"]
    if sag.DKV_ATOMIC_WARPS:
        sag.GLUON_DKV_STAGED_CONFIG = dkv_cfg
    else:
        sag.sparse_mla_dkv_gluon_kernel.configs = [dkv_cfg]
    sag.sparse_mla_dq_split_kernel.configs, sag.DQ_INDICES_AHEAD["products"] = [best["dq"][0]], best["dq"][1]

    def restore() -> None:
        (sag.sparse_mla_dkv_gluon_kernel.configs, sag.GLUON_DKV_STAGED_CONFIG, sag.DKV_ATOMIC_WARPS,
         sag.sparse_mla_dq_split_kernel.configs, sag.DKV_INDICES_AHEAD, sag.DQ_INDICES_AHEAD["products"]) = saved
    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="full", choices=[s for s, v in SHAPES.items() if v["heads"] % 64 == 0])
    parser.add_argument("--seq-len", type=int, default=65536, help="tokens of the per-kernel sweep")
    parser.add_argument("--table-seq-lens", type=int, nargs="*", default=[65536, 262144],
                        help="lengths of the whole-op rows, shipped and picked configurations")
    parser.add_argument("--dkv-trials", nargs="*", default=DKV_TRIALS)
    parser.add_argument("--dq-trials", nargs="*", default=DQ_TRIALS)
    parser.add_argument("--op-trials", nargs="*", default=[],
                        help="latent-gradient trials (as --dkv-trials) the op is also timed with, the query gradient "
                             "shipped")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    ceil = ceilings()
    print(f"matmul anchor {ceil['matmul_tflops']:.0f} TF/s, copy {ceil['copy_tbps']:.2f} TB/s", flush=True)
    rows, best = sweep(args.seq_len, shape, args.reps, args.dkv_trials, args.dq_trials)
    torch.cuda.empty_cache()
    picks = {k: v[-1] for k, v in best.items()}
    table = []
    shipped, bases = shipped_and_bases()
    setups = [("shipped", None), (f"picked: dkv {picks['dkv']}, dq {picks['dq']}", best)]
    for text in args.op_trials:
        setups.append((f"dkv {text}", {"dkv": (*parse_trial(text, bases["dkv"], *shipped["dkv"][1:]), text),
                                       "dq": (*shipped["dq"], "shipped")}))
    for label, setup in setups:
        restore = with_configs(setup) if setup else (lambda: None)
        try:
            for t in args.table_seq_lens:
                for r in bench_attention(t, shape, ceil, args.reps, dkv_forms=("query",)):
                    r.update(configs=label, seq_len=t)
                    table.append(r)
                    print(r, flush=True)
                torch.cuda.empty_cache()
        finally:
            restore()
    print(f"\n{args.shape} shape; matmul anchor {ceil['matmul_tflops']:.0f} TF/s, copy {ceil['copy_tbps']:.2f} TB/s"
          f"\n\n| kernel | trial | ms at {args.seq_len // 1024}k | TF/s | rel. diff from shipped |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['trial']} | {r['error']} | | |")
        else:
            print(f"| {r['kernel']} | {r['trial']} | {1e3 * r['seconds']:.1f} | {r['tflops']:.0f} | "
                  f"{r['rel_diff']:.1e} |")
    print("\n| configurations | T | op | s | TF/s |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r['configs']} | {r['seq_len'] // 1024}k | {r['op']} | {r['seconds']:.4f} | {r['tflops']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"anchor": ceil, "shape": args.shape, "sweep": rows, "picks": picks, "table": table}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
