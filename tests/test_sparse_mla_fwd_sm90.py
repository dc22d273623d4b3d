"""The Triton sparse MLA forward with the indexer KL's pool mass folded in, compiled for sm_90 on the CPU
(Triton's front end and bundled ptxas: :mod:`kernels.dsa.sm90`).

The pool mass replaces a second pass over the gathered latent (``triton_sparse_mla_mass``, 20 ms of a 64k
``small`` step per DSA layer on an H100); it pays only if the forward keeps its registers and occupancy. A
one-hot tensor-core product for the per-pool sums made ptxas spill ~700 bytes per thread at the ``small`` shape's
tilings; the in-register reshape-and-sum must not. The values are checked by tests/test_dsa_triton_interpreter.py
and on a GPU by tests/benchmarks/sparse_mla_tilings.py (its ``mass rel err`` column).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kernels.dsa.sm90 import compile_sm90, resources  # noqa: E402


def _compile(block_h, block_k, warps, stages, n_pools):
    import kernels.dsa.sparse_attention_triton as sat

    kernel = sat.sparse_mla_fwd_kernel
    types = {"Q": "*bf16", "KV": "*bf16", "OUT": "*bf16", "IDX": "*i32", "LSE": "*fp32", "POOL_LSE": "*fp32",
             "scale_log2": "fp32"}
    constexprs = dict(DQK=512, DV=512, BLOCK_D=512, BLOCK_DV=512, BLOCK_H=block_h, BLOCK_K=block_k, KPOOL=16,
                      N_POOLS=n_pools)
    signature = {n: types.get(n, "i32") for n in kernel.fn.arg_names if n not in constexprs}
    return resources(compile_sm90(kernel, signature, constexprs, warps, stages), warps)


# the small shape's tilings (8 heads: 16-row head blocks), BLOCK_K 64 and 32
@pytest.mark.parametrize("tiling", [(16, 64, 4, 2), (16, 64, 8, 2), (16, 32, 4, 2)])
def test_pool_mass_adds_no_spill_to_the_small_shape_forward(tiling):
    plain, with_mass = _compile(*tiling, n_pools=0), _compile(*tiling, n_pools=128)
    assert with_mass["stack_bytes"] == 0, with_mass
    assert with_mass["shared_kib"] <= plain["shared_kib"] + 1, (plain, with_mass)
    if tiling[1] == 64:   # the autotuner's picks on H100 and H200: same CTAs per SM with and without
        assert with_mass["ctas_per_sm"] == plain["ctas_per_sm"], (plain, with_mass)
