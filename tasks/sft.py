"""Supervised fine-tuning (next-base prediction) of the glm5_next model on packed DNA shards.

One process per device, launched by torch elastic (``torchrun``, or flytekitplugins-kfpytorch
``Elastic`` in :func:`sft_task`); the parallel layout, the megatron trainer and the optimizer
step come from :mod:`tasks.trainer`, checkpoints from :mod:`tasks.checkpoint`, the memory plan
from :mod:`tasks.memory_plan`.

Data (:class:`tasks.windows.WindowSampler`): windows of ``seq_len`` tokens cut from the *train*
shards of a pack output (schema in :mod:`tasks.pack`), non-overlapping, in an order drawn from
``seed`` (one permutation per epoch). The data position is the number of windows consumed: it is
a function of the step, so resuming at step ``k`` reads exactly the windows an uninterrupted run
reads. A window predicts ``tokens[t + 1]`` from ``tokens[: t + 1]``; the last position has no
target. The loss is the mean next-token NLL over targets whose ``loss_mask`` is set (A/C/G/T;
N and ``<sep>`` are never targets). CP rank ``r`` of ``R`` holds positions
``[r L/R, (r+1) L/R)`` of every window (the contiguous layout of :mod:`model.parallel`).

Validation and the ``best`` checkpoint use ``eval_windows`` windows of ``eval_seq_len`` tokens
held out by position at the ends of the training shards (:mod:`tasks.windows`: never a training
step's token). This stage never opens the held-out chromosomes' shards: they are evaluate's.

Step (:func:`train_step`): forward -> per-token NLL -> masked sum (+ DSA indexer KL,
DeepSeek-V3.2) -> backward -> :func:`tasks.trainer.optimizer_step` (DP x CP gradient reduction,
division by the global number of target tokens, MoE expert-bias update, distributed optimizer
step with gradient clipping, LR schedule: linear warm-up, cosine decay) -> the next step's windows
read ahead -> one host read of the step's numbers -> metrics as JSON lines.
:func:`train` is the loop: step, log, collect garbage, validate, checkpoint.

Checkpoints (:class:`tasks.checkpoint.Checkpointer`) in ``<checkpoint_dir>/step-NNNNNNN`` with
atomic ``latest`` and ``best`` pointers hold the model, the distributed optimizer, the LR
scheduler, every rank's RNG states and the data position; a run whose ``checkpoint_dir`` holds a
``latest`` pointer resumes from it (an Elastic restart resumes automatically).

Before anything is allocated, :func:`tasks.memory_plan.memory_plan` estimates per-device memory
and per-device pinned host memory and raises when they do not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional
from pathlib import Path

from model.parallel import ParallelLayout
from tasks.atomic import keep_records_through, sha256_file
from tasks.checkpoint import Checkpointer, restore_training_state, training_state
from tasks.memory_plan import MemoryPlan, memory_plan
from tasks.trainer import (ManualGC, build_trainer, finish_parallel, freeze_indexers, init_parallel, local_device,
                           local_window, model_flops_per_token, moe_overload, optimizer_step, peak_memory_gib,
                           peak_pinned_gib, peak_tflops, sync_params)
from tasks.windows import WindowSampler

log = logging.getLogger("megabase.sft")

DTYPES = ("float32", "bfloat16")
RECOMPUTE = ("none", "selective", "full")


class SFTConfigError(ValueError):
    """An SFT configuration that cannot run; the message names the field and value."""


class TrainingDivergedError(RuntimeError):
    """The loss or gradient norm became non-finite; the message names the step and the last good checkpoint."""


@dataclass(frozen=True)
class SFTConfig:
    """Every knob of one SFT run (units in names or comments).

    Attributes:
        model: model preset of :mod:`model.config` (``tiny``, ``small``, ``full``); the export's
            metadata names it.
        init_hf: HF checkpoint directory (GLM-5.3-Flash layout, :mod:`model.convert`) to start
            from: its ``config.json`` replaces the preset's shapes and its weights the random
            init ("" = the preset, randomly initialised from ``seed``). Its vision tower is
            passed through to the export.
        seq_len: tokens per training window (divisible by ``context_parallel``).
        windows_per_step: windows per data-parallel rank per optimizer step (gradient
            accumulation over micro-batches of one window).
        steps: optimizer steps of the whole run (the cosine schedule's length).
        lr, min_lr: peak and final learning rate; warmup_steps: linear warm-up from 0.
        weight_decay, adam_beta1, adam_beta2, adam_eps: AdamW (decoupled weight decay).
        grad_clip: global gradient-norm clip (0 disables).
        seed: model init, data order and RNG streams.
        dtype: parameter/activation dtype; master weights and optimizer state are float32.
        tensor_parallel, context_parallel, expert_parallel: megatron parallel sizes; the data-
            parallel size is ``world_size / (tensor_parallel * context_parallel)``.
        recompute: ``none``, ``selective`` (the modules of ``recompute_modules``: ``mlp`` = every
            MLP/MoE, ``moe`` = MoE layers only) or ``full`` (whole layers, and each MLP chunk in
            them when there are several).
        recompute_keep_attention: with ``recompute="full"``, DSA layers keep their sparse attention
            output from the forward and the recompute reuses it (``heads/tp * (2 * kv_lora + 4)``
            bytes per token and DSA layer more on the device, counted by the memory plan).
        offload_layers: activations of the first N layers are saved to pinned host memory.
        mlp_chunk_tokens: sequence-chunked MLP/MoE, tokens per chunk (0: whole sequence).
        moe_experts: routed-expert path, ``grouped`` (grouped GEMMs) or ``sequential`` (one MLP per
            expert; :mod:`model.moe`): the same parameters and function.
        compile_glue: fuse the layers' elementwise glue with ``torch.compile`` on GPUs
            (:mod:`model.fused`; the same function, CPU runs stay eager).
        dsa_dkv: the sparse MLA backward's latent gradient on GPUs, summed per selected k-pool
            (``pool``), scattered per query (``query``), per query with 64 heads per program and the query
            gradient in the same form (``gluon``: Hopper, a multiple of 64 heads per rank), or ``auto``
            (``pool`` up to :data:`model.layers.DKV_POOL_MAX_HEADS` heads per rank, above that ``gluon`` where
            it runs and ``query`` elsewhere); the same function.
        dsa_fwd: the sparse MLA forward on GPUs, ``triton``, ``gluon`` (warp-specialized, Hopper, a
            multiple of 64 heads per rank; :mod:`kernels.dsa.sparse_attention_gluon`) or ``auto`` (``gluon``
            where it runs, else ``triton``); the same function.
        moe_permute: MoE token permutation of the allgather dispatcher, ``gather`` (row gathers both
            ways, no atomics, no host sync; :class:`model.moe.GatherTokenDispatcher`) or ``megatron``.
        kda_conv: KDA short convolution on GPUs, ``auto`` (fla's Triton ``causal_conv1d``) or ``torch``.
        dsa_kl: the indexer KL loss's indexer side on GPUs, ``auto`` (fused Triton kernels,
            :mod:`kernels.dsa.loss_triton`) or ``torch``; the same function.
        hc_gemm: the mHC projection's GEMM, ``auto`` (bf16 tensor cores with float32 accumulation for
            bf16 streams on GPUs, :func:`kernels.hc.projection.hc_projection`; float32 elsewhere) or
            ``float32`` (float32 copies of the streams and weight).
        overlap_grad_reduce: reduce the gradients bucket by bucket during the backward (megatron
            DDP's ``overlap_grad_reduce``) when DP x CP > 1; the same sums.
        overlap_param_gather: gather the updated parameters bucket by bucket during the next
            forward (megatron DDP's ``overlap_param_gather``), not at the end of the optimizer
            step, when DP x CP > 1; checkpoints and the export gather them first
            (:func:`tasks.trainer.sync_params`). The same weights.
        optimizer_kernels: ``foreach`` (gradient norm and clipping through torch's foreach ops,
            :func:`model.cpu_compat.foreach_multi_tensor_ops`, and Adam fused on GPUs,
            :func:`tasks.trainer.fuse_adam`) or ``megatron`` (its per-tensor fallbacks when
            Transformer Engine and Apex are absent); the same update.
        logits_chunk_tokens: positions whose logits exist at once in the loss.
        indexer_kl_coeff: weight of the DSA lightning-indexer KL loss (0 disables; TP = 1 only).
        expert_bias_update_rate: MoE expert-bias step per update (aux-loss-free balancing).
        checkpoint_dir: directory (local or a mounted bucket) of distributed checkpoints.
        checkpoint_every: save every N steps (and at the end); 0: only at the end.
        keep_checkpoints: most recent checkpoints kept besides ``best``.
        eval_every: validation every N steps (and at the end); 0: only at the end.
        eval_windows, eval_seq_len: validation windows and their length, held out by position at
            the ends of the training shards (:mod:`tasks.windows`), never trained on; the held-out
            chromosomes are not read here.
        peak_tflops_per_device: dense bf16 peak for MFU; 0: from the device name (None on CPU).
        gc_interval: Python's garbage collector is off in the step loop and collects every N steps,
            at the same step on every rank (:class:`ManualGC`); 0 leaves it on.
        inject_nan_at_step, inject_crash_at_step: fault injection for tests (-1: off; steps count
            from 1): the NaN multiplies step k's loss; the crash is ``os._exit(1)`` after step k
            (and its checkpoint), as a killed worker.
    """

    model: str = "tiny"
    init_hf: str = ""
    seq_len: int = 4096
    windows_per_step: int = 1
    steps: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 2
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "float32"
    tensor_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("moe",)
    recompute_keep_attention: bool = False
    offload_layers: int = 0
    mlp_chunk_tokens: int = 0
    moe_experts: str = "grouped"
    compile_glue: bool = True
    dsa_dkv: str = "auto"
    dsa_fwd: str = "auto"
    moe_permute: str = "gather"
    kda_conv: str = "auto"
    dsa_kl: str = "auto"
    hc_gemm: str = "auto"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    optimizer_kernels: str = "foreach"
    logits_chunk_tokens: int = 4096
    indexer_kl_coeff: float = 0.0
    expert_bias_update_rate: float = 1e-3
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    eval_every: int = 0
    eval_windows: int = 2
    eval_seq_len: int = 4096
    peak_tflops_per_device: float = 0.0
    gc_interval: int = 50
    inject_nan_at_step: int = -1
    inject_crash_at_step: int = -1

    def __post_init__(self) -> None:
        positive = ("seq_len", "windows_per_step", "steps", "tensor_parallel", "context_parallel", "expert_parallel",
                    "logits_chunk_tokens", "eval_seq_len", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise SFTConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.gc_interval < 0:
            raise SFTConfigError(f"gc_interval={self.gc_interval} must be >= 0 (0: the collector stays on)")
        if self.dtype not in DTYPES:
            raise SFTConfigError(f"dtype={self.dtype!r}; valid: {DTYPES}")
        if self.recompute not in RECOMPUTE:
            raise SFTConfigError(f"recompute={self.recompute!r}; valid: {RECOMPUTE}")
        if self.optimizer_kernels not in ("foreach", "megatron"):
            raise SFTConfigError(f"optimizer_kernels={self.optimizer_kernels!r}; valid: 'foreach', 'megatron'")
        if bad := set(self.recompute_modules) - {"mlp", "moe"}:
            raise SFTConfigError(f"recompute_modules has {sorted(bad)}; valid: 'mlp', 'moe'")
        for name in ("seq_len", "eval_seq_len"):
            if getattr(self, name) % self.context_parallel:
                raise SFTConfigError(f"{name}={getattr(self, name)} is not divisible by "
                                     f"context_parallel={self.context_parallel}")
        if not 0 <= self.warmup_steps < self.steps:
            raise SFTConfigError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if not 0 <= self.min_lr <= self.lr:
            raise SFTConfigError(f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if self.indexer_kl_coeff and self.tensor_parallel > 1:
            raise SFTConfigError("indexer_kl_coeff>0 with tensor_parallel>1: the KL target sums attention over all "
                                 "heads, which TP splits; train the indexer with tensor_parallel=1")


def model_config(cfg: SFTConfig):
    """The :class:`model.config.Glm5NextConfig` of the run: preset + parallel sizes + memory knobs."""
    import torch

    from model.config import preset

    from tasks.trainer import recompute_overrides

    recompute = recompute_overrides(cfg.recompute, cfg.recompute_modules)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    overrides = dict(tensor_model_parallel_size=cfg.tensor_parallel, context_parallel_size=cfg.context_parallel,
                     expert_model_parallel_size=cfg.expert_parallel, expert_tensor_parallel_size=1, mlp_chunk_tokens=cfg.mlp_chunk_tokens,
                     moe_experts=cfg.moe_experts, compile_glue=cfg.compile_glue, dsa_dkv=cfg.dsa_dkv,
                     dsa_fwd=cfg.dsa_fwd,
                     moe_permute=cfg.moe_permute, kda_conv=cfg.kda_conv, dsa_kl=cfg.dsa_kl,
                     hc_gemm=cfg.hc_gemm,
                     recompute_keep_attention=cfg.recompute_keep_attention and cfg.recompute == "full",
                     moe_router_bias_update_rate=cfg.expert_bias_update_rate, params_dtype=dtype,
                     bf16=dtype == torch.bfloat16, calculate_per_token_loss=True, **recompute)
    if cfg.init_hf:
        from model.config import from_hf

        mcfg = from_hf(json.loads((Path(cfg.init_hf) / "config.json").read_text()), **overrides)
    else:
        mcfg = preset(cfg.model, **overrides)
    if not 0 <= cfg.offload_layers <= mcfg.num_layers:
        raise SFTConfigError(f"offload_layers={cfg.offload_layers} must be in [0, num_layers={mcfg.num_layers}]")
    # TransformerConfig rejects cpu_offloading together with recompute because TE's offload
    # hooks cannot see recomputed tensors; the model offloads with saved-tensor hooks around whole
    # layers (model.offload), which compose with selective MLP recompute, so the fields are set after validation.
    mcfg.cpu_offloading = cfg.offload_layers > 0
    mcfg.cpu_offloading_num_layers = cfg.offload_layers
    return mcfg


def training_windows(pack_dir: str | os.PathLike, cfg: SFTConfig) -> WindowSampler:
    """The run's training windows and its validation windows (held out at the train shards' ends)."""
    return WindowSampler(pack_dir, cfg.seq_len, cfg.seed, cfg.eval_windows, cfg.eval_seq_len)


# ---- DSA indexer KL loss -------------------------------------------------------------------


class IndexerKL:
    """Collects the DSA lightning-indexer KL loss (DeepSeek-V3.2 sec. 2.1) of every full-indexer layer.

    A forward hook on each :class:`model.layers.DSAMixer` with its own indexer takes the mixer's
    selection ``topk [b, s, W]`` and the absorbed queries, gathered latent, log-normaliser ``lse`` and
    per-pool attention mass its forward just computed (detached; ``DSAMixer.keep_kl_inputs``), runs the
    indexer's own score inputs on a *detached* input (:meth:`model.layers.Indexer.score_inputs`), and hands them to
    :func:`kernels.dsa.indexer_kl_loss`: the KL trains the indexer only, the LM loss trains the rest.
    """

    def __init__(self, module, coeff: float):
        from model.layers import DSAMixer

        self.losses: list = []
        self.handles, self.mixers = [], []
        if coeff:
            self.mixers = [m for m in module.modules() if isinstance(m, DSAMixer) and m.indexer is not None]
            for m in self.mixers:
                m.keep_kl_inputs = True
            self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in self.mixers]

    def remove(self):
        """Detach from the model: the hooks go, and the mixers stop keeping their KL inputs."""
        for handle in self.handles:
            handle.remove()
        for m in self.mixers:
            m.keep_kl_inputs, m.kl_inputs = False, None
        self.handles, self.mixers = [], []

    def _hook(self, mixer, args, kwargs, output):
        import torch

        inputs, mixer.kl_inputs = mixer.kl_inputs, None   # never kept past this forward
        # Training forwards only (validation runs the model in eval mode). Under full recompute
        # megatron runs a layer's forward without autograd, then again with it inside backward:
        # the KL is built in the first pass, with autograd on for the indexer's own graph, so it is
        # backpropagated in the step that computed it, and not again in the recompute.
        if not mixer.training or torch._C._current_autograd_node() is not None:
            return
        with torch.enable_grad():
            self.losses.append(self._loss(mixer, args, kwargs, output, inputs))

    @staticmethod
    def _loss(mixer, args, kwargs, output, inputs):
        from kernels.dsa import indexer_kl_loss

        cp, c, ix = mixer.layout.cp, mixer.cfg, mixer.indexer
        xb = args[0].detach().transpose(0, 1)
        q_resid, q_abs, latent, lse, pool_mass = inputs
        q_index, k_index, gate, weights = ix.score_inputs(xb, q_resid, cp)
        return indexer_kl_loss(
            q_index, k_index, gate, ix.kpool_compress_ape, weights, q_abs, latent, lse, output[1],
            kpool=c.index_kpool, topk=c.index_topk, index_softmax_scale=ix.softmax_scale,
            softmax_scale=mixer.softmax_scale, cu_seqlens=kwargs.get("cu_seqlens"), torch_path=c.dsa_kl == "torch",
            pool_mass=pool_mass)

    def pop(self):
        """Sum of the collected layer losses (scalar float32, 0 without any) and reset."""
        total = sum(self.losses) if self.losses else 0.0
        self.losses = []
        return total


# ---- the run -------------------------------------------------------------------------------


class Validator:
    """Mean NLL (nats/token) over the target tokens of the validation windows; DP ranks split them."""

    def __init__(self, data: WindowSampler, layout: ParallelLayout, device):
        self.data, self.layout, self.device = data, layout, device

    def validate(self, module) -> float:
        import torch
        from megatron.core import parallel_state as ps

        module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for k in range(self.layout.dp_rank, len(self.data.validation), self.layout.dp_size):
                ids, labels, target = local_window(self.data.validation_window(k), self.layout, self.device)
                nll = module(ids, labels)
                totals += torch.stack([(nll.double() * target).sum(), target.sum().double()])
        module.train()
        torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group(with_context_parallel=True))
        return float(totals[0] / totals[1].clamp_min(1))


def step_log_line(record: dict, steps: int) -> str:
    """One progress line of a step's metrics record (the keys :func:`train_step` writes): loss in
    nats/token and bits/base, tokens/s, seconds, rank 0's peak memory in GiB (the device's on
    CUDA, the process's max RSS on CPU) and its peak pinned host GiB where measured (CUDA;
    ``None`` is left out)."""
    line = (f"sft step {record['step']}/{steps}: loss {record['loss']:.4f} nats ({record['bits_per_base']:.3f} "
            f"bits/base), {record['tokens_per_s']:.0f} tokens/s, {record['step_time_s']:.1f} s/step")
    peaks = [f"{record[key]:.2f} GiB {what}" for key, what in (("peak_memory_gib", "memory"),
                                                              ("peak_pinned_host_gib", "pinned"))
             if record.get(key) is not None]
    return line + (f", peak {', '.join(peaks)} (rank 0)" if peaks else "")


@dataclass(frozen=True)
class SFTResult:
    """What a run leaves behind (paths on rank 0)."""

    out_dir: Path
    hf_dir: Path
    metrics: Path
    checkpoint: str          # latest checkpoint directory ("" without checkpoint_dir)
    best_checkpoint: str
    final_loss: float
    best_eval_loss: float | None


@dataclass
class SFTRun:
    """One rank's training run: the model and trainer, the data, checkpoints and progress.

    Built by :meth:`start` (parallel init, memory plan, model, resume); :func:`train_step`
    advances it; :meth:`finish` writes the outputs.
    """

    cfg: SFTConfig
    pack_dir: Path
    out_dir: Path
    layout: ParallelLayout
    device: object
    mcfg: object
    plan: MemoryPlan
    module: object              # the glm5_next model
    model: object               # its megatron DDP wrapper
    optimizer: object
    scheduler: object
    data: WindowSampler
    validator: Validator
    indexer_kl: IndexerKL
    checkpointer: Checkpointer | None
    vision: tuple = (None, None)   # (state, config) of an init_hf checkpoint, passed through to the export
    step: int = 0
    consumed: int = 0           # training windows read so far, over all DP ranks
    best_eval: float | None = None
    loss: float = float("nan")
    flops_per_token: float = 0.0    # for MFU
    peak_tflops: float | None = None
    prefetched: tuple | None = None  # (consumed, the step's device windows) read ahead by prefetch()

    @property
    def is_main(self) -> bool:
        return self.layout.rank == 0

    @classmethod
    def start(cls, pack_dir: str | os.PathLike, cfg: SFTConfig, out_dir: str | os.PathLike) -> "SFTRun":
        import torch

        from model.convert import load_hf_checkpoint, load_hf_into_model
        from model.glm5_next import build_model

        layout = init_parallel(cfg.tensor_parallel, cfg.context_parallel, cfg.expert_parallel)
        out_dir = Path(out_dir)
        mcfg = model_config(cfg)
        plan = memory_plan(mcfg, cfg, layout.world_size, layout.local_world_size)
        if layout.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            log.info("SFT config: %s", json.dumps(asdict(cfg)))
            log.info("memory plan (per device):\n%s", plan.table())
        data = training_windows(pack_dir, cfg)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        # From scratch the head starts at zero (build_model: the early loss spike it removes);
        # an init_hf export overwrites every weight below.
        module = build_model(mcfg, seed=cfg.seed, logits_chunk_tokens=cfg.logits_chunk_tokens,
                             dtype=dtype if dtype != torch.float32 else None, layout=layout, zero_head=True)
        vision = (None, None)
        if cfg.init_hf:
            _, text, vision_state = load_hf_checkpoint(Path(cfg.init_hf), lazy=True)
            vision = (vision_state, json.loads((Path(cfg.init_hf) / "config.json").read_text()).get("vision_config"))
            load_hf_into_model(module, text)
        if not cfg.indexer_kl_coeff:
            freeze_indexers(module)
        model, optimizer, scheduler = build_trainer(
            mcfg, module, lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, grad_clip=cfg.grad_clip, steps=cfg.steps,
            warmup_steps=cfg.warmup_steps, decay_style="cosine", optimizer_kernels=cfg.optimizer_kernels,
            overlap_grad_reduce=cfg.overlap_grad_reduce and layout.dp_size * layout.cp_size > 1,
            overlap_param_gather=cfg.overlap_param_gather and layout.dp_size * layout.cp_size > 1)
        device = local_device()
        checkpointer = Checkpointer(cfg.checkpoint_dir, layout.rank) if cfg.checkpoint_dir else None
        run = cls(cfg, Path(pack_dir), out_dir, layout, device, mcfg, plan, module, model, optimizer, scheduler, data,
                  Validator(data, layout, device), IndexerKL(module, cfg.indexer_kl_coeff), checkpointer, vision,
                  flops_per_token=model_flops_per_token(mcfg, cfg.seq_len),
                  peak_tflops=peak_tflops(cfg.peak_tflops_per_device))
        if checkpointer and run.is_main:
            # What tasks.export needs to rebuild the model from the checkpoints alone (nightly eval).
            from model.config import hf_config_dict

            (checkpointer.root / "model_config.json").write_text(json.dumps(hf_config_dict(mcfg), indent=1,
                                                                            sort_keys=True))
        run.resume()
        model.zero_grad_buffer()               # train_step clears the gradients after each update
        optimizer.zero_grad()
        if run.is_main:                        # a restarted run keeps the history up to its checkpoint
            keep_records_through(run.metrics_path, run.step)
        return run

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def checkpoint_state(self, is_loading: bool) -> dict:
        return training_state(self.module, self.optimizer, self.scheduler, self.layout, is_loading, {
            "step": self.step, "windows_consumed": self.consumed, "best_eval_loss": self.best_eval,
            "data": self.data.fingerprint})

    def resume(self) -> None:
        """Continue from the ``latest`` checkpoint, if any (model, optimizer, RNG, data position)."""
        path = self.checkpointer.pointer("latest") if self.checkpointer else None
        if path is None:
            return
        progress = restore_training_state(self.checkpointer, path, lambda: self.checkpoint_state(True), self.module,
                                          self.optimizer, self.scheduler)
        if progress["data"] != self.data.fingerprint:
            raise SFTConfigError(f"{path}: checkpoint was trained on other shards/seq_len/seed/validation split "
                                 f"({progress['data']}) than this run ({self.data.fingerprint})")
        self.step, self.consumed, self.best_eval = (progress["step"], progress["windows_consumed"],
                                                    progress["best_eval_loss"])
        if self.is_main:
            log.info("resumed from %s at step %d (%d windows consumed)", path, self.step, self.consumed)

    def step_windows(self, consumed: int) -> list[tuple]:
        """This rank's windows of the step that starts at stream position ``consumed``:
        ``windows_per_step`` tuples (ids, labels, target) of ``[1, seq_len / cp]`` device tensors
        (:func:`tasks.trainer.local_window`)."""
        return [local_window(self.data.window(consumed + micro * self.layout.dp_size + self.layout.dp_rank),
                             self.layout, self.device) for micro in range(self.cfg.windows_per_step)]

    def prefetch(self) -> None:
        """Read and copy the next step's windows now (while the device still works on this step)."""
        self.prefetched = (self.consumed, self.step_windows(self.consumed))

    def take_windows(self) -> list[tuple]:
        """The windows of the step at ``consumed``: the prefetched ones when they are that step's."""
        ahead, self.prefetched = self.prefetched, None
        return ahead[1] if ahead is not None and ahead[0] == self.consumed else self.step_windows(self.consumed)

    def emit(self, record: dict) -> None:
        """Append ``record`` to ``metrics.jsonl`` and log it (rank 0)."""
        if not self.is_main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        # Progress where the bar is off (no TTY: cluster logs, pyflyte's Elastic workers).
        if "event" in record:
            log.info("sft %s", json.dumps(record))
        else:
            log.info("%s", step_log_line(record, self.cfg.steps))

    def validate(self) -> bool:
        """Validation loss at this step; returns whether it is the best so far."""
        if self.is_main:  # a minute without a line on CPU otherwise
            log.info("sft step %d: validation loss on %d windows of %d tokens", self.step, self.cfg.eval_windows,
                     self.cfg.eval_seq_len)
        loss = self.validator.validate(self.module)
        improved = self.best_eval is None or loss < self.best_eval
        self.best_eval = loss if improved else self.best_eval
        self.emit({"event": "eval", "split": "validation", "step": self.step, "eval_loss": loss,
                   "eval_bits_per_base": loss / math.log(2), "best": improved})
        return improved

    def save(self, best: bool) -> None:
        sync_params(self.model)
        path = self.checkpointer.save(self.checkpoint_state(False), self.step, best, self.cfg.keep_checkpoints)
        self.emit({"event": "checkpoint", "step": self.step, "path": str(path), "best": best})

    def last_checkpoint(self) -> str:
        return str((self.checkpointer.pointer("latest") if self.checkpointer else None) or "none")

    def finish(self) -> SFTResult:
        """Write the HF export, ``summary.json`` and ``manifest.json`` (rank 0); collective."""
        import torch

        from model.convert import export_metadata, hf_state_dict, save_hf_checkpoint

        sync_params(self.model)
        hf = hf_state_dict(self.module)                  # collective over TP/EP
        ckpt = self.checkpointer
        result = SFTResult(self.out_dir, self.out_dir / "hf", self.metrics_path,
                           str(ckpt.pointer("latest") or "") if ckpt else "",
                           str(ckpt.pointer("best") or "") if ckpt else "", self.loss, self.best_eval)
        if self.is_main:
            vision_state, vision_config = self.vision
            save_hf_checkpoint(hf, self.mcfg, result.hf_dir,
                               export_metadata(self.cfg.model, sha256_file(self.pack_dir / "manifest.json")),
                               vision_state=vision_state, vision_config=vision_config)
            summary = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
            summary["config"] = asdict(self.cfg)
            summary["memory_plan_bytes"] = asdict(self.plan)
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            files = sorted(p for p in self.out_dir.rglob("*") if p.is_file() and p.name != "manifest.json")
            (self.out_dir / "manifest.json").write_text(json.dumps(
                {"schema": "megabase.sft/1", "files": {str(p.relative_to(self.out_dir)): sha256_file(p)
                                                       for p in files}}, indent=1))
        torch.distributed.barrier()
        return result


