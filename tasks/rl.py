"""RL fine-tuning stage: GRPO on DNA continuation, rollouts from the inference engine.

Continues from the SFT export (Hugging Face layout) on every rank of a torch elastic job
(kfpytorch ``Elastic``), with SFT's trainer: megatron glm5_next in the run's TP/CP/EP layout,
megatron DDP and the distributed Adam (:func:`tasks.trainer.build_trainer`). Each step:

1. every rank samples the same ``prompts_per_step`` prompts of ``prompt_len`` bases from the
   *training* split's shards (:class:`tasks.windows.TrainShards`: held-out chromosomes never
   reach this stage, the shards' eval split is not opened), each followed in the genome by ``gen_len`` bases without a document
   boundary;
2. rank 0's engine (vLLM in production, the preset names it) generates ``group_size``
   rollouts of ``gen_len`` tokens per prompt with each sampled token's log-prob, and
   broadcasts them;
3. reward against the reference continuation (``tasks.grpo``: why this reward) and
   group-normalized advantages (every rank);
4. the trainer scores the sampled tokens under the policy before this step's updates
   (``logp_old``) and the frozen SFT reference, both restricted to A/C/G/T at the sampling
   temperature as the engine sampled (:func:`model.logprobs.restricted_token_logprobs`);
   DP ranks take their rollouts, CP ranks their contiguous slice of each sequence
   (:class:`LocalTokens`);
5. ``epochs`` passes over ``mini_batches`` mini-batches of the rollouts, one optimizer step
   each (SkyRL's ``update_epochs_per_batch`` and policy mini-batches), on the GRPO loss
   (``tasks.grpo``: PPO clip against ``logp_old`` -- it acts from the second update of a step
   on -- k3 KL to the reference, truncated importance weight trainer/engine), summed per token
   on each rank and divided by the token count of the DP x CP group (``finalize_model_grads``);
6. the updated weights go to the engine (``InferenceEngine.update_weights`` with the model's
   HF-named state dict, gathered over TP/EP), never by restarting it.

Checkpoints (``checkpoint_dir``): megatron distributed checkpoints of the policy, optimizer,
scheduler, RNG and the prompt sampler's state, every ``checkpoint_every`` steps and at the
end; a ``latest`` pointer resumes the run, and the engine then takes the checkpoint's weights.

Metrics per step (JSON lines, ``step`` counted from 1): reward mean/std, KL and clip fraction
(over the step's updates), TIS weight mean/min/max, SkyRL's ``rollout_train_logprobs_abs_diff``
mean/max (``|logp_old - logp_rollout|`` on the sampled tokens: the trainer-vs-engine gap before
the step's updates), tokens/s, step time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tasks import vocab
from tasks.atomic import atomic_output_dir, keep_records_through, sha256_file
from tasks.grpo import GRPOConfig, continuation_reward, group_advantages, grpo_token_terms

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
        temperature: sampling temperature of the rollouts (> 0); the trainer's log-probs use it too.
        reward: "match_fraction" or "prefix" (``tasks.grpo.continuation_reward``).
        mini_batches: optimizer steps per pass over a step's rollouts (the rollouts split into
            this many mini-batches; ``prompts_per_step x group_size`` must divide by
            ``mini_batches x DP``).
        epochs: passes over a step's rollouts. ``mini_batches x epochs`` updates per step; with
            one update the PPO ratio is 1 and the clip never acts.
        engine_dtype: the rollout engine's dtype ("bfloat16" as on a cluster: the importance
            weights then correct a real trainer/engine mismatch; "float32" for a bit-close engine).
        micro_batch_rollouts: rollouts per forward/backward on each DP rank (gradients accumulate
            over the micro-batches of a mini-batch, one optimizer step per mini-batch); 0: a whole
            mini-batch at once. Bounds activation memory: the memory plan counts one micro-batch.
        dtype: trainer parameters, "float32" or "bfloat16" (master weights and Adam stay float32).
        recompute: "none" | "selective" | "full", as in SFT (``recompute_modules`` for selective).
        mlp_chunk_tokens: sequence-chunked MLP/MoE in training (0: whole sequence), as in SFT.
        lr: Adam learning rate, constant (0 keeps every weight, with ``expert_bias_update_rate``
            0: the weight-sync drift check).
        expert_bias_update_rate: the MoE routers' aux-loss-free balancing step per update
            (megatron ``moe_router_bias_update_rate``; it moves ``e_score_correction_bias``
            whatever ``lr`` is). 0 by default: RL keeps the expert bias SFT balanced, as
            DeepSeek-V3 sets the bias update speed to 0 for the last 500B tokens of its
            training (arXiv 2412.19437, sec. 4.2), so the reference, the engine and the policy
            route alike unless the weights themselves move.
        val_prompts: fixed prompts (drawn once from the train split with seed ``seed + 1``, the
            held-out chromosome never) on which every step, before its rollouts, the policy's
            teacher-forced expected reward is measured: the mean over the ``gen_len`` reference
            bases of the probability the policy, restricted to A/C/G/T at ``temperature``,
            gives each base after the true bases before it (an N scores 0). That is the exact
            expected match of the first sampled base and of every base whose predecessors
            matched: the reward's trend without sampling noise (``val_expected_reward``;
            ``reward="match_fraction"`` only). 0: not measured.
        weight_decay: Adam weight decay.
        grad_clip: max global grad norm.
        engine: inference engine ("vllm" | "transformers"); no fallback between them.
        seed: prompt sampling and rollout seeds.
        grpo: the objective's knobs.
        tensor_parallel, context_parallel, expert_parallel: the trainer's megatron layout, as
            in SFT; ``prompt_len + gen_len`` splits over the CP ranks, the rollouts over DP.
        checkpoint_dir: directory of distributed checkpoints (``tasks.checkpoint.Checkpointer``); a
            ``latest`` pointer there resumes the run. Empty: no checkpoints.
        checkpoint_every: save every N steps (and at the end); 0: only at the end.
        keep_checkpoints: most recent checkpoints kept.
        engine_gpu_memory_fraction: on a GPU, the share of rank 0's device the colocated vLLM
            engine may take (``gpu_memory_utilization``); the trainer keeps the rest.
        engine_tensor_parallel: vLLM tensor parallelism of the rollout engine on a GPU node (a
            model larger than one device: the node's GPUs, shared with the trainer ranks).
        gc_interval: Python's garbage collector is off in the step loop and collects every N steps
            on every rank (``tasks.trainer.ManualGC``); 0 leaves it on.
    """

    steps: int = 4
    prompts_per_step: int = 2
    group_size: int = 4
    prompt_len: int = 256
    gen_len: int = 16
    temperature: float = 1.0
    reward: str = "match_fraction"
    mini_batches: int = 2
    epochs: int = 2
    engine_dtype: str = "bfloat16"
    micro_batch_rollouts: int = 0
    dtype: str = "float32"
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("moe",)
    mlp_chunk_tokens: int = 0
    lr: float = 1e-5
    expert_bias_update_rate: float = 0.0
    val_prompts: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    engine: str = "transformers"
    seed: int = 0
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    tensor_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    engine_gpu_memory_fraction: float = 0.3
    engine_tensor_parallel: int = 1
    gc_interval: int = 50


