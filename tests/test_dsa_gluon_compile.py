"""The Gluon score kernel of the lightning indexer (kernels/dsa/indexer_gluon.py) compiled for sm_90 on the CPU.

No GPU is needed: Triton's front end and its bundled ptxas run here (tests/benchmarks/sm90_resources.py).
What this guards is the kernel's reason to exist, the overlap of each head's ``wgmma`` with the previous
head's accumulation: the PTX must wait with one product still in flight (``wgmma.wait_group 1``), and ptxas
must not serialize the ``wgmma`` instructions (its C7510-C7519 warnings: an in-flight accumulator copied
across the loop's back edge, or too many products live at once). Its numbers are checked on an H200 by
tests/gpu/dsa_check.py and tests/benchmarks/indexer_gluon_variants.py.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "benchmarks"))

from dsa_bench import SHAPES  # noqa: E402
from sm90_resources import compile_gluon_scores, ptxas_report  # noqa: E402


@pytest.mark.parametrize("shape", ["small", "full"])
def test_gluon_scores_keep_one_wgmma_in_flight_without_serialization(shape):
    heads, dim = SHAPES[shape]["index_heads"], SHAPES[shape]["index_dim"]
    compiled = compile_gluon_scores(heads, dim, dict(BLOCK_N=128, Q_STAGES=3, TMA_STORE=False, HEAD_GROUP=16))
    ptx = compiled.asm["ptx"]
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    assert "1" in waits, f"no wgmma wait leaves a product in flight: {waits}"
    # 16 heads per iteration, K = dim in steps of 16: every product is issued inside the unrolled group
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 16 * dim // 16
    report = ptxas_report(compiled)
    assert "Used" in report and "registers" in report, report   # ptxas ran and reported
    assert not re.search(r"C75[01]\d", report), report