def train_step(run: SFTRun) -> dict:
    """One optimizer step over ``windows_per_step`` windows per DP rank; returns its metrics record.

    On a GPU the host reads the device once, at the end: the loss, the gradient norm and the MoE
    load come back together after the update is queued. Before that read the host fetches the
    next step's windows (:meth:`SFTRun.prefetch`) and clears the gradients, so the optimizer's
    per-parameter Python loops and the data reads run while the device is still in the backward.

    Raises:
        TrainingDivergedError: non-finite loss or gradient norm. The step's update has been applied
            to this process's weights; nothing is saved after it, so the latest checkpoint stays the
            last good one.
    """
    import torch
    from megatron.core import parallel_state as ps

    cfg, layout, device = run.cfg, run.layout, run.device
    start = time.perf_counter()
    sums = torch.zeros(3, dtype=torch.float64, device=device)   # NLL sum, target tokens, indexer KL
    windows = run.take_windows()
    for micro, (ids, labels, target) in enumerate(windows):
        # The gradient reduction (overlapped with the last backward, or after it) runs once per step.
        last = micro == len(windows) - 1
        with contextlib.nullcontext() if last else run.model.no_sync():
            nll = run.model(ids, labels)                                     # [1, s / cp] float32 nats
            masked = (nll * target).sum()
            if run.step + 1 == cfg.inject_nan_at_step:
                masked = masked * float("nan")
            indexer_kl = run.indexer_kl.pop()                                # a tensor, or 0.0 without DSA
            n_targets = target.sum()
            (masked + cfg.indexer_kl_coeff * indexer_kl * n_targets).backward()
        sums[0] += masked.detach()
        sums[1] += n_targets
        sums[2] += indexer_kl.detach() if torch.is_tensor(indexer_kl) else indexer_kl
    local_targets = sums[1].to(torch.float32).clone()
    torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
    load = moe_overload(run.module, cfg.expert_parallel)     # before finalize_model_grads resets the counts
    # Grads are of the summed NLL: the optimizer step divides them by the global number of target tokens.
    grad_norm = optimizer_step(run.model, run.optimizer, run.scheduler, local_targets)
    run.consumed += cfg.windows_per_step * layout.dp_size
    run.step += 1
    if run.step < cfg.steps:
        run.prefetch()
    run.model.zero_grad_buffer()        # stream-ordered after the update's reads of the gradients
    run.optimizer.zero_grad()
    on_device = [(sums[0] / sums[1].clamp_min(1)).float(), sums[2].float()]
    if torch.is_tensor(grad_norm):
        on_device.append(grad_norm.float().reshape(()))
    if load is not None:
        on_device.extend(load)
    values = torch.stack(on_device).tolist()                                 # the step's one host read
    loss, kl_sum = values[:2]
    norm_value = values[2] if torch.is_tensor(grad_norm) else grad_norm
    overload, expert_imbalance = values[-2:] if load is not None else (None, None)
    if not math.isfinite(loss):
        run.emit({"event": "diverged", "step": run.step, "loss": str(loss)})
        raise TrainingDivergedError(f"non-finite training loss {loss} at step {run.step}; the run stops without "
                                    f"saving; last good checkpoint: {run.last_checkpoint()}")
    if norm_value is not None and not math.isfinite(norm_value):
        raise TrainingDivergedError(f"non-finite gradient norm {norm_value} at step {run.step}; the run stops "
                                    f"without saving; last good checkpoint: {run.last_checkpoint()}")
    run.loss = loss
    elapsed = time.perf_counter() - start
    tokens_per_s = cfg.seq_len * cfg.windows_per_step * layout.dp_size / elapsed
    peak = run.peak_tflops
    return {
        "step": run.step, "loss": loss, "bits_per_base": loss / math.log(2), "lr": run.optimizer.param_groups[0]["lr"],
        "grad_norm": norm_value,
        "indexer_kl": kl_sum / (layout.dp_size * cfg.context_parallel * cfg.windows_per_step),
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / layout.world_size,
        "step_time_s": elapsed, "peak_memory_gib": peak_memory_gib(), "peak_pinned_host_gib": peak_pinned_gib(),
        "moe_max_overload": overload, "moe_expert_max_over_mean": expert_imbalance,
        "mfu": run.flops_per_token * tokens_per_s / (peak * 1e12 * layout.world_size) if peak else None,
    }


