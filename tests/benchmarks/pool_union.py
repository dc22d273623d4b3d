"""How many distinct k-pools blocks of consecutive queries select, from a model's own DSA selections.

A sparse MLA kernel that took a block of ``q`` consecutive queries per program and gathered the union of their
selected k-pools once would move ``q * per_query / union`` times fewer latent rows and compute ``union /
per_query`` times more products (each query masked to its own pools). This prints both ratios per DSA layer, for
a model built from a preset (at initialization) or loaded from a GLM-5.3-Flash-layout export (``--init-hf``, e.g.
an SFT stage's ``hf`` output), on real DNA from a pack's shards. CPU is enough at a few thousand tokens.

    python tests/benchmarks/pool_union.py --pack runs/sft_gpu_pack --preset tiny --index-topk 512 --seq-len 4096
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from model.config import preset  # noqa: E402
from model.convert import load_hf_checkpoint, load_hf_into_model  # noqa: E402
from model.glm5_next import build_model  # noqa: E402
from model.layers import DSAMixer  # noqa: E402
from tasks.pack import shard_token_stream  # noqa: E402


def union_sizes(pools: torch.Tensor, block: int, first: int) -> tuple[float, float]:
    """Mean distinct pools per block of ``block`` consecutive queries from query ``first`` on, and mean pools per
    query, for ``pools [T, n_sel]`` int64 pool ids (``-1`` unused)."""
    sizes = []
    for b in range(first, pools.shape[0], block):
        p = pools[b:b + block].flatten()
        sizes.append(p[p >= 0].unique().numel())
    return float(np.mean(sizes)), (pools[first:] >= 0).sum(-1).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True, help="a pack directory (its train/*.parquet shards)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--init-hf", default="", help="an export directory instead of the preset at initialization")
    parser.add_argument("--index-topk", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--first-query", type=int, default=1024, help="skip queries that see few pools")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 8, 16])
    args = parser.parse_args()
    shards = sorted(glob.glob(os.path.join(args.pack, "train", "*.parquet")))
    if not shards:
        raise SystemExit(f"no train/*.parquet shards under {args.pack}")
    ids, _ = shard_token_stream(shards[0])
    if len(ids) <= args.seq_len:
        raise SystemExit(f"{shards[0]} holds {len(ids)} tokens, fewer than --seq-len {args.seq_len} + 1")
    if args.init_hf:
        cfg, text, _ = load_hf_checkpoint(args.init_hf, index_topk=args.index_topk)
        model = build_model(cfg, seed=0).eval()
        load_hf_into_model(model, text)
    else:
        cfg = preset(args.preset, index_topk=args.index_topk)
        model = build_model(cfg, seed=0).eval()
    caught = []
    for m in model.modules():
        if isinstance(m, DSAMixer):
            m.register_forward_hook(lambda mod, a, out: caught.append(out[1].detach()))
    with torch.no_grad():
        model(torch.as_tensor(ids[:args.seq_len].astype(np.int64))[None])
    kpool = cfg.index_kpool
    print("| layer | block | distinct pools | per query | rows gathered / | products x |")
    print("|---|---|---|---|---|---|")
    for layer, idx in enumerate(caught):
        starts = idx[0, :, :cfg.index_topk:kpool].long()
        pools = torch.where(starts >= 0, starts // kpool, -1)
        for block in args.blocks:
            union, per_query = union_sizes(pools, block, args.first_query)
            print(f"| {layer} | {block} | {union:.1f} | {per_query:.1f} | {block * per_query / union:.2f} | "
                  f"{union / per_query:.2f} |")


if __name__ == "__main__":
    main()
