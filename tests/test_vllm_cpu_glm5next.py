"""vLLM (vllm-cpu 0.32.0 + the megabase_glm5next_cpu plugin) against transformers' plain-torch
glm5_next on the same tiny checkpoint: prompt log-probs at 4k and 16k tokens, greedy decoding,
batched and mixed prefill/decode steps, bf16, and the mHC norm weight and eps (through
in-place ``reload_weights`` and a fresh load).

The tiny checkpoint has every block kind of GLM-5.3-Flash: KDA layers, a DSA layer with its
own k-pool indexer and one that shares it, dense MLP and sigmoid MoE with a shared expert,
mHC with 2 streams, NoPE MLA with kv_lora_rank 512. Weights are re-drawn at unit scale (and
norm weights away from 1) so that log-probs depend on every part. With ``index_topk=64``,
``index_kpool=8`` a 4k-token query keeps 8 of up to 512 pools (16k: of 2048): the selection
is sparse. Engines start with vLLM's defaults (prefix caching requested; chunked prefill on,
which the plugin's platform keeps on every host).

Chunked prefill: the same prompts prefilled whole and over steps of 4096, 1000 and 777 tokens,
for a KDA-only, a DSA-only and the hybrid model, give the one-shot log-probs within 1e-5 and
greedy decoding after them is identical. vLLM branches on the host CPU's AMX support
(vllm/platforms/cpu.py): every test here runs with that branch pinned (``pinned_amx``), and
one checks that both branches schedule glm5_next alike.
"""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch

for _key, _value in dict(
    VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1"
).items():
    os.environ.setdefault(_key, _value)

vllm = pytest.importorskip("vllm")
from safetensors.torch import load_file  # noqa: E402
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

PROMPT_LEN = 4096
LONG_PROMPT_LEN = 16384
DECODE_LEN = 64
TINY_TEXT_CONFIG = dict(
    vocab_size=16,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=512,
    q_lora_rank=32,
    qk_rope_head_dim=0,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=64,
    index_head_dim=128,
    index_n_heads=4,
    index_kpool=8,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    linear_head_dim=32,
    linear_num_heads=2,
    hc_mult=2,
    max_position_embeddings=65536,
    pad_token_id=0,
)
TINY_VISION_CONFIG = dict(
    depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, projection_intermediate_size=64
)


def build_tiny_checkpoint(path, seed: int = 0, variant: str = "hybrid") -> None:
    """Save a tiny ``Glm5NextForConditionalGeneration`` with unit-scale random weights to ``path``
    (``variant``: a key of :data:`LAYER_VARIANTS`)."""
    torch.manual_seed(seed)
    text_config = TINY_TEXT_CONFIG | LAYER_VARIANTS[variant]
    config = Glm5NextConfig(text_config=text_config, vision_config=TINY_VISION_CONFIG)
    model = Glm5NextForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.3 * noise)
            elif "A_log" in name:
                param.copy_(2 * torch.rand(param.shape, generator=generator))
            elif "embed" in name or ("_hc." in name and not name.endswith(".fn")):
                param.copy_(noise)
            elif param.dim() >= 2:
                param.copy_(noise / math.sqrt(param.shape[-1]))
            else:
                param.copy_(0.3 * noise)
    model.save_pretrained(path)


def perturb_mhc_norm_weights(src, dst) -> None:
    """Copy checkpoint ``src`` to ``dst`` with the block-input RMSNorm weights of every layer
    (applied to the mHC-collapsed input) scaled per channel."""
    model = Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.mul_(1 + 0.5 * torch.randn(norm.weight.shape, generator=generator))
    model.save_pretrained(dst)


LAYER_VARIANTS = {
    "hybrid": {},
    "kda": dict(layer_types=["linear_attention"] * 4, indexer_types=["full"] * 4),
    "dsa": dict(layer_types=["indexed_attention"] * 4, indexer_types=["full", "shared", "full", "shared"]),
}
"""Text-config changes of the tiny checkpoint: the hybrid (KDA, DSA, shared DSA, KDA), KDA only, DSA only."""


