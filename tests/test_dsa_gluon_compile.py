"""The Gluon score kernel of the lightning indexer (kernels/dsa/indexer_gluon.py) compiled for sm_90 on the CPU.

No GPU is needed: Triton's front end and its bundled ptxas run here (:mod:`kernels.dsa.sm90`).
What this guards is the kernel's reason to exist, the overlap of each head's ``wgmma`` with the previous
head's accumulation: the PTX must wait with one product still in flight (``wgmma.wait_group 1``), and ptxas
must not serialize the ``wgmma`` instructions (its C7510-C7519 warnings: an in-flight accumulator copied
across the loop's back edge, or too many products live at once). Its numbers are checked on an H200 by
tests/gpu/dsa_check.py and tests/benchmarks/dsa_bench.py.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from kernels.dsa.sm90 import compile_gluon_scores, ptxas_report  # noqa: E402

INDEX_HEADS = {"small": (16, 64), "full": (32, 128)}   # index heads x dim of model/config.py's DSA shapes
N_SELECT = 2048 // 16   # index_topk / kpool


@pytest.mark.parametrize("shape", ["small", "full"])
def test_gluon_scores_keep_one_wgmma_in_flight_without_serialization(shape):
    heads, dim = INDEX_HEADS[shape]
    compiled = compile_gluon_scores(heads, dim, N_SELECT, dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=False, HEAD_GROUP=16))
    ptx = compiled.asm["ptx"]
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    assert "1" in waits, f"no wgmma wait leaves a product in flight: {waits}"
    # 16 heads per iteration, K = dim in steps of 16: every product is issued inside the unrolled group
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 16 * dim // 16
    report = ptxas_report(compiled)
    assert "Used" in report and "registers" in report, report   # ptxas ran and reported
    assert not re.search(r"C75[01]\d", report), report
