"""Training features keep the math: sequence-chunked MLP/MoE, full recompute, cu_seqlens packing."""

import pytest
import torch

from model.config import DSA, preset
from model.glm5_next import build_model

SEQ = 384


def _loss_and_grads(cfg, ids, cu_seqlens=None):
    model = build_model(cfg, seed=3).train()
    loss = model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu_seqlens).sum()
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _ids(n=SEQ + 1, seed=0):
    return torch.randint(4, 9, (1, n), generator=torch.Generator().manual_seed(seed))


def _assert_same(a, b):
    assert abs(a[0] - b[0]) <= 1e-5 * abs(a[0])
    _assert_same_grads(a[1], b[1])


def _assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for k in a:
        # Float32 sums in another order: compare relative to the gradient's own scale.
        scale = a[k].abs().max().item() + 1e-6
        assert (a[k] - b[k]).abs().max().item() <= 1e-4 * scale, k


def test_sequence_chunked_mlp_and_moe_equal_one_pass():
    # Chunking reorders float32 sums in the MoE; with a sparse DSA selection a 1e-7 change can
    # flip a near-tied pool and move gradients by 1e-3 (seen in a full-suite run). Selecting
    # every pool (index_topk >= SEQ) keeps this a test of the chunking alone.
    ids = _ids()
    _assert_same(_loss_and_grads(preset("tiny", index_topk=512), ids),
                 _loss_and_grads(preset("tiny", index_topk=512, mlp_chunk_tokens=100), ids))


def test_full_recompute_equals_no_recompute():
    ids = _ids(seed=1)
    _assert_same(_loss_and_grads(preset("tiny", index_topk=32), ids),
                 _loss_and_grads(preset("tiny", index_topk=32, recompute_granularity="full",
                                        recompute_method="uniform", recompute_num_layers=1), ids))


def test_cu_seqlens_packing_equals_separate_documents():
    cfg = preset("tiny", index_topk=32)
    model = build_model(cfg, seed=4).eval()
    a, b = _ids(200, seed=2), _ids(184, seed=3)
    with torch.no_grad():
        packed = model.logits(model.hidden_states(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 200, 384])))
        sep = torch.cat([model.logits(model.hidden_states(a)), model.logits(model.hidden_states(b))], 0)
    assert (packed - sep).abs().max() <= 1e-5


def test_cu_seqlens_packing_gradients_equal_separate_documents():
    """The packed path's backward (each document's KDA inputs split off the packed projections) gives every
    parameter the sum of the two documents' gradients computed apart."""
    cfg = preset("tiny", index_topk=32)
    a, b = _ids(200, seed=2), _ids(184, seed=3)
    packed_model, sep_model = build_model(cfg, seed=4).eval(), build_model(cfg, seed=4).eval()
    r = torch.randn(384, 1, cfg.vocab_size, generator=torch.Generator().manual_seed(7))
    hidden = packed_model.hidden_states(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 200, 384]))
    (packed_model.logits(hidden).float() * r).sum().backward()
    for doc, rows in ((a, r[:200]), (b, r[200:])):
        (sep_model.logits(sep_model.hidden_states(doc)).float() * rows).sum().backward()
    grads = {k: p.grad for k, p in sep_model.named_parameters() if p.grad is not None}
    assert any("q_conv" in k for k in grads)
    _assert_same_grads(grads, {k: p.grad for k, p in packed_model.named_parameters() if p.grad is not None})


def test_cu_seqlens_that_do_not_cover_the_sequence_are_refused():
    model = build_model(preset("tiny", index_topk=32), seed=4).eval()
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the sequence length 384"):
        model.hidden_states(_ids(384), cu_seqlens=torch.tensor([0, 200, 300]))


def test_activation_offload_equals_no_offload():
    ids = _ids(seed=4)
    _assert_same(_loss_and_grads(preset("tiny", index_topk=32), ids),
                 _loss_and_grads(preset("tiny", index_topk=32, cpu_offloading=True, cpu_offloading_num_layers=2), ids))


