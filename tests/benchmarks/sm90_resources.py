"""Registers, shared memory and resident CTAs per SM of the lightning-indexer kernels on sm_90, without a GPU.

    python tests/benchmarks/sm90_resources.py [--shape full]

Compiles :mod:`kernels.dsa.indexer_triton`'s score, selection, expansion and k-pool compression kernels
and the Gluon score kernel (:mod:`kernels.dsa.indexer_gluon`) for
``GPUTarget("cuda", 90, 32)`` (Triton's front end and ptxas run on the CPU) for every
autotuned configuration and prints a table: registers per thread and shared memory per CTA
(``cuobjdump --dump-resource-usage`` of the cubin), the stack frame ptxas spills registers to, and the CTAs one H100/H200
SM can hold (65,536 registers, 227 KiB of shared memory, 64 warps, 32 CTAs). It also catches compile
errors the interpreter (``TRITON_INTERPRET=1``) accepts. Used to predict kernel variants before
spending device time on them (kernels/NOTES.md).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.autotuner import Autotuner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kernels.dsa.indexer_gluon as ig  # noqa: E402
import kernels.dsa.indexer_triton as it  # noqa: E402
from dsa_bench import KPOOL, SHAPES, TOPK  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_CTAS = 65536, 227 * 1024, 64, 32
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(kernel, signature: dict, constexprs: dict, warps: int, stages: int = 3, maxnreg: int | None = None,
                 unaligned: tuple[str, ...] = ("n_q", "n_pools", "p_lo", "size_class", "n_rows", "n_cols", "n_select")):
    """``triton.compile`` of ``kernel`` (a ``@triton.jit`` function or an autotuner over one) for sm_90.

    Like the launcher's specialization, pointers and integer arguments other than ``unaligned``
    are taken as divisible by 16 (``tt.divisibility``): without it no load is vectorized or
    pipelined (``cp.async``) and the registers and shared memory differ from the GPU's."""
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
               if n not in unaligned and t != "constexpr"}
    src = ASTSource(fn=fn, signature=dict(signature, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                    attrs=aligned)
    options = dict(num_warps=warps, num_stages=stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=TARGET, options=options)


def compile_gluon_scores(heads: int, dim: int, config: dict, maxima: bool = True, seg: int = it.SEGMENT):
    """``triton.compile`` of the Gluon score kernel (:func:`kernels.dsa.indexer_gluon._pool_scores_gluon_kernel`)
    for sm_90 with ``config`` (its ``BLOCK_N``, ``Q_STAGES``, ``TMA_STORE``, ``HEAD_GROUP``, optionally
    ``W_SMEM``), ``heads`` x ``dim`` bf16 queries and the column groups of ``TOPK // KPOOL`` selected pools;
    aligned as the launcher specializes."""
    fn = ig._pool_scores_gluon_kernel.fn
    scalars = ("n_q", "n_pools", "p_lo", "n_pools_total", "size_class")
    sig = dict(zip(["Q", "PK", "W", "OUT", "COLMAX", "SEGMAX", "Q_LO", "Q_HI"],
                   ["*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*i32"]))
    sig.update({n: "i64" for n in fn.arg_names if n.startswith("stride_")})
    sig.update({n: "i32" for n in scalars})
    constexprs = dict(config, H=heads, D=dim, N_COLUMNS=it._n_columns(TOPK // KPOOL), GROUP_N=it.GROUP_N,
                      MAXIMA=maxima, SEG=seg)
    # constexpr defaults (EPILOGUE, W_SMEM) as the launcher applies them; triton.compile would pass None
    constexprs.update({p.name: p.default for p in fn.params
                       if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty})
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig if n not in scalars}
    src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                         attrs=aligned)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4))


