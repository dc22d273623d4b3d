"""Sparse MLA tilings one by one, outside the autotuner: which ``(BLOCK_H, BLOCK_K, warps, stages)`` is fastest
for the forward and for the backward's ``dq`` pass (``MODE`` 1, the per-query half of the per-pool backward),
at a DSA shape and length, beside the matmul rate measured in the same process.

The autotuner keeps only its winner, and it chooses among :func:`_attention_configs` alone; this script
times any tiling (``--configs``), including ones not in that list, on the indexer's k-pool layout
(``dsa_bench.pool_indices``), and checks each against the autotuned kernel's output (the same math in a
different order: differences at bf16 rounding), also with the indexer KL target folded in (the pool mass,
``pool_mass``) against that target's own pass (``triton_sparse_mla_mass``). The run pass (``dkv``) is timed
once at its fixed launch beside the autotuned whole backward, so the table also gives the backward's split.
Where the head count is a multiple of 64 (the ``full`` shape), each configuration of the warp-specialized Gluon
forward (:mod:`kernels.dsa.sparse_attention_gluon`) is timed and checked the same way.

    python tests/benchmarks/sparse_mla_tilings.py --shape full --seq-len 65536 --out $OUT/tilings.json
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

from dsa_bench import KPOOL, POOL_LAYOUTS, SHAPES, TOPK, WIDTH, ceilings, pool_indices, timed  # noqa: E402
from kernels.dsa import sparse_attention_gluon as sag  # noqa: E402
from kernels.dsa import sparse_attention_triton as sat  # noqa: E402

DEFAULT_CONFIGS = ["64,64,8,1", "64,32,8,1", "64,32,8,2", "64,32,8,3", "64,16,8,2", "64,16,8,3", "64,16,8,4",
                   "64,64,8,2", "32,32,4,2", "32,64,8,2", "16,64,8,2"]


def _parse(text: str) -> tuple[int, int, int, int]:
    bh, bk, warps, stages = (int(v) for v in text.split(","))
    return bh, bk, warps, stages


def gluon_forward_rows(q, kv, idx, scale, out_ref, lse_ref, fwd_flops, reps) -> list[dict]:
    """Each schedule and configuration of the warp-specialized Gluon forward (:mod:`kernels.dsa.sparse_attention_gluon`;
    64 heads per program: the ``full`` shape), timed and held against the autotuned Triton forward's ``out`` and
    ``lse``; none where the Gluon kernels cannot run these inputs."""
    rows = []
    if sag.gluon_supported(q, kv, q.shape[-1]) is not None:
        return rows
    for schedule, configs in sag.GLUON_FWD_TRIALS.items():
        for cfg in configs:
            row = {"config": f"gluon {schedule} " + " ".join(f"{k}={v}" for k, v in cfg.kwargs.items())}
            try:
                out, lse = torch.empty_like(out_ref), torch.empty_like(lse_ref)
                row["fwd_s"], _ = timed(lambda: sag.launch_fwd(q, kv, idx, out, lse, scale, cfg, schedule), reps)
                row["fwd_tflops"] = fwd_flops / row["fwd_s"] / 1e12
                row["fwd_err"] = (out.float() - out_ref.float()).abs().max().item()
                # rows without a valid index have lse -inf in both: equal, not nan
                row["lse_err"] = torch.where(lse == lse_ref, 0.0, lse - lse_ref).abs().max().item()
            except Exception as exc:   # a schedule that fails leaves the rows of the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def _forward_call(cfg, schedule: str = "ring"):
    """A ``--call`` of the Gluon forward of ``schedule`` at configuration ``cfg``, without the autotuner."""
    return lambda q, kv, idx, grad, scale, out, lse: sag.launch_fwd(
        q, kv, idx, torch.empty_like(out), torch.empty_like(lse), scale, cfg, schedule)


CALLS = {
    "fwd": _forward_call(sag.GLUON_FWD_TRIALS[sag.FWD_SCHEDULE][0], sag.FWD_SCHEDULE),
    "fwd-ring": _forward_call(sag.GLUON_FWD_CONFIGS[0]),
    "fwd-lazy": _forward_call(sag.GLUON_FWD_LAZY[0]),
    "fwd-pair": _forward_call(sag.GLUON_FWD_PAIR_CONFIGS[0], "pair"),
    "dq": lambda q, kv, idx, grad, scale, out, lse: sag.gluon_sparse_mla_dq(
        q, kv, idx, grad, lse, torch.empty_like(lse), scale, out=out),
    "dkv": lambda q, kv, idx, grad, scale, out, lse: sag.gluon_sparse_mla_dkv(
        q, kv, idx, grad, lse, (grad.float() * out.float()).sum(-1), scale,
        torch.zeros(kv.shape, dtype=torch.float32, device="cuda")),
}
"""``--call``: the Gluon kernel each name launches with the training path's settings (the forward of
:data:`kernels.dsa.sparse_attention_gluon.FWD_SCHEDULE` at its first configuration; the ring forward's first
configuration, or with conditional rescaling; the paired-block forward; the query gradient forming
``rowsum(dO O)``; the latent gradient)."""


def profiled_call(fn, *inputs) -> None:
    """``fn(*inputs)`` once to compile and tune, then once between ``cudaProfilerStart`` and ``Stop`` (what
    ``ncu --profile-from-start off`` profiles), timed."""
    fn(*inputs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.profiler.start()
    start.record()
    fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled call: {start.elapsed_time(end):.2f} ms", flush=True)


def _gluon_kernels(args, q, kv, idx, grad, scale, out_ref, lse_ref, fwd_flops, ceil, valid_keys) -> None:
    """``--gluon-only``: the autotuned Triton forward and every Gluon forward, each ring forward's gathers alone
    (``products=False``), then the Gluon query gradient and latent gradient (with its atomics, predicated off, and
    alone without the products; then in each other of :data:`kernels.dsa.sparse_attention_gluon.ATOMIC_LAYOUTS`),
    one table."""
    t_fwd_auto, _ = timed(lambda: sat.triton_sparse_mla_fwd(q, kv, idx, scale, q.shape[-1]), args.reps)
    rows = ([] if args.dkv_only or args.dq_only
            else gluon_forward_rows(q, kv, idx, scale, out_ref, lse_ref, fwd_flops, args.reps))
    out, lse = torch.empty_like(out_ref), torch.empty_like(lse_ref)
    kernels = [(f"gluon ring forward {' '.join(f'{k}={v}' for k, v in cfg.kwargs.items())}, gathers only", None,
                lambda c=cfg: sag.launch_fwd(q, kv, idx, out, lse, scale, c, products=False))
               for cfg in sag.GLUON_FWD_TRIALS["ring"]]
    delta = (grad.float() * out_ref.float()).sum(-1)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
    per_token = 2 * q.shape[1] * q.shape[2] * WIDTH * q.shape[-1]
    for ahead in (False, True):   # the producer's INDICES_AHEAD off (the default) and on
        tag = ", indices ahead" if ahead else ""
        kernels += [
            (f"gluon dq{tag}", 3 * per_token,
             lambda a=ahead: sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse_ref, delta, scale, indices_ahead=a)),
            (f"gluon dkv{tag}", 4 * per_token,
             lambda a=ahead: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, indices_ahead=a)),
            (f"gluon dkv, atomics predicated off{tag}", 4 * per_token,
             lambda a=ahead: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, atomics=False,
                                                      indices_ahead=a)),
        ]
    for schedule in [d for d in sag.DQ_KERNELS if d != sag.DQ_SCHEDULE]:   # the other query gradients
        kernels.append((f"gluon dq, {schedule} schedule", 3 * per_token,
                        lambda d=schedule: sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse_ref, delta, scale,
                                                                   schedule=d)))
    # rowsum(dO O): its own pass (what the training path runs before the query gradient), or formed in the kernel
    delta_out = torch.empty_like(delta)
    kernels += [("rowsum(dO O) pass", None, lambda: sat.triton_sparse_mla_delta(out_ref, grad)),
                ("gluon dq, rowsum(dO O) formed in the kernel", 3 * per_token,
                 lambda: sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse_ref, delta_out, scale, out=out_ref))]
    # the gradient formed and added in column pieces, the next block's scores ahead of the last piece's atomics or not
    for pieces, ahead in [(n, a) for n in (1, 2, 4) for a in (False, True) if a <= (n > 1)
                          if (n, a) != (sag.DKV_PIECES, sag.DKV_SCORES_AHEAD)]:
        name = f"gluon dkv, {pieces} column piece{'s' * (pieces > 1)}{', scores ahead' if ahead else ''}"
        kernels.append((name, 4 * per_token,
                        lambda n=pieces, a=ahead: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale,
                                                                           dkv, pieces=n, scores_ahead=a)))
    # the atomics in a partition of their own, the consumers' pieces through a shared stage (indices ahead or not)
    for ahead in (False, True):
        tag = ", indices ahead" if ahead else ""
        kernels += [
            (f"gluon dkv, atomics partition{tag}", 4 * per_token,
             lambda a=ahead: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, atomic_warps=4,
                                                      indices_ahead=a)),
            (f"gluon dkv, atomics partition, atomics predicated off{tag}", 4 * per_token,
             lambda a=ahead: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, atomic_warps=4,
                                                      atomics=False, indices_ahead=a)),
        ]
    kernels.append(("gluon dkv, gathers and atomics only (no products)", None,
                    lambda: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, products=False)))
    # the same atomic rows in other L2 requests
    for layout in [a for a in sag.ATOMIC_LAYOUTS if a != sag.DKV_ATOMIC_LAYOUT]:
        kernels += [
            (f"gluon dkv, {layout} atomics", 4 * per_token,
             lambda a=layout: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, atomic_layout=a)),
            (f"gluon dkv, {layout} atomics, no products", None,
             lambda a=layout: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta, scale, dkv, products=False,
                                                       atomic_layout=a)),
        ]
    if args.dkv_only:
        kernels = [k for k in kernels if k[0].startswith("gluon dkv")
                   and not any(f"{a} atomics" in k[0] for a in sag.ATOMIC_LAYOUTS)]
    if args.fwd_only:
        kernels = []
    if args.dq_only:
        kernels = [k for k in kernels if k[0].startswith(("gluon dq", "rowsum"))]
    for name, flops, fn in kernels:
        row = {"config": name}
        try:
            # no error columns: the gradients are checked against float64 by tests/gpu/gluon_smoke.py
            row["time_s"], _ = timed(fn, args.reps)
            row["tflops"] = flops / row["time_s"] / 1e12 if flops else None   # None: no products to count
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
        print(row, flush=True)
    print(f"\n{args.shape} shape, {args.seq_len // 1024}k tokens, {q.shape[2]} heads, index layout {args.index_layout} "
          f"({valid_keys:.1f} valid keys per query); matmul anchor {ceil['matmul_tflops']:.0f} TF/s, copy "
          f"{ceil['copy_tbps']:.2f} TB/s")
    print("\n| kernel | ms | TF/s (the backward's: of its products, recomputed ones counted) | max abs diff of out "
          "from the Triton forward | of lse |")
    print("|---|---|---|---|---|")
    print(f"| Triton, autotuned | {1e3 * t_fwd_auto:.1f} | {fwd_flops / t_fwd_auto / 1e12:.0f} | | |")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} ||||")
        elif "time_s" in r:   # a gradient kernel
            rate = f"{r['tflops']:.0f}" if r["tflops"] is not None else ""
            print(f"| {r['config']} | {1e3 * r['time_s']:.1f} | {rate} | | |")
        else:
            print(f"| {r['config']} | {1e3 * r['fwd_s']:.1f} | {r['fwd_tflops']:.0f} | {r['fwd_err']:.1e} | "
                  f"{r['lse_err']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"anchor": ceil, "shape": args.shape, "seq_len": args.seq_len, "index_layout": args.index_layout,
                       "valid_keys_per_query": valid_keys, "fwd_autotuned_s": t_fwd_auto, "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="full", choices=list(SHAPES))
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--index-layout", default="window", choices=POOL_LAYOUTS,
                        help="which k-pools each query selects (dsa_bench.POOL_LAYOUTS): the same arithmetic, the "
                             "gathered rows from L2 (window, shared) or HBM (spread)")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="BLOCK_H,BLOCK_K,warps,stages")
    parser.add_argument("--gluon-only", action="store_true",
                        help="only the Gluon kernels: every forward schedule and configuration against the "
                             "autotuned Triton forward, then the query and latent gradients; no Triton tilings")
    parser.add_argument("--dkv-only", action="store_true",
                        help="with --gluon-only: only the Gluon latent gradient's rows (its launch, its column pieces, "
                             "indices ahead, its atomics partition, with its atomics predicated off, without products)")
    parser.add_argument("--dq-only", action="store_true",
                        help="with --gluon-only: only the query gradients' rows and the rowsum(dO O) pass")
    parser.add_argument("--fwd-only", action="store_true",
                        help="with --gluon-only: only the forward rows (every schedule and configuration)")
    parser.add_argument("--call", default=None, choices=list(CALLS),
                        help="one launch of this Gluon kernel (its default configuration) between "
                             "cudaProfilerStart and Stop, after a warm launch: for Nsight Compute's "
                             "--profile-from-start off (tests/gpu/ncu_indexer.sh); nothing else runs")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    h, dqk, t = shape["heads"], shape["dqk"], args.seq_len
    ceil = ceilings()
    print(f"matmul anchor {ceil['matmul_tflops']:.0f} TF/s, copy {ceil['copy_tbps']:.2f} TB/s", flush=True)
    torch.manual_seed(0)
    q = torch.randn(1, t, h, dqk, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, t, dqk, device="cuda", dtype=torch.bfloat16)
    idx = pool_indices(t, t, layout=args.index_layout).contiguous()
    valid_keys = (idx >= 0).sum(dim=-1, dtype=torch.float32).mean().item()
    # TF/s below count WIDTH keys per query, as every earlier record does; the layouts select slightly
    # different numbers of valid keys (the first queries see fewer pools), so compare times scaled by this
    print(f"index layout {args.index_layout}: {valid_keys:.1f} valid keys per query of {WIDTH}", flush=True)
    grad = torch.randn(1, t, h, dqk, device="cuda", dtype=torch.bfloat16)
    scale = shape["qk_head"] ** -0.5
    fwd_flops = 2 * t * h * WIDTH * 2 * dqk
    dq_flops = 2 * t * h * WIDTH * 3 * dqk     # QK recomputed, dO V^T, dS kv
    bwd_flops = 2 * t * h * WIDTH * 5 * dqk    # as dsa_bench counts the whole backward

    out_ref, lse_ref = sat.triton_sparse_mla_fwd(q, kv, idx, scale, dqk)
    if args.call:
        profiled_call(CALLS[args.call], q, kv, idx, grad, scale, out_ref, lse_ref)
        return
    if args.gluon_only:
        _gluon_kernels(args, q, kv, idx, grad, scale, out_ref, lse_ref, fwd_flops, ceil, valid_keys)
        return
    n_runs = -(-idx.shape[2] // KPOOL)
    run_ok, scatter, keys, pairs, counts, ends = sat.run_pairs(idx, KPOOL, t)
    block = dict(DQK=dqk, DV=dqk, BLOCK_D=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(dqk))

    n_pools = TOPK // KPOOL
    no_pools = torch.empty(1, 1, 1, 0, device="cuda")

    def launch_fwd(cfg, out, lse, pool_lse=None):
        """One forward launch at tiling ``cfg``; with ``pool_lse`` (``[1, T, H, n_pools]``) the pool log-masses."""
        bh, bk, warps, stages = cfg
        pools = dict(KPOOL=KPOOL, N_POOLS=n_pools) if pool_lse is not None else {}
        pool_lse = no_pools if pool_lse is None else pool_lse
        sat.sparse_mla_fwd_kernel.fn[(t, triton.cdiv(h, bh), 1)](
            q, kv, idx, out, lse, pool_lse, *q.stride()[:3], *kv.stride()[:2], *idx.stride()[:2], *out.stride()[:3],
            *lse.stride()[:2], *pool_lse.stride()[:3], h, idx.shape[2], scale * sat._LOG2E, **block, BLOCK_H=bh,
            BLOCK_K=bk, num_warps=warps, num_stages=stages, **pools)

    def launch_dq(cfg, dq, delta):
        bh, bk, warps, stages = cfg
        sat.sparse_mla_bwd_kernel.fn[(t, triton.cdiv(h, bh), 1)](
            q, kv, idx, out_ref, grad, lse_ref, dq, dkv, run_ok, scatter, delta, *q.stride()[:3],
            *kv.stride()[:2], *idx.stride()[:2], *lse_ref.stride()[:2], *dkv.stride()[:2], h, idx.shape[2], n_runs,
            scale, scale * sat._LOG2E, RUN=KPOOL, MODE=1, **block, BLOCK_H=bh, BLOCK_K=bk, num_warps=warps,
            num_stages=stages)

    dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
    dq_ref = torch.empty_like(q)
    delta_ref = torch.empty(1, t, h, dtype=torch.float32, device="cuda")
    launch_dq((64 if h >= 64 else 16, 32, 8, 2), dq_ref, delta_ref)

    def mass_pass():   # the indexer KL target's own pass, as after the Gluon forward
        return sat.triton_sparse_mla_pool_mass(q, kv, idx, lse_ref, scale, KPOOL, n_pools)

    mass_ref = mass_pass()
    t_mass_pass, _ = timed(mass_pass, args.reps)

    rows = []
    for text in args.configs:
        cfg = _parse(text)
        if cfg[0] > max(16, triton.next_power_of_2(h)):
            continue
        row = {"config": text}
        try:
            out, lse = torch.empty_like(out_ref), torch.empty_like(lse_ref)
            row["fwd_s"], _ = timed(lambda: launch_fwd(cfg, out, lse), args.reps)
            row["fwd_tflops"] = fwd_flops / row["fwd_s"] / 1e12
            row["fwd_err"] = (out.float() - out_ref.float()).abs().max().item()
            # the forward kernel with the indexer KL target folded in (the pool log-masses; their exp2 and sum
            # over heads, the same for every tiling, is timed once below)
            pool_lse = torch.empty(1, t, h, n_pools, device="cuda")
            row["fwd_mass_s"], _ = timed(lambda: launch_fwd(cfg, out, lse, pool_lse), args.reps)
            mass = sat.pool_mass_from_log2(pool_lse, lse)
            row["mass_rel_err"] = ((mass - mass_ref).norm() / mass_ref.norm()).item()
            dq, delta = torch.empty_like(q), torch.empty_like(delta_ref)
            row["dq_s"], _ = timed(lambda: launch_dq(cfg, dq, delta), args.reps)
            row["dq_tflops"] = dq_flops / row["dq_s"] / 1e12
            row["dq_err"] = (dq.float() - dq_ref.float()).abs().max().item()
        except Exception as exc:   # a tiling that does not compile or fit: its row says why, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
        print(row, flush=True)

    rows += gluon_forward_rows(q, kv, idx, scale, out_ref, lse_ref, fwd_flops, args.reps)

    # the run pass at its fixed launch, and the autotuned whole, for the backward's split
    def run_pass():
        sat.sparse_mla_bwd_runs_kernel[(triton.cdiv(keys.numel(), sat.RUN_CHUNK),)](
            q, kv, grad, lse_ref, delta_ref, keys, pairs, counts, ends, dkv, *kv.stride()[:2], *dkv.stride()[:2],
            keys.numel(), t, t, h, scale, scale * sat._LOG2E, RUN=KPOOL, ROWS=sat.RUN_ROWS, CHUNK=sat.RUN_CHUNK,
            num_warps=sat.RUN_WARPS, num_stages=sat.RUN_STAGES, **block)

    t_run_pass, _ = timed(run_pass, args.reps)
    t_whole, _ = timed(lambda: sat.triton_sparse_mla_bwd(q, kv, idx, out_ref, lse_ref, grad, scale, dqk, runs=KPOOL),
                       args.reps)
    t_fwd_auto, _ = timed(lambda: sat.triton_sparse_mla_fwd(q, kv, idx, scale, dqk), args.reps)
    # the whole forward with the pool mass (autotuned kernel + the exp2-and-sum over heads)
    t_fwd_mass_auto, _ = timed(lambda: sat.triton_sparse_mla_fwd(q, kv, idx, scale, dqk, pool_mass=(KPOOL, n_pools)),
                               args.reps)

    # at 64 heads: the per-query backward (autotuned; 32- or 16-head programs fit) against the dq pass plus the
    # Gluon latent gradient (64 heads per program), whole and the Gluon kernel alone
    def compare_dkv_paths() -> dict:
        """The per-query backward (autotuned) against the dq pass plus the Gluon latent gradient."""
        dq_q, dkv_q = sat.triton_sparse_mla_bwd(q, kv, idx, out_ref, lse_ref, grad, scale, dqk)
        dq_g, dkv_g = sat.triton_sparse_mla_bwd(q, kv, idx, out_ref, lse_ref, grad, scale, dqk, dkv_kernel="gluon",
                                                dq_kernel="triton")
        dkv_acc = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
        base = {
            "bwd_per_query_s": timed(lambda: sat.triton_sparse_mla_bwd(q, kv, idx, out_ref, lse_ref, grad, scale, dqk),
                                     args.reps)[0],
            "bwd_gluon_dkv_s": timed(lambda: sat.triton_sparse_mla_bwd(q, kv, idx, out_ref, lse_ref, grad, scale, dqk,
                                                                        dkv_kernel="gluon", dq_kernel="triton"),
                                     args.reps)[0],
            "gluon_dkv_kernel_s": timed(lambda: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta_ref, scale,
                                                                         dkv_acc), args.reps)[0],
            # the same kernel with its atomics predicated off: how much of it is their memory traffic
            "gluon_dkv_no_atomics_s": timed(lambda: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse_ref, delta_ref,
                                                                             scale, dkv_acc, atomics=False),
                                            args.reps)[0],
            "dq_max_abs_diff": (dq_g.float() - dq_q.float()).abs().max().item(),
            "dkv_rel_diff": ((dkv_g.float() - dkv_q.float()).norm() / dkv_q.float().norm()).item(),
        }
        print(base, flush=True)   # before the new kernel below: a hang there still leaves these in the log
        row = {}
        try:   # the Gluon query gradient (kernel level), alone and in the all-Gluon backward; last, so a
            # failure of this new kernel leaves the rows above
            dq_a, dkv_a = sat.triton_sparse_mla_bwd(q, kv, idx, out_ref, lse_ref, grad, scale, dqk, dkv_kernel="gluon",
                                                    dq_kernel="gluon")
            row = {
                "gluon_dq_kernel_s": timed(lambda: sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse_ref, delta_ref, scale),
                                           args.reps)[0],
                "bwd_all_gluon_s": timed(lambda: sat.triton_sparse_mla_bwd(
                    q, kv, idx, out_ref, lse_ref, grad, scale, dqk, dkv_kernel="gluon", dq_kernel="gluon"), args.reps)[0],
                "all_gluon_dq_max_abs_diff": (dq_a.float() - dq_q.float()).abs().max().item(),
                "all_gluon_dq_rel_diff": ((dq_a.float() - dq_q.float()).norm() / dq_q.float().norm()).item(),
                "all_gluon_dkv_rel_diff": ((dkv_a.float() - dkv_q.float()).norm() / dkv_q.float().norm()).item(),
            }
        except Exception as exc:   # the dq kernel failing leaves the rows before it
            row = {"gluon_dq_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            print(row, flush=True)
        return base | row

    per_query = {}
    try:
        if sag.gluon_supported(q, kv, dqk) is None:
            per_query = compare_dkv_paths()
    except Exception as exc:   # the Gluon latent gradient failing: the rows above still print and save
        per_query = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        print(per_query, flush=True)
    print(f"\n{args.shape} shape, {t // 1024}k tokens, {h} heads, index layout {args.index_layout} ({valid_keys:.1f} "
          f"valid keys per query); matmul anchor {ceil['matmul_tflops']:.0f} TF/s")
    print(f"indexer KL target as its own pass (triton_sparse_mla_mass, 4096 queries at a time): "
          f"{1e3 * t_mass_pass:.1f} ms; folded into the forward: the fwd+mass column (kernel), the autotuned forward "
          f"with it {1e3 * t_fwd_mass_auto:.1f} ms (kernel and the exp2-sum over heads)")
    print(f"autotuned: fwd {1e3 * t_fwd_auto:.1f} ms ({fwd_flops / t_fwd_auto / 1e12:.0f} TF/s), whole bwd "
          f"{1e3 * t_whole:.1f} ms, fwd+bwd {(fwd_flops + bwd_flops) / (t_fwd_auto + t_whole) / 1e12:.0f} TF/s; "
          f"run pass {1e3 * t_run_pass:.1f} ms")
    if per_query and "error" not in per_query:
        dkv_flops = 2 * t * h * WIDTH * 2 * dqk
        print(f"64 heads per program: backward per query (autotuned) {1e3 * per_query['bwd_per_query_s']:.1f} ms, "
              f"dq pass + Gluon dkv {1e3 * per_query['bwd_gluon_dkv_s']:.1f} ms (fwd+bwd with the Triton forward "
              f"{(fwd_flops + bwd_flops) / (t_fwd_auto + per_query['bwd_gluon_dkv_s']) / 1e12:.0f} TF/s), the Gluon "
              f"dkv kernel alone {1e3 * per_query['gluon_dkv_kernel_s']:.1f} ms "
              f"({dkv_flops / per_query['gluon_dkv_kernel_s'] / 1e12:.0f} TF/s of its dS^T q + P^T dO), "
              f"{1e3 * per_query['gluon_dkv_no_atomics_s']:.1f} ms with its atomics predicated off; "
              f"dq {per_query['dq_max_abs_diff']:.1e} apart, dkv {per_query['dkv_rel_diff']:.1e} relative")
        if "bwd_all_gluon_s" in per_query:
            t_bwd = per_query["bwd_all_gluon_s"]
            print(f"all-Gluon backward (Gluon dq + Gluon dkv + the rowsum(dO O) kernel) {1e3 * t_bwd:.1f} ms, the Gluon dq "
                  f"kernel alone {1e3 * per_query['gluon_dq_kernel_s']:.1f} ms ({dq_flops / per_query['gluon_dq_kernel_s'] / 1e12:.0f}"
                  f" TF/s); dq {per_query['all_gluon_dq_rel_diff']:.1e} relative ({per_query['all_gluon_dq_max_abs_diff']:.1e}"
                  f" max) and dkv {per_query['all_gluon_dkv_rel_diff']:.1e} from the per-query backward")
            gluon_fwd = [r["fwd_s"] for r in rows if r["config"].startswith("gluon") and "fwd_s" in r]
            if gluon_fwd:   # the issue's target: the fastest Gluon forward plus the all-Gluon backward
                total = min(gluon_fwd) + t_bwd
                print(f"Gluon forward {1e3 * min(gluon_fwd):.1f} ms + all-Gluon backward: fwd+bwd "
                      f"{(fwd_flops + bwd_flops) / total / 1e12:.0f} TF/s ({1e3 * total:.1f} ms)")
    print("\n| BLOCK_H,BLOCK_K,warps,stages | fwd ms | fwd TF/s | fwd+mass ms | dq pass ms | dq pass TF/s | fwd err "
          "| mass rel err | dq err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} ||||||||")
        elif "dq_s" not in r:   # a forward-only row (Gluon)
            print(f"| {r['config']} | {1e3 * r['fwd_s']:.1f} | {r['fwd_tflops']:.0f} | | | | {r['fwd_err']:.1e} | | |")
        else:
            print(f"| {r['config']} | {1e3 * r['fwd_s']:.1f} | {r['fwd_tflops']:.0f} | {1e3 * r['fwd_mass_s']:.1f} | "
                  f"{1e3 * r['dq_s']:.1f} | {r['dq_tflops']:.0f} | {r['fwd_err']:.1e} | {r['mass_rel_err']:.1e} | "
                  f"{r['dq_err']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"anchor": ceil, "shape": args.shape, "seq_len": t, "index_layout": args.index_layout,
                       "valid_keys_per_query": valid_keys, "rows": rows, "run_pass_s": t_run_pass,
                       "mass_pass_s": t_mass_pass, "fwd_mass_autotuned_s": t_fwd_mass_auto,
                       "bwd_autotuned_s": t_whole, "fwd_autotuned_s": t_fwd_auto, **per_query}, f, indent=1)


if __name__ == "__main__":
    main()
