"""The Gluon kernels compiled for sm_90 on the CPU: the lightning indexer's score kernel (kernels/dsa/indexer_gluon.py)
and the warp-specialized sparse MLA forward and latent gradient (kernels/dsa/sparse_attention_gluon.py).

No GPU is needed: Triton's front end and its bundled ptxas run here (:mod:`kernels.dsa.sm90`).
What this guards is each kernel's reason to exist. The score kernel overlaps each head's ``wgmma`` with the
previous head's accumulation: the PTX must wait with one product still in flight (``wgmma.wait_group 1``), and
ptxas must not serialize the ``wgmma`` instructions (its C7510-C7519 warnings: an in-flight accumulator copied
across the loop's back edge, or too many products live at once). The sparse MLA kernels must fit an SM, gather
asynchronously and hand registers to their consumers. Their numbers are checked on an H200 by
tests/gpu/dsa_check.py, tests/gpu/gluon_smoke.py and tests/benchmarks/dsa_bench.py / sparse_mla_tilings.py.
"""

from __future__ import annotations

import importlib.util
import os
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


@pytest.mark.parametrize("config", range(3))
def test_gluon_sparse_forward_gathers_async_and_overlaps_the_products(config):
    """The warp-specialized sparse MLA forward (kernels/dsa/sparse_attention_gluon.py) at the ``full`` shape, 64
    heads x 512: it fits one CTA per SM, gathers with 16-byte ``cp.async`` signalled by every producer thread
    (``.noinc``: the barriers count 128 arrivals), hands registers from the producer to the consumers
    (``setmaxnreg``), issues ``Q K^T`` while ``P V`` is in flight (a ``wgmma`` wait that leaves one group) and ptxas
    serializes no ``wgmma``."""
    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_fwd
    from kernels.dsa.sparse_attention_gluon import GLUON_FWD_CONFIGS

    cfg = GLUON_FWD_CONFIGS[config]
    block_k, stages = cfg.kwargs["BLOCK_K"], cfg.kwargs["STAGES"]
    compiled = compile_gluon_sparse_fwd(64, 512, cfg)
    ptx = compiled.asm["ptx"]
    expected_smem = (64 * 512 + stages * block_k * 512 + 64 * block_k) * 2
    assert expected_smem <= compiled.metadata.shared <= SM_SHARED
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]+\], \[[^]]+\], (0x[0-9a-f]+|\d+)", ptx)
    assert copies and all(int(size, 0) == 16 for size in copies), set(copies)
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 2   # the query tile, a key block
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+", ptx) and "setmaxnreg.inc" in ptx
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    assert "1" in waits, waits
    # Q K^T over K = 512 in steps of 16 at two issue sites (block 0, then each next block); P V over BLOCK_K
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * 512 // 16 + block_k // 16
    report = ptxas_report(compiled)
    assert not re.search(r"C75[01]\d", report), report


@pytest.mark.parametrize("config", range(2))
def test_gluon_sparse_forward_in_pairs_gives_each_warpgroup_its_own_block(config):
    """The paired-block forward (``schedule="pair"``) at the ``full`` shape, 64 heads x 512: it fits one CTA per
    SM (``q``, four half blocks and two ``P`` tiles), each consumer warpgroup runs ``Q K^T`` over a whole 64-key
    block (``m64n64k16``, K = 512 in steps of 16, at three issue sites: the first warpgroup's first block and
    next blocks, the second's) and ``P V`` over its half of ``d_v`` (``m64n256k16``, two per warpgroup and pair,
    the own block's ``P`` from registers), the producer gathers with 16-byte ``cp.async`` (one signal per half
    block, one for the query tile), and ptxas serializes no ``wgmma``."""
    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_fwd_pair
    from kernels.dsa.sparse_attention_gluon import GLUON_FWD_PAIR_CONFIGS

    compiled = compile_gluon_sparse_fwd_pair(64, 512, GLUON_FWD_PAIR_CONFIGS[config])
    ptx = compiled.asm["ptx"]
    expected_smem = (64 * 512 + 4 * 64 * 256 + 2 * 64 * 64) * 2
    assert expected_smem <= compiled.metadata.shared <= SM_SHARED
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]+\], \[[^]]+\], (0x[0-9a-f]+|\d+)", ptx)
    assert copies and all(int(size, 0) == 16 for size in copies), set(copies)
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 1 + 4
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", ptx)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16 [^;]*;", ptx)
    assert len(qk) == 3 * 512 // 16
    assert len(pv) == 2 * 2 * 64 // 16
    # the own block's P from registers: a register-A wgmma names its A fragment as four 32-bit registers
    from_registers = [w for w in pv if re.search(r"\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+,", w)]
    assert len(from_registers) == len(pv) // 2, [w[-90:] for w in pv]
    report = ptxas_report(compiled)
    assert not re.search(r"C75[01]\d", report), report