@pytest.fixture(autouse=True, scope="module")
def pinned_amx():
    """vLLM's host branch pinned to "no AMX" for every test here (engines run in this process)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        yield patch


def prompt_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, TINY_TEXT_CONFIG["vocab_size"], (length,), generator=generator).tolist()


def transformers_reference(path, ids: list[int], dtype: torch.dtype, decode_len: int = 0):
    """Prompt log-probs ``[len(ids) - 1]`` (float32) of transformers' plain-torch forward (top-k
    ties to the lower index), and
    its greedy continuation of ``decode_len`` tokens with the smallest top-1/top-2 logit margin."""
    from tasks.engines import _lower_index_first_topk

    model = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    # Indexer scores tie exactly (ReLU); hold transformers' topk to the project's tie rule
    # (lower index first), which the trainer and the plugin follow.
    with torch.no_grad(), _lower_index_first_topk():
        out = model(input_ids=torch.tensor([ids]), use_cache=decode_len > 0)
        logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
        prompt = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        tokens, margin = [], math.inf
        logits, cache = out.logits[0, -1].float(), out.past_key_values
        for _ in range(decode_len):
            top2 = logits.topk(2).values
            margin = min(margin, (top2[0] - top2[1]).item())
            tokens.append(int(logits.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            logits, cache = out.logits[0, -1].float(), out.past_key_values
    return prompt, tokens, margin


def vllm_prompt_logprobs(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """vLLM's log-prob of every prompt token after the first, per prompt (float32)."""
    params = vllm.SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [
        torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])])
        for out, ids in zip(outputs, prompts)
    ]


def make_llm(path, dtype: str, max_model_len: int = LONG_PROMPT_LEN + 64, **kwargs):
    return vllm.LLM(
        model=str(path),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=0,
        **kwargs,
    )


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, plain_torch_transformers):
    path = tmp_path_factory.mktemp("glm5next_tiny")
    build_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def fp32_reference(checkpoint):
    ids = prompt_ids(PROMPT_LEN, seed=3)
    prompt, tokens, margin = transformers_reference(checkpoint, ids, torch.float32, DECODE_LEN)
    return ids, prompt, tokens, margin


@pytest.fixture(scope="module")
def fp32_llm(checkpoint):
    llm = make_llm(checkpoint, "float32")
    yield llm
    del llm
    gc.collect()


def test_prompt_logprobs_match_transformers_fp32(fp32_llm, fp32_reference):
    ids, reference, _, _ = fp32_reference
    assert PROMPT_LEN > 8 * TINY_TEXT_CONFIG["index_topk"], "prompt too short for the selection to be sparse"
    (got,) = vllm_prompt_logprobs(fp32_llm, [ids])
    diff = (got - reference).abs()
    assert diff.mean() <= 1e-4 and diff.max() <= 1e-3, (diff.mean().item(), diff.max().item())


def test_prompt_logprobs_match_transformers_fp32_16k(fp32_llm, checkpoint):
    ids = prompt_ids(LONG_PROMPT_LEN, seed=4)
    reference, _, _ = transformers_reference(checkpoint, ids, torch.float32)
    (got,) = vllm_prompt_logprobs(fp32_llm, [ids])
    diff = (got - reference).abs()
    assert diff.mean() <= 1e-4 and diff.max() <= 1e-3, (diff.mean().item(), diff.max().item())


def test_greedy_decode_matches_transformers_fp32(fp32_llm, fp32_reference):
    ids, _, reference_tokens, margin = fp32_reference
    # The test's premise: no near-tie that float32 rounding could flip.
    assert margin > 1e-4, f"seed gives a near tie (margin {margin}); pick another prompt seed"
    params = vllm.SamplingParams(temperature=0.0, max_tokens=DECODE_LEN, ignore_eos=True, detokenize=False)
    (out,) = fp32_llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference_tokens


