"""The DSA kernels compiled for Hopper (sm_90) without a GPU: registers, spills, shared memory.

Triton's front end and its bundled ptxas run on the CPU, so every autotuned configuration of the score,
selection, expansion and k-pool compression kernels (:mod:`kernels.dsa.indexer_triton`), of the Gluon score
kernel (:mod:`kernels.dsa.indexer_gluon`), of the sparse MLA kernels (:mod:`kernels.dsa.sparse_attention_triton`
through :func:`compile_sm90`) and of the Gluon sparse MLA kernels (:mod:`kernels.dsa.sparse_attention_gluon`) can
be compiled for ``GPUTarget("cuda", 90, 32)`` and read back (``cuobjdump --dump-resource-usage``, ``ptxas -v``):
how many CTAs one H100/H200 SM holds, whether ptxas spills or serializes ``wgmma`` instructions. It also catches
compile errors the interpreter (``TRITON_INTERPRET=1``) accepts. Used by ``tests/test_dsa_gluon_compile.py`` and
``tests/benchmarks/dsa_bench.py resources``; not imported by :mod:`kernels.dsa`.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.autotuner import Autotuner

from kernels.dsa import indexer_gluon, indexer_triton, sparse_attention_gluon

TARGET = GPUTarget("cuda", 90, 32)
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_CTAS = 65536, 227 * 1024, 64, 32
"""What one H100/H200 SM holds: registers, shared memory bytes, warps, CTAs."""

SCORE_POINTERS = dict(zip(["Q", "PK", "W", "OUT", "COLMAX", "SEGMAX", "Q_LO", "Q_HI"],
                          ["*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*i32"]))


def _aligned(fn, signature: dict, unaligned: tuple[str, ...]) -> dict:
    """``tt.divisibility`` 16 for the pointers and integers of ``signature`` other than ``unaligned``, as the
    launcher specializes them: without it no load is vectorized or pipelined and the registers and shared memory
    differ from the GPU's."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
            if n not in unaligned and t != "constexpr"}


def compile_sm90(kernel, signature: dict, constexprs: dict, warps: int, stages: int = 3, maxnreg: int | None = None,
                 unaligned: tuple[str, ...] = ("n_q", "n_pools", "p_lo", "size_class", "n_rows", "n_cols", "n_select")):
    """``triton.compile`` of ``kernel`` (a ``@triton.jit`` function or an autotuner over one) for sm_90, the
    arguments of ``signature`` other than ``unaligned`` taken as divisible by 16."""
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    src = ASTSource(fn=fn, signature=dict(signature, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                    attrs=_aligned(fn, signature, unaligned))
    options = dict(num_warps=warps, num_stages=stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=TARGET, options=options)


def compile_gluon_scores(heads: int, dim: int, n_select: int, config: dict, seg: int = indexer_triton.SEGMENT):
    """``triton.compile`` of the Gluon score kernel (:func:`kernels.dsa.indexer_gluon.pool_scores_gluon_kernel`)
    for sm_90 with ``config`` (its ``BLOCK_N``, ``Q_STAGES``, ``TMA_STORE``, ``HEAD_GROUP``), ``heads`` x ``dim``
    bf16 queries and the column groups of ``n_select`` selected pools; aligned as the launcher specializes."""
    fn = indexer_gluon.pool_scores_gluon_kernel.fn
    scalars = ("n_q", "n_pools", "p_lo", "n_pools_total", "size_class")
    sig = dict(SCORE_POINTERS)
    sig.update({n: "i64" for n in fn.arg_names if n.startswith("stride_")})
    sig.update({n: "i32" for n in scalars})
    constexprs = dict(config, H=heads, D=dim, N_COLUMNS=indexer_triton.n_columns(n_select),
                      GROUP_N=indexer_triton.GROUP_N, SEG=seg)
    # constexpr defaults as the launcher applies them; triton.compile would pass None
    constexprs.update({p.name: p.default for p in fn.params
                       if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty})
    src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                         attrs=_aligned(fn, sig, scalars))
    return triton.compile(src, target=TARGET, options=dict(num_warps=4))


def _compile_gluon_sparse(kernel, pointers: dict, scalars: tuple[str, ...], heads: int, dim: int, config):
    """``triton.compile`` of a Gluon sparse MLA kernel (:mod:`kernels.dsa.sparse_attention_gluon`) for sm_90:
    ``pointers`` its pointer arguments' types, ``scalars`` its float scalars plus ``n_idx`` (not aligned), the
    strides int64, ``config`` one of its ``triton.Config`` (kwargs, warps, ``maxnreg``) at ``heads`` x ``dim``; a
    constexpr the config leaves out takes the kernel's default."""
    fn = kernel.fn
    sig = dict(pointers)
    sig.update({n: "i64" for n in fn.arg_names if n.startswith("stride_")})
    sig.update({n: "i32" if n == "n_idx" else "fp32" for n in scalars})
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = dict(defaults, **config.kwargs, H=heads, D=dim)
    src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                         attrs=_aligned(fn, sig, scalars))
    return triton.compile(src, target=TARGET, options=dict(num_warps=config.num_warps, maxnreg=config.maxnreg))


