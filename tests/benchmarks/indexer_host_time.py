"""Where the lightning indexer's end-to-end time goes outside its kernels, at 1M tokens (full shape).

    python tests/benchmarks/indexer_host_time.py

Times one :func:`kernels.dsa.lightning_indexer_topk` call three ways on the same inputs: CUDA events
around the call (as ``dsa_bench.timed``), host wall clock with a synchronize after, and the host time
until the call returns without one (its launch and host-sync cost). Compare with the kernel time of
``indexer_score_variants.py --profile``.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dsa_bench import SHAPES, indexer_inputs  # noqa: E402
from kernels.dsa import lightning_indexer_topk  # noqa: E402

inputs, kw, _ = indexer_inputs(1 << 20, SHAPES["full"])
lightning_indexer_topk(*inputs, **kw)
torch.cuda.synchronize()
for _ in range(3):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    lightning_indexer_topk(*inputs, **kw)
    t_return = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    print(json.dumps(dict(event_s=start.elapsed_time(end) / 1e3, wall_s=time.perf_counter() - t0,
                          host_until_return_s=t_return)), flush=True)