def train(pack_dir: str | os.PathLike, cfg: SFTConfig, out_dir: str | os.PathLike) -> SFTResult:
    """Train ``cfg.model`` on the train shards of ``pack_dir``; run on every rank of the job.

    Writes on rank 0: ``out_dir/metrics.jsonl`` (one JSON object per step / validation /
    checkpoint), ``out_dir/hf/`` (HF export of the final weights, :mod:`model.convert`),
    ``out_dir/summary.json`` and ``out_dir/manifest.json`` (sha256 of every file).

    Raises:
        SFTConfigError: inconsistent configuration, or a checkpoint of another run.
        tasks.trainer.ParallelLayoutError: a launch layout that does not divide the ranks.
        tasks.windows.WindowError: the train shards cannot supply the windows.
        tasks.memory_plan.MemoryPlanError: the plan does not fit this machine (before anything is allocated).
        TrainingDivergedError: non-finite loss or gradient norm; the latest checkpoint stays the
            last good one.
    """
    from tqdm.auto import tqdm

    run = SFTRun.start(pack_dir, cfg, out_dir)
    bar = tqdm(total=cfg.steps, initial=run.step, desc="sft", unit="step", disable=None if run.is_main else True)
    with ManualGC(cfg.gc_interval) as collector, bar:
        while run.step < cfg.steps:
            record = train_step(run)
            run.emit(record)
            collector.step(run.step)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update()
            last_step = run.step == cfg.steps
            improved = False
            if (cfg.eval_every and run.step % cfg.eval_every == 0) or last_step:
                improved = run.validate()
            if run.checkpointer and ((cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0) or last_step
                                     or improved):
                run.save(improved)
            if run.step == cfg.inject_crash_at_step:
                os._exit(1)
    return run.finish()