def compile_gluon_sparse_fwd(heads: int, dim: int, config, index_dtype: str = "*i32"):
    """The warp-specialized sparse MLA forward (:func:`kernels.dsa.sparse_attention_gluon.sparse_mla_fwd_gluon_kernel`)
    compiled for sm_90 with ``config`` (``BLOCK_K``, ``STAGES``, ``GATHER_ROWS``, ``PRODUCER_REGS``), ``heads`` x
    ``dim`` bf16 queries and latent (``d_v == dim``); aligned as the launcher specializes."""
    pointers = dict(zip(["Q", "KV", "IDX", "OUT", "LSE"], ["*bf16", "*bf16", index_dtype, "*bf16", "*fp32"]))
    return _compile_gluon_sparse(sparse_attention_gluon.sparse_mla_fwd_gluon_kernel, pointers,
                                 ("n_idx", "scale_log2"), heads, dim, config)


def compile_gluon_sparse_dkv(heads: int, dim: int, config, index_dtype: str = "*i32"):
    """The sparse MLA latent-gradient kernel (:func:`kernels.dsa.sparse_attention_gluon.sparse_mla_dkv_gluon_kernel`)
    compiled for sm_90 with ``config``, ``heads`` x ``dim`` bf16 queries, latent and output gradient; in the atomic
    layout the launcher takes (``DKV_ATOMIC_LAYOUT``) unless ``config`` names its ``ATOMIC_LAYOUT``."""
    sag = sparse_attention_gluon
    config = triton.Config(dict(ATOMIC_LAYOUT=sag.ATOMIC_LAYOUTS.index(sag.DKV_ATOMIC_LAYOUT)) | config.kwargs,
                           num_warps=config.num_warps, maxnreg=config.maxnreg)
    pointers = dict(zip(["Q", "KV", "IDX", "DO", "LSE", "DELTA", "DKV"],
                        ["*bf16", "*bf16", index_dtype, "*bf16", "*fp32", "*fp32", "*fp32"]))
    return _compile_gluon_sparse(sparse_attention_gluon.sparse_mla_dkv_gluon_kernel, pointers,
                                 ("n_idx", "scale", "scale_log2"), heads, dim, config)


def compile_gluon_sparse_dq(heads: int, dim: int, config, index_dtype: str = "*i32", schedule: str | None = None):
    """A sparse MLA query-gradient kernel (:data:`kernels.dsa.sparse_attention_gluon.DQ_KERNELS` ``[schedule]``,
    ``None``: the launcher's ``DQ_SCHEDULE``) compiled for sm_90 with ``config`` (one of that kernel's), ``heads`` x
    ``dim`` bf16 queries, latent and gradients (and the forward's output, for a kernel that takes ``OUT``)."""
    sag = sparse_attention_gluon
    kernel = sag.DQ_KERNELS[schedule or sag.DQ_SCHEDULE]
    names = [n for n in ["Q", "KV", "IDX", "DO", "LSE", "DELTA", "DQ", "OUT"] if n in kernel.fn.arg_names]
    pointers = dict(zip(names, ["*bf16", "*bf16", index_dtype, "*bf16", "*fp32", "*fp32", "*bf16", "*bf16"]))
    return _compile_gluon_sparse(kernel, pointers,
                                 ("n_idx", "scale", "scale_log2"), heads, dim, config)