def test_token_logprobs_batched_with_and_without_explicit_labels():
    from model.logprobs import token_logprobs

    model = build_model(preset("tiny", index_topk=32), seed=5).eval()
    ids = torch.randint(4, 9, (2, 130), generator=torch.Generator().manual_seed(6))
    implicit = token_logprobs(model, ids, chunk_tokens=64)
    explicit = token_logprobs(model, ids[:, :-1], chunk_tokens=64, labels=ids[:, 1:])
    with torch.no_grad():
        full = torch.log_softmax(model.logits(model.hidden_states(ids)).float(), -1).transpose(0, 1)
    expected = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert implicit.shape == (2, 129)
    assert (implicit - expected).abs().max() <= 1e-5 and (explicit - expected).abs().max() <= 1e-5


def test_cpu_reference_runs_compiled_functions_eagerly():
    """megatron's jit_fuser is torch.compile on GPU hosts: the CPU reference must not compile."""
    from model.cpu_compat import cpu_reference

    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    fused = torch.compile(lambda x: x * 2 + 1, backend=backend)
    fused(torch.ones(3))
    assert len(compiled) == 1, "premise: outside the block the function compiles"
    with cpu_reference():
        # A new dtype would make dynamo compile again; inside the block it runs eagerly.
        assert torch.equal(fused(torch.ones(3, dtype=torch.float64)), torch.full((3,), 3.0, dtype=torch.float64))
        assert torch.cuda.current_device() == torch.device("cpu")
    assert len(compiled) == 1


def test_zero_head_starts_at_ln_vocab_and_leaves_every_other_weight_as_drawn():
    import math

    cfg = preset("tiny")
    drawn = dict(build_model(cfg, seed=6).named_parameters())
    model = build_model(cfg, seed=6, zero_head=True).eval()
    params = dict(model.named_parameters())
    assert float(params["output_layer.weight"].abs().max()) == 0.0
    assert float(drawn["output_layer.weight"].abs().max()) > 0.0
    for name, p in params.items():
        if name != "output_layer.weight":
            assert torch.equal(p, drawn[name]), name
    ids = _ids(seed=5)
    with torch.no_grad():
        nll = model(ids[:, :-1], labels=ids[:, 1:])
    # every logit 0: each token costs ln(vocab) nats, whatever the body computes
    assert torch.allclose(nll, torch.full_like(nll, math.log(cfg.vocab_size)), atol=1e-6)


