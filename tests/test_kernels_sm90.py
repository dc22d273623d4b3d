"""The mHC kernels and the sparse MLA backward's run scan compiled for sm_90 on the CPU (Triton's front end and
bundled ptxas: :mod:`kernels.dsa.sm90`).

Triton's CPU interpreter runs what the compiler rejects (a variable bound to tensors of different shapes in the
two branches of a runtime ``if`` passed the interpreter and failed to compile), and ptxas' register use is only
visible in a compile: each kernel must compile at the launch configuration its wrapper uses and spill nothing.
Their values are checked by tests/test_hc_kernels_interpreter.py, tests/test_hc_projection_interpreter.py and
tests/test_dsa_triton_interpreter.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kernels.dsa.sm90 import compile_sm90, resources  # noqa: E402
from kernels.hc.merge_triton import MERGE_BWD_CONFIGS  # noqa: E402


def _signature(kernel, constexprs, types):
    return {n: types.get(n, "i32") for n in kernel.arg_names if n not in constexprs}


@pytest.mark.parametrize("name", ["hc_maps_fwd_kernel", "hc_maps_bwd_kernel"])
def test_hc_maps_kernels_compile_without_spills(name):
    import kernels.hc.maps_triton as mt

    kernel = getattr(mt, name)
    constexprs = dict(NP=4, BLOCK_T=mt.BLOCK_T)
    types = {n: "*fp32" for n in ("MIXED", "BASE", "SCALE", "PRE", "POST", "COMB", "DPRE", "DPOST", "DCOMB", "DZ")}
    types["eps"] = "fp32"
    compiled = compile_sm90(kernel, _signature(kernel, constexprs, types), constexprs, 4, 1,
                            unaligned=("T", "n", "iters", "steps", "stride_m", "stride_dz"))
    assert resources(compiled, 4)["stack_bytes"] == 0


@pytest.mark.parametrize("w_parts", [1, 3])
@pytest.mark.parametrize("extra,stream_tiles", [(False, False), (True, False), (True, True)])
def test_projection_dx_kernel_compiles_without_spills(w_parts, extra, stream_tiles):
    import kernels.hc.projection_triton as pt

    kernel = pt.hc_projection_dx_kernel
    constexprs = dict(W_PARTS=w_parts, EXTRA=extra, STREAM_TILES=stream_tiles, BLOCK_M=pt.BLOCK_M,
                      BLOCK_K=pt.DX_BLOCK_K, BLOCK_P=32)
    types = {"GRAD": "*fp32", "Y": "*fp32", "RSTD": "*fp32", "X": "*bf16", "W": "*fp32", "DX": "*bf16",
             "PRE": "*fp32", "DB": "*bf16", "DS": "*bf16"}
    compiled = compile_sm90(kernel, _signature(kernel, constexprs, types), constexprs, pt.WARPS, pt.STAGES,
                            unaligned=("m", "p", "stride_pre"))
    assert resources(compiled, pt.WARPS)["stack_bytes"] == 0


@pytest.mark.parametrize("config", range(len(MERGE_BWD_CONFIGS)))
def test_merge_backward_kernel_compiles_without_spills(config):
    import kernels.hc.merge_triton as mt

    kernel, cfg = mt.hc_merge_bwd_kernel, MERGE_BWD_CONFIGS[config]
    constexprs = dict(NP=4, **cfg.kwargs)
    types = {"G": "*bf16", "OUT": "*bf16", "S": "*bf16", "POST": "*fp32", "COMB": "*fp32", "D_OUT": "*bf16",
             "D_S": "*bf16", "D_POST": "*fp32", "D_COMB": "*fp32"}
    compiled = compile_sm90(kernel, _signature(kernel.fn, constexprs, types), constexprs, cfg.num_warps,
                            cfg.num_stages, unaligned=("T", "n"))
    assert resources(compiled, cfg.num_warps)["stack_bytes"] == 0


def test_run_scan_kernel_compiles_without_spills_at_the_full_selection_width():
    import kernels.dsa.sparse_attention_triton as sat

    # index_topk 2048 plus the own pool's 15-token tail: 129 groups of 16, a [256, 16] tile; the warps run_scan picks
    kernel = sat.run_scan_kernel
    block_r, block_run, warps = sat.run_scan_tile(129, 16)
    assert (block_r, block_run) == (256, 16)
    constexprs = dict(RUN=16, BLOCK_R=block_r, BLOCK_RUN=block_run)
    types = {"IDX": "*i32", "RUN_OK": "*u8", "SCATTER": "*u8", "KEYS": "*i32"}
    compiled = compile_sm90(kernel, _signature(kernel, constexprs, types), constexprs, warps, 1,
                            unaligned=("width", "n_runs", "stride_it"))
    assert resources(compiled, warps)["stack_bytes"] == 0
