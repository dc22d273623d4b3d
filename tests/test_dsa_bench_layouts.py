"""The sparse MLA benchmarks' k-pool selections (tests/benchmarks/dsa_bench.py ``pool_indices``): each layout is
a valid DSA selection (causal, distinct, whole pools) and places its pools
where its name says: in a recent window, over the whole history, or the same for every query."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "benchmarks"))

from dsa_bench import KPOOL, POOL_LAYOUTS, TOPK, WIDTH, pool_indices  # noqa: E402

SEQ = 16384


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
def test_selection_is_causal_distinct_and_full_once_history_allows(layout):
    torch.manual_seed(0)
    idx = pool_indices(SEQ, SEQ, "cpu", layout)[0]
    assert idx.shape == (SEQ, WIDTH) and idx.dtype == torch.int32
    pos = torch.arange(SEQ)[:, None]
    valid = idx >= 0
    assert bool((idx[valid] <= pos.expand_as(idx)[valid]).all())
    ordered = idx.sort(dim=1).values
    assert not bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())
    # selected pools are whole: the first TOPK slots hold runs of KPOOL consecutive keys
    pools = idx[:, :TOPK].reshape(SEQ, TOPK // KPOOL, KPOOL)
    whole = pools[..., 0] >= 0
    assert bool((pools[whole] - pools[whole][:, :1] == torch.arange(KPOOL)).all())
    # every query with 4 x TOPK keys of history (the window layout's reach) has its TOPK keys
    assert bool((valid[4 * TOPK:, :TOPK].sum(dim=1) == TOPK).all())


def test_layouts_place_pools_where_they_say():
    torch.manual_seed(0)
    last = {layout: pool_indices(SEQ, SEQ, "cpu", layout)[0, -1, :TOPK] for layout in POOL_LAYOUTS}
    assert int(last["window"].min()) >= SEQ - 4 * TOPK              # a recent window
    assert int(last["spread"].min()) < SEQ // TOPK * KPOOL           # reaches back to the first pools
    assert int(last["spread"].max()) >= SEQ - 2 * SEQ // (TOPK // KPOOL)   # ... and to the latest ones
    shared = pool_indices(SEQ, SEQ, "cpu", "shared")[0, 4 * TOPK:, :TOPK]
    assert bool((shared == shared[:1]).all())                        # one set for every query that sees it
    with pytest.raises(ValueError, match="pool layout 'nearby'"):
        pool_indices(SEQ, SEQ, "cpu", "nearby")
