"""Supervised fine-tuning (next-base prediction) of the glm5_next model on packed DNA shards.

One process per device, launched by torch elastic (``torchrun``, or flytekitplugins-kfpytorch
``Elastic`` in :func:`sft_task`); megatron-core ``parallel_state`` splits the world into
TP x CP x DP (EP inside the TP x CP x DP ranks for the MoE experts). On a machine without a GPU
the same code runs on gloo through :mod:`model.cpu_compat`.

Data (:class:`WindowSampler`): windows of ``seq_len`` tokens cut from the train shards of a pack
output (schema in :mod:`tasks.pack`), non-overlapping, in an order drawn from ``seed`` (one
permutation per epoch). The data position is the number of windows consumed: it is a function of
the step, so resuming at step ``k`` reads exactly the windows an uninterrupted run reads. A window
predicts ``tokens[t + 1]`` from ``tokens[: t + 1]``; the last position has no target. The loss
is the mean next-token NLL over targets whose ``loss_mask`` is set (A/C/G/T; N and ``<sep>``
are never targets). CP rank ``r`` of ``R`` holds positions ``[r L/R, (r+1) L/R)`` of every window
(the contiguous layout of :mod:`model.parallel`).

Step (:func:`train`, on one screen): forward -> per-token NLL -> masked sum (+ DSA indexer KL,
DeepSeek-V3.2) -> backward -> megatron ``finalize_model_grads`` (DP x CP gradient reduction,
division by the global number of target tokens, MoE expert-bias update, DeepSeek-V3
aux-loss-free balancing) -> distributed optimizer step with gradient clipping -> LR schedule
(linear warm-up, cosine decay) -> metrics as JSON lines.

Checkpoints: megatron distributed checkpoints (``torch_dist``) in ``<checkpoint_dir>/step-NNNNNNN``,
written to a temporary directory and renamed, then ``latest`` (and ``best``) pointer files are
replaced atomically: a killed run never leaves a half-written checkpoint behind a pointer. They
hold the model, the distributed optimizer (``fully_reshardable``), the LR scheduler, every rank's
RNG states and the data position; a run whose ``checkpoint_dir`` holds a ``latest`` pointer
resumes from it (an Elastic restart resumes automatically).

Before anything is allocated, :func:`memory_plan` estimates per-device memory and per-device
pinned host memory and raises :class:`MemoryPlanError` when they do not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Optional
from pathlib import Path

import numpy as np

from tasks.atomic import keep_records_through, resolve_inside

log = logging.getLogger("megabase.sft")

DTYPES = ("float32", "bfloat16")
RECOMPUTE = ("none", "selective", "full")


class SFTConfigError(ValueError):
    """An SFT configuration or launch layout that cannot run; the message names the field and value."""


class MemoryPlanError(RuntimeError):
    """The planned per-device or pinned-host memory exceeds what this machine has."""


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
            MLP/MoE, ``moe`` = MoE layers only) or ``full`` (whole layers, and each MLP chunk in them).
        offload_layers: activations of the first N layers are saved to pinned host memory.
        mlp_chunk_tokens: sequence-chunked MLP/MoE, tokens per chunk (0: whole sequence).
        logits_chunk_tokens: positions whose logits exist at once in the loss.
        indexer_kl_coeff: weight of the DSA lightning-indexer KL loss (0 disables; TP = 1 only).
        expert_bias_update_rate: MoE expert-bias step per update (aux-loss-free balancing).
        checkpoint_dir: directory (local or a mounted bucket) of distributed checkpoints.
        checkpoint_every: save every N steps (and at the end); 0: only at the end.
        keep_checkpoints: most recent checkpoints kept besides ``best``.
        eval_every: validation every N steps (and at the end); 0: only at the end.
        eval_windows, eval_seq_len: held-out windows per validation and their length.
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
    offload_layers: int = 0
    mlp_chunk_tokens: int = 0
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


# ---- data ----------------------------------------------------------------------------------


class WindowSampler:
    """Deterministic, resumable windows of ``seq_len`` tokens over the shards of one split.

    Windows are ``[o, o + seq_len)`` for ``o = 0, seq_len, 2 seq_len, ...`` inside each shard
    (a shard's tail shorter than ``seq_len`` is not used). Global window ``i`` of the stream is
    ``perm_e[i mod n]`` with ``e = i div n`` and ``perm_e`` the permutation of the ``n`` windows
    drawn by ``numpy.random.default_rng((seed, e))``: the order depends on ``seed`` only, and
    any position can be read without replaying the ones before it.

    Args:
        pack_dir: a :func:`tasks.pack.pack` output directory.
        split: ``"train"`` or ``"eval"``.
        seq_len: tokens per window.
        seed: order seed.

    Raises:
        SFTConfigError: no shard of the split holds ``seq_len`` tokens.
    """

    def __init__(self, pack_dir: str | os.PathLike, split: str, seq_len: int, seed: int):
        self.pack_dir = Path(pack_dir)
        from tasks.pack import verify_shards
        shards = verify_shards(self.pack_dir, (split,))["splits"][split]["shards"]
        self.seq_len, self.seed = seq_len, seed
        self.shards = [s["path"] for s in shards]
        self.windows = [(i, o) for i, s in enumerate(shards) for o in range(0, s["tokens"] - seq_len + 1, seq_len)]
        if not self.windows:
            longest = max((s["tokens"] for s in shards), default=0)
            raise SFTConfigError(f"{self.pack_dir}: no {split} shard holds seq_len={seq_len} tokens "
                                 f"(longest {longest}); lower seq_len")
        self.fingerprint = {"shards": [s["sha256"] for s in shards], "seq_len": seq_len, "seed": seed}
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.windows)

    def index(self, position: int) -> tuple[int, int]:
        """(shard index, token offset) of the window at stream position ``position``."""
        epoch, i = divmod(position, len(self.windows))
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng((self.seed, epoch)).permutation(len(self.windows)))
        return self.windows[int(self._perm[1][i])]

    def _shard(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        from tasks.pack import shard_token_stream

        if i not in self._cache:
            self._cache.clear()  # windows are drawn across shards at random: keep one decoded shard
            self._cache[i] = shard_token_stream(self.pack_dir / self.shards[i])
        return self._cache[i]

    def window(self, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window at stream position ``position``.

        Returns:
            (input ids ``[seq_len]`` int64, labels ``[seq_len]`` int64 (``labels[t] = ids[t + 1]``,
            last = 0), target mask ``[seq_len]`` bool (``loss_mask[t + 1]``, last False)).
        """
        shard, offset = self.index(position)
        return self.fixed_window(shard, offset)

    def fixed_window(self, shard: int, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens, mask = self._shard(shard)
        ids = tokens[offset: offset + self.seq_len].astype(np.int64)
        labels = np.zeros_like(ids)
        labels[:-1] = ids[1:]
        target = np.zeros(self.seq_len, bool)
        target[:-1] = mask[offset + 1: offset + self.seq_len]
        return ids, labels, target


def eval_positions(sampler: WindowSampler, count: int) -> list[tuple[int, int]]:
    """``count`` held-out windows spread evenly over the split (fixed for the whole run)."""
    n = len(sampler.windows)
    return [sampler.windows[(k * n) // count] for k in range(min(count, n))]


# ---- memory plan ---------------------------------------------------------------------------


def host_memory_limit_bytes() -> int:
    """Memory this process's container may use: the cgroup limit where set, else MemTotal.

    On some GPU hosts MemTotal starts far below the real (cgroup) allowance and on shared
    machines the cgroup is far below MemTotal: the smaller known bound wins.
    """
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
    return min(limits)


@dataclass(frozen=True)
class MemoryPlan:
    """Expected per-device memory of one SFT rank, in bytes (see :func:`memory_plan`)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    workspace: int
    reserve: int
    pinned_host: int
    device_total: int
    device_limit: int
    host_total: int
    host_limit: int

    def table(self) -> str:
        g = 1 << 30
        rows = [("weights", self.weights), ("grad buffers", self.grads), ("optimizer (master+Adam)", self.optimizer),
                ("activations kept on device", self.activations),
                ("workspace (backward in flight)", self.workspace),
                (f"allocator reserve ({ALLOCATOR_RESERVE:.0%})", self.reserve)]
        lines = [f"  {name:<36s}{v / g:10.2f} GiB" for name, v in rows]
        lines.append(f"  {'= per device':<36s}{self.device_total / g:10.2f} GiB of {self.device_limit / g:.2f} GiB")
        lines.append(f"  {'pinned host (offloaded activations)':<36s}{self.pinned_host / g:10.2f} GiB per device")
        lines.append(f"  {'host total for this node':<36s}{self.host_total / g:10.2f} GiB of {self.host_limit / g:.2f} GiB")
        return "\n".join(lines)


FLA_CHUNK = 64
"""Chunk length of fla's ``chunk_kda`` (its per-chunk ``[C, C]`` matrices are saved per token)."""
CPU_KDA_CORE_FACTOR = 30
"""The plain-torch chunked KDA (CPU path) saves 20-30x what fla saves per token (measured with
``tests/gpu/activation_bytes.py``: small 491,713 vs 16,464 B/token on an H200; tiny 38,826 vs
1,952 planned for fla); the CPU plan uses the upper end."""
OFFLOAD_PINNED_FACTOR = 1.083
"""Pinned host bytes per planned offloaded byte. :class:`model.offload.OffloadActivations` copies
each saved storage once (1.002 x the distinct saved bytes) and CUDA's caching host allocator
rounds every pinned block up to a power of two. Measured on an H200 for ``small`` with MLP
recompute: 1.083 by ``python tests/gpu/activation_bytes.py --preset small --seq 65536
--mlp-chunk-tokens 65536 --recompute-mlp --offload`` (every layer offloaded, the rounding applied
to each copy), 1.081 as the pinned peak of ``tests/gpu/sft_small.py --configs 256k-sel-off4``
(68.6 GiB for 63.5 GiB planned). ``torch.autograd.graph.save_on_cpu``, one copy per op that saves
a tensor or a view of it, measured 1.745 and 1.743 (110.6 GiB) the same ways. The rounding depends
on the tensor sizes; under full recompute (the offloaded tensors are each layer's input streams and
top-k, a few large blocks) the plan rounds each block itself (:func:`pinned_block_bytes`)."""
ALLOCATOR_RESERVE = 0.05
"""Fraction of the planned device total added for allocator fragmentation and communicator
buffers (a 512k full-recompute run on one H200 failed at 126 GiB allocated + 26 GiB reserved)."""


def pinned_block_bytes(nbytes: int) -> int:
    """Pinned host bytes CUDA's caching host allocator takes for a request of ``nbytes`` bytes:
    the next power of two (``CachingHostAllocator``, PyTorch ``aten/src/ATen/core/CachingHostAllocator.h``)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def activation_bytes_per_token(mcfg, layer: int, tp: int, width: int, on_gpu: bool = True,
                               context_parallel: int = 1) -> dict[str, int]:
    """Bytes autograd saves per token in layer ``layer`` on one TP rank, by part.

    Counted from the tensors each op of :mod:`model.layers` / :mod:`model.glm5_next` keeps for
    backward, with ``width`` bytes per activation element (2 for bf16) and float32 where the
    code keeps float32; checked against ``tests/gpu/activation_bytes.py`` (autograd's saved
    tensors, deduplicated by storage) on CPU in ``tests/test_sft.py`` and on an H200
    (``kernels/NOTES.md at fee4dc9``: every part within 1% for the ``small`` preset). Parts:

    * ``mhc``: the two hyper-connections' input streams (their float32 maps are recomputed);
    * ``other``: the two RMSNorms (input + float32 rstd) and the two stream merges;
    * ``mixer``: projections, convolutions, gates and norms around the token mixer;
    * ``core``: fla ``chunk_kda`` on GPU (``CPU_KDA_CORE_FACTOR`` x on CPU) or the DSA sparse
      attention (absorbed queries, latent, output, LSE) plus the int32 top-k of a layer with its
      own indexer;
    * ``cp_state``: with ``context_parallel > 1`` a KDA layer runs ``chunk_kda`` twice
      (:meth:`model.layers.KDAMixer._kda_context_parallel`: the state pass with values ``[v | 0]``,
      then the output pass), so it keeps a second core and the second value half: ``core + kd``
      elements, else 0 (256k tokens with CP=2 on 2 H200s, MLP recompute: 91.0 GiB peak, 76.7 GiB
      planned without this part, 90.2 GiB with it, 94.7 GiB with the allocator reserve);
    * ``mlp``: dense SwiGLU (input, gate/up output, clamp/SiLU/product intermediates) or MoE
      (``topk`` routed copies, the shared expert, router and dispatch; sequence split over TP);
    * ``mlp_input``: what a recomputed MLP chunk keeps (its input).
    """
    f32 = 4
    h, n = mcfg.hidden_size, mcfg.hc_mult
    parts = {"mhc": 2 * n * h * width + 2 * n * f32,
             "other": (4 * h + 2 * (n * n + n)) * width + 2 * f32}
    if mcfg.layer_types[layer] == "linear_attention":
        heads = mcfg.linear_num_heads // tp
        kd, d = heads * mcfg.linear_head_dim, mcfg.linear_head_dim
        parts["mixer"] = (h + 10 * kd + 2 * d) * width + heads * f32   # x, conv in/out, f, gate, o, low-rank
        core = (5 * kd + 2 * heads * FLA_CHUNK) * width + kd * f32 + 2 * heads * f32  # q k v, l2-normed q k, g
        parts["core"] = core if on_gpu else CPU_KDA_CORE_FACTOR * core
        parts["cp_state"] = 0 if context_parallel == 1 else parts["core"] + kd * width
    else:
        heads = mcfg.num_attention_heads // tp
        kv = mcfg.kv_lora_rank
        parts["mixer"] = (h + 2 * mcfg.q_lora_rank + kv + heads * (mcfg.qk_nope_head_dim + mcfg.v_head_dim)) * width \
            + 2 * f32
        own_indexer = mcfg.indexer_types[layer] != "shared"
        parts["core"] = (2 * heads * kv + kv) * width + heads * f32 + (mcfg.index_width * 4 if own_indexer else 0)
        parts["cp_state"] = 0
    if mcfg.mlp_layer_types[layer] == "sparse":
        routed = mcfg.moe_router_topk * (1.25 * h + 6 * (mcfg.moe_ffn_hidden_size or 0))  # permuted copies
        shared = h + 6 * (mcfg.moe_shared_expert_intermediate_size or 0)
        parts["mlp"] = int((routed + shared + h + 8 * (mcfg.num_moe_experts or 0)) * width / tp)
    else:
        parts["mlp"] = (h + 6 * mcfg.ffn_hidden_size // tp) * width
    parts["mlp_input"] = h * width
    return parts


def memory_plan(mcfg, cfg: SFTConfig, world_size: int, procs_per_node: int, device_limit: int | None = None,
                host_limit: int | None = None, on_gpu: bool | None = None) -> MemoryPlan:
    """Per-device memory of one rank for model ``mcfg`` under ``cfg``, checked against the limits.

    Weights in ``cfg.dtype`` (experts divided by EP, TP-split matrices by TP), float32 gradient
    buffers, float32 master weights + Adam moments (12 bytes/parameter) divided over the
    DP x CP ranks by the distributed optimizer; activations: per-token saved bytes of every
    layer (:func:`activation_bytes_per_token`) times ``seq_len / context_parallel`` tokens,
    minus the MLP/MoE part of recomputed layers (``selective``) or all but the layer inputs
    (``full``); offloaded layers move to pinned host memory (times ``OFFLOAD_PINNED_FACTOR``).
    Workspace: 1-3.75x one layer's non-MLP activations (the backward in flight, by recompute and
    offload mode), one MLP chunk, one float32 logits chunk; plus an allocator reserve of
    ``ALLOCATOR_RESERVE``. Estimates calibrated on an H200 (table in
    ``kernels/NOTES.md at fee4dc9``); the GPU benchmark reports the measured peak next to it.

    Args:
        mcfg: :class:`model.config.Glm5NextConfig`.
        cfg: the run's :class:`SFTConfig`.
        world_size: ranks of the job; procs_per_node: ranks sharing one host's memory.
        device_limit: bytes of one device (default: free CUDA memory, or on CPU the host
            limit shared by the node's ranks); host_limit: bytes of the host (default:
            :func:`host_memory_limit_bytes`); on_gpu: plan for GPUs (default: whether CUDA is
            available here; pass True to plan a GPU preset from another machine).

    Raises:
        SFTConfigError: the parallel sizes do not divide the world size.
        MemoryPlanError: the device or host cannot hold the plan; the message has the table.
    """
    import torch

    from model.config import DSA, parameter_count
    from model.glm5_next import mlp_recomputed

    tp, cp, ep = cfg.tensor_parallel, cfg.context_parallel, cfg.expert_parallel
    if world_size % (tp * cp):
        raise SFTConfigError(f"world_size={world_size} is not divisible by tensor_parallel x context_parallel = {tp * cp}")
    dp = world_size // (tp * cp)
    if (dp * cp * tp) % ep or (mcfg.num_moe_experts or ep) % ep:
        raise SFTConfigError(f"expert_parallel={ep} must divide the DPxCPxTP ranks ({dp * cp * tp}) and the "
                             f"{mcfg.num_moe_experts} experts")
    counts = parameter_count(mcfg)
    dense = counts["total"] - counts["moe_routed"]
    local_params = dense / tp + counts["moe_routed"] / ep
    width = 2 if cfg.dtype == "bfloat16" else 4
    weights = int(local_params * width)
    grads = int(local_params * 4)
    optimizer = int(local_params * 12 / (dp * cp))
    tokens = cfg.seq_len // cp
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    device_acts, host_acts, layer_work, mlp_work, reload_work, pinned_exact = 0, 0, 0, 0, 0, 0
    offloaded_layer = 0   # the largest offloaded layer's saved bytes per token
    for i in range(mcfg.num_layers):
        part = activation_bytes_per_token(mcfg, i, tp, width, on_gpu, cp)
        # the workspace unit is the layer without the CP state pass, the one its in-flight factors
        # were fitted on (1M tokens, CP=2, full recompute: 107.7 GiB measured, 112.9 GiB planned)
        unit = part["mhc"] + part["other"] + part["mixer"] + part["core"]
        around = unit + part["cp_state"]
        if cfg.recompute == "full":
            # the layer checkpoint keeps its input streams, and the top-k a DSA layer hands on
            kept_tensors = [mcfg.hc_mult * mcfg.hidden_size * width]
            if i and mcfg.layer_types[i - 1] == DSA:
                kept_tensors.append(mcfg.index_width * 4)
            kept = sum(kept_tensors)
            if i < cfg.offload_layers:   # two large tensors: the host allocator's rounding, exactly
                pinned_exact += sum(pinned_block_bytes(b * tokens) for b in kept_tensors)
                reload_work = max(reload_work, kept)
        elif mlp_recomputed(cfg.recompute, cfg.recompute_modules, mcfg.mlp_layer_types[i] == "sparse"):
            kept = around + part["mlp_input"]
        else:
            kept = around + part["mlp"]
        layer_work = max(layer_work, unit)
        mlp_work = max(mlp_work, part["mlp"])
        if i < cfg.offload_layers:
            host_acts += kept
            offloaded_layer = max(offloaded_layer, kept)
        else:
            device_acts += kept
    activations = int(device_acts * tokens)
    pinned = pinned_exact if cfg.recompute == "full" else int(host_acts * tokens * OFFLOAD_PINNED_FACTOR)
    chunk = min(cfg.logits_chunk_tokens, tokens)
    mlp_tokens = min(cfg.mlp_chunk_tokens, tokens) if cfg.mlp_chunk_tokens > 0 else tokens
    # Backward in flight, in units of one layer's non-MLP activations, fitted on an H200 (small
    # preset, kernels/NOTES.md at fee4dc9): the gradients of the layer in backward (1; 1.08 measured at 64k
    # without recompute), a reloaded offloaded layer (+0.75; 1.7 measured at 256k), a recomputed
    # layer with its gradients (+2; 2.8 measured at 256k full recompute); plus one MLP chunk and
    # one float32 logits chunk. Under full recompute an offloaded layer reloads only its inputs
    # (``reload_work``) before its forward is recomputed on the device.
    # On a GPU the offloaded layers' copies run on a copy stream (model.offload.OffloadChain) and
    # each offloaded layer's backward prefetches the one before: one more offloaded layer's saved
    # tensors on the device while a layer is in backward.
    offload_reload = 0.75 if cfg.offload_layers and cfg.recompute != "full" else 0
    prefetch = offloaded_layer if on_gpu and cfg.offload_layers > 1 else 0
    layers_in_flight = 1 + (2 if cfg.recompute == "full" else 0) + offload_reload
    workspace = int(layers_in_flight * layer_work * tokens + (reload_work + prefetch) * tokens + mlp_work * mlp_tokens
                    + chunk * mcfg.vocab_size / tp * 4 * 3)
    reserve = int(ALLOCATOR_RESERVE * (weights + grads + optimizer + activations + workspace))
    device_total = weights + grads + optimizer + activations + workspace + reserve
    host_limit = host_limit or host_memory_limit_bytes()
    if device_limit is None:
        if on_gpu:
            device_limit = torch.cuda.mem_get_info()[0]
        else:
            device_limit = host_limit // procs_per_node
    on_host = 0 if on_gpu else device_total   # on CPU the "device" is host memory
    host_total = procs_per_node * (pinned + on_host)
    plan = MemoryPlan(weights, grads, optimizer, activations, workspace, reserve, pinned, device_total, device_limit,
                      host_total, host_limit)
    problems = []
    if device_total > device_limit:
        problems.append(f"per-device memory {device_total / 2**30:.2f} GiB exceeds the device's "
                        f"{device_limit / 2**30:.2f} GiB")
    if host_total > host_limit:
        problems.append(f"host memory for {procs_per_node} ranks {host_total / 2**30:.2f} GiB exceeds the host's "
                        f"{host_limit / 2**30:.2f} GiB (cgroup limit or MemTotal)")
    if problems:
        raise MemoryPlanError(
            f"model {cfg.model!r} at seq_len={cfg.seq_len} with TP={tp} CP={cp} EP={ep} DP={dp} "
            f"recompute={cfg.recompute!r} offload_layers={cfg.offload_layers} does not fit: "
            + "; ".join(problems) + ". Raise context_parallel, enable recompute/offload or lower seq_len.\n"
            + plan.table()
        )
    return plan


# ---- megatron on this machine --------------------------------------------------------------


@contextlib.contextmanager
def _megatron_optimizer_on_cpu():
    """Let megatron's optimizer code run on CPU tensors (no-op when a GPU is present).

    megatron-core 0.19.2 asserts ``param.type() == "torch.cuda.FloatTensor"`` (distributed
    optimizer, gradient clipping) and allocates norm buffers with ``device="cuda"`` (``clip_grads``, ``utils.local_multi_tensor_l2_norm``). Inside this
    context a CPU tensor reports its CUDA type name and ``device="cuda"`` allocations in those
    megatron modules land on the CPU. Scoped to optimizer construction and ``step()`` so no other
    code sees it; :mod:`model.cpu_compat` leaves ``Tensor.type`` alone for the same reason.
    """
    import torch

    if torch.cuda.is_available():
        yield
        return
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    original_type = torch.Tensor.type

    def cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return original_type(self, dtype, non_blocking, **kwargs)

    class _CPUTorch:
        """``torch`` as seen by the patched megatron modules: ``device="cuda"`` means the CPU."""

        def __getattr__(self, name):
            value = getattr(torch, name)
            if name in ("zeros", "tensor", "empty", "ones", "full", "zeros_like", "empty_like"):
                def on_cpu(*args, **kwargs):
                    if str(kwargs.get("device", "")).startswith("cuda"):
                        kwargs["device"] = "cpu"
                    return value(*args, **kwargs)
                return on_cpu
            return value

    modules = (clip_grads, distrib_optimizer, optimizer, utils)
    saved = [m.torch for m in modules]
    torch.Tensor.type = cuda_type_name
    for m in modules:
        m.torch = _CPUTorch()
    try:
        yield
    finally:
        torch.Tensor.type = original_type
        for m, t in zip(modules, saved):
            m.torch = t


@dataclass(frozen=True)
class Layout:
    """This rank's place in the job (from torch elastic's environment and megatron parallel_state)."""

    rank: int
    world_size: int
    local_world_size: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    dp_size: int


def init_parallel(cfg: SFTConfig) -> Layout:
    """Initialise ``torch.distributed`` (nccl, or gloo on CPU) and megatron ``parallel_state``.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun, kfpytorch
    Elastic); without them runs as a single process (in-memory rendezvous, no port).

    Raises:
        SFTConfigError: TP x CP does not divide the world size.
    """
    import torch
    from megatron.core import parallel_state as ps

    from model import cpu_compat

    cpu_compat.enable()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world % (cfg.tensor_parallel * cfg.context_parallel):
        raise SFTConfigError(f"world_size={world} is not divisible by tensor_parallel={cfg.tensor_parallel} x "
                             f"context_parallel={cfg.context_parallel}")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cpu_compat.init_process_group(rank, world)
    if not ps.model_parallel_is_initialized():
        # Experts are whole on their EP rank (expert TP = 1): the layout model.convert reads/writes.
        ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_parallel,
                                     context_parallel_size=cfg.context_parallel,
                                     expert_model_parallel_size=cfg.expert_parallel,
                                     expert_tensor_parallel_size=1)
    return Layout(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), ps.get_tensor_model_parallel_rank(),
                  ps.get_context_parallel_rank(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def model_config(cfg: SFTConfig):
    """The :class:`model.config.Glm5NextConfig` of the run: preset + parallel sizes + memory knobs."""
    import torch

    from model.config import preset

    recompute = {
        "none": {},
        "selective": dict(recompute_granularity="selective", recompute_modules=list(cfg.recompute_modules)),
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }[cfg.recompute]
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    overrides = dict(tensor_model_parallel_size=cfg.tensor_parallel, context_parallel_size=cfg.context_parallel,
                     expert_model_parallel_size=cfg.expert_parallel, expert_tensor_parallel_size=1, mlp_chunk_tokens=cfg.mlp_chunk_tokens,
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


def _model_sharded_state_dict(module):
    """megatron sharded state dict of the model, with TP-split parameters of plain modules fixed.

    ``MegatronModule.sharded_state_dict`` marks a module's own parameters as replicated over TP
    unless the module overrides it; the KDA mixer's convolution weights, ``dt_bias`` and ``A_log``
    are split over TP (``tensor_model_parallel`` attribute) and would be saved from TP rank 0
    only. They are re-described here as TP shards along their ``partition_dim``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    sharded = module.sharded_state_dict()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp == 1:
        return sharded
    replica = ps.get_data_parallel_rank(with_context_parallel=True)
    for name, param in module.named_parameters():
        entry = sharded.get(name)
        if (getattr(param, "tensor_model_parallel", False) and isinstance(entry, ShardedTensor)
                and tuple(entry.global_shape) == tuple(param.shape)):
            sharded[name] = ShardedTensor.from_rank_offsets(
                name, param, (param.partition_dim, tp_rank, tp), replica_id=(0, 0, replica))
    return sharded


# ---- DSA indexer KL loss -------------------------------------------------------------------


class IndexerKL:
    """Collects the DSA lightning-indexer KL loss (DeepSeek-V3.2 sec. 2.1) of every full-indexer layer.

    A forward hook on each :class:`model.layers.DSAMixer` with its own indexer recomputes, from the
    mixer's input ``x [s, b, h]`` and its selection ``topk [b, s, W]``, the main attention's
    log-normaliser (no gradient) and the indexer scores of a *detached* input, and hands them to
    :func:`kernels.dsa.indexer_kl_loss`: the KL trains the indexer only, the LM loss trains the
    rest. The recomputation costs one extra sparse-attention forward per full-indexer layer;
    the model does not expose its ``lse``.
    """

    def __init__(self, module, coeff: float):
        from model.layers import DSAMixer

        self.losses: list = []
        self.handles = []
        if coeff:
            self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in module.modules()
                            if isinstance(m, DSAMixer) and m.indexer is not None]

    def _hook(self, mixer, args, kwargs, output):
        import torch
        import torch.nn.functional as F

        from kernels.dsa import indexer_kl_loss, sparse_mla_attention
        from model.layers import _cp_context
        from model.parallel import all_gather_seq

        if not torch.is_grad_enabled():
            return
        cp, c, ix = _cp_context(), mixer.cfg, mixer.indexer
        xb = args[0].detach().transpose(0, 1)
        topk = output[1]
        with torch.no_grad():
            q_resid = mixer.q_a_layernorm(mixer.q_a_proj(xb))
            q = mixer.q_b_proj(q_resid)[0].unflatten(-1, (mixer.heads, mixer.nope))
            latent = all_gather_seq(mixer.kv_a_layernorm(mixer.kv_a_proj_with_mqa(xb)), 1, cp)
            w_uk = mixer.kv_b_proj.weight.view(mixer.heads, mixer.nope + mixer.v_dim, mixer.kv_lora)[:, : mixer.nope]
            q_abs = torch.einsum("bshd,hdc->bshc", q, w_uk)
            _, lse = sparse_mla_attention(q_abs, latent, topk, mixer.nope ** -0.5, mixer.kv_lora)
        q_index = ix.wq_b(q_resid).unflatten(-1, (ix.n_heads, ix.head_dim))
        k_index = all_gather_seq(ix.k_norm(ix.wk(xb)), 1, cp)
        gate = all_gather_seq(F.linear(xb, ix.kpool_compress_gate), 1, cp)
        weights = ix.weights_proj(xb).float() * ix.n_heads ** -0.5
        self.losses.append(indexer_kl_loss(
            q_index, k_index, gate, ix.kpool_compress_ape, weights, q_abs, latent, lse, topk,
            kpool=c.index_kpool, topk=c.index_topk, index_softmax_scale=ix.head_dim ** -0.5,
            softmax_scale=mixer.nope ** -0.5, cu_seqlens=kwargs.get("cu_seqlens")))

    def pop(self):
        """Sum of the collected layer losses (scalar float32, 0 without any) and reset."""
        total = sum(self.losses) if self.losses else 0.0
        self.losses = []
        return total