def test_full_recompute_runs_a_single_mlp_chunk_forward_twice_and_several_chunks_three_times(monkeypatch):
    # One chunk inside a full-layer checkpoint is not checkpointed again (the same activations would be
    # alive at the same time in its backward): forward + the layer's recompute. Several chunks are:
    # forward, the layer's recompute, each chunk's own recompute in backward. The same gradients.
    from model.glm5_next import Glm5NextLayer

    calls = []
    mlp = Glm5NextLayer._mlp
    monkeypatch.setattr(Glm5NextLayer, "_mlp", lambda self, x: calls.append(x.shape[0]) or mlp(self, x))
    ids = _ids(seed=1)
    full = dict(index_topk=32, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    layers = preset("tiny").num_layers
    for chunk, per_layer in ((0, [SEQ] * 2), (200, [200, SEQ - 200] * 3)):
        calls.clear()
        recomputed = _loss_and_grads(preset("tiny", mlp_chunk_tokens=chunk, **full), ids)
        assert sorted(calls) == sorted(per_layer * layers), (chunk, calls)
        _assert_same(_loss_and_grads(preset("tiny", index_topk=32, mlp_chunk_tokens=chunk), ids), recomputed)


def test_full_recompute_keeping_the_attention_output_is_bitwise_the_same_and_skips_its_recompute(monkeypatch):
    from kernels.dsa import sparse_attention

    calls = []
    forward = sparse_attention.torch_sparse_mla_fwd
    monkeypatch.setattr(sparse_attention, "torch_sparse_mla_fwd", lambda *a, **k: calls.append(1) or forward(*a, **k))
    ids = _ids()
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recomputed = _loss_and_grads(preset("tiny", **full), ids)
    runs_recomputed = len(calls)
    calls.clear()
    model = build_model(preset("tiny", recompute_keep_attention=True, **full), seed=3).train()
    loss = model(ids[:, :-1], labels=ids[:, 1:]).sum()
    loss.backward()
    kept = (loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    dsa_layers = sum(t == DSA for t in preset("tiny").layer_types)
    assert runs_recomputed == 2 * dsa_layers and len(calls) == dsa_layers   # forward + recompute vs forward only
    assert recomputed[0] == kept[0]
    assert all(torch.equal(recomputed[1][k], kept[1][k]) for k in recomputed[1])
    assert all(not layer.mixer.kept_attention for layer in model.layers if hasattr(layer.mixer, "kept_attention"))


def test_foreach_multi_tensor_ops_match_megatrons_per_tensor_fallbacks():
    # megatron's clip_grads / optimizer run their local (no TE, no Apex) l2-norm and scale inside
    # the block only when those are the ones in use; the foreach versions give the same values.
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from model.cpu_compat import _foreach_l2_norm, _foreach_scale, foreach_multi_tensor_ops, megatron_optimizer_on_cpu

    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(*shape, generator=gen) for shape in ((7, 3), (11,), (2, 5, 4))]
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    got, _ = _foreach_l2_norm(0, None, [grads], False)
    assert got.shape == (1,) and abs(got.item() - want.item()) <= 1e-6 * want.item()
    with megatron_optimizer_on_cpu():   # megatron's fallback allocates its result with device="cuda"
        ref, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    assert abs(got.item() - ref.item()) <= 1e-6 * want.item()
    scaled = [g.clone() for g in grads]
    _foreach_scale(0, None, [scaled, scaled], 0.25)
    assert all(torch.equal(s, g * 0.25) for s, g in zip(scaled, grads))
    half = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    _foreach_scale(0, None, [grads, half], 1.0)      # a copy with a cast, as megatron's main -> model params
    assert all(torch.equal(h, g.bfloat16()) for h, g in zip(half, grads))
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    with foreach_multi_tensor_ops():
        assert clip_grads.l2_norm_impl is _foreach_l2_norm and optimizer.multi_tensor_scale_impl is _foreach_scale
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm


def test_foreach_ops_keep_the_gradient_norm_on_the_device_and_clip_by_its_tensor_factor(monkeypatch):
    # With multi_tensor_scale_tensor provided, megatron returns the norm as a tensor (no host read)
    # and scales every gradient by min(1, clip / (norm + 1e-6)); a single rank's all-reduce is the identity.
    from megatron.core.optimizer import clip_grads

    from model.cpu_compat import foreach_multi_tensor_ops, megatron_optimizer_on_cpu

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *args, **kwargs: None)
    gen = torch.Generator().manual_seed(4)
    shapes = ((6, 5), (13,), (3, 2, 2))
    for clip in (0.5, 1e3):                         # clipped, and a factor of 1
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        grads64 = [p.grad.double().clone() for p in params]
        norm64 = torch.sqrt(sum((g ** 2).sum() for g in grads64))
        with megatron_optimizer_on_cpu(), foreach_multi_tensor_ops():
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
            assert torch.is_tensor(norm) and norm.dtype == torch.float32
            clip_grads.clip_grad_by_total_norm_fp32(params, clip, norm)
        assert abs(norm.item() - norm64.item()) <= 1e-6 * norm64.item()
        factor = min(1.0, clip / (norm64.item() + 1e-6))
        for p, g in zip(params, grads64):
            torch.testing.assert_close(p.grad.double(), g * factor, rtol=1e-6, atol=0)
    assert clip_grads.multi_tensor_scale_tensor_impl is None     # restored after the block
