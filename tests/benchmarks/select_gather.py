"""The selection kernel alone on one query block, hit segments read one score or two at a time (issue 4, v26).

    python tests/benchmarks/select_gather.py [--rows 8192] [--pools 16384 65536] [--out f.json]

:func:`kernels.dsa.indexer_triton._select_kernel` on random float32 scores ``[1, rows, pools]`` (every pool
visible to every query), the column-group maxima and the 32-pool segment maxima recomputed with torch, called
directly (``.fn``) with the tuner's segmented configuration (``CHUNK`` 1024, one warp) and the default bound
(``BOUND_SLACK``), once per ``PAIRS`` value: False, v21's gather (32 4-byte loads per thread and segment, each
warp-wide load touching 32 cache lines) and True, v26's (16 int64 loads of score pairs). Both must give the
indices of ``torch.topk`` over the composite keys. Prints milliseconds per launch and the ratio, one row per
pool count, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kernels.dsa.indexer_triton as it  # noqa: E402
from dsa_bench import KPOOL, TOPK  # noqa: E402
from indexer_score_variants import cuda_ms  # noqa: E402
from kernels.dsa.indexer import _selection_keys, decode_selection_keys  # noqa: E402

N_SELECT = TOPK // KPOOL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--pools", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    columns, capacity, seg = it._n_columns(N_SELECT), it._capacity(N_SELECT), it.SEGMENT
    rows, report = args.rows, []
    for pools in args.pools:
        gen = torch.Generator(device="cuda").manual_seed(pools)
        scores = torch.randn(1, rows, pools, device="cuda", generator=gen)
        # column group c holds the pools p with p mod columns == c: disjoint groups, as the selection needs
        col_max = scores.view(1, rows, pools // columns, columns).amax(2).contiguous()
        seg_max = scores.view(1, rows, pools // seg, seg).amax(-1).contiguous()
        q_lo = torch.zeros(rows, dtype=torch.int32, device="cuda")
        q_hi = torch.full((rows,), pools, dtype=torch.int32, device="cuda")
        keys = _selection_keys(scores[0], torch.arange(pools, device="cuda"), torch.isfinite(scores[0]))
        want, _ = decode_selection_keys(keys.topk(N_SELECT, dim=-1).values)
        del keys
        hits = torch.empty(rows * (pools // seg), dtype=torch.int32, device="cuda")
        counts = torch.zeros(1, rows, dtype=torch.int32, device="cuda")
        slots = torch.empty(rows, capacity, dtype=torch.long, device="cuda")
        selected = torch.empty(1, rows, N_SELECT, dtype=torch.long, device="cuda")
        row = dict(rows=rows, pools=pools)
        for pairs in (False, True):
            def run(pairs=pairs):
                it._select_kernel.fn[(rows,)](
                    scores, col_max, seg_max, hits, counts, slots, selected, q_lo, q_hi,
                    scores.stride(0), scores.stride(1), col_max.stride(0), col_max.stride(1),
                    seg_max.stride(0), seg_max.stride(1), counts.stride(0), selected.stride(0), selected.stride(1),
                    rows, pools, 0, it._size_class(pools), N_SELECT=N_SELECT, N_COLUMNS=columns, CAPACITY=capacity,
                    CHUNK=1024, SPLIT_SORT=True, LOOP_STAGES=1, BOUND_PASS=False, COMPACT="relaxed", SEG=seg,
                    **dict(it.select_constants(), PAIRS=pairs), num_warps=1)
            selected.fill_(-7)
            run()
            torch.cuda.synchronize()
            row[f"equal_pairs{int(pairs)}"] = bool(torch.equal(selected[0], want))
            row[f"ms_pairs{int(pairs)}"] = cuda_ms(run, reps=20)
        row["ratio"] = row["ms_pairs1"] / row["ms_pairs0"]
        print(json.dumps(row), flush=True)
        report.append(row)
        del scores, col_max, seg_max, hits, slots, selected, want
        torch.cuda.empty_cache()
    print("\n| rows x pools | v21 gather ms | v26 pairs ms | ratio | indices equal |")
    print("|---|---|---|---|---|")
    for r in report:
        print(f"| {r['rows']} x {r['pools']} | {r['ms_pairs0']:.3f} | {r['ms_pairs1']:.3f} | {r['ratio']:.3f} | "
              f"{r['equal_pairs0']}/{r['equal_pairs1']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
