"""KDA context-parallel state fold, forward+backward: per-rank indexing of the gathered states vs
``model.layers.fold_cp_states`` (split and unbind once) vs a log-depth tree, as the last CP rank.

The fold runs in every KDA layer's forward (twice under full recompute) and backward. Indexing the
gathered ``[B, R, H, K, 2V]`` tensor per rank makes each slice's backward a zero-filled full-size
gradient that autograd then accumulates: ``O(R^2)`` bytes. Prints a table; every variant in the
same process (the anchors for each other; the tree's values are checked against ``fold_cp_states``)::

    python tests/benchmarks/kda_cp_fold_bench.py                       # full preset widths, CP 16/64
    python tests/benchmarks/kda_cp_fold_bench.py --heads 8 --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.layers import fold_cp_states  # noqa: E402


def fold_by_indexing(gathered: torch.Tensor, rank: int, v_dim: int) -> torch.Tensor:
    """The fold written with per-rank slices of ``gathered`` (the variant ``fold_cp_states`` replaced)."""
    state = gathered[:, 0, ..., :v_dim] * 0
    for j in range(rank):
        state = gathered[:, j, ..., v_dim:] @ state + gathered[:, j, ..., :v_dim]
    return state


def fold_by_tree(gathered: torch.Tensor, rank: int, v_dim: int) -> torch.Tensor:
    """The fold as a log-depth reduction of the affine maps ``S -> M_j S + L_j`` (a candidate: about
    ``2 log2(R)`` batched launches instead of ``R`` sequential ones, twice the FLOPs); composing ``j``
    then ``j + 1`` gives ``(M_{j+1} M_j, M_{j+1} L_j + L_{j+1})``."""
    local, transition = gathered.split([v_dim, gathered.shape[-1] - v_dim], dim=-1)
    if rank == 0:
        return local[:, 0] * 0
    m, s = transition[:, :rank], local[:, :rank]
    while m.shape[1] > 1:
        pairs = m.shape[1] // 2 * 2
        first_m, next_m = m[:, 0:pairs:2], m[:, 1:pairs:2]
        composed_m, composed_s = next_m @ first_m, next_m @ s[:, 0:pairs:2] + s[:, 1:pairs:2]
        m = torch.cat([composed_m, m[:, pairs:]], dim=1)
        s = torch.cat([composed_s, s[:, pairs:]], dim=1)
    return s[:, 0]


def time_fold(fold, gathered, rank, v_dim, iters: int) -> float:
    """Median seconds of one forward+backward of ``fold``."""
    times = []
    for i in range(iters + 1):
        gathered.grad = None
        if gathered.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fold(gathered, rank, v_dim).sum().backward()
        if gathered.is_cuda:
            torch.cuda.synchronize()
        if i:   # the first call warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--heads", type=int, default=64, help="KDA heads per rank (full preset: 64)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="JSON file for the rows")
    args = parser.parse_args()
    d, rows = args.head_dim, []
    print("| CP | gathered MiB | per-rank indexing ms | split+unbind ms | tree ms | speed-up (split+unbind) |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        gathered = torch.randn(1, cp, args.heads, d, 2 * d, device=args.device) * 0.1
        gathered.requires_grad_()
        old = time_fold(fold_by_indexing, gathered, cp - 1, d, args.iters)
        new = time_fold(fold_cp_states, gathered, cp - 1, d, args.iters)
        tree = time_fold(fold_by_tree, gathered, cp - 1, d, args.iters)
        want, got = fold_cp_states(gathered, cp - 1, d), fold_by_tree(gathered, cp - 1, d)
        err = ((got - want).norm() / want.norm()).item()
        if err > 1e-4:
            raise AssertionError(f"CP={cp}: the tree fold differs from fold_cp_states by {err:.2e} (relative norm)")
        mib = gathered.numel() * 4 / 2**20
        rows.append({"cp": cp, "gathered_mib": mib, "indexing_s": old, "split_unbind_s": new, "tree_s": tree,
                     "tree_relative_error": err})
        print(f"| {cp} | {mib:.0f} | {old * 1e3:.2f} | {new * 1e3:.2f} | {tree * 1e3:.2f} | {old / new:.1f}x |",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(args.device), "heads": args.heads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