def test_batched_requests_match_each_alone(fp32_llm):
    long_ids, short_ids = prompt_ids(1500, seed=11), prompt_ids(700, seed=12)
    together = vllm_prompt_logprobs(fp32_llm, [long_ids, short_ids])
    alone = [vllm_prompt_logprobs(fp32_llm, [ids])[0] for ids in (long_ids, short_ids)]
    for batched, single in zip(together, alone):
        assert (batched - single).abs().max() <= 1e-5


def test_mhc_norm_weight_changes_vllm_output(checkpoint, fp32_llm, tmp_path):
    """vllm-cpu's fused mHC ops ignore norm_weight: the plugin must not. With the block-input
    norm weights perturbed (pushed by vLLM's in-place ``reload_weights``, the RL weight-sync
    path), vLLM must follow transformers on the perturbed checkpoint, far from the
    unperturbed model's log-probs (which an ignored weight would reproduce); reloading the
    original tensors must restore the original log-probs."""
    perturbed = tmp_path / "perturbed"
    perturb_mhc_norm_weights(checkpoint, perturbed)
    ids = prompt_ids(512, seed=5)
    base, _, _ = transformers_reference(checkpoint, ids, torch.float32)
    reference, _, _ = transformers_reference(perturbed, ids, torch.float32)
    assert (reference - base).abs().mean() > 1e-2, "perturbation too small to detect"
    try:
        fp32_llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(load_file(perturbed / "model.safetensors").items())}
        )
        (got,) = vllm_prompt_logprobs(fp32_llm, [ids])
    finally:
        fp32_llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(load_file(checkpoint / "model.safetensors").items())}
        )
    (restored,) = vllm_prompt_logprobs(fp32_llm, [ids])
    assert (got - base).abs().mean() > 1e-2
    assert (got - reference).abs().max() <= 1e-3
    assert (restored - base).abs().max() <= 1e-3


# The tests below start engines of their own. They must not use ``fp32_llm`` afterwards:
# shutting an in-process engine down tears down vLLM's global parallel state.


def test_prompt_logprobs_bf16_within_model_bf16_spread(checkpoint, fp32_reference):
    """bf16 vLLM vs float32 transformers, bounded by 2x transformers' own bf16-vs-fp32 spread."""
    ids, fp32_logprobs, _, _ = fp32_reference
    ids, fp32_logprobs = ids[:2048], fp32_logprobs[:2047]
    hf_bf16, _, _ = transformers_reference(checkpoint, ids, torch.bfloat16)
    spread = (hf_bf16 - fp32_logprobs).abs().mean().item()
    llm = make_llm(checkpoint, "bfloat16", max_model_len=2048 + 64)
    try:
        (got,) = vllm_prompt_logprobs(llm, [ids])
    finally:
        del llm
        gc.collect()
    error = (got - fp32_logprobs).abs().mean().item()
    assert error <= 2 * spread, (error, spread)


def test_rms_norm_eps_is_honoured(checkpoint, tmp_path):
    """The other half of the fused-mHC defect (``norm_eps`` ignored): with ``rms_norm_eps``
    raised to a value that moves every norm, vLLM must still follow transformers."""
    model = Glm5NextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model.config.text_config.rms_norm_eps = 0.5
    large_eps = tmp_path / "large_eps"
    model.save_pretrained(large_eps)
    ids = prompt_ids(512, seed=6)
    base, _, _ = transformers_reference(checkpoint, ids, torch.float32)
    reference, _, _ = transformers_reference(large_eps, ids, torch.float32)
    assert (reference - base).abs().mean() > 1e-2, "eps change too small to detect"
    llm = make_llm(large_eps, "float32", max_model_len=1024)
    try:
        (got,) = vllm_prompt_logprobs(llm, [ids])
    finally:
        del llm
        gc.collect()
    assert (got - reference).abs().max() <= 1e-3



