"""The lightning indexer's Gluon score kernel, configuration by configuration, against the Triton one (v15).

    python tests/benchmarks/indexer_gluon_variants.py [--shapes small full] [--out f.json]

One block of 8192 queries against 65,536 visible pools per DSA shape (``dsa_bench.SHAPES``), the size of the
last blocks of a 1M-token sequence at kpool 16 (as ``indexer_score_variants.py``). Times, in the same run on
the same bf16 inputs, :func:`kernels.dsa.indexer_triton.launch_pool_scores` with the autotuned Triton kernel
and each Gluon configuration of :data:`GLUON_VARIANTS` called without the tuner
(:func:`kernels.dsa.indexer_gluon.gluon_pool_scores` with ``config``). Every Gluon variant with the real
epilogue must write the Triton kernel's scores bit for bit, and column-group and segment maxima equal to a
torch recomputation from its scores; ``EPILOGUE`` 1 variants (a plain add per product: wrong scores) time the
kernel with half the epilogue instructions, to separate the epilogue's cost from the MMA stream's. Prints a
table (ms per block, % of the bf16 matmul rate measured in the same run).
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

import kernels.dsa.indexer_triton as it  # noqa: E402
from dsa_bench import SHAPES, TOPK, KPOOL, ceilings, timed  # noqa: E402
from indexer_score_variants import group_maxima  # noqa: E402
from kernels.dsa.indexer_gluon import gluon_pool_scores  # noqa: E402

ROWS, POOLS = 8192, 65536
GLUON_VARIANTS = [
    dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=False, HEAD_GROUP=8, W_SMEM=False),
    dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=False, HEAD_GROUP=8),
    dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=False, HEAD_GROUP=8, EPILOGUE=1),
    dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=False, HEAD_GROUP=16),
    dict(BLOCK_N=128, Q_STAGES=2, TMA_STORE=False, HEAD_GROUP=16),
    dict(BLOCK_N=64, Q_STAGES=3, TMA_STORE=True, HEAD_GROUP=8),
    dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=True, HEAD_GROUP=8),
    dict(BLOCK_N=128, Q_STAGES=2, TMA_STORE=True, HEAD_GROUP=16),
    dict(BLOCK_N=128, Q_STAGES=4, TMA_STORE=False, HEAD_GROUP=8),
]
"""Configurations timed (``W_SMEM`` False: head weights by global loads in the head loop, as before v19);
``EPILOGUE`` 1 times a plain add per product (wrong scores, not compared)."""


def block_inputs(shape: dict, seed: int):
    """Queries ``[1, ROWS, H, D]`` bf16, pooled keys ``[1, POOLS, D]`` bf16, pre-scaled weights ``[1, ROWS, H]``
    float32 and every query's visible range ``[0, POOLS)`` (int32), from a seeded generator."""
    h, d = shape["index_heads"], shape["index_dim"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, ROWS, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pk = torch.randn(1, POOLS, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1, ROWS, h, device="cuda", generator=gen) * h**-0.5 * d**-0.5
    lo = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    hi = torch.full((ROWS,), POOLS, dtype=torch.int32, device="cuda")
    return q, pk, w, lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["small", "full"], choices=list(SHAPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceil = ceilings()
    print(json.dumps(dict(ceilings=ceil)), flush=True)
    it._set_descriptor_allocator(torch.device("cuda"))
    columns, seg = it._n_columns(TOPK // KPOOL), it.SEGMENT
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        q, pk, w, lo, hi = block_inputs(shape, seed=len(name))
        flops = 2 * ROWS * POOLS * shape["index_heads"] * shape["index_dim"]
        scores = torch.empty(1, ROWS, POOLS, device="cuda")
        col_max = torch.empty(1, ROWS, columns, device="cuda")
        seg_max = torch.empty(1, ROWS, POOLS // seg, device="cuda")
        variants = [("triton (autotuned)", None)] + [
            ("gluon " + " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in c.items()), dict(c))
            for c in GLUON_VARIANTS]
        reference = None
        for label, config in variants:
            def call():
                if config is None:
                    it.launch_pool_scores("triton", q, pk, w, scores, col_max, seg_max, lo, hi, 0, columns, True, seg)
                else:
                    gluon_pool_scores(q, pk, w, scores, col_max, seg_max, lo, hi, 0, it._size_class(POOLS), columns,
                                      it.GROUP_N, True, seg, config=config)
            try:
                scores.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                row = dict(shape=name, variant=label)
                if config is None:
                    reference = scores.clone()
                elif config.get("EPILOGUE", 2) == 2:
                    block_n = config["BLOCK_N"]
                    row.update(scores_equal=bool(torch.equal(scores, reference)),
                               col_max_equal=bool(torch.equal(col_max[0], group_maxima(scores[0], block_n))),
                               seg_max_equal=bool(torch.equal(seg_max[0], scores[0].view(ROWS, -1, seg).amax(-1))))
                ms = timed(call, 5)[0] * 1e3
                row.update(ms=ms, pct_of_matmul=100 * flops / (ms / 1e3) / 1e12 / ceil["matmul_tflops"])
            except Exception as err:   # report and go on
                row = dict(shape=name, variant=label, error=repr(err)[:300])
            print(json.dumps(row), flush=True)
            rows.append(row)
        q = pk = w = scores = col_max = seg_max = reference = None   # freed before the next shape
        torch.cuda.empty_cache()
    print("\n| shape | score kernel, 8192 x 65,536 | ms | % of matmul | scores / maxima equal |\n|---|---|---|---|---|")
    for r in rows:
        if "ms" in r:
            check = "-" if "scores_equal" not in r else \
                f"{r['scores_equal']} / {r['col_max_equal'] and r['seg_max_equal']}"
            print(f"| {r['shape']} | {r['variant']} | {r['ms']:.2f} | {r['pct_of_matmul']:.0f}% | {check} |")
        else:
            print(f"| {r['shape']} | {r['variant']} | error: {r['error'][:80]} | | |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceilings=ceil, rows=rows, triton=triton.__version__), f, indent=1)


if __name__ == "__main__":
    main()