# ---- metrics helpers -----------------------------------------------------------------------


def model_flops_per_token(mcfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward) of the model at ``seq_len``.

    Matmuls: ``6 x active parameters`` (routed experts counted ``topk`` times); DSA sparse MLA
    in absorbed form: ``6 x 2 x H x W x (kv_lora + kv_lora)`` for ``W`` selected keys; lightning
    indexer (forward only, no gradient): ``2 x H_I x D_I x (seq_len / 2) / kpool`` pool scores on
    average under the causal mask; KDA chunked recurrence: ``6 x 4 x H x d_k x d_v`` (state update,
    output, intra-chunk terms). Embedding lookups are not FLOPs and are excluded.
    """
    from model.config import parameter_count

    counts = parameter_count(mcfg)
    flops = 6.0 * (counts["active"] - counts["embedding"])
    for kind, indexer in zip(mcfg.layer_types, mcfg.indexer_types):
        if kind == "indexed_attention":
            flops += 6 * 2 * mcfg.num_attention_heads * mcfg.index_width * 2 * mcfg.kv_lora_rank
            if indexer == "full":
                flops += 2 * mcfg.index_n_heads * mcfg.index_head_dim * (seq_len / 2) / mcfg.index_kpool
        else:
            flops += 6 * 4 * mcfg.linear_num_heads * mcfg.linear_head_dim ** 2
    return flops


PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}
"""Dense bf16 tensor-core peak per device (vendor datasheets, without sparsity)."""


def _peak_tflops(cfg: SFTConfig) -> float | None:
    import torch

    if cfg.peak_tflops_per_device:
        return cfg.peak_tflops_per_device
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def step_log_line(record: dict, steps: int) -> str:
    """One progress line of a step's metrics record (the keys :func:`train` writes): loss in
    nats/token and bits/base, tokens/s, seconds, rank 0's peak memory in GiB (the device's on
    CUDA, the process's max RSS on CPU) and its peak pinned host GiB where measured (CUDA;
    ``None`` is left out)."""
    line = (f"sft step {record['step']}/{steps}: loss {record['loss']:.4f} nats ({record['bits_per_base']:.3f} "
            f"bits/base), {record['tokens_per_s']:.0f} tokens/s, {record['step_time_s']:.1f} s/step")
    peaks = [f"{record[key]:.2f} GiB {what}" for key, what in (("peak_memory_gib", "memory"),
                                                              ("peak_pinned_host_gib", "pinned"))
             if record.get(key) is not None]
    return line + (f", peak {', '.join(peaks)} (rank 0)" if peaks else "")


def _peak_memory_gib() -> float:
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def _peak_pinned_gib() -> float | None:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return None
    return stats().get("allocated_bytes.peak", 0) / 2**30  # host allocator keys have no ".all"


def _moe_overload(module, ep: int):
    """(busiest EP rank's routed tokens / balanced share, busiest expert / mean) over MoE layers.

    Reads the routers' ``local_tokens_per_expert`` of this step summed over TP x DP x CP ranks;
    call before ``finalize_model_grads`` (which uses and resets them).
    """
    import torch
    from megatron.core import parallel_state as ps

    counts = [m.local_tokens_per_expert.detach().clone().float() for m in module.modules()
              if getattr(m, "local_tokens_per_expert", None) is not None and hasattr(m, "expert_bias")]
    if not counts:
        return None, None
    stacked = torch.stack(counts)                      # [moe layers, experts]
    torch.distributed.all_reduce(stacked, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
    mean = stacked.mean(-1).clamp_min(1e-9)
    per_rank = stacked.unflatten(-1, (ep, -1)).sum(-1)  # [layers, ep]
    return (float((per_rank.max(-1).values / (mean * stacked.shape[-1] / ep)).max()),
            float((stacked.max(-1).values / mean).max()))


# ---- checkpoints ---------------------------------------------------------------------------


class Checkpointer:
    """Atomic megatron distributed checkpoints with ``latest`` and ``best`` pointers.

    Layout of ``root``::

        step-0000010/      a torch_dist checkpoint (model, optimizer, scheduler, RNG, data position)
        latest             text: the name of the newest complete checkpoint directory
        best               text: the checkpoint with the lowest validation loss

    A checkpoint is written into ``step-NNNNNNN.tmp`` and renamed once every rank finished;
    pointers are replaced with ``os.replace``. Leftover ``.tmp`` directories (a killed save) are
    removed at start-up.
    """

    def __init__(self, root: str, rank: int):
        import torch

        self.root = Path(root) if root else None
        self.rank = rank
        self._barrier = torch.distributed.barrier
        if self.root is not None and rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for tmp in self.root.glob("*.tmp"):
                shutil.rmtree(tmp)
        self._barrier()

    def pointer(self, name: str) -> Path | None:
        """The checkpoint directory a pointer (``latest``/``best``) names, or None."""
        if self.root is None or not (self.root / name).exists():
            return None
        return resolve_inside(self.root, (self.root / name).read_text().strip())

    def _set_pointer(self, name: str, target: Path) -> None:
        tmp = self.root / f".{name}.tmp"
        tmp.write_text(target.name + "\n")
        os.replace(tmp, self.root / name)

    def save(self, state: dict, step: int, best: bool, keep: int) -> Path:
        """Save ``state`` (a sharded state dict) as checkpoint ``step``; collective over all ranks."""
        from megatron.core import dist_checkpointing

        final = self.root / f"step-{step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        self._barrier()
        dist_checkpointing.save(state, str(tmp))
        self._barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._set_pointer("latest", final)
            if best:
                self._set_pointer("best", final)
            protected = {final, self.pointer("best")}
            for old in sorted(self.root.glob("step-???????"))[:-keep]:
                if old not in protected:
                    shutil.rmtree(old)
        self._barrier()
        return final

    def load(self, state: dict, path: Path) -> dict:
        """Load checkpoint ``path`` into the sharded state dict ``state``; returns the loaded dict."""
        from megatron.core import dist_checkpointing

        return dist_checkpointing.load(state, str(path))


def _rng_state() -> dict:
    import random

    import torch
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    import random

    import torch
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _init_adam_state(optimizer) -> None:
    """Create zero Adam state (``exp_avg``, ``exp_avg_sq``, a per-parameter ``step``) before a load.

    The distributed optimizer builds its loading template from ``state_dict()``, which (without
    Apex/TE) reads every parameter's ``step``; a fresh ``torch.optim.AdamW`` has no state yet and
    megatron's own ``init_state_fn`` creates the moments but no ``step``.
    """
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                if not state:
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                 step=torch.zeros((), dtype=torch.float32))


def _tolerate_missing_state_keys(optimizer) -> None:
    """Make the distributed optimizer's state setter copy only the state the checkpoint carries.

    ``load_parameter_state_from_fully_reshardable`` hands ``_set_main_param_and_optimizer_states``
    the parameter and Adam moments but not ``step`` (restored separately from the param groups),
    and the setter indexes the source by every key of the destination (``KeyError: 'step'``
    without Apex/TE, FINDINGS.md). This per-instance setter copies, under ``no_grad``, the keys
    present on both sides. Only for the non-precision-aware path, which this stage uses.
    """
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "model_param_group_index_map"):
            continue

        def set_states(model_param, tensors, opt=opt):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            targets = {"param": main_param, **opt.optimizer.state[main_param]}
            with torch.no_grad():
                for key, value in tensors.items():
                    if isinstance(value, torch.Tensor) and isinstance(targets.get(key), torch.Tensor):
                        targets[key].copy_(value)

        opt._set_main_param_and_optimizer_states = set_states


def _untie_adam_step(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor after a checkpoint load.

    megatron's optimizer state setter (without Apex/TE) writes one shared ``step`` tensor into
    every parameter's state; ``torch.optim.AdamW`` then increments it once per parameter per
    step and the bias correction of the next step is wrong (FINDINGS.md). Cloning restores
    per-parameter counters with the same value.
    """
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def build_trainer(mcfg, module, *, lr: float, min_lr: float, weight_decay: float, betas: tuple[float, float],
                  eps: float, grad_clip: float, steps: int, warmup_steps: int, decay_style: str):
    """Wrap ``module`` for training: megatron DDP, distributed Adam, LR schedule (SFT and RL).

    Gradients reduce in float32 over the DP x CP group; the optimizer state is sharded over DP
    (``use_distributed_optimizer``); parameters are ``mcfg.params_dtype``. The schedule warms up
    linearly for ``warmup_steps`` then follows ``decay_style`` ("cosine", "constant") to
    ``min_lr`` at ``steps``.

    Returns:
        (DDP-wrapped model, megatron optimizer, ``OptimizerParamScheduler``).
    """
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = mcfg.params_dtype
    model = DistributedDataParallel(mcfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), module)
    with _megatron_optimizer_on_cpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], adam_eps=eps, clip_grad=grad_clip, bf16=dtype == torch.bfloat16,
            params_dtype=dtype, use_distributed_optimizer=True), [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(steps, 1), lr_decay_style=decay_style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=max(steps, 1), wd_incr_style="constant",
        # On resume the schedule comes from this config; the checkpoint restores the step count.
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    return model, optimizer, scheduler


def training_state(module, optimizer, scheduler, layout: "Layout", is_loading: bool, progress: dict) -> dict:
    """The sharded state dict of a checkpoint: model, optimizer, scheduler, ``progress``, RNG.

    ``progress`` is a small picklable dict (step, data position, ...) stored once (rank 0's).
    """
    from megatron.core.dist_checkpointing import ShardedObject

    model_state = _model_sharded_state_dict(module)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}),
        "scheduler": scheduler.state_dict(),
        "progress": progress,
        "rng": ShardedObject("rng_state", _rng_state(), (layout.world_size,), (layout.rank,), replica_id=0),
    }


