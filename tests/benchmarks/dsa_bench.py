"""Benchmark of the DSA Triton kernels on one H200 (issue 4):

    python tests/benchmarks/dsa_bench.py [--seq-lens 65536 262144 1048576] [--out bench.json]

For the ``small`` and ``full`` DSA shapes (model/config.py presets) it times the lightning
indexer + top-k, sparse MLA attention forward, and forward+backward, with peak memory, and
in the same run measures the ceilings (a large bf16 matmul, a device copy) and the anchor:
dense causal ``scaled_dot_product_attention`` (flash) with the same head shape at 64k and
256k. Every row carries its prediction (FLOPs over the measured matmul rate or bytes over
the measured copy bandwidth, whichever is larger) next to the measurement.

The full shape's absorbed query at 1M tokens is 64 GiB (1M x 64 heads x 512 x bf16), so its
attention rows at 1M time one context-parallel quarter (256k queries over 1M keys) and
report 4x that time, marked ``x4 of 256k chunk``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from kernels.dsa import (indexer_gluon, indexer_kl_loss, indexer_triton, lightning_indexer_topk,  # noqa: E402
                         sparse_attention_triton, sparse_mla_attention)
from kernels.dsa.indexer import _compress_on_grid, _torch_pool_topk, kpool_grid  # noqa: E402

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
    pause is device time too: with it on, every other timing of the 1M-token indexer was 9-14 ms (5-8%) slower
    (kernels/NOTES.md, v28)."""
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
            pk = _compress_on_grid(k, g, ape, grid)
            return _torch_pool_topk(q, pk, w, grid, TOPK // KPOOL, d**-0.5, 0, 1024)

        t, peak = timed(torch_run, reps)
        rows.append(dict(op="indexer+topk (torch blockwise)", seconds=t, predicted=predicted, peak_gib=peak,
                         tflops=flops / t / 1e12, pct_of_matmul=100 * flops / t / 1e12 / ceil["matmul_tflops"]))
    return rows


def bench_attention(seq_len: int, shape: dict, ceil: dict, reps: int) -> list[dict]:
    h, dqk = shape["heads"], shape["dqk"]
    n_q, factor, note = seq_len, 1, ""
    if h * seq_len * dqk * 2 > 32 * 2**30:
        n_q, factor, note = seq_len // 4, 4, " x4 of 256k chunk"
    q = torch.randn(1, n_q, h, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, seq_len, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # causal random selections of WIDTH distinct tokens (the kernels' cost does not depend on which)
    pos = torch.arange(seq_len - n_q, seq_len, device="cuda")[:, None]
    idx = (pos - torch.randint(0, 2**31 - 1, (n_q, 1), device="cuda") % (WIDTH * 8) - torch.arange(WIDTH, device="cuda") * 8)
    idx = torch.where(idx >= 0, idx, -1).to(torch.int32)[None].contiguous()
    scale = shape["qk_head"] ** -0.5
    k_valid = WIDTH  # nearly every query at these lengths has a full selection
    fwd_flops = 2 * n_q * h * k_valid * (dqk + dqk)
    fwd_bytes = n_q * k_valid * dqk * 2 * max(1, h // 32) + q.numel() * 2 * 2
    bwd_flops = 2 * n_q * h * k_valid * (dqk + 2 * dqk + 2 * dqk)
    bwd_bytes = fwd_bytes + n_q * k_valid * dqk * 4 * max(1, h // 32)  # fp32 atomics, d_v folded in
    pred_f = max(fwd_flops / ceil["matmul_tflops"] / 1e12, fwd_bytes / ceil["copy_tbps"] / 1e12)
    pred_b = max((fwd_flops + bwd_flops) / ceil["matmul_tflops"] / 1e12, (fwd_bytes + bwd_bytes) / ceil["copy_tbps"] / 1e12)

    def fwd():
        with torch.no_grad():
            return sparse_mla_attention(q, kv, idx, scale, dqk)

    grad = torch.randn(1, n_q, h, dqk, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        out, _ = sparse_mla_attention(q, kv, idx, scale, dqk)
        out.backward(grad)

    t_f, peak_f = timed(fwd, reps)
    rows = [dict(op="sparse MLA fwd" + note, seconds=t_f * factor, predicted=pred_f * factor, peak_gib=peak_f,
                 tflops=fwd_flops / t_f / 1e12)]
    t_b, peak_b = timed(fwd_bwd, reps)
    rows.append(dict(op="sparse MLA fwd+bwd" + note, seconds=t_b * factor, predicted=pred_b * factor,
                     peak_gib=peak_b, tflops=(fwd_flops + bwd_flops) / t_b / 1e12))
    return rows


def bench_indexer_loss(seq_len: int, shape: dict, ceil: dict, reps: int) -> list[dict]:
    """KL loss forward+backward: Triton target (per-pool attention mass), torch indexer side."""
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

    def run():
        loss = indexer_kl_loss(qi, ki, g, ape, w, q, kv, lse, idx, index_softmax_scale=di**-0.5,
                               softmax_scale=shape["qk_head"] ** -0.5, **kw)
        loss.backward()

    flops = 2 * seq_len * h * TOPK * dqk + 3 * 2 * seq_len * hi * (TOPK // KPOOL) * di
    bytes_ = seq_len * TOPK * dqk * 2 * max(1, h // 32)  # the mass kernel's latent gathers
    pred = max(flops / ceil["matmul_tflops"] / 1e12, bytes_ / ceil["copy_tbps"] / 1e12)
    t, peak = timed(run, reps)
    return [dict(op="indexer KL loss fwd+bwd", seconds=t, predicted=pred, peak_gib=peak,
                 tflops=flops / t / 1e12)]


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
        t_b, peak_b = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad), reps)
    return [
        dict(op="dense causal SDPA fwd (anchor)", seconds=t_f, predicted=pred, peak_gib=peak_f, tflops=fwd_flops / t_f / 1e12),
        dict(op="dense causal SDPA fwd+bwd (anchor)", seconds=t_b, predicted=3.5 * pred, peak_gib=peak_b,
             tflops=3.5 * fwd_flops / t_b / 1e12),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-torch-indexer", action="store_true", help="skip the torch blockwise indexer rows")
    args = parser.parse_args()
    ceil = ceilings()
    probe = torch.empty(1, 1, 2, 1, device="cuda", dtype=torch.bfloat16)
    score_kernel = indexer_triton.resolve_score_kernel(indexer_triton.SCORE_KERNEL, probe)
    print(json.dumps(dict(ceilings=ceil, score_kernel=score_kernel)), flush=True)
    table = []
    for name in args.shapes:
        shape = SHAPES[name]
        for seq_len in args.seq_lens:
            reps = 3 if seq_len <= 65536 else 1
            rows = bench_indexer(seq_len, shape, ceil, reps, torch_path=seq_len <= 262144 and not args.no_torch_indexer,
                                 profile=seq_len == max(args.seq_lens), score_kernel=score_kernel)
            rows += bench_attention(seq_len, shape, ceil, reps)
            if seq_len <= 262144:
                rows += bench_sdpa(seq_len, shape, ceil, reps)
            if seq_len <= 262144:
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
    tuned = {}
    for module, names in [(indexer_triton, ["_pool_scores_kernel", "_select_kernel"]),
                          (indexer_gluon, ["_pool_scores_gluon_kernel"]),
                          (sparse_attention_triton, ["_sparse_mla_fwd_kernel", "_sparse_mla_bwd_kernel",
                                                     "_sparse_mla_mass_kernel"])]:
        for name in names:
            tuned[name] = {str(key): str(cfg) for key, cfg in getattr(module, name).cache.items()}
    print(json.dumps(dict(autotuned=tuned), indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceilings=ceil, score_kernel=score_kernel, rows=table, autotuned=tuned), f, indent=1)


if __name__ == "__main__":
    main()