def ptxas_report(compiled) -> str:
    """``ptxas -v`` (Triton's bundled ptxas) on a compiled kernel's PTX for sm_90a: its register and spill lines
    and its performance warnings, e.g. C7510-C7519 when it serializes ``wgmma`` instructions."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = get_ptxas(90).path   # the one Triton itself runs for sm_90
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True)
    return result.stdout + result.stderr


def resources(compiled, warps: int) -> dict:
    """Registers per thread, shared bytes per CTA, spill stack bytes and resident CTAs per SM of a compiled kernel."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))   # per-thread stack frame: ptxas's spills
    shared = max(int(re.search(r"SHARED:(\d+)", text).group(1)), compiled.metadata.shared)
    per_warp = -(-regs * 32 // 256) * 256   # registers are allocated per warp in units of 256
    ctas = min(SM_REGISTERS // (per_warp * warps), SM_SHARED // max(shared, 1), SM_WARPS // warps, SM_CTAS)
    return dict(registers=regs, stack_bytes=stack, shared_kib=shared / 1024, ctas_per_sm=ctas,
                warps_per_sm=ctas * warps)


def _label(kwargs: dict) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in kwargs.items())


def indexer_builds(heads: int, dim: int, kpool: int, n_select: int) -> list[tuple[str, object, int]]:
    """Every autotuned configuration of the indexer's kernels compiled for sm_90 at ``heads`` x ``dim`` index
    heads, ``kpool``-token pools and ``n_select`` selected pools: ``(label, compiled kernel, warps)`` rows."""
    it = indexer_triton
    columns, capacity, seg = it.n_columns(n_select), it.candidate_capacity(n_select), it.SEGMENT
    rows = []
    score_sig = dict(SCORE_POINTERS)
    score_sig.update({n: "i64" for n in it.pool_scores_kernel.fn.arg_names if n.startswith("stride_")})
    score_sig.update({n: "i32" for n in ["n_q", "n_pools", "p_lo", "size_class"]})
    for config in it.SCORE_CONFIGS:
        for width in (seg, 0):
            kw = dict(config.kwargs, H=heads, D=dim, N_COLUMNS=columns, GROUP_N=it.GROUP_N, SEG=width)
            name = (f"scores {_label(config.kwargs)} SEG={width} w{config.num_warps} s{config.num_stages}"
                    + (f" maxnreg {config.maxnreg}" if config.maxnreg else ""))
            rows.append((name, compile_sm90(it.pool_scores_kernel, score_sig, kw, config.num_warps,
                                            config.num_stages, config.maxnreg), config.num_warps))
    select_sig = dict(zip(["S", "COLMAX", "SEGMAX", "HITS", "COUNT", "SLOTS", "OUT", "Q_LO", "Q_HI"],
                          ["*fp32", "*fp32", "*fp32", "*i32", "*i32", "*i64", "*i64", "*i32", "*i32"]))
    select_sig.update({n: "i64" for n in it.select_kernel.fn.arg_names if n.startswith("stride_")})
    select_sig.update({n: "i32" for n in ["n_rows", "n_cols", "p_lo", "size_class"]})
    for config in it.SELECT_CONFIGS:
        for width in (seg, 0):
            kw = dict(config.kwargs, N_SELECT=n_select, N_COLUMNS=columns, CAPACITY=capacity, SEG=width,
                      SEG_CHUNK=it.SEGMENT_CHUNK, BOUND_SLACK=it.BOUND_SLACK)
            rows.append((f"select {_label(config.kwargs)} SEG={width} w{config.num_warps}",
                         compile_sm90(it.select_kernel, select_sig, kw, config.num_warps), config.num_warps))
    expand_sig = dict(zip(["POOLS", "START", "Q_POS", "Q_DOC_START", "OUT"], ["*i64", "*i64", "*i64", "*i64", "*i32"]))
    expand_sig.update({n: "i64" for n in ["stride_pb", "stride_pt", "stride_ob", "stride_ot"]})
    expand_sig.update(n_q="i32", n_select="i32")
    kw = it.expand_constants(kpool, n_select, True, it.EXPAND_ROWS)
    rows.append((f"expand BLOCK_T={it.EXPAND_ROWS} w4", compile_sm90(it.expand_kernel, expand_sig, kw, 4), 4))
    compress_sig = dict(zip(["K", "G", "APE", "START", "DOC", "DOC_BOUNDS", "OUT"],
                            ["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*i64", "*bf16"]))
    compress_sig.update({n: "i64" for n in ["stride_kb", "stride_ks", "stride_gb", "stride_gs", "stride_ob",
                                             "stride_op"]})
    compress_sig.update(n_pools="i32")
    kw = it.compress_constants(dim, kpool)
    rows.append((f"compress BLOCK_P={kw['BLOCK_P']} w{it.COMPRESS_WARPS}",
                 compile_sm90(it.compress_kernel, compress_sig, kw, it.COMPRESS_WARPS, unaligned=("n_pools",)),
                 it.COMPRESS_WARPS))
    for config in indexer_gluon.GLUON_CONFIGS:
        if heads % config.kwargs["HEAD_GROUP"] == 0:
            rows.append((f"gluon scores {_label(config.kwargs)}",
                         compile_gluon_scores(heads, dim, n_select, config.kwargs), 4))
    return rows


def compile_gluon_sparse_fwd_pair(heads: int, dim: int, config, index_dtype: str = "*i32"):
    """The paired-block sparse MLA forward (:func:`kernels.dsa.sparse_attention_gluon.sparse_mla_fwd_pair_kernel`)
    compiled for sm_90 with ``config`` (``GATHER_ROWS``, ``PRODUCER_REGS``, ``CONSUMER_REGS``), ``heads`` x ``dim``
    bf16 queries and latent (``d_v == dim``); aligned as the launcher specializes."""
    pointers = dict(zip(["Q", "KV", "IDX", "OUT", "LSE"], ["*bf16", "*bf16", index_dtype, "*bf16", "*fp32"]))
    return _compile_gluon_sparse(sparse_attention_gluon.sparse_mla_fwd_pair_kernel, pointers,
                                 ("n_idx", "scale_log2"), heads, dim, config)