def restore_training_state(ckpt: "Checkpointer", path: Path, template, module, optimizer, scheduler) -> dict:
    """Load checkpoint ``path`` (a :func:`training_state` layout) into the run; returns its ``progress``.

    ``template()`` builds the loading state dict (:func:`training_state` with ``is_loading``);
    it is called once the fresh optimizer has Adam state to describe.

    Restores the model, the distributed Adam state (per-parameter ``step`` counters untied),
    the scheduler and this rank's RNG states. Collective over all ranks.
    """
    _init_adam_state(optimizer)
    _tolerate_missing_state_keys(optimizer)
    loaded = ckpt.load(template(), path)
    module.load_state_dict(loaded["model"], strict=False)
    with _megatron_optimizer_on_cpu():
        optimizer.load_state_dict(loaded["optimizer"])
    _untie_adam_step(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    _set_rng_state(loaded["rng"])
    return loaded["progress"]


# ---- the run -------------------------------------------------------------------------------


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


def _batch(sampler: WindowSampler, position_or_window, layout: Layout, cp: int, device):
    """This rank's CP slice of one window: (ids [1, s/cp], labels [1, s/cp], target mask [1, s/cp])."""
    import torch

    if isinstance(position_or_window, tuple):
        ids, labels, target = sampler.fixed_window(*position_or_window)
    else:
        ids, labels, target = sampler.window(position_or_window)
    part = len(ids) // cp
    cut = slice(layout.cp_rank * part, (layout.cp_rank + 1) * part)
    return tuple(torch.from_numpy(np.ascontiguousarray(a[cut]))[None].to(device) for a in (ids, labels, target))


def evaluate(module, sampler: WindowSampler, windows: list[tuple[int, int]], layout: Layout, cp: int, device) -> float:
    """Mean NLL (nats/token) over the target tokens of ``windows``; DP ranks split the windows."""
    import torch
    from megatron.core import parallel_state as ps

    module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for k in range(layout.dp_rank, len(windows), layout.dp_size):
            ids, labels, target = _batch(sampler, windows[k], layout, cp, device)
            nll = module(ids, labels)
            totals += torch.stack([(nll.double() * target).sum(), target.sum().double()])
    module.train()
    torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(totals[0] / totals[1].clamp_min(1))


class ManualGC:
    """Python's garbage collector off inside a training loop, with a full collection every ``interval``
    steps, at the same step on every rank (Megatron-LM's ``--manual-gc``).

    An automatic collection pauses one rank's host at a moment its own allocations choose, for tens of
    milliseconds (a full collection: 44 ms in a process that imported torch, on an H200 host). Where the
    device waits on the host's launches (the lightning indexer's first query blocks) the pause is device
    time too: it made every other timing of the 1M-token indexer 5-8% slower (kernels/NOTES.md at fee4dc9, v28). And
    the other ranks wait for that rank at the next collective.

    A context manager around the loop: on entry one full collection, then the collector off (``interval``
    > 0); :meth:`step` after each optimizer step; on exit the collector back as it was. ``interval`` 0
    changes nothing.

    Raises:
        ValueError: ``interval < 0``.
    """

    def __init__(self, interval: int):
        if interval < 0:
            raise ValueError(f"gc interval must be >= 0, got {interval}")
        self.interval = interval
        self._was_enabled = True

    def __enter__(self) -> "ManualGC":
        self._was_enabled = gc.isenabled()
        if self.interval:
            gc.collect()
            gc.disable()
        return self

    def step(self, step: int) -> None:
        """Collect after optimizer step ``step`` (counted from 1) when it is a multiple of ``interval``."""
        if self.interval and step % self.interval == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.interval and self._was_enabled:
            gc.enable()


def train(pack_dir: str | os.PathLike, cfg: SFTConfig, out_dir: str | os.PathLike) -> SFTResult:
    """Train ``cfg.model`` on the train shards of ``pack_dir``; run on every rank of the job.

    Writes on rank 0: ``out_dir/metrics.jsonl`` (one JSON object per step / validation /
    checkpoint), ``out_dir/hf/`` (HF export of the final weights, :mod:`model.convert`),
    ``out_dir/summary.json`` and ``out_dir/manifest.json`` (sha256 of every file).

    Raises:
        SFTConfigError: inconsistent configuration or launch layout.
        MemoryPlanError: the plan does not fit this machine (before anything is allocated).
        TrainingDivergedError: non-finite loss or gradient norm; the latest checkpoint stays the
            last good one.
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from model.convert import export_metadata, hf_state_dict, load_hf_checkpoint, load_hf_into_model, save_hf_checkpoint
    from model.glm5_next import build_model

    layout = init_parallel(cfg)
    is_main = layout.rank == 0
    out_dir = Path(out_dir)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mcfg = model_config(cfg)
    plan = memory_plan(mcfg, cfg, layout.world_size, layout.local_world_size)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        log.info("SFT config: %s", json.dumps(asdict(cfg)))
        log.info("memory plan (per device):\n%s", plan.table())

    train_data = WindowSampler(pack_dir, "train", cfg.seq_len, cfg.seed)
    eval_data = WindowSampler(pack_dir, "eval", cfg.eval_seq_len, cfg.seed)
    eval_windows = eval_positions(eval_data, cfg.eval_windows)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    module = build_model(mcfg, seed=cfg.seed, logits_chunk_tokens=cfg.logits_chunk_tokens,
                         dtype=dtype if dtype != torch.float32 else None)
    vision_state = vision_config = None
    if cfg.init_hf:
        _, text, vision_state = load_hf_checkpoint(Path(cfg.init_hf))
        vision_config = json.loads((Path(cfg.init_hf) / "config.json").read_text()).get("vision_config")
        load_hf_into_model(module, text)
    model, optimizer, scheduler = build_trainer(
        mcfg, module, lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps, grad_clip=cfg.grad_clip, steps=cfg.steps, warmup_steps=cfg.warmup_steps, decay_style="cosine")
    kl = IndexerKL(module, cfg.indexer_kl_coeff)

    def checkpoint_state(is_loading: bool, step: int, consumed: int, best_eval: float | None) -> dict:
        return training_state(module, optimizer, scheduler, layout, is_loading, {
            "step": step, "windows_consumed": consumed, "best_eval_loss": best_eval, "data": train_data.fingerprint})

    ckpt = Checkpointer(cfg.checkpoint_dir, layout.rank) if cfg.checkpoint_dir else None
    if ckpt and layout.rank == 0:
        # What tasks.export needs to rebuild the model from the checkpoints alone (nightly eval).
        from model.config import hf_config_dict

        (ckpt.root / "model_config.json").write_text(json.dumps(hf_config_dict(mcfg), indent=1, sort_keys=True))
    step, consumed, best_eval = 0, 0, None
    resume_from = ckpt.pointer("latest") if ckpt else None
    if resume_from is not None:
        progress = restore_training_state(ckpt, resume_from, lambda: checkpoint_state(True, 0, 0, None), module,
                                          optimizer, scheduler)
        if progress["data"] != train_data.fingerprint:
            raise SFTConfigError(f"{resume_from}: checkpoint was trained on other shards/seq_len/seed "
                                 f"({progress['data']}) than this run ({train_data.fingerprint})")
        step, consumed, best_eval = progress["step"], progress["windows_consumed"], progress["best_eval_loss"]
        if is_main:
            log.info("resumed from %s at step %d (%d windows consumed)", resume_from, step, consumed)

    metrics_path = out_dir / "metrics.jsonl"
    if is_main:                                # a restarted run keeps the history up to its checkpoint
        keep_records_through(metrics_path, step)

    def emit(record: dict) -> None:
        if is_main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            # Progress where the bar is off (no TTY: cluster logs, pyflyte's Elastic workers).
            if "event" in record:
                log.info("sft %s", json.dumps(record))
            else:
                log.info("%s", step_log_line(record, cfg.steps))

    def save(step_done: int, best: bool) -> None:
        path = ckpt.save(checkpoint_state(False, step_done, consumed, best_eval), step_done, best, cfg.keep_checkpoints)
        emit({"event": "checkpoint", "step": step_done, "path": str(path), "best": best})

    flops_per_token = model_flops_per_token(mcfg, cfg.seq_len)
    peak_tflops = _peak_tflops(cfg)
    tokens_per_step = cfg.seq_len * cfg.windows_per_step * layout.dp_size
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    loss = float("nan")
    bar = None
    if is_main:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=step, desc="sft", unit="step", disable=None)
    with ManualGC(cfg.gc_interval) as collector:
        while step < cfg.steps:
            start = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            sums = torch.zeros(3, dtype=torch.float64, device=device)   # NLL sum, target tokens, indexer KL
            for micro in range(cfg.windows_per_step):
                ids, labels, target = _batch(train_data, consumed + micro * layout.dp_size + layout.dp_rank, layout,
                                             cfg.context_parallel, device)
                nll = model(ids, labels)                                         # [1, s / cp] float32 nats
                masked = (nll * target).sum()
                if step + 1 == cfg.inject_nan_at_step:
                    masked = masked * float("nan")
                indexer_kl = kl.pop()
                n_targets = target.sum()
                (masked + cfg.indexer_kl_coeff * indexer_kl * n_targets).backward()
                sums += torch.stack([masked.detach().double(), n_targets.double(),
                                     torch.as_tensor(indexer_kl, dtype=torch.float64, device=device).detach()])
            local_targets = sums[1].to(torch.float32).clone()
            torch.distributed.all_reduce(sums, group=dp_cp_group)
            loss = float(sums[0] / sums[1].clamp_min(1))
            if not math.isfinite(loss):
                last = ckpt.pointer("latest") if ckpt else None
                emit({"event": "diverged", "step": step + 1, "loss": str(loss)})
                raise TrainingDivergedError(f"non-finite training loss {loss} at step {step + 1}; stopped before the "
                                            f"optimizer update; last good checkpoint: {last or 'none'}")
            overload, expert_imbalance = _moe_overload(module, cfg.expert_parallel)
            # Grads are of the summed NLL: finalize divides them by the global number of target tokens.
            finalize_model_grads([model], num_tokens=local_targets)
            scheduler.step(1)   # the LR of step k is the schedule at k + 1: warm-up starts above 0
            with _megatron_optimizer_on_cpu():
                _, grad_norm, _ = optimizer.step()
            if grad_norm is not None and not math.isfinite(grad_norm):
                raise TrainingDivergedError(f"non-finite gradient norm {grad_norm} at step {step + 1}; the update was "
                                            f"applied: resume from {ckpt.pointer('latest') if ckpt else 'none'}")
            consumed += cfg.windows_per_step * layout.dp_size
            step += 1
            elapsed = time.perf_counter() - start
            tokens_per_s = tokens_per_step / elapsed
            record = {
                "step": step, "loss": loss, "bits_per_base": loss / math.log(2), "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm,
                "indexer_kl": float(sums[2]) / (layout.dp_size * cfg.context_parallel * cfg.windows_per_step),
                "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / layout.world_size,
                "step_time_s": elapsed, "peak_memory_gib": _peak_memory_gib(),
                "peak_pinned_host_gib": _peak_pinned_gib(),
                "moe_max_overload": overload, "moe_expert_max_over_mean": expert_imbalance,
                "mfu": ((flops_per_token * tokens_per_s / (peak_tflops * 1e12 * layout.world_size))
                        if peak_tflops else None),
            }
            emit(record)
            collector.step(step)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}")
                bar.update()
            last_step = step == cfg.steps
            improved = False
            if (cfg.eval_every and step % cfg.eval_every == 0) or last_step:
                eval_loss = evaluate(module, eval_data, eval_windows, layout, cfg.context_parallel, device)
                improved = best_eval is None or eval_loss < best_eval
                best_eval = min(eval_loss, best_eval) if best_eval is not None else eval_loss
                emit({"event": "eval", "step": step, "eval_loss": eval_loss,
                      "eval_bits_per_base": eval_loss / math.log(2), "best": improved})
            if ckpt and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or last_step or improved):
                save(step, improved)
            if step == cfg.inject_crash_at_step:
                os._exit(1)
    if bar is not None:
        bar.close()

    hf = hf_state_dict(module)
    hf_dir = out_dir / "hf"
    manifest_sha = _sha256(Path(pack_dir) / "manifest.json")
    result = SFTResult(out_dir, hf_dir, metrics_path, str(ckpt.pointer("latest") or "") if ckpt else "",
                       str(ckpt.pointer("best") or "") if ckpt else "", loss, best_eval)
    if is_main:
        save_hf_checkpoint(hf, mcfg, hf_dir, export_metadata(cfg.model, manifest_sha), vision_state=vision_state,
                           vision_config=vision_config)
        summary = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
        summary["config"] = asdict(cfg)
        summary["memory_plan_bytes"] = asdict(plan)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != "manifest.json")
        (out_dir / "manifest.json").write_text(json.dumps(
            {"schema": "megabase.sft/1", "files": {str(p.relative_to(out_dir)): _sha256(p) for p in files}}, indent=1))
    torch.distributed.barrier()
    return result


def _sha256(path: Path) -> str:
    from tasks.atomic import sha256_file

    return sha256_file(path)


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


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    main()