# ---- Flyte task: resources, Elastic layout and cache version only; the logic is train() ----

from flytekit import Cache, task  # noqa: E402
from flytekit.extras.accelerators import GPUAccelerator  # noqa: E402
from flytekitplugins.kfpytorch import Elastic  # noqa: E402

from tasks.caching import HashedDir, as_output, requests_for, run_checkpoint_dir, stage_version  # noqa: E402
from tasks.caching import shared_kernel_cache, stage_output_dir  # noqa: E402
from tasks.presets import Preset, active_preset  # noqa: E402

SFT_VERSION = stage_version("sft", active_preset())


def preset_sft_config(preset: Preset) -> SFTConfig:
    """The :class:`SFTConfig` a preset asks for (windows, parallel sizes, :class:`tasks.presets.SFTSpec`)."""
    spec, par = preset.sft, preset.train_parallel
    return SFTConfig(
        model=preset.model, seq_len=preset.train_seq_len, eval_seq_len=preset.eval_seq_len, steps=spec.steps,
        lr=spec.lr, min_lr=spec.min_lr, warmup_steps=spec.warmup_steps, windows_per_step=spec.windows_per_step,
        dtype=spec.dtype, tensor_parallel=par.tensor_parallel, context_parallel=par.context_parallel,
        expert_parallel=par.expert_parallel, recompute=spec.recompute, recompute_modules=tuple(spec.recompute_modules),
        offload_layers=spec.offload_layers, mlp_chunk_tokens=spec.mlp_chunk_tokens,
        indexer_kl_coeff=spec.indexer_kl_coeff, expert_bias_update_rate=spec.expert_bias_update_rate,
        checkpoint_dir=spec.checkpoint_uri, checkpoint_every=spec.checkpoint_every, eval_every=spec.eval_every,
        eval_windows=spec.eval_windows,
    )