@dataclass(frozen=True)
class RLResult:
    """Where the RL output is: HF export (``hf/``), ``metrics.jsonl``, ``rollouts.jsonl``."""

    out_dir: Path
    export_dir: Path
    metrics: list[dict]


class PromptSampler:
    """Prompts + reference continuations from the train split's shards, deterministic by seed.

    Windows of ``prompt_len + gen_len`` tokens are drawn uniformly among positions whose whole
    window lies inside one document (no ``<sep>``) of one shard. Every rank of a job draws the
    same prompts (same seed); :attr:`state` / :meth:`restore` carry the position over a resume.
    """

    def __init__(self, shards_dir: Path, prompt_len: int, gen_len: int, seed: int):
        from tasks.windows import TrainShards

        data = TrainShards(shards_dir)
        manifest = data.manifest
        self.window = prompt_len + gen_len
        self.prompt_len = prompt_len
        self.streams, self.starts, self.paths = [], [], []
        for i, shard in enumerate(data.shards):
            tokens, _ = data.stream(i)
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
        self.fingerprint = f"{manifest.get('sha256', '')}:{'|'.join(self.paths)}:{prompt_len}+{gen_len}:{seed}"

    @property
    def state(self) -> dict:
        """The generator's state (JSON-able), to store in a checkpoint."""
        return self.rng.bit_generator.state

    def restore(self, state: dict) -> None:
        """Continue from a :attr:`state` taken earlier."""
        self.rng.bit_generator.state = state

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


@dataclass(frozen=True)
class LocalTokens:
    """This rank's share of a batch of sequences ``[N, S]`` whose last ``gen_len`` tokens were sampled.

    DP ranks take rows ``dp_rank::dp_size``; CP ranks take the contiguous columns
    ``[cp_rank * S / cp, (cp_rank + 1) * S / cp)`` (the SFT split). Position ``p`` predicts
    token ``p + 1``; the sampled tokens are predicted by positions ``S - gen_len - 1 ... S - 2``,
    of which this rank holds local positions ``positions`` = generated tokens ``tokens``.
    """

    rows: slice
    ids: np.ndarray          # int64 [n, S / cp]
    labels: np.ndarray       # int64 [n, S / cp]: next token (0 past the end, never scored)
    positions: slice         # local positions that predict a sampled token
    tokens: slice            # which of the gen_len sampled tokens they predict

    @classmethod
    def split(cls, sequences: np.ndarray, gen_len: int, dp_rank: int, dp_size: int, cp_rank: int,
              cp_size: int) -> "LocalTokens":
        n, s = sequences.shape
        if s % cp_size or n % dp_size:
            raise RLError(f"a batch of {n} sequences x {s} tokens does not split over DP={dp_size} x CP={cp_size}")
        rows = slice(dp_rank, n, dp_size)
        local = s // cp_size
        lo = cp_rank * local
        mine = sequences[rows]
        labels = np.concatenate([mine[:, 1:], np.zeros_like(mine[:, :1])], axis=1)
        first = s - gen_len - 1
        p_lo, p_hi = min(max(first - lo, 0), local), min(max(s - 1 - lo, 0), local)
        return cls(rows, np.ascontiguousarray(mine[:, lo : lo + local]), np.ascontiguousarray(labels[:, lo : lo + local]),
                   slice(p_lo, p_hi), slice(lo + p_lo - first, lo + p_hi - first))