def test_mixed_prefill_and_decode_step_matches_each_alone(checkpoint):
    """Two 1500-token prompts exceed one step's 2048-token budget, so the second prefills in
    the step where the first decodes: KDA states and DSA caches must stay per request."""
    prompts = [prompt_ids(1500, seed=21), prompt_ids(1500, seed=22)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True, detokenize=False)
    llm = make_llm(checkpoint, "float32", max_model_len=2048)
    try:
        together = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        alone = [llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0] for ids in prompts]
    finally:
        del llm
        gc.collect()
    for batched, single in zip(together, alone):
        assert list(batched.outputs[0].token_ids) == list(single.outputs[0].token_ids)
        for step_batched, step_single, token in zip(
            batched.outputs[0].logprobs, single.outputs[0].logprobs, single.outputs[0].token_ids
        ):
            assert abs(step_batched[token].logprob - step_single[token].logprob) <= 1e-5


def test_short_max_model_len_block_size_not_a_multiple_of_16(checkpoint):
    """max_model_len 106 caps vLLM's block size at 106, and the caches are bound with 128-token
    kernel blocks: cache rows must follow the bound tensor's block size (the RL engine's
    prompt + generation length; a 0.4-nat gap before the fix)."""
    ids = prompt_ids(105, seed=8)
    reference, _, _ = transformers_reference(checkpoint, ids, torch.float32)
    llm = make_llm(checkpoint, "float32", max_model_len=106)
    try:
        assert llm.llm_engine.vllm_config.cache_config.block_size % 16, "premise: a block size vLLM must round"
        (got,) = vllm_prompt_logprobs(llm, [ids])
    finally:
        del llm
        gc.collect()
    assert (got - reference).abs().max() <= 1e-3


# ---- chunked prefill -------------------------------------------------------------------------

STEP_BUDGETS = (None, 4096, 1000, 777)
"""Engine step budgets (``max_num_batched_tokens``) of the chunked-prefill runs; None: the whole
prompt in one step (chunked prefill off). 1000 and 777 put step boundaries inside 64-token KDA
chunks and 8-token k-pools."""


@pytest.fixture(scope="module", params=sorted(LAYER_VARIANTS))
def chunked_runs(request, tmp_path_factory, plain_torch_transformers):
    """Per step budget: prompt log-probs of a 4k and a 16k prompt and a 64-token greedy decode
    after the 4k prompt, for one layer variant; and transformers' 4k and 16k log-probs."""
    variant = request.param
    path = tmp_path_factory.mktemp(f"glm5next_{variant}")
    build_tiny_checkpoint(path, variant=variant)
    prompts = [prompt_ids(PROMPT_LEN, seed=3), prompt_ids(LONG_PROMPT_LEN, seed=4)]
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=DECODE_LEN, ignore_eos=True, detokenize=False)
    runs = {}
    for budget in STEP_BUDGETS:
        kwargs = (dict(enable_chunked_prefill=False) if budget is None
                  else dict(enable_chunked_prefill=True, max_num_batched_tokens=budget))
        llm = make_llm(path, "float32", **kwargs)
        try:
            scheduler = llm.llm_engine.vllm_config.scheduler_config
            assert scheduler.enable_chunked_prefill == (budget is not None)
            if budget is not None:
                assert scheduler.max_num_batched_tokens == budget
            logprobs = vllm_prompt_logprobs(llm, prompts)
            (decoded,) = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        finally:
            shutdown(llm)
        runs[budget] = (logprobs, list(decoded.outputs[0].token_ids))
    reference = [transformers_reference(path, ids, torch.float32)[0] for ids in prompts]
    return variant, runs, reference


@pytest.mark.parametrize("budget", STEP_BUDGETS[1:])
def test_chunked_prefill_matches_one_shot_prefill(chunked_runs, budget):
    variant, runs, _ = chunked_runs
    (one_shot, one_shot_decode), (chunked, chunked_decode) = runs[None], runs[budget]
    for length, whole, split in zip((PROMPT_LEN, LONG_PROMPT_LEN), one_shot, chunked):
        diff = (split - whole).abs()
        print(f"{variant}, {length} tokens, {budget}-token steps: max |diff| {diff.max().item():.2e}")
        assert diff.max() <= 1e-5, (variant, length, budget, diff.max().item(), int(diff.argmax()))
    assert chunked_decode == one_shot_decode