def ptxas_report(compiled) -> str:
    """``ptxas -v`` (Triton's bundled ptxas) on a compiled kernel's PTX for sm_90a: its register and spill lines
    and its performance warnings, e.g. C7510-C7519 when it serializes ``wgmma`` instructions."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = get_ptxas(90).path   # the one Triton itself runs for sm_90 (3.9: ptxas-blackwell, a newer PTX ISA)
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True)
    return result.stdout + result.stderr


def resources(compiled, warps: int) -> dict:
    """Registers per thread, shared bytes per CTA, spill stores and resident CTAs per SM of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))   # per-thread stack frame: ptxas's spills
    shared = max(int(re.search(r"SHARED:(\d+)", text).group(1)), compiled.metadata.shared)
    # registers are allocated per warp in units of 256
    per_warp = -(-regs * 32 // 256) * 256
    ctas = min(SM_REGISTERS // (per_warp * warps), SM_SHARED // max(shared, 1), SM_WARPS // warps, SM_CTAS)
    return dict(registers=regs, stack_bytes=stack, shared_kib=shared / 1024, ctas_per_sm=ctas,
                warps_per_sm=ctas * warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="full", choices=list(SHAPES))
    args = parser.parse_args()
    h, d = SHAPES[args.shape]["index_heads"], SHAPES[args.shape]["index_dim"]
    n_select = TOPK // KPOOL
    columns, capacity = it._n_columns(n_select), it._capacity(n_select)
    rows = []
    score_sig = dict(zip(
        ["Q", "PK", "W", "OUT", "COLMAX", "SEGMAX", "Q_LO", "Q_HI"],
        ["*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*i32"]))
    score_sig.update({n: "i64" for n in ["stride_qb", "stride_qt", "stride_qh", "stride_pb", "stride_pp",
                                          "stride_wb", "stride_wt", "stride_ob", "stride_ot", "stride_cb", "stride_ct",
                                          "stride_gb", "stride_gt"]})
    score_sig.update({n: "i32" for n in ["n_q", "n_pools", "p_lo", "size_class"]})
    for config in it.SCORE_CONFIGS:
        for maxima, seg, tma, store in [
                (True, it.SEGMENT, True, True), (True, it.SEGMENT, True, False), (True, it.SEGMENT, False, False),
                (True, 0, True, True), (False, 0, True, True)]:
            kw = dict(config.kwargs, H=h, D=d, N_COLUMNS=columns, GROUP_N=it.GROUP_N, MAXIMA=maxima, SEG=seg, TMA=tma,
                      TMA_STORE=store)
            name = "scores " + " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in config.kwargs.items())
            name += (f" MAXIMA={int(maxima)} SEG={seg} TMA={int(tma)} TMA_STORE={int(store)}"
                     f" w{config.num_warps} s{config.num_stages}"
                     + (f" maxnreg {config.maxnreg}" if config.maxnreg else ""))
            rows.append((name, compile_sm90(it._pool_scores_kernel, score_sig, kw, config.num_warps,
                                            config.num_stages, config.maxnreg), config.num_warps))
    select_sig = dict(zip(["S", "COLMAX", "SEGMAX", "HITS", "COUNT", "SLOTS", "OUT", "Q_LO", "Q_HI"],
                          ["*fp32", "*fp32", "*fp32", "*i32", "*i32", "*i64", "*i64", "*i32", "*i32"]))
    select_sig.update({n: "i64" for n in ["stride_sb", "stride_st", "stride_cb", "stride_ct", "stride_gb", "stride_gt",
                                           "stride_nb", "stride_ob", "stride_ot"]})
    select_sig.update({n: "i32" for n in ["n_rows", "n_cols", "p_lo", "size_class"]})
    for config in it.SELECT_CONFIGS:
        for bound_pass, seg in [(False, it.SEGMENT), (False, 0), (True, 0)]:
            kw = dict(config.kwargs, N_SELECT=n_select, N_COLUMNS=columns, CAPACITY=capacity, BOUND_PASS=bound_pass,
                      SEG=seg, **it.select_constants())
            name = f"select CHUNK={config.kwargs['CHUNK']} LOOP_STAGES={config.kwargs['LOOP_STAGES']} " \
                   f"BOUND_PASS={int(bound_pass)} SEG={seg} w{config.num_warps}"
            rows.append((name, compile_sm90(it._select_kernel, select_sig, kw, config.num_warps), config.num_warps))
    expand_sig = dict(zip(["POOLS", "START", "Q_POS", "Q_DOC_START", "OUT"], ["*i64", "*i64", "*i64", "*i64", "*i32"]))
    expand_sig.update({n: "i64" for n in ["stride_pb", "stride_pt", "stride_ob", "stride_ot"]})
    expand_sig.update(n_q="i32", n_select="i32")
    kw = it.expand_constants(KPOOL, n_select, True, it.EXPAND_ROWS)
    rows.append((f"expand BLOCK_T={it.EXPAND_ROWS} w4", compile_sm90(it._expand_kernel, expand_sig, kw, 4), 4))
    compress_sig = dict(zip(["K", "G", "APE", "START", "DOC", "DOC_BOUNDS", "OUT"],
                            ["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*i64", "*bf16"]))
    compress_sig.update({n: "i64" for n in ["stride_kb", "stride_ks", "stride_gb", "stride_gs", "stride_ob",
                                             "stride_op"]})
    compress_sig.update(n_pools="i32")
    kw = it.compress_constants(d, KPOOL)
    rows.append((f"compress BLOCK_P={kw['BLOCK_P']} w{it.COMPRESS_WARPS}",
                 compile_sm90(it._compress_kernel, compress_sig, kw, it.COMPRESS_WARPS, unaligned=("n_pools",)),
                 it.COMPRESS_WARPS))
    for config in ig.GLUON_CONFIGS:
        if h % config.kwargs["HEAD_GROUP"] == 0:
            name = "gluon scores " + " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in config.kwargs.items())
            rows.append((name, compile_gluon_scores(h, d, config.kwargs), 4))
    print(f"| kernel ({args.shape}: {h} heads x {d}) | registers | spill stack B/thread | shared KiB | CTAs/SM | warps/SM |")
    print("|---|---|---|---|---|---|")
    for name, compiled, warps in rows:
        r = resources(compiled, warps)
        print(f"| {name} | {r['registers']} | {r['stack_bytes']} | {r['shared_kib']:.0f} | {r['ctas_per_sm']} | "
              f"{r['warps_per_sm']} |", flush=True)


if __name__ == "__main__":
    main()