def trainer_overrides(cfg: RLConfig) -> dict:
    """:func:`model.config.from_hf` overrides of the RL trainer: layout, dtype, recompute, MoE chunks."""
    from tasks.trainer import recompute_overrides

    if cfg.recompute not in ("none", "selective", "full") or cfg.dtype not in ("float32", "bfloat16"):
        raise RLError(f"recompute={cfg.recompute!r}, dtype={cfg.dtype!r}: choose recompute none|selective|full "
                      "and dtype float32|bfloat16")
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    return dict(tensor_model_parallel_size=cfg.tensor_parallel, context_parallel_size=cfg.context_parallel,
                expert_model_parallel_size=cfg.expert_parallel, expert_tensor_parallel_size=1,
                calculate_per_token_loss=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                moe_router_bias_update_rate=cfg.expert_bias_update_rate, mlp_chunk_tokens=cfg.mlp_chunk_tokens,
                **recompute_overrides(cfg.recompute, cfg.recompute_modules))


@dataclass(frozen=True)
class _PlannedRun:
    """The fields :func:`tasks.memory_plan.memory_plan` reads, for one RL micro-batch."""

    model: str
    seq_len: int
    dtype: str
    tensor_parallel: int
    context_parallel: int
    expert_parallel: int
    recompute: str
    recompute_modules: tuple[str, ...]
    offload_layers: int
    mlp_chunk_tokens: int
    logits_chunk_tokens: int


def rl_memory_plan(mcfg, cfg: RLConfig, world_size: int, procs_per_node: int, device_limit: int | None = None,
                   on_gpu: bool | None = None):
    """Per-device memory of an RL trainer rank, checked before anything is allocated.

    SFT's plan (:func:`tasks.memory_plan.memory_plan`: weights, float32 grads, distributed
    Adam, activations, workspace) for one micro-batch of ``micro_batch_rollouts`` sequences of
    ``prompt_len + gen_len`` tokens (activations scale with the tokens in flight), on a device
    that also holds the frozen reference policy (weights in ``cfg.dtype``) and, on rank 0's GPU,
    the colocated engine's ``engine_gpu_memory_fraction``.

    Raises:
        tasks.memory_plan.MemoryPlanError: the plan does not fit; the message has the table.
    """
    from model.config import parameter_count
    from tasks.memory_plan import host_memory_limit_bytes, memory_plan

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    dp = world_size // (cfg.tensor_parallel * cfg.context_parallel)
    per_rank = (cfg.prompts_per_step * cfg.group_size) // (cfg.mini_batches * max(dp, 1))
    micro = cfg.micro_batch_rollouts or max(per_rank, 1)
    counts = parameter_count(mcfg)
    local_params = (counts["total"] - counts["moe_routed"]) / cfg.tensor_parallel + counts["moe_routed"] / cfg.expert_parallel
    reference = int(local_params * (2 if cfg.dtype == "bfloat16" else 4))
    if device_limit is None:
        device_limit = torch.cuda.mem_get_info()[0] if on_gpu else host_memory_limit_bytes() // procs_per_node
    engine = int(device_limit * cfg.engine_gpu_memory_fraction) if on_gpu else 0
    device_limit = device_limit - engine - reference
    planned = _PlannedRun(f"RL trainer, {micro} rollouts per micro-batch", micro * (cfg.prompt_len + cfg.gen_len), cfg.dtype, cfg.tensor_parallel,
                          cfg.context_parallel, cfg.expert_parallel, cfg.recompute, cfg.recompute_modules, 0,
                          cfg.mlp_chunk_tokens, 4096)
    return memory_plan(mcfg, planned, world_size, procs_per_node, device_limit=device_limit, on_gpu=on_gpu)