@pytest.mark.parametrize("atomics", [True, False])
def test_gluon_sparse_dkv_holds_q_and_do_once(atomics):
    """The sparse MLA latent-gradient kernel at 64 heads x 512: ``q`` and ``dO`` one copy each in shared memory
    (64 KiB apiece, read by ``wgmma`` in both major orders), one 64-key latent buffer and the ``P^T`` / ``dS^T``
    tiles: it fits one CTA per SM, where Triton's per-query backward needs 256-352 KiB at 64 heads. Per key block,
    ``Q K^T`` and ``dO V^T`` over K = 512 and ``dS^T q`` and ``P^T dO`` over the 64 heads; vector float32 atomics.
    The benchmarks' ``ATOMICS=False`` build is the same kernel (same products, same atomics, predicated off)."""
    import triton

    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_dkv
    from kernels.dsa.sparse_attention_gluon import GLUON_DKV_CONFIGS

    cfg = GLUON_DKV_CONFIGS[0]
    compiled = compile_gluon_sparse_dkv(64, 512, triton.Config(dict(cfg.kwargs, ATOMICS=atomics),
                                                               num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
    ptx = compiled.asm["ptx"]
    expected_smem = (2 * 64 * 512 + 64 * 512 + 2 * 64 * 64) * 2
    assert expected_smem <= compiled.metadata.shared <= SM_SHARED
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * 512 // 16 + 2 * 64 // 16
    atomics = re.findall(r"\b(?:red|atom)\.global\.[\w.]*add\.(v[24])\.f32", ptx)
    assert atomics and len(atomics) == len(re.findall(r"\b(?:red|atom)\.global", ptx)), atomics[:4]
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 2
    report = ptxas_report(compiled)
    assert not re.search(r"C75[01]\d", report), report


@pytest.mark.parametrize("layout", ["v4", "halves", "lines"])
def test_gluon_sparse_dkv_atomic_layouts_widen_the_atomics(layout):
    """The latent gradient's other atomic layouts (``ATOMIC_LAYOUTS``): the same 64 x 512 float32 adds per key
    block in half as many ``red.v4.f32`` instructions (16 bytes per thread) instead of ``v2``; ``v4`` and
    ``halves`` trade values between lanes through shuffles (no shared memory), ``lines`` through shared memory
    that still fits one CTA per SM; none spills more than the ``fragments`` build."""
    import triton

    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_dkv, resources
    from kernels.dsa.sparse_attention_gluon import ATOMIC_LAYOUTS, GLUON_DKV_CONFIGS

    cfg = GLUON_DKV_CONFIGS[0]
    builds = {}
    for name in ("fragments", layout):
        config = triton.Config(dict(cfg.kwargs, ATOMIC_LAYOUT=ATOMIC_LAYOUTS.index(name)), num_warps=cfg.num_warps,
                               maxnreg=cfg.maxnreg)
        builds[name] = compile_gluon_sparse_dkv(64, 512, config)
    base, wide = builds["fragments"], builds[layout]
    count = lambda c, v: len(re.findall(rf"\b(?:red|atom)\.global\.[\w.]*add\.{v}\.f32", c.asm["ptx"]))
    # each consumer thread's share of one block: 64 x 512 floats over 256 threads
    assert 2 * count(base, "v2") == 64 * 512 // 256 == 4 * count(wide, "v4")
    assert count(wide, "v2") == 0
    shuffles = len(re.findall(r"\bshfl\.sync", wide.asm["ptx"])) - len(re.findall(r"\bshfl\.sync", base.asm["ptx"]))
    if layout in ("v4", "halves"):
        assert shuffles > 0 and wide.metadata.shared == base.metadata.shared
    else:
        assert shuffles == 0 and base.metadata.shared < wide.metadata.shared <= SM_SHARED
    # Triton 3.6 (the device's) spills none of the three; newer ptxas spills the same few live values in each
    assert resources(wide, cfg.num_warps)["stack_bytes"] <= resources(base, cfg.num_warps)["stack_bytes"] + 32


@pytest.mark.parametrize("pieces,ahead", [(2, False), (4, False), (2, True), (4, True)])
def test_gluon_sparse_dkv_column_pieces_issue_products_before_the_atomics(pieces, ahead):
    """The latent gradient in column pieces (``PIECES``): the same 64 x 512 float32 adds per key block (as many
    ``v4`` atomics as the one-piece build) and the same shared memory, the gradient products in ``wgmma`` of N =
    512 / pieces / 2 per warpgroup. Each piece's products are issued before the previous piece's are awaited
    (``wgmma.wait_group 2``: the next piece's two groups stay in flight under the atomics); with ``SCORES_AHEAD``
    the next block's ``Q K^T`` and ``dO V^T`` too, before the last piece's atomics."""
    import triton

    from kernels.dsa.sm90 import compile_gluon_sparse_dkv
    from kernels.dsa.sparse_attention_gluon import GLUON_DKV_CONFIGS

    cfg = GLUON_DKV_CONFIGS[0]
    build = lambda **kw: compile_gluon_sparse_dkv(64, 512, triton.Config(dict(cfg.kwargs, **kw),
                                                                         num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
    one, split = build(), build(PIECES=pieces, SCORES_AHEAD=ahead)
    count = lambda c, pattern: len(re.findall(pattern, c.asm["ptx"]))
    v4 = r"\b(?:red|atom)\.global\.[\w.]*add\.v4\.f32"
    assert count(split, v4) == count(one, v4) == 64 * 512 // 256 // 4
    assert split.metadata.shared == one.metadata.shared
    n = 512 // pieces // 2
    # per block, 2 products over the 64 heads (K = 64: 4 wgmma each) per piece, all in N = n instructions
    assert count(split, rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16") == 2 * 4 * pieces
    waits = count(split, r"wgmma\.wait_group\.sync\.aligned 2\b")
    assert waits == pieces - 1 + ahead, waits
    assert not re.search(r"C75[01]\d", ptxas_report(split))


def test_gluon_sparse_dkv_atomics_partition_takes_the_atomics_off_the_consumers():
    """The latent gradient with its atomics in a partition of their own (``ATOMIC_WARPS=4``): the consumers issue
    no atomics and stage each of the 8 ``[64, 64]`` float32 pieces of a key block in 16 KiB of shared memory; the
    atomics warpgroup adds a block's 64 x 512 floats in ``v4`` atomics, 128 threads' share each; 16 warps fit
    the SM's registers at launch (128 each) and ``setmaxnreg`` moves them to the consumers."""
    import triton

    from kernels.dsa.sm90 import SM_REGISTERS, SM_SHARED, compile_gluon_sparse_dkv, ptxas_report
    from kernels.dsa.sparse_attention_gluon import DKV_STAGED_PIECES, GLUON_DKV_STAGED_CONFIG

    cfg = GLUON_DKV_STAGED_CONFIG
    kw = dict(cfg.kwargs, PIECES=DKV_STAGED_PIECES, SCORES_AHEAD=True, ATOMIC_WARPS=4)
    compiled = compile_gluon_sparse_dkv(64, 512, triton.Config(kw, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
    ptx = compiled.asm["ptx"]
    assert re.search(r"\.reqntid 512\b", ptx) and 16 * 32 * cfg.maxnreg <= SM_REGISTERS
    expected_smem = (2 * 64 * 512 + 64 * 512 + 2 * 64 * 64) * 2 + 64 * 64 * 4
    assert expected_smem <= compiled.metadata.shared <= SM_SHARED
    atomics = re.findall(r"\b(?:red|atom)\.global\.[\w.]*add\.(v[24])\.f32", ptx)
    assert atomics == ["v4"] * (64 * 512 // 128 // 4), atomics[:4]
    regs = [int(r) for r in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)]
    assert cfg.kwargs["PRODUCER_REGS"] in regs and cfg.kwargs["ATOMIC_REGS"] in regs
    consumers = (16 * cfg.maxnreg - 4 * cfg.kwargs["PRODUCER_REGS"] - 4 * cfg.kwargs["ATOMIC_REGS"]) // 8 // 8 * 8
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{consumers}\b", ptx)
    # S and dP over K = 512 (issued before the loop and inside it), then 2 products over the 64 heads per piece:
    # all in N = 32 per warpgroup (a 64-key block's scores, a 64-column piece)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)
    assert wgmma == ["32"] * (2 * 2 * 512 // 16 + 2 * 4 * DKV_STAGED_PIECES), len(wgmma)
    assert not re.search(r"C75[01]\d", ptxas_report(compiled))


def test_gluon_sparse_dq_gathers_q_do_and_a_two_deep_ring():
    """The sparse MLA query-gradient kernel at 64 heads x 512: ``q`` and ``dO`` once each, two 32-key latent
    buffers and the ``dS`` tile in shared memory (one CTA per SM); per key block ``Q K^T`` and ``dO V^T`` over
    K = 512 and ``dS K`` over the block's 32 keys; ``cp.async`` signalled with ``.noinc`` for the query tile and
    the ring; no serialized ``wgmma``."""
    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_dq
    from kernels.dsa.sparse_attention_gluon import GLUON_DQ_CONFIGS

    for cfg in GLUON_DQ_CONFIGS:
        compiled = compile_gluon_sparse_dq(64, 512, cfg, schedule="keys")
        ptx = compiled.asm["ptx"]
        block_k = cfg.kwargs["BLOCK_K"]
        expected_smem = (2 * 64 * 512 + cfg.kwargs["STAGES"] * block_k * 512 + 64 * block_k) * 2
        assert expected_smem <= compiled.metadata.shared <= SM_SHARED
        # S and dP of the first block before the loop and of the next block inside it, then dS K
        assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * (2 * 512 // 16) + block_k // 16
        assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 2
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+", ptx) and "setmaxnreg.inc" in ptx
        report = ptxas_report(compiled)
        assert not re.search(r"C75[01]\d", report), report


def test_gluon_sparse_dq_products_schedule_gives_each_warpgroup_one_score_product():
    """The ``"products"`` query gradient at 64 heads x 512: one warpgroup runs ``Q K^T``, the other ``dO V^T``,
    each over the whole 32-key block (32 ``wgmma`` over K = 512 each, once in its own partition), each ``dS K``
    over half of ``D``; ``P`` (float32) and ``dS`` double-buffered in shared memory beside ``q``, ``dO`` and the
    two-deep ring, one CTA per SM; no serialized ``wgmma``, and no more spills than the ``"keys"`` schedule's
    kernel."""
    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_dq, resources
    from kernels.dsa.sparse_attention_gluon import GLUON_DQ_CONFIGS, GLUON_DQ_SPLIT_CONFIGS

    keys = compile_gluon_sparse_dq(64, 512, GLUON_DQ_CONFIGS[0], schedule="keys")
    for cfg in GLUON_DQ_SPLIT_CONFIGS:
        compiled = compile_gluon_sparse_dq(64, 512, cfg, schedule="products")
        ptx = compiled.asm["ptx"]
        block_k, stages = cfg.kwargs["BLOCK_K"], cfg.kwargs["STAGES"]
        expected_smem = 2 * 64 * 512 * 2 + stages * block_k * 512 * 2 + 2 * 64 * block_k * (4 + 2)
        assert expected_smem <= compiled.metadata.shared <= SM_SHARED
        assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * (512 // 16) + 2 * (block_k // 16)
        # the producer's query tile and ring, once each
        assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)) == 2
        report = ptxas_report(compiled)
        assert not re.search(r"C75[01]\d", report), report
        assert resources(compiled, 12)["stack_bytes"] <= resources(keys, 12)["stack_bytes"]


def test_ring_forward_sums_its_denominator_without_a_per_block_reduction():
    """The ring forward with ``ROW_SUM_AT_END`` (the default) keeps the softmax denominator per element and sums it
    once after the loop: its PTX has fewer thread barriers than the same configuration summing per block (each
    reduction across the two warpgroups goes through shared memory between barriers), and the same products."""
    import triton

    from kernels.dsa.sm90 import compile_gluon_sparse_fwd
    from kernels.dsa.sparse_attention_gluon import GLUON_FWD_CONFIGS

    cfg = GLUON_FWD_CONFIGS[0]
    builds = {at_end: compile_gluon_sparse_fwd(64, 512, triton.Config(dict(cfg.kwargs, ROW_SUM_AT_END=at_end),
                                                                      num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
              for at_end in (True, False)}
    count = {k: {op: len(re.findall(op, b.asm["ptx"])) for op in (r"bar\.sync", r"wgmma\.mma_async")}
             for k, b in builds.items()}
    assert count[True][r"bar\.sync"] < count[False][r"bar\.sync"], count
    assert count[True][r"wgmma\.mma_async"] == count[False][r"wgmma\.mma_async"], count


def test_sm_share_occupier_leaves_no_room_for_the_sparse_mla_kernels():
    """``tests/benchmarks/sparse_mla_sm_share.py`` holds SMs with one ``occupy_kernel`` CTA each: its shared memory
    plus the smallest Gluon sparse MLA kernel's (the query gradient's) exceeds an SM's, so none of their CTAs runs
    on a held SM; and it polls its release flag with a volatile load (a cached load would spin forever)."""
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    path = os.path.join(os.path.dirname(__file__), "benchmarks", "sparse_mla_sm_share.py")
    spec = importlib.util.spec_from_file_location("sparse_mla_sm_share", path)
    share = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(share)
    from kernels.dsa.sm90 import SM_SHARED, TARGET, compile_gluon_sparse_dq
    from kernels.dsa.sparse_attention_gluon import GLUON_DQ_CONFIGS

    src = GluonASTSource(fn=share.occupy_kernel, signature={"FLAG": "*i32", "OUT": "*i32", "ROWS": "constexpr"},
                         constexprs={"ROWS": share.OCCUPY_ROWS})
    occupier = triton.compile(src, target=TARGET, options=dict(num_warps=4))
    smallest = min(compile_gluon_sparse_dq(64, 512, cfg, schedule="keys").metadata.shared for cfg in GLUON_DQ_CONFIGS)
    assert 2 * occupier.metadata.shared > SM_SHARED   # one occupier per SM
    assert occupier.metadata.shared + smallest > SM_SHARED
    assert re.search(r"ld\.volatile\.global", occupier.asm["ptx"])



def test_ring_forward_runs_its_softmax_under_p_v():
    """``SOFTMAX_UNDER_PV`` (:func:`kernels.dsa.sparse_attention_gluon._consumer_under_pv`): the exponentials of
    the softmax come between the ``wgmma`` wait that leaves one group in flight (``P V``) and the wait for it, where
    the default consumer has none; ``P`` takes two buffers; the same ``Q K^T`` products, with no block's scores
    recomputed (one ``P V`` more issue site, for the last block), and no more spills than the default consumer."""
    import triton

    from kernels.dsa.sm90 import SM_SHARED, compile_gluon_sparse_fwd, resources
    from kernels.dsa.sparse_attention_gluon import GLUON_FWD_UNDER_PV

    def exps_with_one_group_in_flight(ptx: str) -> int:
        body = ptx.split("wgmma.wait_group.sync.aligned 1;", 1)[1].split("wgmma.wait_group.sync.aligned 0;", 1)[0]
        return len(re.findall(r"ex2\.approx", body))

    cfg = GLUON_FWD_UNDER_PV[0]
    block_k = cfg.kwargs["BLOCK_K"]
    plain = compile_gluon_sparse_fwd(64, 512, triton.Config(dict(cfg.kwargs, SOFTMAX_UNDER_PV=False),
                                                            num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
    under = compile_gluon_sparse_fwd(64, 512, cfg)
    assert exps_with_one_group_in_flight(plain.asm["ptx"]) == 0
    # each thread's share of a [64, BLOCK_K] tile over 8 warps
    assert exps_with_one_group_in_flight(under.asm["ptx"]) >= 64 * block_k // 256
    assert under.metadata.shared - plain.metadata.shared == 64 * block_k * 2
    assert under.metadata.shared <= SM_SHARED
    wgmma = {k: len(re.findall(r"wgmma\.mma_async", b.asm["ptx"])) for k, b in (("plain", plain), ("under", under))}
    assert wgmma["plain"] == 2 * 512 // 16 + block_k // 16, wgmma
    assert wgmma["under"] == 2 * 512 // 16 + 2 * block_k // 16, wgmma
    assert resources(under, 12)["stack_bytes"] <= resources(plain, 12)["stack_bytes"]


def _basic_blocks(ptx: str) -> list[list[str]]:
    """The PTX of a kernel cut at its basic-block labels (``$L__BB..:``), in text order."""
    out, cur = [], []
    for line in ptx.splitlines():
        if re.match(r"^\$L__BB\d+_\d+:", line):
            out.append(cur)
            cur = []
        cur.append(line)
    return out + [cur]


def test_ring_forward_lazy_rescale_puts_the_rescale_of_o_behind_a_branch():
    """``LAZY_RESCALE`` (:func:`kernels.dsa.sparse_attention_gluon._ring_softmax_lazy`): the basic block with the
    most float32 multiplies is ``O``'s rescale (each thread's ``64 * 512 / 256 = 128`` accumulators). In the
    default consumer it runs straight into ``P V`` (one block with the ``m64n256k16`` products); with lazy
    rescaling it is a block of its own, entered through a conditional branch. The same products, and no more
    stack than the default."""
    import triton

    from kernels.dsa.sm90 import compile_gluon_sparse_fwd, resources
    from kernels.dsa.sparse_attention_gluon import GLUON_FWD_LAZY

    cfg = GLUON_FWD_LAZY[0]
    builds = {lazy: compile_gluon_sparse_fwd(64, 512, triton.Config(dict(cfg.kwargs, LAZY_RESCALE=lazy),
                                                                    num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
              for lazy in (False, True)}
    rescale = {}
    for lazy, build in builds.items():
        bbs = _basic_blocks(build.asm["ptx"])
        muls = [sum(bool(re.search(r"\bmul(\.rn)?\.f32", line)) for line in bb) for bb in bbs]
        i = max(range(len(bbs)), key=muls.__getitem__)
        assert muls[i] >= 64 * 512 // 256, muls[i]
        code = [line.strip() for line in bbs[i - 1] if line.strip() and not line.strip().startswith(("$", "//"))]
        rescale[lazy] = (any("m64n256k16" in line for line in bbs[i]), re.match(r"@!?%p\d+ bra", code[-1]))
    assert rescale[False][0] and not rescale[False][1], rescale
    assert not rescale[True][0] and rescale[True][1], rescale
    wgmma = {k: len(re.findall(r"wgmma\.mma_async", b.asm["ptx"])) for k, b in builds.items()}
    assert wgmma[True] == wgmma[False], wgmma
    assert resources(builds[True], 12)["stack_bytes"] <= resources(builds[False], 12)["stack_bytes"]


def test_pair_forward_keeps_its_wgmma_descriptors_in_the_loop():
    """The paired-block forward's consumers address their buffers through
    :func:`kernels.dsa.sparse_attention_gluon._opaque_zero`, so the compiler does not hoist the ``wgmma``
    shared-memory descriptors out of the pair loop into local memory: the stack holds fewer bytes than one
    warpgroup's ``Q K^T`` descriptors alone (``512 / 16`` 64-bit descriptors; it held over 1 KB before)."""
    from kernels.dsa.sm90 import compile_gluon_sparse_fwd_pair, resources
    from kernels.dsa.sparse_attention_gluon import GLUON_FWD_PAIR_CONFIGS

    for cfg in GLUON_FWD_PAIR_CONFIGS:
        stack = resources(compile_gluon_sparse_fwd_pair(64, 512, cfg), 12)["stack_bytes"]
        assert stack < 512 // 16 * 8, (cfg.kwargs, stack)
