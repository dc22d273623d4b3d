"""The sparse MLA latent gradient's float32 row adds alone, two ways: vector atomics from the SM in 128-byte lines
(a blocked layout with the requests of the ``lines`` entry of :data:`kernels.dsa.sparse_attention_gluon.ATOMIC_LAYOUTS`:
4 rows x 128 bytes per warp instruction) against Hopper's TMA bulk
reduction (``cp.reduce.async.bulk.tensor ... .add.f32``: the rows are staged in shared memory and the TMA unit
adds them in L2).

The Gluon latent gradient (:func:`kernels.dsa.sparse_attention_gluon.sparse_mla_dkv_gluon_kernel`) adds one
``[64, D]`` float32 block per 64 selected keys of each query, 258 GB at the ``full`` shape and 64k tokens. On
``n`` of 132 SMs it takes ``132 / n`` times as long, so its atomics are bound by what each SM issues, not by L2
(``tests/benchmarks/sparse_mla_sm_share.py``). The TMA unit issues its own requests, a whole row segment per
instruction; whether that carries the same adds faster is what this measures before the kernel is changed.

Both kernels are persistent (one program per SM, like the latent gradient's one CTA per SM) and walk the same
queries' selections (``dsa_bench.pool_indices``, ``window`` layout): the same rows, the same number of adds.
Each adds 1.0 per selected key and column, so ``dkv`` must equal each key's selection count (exact in float32):
a kernel that adds a row twice or misses one fails the check.

    python tests/benchmarks/sparse_mla_atomics.py --seq-len 65536 --out $OUT/atomics.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon.language import _core as gl_core
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dsa_bench import ceilings, pool_indices, timed  # noqa: E402

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gl_core.builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``cp.reduce.async.bulk.tensor`` add of the shared-memory tile ``src`` into ``tensor_desc`` at ``coord``
    (Triton's ``ttng.async_tma_reduce``, which Gluon 3.6 has no wrapper for); completes like a TMA store
    (:func:`tma.store_wait`)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def red_lines_kernel(IDX, DKV, n_q, n_idx, stride_it, D: gl.constexpr, BLOCK_K: gl.constexpr):
    """Programs ``pid, pid + P, ...`` of the queries: each 64-key block's ``[BLOCK_K, D]`` float32 ones added to
    ``DKV`` rows ``IDX[t, block]`` with relaxed vector atomics (``atom.global.gpu.relaxed.add.v4.f32`` in the
    PTX), 8 lanes per 128-byte line of a row, 4 rows per warp instruction."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ones = gl.full([BLOCK_K, D], 1.0, gl.float32, layout)
    for t in range(gl.program_id(0), n_q, gl.num_programs(0)):
        row_idx = IDX + t.to(gl.int64) * stride_it
        for j in range(gl.cdiv(n_idx, BLOCK_K)):
            k = j * BLOCK_K + offs_k
            rows = gl.load(row_idx + k, mask=k < n_idx, other=-1).to(gl.int64)
            gl.atomic_add(DKV + rows[:, None] * D + offs_d[None, :], ones, mask=(rows >= 0)[:, None], sem="relaxed")


@gluon.jit
def tma_reduce_kernel(IDX, DKV, n_q, n_idx, stride_it, n_keys, D: gl.constexpr, BLOCK_K: gl.constexpr,
                      CHUNK: gl.constexpr, BOX: gl.constexpr):
    """The same adds through a ``[BLOCK_K, CHUNK]`` float32 staging tile: per block and ``CHUNK`` columns, the
    tile is written from registers (as the latent gradient's ``wgmma`` result would be), then one TMA reduction
    of ``[1, BOX]`` per valid row and ``BOX`` columns; the tile is rewritten only after the TMA has read it."""
    smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = tma.make_tensor_descriptor(DKV, shape=[n_keys, D], strides=[D, 1], block_shape=[1, BOX], layout=smem_l)
    stage = gl.allocate_shared_memory(gl.float32, [BLOCK_K, CHUNK], smem_l)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    ones = gl.full([BLOCK_K, CHUNK], 1.0, gl.float32, layout)
    for t in range(gl.program_id(0), n_q, gl.num_programs(0)):
        row_idx = IDX + t.to(gl.int64) * stride_it
        for j in range(gl.cdiv(n_idx, BLOCK_K)):
            for c in gl.static_range(D // CHUNK):
                tma.store_wait(0)
                _cta_barrier()   # the previous chunk's reductions have read the tile
                stage.store(ones)
                fence_async_shared()
                _cta_barrier()
                for r in gl.static_range(BLOCK_K):
                    k = j * BLOCK_K + r
                    row = gl.load(row_idx + k, mask=k < n_idx, other=-1)
                    if row >= 0:
                        for b in gl.static_range(CHUNK // BOX):
                            tma_reduce_add(desc, [row, c * CHUNK + b * BOX],
                                           stage.slice(r, 1).slice(b * BOX, BOX, dim=1))
    tma.store_wait(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tma", nargs="*", default=["512,256", "128,128", "64,64"],
                    help="CHUNK,BOX pairs of the TMA kernel: staging columns per round, columns per reduction")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

    ceil = ceilings()
    n = args.seq_len
    idx = pool_indices(n, n)[0].contiguous()
    n_idx = idx.shape[1]
    valid = idx[idx >= 0].long()
    expect = torch.bincount(valid, minlength=n).float()[:, None].expand(n, args.dim)
    adds_gb = valid.numel() * args.dim * 4 / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dkv = torch.zeros(n, args.dim, dtype=torch.float32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: matmul {ceil['matmul_tflops']:.0f} TF/s, copy {ceil['copy_tbps']:.2f} TB/s; "
          f"{n} queries x {n_idx} slots, {valid.numel() / n:.1f} valid per query: {adds_gb:.1f} GB of float32 adds",
          flush=True)

    variants = [("red.global, 128-byte lines", lambda: red_lines_kernel[(sms,)](
        idx, dkv, n, n_idx, idx.stride(0), D=args.dim, BLOCK_K=64, num_warps=8))]
    for pair in args.tma:
        chunk, box = (int(v) for v in pair.split(","))
        variants.append((f"TMA reduce, {chunk}-column tile, [1, {box}] per row", lambda chunk=chunk, box=box:
                         tma_reduce_kernel[(sms,)](idx, dkv, n, n_idx, idx.stride(0), n, D=args.dim, BLOCK_K=64,
                                                   CHUNK=chunk, BOX=box, num_warps=8)))
    rows = []
    print(f"| adds | ms | GB/s of adds | per SM GB/s | exact |\n|---|---|---|---|---|", flush=True)
    for name, fn in variants:
        row = dict(variant=name)
        try:
            dkv.zero_()
            fn()
            torch.cuda.synchronize()
            row["exact"] = bool(torch.equal(dkv, expect))
            row["s"], _ = timed(fn, args.reps)
            row["gbps"] = adds_gb / row["s"]
            print(f"| {name} | {row['s'] * 1e3:.1f} | {row['gbps']:.0f} | {row['gbps'] / sms:.1f} | {row['exact']} |",
                  flush=True)
        except Exception as exc:   # one variant that fails to compile leaves the others' rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"| {name} | failed: {row['error']} |", flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), ceilings=ceil, seq_len=n, adds_gb=adds_gb, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