def _sequence_logprobs(module, batch: LocalTokens, device, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs ``[n, k]`` of this rank's ``k`` sampled tokens, and an anchor scalar.

    The distribution is the one the engine sampled from: logits restricted to A/C/G/T at
    ``temperature`` (:func:`model.logprobs.restricted_token_logprobs`). Only the positions that
    predict sampled tokens reach the output head. The anchor (0 x the hidden states) joins ranks
    that hold no sampled token to the backward pass, whose context-parallel collectives every CP
    rank must enter.
    """
    from model.logprobs import restricted_token_logprobs

    hidden = module.hidden_states(torch.from_numpy(batch.ids).to(device))          # [S / cp, n, h]
    labels = torch.from_numpy(batch.labels).to(device).transpose(0, 1)[batch.positions]
    picked = hidden[batch.positions]
    anchor = hidden.sum() * 0.0
    if picked.shape[0] == 0:
        return hidden.new_zeros(hidden.shape[1], 0), anchor
    logp = restricted_token_logprobs(module, picked, labels.contiguous(), vocab.ACGT, temperature)
    return logp.transpose(0, 1), anchor


def _expected_reward(policy, prompts: np.ndarray, truth: np.ndarray, cfg: RLConfig, layout, device, group) -> float:
    """Teacher-forced expected match reward of ``policy`` on fixed prompts (``RLConfig.val_prompts``).

    Args:
        prompts: int64 ``[n, prompt_len]``; truth: int64 ``[n, gen_len]``, the reference bases.

    Returns:
        The mean over ``n x gen_len`` reference bases of ``p(base | prompt, true bases before
        it)`` under the policy restricted to A/C/G/T at ``cfg.temperature``; an N (or any id
        outside A/C/G/T) contributes 0, as it matches nothing in the reward. DP ranks split the
        prompts, CP ranks the positions (:class:`LocalTokens`); the sums meet over ``group``.
    """
    acgt = np.isin(truth, vocab.ACGT)
    labels = np.where(acgt, truth, vocab.ACGT[0])                 # scored ids must be bases; masked below
    rows = cfg.micro_batch_rollouts * layout.dp_size if cfg.micro_batch_rollouts else len(prompts)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = policy.training
    policy.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), rows):
            part = slice(start, start + rows)
            batch = LocalTokens.split(np.concatenate([prompts[part], labels[part]], axis=1), cfg.gen_len,
                                      layout.dp_rank, layout.dp_size, layout.cp_rank, cfg.context_parallel)
            logp, _ = _sequence_logprobs(policy, batch, device, cfg.temperature)
            mask = torch.from_numpy(acgt[part][batch.rows][:, batch.tokens]).to(device)
            total[0] += (logp.exp() * mask).sum().double()
            total[1] += float(mask.numel())
    policy.train(was_training)
    torch.distributed.all_reduce(total, group=group)
    return float(total[0] / total[1])


def _broadcast(array: np.ndarray | None, shape: tuple[int, ...], dtype, device) -> np.ndarray:
    """Rank 0's ``array`` on every rank (rollouts are generated by rank 0's engine)."""
    t = torch.from_numpy(np.ascontiguousarray(array)).to(device) if array is not None else \
        torch.empty(shape, dtype=dtype, device=device)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast(t, 0)
    return t.cpu().numpy()


def _policy_updates(policy, reference, model, optimizer, scheduler, sequences: np.ndarray, rollout_logp: np.ndarray,
                    advantages: torch.Tensor, cfg: RLConfig, layout, device, group, step: int):
    """One RL step's optimizer updates: ``cfg.epochs`` passes over ``cfg.mini_batches`` mini-batches.

    The mini-batches are a seeded partition of the step's rollouts (the same on every rank and
    after a resume). ``logp_old`` and the reference log-probs of every mini-batch are taken
    before the first update, so from the second update on the PPO ratio departs from 1 and the
    clip acts; the truncated importance weight ``exp(logp_old - logp_rollout)`` and the gap are
    properties of the rollouts and are the same in every pass.

    Args:
        sequences: int64 ``[n_rollouts, prompt_len + gen_len]`` prompts followed by the samples.
        rollout_logp: float32 ``[n_rollouts, gen_len]``, the engine's log-probs of the samples.
        advantages: float ``[n_rollouts]``.
        group: the DP x CP process group the sums are reduced over.

    Returns:
        (sums over the group: ``objective``/``kl``/``clipped``/``updated_tokens`` over every update,
        ``tis_weight``/``gap``/``tokens`` over the rollouts once; max gap; (min, max) TIS weight;
        the last update's grad norm).
    """
    from tasks.trainer import optimizer_step

    n_rollouts = len(sequences)
    order = np.random.default_rng([cfg.seed, step]).permutation(n_rollouts)
    micro_rows = (cfg.micro_batch_rollouts or n_rollouts // (cfg.mini_batches * layout.dp_size)) * layout.dp_size
    policy.train()
    mini_batches = []
    for mini in np.array_split(order, cfg.mini_batches):
        parts = []
        for start in range(0, len(mini), micro_rows):
            rows = np.sort(mini[start : start + micro_rows])
            batch = LocalTokens.split(sequences[rows], cfg.gen_len, layout.dp_rank, layout.dp_size, layout.cp_rank,
                                      cfg.context_parallel)
            with torch.no_grad():
                old, _ = _sequence_logprobs(policy, batch, device, cfg.temperature)
                ref, _ = _sequence_logprobs(reference, batch, device, cfg.temperature)
            mine = rows[batch.rows]
            engine_logp = torch.from_numpy(rollout_logp[mine][:, batch.tokens]).to(device)
            parts.append((batch, old, ref, engine_logp, advantages[mine].to(device)))
        mini_batches.append(parts)
    keys = ("objective", "kl", "clipped", "updated_tokens", "tis_weight", "gap", "tokens")
    local = dict.fromkeys(keys, 0.0)
    weights, gap_max = [], 0.0
    for batch, old, ref, engine_logp, adv in (p for parts in mini_batches for p in parts):
        terms = grpo_token_terms(old, old, ref, engine_logp, adv, cfg.grpo)
        local["tis_weight"] += terms["tis_weight"].sum().double()
        local["gap"] += terms["gap"].sum().double()
        local["tokens"] += float(terms["gap"].numel())
        weights.append(terms["tis_weight"].flatten())
        if terms["gap"].numel():
            gap_max = max(gap_max, float(terms["gap"].max()))
    weights = torch.cat(weights)
    grad_norm = 0.0
    for _ in range(cfg.epochs):
        for parts in mini_batches:
            model.zero_grad_buffer()
            optimizer.zero_grad()
            tokens = torch.zeros((), device=device)
            for batch, old, ref, engine_logp, adv in parts:          # gradients accumulate
                logp, anchor = _sequence_logprobs(policy, batch, device, cfg.temperature)
                terms = grpo_token_terms(logp, old, ref, engine_logp, adv, cfg.grpo)
                # Sums over this rank's tokens; finalize_model_grads divides the gradients by
                # the token count of the whole DP x CP group (calculate_per_token_loss).
                (terms["objective"].sum() + anchor).backward()
                tokens += float(terms["objective"].numel())
                local["objective"] += terms["objective"].detach().sum().double()
                local["kl"] += terms["kl"].sum().double()
                local["clipped"] += terms["clipped"].sum().double()
            local["updated_tokens"] += float(tokens)
            grad_norm = float(optimizer_step(model, optimizer, scheduler, tokens.clone()))
    sums = torch.stack([torch.as_tensor(local[k], dtype=torch.float64, device=device) for k in keys])
    extremes = torch.tensor([gap_max, -float(weights.min()) if weights.numel() else -1.0,
                             float(weights.max()) if weights.numel() else 1.0], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(sums, group=group)
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    return (dict(zip(keys, sums.tolist())), float(extremes[0]), (-float(extremes[1]), float(extremes[2])), grad_norm)


def rollout_engine_options(cfg: RLConfig) -> dict:
    """Keyword arguments of the rollout engine (:func:`tasks.engines.make_engine`) for ``cfg``.

    On a GPU: vLLM's share of rank 0's device and its tensor parallelism. On CPU: whole-prompt
    prefill. Every rollout is seeded, so a rerun or a resume samples the same rollouts, and vLLM
    on CPU cannot go on sampling a seeded request whose prefill was split over engine steps
    (:meth:`tasks.engines.VLLMEngine.generate`); a batch of rollout prompts longer than one
    step's budget would be split.
    """
    if cfg.engine != "vllm":
        return {}
    if torch.cuda.is_available():
        return {"llm_kwargs": {"gpu_memory_utilization": cfg.engine_gpu_memory_fraction,
                               "tensor_parallel_size": cfg.engine_tensor_parallel}}
    return {"chunked_prefill": False}


def rl(sft_export: str | os.PathLike, shards_dir: str | os.PathLike, cfg: RLConfig,
       out_dir: str | os.PathLike, preset: str = "local-cpu") -> RLResult:
    """Run GRPO from an SFT export on every rank of the job; write the export and per-step metrics.

    The trainer is SFT's: megatron glm5_next with ``cfg``'s TP/CP/EP layout, megatron DDP and
    the distributed Adam (:func:`tasks.trainer.build_trainer`). Rank 0 holds the inference engine
    (colocated with the trainer) and broadcasts the rollouts; every rank draws the same prompts.

    Args:
        sft_export: HF-layout checkpoint directory (``config.json`` + safetensors).
        shards_dir: pack output (only the train split is read).
        cfg: RL configuration.
        out_dir: output directory, written by rank 0 (atomic): ``hf/`` export,
            ``metrics.jsonl``, ``rollouts.jsonl``, ``rl_config.json``.
        preset: recorded in the export metadata.

    Raises:
        RLError: no prompt window in the shards, a batch that does not split over the ranks,
            a checkpoint of another run, or a non-finite loss (names the step).
        tasks.engines.EngineError: the engine cannot be built or rejects a request.
    """
    from megatron.core import parallel_state as ps

    from model.convert import export_metadata, hf_state_dict, load_hf_checkpoint, load_hf_into_model, save_hf_checkpoint
    from model.glm5_next import build_model
    from tasks.engines import SamplingConfig, make_engine
    from tasks.checkpoint import Checkpointer, restore_training_state, training_state
    from tasks.trainer import ManualGC, build_trainer, freeze_indexers, init_parallel, local_device

    layout = init_parallel(cfg.tensor_parallel, cfg.context_parallel, cfg.expert_parallel)
    is_main = layout.rank == 0
    device = local_device()
    sft_export, shards_dir, out_dir = Path(sft_export), Path(shards_dir), Path(out_dir)
    n_rollouts = cfg.prompts_per_step * cfg.group_size
    if (cfg.prompt_len + cfg.gen_len) % cfg.context_parallel or n_rollouts % layout.dp_size:
        raise RLError(f"prompt_len + gen_len = {cfg.prompt_len + cfg.gen_len} must divide over CP={cfg.context_parallel} "
                      f"and prompts_per_step x group_size = {n_rollouts} over DP={layout.dp_size}")
    if cfg.gc_interval < 0:
        raise RLError(f"gc_interval={cfg.gc_interval} must be >= 0 (0: the collector stays on)")
    if cfg.mini_batches < 1 or cfg.epochs < 1 or n_rollouts % (cfg.mini_batches * layout.dp_size):
        raise RLError(f"prompts_per_step x group_size = {n_rollouts} rollouts must split into mini_batches="
                      f"{cfg.mini_batches} (>= 1) x DP={layout.dp_size}, and epochs={cfg.epochs} must be >= 1")
    if cfg.temperature <= 0:
        raise RLError(f"temperature={cfg.temperature}: rollouts are sampled (> 0); the trainer scores them at it")
    if cfg.val_prompts < 0 or cfg.val_prompts % layout.dp_size or (cfg.val_prompts and cfg.reward != "match_fraction"):
        raise RLError(f"val_prompts={cfg.val_prompts} must be >= 0, divide over DP={layout.dp_size}, and goes with "
                      f"reward='match_fraction' (got {cfg.reward!r})")
    per_rank = n_rollouts // (cfg.mini_batches * layout.dp_size)
    if cfg.micro_batch_rollouts < 0 or (cfg.micro_batch_rollouts and per_rank % cfg.micro_batch_rollouts):
        raise RLError(f"micro_batch_rollouts={cfg.micro_batch_rollouts} must divide the {per_rank} rollouts of a "
                      f"mini-batch on each DP rank (0: all at once)")
    sampler = PromptSampler(shards_dir, cfg.prompt_len, cfg.gen_len, cfg.seed)
    val_prompts, val_truth, _ = (PromptSampler(shards_dir, cfg.prompt_len, cfg.gen_len, cfg.seed + 1)
                                 .sample(cfg.val_prompts) if cfg.val_prompts else (None, None, None))
    from model.config import from_hf

    plan = rl_memory_plan(from_hf(json.loads((sft_export / "config.json").read_text()), **trainer_overrides(cfg)), cfg,
                          layout.world_size, layout.local_world_size)
    if is_main:
        log.info("rl memory plan (per device, before anything is allocated):\n%s", plan.table())
    model_cfg, text_state, vision_state = load_hf_checkpoint(sft_export, lazy=True, **trainer_overrides(cfg))
    dtype = model_cfg.params_dtype if model_cfg.bf16 else None   # None: megatron's float32 parameters
    policy = build_model(model_cfg, seed=cfg.seed, layout=layout, dtype=dtype)
    load_hf_into_model(policy, text_state)
    reference = build_model(model_cfg, seed=cfg.seed, layout=layout, dtype=dtype)
    load_hf_into_model(reference, text_state)
    reference.eval().requires_grad_(False)
    del text_state
    freeze_indexers(policy)             # the GRPO loss gives the indexers no gradient
    model, optimizer, scheduler = build_trainer(
        model_cfg, policy, lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8,
        grad_clip=cfg.grad_clip, steps=cfg.steps * cfg.mini_batches * cfg.epochs, warmup_steps=0,
        decay_style="constant")

    def checkpoint_state(is_loading: bool, step: int) -> dict:
        return training_state(policy, optimizer, scheduler, layout, is_loading,
                              {"step": step, "sampler": sampler.state, "data": sampler.fingerprint})

    ckpt = Checkpointer(cfg.checkpoint_dir, layout.rank) if cfg.checkpoint_dir else None
    step = 0
    resume_from = ckpt.pointer("latest") if ckpt else None
    if resume_from is not None:
        progress = restore_training_state(ckpt, resume_from, lambda: checkpoint_state(True, 0), policy, optimizer,
                                          scheduler)
        if progress["data"] != sampler.fingerprint:
            raise RLError(f"{resume_from}: checkpoint of another RL run ({progress['data']}), "
                          f"this one samples {sampler.fingerprint}")
        step = progress["step"]
        sampler.restore(progress["sampler"])
        if is_main:
            log.info("resumed from %s at step %d", resume_from, step)

    # History lives beside the checkpoints (a restarted run keeps it up to its checkpoint) or,
    # without checkpoints, in the output being written.
    history = Path(cfg.checkpoint_dir) if ckpt else None
    max_len = cfg.prompt_len + cfg.gen_len + 1
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    metrics: list[dict] = []
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(atomic_output_dir(out_dir)) if is_main else None
        engine = stack.enter_context(make_engine(cfg.engine, sft_export, cfg.engine_dtype, max_len,
                                                 **rollout_engine_options(cfg))) if is_main else None
        hf_now = hf_state_dict(policy) if step else None       # collective over TP/EP
        if engine is not None and hf_now is not None:
            engine.update_weights({**hf_now, **vision_state})   # resumed: the engine gets the checkpoint's policy
        del hf_now
        if is_main:
            (work / "rl_config.json").write_text(json.dumps(asdict(cfg), indent=1))
            history = history or work
            metrics = keep_records_through(history / "metrics.jsonl", step)
            keep_records_through(history / "rollouts.jsonl", step)
        bar = None
        if is_main:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.steps, initial=step, desc="rl", unit="step", disable=None)
        with ManualGC(cfg.gc_interval) as collector:
            while step < cfg.steps:
                t0 = time.perf_counter()
                # The policy that samples this step's rollouts, on the fixed prompts (as reward_mean).
                val_reward = (_expected_reward(policy, val_prompts, val_truth, cfg, layout, device, dp_cp_group)
                              if cfg.val_prompts else None)
                prompts, truth, origins = sampler.sample(cfg.prompts_per_step)
                repeated = np.repeat(prompts, cfg.group_size, axis=0)
                generated = rollout_logp = None
                if engine is not None:
                    sampling = SamplingConfig(max_new_tokens=cfg.gen_len, temperature=cfg.temperature,
                                              seed=cfg.seed * 1_000_003 + step * 10_007, allowed_token_ids=vocab.ACGT)
                    rollouts = engine.generate(list(repeated), sampling)
                    generated = np.stack([r.tokens for r in rollouts]).astype(np.int64)
                    rollout_logp = np.stack([r.logprobs for r in rollouts]).astype(np.float32)
                generated = _broadcast(generated, (n_rollouts, cfg.gen_len), torch.int64, device)
                rollout_logp = _broadcast(rollout_logp, (n_rollouts, cfg.gen_len), torch.float32, device)
                rewards = torch.tensor([
                    continuation_reward(g, t, cfg.reward)
                    for g, t in zip(generated, np.repeat(truth, cfg.group_size, 0))
                ], dtype=torch.float32).view(cfg.prompts_per_step, cfg.group_size)
                advantages = group_advantages(rewards, cfg.grpo).flatten()
                sums, gap_max, tis_range, grad_norm = _policy_updates(
                    policy, reference, model, optimizer, scheduler, np.concatenate([repeated, generated], axis=1),
                    rollout_logp, advantages, cfg, layout, device, dp_cp_group, step)
                loss = float(sums["objective"] / sums["updated_tokens"])
                if not np.isfinite(loss):
                    raise RLError(f"non-finite GRPO loss {loss} at step {step + 1}; last good checkpoint: "
                                  f"{(ckpt.pointer('latest') if ckpt else None) or 'none'}")
                hf = hf_state_dict(policy)                           # collective over TP/EP
                if engine is not None:
                    engine.update_weights({**hf, **vision_state})
                del hf
                step += 1
                seconds = time.perf_counter() - t0
                row = {
                    "step": step, "loss": loss, "reward_mean": rewards.mean().item(),
                    "reward_std": rewards.std(unbiased=False).item(), "grad_norm": grad_norm,
                    "updates": cfg.mini_batches * cfg.epochs,
                    "kl": float(sums["kl"] / sums["updated_tokens"]),
                    "clip_fraction": float(sums["clipped"] / sums["updated_tokens"]),
                    "tis_weight_mean": float(sums["tis_weight"] / sums["tokens"]),
                    "tis_weight_min": tis_range[0], "tis_weight_max": tis_range[1],
                    "rollout_train_logprobs_abs_diff_mean": float(sums["gap"] / sums["tokens"]),
                    "rollout_train_logprobs_abs_diff_max": gap_max,
                    "tokens_per_s": n_rollouts * (cfg.prompt_len + cfg.gen_len) / seconds, "step_time_s": seconds,
                    "engine": engine.description if engine is not None else "",
                }
                if val_reward is not None:
                    row["val_expected_reward"] = val_reward
                if is_main:
                    metrics.append(row)
                    with (history / "metrics.jsonl").open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    with (history / "rollouts.jsonl").open("a") as f:
                        for k, (tokens, reward) in enumerate(zip(generated, rewards.flatten().tolist())):
                            shard, offset = origins[k // cfg.group_size]
                            f.write(json.dumps({"step": step, "shard": shard, "offset": offset,
                                                "prompt_len": cfg.prompt_len, "generated": tokens.tolist(),
                                                "reward": reward}) + "\n")
                    gap = row["rollout_train_logprobs_abs_diff_mean"]
                    log.info("rl step %d/%d: reward %.3f kl %.2e clip %.3f tis [%.3f, %.3f] gap %.2e%s", step, cfg.steps,
                             row["reward_mean"], row["kl"], row["clip_fraction"], row["tis_weight_min"],
                             row["tis_weight_max"], gap,
                             f" val expected reward {val_reward:.4f}" if val_reward is not None else "")
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", clip=f"{row['clip_fraction']:.2f}",
                                    gap=f"{gap:.1e}")
                    bar.update()
                if ckpt and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps):
                    ckpt.save(checkpoint_state(False, step), step, False, cfg.keep_checkpoints)
                collector.step(step)
        if bar is not None:
            bar.close()
        hf = hf_state_dict(policy)
        if is_main:
            if history != work:
                for name in ("metrics.jsonl", "rollouts.jsonl"):
                    if (history / name).exists():
                        shutil.copyfile(history / name, work / name)
                    else:
                        (work / name).write_text("")
            meta = export_metadata(preset, sha256_file(shards_dir / "manifest.json"))
            save_hf_checkpoint(hf, model_cfg, work / "hf", meta, vision_state=vision_state,
                               vision_config=json.loads((sft_export / "config.json").read_text()).get("vision_config"))
    torch.distributed.barrier()
    return RLResult(out_dir=out_dir, export_dir=out_dir / "hf", metrics=metrics)


# ---- Flyte task: resources, Elastic layout and cache version only; the logic is rl() above --

from flytekitplugins.kfpytorch import Elastic  # noqa: E402
from flytekit import Cache, task  # noqa: E402

from tasks.caching import (  # noqa: E402
    HashedDir, as_output, stage_version, hf_export, manifest_sha256, resource_kwargs, run_checkpoint_dir,
    shared_kernel_cache, stage_output_dir,
)
from tasks.presets import Preset, active_preset  # noqa: E402
from tasks.trainer import finish_parallel  # noqa: E402


def rl_parallel(preset: Preset):
    """The RL trainer's layout: ``preset.rl.parallel``, or the SFT layout when unset."""
    return preset.rl.parallel or preset.train_parallel


def preset_rl_config(preset: Preset, **overrides) -> RLConfig:
    """The RL configuration a preset implies (``preset.rl`` with ``overrides`` of its fields).

    The GRPO loss averages over tokens and the reward is a fraction of ``gen_len`` bases, so the
    loss's KL coefficient is ``kl_per_base / gen_len`` (``tasks.grpo``: the per-base trade-off);
    advantages are Dr. GRPO's (centred, not divided by the group's std, which would rescale the
    reward against the KL term group by group).
    """
    spec = dataclasses.replace(preset.rl, **overrides)
    par = rl_parallel(preset)
    return RLConfig(steps=spec.steps, prompts_per_step=spec.prompts_per_step, group_size=spec.group_size,
                    prompt_len=spec.prompt_len, gen_len=spec.gen_len, temperature=spec.temperature,
                    mini_batches=spec.mini_batches, epochs=spec.epochs, engine_dtype=spec.engine_dtype,
                    micro_batch_rollouts=spec.micro_batch_rollouts, dtype=spec.dtype, recompute=spec.recompute,
                    mlp_chunk_tokens=spec.mlp_chunk_tokens,
                    lr=spec.lr, engine=preset.engine,
                    grpo=GRPOConfig(kl_coef=spec.kl_per_base / spec.gen_len, scale_by_std=False),
                    tensor_parallel=par.tensor_parallel, context_parallel=par.context_parallel,
                    expert_parallel=par.expert_parallel, checkpoint_dir=spec.checkpoint_uri,
                    checkpoint_every=spec.checkpoint_every, engine_tensor_parallel=spec.engine_tensor_parallel)


RL_VERSION = stage_version("rl", active_preset())
_PRESET = active_preset()


@task(task_config=Elastic(nnodes=rl_parallel(_PRESET).nnodes, nproc_per_node=rl_parallel(_PRESET).nproc_per_node,
                          increase_shared_mem=False),
      cache=Cache(version=RL_VERSION), **resource_kwargs(_PRESET.train_resources))
def rl_task(shards: HashedDir, sft: HashedDir, cfg: RLConfig) -> HashedDir:
    """Flyte wrapper of :func:`rl` on every Elastic worker: GRPO from the SFT output's HF export.

    The trainer ranks use the preset's RL layout (TP/CP/EP as SFT); rank 0 holds the inference
    engine (colocated). Checkpoints go to ``cfg.checkpoint_dir`` (default
    ``$MEGABASE_HOME/checkpoints/<key>``, a shared mount on a cluster) and a restarted worker
    resumes from the latest. The output holds ``hf/`` (the RL export), ``metrics.jsonl`` and
    ``rollouts.jsonl``; rank 0's output comes back.
    """
    identity = dict(shards=manifest_sha256(shards), sft=manifest_sha256(sft), cfg=asdict(cfg))
    cfg = dataclasses.replace(cfg, checkpoint_dir=run_checkpoint_dir(cfg.checkpoint_dir, RL_VERSION, **identity))
    shared_kernel_cache(cfg.checkpoint_dir)
    out = stage_output_dir("rl", RL_VERSION, **identity)
    rl(hf_export(sft.download()), shards.download(), cfg, out, preset=active_preset().name)
    finish_parallel()
    return as_output(out)


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m tasks.rl SFT_EXPORT PACK_DIR OUT_DIR [--config JSON]``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sft_export")
    parser.add_argument("pack_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--config", default="{}", help="JSON object of RLConfig fields (grpo: a nested object)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fields = json.loads(args.config)
    if "grpo" in fields:
        fields["grpo"] = GRPOConfig(**fields["grpo"])
    rl(args.sft_export, args.pack_dir, RLConfig(**fields), args.out_dir)
    finish_parallel()


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    main()