@pytest.mark.parametrize("budget", STEP_BUDGETS)
def test_chunked_prefill_matches_transformers(chunked_runs, budget):
    variant, runs, reference = chunked_runs
    for length, got, expected in zip((PROMPT_LEN, LONG_PROMPT_LEN), runs[budget][0], reference):
        diff = (got - expected).abs()
        print(f"{variant}, {length} tokens, {budget or 'whole'}-token steps vs transformers: "
              f"mean |diff| {diff.mean().item():.2e} max {diff.max().item():.2e}")
        assert diff.mean() <= 1e-4 and diff.max() <= 1e-3, (variant, length, budget, diff.mean().item(),
                                                             diff.max().item())


@pytest.mark.parametrize("amx", [False, True])
def test_glm5next_scheduling_does_not_depend_on_amx(checkpoint, pinned_amx, amx):
    """vllm-cpu switches chunked prefill off and forces 16-token blocks for MLA models on CPUs
    without AMX; the plugin's platform keeps glm5_next's settings on both kinds of host."""
    pinned_amx.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    try:
        for kwargs, expected in ((dict(enable_chunked_prefill=True, max_num_batched_tokens=777), (True, 777)),
                                 (dict(), (True, None))):
            llm = make_llm(checkpoint, "float32", max_model_len=2048, **kwargs)
            try:
                config = llm.llm_engine.vllm_config
                chunked, budget = expected
                assert config.scheduler_config.enable_chunked_prefill is chunked
                if budget is not None:
                    assert config.scheduler_config.max_num_batched_tokens == budget
                assert config.cache_config.block_size == 128
            finally:
                shutdown(llm)
    finally:
        pinned_amx.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


# ---- seeded rollouts (the RL stage's engine) ----------------------------------------------------


@pytest.mark.parametrize("amx", [False, True])
def test_seeded_rollouts_beyond_one_engine_step_on_either_host(checkpoint, pinned_amx, amx):
    """The local RL step's shape: 8 seeded rollouts of 1024-token prompts, more prompt tokens than
    one engine step takes. On a CPU with AMX (vllm-cpu kept chunked prefill on) one prompt was
    split over two steps and vLLM's generator rewind killed the engine core; the RL stage's
    engine options prefill whole prompts, and the same seeds give the same rollouts."""
    from tasks.engines import SamplingConfig, make_engine
    from tasks.presets import get_preset
    from tasks.rl import preset_rl_config, rollout_engine_options

    pinned_amx.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = preset_rl_config(get_preset("local-cpu"))
    prompts = [prompt_ids(cfg.prompt_len, seed=30 + i) for i in range(cfg.prompts_per_step * cfg.group_size)]
    sampling = SamplingConfig(max_new_tokens=cfg.gen_len, temperature=cfg.temperature, seed=7)
    try:
        engine = make_engine("vllm", checkpoint, "float32", cfg.prompt_len + cfg.gen_len + 1,
                             **rollout_engine_options(cfg))
        with engine:
            assert sum(map(len, prompts)) > engine.max_num_batched_tokens, "premise: the batch exceeds one step"
            first, second = (engine.generate(prompts, sampling) for _ in range(2))
    finally:
        pinned_amx.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert [list(a.tokens) for a in first] == [list(b.tokens) for b in second]
    assert all(len(a.tokens) == cfg.gen_len for a in first)
    assert len({tuple(a.tokens) for a in first}) > 1


def test_seeded_sampling_that_would_split_a_prefill_is_refused_with_a_clear_error(checkpoint):
    from tasks.engines import EngineError, SamplingConfig, VLLMEngine

    prompts = [prompt_ids(1024, seed=40 + i) for i in range(8)]
    with VLLMEngine(checkpoint, "float32", 1100, chunked_prefill=True, max_num_batched_tokens=4096) as engine:
        with pytest.raises(EngineError, match="chunked_prefill=False"):
            engine.generate(prompts, SamplingConfig(max_new_tokens=4, seed=7))
        # One engine step holds these: nothing is split, seeded sampling runs.
        (out,) = engine.generate(prompts[:1], SamplingConfig(max_new_tokens=4, seed=7))
        assert len(out.tokens) == 4