_PRESET = active_preset()
_TRAIN = _PRESET.train_resources


@task(
    task_config=Elastic(nnodes=_PRESET.train_parallel.nnodes, nproc_per_node=_PRESET.train_parallel.nproc_per_node,
                        increase_shared_mem=False),
    cache=Cache(version=SFT_VERSION),
    requests=requests_for(_TRAIN),
    accelerator=GPUAccelerator(_TRAIN.accelerator) if _TRAIN.accelerator else None,
    shared_memory=_TRAIN.shared_memory or False,
)
def sft_task(shards: HashedDir, cfg: SFTConfig, init: Optional[HashedDir] = None) -> HashedDir:
    """Flyte wrapper of :func:`train` on every Elastic worker; rank 0's output directory comes back.

    The output holds ``hf/`` (HF export), ``metrics.jsonl``, ``summary.json`` (with the checkpoint
    directory's path) and ``manifest.json``; checkpoints stay in ``cfg.checkpoint_dir`` (default
    ``$MEGABASE_HOME/checkpoints/<key>``, a path every worker derives identically: on a cluster
    it must be a shared mount). megatron is imported inside :func:`train` (workers are spawned
    with the task function cloudpickled). ``init`` (the base-model stage's export) replaces
    ``cfg.init_hf``, so held-out evaluation has the exact "before" checkpoint.
    """
    from tasks.caching import hf_export, manifest_sha256

    if init is not None:
        cfg = dataclasses.replace(cfg, init_hf=str(hf_export(init.download())))
    identity = dict(shards=manifest_sha256(shards), cfg=asdict(cfg) | {"init_hf": ""},
                    init=manifest_sha256(init) if init is not None else cfg.init_hf)
    cfg = dataclasses.replace(cfg, checkpoint_dir=run_checkpoint_dir(cfg.checkpoint_dir, SFT_VERSION, **identity))
    shared_kernel_cache(cfg.checkpoint_dir)
    out = stage_output_dir("sft", SFT_VERSION, **identity)
    train(shards.download(), cfg, out)
    finish_parallel()
    return as_output(out)


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m tasks.sft PACK_DIR OUT_DIR [--config JSON]``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pack_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--config", default="{}", help="JSON object of SFTConfig fields")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fields = json.loads(args.config)
    if "recompute_modules" in fields:
        fields["recompute_modules"] = tuple(fields["recompute_modules"])
    train(args.pack_dir, SFTConfig(**fields), args.out_dir)
    finish_parallel()


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    main()
