"""One lightning-indexer call, for Nsight Compute (``tests/gpu/ncu_indexer.sh``) to profile one of its kernels.

    python tests/benchmarks/indexer_ncu.py --shape small --seq-len 262144 [--warm-only]

Draws the inputs of ``dsa_bench.indexer_inputs`` (seeded) and calls :func:`kernels.dsa.lightning_indexer_topk`
once. ``--warm-only`` is the run before the profiled one: it fills Triton's compile and autotuning caches on
disk (``TRITON_CACHE_AUTOTUNING=1``), so that the profiled process launches each kernel exactly as often as the
call does (no tuning launches) and ``ncu --launch-skip N`` picks the call's N-th launch of a kernel (query block
N). Prints the score kernel the call resolved and its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kernels.dsa.indexer_triton as it  # noqa: E402
from dsa_bench import SHAPES, indexer_inputs  # noqa: E402
from kernels.dsa import lightning_indexer_topk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--seq-len", type=int, default=262144)
    parser.add_argument("--warm-only", action="store_true")
    args = parser.parse_args()
    inputs, kw, _ = indexer_inputs(args.seq_len, SHAPES[args.shape], seed=args.seq_len)
    t0 = time.perf_counter()
    lightning_indexer_topk(*inputs, **kw)
    torch.cuda.synchronize()
    print(json.dumps(dict(shape=args.shape, seq_len=args.seq_len, warm_only=args.warm_only,
                          score_kernel=it.resolve_score_kernel(it.SCORE_KERNEL, inputs[0]),
                          seconds=time.perf_counter() - t0)), flush=True)


if __name__ == "__main__":
    main()
