"""The DSA Triton kernels, run by Triton's CPU interpreter at tiny sizes, equal the torch paths.

The interpreter must be chosen before the kernels are defined and has no benchmarker for
the autotuner, so the check runs in a subprocess with ``TRITON_INTERPRET=1`` and one
config per kernel. float32 only (the interpreter computes through numpy, which has no
bfloat16); the bf16 behaviour on an H200 is checked by tests/gpu/dsa_check.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    import kernels.dsa.indexer_triton as it
    import kernels.dsa.sparse_attention_triton as st
    from kernels.dsa.grid import kpool_grid
    from kernels.dsa.indexer import compress_on_grid, expand_selection, torch_pool_topk
    from kernels.dsa.sparse_attention import torch_sparse_mla_bwd, torch_sparse_mla_fwd

    for kernel, cfg in [(it.pool_scores_kernel, dict(BLOCK_M=16, BLOCK_N=32)),
                        (it.select_kernel, dict(CHUNK=64)),
                        (st.sparse_mla_fwd_kernel, dict(BLOCK_H=16, BLOCK_K=16)),
                        (st.sparse_mla_bwd_kernel, dict(BLOCK_H=16, BLOCK_K=16)),
                        (st.sparse_mla_mass_kernel, dict(BLOCK_H=16, BLOCK_K=16))]:
        kernel.configs = [c for c in kernel.configs[:1]]
        kernel.configs[0].kwargs.update(cfg)
    st.RUN_ROWS, st.RUN_CHUNK = 32, 3   # the run pass: 32 (query, head) rows per step, 3 pairs per program
    it.candidate_capacity = lambda n_select: 16   # 16 candidate slots: all-equal scores overflow them
    it.n_columns = lambda n_select: 32  # 32 column groups, 16 per score program: 2 programs along
    it.GROUP_N = 16                      # the pools, each folding 2 pools of a tile into a group
    it.SEGMENT_CHUNK = 4                 # segment maxima compacted 4 at a time: several steps per row

    gen = torch.Generator().manual_seed(0)
    # The interpreter's tl.dot is numpy's float32 matmul, whose accuracy depends on the host's BLAS
    # (seen: a CI host where the sparse MLA forward landed 6e-5 from the float32 torch path, 100x this
    # machine's float32 error). References are float64, and the tolerance scales with the host's
    # measured float32 matmul error relative to the products' magnitudes, never beyond 1e-3 (a kernel
    # bug is an O(1) error).
    probe = torch.Generator().manual_seed(2)
    a, b = (torch.randn(shape, generator=probe, dtype=torch.float64) for shape in ((16, 32), (32, 16)))
    scale = (a.abs() @ b.abs()).max()
    blas_err = max(float((torch.from_numpy(a.float().numpy() @ b.float().numpy()).double() - a @ b).abs().max() / scale),
                   float(((a.float() @ b.float()).double() - a @ b).abs().max() / scale))
    ATOL = max(1e-5, 50 * blas_err)
    assert ATOL <= 1e-3, f"this host's float32 matmul has relative error {blas_err:.1e}: too coarse for these checks"

    def f64(*tensors):
        return [x.double() if x.is_floating_point() else x for x in tensors]

    def close(got, want, what):   # torch.allclose with rtol = atol = ATOL, naming what failed and by how much
        assert got.shape == want.shape, (what, got.shape, want.shape)
        err = (got.double() - want).abs()
        assert bool((err <= ATOL * (1 + want.abs())).all()), (what, float(err.max()), ATOL, blas_err)

    # sparse MLA: 20 heads (two head blocks, masked rows), d_v < Dqk and d_v == Dqk, empty rows
    for d_v in (16, 32):
        q, kv = torch.randn(2, 5, 20, 32, generator=gen), torch.randn(2, 40, 32, generator=gen)
        idx = torch.stack([torch.randperm(40, generator=gen)[:20] for _ in range(10)]).view(2, 5, 20).int()
        idx[0, 1, ::3] = -1
        idx[1, 2] = -1
        out, lse = torch_sparse_mla_fwd(q, kv, idx, 0.3, d_v)   # float32: the backward's inputs
        out64, lse64 = torch_sparse_mla_fwd(*f64(q, kv, idx), 0.3, d_v)
        t_out, t_lse = st.triton_sparse_mla_fwd(q, kv, idx, 0.3, d_v)
        close(t_out, out64, "fwd out")
        assert torch.equal(torch.isinf(t_lse), torch.isinf(lse64))
        close(t_lse[~torch.isinf(lse64)], lse64[~torch.isinf(lse64)], "fwd lse")
        grad = torch.randn(out.shape, generator=gen)
        for name, a, b in zip(("dq", "dkv"), st.triton_sparse_mla_bwd(q, kv, idx, out, lse, grad, 0.3, d_v),
                              torch_sparse_mla_bwd(*f64(q, kv, idx, out, lse, grad), 0.3, d_v)):
            close(a, b, name)
        q64, kv64 = f64(q, kv)
        scores = torch.einsum("bthd,btkd->bthk", q64, kv64[torch.arange(2)[:, None, None], idx.long().clamp_min(0)]) * 0.3
        mass = torch.where(idx[:, :, None] >= 0, torch.exp(scores - lse64[..., None]), 0.0).sum(2).nan_to_num(0.0)
        close(st.triton_sparse_mla_mass(q, kv, idx, lse, 0.3), mass, "mass")
        # the pool mass folded into the forward: pools of 4 slots over the first 16 slots, then all 20
        for n_pools in (4, 5):
            f_out, f_lse, f_mass = st.triton_sparse_mla_fwd(q, kv, idx, 0.3, d_v, pool_mass=(4, n_pools))
            assert torch.equal(f_out, t_out) and torch.equal(f_lse, t_lse)
            want = mass[..., : 4 * n_pools].view(2, 5, n_pools, 4).sum(-1)
            close(f_mass, want, "fwd pool mass")
            # the same from its own pass (after the Gluon forward), 2 queries at a time
            close(st.triton_sparse_mla_pool_mass(q, kv, idx, lse, 0.3, 4, n_pools, block=2), want, "pool mass")
        # rowsum(dO O): 200 rows (the last program partly masked), d_v 16 and 32
        delta = st.triton_sparse_mla_delta(out, grad)
        assert delta.shape == out.shape[:3] and delta.dtype == torch.float32
        assert torch.allclose(delta.double(), torch.einsum("bthv,bthv->bth", out.double(), grad.double()), atol=1e-5)
    # d_v 200: two 128-wide column steps, the second partly masked
    o, g = torch.randn(1, 3, 5, 200, generator=gen), torch.randn(1, 3, 5, 200, generator=gen)
    assert torch.allclose(st.triton_sparse_mla_delta(o, g).double(), (o.double() * g.double()).sum(-1), atol=1e-4)

    # the key-centric dkv pass over runs of 16 (the indexer's k-pool layout): 3 runs + a 5-slot tail per
    # query; runs from two staggered pool grids (rows of different keys overlap), runs shared by many
    # queries (key segments spanning the 3-pair chunks), -1 runs, a reversed run and a run with a hole
    # (not runs: scattered per query), an empty query; 8 heads (4 pairs per 32-row step) and 20 (padded).
    # Tails: on even (b + t) the indexer's own-pool prefix (c consecutive tokens, then -1; one ends at the
    # last key, so the run's 16 rows pass the end of kv), else 5 other tokens in descending order (no run).
    def staggered_indices(batch, n_q, n_keys):
        idx = torch.full((batch, n_q, 53), -1, dtype=torch.int32)
        prefix = torch.zeros(batch, n_q, dtype=torch.bool)
        for b in range(batch):
            for t in range(n_q):
                grid = [0, 16, 32, 48, 64] if (b + t) % 2 else [8, 24, 40, 56]
                starts = [grid[i] for i in torch.randperm(len(grid), generator=gen)[:3].tolist()]
                for r, s0 in enumerate(starts):
                    if (b, t, r) != (1, 3, 2):   # one -1 run
                        idx[b, t, 16 * r:16 * (r + 1)] = torch.arange(s0, s0 + 16)
                rest = set(range(n_keys)) - set(idx[b, t, :48].tolist())
                if (b + t) % 2 == 0:
                    count = 1 + (b + t) % 5
                    s0 = n_keys - count if (b, t) == (0, 2) else max(
                        x for x in rest if all(x + i in rest for i in range(count)) and x + count < n_keys - 1)
                    idx[b, t, 48:48 + count] = torch.arange(s0, s0 + count)
                    prefix[b, t] = True
                else:
                    rest = sorted(rest)
                    pick = sorted((rest[i] for i in torch.randperm(len(rest), generator=gen)[:5].tolist()), reverse=True)
                    idx[b, t, 48:] = torch.tensor(pick)
        idx[0, 0, 16:32] = idx[0, 0, 16:32].flip(0)   # reversed: a permutation, not a run
        idx[0, 1, 5] = -1                                # a hole
        idx[1, 5] = -1                                   # no key at all
        prefix[1, 5] = False
        return idx, prefix

    for heads, d_v in ((8, 32), (20, 16)):
        q, kv = torch.randn(2, 6, heads, 32, generator=gen), torch.randn(2, 80, 32, generator=gen)
        idx, prefix = staggered_indices(2, 6, 80)
        assert (idx[0, 2, 48:] >= 0).sum() == 3 and idx[0, 2, 50] == 79   # the tail at the last key
        out, lse = torch_sparse_mla_fwd(q, kv, idx, 0.3, d_v)
        grad = torch.randn(out.shape, generator=gen)
        ref = torch_sparse_mla_bwd(*f64(q, kv, idx, out, lse, grad), 0.3, d_v)
        run_ok, scatter = st.run_pairs(idx, 16, 80)[:2]
        for a, b in zip(st.run_scan(idx.long(), 16, 80), st.torch_run_scan(idx, 16, 80)):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
        not_run = torch.zeros(2, 6, 4, dtype=torch.bool)
        not_run[0, 0, 1] = not_run[0, 1, 0] = not_run[1, 3, 2] = True
        not_run[1, 5] = True
        not_run[..., 3] = ~prefix
        assert torch.equal(run_ok.bool(), ~not_run), run_ok
        assert torch.equal(run_ok[..., 3].long(), (idx[..., 48:] >= 0).sum(-1) * prefix)   # the tails' lengths
        groups = torch.nn.functional.pad(idx, (0, 11), value=-1).view(2, 6, 4, 16)
        assert torch.equal(scatter.bool(), (not_run & (groups >= 0).any(-1)).any(-1)), scatter   # queries mode 2 reads
        for runs in (16, None):
            for name, a, b in zip(("dq", "dkv"), st.triton_sparse_mla_bwd(q, kv, idx, out, lse, grad, 0.3, d_v, runs), ref):
                close(a, b, (name, heads, runs))

    # the run scan on random slots with planted runs and prefixes: widths not a multiple of the run length,
    # a run length that is not a power of two, fewer slots than one run; int32 and int64 indices
    for dtype in (torch.int32, torch.int64):
        for width, run in ((53, 16), (40, 8), (7, 16), (45, 12)):
            idx = torch.randint(-1, 30, (2, 9, width), generator=gen)
            for t in range(9):
                for r in range(width // run):
                    if (t + r) % 2 == 0:
                        c = run if (t + r) % 4 else 1 + t % run
                        idx[0, t, r * run:(r + 1) * run] = -1
                        idx[0, t, r * run:r * run + c] = torch.arange(3 + t, 3 + t + c)
            idx[1, 4] = -1
            got, want = st.run_scan(idx.to(dtype), run, 40), st.torch_run_scan(idx.to(dtype), run, 40)
            assert (width < run or want[0].bool().any()) and want[1].any() and not want[1].all()
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (dtype, width, run, a, b)

    # every buffer torch.empty gives the indexer is poisoned (finite scores above any real one,
    # out-of-range indices): a read of memory no kernel wrote changes the selection
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(1e30) if t.is_floating_point() else t.fill_(7777)

    def check_indexer(one_block, *variant):
        torch.empty = poisoned_empty
        try:   # 40: 3 query blocks; None (default sizing): one block of 96 queries
            for query_block in (40, None) if one_block else (40,):
                check_indexer_blocks(query_block, *variant)
        finally:
            torch.empty = real_empty

    def check_indexer_blocks(query_block, *variant):
        # indexer: random scores, packed documents, and all-equal scores (the overflow path; with one
        # block the overflowing rows' tiles beyond the pools their query tile sees are not written)
        gen = torch.Generator().manual_seed(1)
        n, kpool, n_select = 96, 4, 3
        q, w = torch.randn(1, n, 2, 16, generator=gen), torch.randn(1, n, 2, generator=gen)
        k, g, ape = torch.randn(1, n, 16, generator=gen), torch.randn(1, n, 16, generator=gen), torch.randn(kpool, 16, generator=gen)
        for cu, queries, kpool in [(None, q, 4), (torch.tensor([0, 30, 96]), q, 4), (None, torch.zeros_like(q), 4),
                                   (torch.tensor([0, 10, 96]), q, 1)]:   # 96 pools: 2 tiles per program
            ape = torch.randn(kpool, 16, generator=gen)
            grid = kpool_grid(n, kpool, cu)
            keys = compress_on_grid(k, g, ape, grid)
            got = it.triton_pool_topk(queries, keys, w, grid, n_select, 0.25, 0, query_block=query_block)
            ref = torch_pool_topk(queries, keys, w, grid, n_select, 0.25, 0, 32)
            assert torch.equal(got, ref), (variant, (got != ref).nonzero())
        # one high-index pool above a tie of every other pool at 0: the tie overflows the slots
        # and the kernel's exact pass must still put pool 40 first
        grid = kpool_grid(n, 2)
        keys = torch.zeros(1, 48, 16)
        keys[0, 40] = 1.0
        ones, w_pos = torch.ones_like(q), w.abs() + 0.1
        got = it.triton_pool_topk(ones, keys, w_pos, grid, n_select, 0.25, 0, query_block=query_block)
        assert torch.equal(got, torch_pool_topk(ones, keys, w_pos, grid, n_select, 0.25, 0, 32))
        assert got[0, -1].tolist() == [40, 0, 1], got[0, -1]
        # 32 pools above a tie of all others, in two column groups (pools p = 0, 1 mod 16 of every
        # other 32-pool tile: the score kernel's groups 0 and 1, the selection's 0 and 16): the bound
        # is the tie and the slots overflow; the exact pass must climb from the bound to the third
        # score, or it keeps 32 candidates for 16 slots. 8 queries (CP offset 504), 512 one-token pools
        grid = kpool_grid(512, 1)
        keys = torch.ones(1, 512, 16)
        top = torch.tensor([p for p in range(512) if p % 64 < 32 and p % 16 < 2])
        keys[0, top] = torch.linspace(2.0, 9.0, len(top))[:, None]   # the best last
        got = it.triton_pool_topk(ones[:, :8], keys, w_pos[:, :8], grid, n_select, 0.25, 504, query_block=query_block)
        assert torch.equal(got, torch_pool_topk(ones[:, :8], keys, w_pos[:, :8], grid, n_select, 0.25, 504, 32))
        assert got[0, -1].tolist() == top.flip(0)[:3].tolist(), got[0, -1]
        # 10 keys: the block sees 2 pools, fewer than n_select, and its first 3 queries none: the
        # selection writes 2 entries per row, the rest must be -1 (removing the fill fails here)
        grid, ape4 = kpool_grid(10, 4), torch.randn(4, 16, generator=gen)
        keys = compress_on_grid(k[:, :10], g[:, :10], ape4, grid)
        got = it.triton_pool_topk(q[:, :10], keys, w[:, :10], grid, n_select, 0.25, 0, query_block=query_block)
        assert torch.equal(got, torch_pool_topk(q[:, :10], keys, w[:, :10], grid, n_select, 0.25, 0, 32)), got
        # context-parallel call: the last 46 queries against all 96 keys, packed documents
        kpool, ape = 4, torch.randn(4, 16, generator=gen)
        grid = kpool_grid(n, kpool, torch.tensor([0, 30, 96]))
        keys = compress_on_grid(k, g, ape, grid)
        got = it.triton_pool_topk(q[:, 50:], keys, w[:, 50:], grid, n_select, 0.25, 50, query_block=query_block)
        assert torch.equal(got, torch_pool_topk(q[:, 50:], keys, w[:, 50:], grid, n_select, 0.25, 50, 32)), variant

    # expansion of pool indices to token indices (and tails), one kernel against the torch path:
    # packed documents, a kpool that is not a power of two, unselected pools, a CP query offset
    for kpool, tail, q_off in [(4, True, 0), (3, True, 20), (4, False, 0)]:
        grid = kpool_grid(96, kpool, torch.tensor([0, 30, 96]))
        n_pools = int(grid.start.numel())
        pools = torch.randint(-1, n_pools, (1, 96 - q_off, 5), generator=gen)
        got = it.triton_expand_selection(pools, grid, 96 - q_off, q_off, 5 * kpool, tail, block_t=4)
        assert torch.equal(got, expand_selection(pools, grid, 96 - q_off, q_off, 5 * kpool, tail)), (kpool, tail)

    # k-pool compression, one kernel against the torch path (float64 reference): packed documents
    # whose last pools are incomplete, a kpool and an index dim that are not powers of two, batch 2
    for batch, n, kpool, dim, cu in [(1, 96, 4, 16, torch.tensor([0, 30, 31, 96])), (2, 50, 3, 12, None)]:
        k, g = torch.randn(batch, n, dim, generator=gen), 3 * torch.randn(batch, n, dim, generator=gen)
        ape = torch.randn(kpool, dim, generator=gen)
        grid = kpool_grid(n, kpool, cu)
        got = it.triton_kpool_compress(k, g, ape, grid)
        ref = compress_on_grid(k.double(), g.double(), ape.double(), grid)
        assert got.dtype == torch.float32 and got.shape == ref.shape, (got.dtype, got.shape)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6), (got.double() - ref).abs().max()

    score_cfg, select_cfg = it.pool_scores_kernel.configs[0].kwargs, it.select_kernel.configs[0].kwargs
    # paired head products (PAIR) or one head at a time; the selection reading whole rows or only the
    # segments (of 8 or 32 pools: 4 or 1 per 32-pool tile) whose maximum reaches its bound, in every query
    # block or in those that see at least 16 pools (the 40-query blocks see 10-24); the bound's bisection
    # stopping early (slack 0 and 2) or taking no step (40 exceeds the 32 columns, as the default 32 does at
    # these sizes); pipelined or plain row loops (one block of every query as well, read by segments)
    for one_block, pair, segment, min_pools, slack, stages in [
            (True, True, 8, 0, 0, 2),
            (False, False, 0, 0, 2, 1),
            (False, False, 32, 0, 2, 2),
            (False, True, 8, 16, 40, 1)]:
        it.SEGMENT, it.SEGMENT_MIN_POOLS, it.BOUND_SLACK = segment, min_pools, slack
        score_cfg.update(PAIR=pair)
        select_cfg.update(LOOP_STAGES=stages)
        check_indexer(one_block, pair, segment, min_pools, slack, stages)
    print("TRITON_INTERPRETER_OK")
    """
)


