"""Benchmarks of the DSA kernels, one command per question (``kernels/dsa/README.md`` has the numbers):

    python tests/benchmarks/dsa_bench.py [table] [--seq-lens 65536 262144 1048576] [--no-torch-indexer] [--out f.json]
        [--gluon-forward default|ring|ring-lazy|pair]   # which Gluon sparse MLA forward the training path runs
        [--ops indexer attention sdpa indexer-loss] [--dkv query pool]   # which rows (default: all)
    python tests/benchmarks/dsa_bench.py indexer [--score-kernels triton gluon] [--rounds 3] [--profile] [--out f.json]
    python tests/benchmarks/dsa_bench.py stages [--seq-len 1048576] [--out f.json]
    python tests/benchmarks/dsa_bench.py call --shape small --seq-len 262144     # one indexer call, for ncu
    python tests/benchmarks/dsa_bench.py resources [--shape full]               # sm_90 registers, no GPU
    python tests/benchmarks/dsa_bench.py sass ncu_0.sass.csv [--top 12] [--reasons]   # ncu's SASS table, no GPU

``table`` (the default): for the ``small`` and ``full`` DSA shapes (model/config.py presets) it times the lightning
indexer + top-k, sparse MLA attention forward, and forward+backward, with peak memory, and
in the same run measures the ceilings (a large bf16 matmul, a device copy) and the anchor:
dense causal ``scaled_dot_product_attention`` (flash) with the same head shape at 64k and
256k. Every row carries its prediction (FLOPs over the measured matmul rate or bytes over
the measured copy bandwidth, whichever is larger) next to the measurement.

The full shape's absorbed query at 1M tokens is 64 GiB (1M x 64 heads x 512 x bf16), so its
attention rows at 1M time one context-parallel quarter (256k queries over 1M keys) and
report 4x that time, marked ``x4 of 256k chunk``.

``indexer``: :func:`kernels.dsa.lightning_indexer_topk` end to end with each score kernel on the same inputs,
the kernels taking turns round after round (a drift of the clocks falls on all alike; the table gives the
median), identical indices required; ``--profile`` adds the CUDA milliseconds per kernel of one call.
``stages``: the indexer's two memory-bound kernels (expansion to token indices, k-pool compression) against
the torch paths and ``fill_`` of the output (the write ceiling), with their errors. ``call``: one seeded
indexer call for Nsight Compute (``tests/gpu/ncu_indexer.sh``; ``--warm-only`` fills the compile and autotune
caches first, so that ``ncu --launch-skip N`` picks query block ``N``). ``resources``: every autotuned
configuration compiled for sm_90 on the CPU (:mod:`kernels.dsa.sm90`): registers, spill stack, shared memory,
CTAs per SM. ``sass``: where a kernel's time goes, from ncu's per-instruction stall samples.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gc
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from kernels.dsa import indexer_kl_loss, lightning_indexer_topk, sparse_mla_attention  # noqa: E402
from kernels.dsa.grid import kpool_grid  # noqa: E402
from kernels.dsa.indexer import compress_on_grid, expand_selection, torch_pool_topk  # noqa: E402

SHAPES = {
    "small": dict(heads=8, dqk=512, qk_head=128, v_head=128, index_heads=16, index_dim=64),
    "full": dict(heads=64, dqk=512, qk_head=256, v_head=256, index_heads=32, index_dim=128),
}
KPOOL, TOPK = 16, 2048
WIDTH = TOPK + KPOOL - 1


def timed(fn, reps: int) -> tuple[float, float]:
    """Mean seconds over ``reps`` after one warm-up, and peak GiB allocated during the runs. Python's
    garbage collector is off while they run (as ``timeit`` does): a full collection pauses the host for tens of
    milliseconds (44 ms in a fresh process that imported torch, on the device's host), and where the device
    waits on the host (the indexer's first query blocks, whose kernels are shorter than their launches) the
    pause is device time too: with it on, every other timing of the 1M-token indexer was 9-14 ms (5-8%) slower."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gc.collect()
    gc.disable()
    try:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    return start.elapsed_time(end) / 1e3 / reps, torch.cuda.max_memory_allocated() / 2**30


def indexer_inputs(seq_len: int, shape: dict, seed: int | None = None, device: str = "cuda"):
    """Random lightning-indexer inputs at ``seq_len`` tokens for a DSA ``shape`` (:data:`SHAPES`).

    Returns the positional arguments of :func:`kernels.dsa.lightning_indexer_topk` (queries
    ``[1, T, H, D]``, keys and gate scores ``[1, T, D]``, k-pool bias ``[KPOOL, D]``, all bf16;
    head weights ``[1, T, H]`` float32 scaled by ``H ** -0.5``), its keyword arguments and the
    score FLOPs of one causal call (a query sees half the pools on average). ``seed``: drawn
    from a generator of that seed, else from the global one.
    """
    h, d = shape["index_heads"], shape["index_dim"]
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(1, seq_len, h, d, **bf16)
    k, g = (torch.randn(1, seq_len, d, **bf16) for _ in range(2))
    ape = torch.randn(KPOOL, d, **bf16)
    w = torch.randn(1, seq_len, h, device=device, generator=gen) * h**-0.5
    kw = dict(kpool=KPOOL, topk=TOPK, select_tail=True, softmax_scale=d**-0.5)
    return (q, k, g, ape, w), kw, 2 * seq_len * (seq_len // KPOOL / 2) * h * d


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t, _ = timed(lambda: a @ b, 10)
    x = torch.empty(2**30, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    tc, _ = timed(lambda: y.copy_(x), 10)
    return dict(matmul_tflops=2 * 8192**3 / t / 1e12, copy_tbps=2 * x.numel() * 4 / tc / 1e12)


def bench_indexer(seq_len: int, shape: dict, ceil: dict, reps: int, torch_path: bool, profile: bool,
                  score_kernel: str) -> list[dict]:
    d = shape["index_dim"]
    (q, k, g, ape, w), kw, flops = indexer_inputs(seq_len, shape)
    pools = seq_len // KPOOL
    score_bytes = seq_len * (pools / 2) * 4 * 3  # fp32 score buffer: write, topk read, tie-check read
    bytes_ = score_bytes + q.numel() * 2 * max(1, pools // 128) / 8  # q re-reads mostly from L2
    predicted = max(flops / ceil["matmul_tflops"] / 1e12, bytes_ / ceil["copy_tbps"] / 1e12)
    t, peak = timed(lambda: lightning_indexer_topk(q, k, g, ape, w, **kw), reps)
    if profile:  # where the indexer's time goes, kernel by kernel
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            lightning_indexer_topk(q, k, g, ape, w, **kw)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)
    rows = [dict(op=f"indexer+topk (Triton selection, {score_kernel} scores)", seconds=t, predicted=predicted, peak_gib=peak,
                 tflops=flops / t / 1e12, pct_of_matmul=100 * flops / t / 1e12 / ceil["matmul_tflops"])]
    if torch_path:
        grid = kpool_grid(seq_len, KPOOL, None, q.device)

        def torch_run():
            pk = compress_on_grid(k, g, ape, grid)
            return torch_pool_topk(q, pk, w, grid, TOPK // KPOOL, d**-0.5, 0, 1024)

        t, peak = timed(torch_run, reps)
        rows.append(dict(op="indexer+topk (torch blockwise)", seconds=t, predicted=predicted, peak_gib=peak,
                         tflops=flops / t / 1e12, pct_of_matmul=100 * flops / t / 1e12 / ceil["matmul_tflops"]))
    return rows


POOL_LAYOUTS = ("window", "spread", "shared")
"""Which visible k-pools :func:`pool_indices` selects per query (``TOPK / KPOOL`` of them):

- ``window``: every other pool back from a random offset, so a query's pools lie in the last ``4 TOPK`` keys
  (8,192 x 1,152 bytes of latent at the ``full`` shape: a working set that stays in L2).
- ``spread``: evenly over the query's whole visible history from a random phase (a long-range selection:
  at 64k the latent, 75 MB, does not fit L2).
- ``shared``: the same pools 0, 2, 4, ... for every query that sees them (all queries read one set of 128
  pools, 2.4 MB: L2-resident, the gather's best case).

The kernels' arithmetic is the same for all three. Only where the gathered rows come from differs:
HBM or L2, and reused by neighbouring queries or not."""


def pool_indices(seq_len: int, n_q: int, device: str = "cuda", layout: str = "window") -> torch.Tensor:
    """``[1, n_q, WIDTH]`` int32 causal k-pool selections for the last ``n_q`` of ``seq_len`` queries, expanded as
    the indexer does (:func:`expand_selection`, tails included): ``TOPK / KPOOL`` distinct complete visible pools
    placed by ``layout`` (:data:`POOL_LAYOUTS`), ``-1`` where a query sees fewer. The kernels' arithmetic depends
    on how many (query, pool) pairs there are; their memory traffic also on which. Raises ValueError for an
    unknown ``layout``."""
    n_sel = TOPK // KPOOL
    visible = (torch.arange(seq_len - n_q, seq_len, device=device)[:, None] + 1) // KPOOL
    j = torch.arange(n_sel, device=device)
    if layout == "window":
        pools = visible - 1 - torch.randint(0, 2 * n_sel, (n_q, 1), device=device) - 2 * j
    elif layout == "spread":   # stride >= 1 pool keeps them distinct; past the start they fall below 0
        stride = (visible / n_sel).clamp_min(1.0)
        phase = torch.rand(n_q, 1, device=device)
        pools = visible - 1 - ((j + phase) * stride).floor().long()
    elif layout == "shared":
        pools = torch.where(2 * j < visible, 2 * j, -1)
    else:
        raise ValueError(f"pool layout {layout!r}; valid: {', '.join(POOL_LAYOUTS)}")
    pools = pools.clamp_min(-1)[None]
    return expand_selection(pools, kpool_grid(seq_len, KPOOL, None, device), n_q, seq_len - n_q, TOPK, True)


def backward_inputs(seq_len: int, shape: dict, layout: str = "window") -> tuple:
    """Random inputs of the sparse MLA backward kernels at ``seq_len`` queries and keys of a DSA ``shape``, seeded,
    as ``(q, kv, idx, grad, scale, out, lse)``: ``q [1, T, H, Dqk]``, ``kv [1, T, Dqk]``, ``grad`` (like ``q``)
    bf16, ``idx`` (:func:`pool_indices` in ``layout``), ``scale``, and the Triton forward's ``out`` and ``lse``
    (float32 ``[1, T, H]``)."""
    from kernels.dsa.sparse_attention_triton import triton_sparse_mla_fwd

    h, dqk = shape["heads"], shape["dqk"]
    torch.manual_seed(0)
    q = torch.randn(1, seq_len, h, dqk, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, seq_len, dqk, device="cuda", dtype=torch.bfloat16)
    idx = pool_indices(seq_len, seq_len, layout=layout).contiguous()
    grad = torch.randn(1, seq_len, h, dqk, device="cuda", dtype=torch.bfloat16)
    scale = shape["qk_head"] ** -0.5
    out, lse = triton_sparse_mla_fwd(q, kv, idx, scale, dqk)
    return q, kv, idx, grad, scale, out, lse


DKV_FORMS = {"query": None, "pool": KPOOL}
"""``table --dkv``: the latent gradient's forms timed after the forward, by name: per query (float32 atomics,
the training path's) and per k-pool run (``runs=KPOOL``)."""


def bench_attention(seq_len: int, shape: dict, ceil: dict, reps: int, dkv_forms=tuple(DKV_FORMS)) -> list[dict]:
    """Sparse MLA forward, and forward + backward with ``dkv`` in each of ``dkv_forms`` (:data:`DKV_FORMS`); with
    both forms, the relative norm difference of their gradients is printed."""
    h, dqk = shape["heads"], shape["dqk"]
    n_q, factor, note = seq_len, 1, ""
    if h * seq_len * dqk * 2 > 32 * 2**30:
        n_q, factor, note = seq_len // 4, 4, " x4 of 256k chunk"
    q = torch.randn(1, n_q, h, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, seq_len, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = pool_indices(seq_len, n_q)
    scale = shape["qk_head"] ** -0.5
    k_valid = WIDTH  # nearly every query at these lengths has a full selection
    fwd_flops = 2 * n_q * h * k_valid * (dqk + dqk)
    fwd_bytes = n_q * k_valid * dqk * 2 * max(1, h // 32) + q.numel() * 2 * 2
    bwd_flops = 2 * n_q * h * k_valid * (dqk + 2 * dqk + 2 * dqk)
    bwd_bytes = fwd_bytes + n_q * k_valid * dqk * 4 * max(1, h // 32)  # fp32 atomics, d_v folded in
    # per run: the dq pass gathers like the forward; the run pass reads q and dO rows once per (query, pool)
    # pair and recomputes QK and dO V^T (4 products of 2 * H * Dqk per selected token instead of 2)
    run_flops = bwd_flops + 2 * n_q * h * k_valid * 2 * dqk
    run_bytes = 2 * fwd_bytes + n_q * (TOPK // KPOOL) * h * dqk * 2 * 2
    pred_f = max(fwd_flops / ceil["matmul_tflops"] / 1e12, fwd_bytes / ceil["copy_tbps"] / 1e12)
    pred_b = max((fwd_flops + bwd_flops) / ceil["matmul_tflops"] / 1e12, (fwd_bytes + bwd_bytes) / ceil["copy_tbps"] / 1e12)
    pred_r = max((fwd_flops + run_flops) / ceil["matmul_tflops"] / 1e12, (fwd_bytes + run_bytes) / ceil["copy_tbps"] / 1e12)

    def fwd():
        with torch.no_grad():
            return sparse_mla_attention(q, kv, idx, scale, dqk)

    grad = torch.randn(1, n_q, h, dqk, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(runs):
        # the op's gradients, as a model's backward passes them on: q and kv are leaves here, and .backward()
        # would add each call's dq to q.grad, a 4.3 GB bf16 read-add-write at 64k tokens that the op never does
        out, _ = sparse_mla_attention(q, kv, idx, scale, dqk, runs=runs)
        return torch.autograd.grad(out, (q, kv), grad)

    t_f, peak_f = timed(fwd, reps)
    rows = [dict(op="sparse MLA fwd" + note, seconds=t_f * factor, predicted=pred_f * factor, peak_gib=peak_f,
                 tflops=fwd_flops / t_f / 1e12)]
    grads, predicted = {}, dict(query=pred_b, pool=pred_r)
    for form in dkv_forms:
        runs, pred = DKV_FORMS[form], predicted[form]
        t_b, peak_b = timed(lambda: fwd_bwd(runs), reps)
        rows.append(dict(op=f"sparse MLA fwd+bwd, dkv per {form}" + note, seconds=t_b * factor, predicted=pred * factor,
                         peak_gib=peak_b, tflops=(fwd_flops + bwd_flops) / t_b / 1e12))
        if len(dkv_forms) > 1:   # float32 copies for the comparison: 32 GiB of dq alone at 256k, full shape
            grads[runs] = tuple(g.float() for g in fwd_bwd(runs))
    for name, a, b in zip(("dq", "dkv"), grads.get(None, ()), grads.get(KPOOL, ())):
        err = ((a - b).norm() / b.norm()).item()
        print(f"  {n_q // 1024}k x {h} heads: {name} per pool vs per query, relative norm difference {err:.2e}",
              flush=True)
    return rows


def bench_indexer_loss(seq_len: int, shape: dict, ceil: dict, reps: int) -> list[dict]:
    """KL loss forward+backward: Triton target (per-pool attention mass); the indexer side fused in Triton
    (the CUDA path) and in torch (the reference), taking turns in the same run."""
    h, dqk, hi, di = shape["heads"], shape["dqk"], shape["index_heads"], shape["index_dim"]
    dev, bf = "cuda", torch.bfloat16
    qi = torch.randn(1, seq_len, hi, di, device=dev, dtype=bf, requires_grad=True)
    ki = torch.randn(1, seq_len, di, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(1, seq_len, di, device=dev, dtype=bf, requires_grad=True)
    ape = torch.randn(KPOOL, di, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(1, seq_len, hi, device=dev, requires_grad=True)
    kw = dict(kpool=KPOOL, topk=TOPK)
    with torch.no_grad():
        idx = lightning_indexer_topk(qi, ki, g, ape, w, select_tail=True, softmax_scale=di**-0.5, **kw)
        q = torch.randn(1, seq_len, h, dqk, device=dev, dtype=bf)
        kv = torch.randn(1, seq_len, dqk, device=dev, dtype=bf)
        _, lse = sparse_mla_attention(q, kv, idx, shape["qk_head"] ** -0.5, dqk)

    def run(torch_path):
        loss = indexer_kl_loss(qi, ki, g, ape, w, q, kv, lse, idx, index_softmax_scale=di**-0.5,
                               softmax_scale=shape["qk_head"] ** -0.5, torch_path=torch_path, **kw)
        return torch.autograd.grad(loss, (qi, ki, g, ape, w))   # no leaf .grad accumulated (fwd_bwd above)

    flops = 2 * seq_len * h * TOPK * dqk + 3 * 2 * seq_len * hi * (TOPK // KPOOL) * di
    bytes_ = seq_len * TOPK * dqk * 2 * max(1, h // 32)  # the mass kernel's latent gathers
    pred = max(flops / ceil["matmul_tflops"] / 1e12, bytes_ / ceil["copy_tbps"] / 1e12)
    rows = []
    for torch_path, label in ((False, "fused indexer side"), (True, "torch indexer side")):
        t, peak = timed(lambda: run(torch_path), reps)
        rows.append(dict(op=f"indexer KL loss fwd+bwd, {label}", seconds=t, predicted=pred, peak_gib=peak,
                         tflops=flops / t / 1e12))
    return rows


def bench_sdpa(seq_len: int, shape: dict, ceil: dict, reps: int) -> list[dict]:
    h, dqk, dv = shape["heads"], shape["qk_head"], shape["v_head"]
    q = torch.randn(1, h, seq_len, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, h, seq_len, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, h, seq_len, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fwd_flops = 2 * seq_len * seq_len / 2 * h * (dqk + dv)
    pred = fwd_flops / ceil["matmul_tflops"] / 1e12
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_f, peak_f = timed(lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True), reps)
        grad = torch.randn(1, h, seq_len, dv, device="cuda", dtype=torch.bfloat16)
        t_b, peak_b = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                        (q, k, v), grad), reps)
    return [
        dict(op="dense causal SDPA fwd (anchor)", seconds=t_f, predicted=pred, peak_gib=peak_f, tflops=fwd_flops / t_f / 1e12),
        dict(op="dense causal SDPA fwd+bwd (anchor)", seconds=t_b, predicted=3.5 * pred, peak_gib=peak_b,
             tflops=3.5 * fwd_flops / t_b / 1e12),
    ]


def _gluon_forward(schedule: str, lazy: bool = False):
    """A ``table --gluon-forward`` setting: the training path's Gluon forward set to ``schedule``, the ring kernel
    autotuned over its conditional-rescaling configuration alone with ``lazy``."""
    def apply() -> None:
        from kernels.dsa import sparse_attention_gluon as sag
        sag.FWD_SCHEDULE = schedule
        if lazy:
            sag.sparse_mla_fwd_gluon_kernel.configs = list(sag.GLUON_FWD_LAZY)
    return apply


GLUON_FORWARDS = {"default": lambda: None, "ring": _gluon_forward("ring"),
                  "ring-lazy": _gluon_forward("ring", lazy=True), "pair": _gluon_forward("pair")}
"""``table --gluon-forward``: how each choice sets the Gluon forward the training path runs
(:func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_fwd`) for this process: as shipped, the ring kernel
(autotuned over its configurations, or over its conditional-rescaling one alone), or the paired-block schedule."""


TABLE_OPS = {"indexer": "lightning indexer + top-k", "attention": "sparse MLA fwd and fwd+bwd",
             "sdpa": "the dense causal SDPA anchor (up to 256k)", "indexer-loss": "indexer KL loss (up to 256k)"}
"""``table --ops``: the row groups of the table, each timed for every shape and length."""


def table(args) -> None:
    from kernels.dsa.indexer_triton import resolve_score_kernel

    GLUON_FORWARDS[args.gluon_forward]()
    ceil = ceilings()
    probe = torch.empty(1, 1, 2, 1, device="cuda", dtype=torch.bfloat16)
    score_kernel = resolve_score_kernel("auto", probe)
    print(json.dumps(dict(ceilings=ceil, score_kernel=score_kernel, gluon_forward=args.gluon_forward, ops=args.ops,
                          dkv=args.dkv)), flush=True)
    table = []
    for name in args.shapes:
        shape = SHAPES[name]
        for seq_len in args.seq_lens:
            reps = 3 if seq_len <= 65536 else 1
            rows = []
            if "indexer" in args.ops:
                rows += bench_indexer(seq_len, shape, ceil, reps,
                                      torch_path=seq_len <= 262144 and not args.no_torch_indexer,
                                      profile=seq_len == max(args.seq_lens), score_kernel=score_kernel)
            if "attention" in args.ops:
                rows += bench_attention(seq_len, shape, ceil, reps, args.dkv)
            if "sdpa" in args.ops and seq_len <= 262144:
                rows += bench_sdpa(seq_len, shape, ceil, reps)
            if "indexer-loss" in args.ops and seq_len <= 262144:
                rows += bench_indexer_loss(seq_len, shape, ceil, reps)
            for row in rows:
                row.update(shape=name, seq_len=seq_len)
                print(json.dumps(row), flush=True)
            table += rows
            torch.cuda.empty_cache()
    print("\n| shape | T | op | predicted s | measured s | peak GiB | TFLOP/s |\n|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['shape']} | {r['seq_len'] // 1024}k | {r['op']} | {r['predicted']:.4f} | {r['seconds']:.4f} "
              f"| {r['peak_gib']:.1f} | {r['tflops']:.0f} |")
    tuned = autotuned()
    print(json.dumps(dict(autotuned=tuned), indent=1), flush=True)
    write(args.out, dict(ceilings=ceil, score_kernel=score_kernel, gluon_forward=args.gluon_forward, ops=args.ops,
                         dkv=args.dkv, rows=table, autotuned=tuned))


def autotuned() -> dict:
    """The configuration each autotuned DSA kernel chose, per tuning key."""
    from kernels.dsa import indexer_gluon, indexer_triton, sparse_attention_triton

    kernels = dict(pool_scores_kernel=indexer_triton.pool_scores_kernel, select_kernel=indexer_triton.select_kernel,
                   pool_scores_gluon_kernel=indexer_gluon.pool_scores_gluon_kernel,
                   sparse_mla_fwd_kernel=sparse_attention_triton.sparse_mla_fwd_kernel,
                   sparse_mla_bwd_kernel=sparse_attention_triton.sparse_mla_bwd_kernel,
                   sparse_mla_mass_kernel=sparse_attention_triton.sparse_mla_mass_kernel)
    return {name: {str(key): str(cfg) for key, cfg in kernel.cache.items()} for name, kernel in kernels.items()}


def write(path: str | None, result) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def profile_call(call, label: str, top: int = 10) -> list[dict]:
    """CUDA milliseconds of the ``top`` kernels of one ``call`` (after a warm-up), as rows labelled ``label``."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [dict(profile=label, kernel=e.key[:90], calls=e.count, ms=e.device_time_total / 1e3)
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]]


def indexer(args) -> None:
    """The ``indexer`` command (module docstring)."""
    ceil = ceilings()
    print(json.dumps(dict(ceilings=ceil)), flush=True)
    rows = []
    for name in args.shapes:
        for seq_len in args.seq_lens:
            inputs, kw, flops = indexer_inputs(seq_len, SHAPES[name], seed=seq_len)
            selected, times, peaks = {}, {k: [] for k in args.score_kernels}, {}
            for _ in range(args.rounds):
                for kernel in args.score_kernels:
                    def call(kernel=kernel):
                        return lightning_indexer_topk(*inputs, **kw, score_kernel=kernel)
                    if kernel not in selected:   # kept on the host: the other kernel's peak must not include it
                        selected[kernel] = call().cpu()
                    t, peak = timed(call, args.reps or (2 if seq_len > 262144 else 5))
                    times[kernel].append(t)
                    peaks[kernel] = max(peak, peaks.get(kernel, 0.0))
            first = args.score_kernels[0]
            for kernel in args.score_kernels:
                t = statistics.median(times[kernel])
                row = dict(shape=name, seq_len=seq_len, score_kernel=kernel, seconds=t, seconds_per_round=times[kernel],
                           peak_gib=peaks[kernel], tflops=flops / t / 1e12,
                           pct_of_matmul=100 * flops / t / 1e12 / ceil["matmul_tflops"],
                           identical_to_first=bool(torch.equal(selected[kernel], selected[first])))
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.profile:
                    for prow in profile_call(lambda: lightning_indexer_topk(*inputs, **kw, score_kernel=kernel),
                                             f"{name} {seq_len // 1024}k {kernel}"):
                        print(json.dumps(prow), flush=True)
                        rows.append(prow)
            inputs = selected = None   # freed before the next length
            torch.cuda.empty_cache()
    print("\n| shape | T | score kernel | s | TFLOP/s | % of matmul | peak GiB | same indices |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "seconds" in r:
            print(f"| {r['shape']} | {r['seq_len'] // 1024}k | {r['score_kernel']} | {r['seconds']:.4f} "
                  f"| {r['tflops']:.0f} | {r['pct_of_matmul']:.0f}% | {r['peak_gib']:.1f} | {r['identical_to_first']} |")
    write(args.out, dict(ceilings=ceil, rows=rows, autotuned=autotuned()))


def cuda_ms(fn, reps: int = 20) -> float:
    return timed(fn, reps)[0] * 1e3


def stages(args) -> None:
    """The ``stages`` command (module docstring): expansion and k-pool compression at ``args.seq_len`` tokens."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))
    from dsa_check import bf16_ulps_apart, rel_err

    from kernels.dsa.indexer_triton import triton_expand_selection, triton_kpool_compress

    n, rows = args.seq_len, []
    gen = torch.Generator(device="cuda").manual_seed(0)
    grid = kpool_grid(n, KPOOL, None, "cuda")
    n_pools, n_select = grid.start.numel(), TOPK // KPOOL
    # each query's pools drawn from those it sees (-1 where it sees fewer than n_select)
    visible = (torch.arange(n, device="cuda")[:, None] + 1) // KPOOL
    pools = (torch.rand(n, n_select, device="cuda", generator=gen) * visible).long()
    pools = torch.where(torch.arange(n_select, device="cuda")[None] < visible, pools, -1)[None]
    out_bytes = n * WIDTH * 4
    want = expand_selection(pools, grid, n, 0, TOPK, True)
    got = triton_expand_selection(pools, grid, n, 0, TOPK, True)
    for version, fn, moved, check in [
            ("triton", lambda: triton_expand_selection(pools, grid, n, 0, TOPK, True), out_bytes + pools.numel() * 8,
             f"equal {torch.equal(got, want)}"),
            ("torch", lambda: expand_selection(pools, grid, n, 0, TOPK, True), out_bytes + pools.numel() * 8, ""),
            ("fill_ of the output (write ceiling)", lambda: want.fill_(-1), out_bytes, "")]:
        ms = cuda_ms(fn)
        rows.append(dict(kernel="expand", version=version, ms=ms, gb_per_s=moved / ms / 1e6, check=check))
    del pools, want, got, visible
    torch.cuda.empty_cache()
    for dim in (64, 128):
        k = torch.nn.functional.layer_norm(torch.randn(1, n, dim, device="cuda", generator=gen), (dim,)).bfloat16()
        g = torch.randn(1, n, dim, device="cuda", generator=gen).bfloat16()
        ape = (0.1 * torch.randn(KPOOL, dim, device="cuda", generator=gen)).bfloat16()
        ref = compress_on_grid(k, g, ape, grid)
        ref64 = compress_on_grid(k.double(), g.double(), ape.double(), grid)
        moved = 2 * k.numel() * 2 + n_pools * dim * 2
        for version, fn in [("triton", lambda: triton_kpool_compress(k, g, ape, grid)),
                            ("torch", lambda: compress_on_grid(k, g, ape, grid))]:
            got = fn()
            check = f"rel err {rel_err(got, ref64):.2e}, {bf16_ulps_apart(got, ref):.0f} ulp from torch"
            ms = cuda_ms(fn)
            rows.append(dict(kernel=f"compress d{dim}", version=version, ms=ms, gb_per_s=moved / ms / 1e6, check=check))
        del k, g, ref, ref64, got
        torch.cuda.empty_cache()
    print(f"\n| kernel (T = {n}) | version | ms | GB/s | check |\n|---|---|---|---|---|")
    for r in rows:
        print(json.dumps(r), flush=True)
        print(f"| {r['kernel']} | {r['version']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | {r['check']} |")
    write(args.out, rows)


def call(args) -> None:
    """The ``call`` command (module docstring): one seeded indexer call, its score kernel and wall time."""
    from kernels.dsa.indexer_triton import resolve_score_kernel

    inputs, kw, _ = indexer_inputs(args.seq_len, SHAPES[args.shape], seed=args.seq_len)
    t0 = time.perf_counter()
    lightning_indexer_topk(*inputs, **kw, score_kernel=args.score_kernel)
    torch.cuda.synchronize()
    print(json.dumps(dict(shape=args.shape, seq_len=args.seq_len, warm_only=args.warm_only,
                          score_kernel=resolve_score_kernel(args.score_kernel, inputs[0]),
                          seconds=time.perf_counter() - t0)), flush=True)


def resources(args) -> None:
    """The ``resources`` command (module docstring): one table row per compiled configuration."""
    from kernels.dsa.sm90 import indexer_builds, resources as usage

    h, d = SHAPES[args.shape]["index_heads"], SHAPES[args.shape]["index_dim"]
    print(f"| kernel ({args.shape}: {h} heads x {d}) | registers | spill stack B/thread | shared KiB | CTAs/SM | "
          "warps/SM |\n|---|---|---|---|---|---|")
    for name, compiled, warps in indexer_builds(h, d, KPOOL, TOPK // KPOOL):
        r = usage(compiled, warps)
        print(f"| {name} | {r['registers']} | {r['stack_bytes']} | {r['shared_kib']:.0f} | {r['ctas_per_sm']} | "
              f"{r['warps_per_sm']} |", flush=True)


def opcode(sass: str) -> str:
    """The opcode of one SASS line, without its predicate (``@!P0 ATOMG.E.ADD ...`` -> ``ATOMG.E.ADD``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", sass).split(" ")[0]


def sass(args) -> None:
    """The ``sass`` command (module docstring): from an ncu ``--page source --print-source sass --csv`` export,
    the opcodes with the largest shares of stall samples (where warps were when sampled: the time) and of
    executions, the hottest instructions (a consumer waits on its producer: a ``SHFL.IDX`` after an ``ATOMG``
    carries the atomic's latency) and, with ``--reasons``, the stall reasons with their opcodes."""
    with open(args.csv, newline="") as f:
        table = list(csv.reader(f))
    at = next((i for i, r in enumerate(table) if "Source" in r and "Instructions Executed" in r), None)
    if at is None:
        raise SystemExit(f"{args.csv}: no 'Source' and 'Instructions Executed' columns (ncu --page source --csv)")
    header = table[at]
    recs = [r for r in table[at + 1:] if len(r) >= len(header) and r[0].startswith("0x")]
    i_src, i_exec = header.index("Source"), header.index("Instructions Executed")
    i_samples = header.index("Warp Stall Sampling (All Samples)")
    ops = [opcode(r[i_src].strip()) for r in recs]
    samples, executed = [int(r[i_samples] or 0) for r in recs], [int(r[i_exec] or 0) for r in recs]
    by_samples, by_exec = collections.Counter(), collections.Counter()
    for op, s_, e in zip(ops, samples, executed):
        by_samples[op] += s_
        by_exec[op] += e
    total_s, total_e = sum(samples) or 1, sum(executed) or 1
    print(f"{len(recs)} instructions, {total_e:,} warp-level executions, {total_s:,} stall samples\n")
    print("| opcode | % of stall samples | % of executions |\n|---|---|---|")
    for op, s_ in by_samples.most_common(args.top):
        print(f"| {op} | {100 * s_ / total_s:.1f} | {100 * by_exec[op] / total_e:.1f} |")
    print("\n| address offset | SASS | % of stall samples | executions |\n|---|---|---|---|")
    base = int(recs[0][0], 16) if recs else 0
    for i in sorted(range(len(recs)), key=lambda i: -samples[i])[:args.top]:
        print(f"| {int(recs[i][0], 16) - base:#x} | `{recs[i][i_src].strip()[:70]}` | "
              f"{100 * samples[i] / total_s:.2f} | {executed[i]:,} |")
    if args.reasons:
        reasons = {n: collections.Counter() for n in header if n.startswith("stall_") and "Not Issued" not in n}
        for r, op in zip(recs, ops):
            for n in reasons:
                reasons[n][op] += int(r[header.index(n)] or 0)
        total = sum(sum(c.values()) for c in reasons.values()) or 1
        print("\n| stall reason | % of samples | top opcodes (points) |\n|---|---|---|")
        for n, counts in sorted(reasons.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]:
            top = ", ".join(f"{op} {100 * v / total:.1f}" for op, v in counts.most_common(5))
            print(f"| {n} | {100 * sum(counts.values()) / total:.1f} | {top} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    lengths = dict(type=int, nargs="+", default=[65536, 262144, 1048576])
    p = commands.add_parser("table", help="the DSA kernels' table (the default)")
    p.add_argument("--seq-lens", **lengths)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-torch-indexer", action="store_true", help="skip the torch blockwise indexer rows")
    p.add_argument("--gluon-forward", default="default", choices=list(GLUON_FORWARDS),
                   help="the Gluon sparse MLA forward the training path runs for the table (64-head shapes): as "
                        "shipped, the ring (with conditional rescaling), or the paired-block schedule")
    p.add_argument("--ops", nargs="+", default=list(TABLE_OPS), choices=list(TABLE_OPS),
                   help="which rows to time: " + "; ".join(f"{k}: {v}" for k, v in TABLE_OPS.items()))
    p.add_argument("--dkv", nargs="+", default=list(DKV_FORMS), choices=list(DKV_FORMS),
                   help="the latent gradient's forms in the attention rows; with one, no float32 copies of the "
                        "gradients are kept for comparing the two (32 GiB of dq at 256k, full shape)")
    p.add_argument("--out", default=None)
    p = commands.add_parser("indexer", help="the lightning indexer end to end, score kernel by score kernel")
    p.add_argument("--seq-lens", **lengths)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--score-kernels", nargs="+", default=["auto"], choices=["auto", "triton", "gluon"])
    p.add_argument("--rounds", type=int, default=1, help="timings per kernel, the kernels taking turns; median")
    p.add_argument("--reps", type=int, default=None, help="calls per timing (default: 2 above 256k tokens, else 5)")
    p.add_argument("--profile", action="store_true", help="CUDA ms per kernel of one call")
    p.add_argument("--out", default=None)
    p = commands.add_parser("stages", help="the expansion and k-pool compression kernels against the torch paths")
    p.add_argument("--seq-len", type=int, default=1 << 20)
    p.add_argument("--out", default=None)
    p = commands.add_parser("call", help="one indexer call (for Nsight Compute)")
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--seq-len", type=int, default=262144)
    p.add_argument("--score-kernel", default="auto", choices=["auto", "triton", "gluon"])
    p.add_argument("--warm-only", action="store_true", help="the run before the profiled one (fills the caches)")
    p = commands.add_parser("resources", help="registers, spills, shared memory on sm_90, no GPU")
    p.add_argument("--shape", default="full", choices=list(SHAPES))
    p = commands.add_parser("sass", help="an ncu SASS export's stall samples by opcode and instruction")
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--reasons", action="store_true", help="also the stall reasons, each with its top opcodes")
    argv = sys.argv[1:]
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):   # no command: the table
        argv = ["table"] + argv
    args = parser.parse_args(argv)
    dict(table=table, indexer=indexer, stages=stages, call=call, resources=resources, sass=sass)[args.command](args)


if __name__ == "__main__":
    main()
