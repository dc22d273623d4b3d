"""Where the lightning indexer's end-to-end time goes outside its kernels, at 1M tokens (full shape).

    python tests/benchmarks/indexer_host_time.py

Times one :func:`kernels.dsa.lightning_indexer_topk` call three ways on the same inputs: CUDA events
around the call (as ``dsa_bench.timed``), host wall clock with a synchronize after, and the host time
until the call returns without one (its launch and host-sync cost); plus the profiled kernel time.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dsa_bench import KPOOL, SHAPES, TOPK  # noqa: E402
from kernels.dsa import lightning_indexer_topk  # noqa: E402

h, d, n = SHAPES["full"]["index_heads"], SHAPES["full"]["index_dim"], 1 << 20
q = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
k, g = (torch.randn(1, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ape = torch.randn(KPOOL, d, device="cuda", dtype=torch.bfloat16)
w = torch.randn(1, n, h, device="cuda") * h**-0.5
kw = dict(kpool=KPOOL, topk=TOPK, select_tail=True, softmax_scale=d**-0.5)
lightning_indexer_topk(q, k, g, ape, w, **kw)
torch.cuda.synchronize()
rows = []
for _ in range(3):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    out = lightning_indexer_topk(q, k, g, ape, w, **kw)
    t_return = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    rows.append(dict(event_s=start.elapsed_time(end) / 1e3, wall_s=time.perf_counter() - t0, host_until_return_s=t_return))
    print(json.dumps(rows[-1]), flush=True)
del out
