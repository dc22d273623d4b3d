"""The whole-step profiler's kernel families (tests/benchmarks/sft_profile.py): each kernel the model launches
lands in the family its time is reported and projected under (layer_bench scales the tensor-core families
by the matrix rate, the rest by the memory rate)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))

from sft_profile import kernel_family  # noqa: E402


@pytest.mark.parametrize("name, family", [
    # the sparse MLA kernels, Triton and Gluon (kernels/dsa/sparse_attention_*.py)
    ("sparse_mla_fwd_kernel", "sparse MLA fwd"),
    ("sparse_mla_fwd_gluon_kernel", "sparse MLA fwd"),
    ("sparse_mla_bwd_kernel", "sparse MLA bwd"),
    ("sparse_mla_bwd_runs_kernel", "sparse MLA bwd"),
    ("sparse_mla_dq_gluon_kernel", "sparse MLA bwd"),
    ("sparse_mla_dkv_gluon_kernel", "sparse MLA bwd"),
    ("sparse_mla_delta_kernel", "sparse MLA bwd"),
    ("run_scan_kernel", "sparse MLA bwd"),
    # the mHC kernels (kernels/hc/*_triton.py), not the inductor glue around them
    ("hc_projection_dx_kernel", "mHC"),
    ("hc_maps_bwd_kernel", "mHC"),
    ("hc_merge_bwd_kernel", "mHC"),
    # the indexer's attention-mass target is the indexer KL's, not attention
    ("sparse_mla_mass_kernel", "DSA indexer"),
    ("pool_scores_gluon_kernel", "DSA indexer"),
    ("chunk_kda_bwd_kernel_intra", "KDA/fla"),
    ("triton_poi_fused_add_mul_0", "inductor glue"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("Memcpy DtoD (Device -> Device)", "copy/cast"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_families(name, family):
    assert kernel_family(name) == family
