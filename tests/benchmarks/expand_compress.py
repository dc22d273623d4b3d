"""The indexer's two memory-bound kernels against their earlier forms, same run (issue 4, v27).

    python tests/benchmarks/expand_compress.py [--seq-len 1048576] [--out f.json]

* expansion of ``[1, T, 128]`` pool indices to ``[1, T, 2063]`` int32 token indices (kpool 16, top-k
  2048, tails): :func:`kernels.dsa.indexer_triton.triton_expand_selection` at 1, 2, 4 and 8 rows per
  program (equal to the torch expansion), and ``fill_`` of the same output as the write ceiling;
* k-pool compression of ``[1, T, D]`` bf16 keys and gates (index dim 64 and 128):
  :func:`kernels.dsa.indexer_triton.triton_kpool_compress` at several ``COMPRESS_ELEMENTS`` x
  ``COMPRESS_WARPS`` against the torch path (:func:`kernels.dsa.indexer._compress_on_grid`): relative
  error against float64 and the largest difference from the torch path in bf16 ulps
  (``dsa_check.bf16_ulps_apart``).

Milliseconds are CUDA-event means (``indexer_score_variants.cuda_ms``); GB/s counts each byte the kernel
must move once. Prints one JSON line per case and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))

import kernels.dsa.indexer_triton as it  # noqa: E402
from dsa_bench import KPOOL, TOPK  # noqa: E402
from dsa_check import bf16_ulps_apart, rel_err  # noqa: E402
from indexer_score_variants import cuda_ms  # noqa: E402
from indexer_versions import with_constants  # noqa: E402
from kernels.dsa.indexer import _compress_on_grid, _expand_selection, kpool_grid  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, rows = args.seq_len, []
    gen = torch.Generator(device="cuda").manual_seed(0)
    grid = kpool_grid(n, KPOOL, None, "cuda")
    n_pools, n_select = grid.start.numel(), TOPK // KPOOL

    # expansion: each query's pools drawn from those it sees (-1 where it sees fewer than n_select)
    pos = torch.arange(n, device="cuda")[:, None]
    visible = (pos + 1) // KPOOL
    pools = (torch.rand(n, n_select, device="cuda", generator=gen) * visible).long()
    pools = torch.where(torch.arange(n_select, device="cuda")[None] < visible, pools, -1)[None]
    del pos, visible
    out_bytes = n * (TOPK + KPOOL - 1) * 4
    moved = out_bytes + pools.numel() * 8
    want = _expand_selection(pools, grid, n, 0, TOPK, True)
    cases = [(f"{block_t} rows per program", lambda block_t=block_t: it.triton_expand_selection(
        pools, grid, n, 0, TOPK, True, block_t=block_t)) for block_t in (1, 2, 4, 8)]
    for name, fn in cases:
        got = fn()
        row = dict(kernel="expand", version=name, equal=bool(torch.equal(got, want)), ms=cuda_ms(fn, reps=20))
        row["gb_per_s"] = moved / row["ms"] / 1e6
        del got
        print(json.dumps(row), flush=True)
        rows.append(row)
    fill_ms = cuda_ms(lambda: want.fill_(-1), reps=20)
    rows.append(dict(kernel="expand", version="fill_ of the output (write ceiling)", equal=None, ms=fill_ms,
                     gb_per_s=out_bytes / fill_ms / 1e6))
    print(json.dumps(rows[-1]), flush=True)
    del pools, want
    torch.cuda.empty_cache()

    # compression
    for dim in (64, 128):
        k = torch.nn.functional.layer_norm(torch.randn(1, n, dim, device="cuda", generator=gen), (dim,)).bfloat16()
        g = torch.randn(1, n, dim, device="cuda", generator=gen).bfloat16()
        ape = (0.1 * torch.randn(KPOOL, dim, device="cuda", generator=gen)).bfloat16()
        ref = _compress_on_grid(k, g, ape, grid)
        ref64 = _compress_on_grid(k.double(), g.double(), ape.double(), grid)
        moved = 2 * k.numel() * 2 + n_pools * dim * 2
        cases = [("torch _compress_on_grid", lambda: _compress_on_grid(k, g, ape, grid))]
        for elements, warps in [(4096, 4), (8192, 4), (16384, 4), (16384, 8), (32768, 8)]:
            compress = with_constants(it.triton_kpool_compress,
                                      dict(COMPRESS_ELEMENTS=elements, COMPRESS_WARPS=warps))
            cases.append((f"v27 {elements} elements, {warps} warps",
                          lambda compress=compress: compress(k, g, ape, grid)))
        for name, fn in cases:
            got = fn()
            row = dict(kernel=f"compress d{dim}", version=name, rel_err_float64=rel_err(got, ref64),
                       max_bf16_ulps_from_torch=bf16_ulps_apart(got, ref),
                       ms=cuda_ms(fn, reps=20))
            row["gb_per_s"] = moved / row["ms"] / 1e6
            print(json.dumps(row), flush=True)
            rows.append(row)
        del k, g, ref, ref64
        torch.cuda.empty_cache()

    print(f"\n| kernel (T = {n}) | version | ms | GB/s | check |\n|---|---|---|---|---|")
    for r in rows:
        check = r["equal"] if "equal" in r else f"rel err {r['rel_err_float64']:.2e}, " \
            f"{r['max_bf16_ulps_from_torch']:.0f} ulp from torch"
        print(f"| {r['kernel']} | {r['version']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | {check} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
