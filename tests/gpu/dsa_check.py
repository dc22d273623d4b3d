"""GPU correctness check of the DSA Triton kernels (issue 4). Run on an H200:

    python tests/gpu/dsa_check.py [--seq-lens 4096 16384 65536] [--score-kernel gluon] [--kl-only] [--out results.json]

Per sequence length, with fresh random inputs and the caching allocator's free memory
filled with NaN before every kernel call (so an unwritten output shows up):

* indexer: the one-kernel k-pool compression within one bf16 ulp of the torch compression (of
  the larger value, at least the keys' rms) and no farther from float64; the Triton selection vs
  the blockwise torch path on the same bf16 pooled keys (index sets equal per query, modulo
  near-ties); the one-kernel expansion equal
  to the torch expansion; and score-mass capture against float64 scores:
  ``sum softmax(I64)[selected] / sum softmax(I64)[true top pools] >= 0.99`` on sampled rows;
* sparse MLA attention forward on the selected indices: relative Frobenius error of the
  bf16 output vs float64 (sampled rows) <= 1e-2; backward (dq, dkv) vs float64 at the
  smallest length, with dkv scattered per query and summed per k-pool run; where the heads are a
  multiple of 64 (the ``full`` shape), the warp-specialized Gluon forward too, to the same bounds, on
  the indexer's indices and on a ragged width with an all ``-1`` query (zero output, ``lse = -inf``),
  and the backward with the Gluon latent gradient (64 heads per program); the indexer KL's target as the
  forward returns it (``pool_mass``: each pool's attention mass, summed over heads) within 1e-2 of float64;
* indexer KL loss: the fused Triton kernel (:mod:`kernels.dsa.loss_triton`) and the torch path
  (``kernels.dsa.loss._block_kl``, float32 on the same GPU) against float64 on the first 4096 queries' selected
  pools: the kernel's loss and gradients of the weights and pool keys within 1e-4 relative (or twice the torch
  path's own error where that is larger), of the bf16 queries within 2^-8; the kernel-vs-torch gaps are reported
  beside them; with ``--kl-only`` this check alone, on the window layout's k-pools;
* massive ties (``--ties``, and by default): every score equal (zero queries), and 160 pools
  of six score levels above a tie of all others in 40 of the 512 column groups, so that the
  selection's slots overflow and its exact pass must climb above its bound:
  the Triton selection equals the torch path exactly and, for the last query, the pools ranked
  by (level, lower index first) directly;
* context parallelism (when 2 GPUs are visible): indices computed on each rank from its
  local queries against all-gathered keys equal the single-GPU result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from kernels.dsa import lightning_indexer_topk, sparse_mla_attention  # noqa: E402
from kernels.dsa.grid import kpool_grid  # noqa: E402
from kernels.dsa.indexer import compress_on_grid, expand_selection, torch_pool_topk  # noqa: E402
from kernels.dsa.indexer_triton import resolve_score_kernel, triton_kpool_compress, triton_pool_topk  # noqa: E402
from kernels.dsa.loss import _block_kl  # noqa: E402
from kernels.dsa.loss_triton import triton_indexer_kl  # noqa: E402
from kernels.dsa.sparse_attention import torch_sparse_mla_bwd, torch_sparse_mla_fwd  # noqa: E402
from kernels.dsa.sparse_attention_gluon import gluon_supported, gluon_sparse_mla_fwd  # noqa: E402
from kernels.dsa.sparse_attention_triton import triton_sparse_mla_bwd  # noqa: E402

SHAPES = {  # model/config.py presets: MLA heads, kv_lora_rank, qk head dim, indexer heads x dim
    "small": dict(heads=8, dqk=512, qk_head=128, index_heads=16, index_dim=64),
    "full": dict(heads=64, dqk=512, qk_head=256, index_heads=32, index_dim=128),
}
KPOOL, TOPK = 16, 2048


def poison() -> None:
    """Fill the allocator's cached free memory with NaN so torch.empty returns NaN-filled blocks."""
    free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if free > 2**20:
        torch.empty(free // 4 - 2**18, dtype=torch.float32, device="cuda").fill_(float("nan"))


def indexer_inputs(seq_len: int, shape: dict, gen: torch.Generator) -> dict:
    h, d = shape["index_heads"], shape["index_dim"]
    dev = "cuda"
    return dict(
        q=torch.randn(1, seq_len, h, d, generator=gen, device=dev).bfloat16(),
        k=torch.nn.functional.layer_norm(torch.randn(1, seq_len, d, generator=gen, device=dev), (d,)).bfloat16(),
        gate_scores=torch.randn(1, seq_len, d, generator=gen, device=dev).bfloat16(),
        ape=(0.1 * torch.randn(KPOOL, d, generator=gen, device=dev)).bfloat16(),
        weights=torch.randn(1, seq_len, h, generator=gen, device=dev) * h**-0.5,
    )


def bf16_ulps_apart(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|got - ref|`` in bf16 ulps of the larger of the two values, or of ``ref``'s rms where that is
    larger (a weighted sum that cancels to ~0 carries float32 noise of many ulps of its tiny result)."""
    got, ref = got.float(), ref.float()
    magnitude = torch.maximum(got.abs(), ref.abs()).clamp_min(ref.pow(2).mean().sqrt())
    ulp = torch.ldexp(torch.ones_like(magnitude), torch.frexp(magnitude).exponent - 8)
    return float(((got - ref).abs() / ulp).max())


def check_indexer(seq_len: int, shape: dict, gen: torch.Generator, score_kernel: str,
                  n_rows: int = 1024) -> tuple[dict, torch.Tensor]:
    inp = indexer_inputs(seq_len, shape, gen)
    scale = shape["index_dim"] ** -0.5
    poison()
    indices = lightning_indexer_topk(**inp, kpool=KPOOL, topk=TOPK, select_tail=True, softmax_scale=scale,
                                     score_kernel=score_kernel)
    torch.cuda.synchronize()
    grid = kpool_grid(seq_len, KPOOL, None, inp["q"].device)
    # the pooled keys the Triton path selects on (triton_kpool_compress) are the same-precision
    # reference's too; they are checked against the torch compression and against float64
    poison()
    pool_keys = triton_kpool_compress(inp["k"], inp["gate_scores"], inp["ape"], grid)
    torch_keys = compress_on_grid(inp["k"], inp["gate_scores"], inp["ape"], grid)
    keys64 = compress_on_grid(inp["k"].double(), inp["gate_scores"].double(), inp["ape"].double(), grid)
    compression = dict(
        max_ulps_from_torch=bf16_ulps_apart(pool_keys, torch_keys),
        rel_err_float64=rel_err(pool_keys, keys64), torch_rel_err_float64=rel_err(torch_keys, keys64))
    del torch_keys
    n_sel = TOPK // KPOOL
    ref_pools = torch_pool_topk(inp["q"], pool_keys, inp["weights"], grid, n_sel, scale, 0, 512)
    got_pools = torch.where(indices[..., :TOPK:KPOOL] >= 0, indices[..., :TOPK:KPOOL].long() // KPOOL, -1)
    got_sorted, ref_sorted = got_pools.sort(-1).values, ref_pools.sort(-1).values
    differing = (got_sorted != ref_sorted).any(-1)[0]
    # float64 scores on sampled rows (plus every differing row) for ties and mass capture
    rows = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seq_len))[:n_rows].cuda()
    rows = torch.unique(torch.cat([rows, differing.nonzero().flatten()]))
    q64 = inp["q"][0, rows].double()
    visible = (grid.end[None, :] <= rows[:, None]) & grid.complete[None, :]

    def scores64(keys: torch.Tensor) -> torch.Tensor:
        per_head = torch.relu(torch.einsum("thd,pd->thp", q64, keys.double()) * scale)
        return torch.einsum("thp,th->tp", per_head, inp["weights"][0, rows].double()).masked_fill(~visible, float("-inf"))

    s64 = scores64(keys64[0])  # float64 from the inputs: the mass-capture reference
    s_same = scores64(pool_keys[0])  # the bf16 pool keys both paths used: the tie reference
    true_top = s64.topk(n_sel, dim=-1).indices
    probs = torch.softmax(s64, dim=-1).nan_to_num(0.0)
    sel = got_pools[0, rows]
    got_mass = torch.where(sel >= 0, torch.gather(probs, 1, sel.clamp_min(0)), 0.0).sum(-1)
    true_mass = torch.gather(probs, 1, true_top).masked_fill(~torch.gather(visible, 1, true_top), 0.0).sum(-1)
    capture = (got_mass / true_mass.clamp_min(1e-300))[true_mass > 0]
    # a differing pool must be a near-tie in float64 with the boundary
    max_tie_gap = 0.0
    for r in differing.nonzero().flatten().tolist()[:256]:
        i = int((rows == r).nonzero()[0, 0])
        a, b = set(got_pools[0, r].tolist()) - {-1}, set(ref_pools[0, r].tolist()) - {-1}
        boundary = min(s_same[i, p].item() for p in a | b)
        max_tie_gap = max(max_tie_gap, max(abs(s_same[i, p].item() - boundary) for p in a ^ b))
    # the one-kernel expansion (triton_expand_selection) against the torch expansion of the
    # pools the same Triton selection picks (deterministic): every token and tail entry
    pools = triton_pool_topk(inp["q"], pool_keys, inp["weights"], grid, n_sel, scale, 0, score_kernel=score_kernel)
    expansion_equal = bool(torch.equal(indices, expand_selection(pools, grid, seq_len, 0, TOPK, True)))
    result = dict(
        compression=compression,
        expansion_equal=expansion_equal,
        nan_or_poison=bool((indices < -1).any() or (indices >= seq_len).any()),
        rows_differing_from_torch_same_precision=int(differing.sum()),
        max_float64_gap_of_differing_pools=max_tie_gap,
        mass_capture_min=float(capture.min()), mass_capture_mean=float(capture.mean()),
    )
    # the fused compression: within one bf16 ulp of the torch path, no farther from float64
    compression_ok = compression["max_ulps_from_torch"] <= 1 and (
        compression["rel_err_float64"] <= 1.05 * compression["torch_rel_err_float64"])
    result["ok"] = (
        compression_ok and expansion_equal and not result["nan_or_poison"] and max_tie_gap <= 1e-3
        and result["mass_capture_min"] >= 0.99
    )
    return result, indices


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def check_attention(seq_len: int, shape: dict, indices: torch.Tensor, gen: torch.Generator, backward: bool) -> dict:
    h, dqk = shape["heads"], shape["dqk"]
    scale = shape["qk_head"] ** -0.5
    q = torch.randn(1, seq_len, h, dqk, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(1, seq_len, dqk, generator=gen, device="cuda").bfloat16()
    q.requires_grad_(backward)
    kv.requires_grad_(backward)
    poison()
    out, lse = sparse_mla_attention(q, kv, indices, scale, dqk)
    torch.cuda.synchronize()
    rows = torch.randperm(seq_len, generator=torch.Generator().manual_seed(1))[:1024].cuda()
    ref_out, ref_lse = torch_sparse_mla_fwd(q.detach()[:, rows].double(), kv.detach().double(), indices[:, rows], scale, dqk, 64)
    result = dict(
        out_finite=bool(torch.isfinite(out).all()),
        out_rel_err=rel_err(out[:, rows], ref_out),
        lse_max_abs_err=float((lse[:, rows].double() - ref_lse).abs().max()),
    )
    ok = result["out_finite"] and result["out_rel_err"] <= 1e-2 and result["lse_max_abs_err"] <= 5e-2
    # the indexer KL's target as the model asks for it (pool_mass): folded into the Triton forward, or one pass of
    # the mass kernel after the Gluon one, against float64 probabilities summed per pool of 16 slots over 2048
    pools = 2048 // 16
    _, _, mass = sparse_mla_attention(q.detach(), kv.detach(), indices, scale, dqk, pool_mass=(16, pools))
    _, _, ref_mass = torch_sparse_mla_fwd(q.detach()[:, rows].double(), kv.detach().double(), indices[:, rows], scale,
                                          dqk, 64, pool_mass=(16, pools))
    result["pool_mass_rel_err"] = rel_err(mass[:, rows], ref_mass)
    ok = ok and result["pool_mass_rel_err"] <= 1e-2
    if gluon_supported(q, kv, dqk) is None:
        try:
            gluon = check_gluon_forward(q.detach(), kv.detach(), indices, scale, dqk, rows, ref_out, ref_lse,
                                        out.detach())
        except Exception as exc:   # recorded as a failure; the other checks still run
            gluon = dict(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        result["gluon_fwd"] = gluon
        ok = ok and gluon["ok"]
    if backward:
        grad = torch.randn(out.shape, generator=gen, device="cuda").bfloat16()
        ref_o64, ref_l64 = torch_sparse_mla_fwd(q.detach().double(), kv.detach().double(), indices, scale, dqk, 64)
        dq64, dkv64 = torch_sparse_mla_bwd(
            q.detach().double(), kv.detach().double(), indices, ref_o64, ref_l64, grad.double(), scale, dqk, 64
        )
        # dkv scattered per query, and summed per k-pool run (the indexer's layout; the model's path), and
        # where the heads allow, per query with 64 heads per program (the Gluon dq and latent gradient kernels)
        paths = [(None, "triton", ""), (16, "triton", "_per_pool")]
        if gluon_supported(q, kv, dqk) is None:
            paths.append((None, "gluon", "_gluon"))
        for runs, dkv_kernel, tag in paths:
            q.grad = kv.grad = None
            out, _ = sparse_mla_attention(q, kv, indices, scale, dqk, runs=runs, dkv_kernel=dkv_kernel)
            poison()
            out.backward(grad)
            result.update({f"dq{tag}_rel_err": rel_err(q.grad, dq64), f"dkv{tag}_rel_err": rel_err(kv.grad, dkv64)})
            ok = ok and result[f"dq{tag}_rel_err"] <= 1e-2 and result[f"dkv{tag}_rel_err"] <= 1e-2
        if gluon_supported(q, kv, dqk) is None:   # the Gluon latent gradient beside the Triton dq pass (kernel level;
            lse_f = ref_l64.float()                 # the model's "gluon" path above takes the Gluon dq)
            try:
                dq_t, dkv_t = triton_sparse_mla_bwd(q.detach(), kv.detach(), indices, ref_o64.to(q.dtype), lse_f,
                                                    grad, scale, dqk, dkv_kernel="gluon", dq_kernel="triton")
                torch.cuda.synchronize()
                result.update(dq_pass_gluon_dkv_rel_err=rel_err(dq_t, dq64),
                              dkv_pass_gluon_dkv_rel_err=rel_err(dkv_t, dkv64))
            except Exception as exc:   # recorded as a failure, the other checks still report
                result["dq_pass_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            ok = (ok and result.get("dq_pass_gluon_dkv_rel_err", 1.0) <= 1e-2
                  and result.get("dkv_pass_gluon_dkv_rel_err", 1.0) <= 1e-2)
    result["ok"] = ok
    return result


def check_gluon_forward(q, kv, indices, scale, dqk, rows, ref_out, ref_lse, triton_out) -> dict:
    """The warp-specialized Gluon forward (:mod:`kernels.dsa.sparse_attention_gluon`) on the same inputs: against
    float64 on ``rows``, against the Triton forward everywhere, and on a ragged index width (not a multiple of
    any ``BLOCK_K``) with a query whose slots are all ``-1`` (zero output, ``lse = -inf``)."""
    poison()
    out, lse = gluon_sparse_mla_fwd(q, kv, indices, scale, dqk)
    torch.cuda.synchronize()
    res = dict(out_finite=bool(torch.isfinite(out).all()), out_rel_err=rel_err(out[:, rows], ref_out),
               lse_max_abs_err=float((lse[:, rows].double() - ref_lse).abs().max()),
               vs_triton_ulps=bf16_ulps_apart(out, triton_out))
    ragged = indices[:, :, : indices.shape[2] - 5].clone()
    ragged[:, rows[:1]] = -1
    poison()
    r_out, r_lse = gluon_sparse_mla_fwd(q, kv, ragged, scale, dqk)
    ref_r_out, ref_r_lse = torch_sparse_mla_fwd(q[:, rows].double(), kv.double(), ragged[:, rows], scale, dqk, 64)
    res.update(ragged_out_rel_err=rel_err(r_out[:, rows], ref_r_out),
               empty_row_zero=bool((r_out[:, rows[:1]] == 0).all()),
               empty_row_lse_neg_inf=bool(torch.isneginf(r_lse[:, rows[:1]]).all()),
               ragged_lse_max_abs_err=float((r_lse[:, rows[1:]].double() - ref_r_lse[:, 1:]).abs().max()))
    res["ok"] = (res["out_finite"] and res["out_rel_err"] <= 1e-2 and res["lse_max_abs_err"] <= 5e-2
                 and res["ragged_out_rel_err"] <= 1e-2 and res["ragged_lse_max_abs_err"] <= 5e-2
                 and res["empty_row_zero"] and res["empty_row_lse_neg_inf"])
    return res


def kl_float64(q, weights, keys, row, ok, target, scale: float, grad, chunk: int = 1024):
    """The indexer KL per query and its gradients in float64, from the formula in
    :func:`kernels.dsa.loss.indexer_kl_loss`'s docstring (written here apart from the two paths it judges).

    ``q [1, n, H_I, D_I]``, ``weights [1, n, H_I]``, ``keys [1, P, D_I]`` (any float dtype), ``row, ok, target
    [1, n, J]`` (pool rows, their validity, the target mass), ``grad [1, n]`` the loss's incoming gradient.
    Returns ``[kl [1, n], dq, dweights, dkeys]``, float64, queries taken ``chunk`` at a time."""
    leaves = [x.detach().double().requires_grad_() for x in (q, weights, keys)]
    q64, w64, k64 = leaves
    kl = []
    for s in range(0, q.shape[1], chunk):
        sl = slice(s, s + chunk)
        keys_sel = k64[0][row[0, sl]]  # [t, J, D_I]
        scores = torch.einsum("thd,tjd->thj", q64[0, sl], keys_sel) * scale
        logits = torch.einsum("thj,th->tj", scores.relu(), w64[0, sl])
        log_pred = logits.masked_fill(~ok[0, sl], float("-inf")).log_softmax(-1).masked_fill(~ok[0, sl], 0.0)
        p = target[0, sl].double()
        part = (p * (p.clamp_min(1e-10).log() - log_pred)).sum(-1)
        (part * grad[0, sl].double()).sum().backward()
        kl.append(part.detach())
    return [torch.cat(kl)[None]] + [x.grad for x in leaves]


def check_kl(seq_len: int, shape: dict, indices: torch.Tensor, gen: torch.Generator, n_q: int = 4096) -> dict:
    """The fused indexer KL and the torch path (float32) on the first ``n_q`` queries (random target mass),
    both against float64."""
    inputs = indexer_inputs(seq_len, shape, gen)
    grid = kpool_grid(seq_len, KPOOL, None, "cuda")
    keys = compress_on_grid(inputs["k"].float(), inputs["gate_scores"].float(), inputs["ape"].float(), grid)
    starts = indices[:, :n_q, :TOPK:KPOOL].long()
    ok = starts >= 0
    row = grid.pool_of_start(starts.clamp_min(0))
    target = torch.rand(ok.shape, generator=gen, device="cuda").masked_fill(~ok, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    grad = torch.randn(1, n_q, generator=gen, device="cuda")
    scale = shape["index_dim"] ** -0.5
    got = []
    for fn in (_block_kl, triton_indexer_kl):
        leaves = [inputs["q"][:, :n_q].clone().requires_grad_(), inputs["weights"][:, :n_q].clone().requires_grad_(),
                  keys.clone().requires_grad_()]
        kl = fn(*leaves, row, ok, target, scale)
        kl.backward(grad)
        got.append([kl] + [x.grad for x in leaves])
    exact = kl_float64(inputs["q"][:, :n_q], inputs["weights"][:, :n_q], keys, row, ok, target, scale, grad)
    names = ("kl", "dq", "dw", "dkeys")
    result = {f"{name}_rel_err": rel_err(b, a) for name, a, b in zip(names, *got)}
    result.update({f"{name}_f64_rel_err": rel_err(b, e) for name, b, e in zip(names, got[1], exact)})
    result.update({f"{name}_torch_f64_rel_err": rel_err(a, e) for name, a, e in zip(names, got[0], exact)})
    # Both float32 paths sum thousands of products per pool key in different orders (atomic adds in both), so
    # the kernel is judged against float64: within the limit, or within twice the torch path's own error where
    # that is larger. dq is bf16 like the queries: rounding alone puts it ~2^-9 from float64.
    limits = dict(kl=1e-4, dq=2**-8, dw=1e-4, dkeys=1e-4)
    result["ok"] = (all(result[f"{k}_f64_rel_err"] <= max(v, 2 * result[f"{k}_torch_f64_rel_err"])
                        for k, v in limits.items())
                    and all(bool(torch.isfinite(x).all()) for x in got[1]))
    return result


def check_ties(score_kernel: str, seq_len: int = 16384) -> dict:
    """The massive-tie cases of the module docstring at ``seq_len`` tokens (full shape's index heads)."""
    h, d, n_select = SHAPES["full"]["index_heads"], SHAPES["full"]["index_dim"], TOPK // KPOOL
    grid = kpool_grid(seq_len, KPOOL, None, "cuda")
    n_pools = seq_len // KPOOL
    pool = torch.arange(n_pools, device="cuda")
    # score level of each pool: 3 for the tie; 4-9 for pools p % 32 < 5 (in the score kernel's 128-pool
    # tiles, 16 programs x 32 column groups: 40 groups hold them at 1,024 pools)
    level = torch.where(pool % 32 < 5, 4 + (pool // 32) % 6, 3).float()
    keys = torch.zeros(1, n_pools, d, device="cuda")
    keys[0, :, 0] = level
    weights = torch.full((1, seq_len, h), 1.0 / h, device="cuda")
    result = {}
    for case, q0 in [("all_equal", 0.0), ("climb", 1.0)]:
        q = torch.zeros(1, seq_len, h, d, device="cuda")
        q[..., 0] = q0
        q, pool_keys = q.bfloat16(), keys.bfloat16()
        poison()
        got = triton_pool_topk(q, pool_keys, weights, grid, n_select, d**-0.5, 0, score_kernel=score_kernel)
        ref = torch_pool_topk(q, pool_keys, weights, grid, n_select, d**-0.5, 0, 1024)
        last = seq_len - 1   # sees every pool; ranked by (level or 0, lower index first)
        score = level if q0 else torch.zeros_like(level)
        direct = sorted(range(n_pools), key=lambda p: (-float(score[p]), p))[:n_select]
        result[case] = dict(rows_differing_from_torch=int((got != ref).any(-1).sum()),
                            last_row_equal_direct=got[0, last].tolist() == direct)
    result["ok"] = all(r["rows_differing_from_torch"] == 0 and r["last_row_equal_direct"] for r in result.values())
    return result


def _cp_worker(rank: int, world: int, seq_len: int, port: int, queue, score_kernel: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    shape = SHAPES["full"]
    gen = torch.Generator(device="cuda").manual_seed(1234)  # same full inputs on every rank
    inp = indexer_inputs(seq_len, shape, gen)
    kw = dict(kpool=KPOOL, topk=TOPK, select_tail=True, softmax_scale=shape["index_dim"] ** -0.5,
              score_kernel=score_kernel)
    local = seq_len // world
    sl = slice(rank * local, (rank + 1) * local)
    # each rank owns its chunk of keys; all-gather them as the CP model does
    parts = {n: [torch.empty_like(inp[n][:, sl]) for _ in range(world)] for n in ("k", "gate_scores")}
    for n in parts:
        dist.all_gather(parts[n], inp[n][:, sl].contiguous())
    k_all, g_all = torch.cat(parts["k"], 1), torch.cat(parts["gate_scores"], 1)
    mine = lightning_indexer_topk(
        inp["q"][:, sl], k_all, g_all, inp["ape"], inp["weights"][:, sl], q_offset=rank * local, **kw
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        single = lightning_indexer_topk(**inp, **kw)
        queue.put(bool(torch.equal(torch.cat(gathered, 1), single)))
    dist.destroy_process_group()


def check_context_parallel(seq_len: int, score_kernel: str, world: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_cp_worker, args=(world, seq_len, 29533 + world, queue, score_kernel),
                       nprocs=world, start_method="spawn")
    return dict(world=world, seq_len=seq_len, indices_equal_single_gpu=queue.get(), ok=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--out", default=None)
    parser.add_argument("--ties", action="store_true", help="only the massive-tie check")
    parser.add_argument("--kl-only", action="store_true",
                        help="only the fused indexer KL against the torch path, on the window layout's k-pools "
                             "(tests/benchmarks/dsa_bench.pool_indices): no indexer or attention kernels compiled")
    parser.add_argument("--score-kernel", choices=["auto", "triton", "gluon"], default="auto",
                        help="the indexer's score kernel (auto: Gluon on Hopper, Triton elsewhere)")
    args = parser.parse_args()
    probe = torch.empty(1, 1, SHAPES["full"]["index_heads"], 1, device="cuda", dtype=torch.bfloat16)
    print(f"indexer score kernel: {args.score_kernel} -> {resolve_score_kernel(args.score_kernel, probe)}", flush=True)
    results = []
    if args.kl_only:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
        from dsa_bench import pool_indices

        for seq_len in args.seq_lens:
            for name, shape in SHAPES.items():
                gen = torch.Generator(device="cuda").manual_seed(seq_len + len(name))
                kl = check_kl(seq_len, shape, pool_indices(seq_len, seq_len), gen)
                row = dict(seq_len=seq_len, shape=name, kl=kl)
                print(json.dumps(row), flush=True)
                results.append(row)
        args.seq_lens = []
    else:
        ties = dict(ties=check_ties(args.score_kernel))
        print(json.dumps(ties), flush=True)
        results.append(ties)
    if args.ties:
        args.seq_lens = []
    for seq_len in args.seq_lens:
        for name, shape in SHAPES.items():
            gen = torch.Generator(device="cuda").manual_seed(seq_len + len(name))
            idx_res, indices = check_indexer(seq_len, shape, gen, args.score_kernel)
            attn_res = check_attention(seq_len, shape, indices, gen, backward=seq_len == min(args.seq_lens))
            kl_res = check_kl(seq_len, shape, indices, gen)
            row = dict(seq_len=seq_len, shape=name, indexer=idx_res, attention=attn_res, kl=kl_res)
            print(json.dumps(row), flush=True)
            results.append(row)
            del indices
            torch.cuda.empty_cache()
    if torch.cuda.device_count() >= 2 and args.seq_lens:
        for world in (2, 4, 8):   # CP over 2 GPUs and, where the host has them, 4 and 8
            if world > torch.cuda.device_count():
                break
            cp = check_context_parallel(max(args.seq_lens), args.score_kernel, world)
            cp["ok"] = cp["indices_equal_single_gpu"]
            print(json.dumps(dict(context_parallel=cp)), flush=True)
            results.append(dict(context_parallel=cp))
    elif args.seq_lens:
        print("context parallel check skipped: fewer than 2 GPUs visible", flush=True)
    all_ok = all(r.get("indexer", {}).get("ok", True) and r.get("attention", {}).get("ok", True)
                 and r.get("kl", {}).get("ok", True)
                 and r.get("context_parallel", {}).get("ok", True) and r.get("ties", {}).get("ok", True)
                 for r in results)
    print(f"ALL OK: {all_ok}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