def run_interpreted(script: str) -> None:
    """Run ``script`` in a subprocess under Triton's interpreter; it prints TRITON_INTERPRETER_OK when its checks pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "TRITON_INTERPRETER_OK" in result.stdout, result.stderr[-3000:]


def test_triton_kernels_under_the_interpreter_equal_the_torch_paths():
    run_interpreted(SCRIPT)


KL_SCRIPT = textwrap.dedent(
    """
    import torch
    import kernels.dsa.loss_triton as lt
    from kernels.dsa.loss import _block_kl
    from kernels.dsa.loss_triton import triton_indexer_kl

    gen = torch.Generator().manual_seed(1)
    # 20 indexer heads (masked rows of a 32-row block), dim 40 (two 32-column or three 16-column steps, the last
    # partly masked) and 6 selected pools (not powers of two),
    # batch 2, unselected pools, a row without any, a target of zeros on a row that has pools
    batch, n_q, heads, dim, n_pools, n_sel = 2, 7, 20, 40, 30, 6
    q = torch.randn(batch, n_q + 2, heads, dim, generator=gen)[:, 1:-1]       # strided along t
    w = torch.randn(batch, n_q, heads, generator=gen) * heads**-0.5
    keys = torch.randn(batch, n_pools, dim, generator=gen)
    row = torch.randint(0, n_pools, (batch, n_q, n_sel), generator=gen)
    ok = torch.rand(batch, n_q, n_sel, generator=gen) > 0.25
    ok[0, 3] = False
    target = torch.rand(batch, n_q, n_sel, generator=gen).masked_fill(~ok, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    target[1, 2] = 0.0
    grad = torch.randn(batch, n_q, generator=gen)

    def kl_and_grads(fn):
        leaves = [x.clone().requires_grad_() for x in (q, w, keys)]
        kl = fn(leaves[0], leaves[1], leaves[2], row, ok, target, 0.37)
        kl.backward(grad)
        return [kl.detach()] + [x.grad for x in leaves]

    want = kl_and_grads(_block_kl)
    for cfg in lt.KL_CONFIGS:   # each autotuned configuration alone: the interpreter has no benchmarker
        lt.indexer_kl_kernel.configs = [cfg]
        got = kl_and_grads(triton_indexer_kl)
        for name, a, b in zip(("kl", "dq", "dw", "dkeys"), want, got):
            assert torch.isfinite(b).all() and torch.isfinite(a).all(), name
            assert torch.allclose(b, a, rtol=1e-5, atol=1e-5), (cfg, name, (a - b).abs().max())
        assert got[1][0, 3].abs().max() == 0 and got[0][0, 3] == 0   # no selected pool
    print("TRITON_INTERPRETER_OK")
    """
)


def test_fused_indexer_kl_under_the_interpreter_equals_the_torch_path():
    run_interpreted(KL_SCRIPT)
