"""RL fine-tuning stage: GRPO on DNA continuation, rollouts from the inference engine.

Continues from the SFT export (Hugging Face layout). Each step:

1. sample ``prompts_per_step`` prompts of ``prompt_len`` bases from the *training* split's
   shards (held-out chromosomes never reach this stage: the shards' eval split is not read),
   each followed in the genome by ``gen_len`` bases without a document boundary;
2. the engine (vLLM in production, the preset names it) generates ``group_size`` rollouts of
   ``gen_len`` tokens per prompt and returns each sampled token's log-prob;
3. reward against the reference continuation, group-normalized advantages, and the trainer
   (the same megatron glm5_next model as SFT) recomputes log-probs of the sampled tokens:
   policy, old policy (= policy before this step's update) and the frozen SFT reference;
4. one optimizer step on the GRPO loss (``tasks.grpo``: PPO clip, k3 KL to the reference,
   truncated importance weight trainer/engine);
5. the updated weights go to the engine in memory (``InferenceEngine.update_weights`` with
   the model's HF-named state dict), never by restarting it.

Metrics per step (JSON lines): reward mean/std, KL, clip fraction,
``rollout_train_logprobs_abs_diff`` mean/max (trainer vs engine on the sampled tokens),
tokens/s, step time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tasks import vocab
from tasks.atomic import atomic_output_dir, sha256_file
from tasks.grpo import GRPOConfig, continuation_reward, group_advantages, grpo_loss

log = logging.getLogger("megabase.rl")


class RLError(RuntimeError):
    """The RL stage cannot run (no usable prompt in the shards, a non-finite loss, ...)."""


@dataclass(frozen=True)
class RLConfig:
    """RL stage knobs (lengths in tokens = bases).

    Attributes:
        steps: optimizer steps.
        prompts_per_step: distinct prompts per step.
        group_size: rollouts per prompt (the GRPO group).
        prompt_len: bases of genome context given to the policy.
        gen_len: bases the policy generates (compared with the reference continuation).
        temperature: sampling temperature of the rollouts.
        reward: "match_fraction" or "prefix" (``tasks.grpo.continuation_reward``).
        lr: AdamW learning rate (0 keeps the weights: the weight-sync drift check).
        weight_decay: AdamW weight decay.
        grad_clip: max global grad norm.
        engine: inference engine ("vllm" | "transformers"); no fallback between them.
        seed: prompt sampling and rollout seeds.
        grpo: the objective's knobs.
    """

    steps: int = 4
    prompts_per_step: int = 2
    group_size: int = 4
    prompt_len: int = 256
    gen_len: int = 16
    temperature: float = 1.0
    reward: str = "match_fraction"
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    engine: str = "transformers"
    seed: int = 0
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


@dataclass(frozen=True)
class RLResult:
    """Where the RL output is: HF export (``hf/``), ``metrics.jsonl``, ``rollouts.jsonl``."""

    out_dir: Path
    export_dir: Path
    metrics: list[dict]


class PromptSampler:
    """Prompts + reference continuations from the train split's shards, deterministic by seed.

    Windows of ``prompt_len + gen_len`` tokens are drawn uniformly among positions whose whole
    window lies inside one document (no ``<sep>``) of one shard.
    """

    def __init__(self, shards_dir: Path, prompt_len: int, gen_len: int, seed: int):
        from tasks.pack import shard_token_stream

        manifest = json.loads((shards_dir / "manifest.json").read_text())
        self.window = prompt_len + gen_len
        self.prompt_len = prompt_len
        self.streams, self.starts, self.paths = [], [], []
        for shard in manifest["splits"]["train"]["shards"]:
            tokens, _ = shard_token_stream(shards_dir / shard["path"])
            # seps_before[i] = separators at positions < i; a window [s, s + window) is valid
            # when it holds none.
            if len(tokens) < self.window:
                continue
            seps_before = np.concatenate(([0], np.cumsum(tokens == vocab.SEP)))
            valid = np.flatnonzero(seps_before[self.window:] == seps_before[:-self.window])
            if len(valid):
                self.streams.append(tokens)
                self.starts.append(valid)
                self.paths.append(shard["path"])
        if not self.streams:
            raise RLError(f"{shards_dir}: no train window of {self.window} tokens inside one document")
        self.rng = np.random.default_rng(seed)

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int]]]:
        """``n`` prompts and continuations.

        Returns:
            (prompts int64 ``[n, prompt_len]``, continuations int64 ``[n, gen_len]``,
            origins: (shard path, token offset of the prompt in the shard's stream) each).
        """
        prompts, continuations, origins = [], [], []
        for _ in range(n):
            i = int(self.rng.integers(len(self.streams)))
            start = int(self.starts[i][self.rng.integers(len(self.starts[i]))])
            window = self.streams[i][start : start + self.window].astype(np.int64)
            prompts.append(window[: self.prompt_len])
            continuations.append(window[self.prompt_len :])
            origins.append((self.paths[i], start))
        return np.stack(prompts), np.stack(continuations), origins


def _sequence_logprobs(model, sequences: torch.Tensor, gen_len: int) -> torch.Tensor:
    """Trainer log-probs ``[n, gen_len]`` of the last ``gen_len`` tokens of ``sequences [n, s]``.

    Only the positions that predict generated tokens reach the output head (chunked NLL of
    ``model.logprobs``); the prompt's hidden states are not projected to the vocabulary.
    """
    from model.logprobs import chunked_token_nll

    hidden = model.hidden_states(sequences)[-gen_len - 1 : -1]          # [gen_len, n, h]
    labels = sequences[:, -gen_len:].transpose(0, 1).contiguous()       # [gen_len, n]
    return -chunked_token_nll(model, hidden, labels, model.logits_chunk_tokens).transpose(0, 1)


def rl(sft_export: str | os.PathLike, shards_dir: str | os.PathLike, cfg: RLConfig,
       out_dir: str | os.PathLike, preset: str = "local-cpu") -> RLResult:
    """Run GRPO from an SFT export; write the final HF export and per-step metrics.

    Args:
        sft_export: HF-layout checkpoint directory (``config.json`` + safetensors).
        shards_dir: pack output (only the train split is read).
        cfg: RL configuration.
        out_dir: output directory (atomic): ``hf/`` export, ``metrics.jsonl``, ``rollouts.jsonl``,
            ``rl_config.json``.
        preset: recorded in the export metadata.

    Raises:
        RLError: no prompt window in the shards, or a non-finite loss (names the step).
        tasks.engines.EngineError: the engine cannot be built or rejects a request.
    """
    from model.convert import export_metadata, hf_state_dict, hf_to_megatron, load_hf_checkpoint, load_megatron_state, save_hf_checkpoint
    from model.glm5_next import build_model
    from tasks.engines import SamplingConfig, make_engine

    sft_export, shards_dir = Path(sft_export), Path(shards_dir)
    sampler = PromptSampler(shards_dir, cfg.prompt_len, cfg.gen_len, cfg.seed)
    model_cfg, text_state, vision_state = load_hf_checkpoint(sft_export)
    policy = build_model(model_cfg, seed=cfg.seed)
    load_megatron_state(policy, hf_to_megatron(text_state, model_cfg))
    reference = build_model(model_cfg, seed=cfg.seed)
    load_megatron_state(reference, hf_to_megatron(text_state, model_cfg))
    reference.eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    max_len = cfg.prompt_len + cfg.gen_len + 1

    metrics: list[dict] = []
    with atomic_output_dir(out_dir) as work, make_engine(cfg.engine, sft_export, "float32", max_len) as engine:
        (work / "rl_config.json").write_text(json.dumps(asdict(cfg), indent=1))
        log_file = open(work / "metrics.jsonl", "w")
        rollout_file = open(work / "rollouts.jsonl", "w")
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            prompts, truth, origins = sampler.sample(cfg.prompts_per_step)
            repeated = np.repeat(prompts, cfg.group_size, axis=0)
            sampling = SamplingConfig(max_new_tokens=cfg.gen_len, temperature=cfg.temperature,
                                      seed=cfg.seed * 1_000_003 + step * 10_007)
            rollouts = engine.generate(list(repeated), sampling)
            generated = np.stack([r.tokens for r in rollouts])
            rollout_logp = torch.from_numpy(np.stack([r.logprobs for r in rollouts]))
            rewards = torch.tensor([
                continuation_reward(g, t, cfg.reward) for g, t in zip(generated, np.repeat(truth, cfg.group_size, 0))
            ], dtype=torch.float32).view(cfg.prompts_per_step, cfg.group_size)
            advantages = group_advantages(rewards, cfg.grpo).flatten()

            sequences = torch.from_numpy(np.concatenate([repeated, generated], axis=1))
            policy.train()
            logp = _sequence_logprobs(policy, sequences, cfg.gen_len)
            with torch.no_grad():
                logp_ref = _sequence_logprobs(reference, sequences, cfg.gen_len)
            mask = torch.ones_like(logp, dtype=torch.bool)
            loss, stats = grpo_loss(logp, logp.detach(), logp_ref, rollout_logp, advantages, mask, cfg.grpo)
            if not torch.isfinite(loss):
                raise RLError(f"non-finite GRPO loss {loss.item()} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            optimizer.step()
            engine.update_weights({**hf_state_dict(policy), **vision_state})

            seconds = time.perf_counter() - t0
            row = {
                "step": step, "loss": loss.item(), "reward_mean": rewards.mean().item(),
                "reward_std": rewards.std(unbiased=False).item(), "grad_norm": float(grad_norm),
                **stats, "tokens_per_s": sequences.numel() / seconds, "step_time_s": seconds,
                "engine": engine.description,
            }
            metrics.append(row)
            log_file.write(json.dumps(row) + "\n")
            for k, (tokens, reward) in enumerate(zip(generated, rewards.flatten().tolist())):
                shard, offset = origins[k // cfg.group_size]
                rollout_file.write(json.dumps({"step": step, "shard": shard, "offset": offset,
                                               "prompt_len": cfg.prompt_len, "generated": tokens.tolist(),
                                               "reward": reward}) + "\n")
            log.info("rl step %d: reward %.3f kl %.2e gap %.2e", step, row["reward_mean"], row["kl"],
                     row["rollout_train_logprobs_abs_diff_mean"])
        log_file.close()
        rollout_file.close()
        meta = export_metadata(preset, sha256_file(shards_dir / "manifest.json"))
        save_hf_checkpoint(hf_state_dict(policy), model_cfg, work / "hf", meta, vision_state=vision_state,
                           vision_config=json.loads((sft_export / "config.json").read_text()).get("vision_config"))
    out_dir = Path(out_dir)
    return RLResult(out_dir=out_dir, export_dir=out_dir / "hf", metrics=metrics)


# ---- Flyte task: resources and cache version only; the logic is rl() above ----------------

from flytekit import Cache, task  # noqa: E402

from workflows.caching import (  # noqa: E402
    HashedDir, as_output, code_version, hf_export, manifest_sha256, resource_kwargs, stage_output_dir,
)
from workflows.presets import active_preset  # noqa: E402

def preset_rl_config(preset) -> RLConfig:
    """The RL configuration a preset implies (``preset.rl`` plus its engine)."""
    spec = preset.rl
    return RLConfig(steps=spec.steps, prompts_per_step=spec.prompts_per_step, group_size=spec.group_size,
                    prompt_len=spec.prompt_len, gen_len=spec.gen_len, temperature=spec.temperature,
                    lr=spec.lr, engine=preset.engine, grpo=GRPOConfig(kl_coef=spec.kl_coef))


RL_VERSION = code_version("tasks/rl.py", "tasks/grpo.py", "tasks/engines.py", "model", "kernels")


@task(cache=Cache(version=RL_VERSION), **resource_kwargs(active_preset().train_resources))
def rl_task(shards: HashedDir, sft: HashedDir, cfg: RLConfig) -> HashedDir:
    """Flyte wrapper of :func:`rl`: GRPO from the SFT output's HF export (``sft/hf``).

    Runs as one process (one GPU of the node's request) with the engine beside the trainer
    (colocated); multi-rank RL with context parallelism for long prompts is not built yet. The
    output holds ``hf/`` (the RL export), ``metrics.jsonl`` and ``rollouts.jsonl``.
    """
    out = stage_output_dir("rl", RL_VERSION, shards=manifest_sha256(shards), sft=manifest_sha256(sft), cfg=asdict(cfg))
    rl(hf_export(sft.download()), shards.download(), cfg, out, preset=active_preset().name)
    return as_output(out)
