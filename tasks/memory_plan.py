"""Per-device and pinned-host memory of one training rank, planned before anything is allocated.

:func:`memory_plan` adds weights, gradient buffers, the distributed optimizer's state, the
activations autograd keeps (:func:`activation_bytes_per_token`, by layer and part, minus what
recompute drops and offload moves to pinned host memory), the backward's workspace and an
allocator reserve, and raises :class:`MemoryPlanError` when the device or the host cannot hold
it. The constants below are calibrated on an H200; ``tests/gpu/activation_bytes.py`` and
``tests/gpu/sft_small.py`` re-measure them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.presets import ParallelSpec
from tasks.trainer import check_parallel_sizes


class MemoryPlanError(RuntimeError):
    """The planned per-device or pinned-host memory exceeds what this machine has."""


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


def gib_or_mib(nbytes: int) -> str:
    """``nbytes`` in GiB, or in MiB when it is under 0.01 GiB and not zero (a tiny model's weights would otherwise
    read 0.00 GiB beside gigabytes of activations): the number right-aligned in 10 characters, then the unit."""
    if 0 < nbytes < (1 << 30) / 100:
        return f"{nbytes / 2**20:10.2f} MiB"
    return f"{nbytes / 2**30:10.2f} GiB"


def device_table(rows: list[tuple[str, int]], device_total: int, device_limit: int, width: int) -> list[str]:
    """Lines of a plan's table: one per ``(part, bytes)`` row (:func:`gib_or_mib`), then the device total against
    its limit."""
    lines = [f"  {name:<{width}s}{gib_or_mib(v)}" for name, v in rows]
    lines.append(f"  {'= per device':<{width}s}{gib_or_mib(device_total)} of {device_limit / 2**30:.2f} GiB")
    return lines


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
        lines = device_table([("weights", self.weights), ("grad buffers", self.grads),
                              ("optimizer (master+Adam)", self.optimizer),
                              ("activations kept on device", self.activations),
                              ("workspace (backward in flight)", self.workspace),
                              (f"allocator reserve ({ALLOCATOR_RESERVE:.0%})", self.reserve)],
                             self.device_total, self.device_limit, 36)
        lines.append(f"  {'pinned host (offloaded activations)':<36s}{gib_or_mib(self.pinned_host)} per device")
        lines.append(f"  {'host total for this node':<36s}{gib_or_mib(self.host_total)} of {self.host_limit / 2**30:.2f} GiB")
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
    (``docs/measurements.md``: every part within 1% for the ``small`` preset). Parts:

    * ``mhc``: the two hyper-connections' input streams and their projections' float32 ``y`` (``(2+n)n`` values)
      and ``rstd`` (the maps are recomputed from them: :class:`model.layers.HyperConnection`);
    * ``other``: the two RMSNorms (input + float32 rstd) and the two stream merges (the block
      output and the float32 ``post`` and ``comb`` maps: :func:`model.fused.hc_merge` mixes in float32);
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
    parts = {"mhc": 2 * n * h * width + 2 * ((2 + n) * n + 1) * f32,
             "other": 4 * h * width + 2 * (n * n + n) * f32 + 2 * f32}
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


def memory_plan(mcfg, cfg, world_size: int, procs_per_node: int, device_limit: int | None = None,
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
    ``docs/measurements.md``); the GPU benchmark reports the measured peak next to it.

    Args:
        mcfg: :class:`model.config.Glm5NextConfig`.
        cfg: the run's :class:`tasks.sft.SFTConfig` (its model, seq_len, dtype, parallel, recompute,
            offload, mlp_chunk_tokens and logits_chunk_tokens fields).
        world_size: ranks of the job; procs_per_node: ranks sharing one host's memory.
        device_limit: bytes of one device (default: free CUDA memory, or on CPU the host
            limit shared by the node's ranks); host_limit: bytes of the host (default:
            :func:`host_memory_limit_bytes`); on_gpu: plan for GPUs (default: whether CUDA is
            available here; pass True to plan a GPU preset from another machine).

    Raises:
        ParallelLayoutError: the parallel sizes do not divide the world size.
        MemoryPlanError: the device or host cannot hold the plan; the message has the table.
    """
    import torch

    from model.config import DSA, parameter_count
    from model.glm5_next import mlp_recomputed

    tp, cp, ep = cfg.tensor_parallel, cfg.context_parallel, cfg.expert_parallel
    dp = check_parallel_sizes(world_size, tp, cp, ep, mcfg.num_moe_experts)
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
            if getattr(cfg, "recompute_keep_attention", False) and mcfg.layer_types[i] == DSA:
                # the sparse attention's output (latent width) and float32 lse per token, kept on the device
                device_acts += mcfg.num_attention_heads // tp * (mcfg.kv_lora_rank * width + 4)
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
    # preset, docs/measurements.md): the gradients of the layer in backward (1; 1.08 measured at 64k
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


@dataclass(frozen=True)
class ForwardRun:
    """What :func:`forward_memory_plan` reads: one forward-only scoring rank (verify, evaluate).

    Attributes:
        seq_len: tokens of the longest window scored (split over the context-parallel ranks).
        dtype: "float32" or "bfloat16" parameters and activations.
        parallel: the layout (:class:`tasks.presets.ParallelSpec`: TP, CP, EP; nodes x processes).
        mlp_chunk_tokens: sequence-chunked MLP/MoE (0: whole sequence).
        engine_fraction: share of the device an inference engine on the same device takes
            (verify's engine leg on rank 0's node); 0: none.
    """

    seq_len: int
    dtype: str
    parallel: ParallelSpec
    mlp_chunk_tokens: int = 0
    engine_fraction: float = 0.0


SCORING_LOGITS_CHUNK_TOKENS = 4096
"""Positions whose float32 logits a scoring rank holds at once (``tasks.engines.TrainerLogProbs``' default)."""


@dataclass(frozen=True)
class ForwardPlan:
    """Expected per-device memory of one forward-only scoring rank (see :func:`forward_memory_plan`).

    Attributes:
        parts: bytes by part, in table order (the engine's share included).
        engine: bytes of the device an inference engine beside the rank takes.
        device_total, device_limit: planned bytes per device and what the device has.
    """

    parts: dict[str, int]
    engine: int
    device_total: int
    device_limit: int

    def table(self) -> str:
        return "\n".join(device_table(list(self.parts.items()), self.device_total, self.device_limit, 40))


def forward_memory_plan(mcfg, run: ForwardRun, device_limit: int | None = None,
                        on_gpu: bool | None = None) -> ForwardPlan:
    """Per-device memory of a forward-only scoring rank (no autograd), checked against the device.

    Weights in ``run.dtype`` (experts divided by EP, TP-split matrices by TP). Without autograd a
    layer's activations are freed when the next layer starts, so the activations are one
    layer's: the largest layer's saved bytes per token (:func:`activation_bytes_per_token`, the
    training plan's count of what a layer allocates, CP state pass included) for the
    ``seq_len / context_parallel`` local tokens, its MLP/MoE part for one ``mlp_chunk_tokens``
    chunk, and the residual streams entering and leaving it. Under CP a DSA layer all-gathers the
    whole window's latent keys and its indexer's keys and gates (``kv_lora_rank + 2 x
    index_head_dim`` elements per token of the window). One float32 logits chunk (with its
    log-softmax), the allocator reserve, and ``engine_fraction`` of the device when an engine
    shares it.

    Args:
        mcfg: :class:`model.config.Glm5NextConfig`.
        run: the scoring rank's :class:`ForwardRun` (its layout's ranks sharing a host share its
            memory on CPU).
        device_limit: bytes of one device (default: the CUDA device's total memory, the share an
            engine takes being a fraction of it, or on CPU the host limit shared by the node's ranks); on_gpu: plan for GPUs (default: whether CUDA is available
            here; pass True to plan a GPU preset from another machine).

    Raises:
        ParallelLayoutError: the parallel sizes do not divide the world size or the experts.
        MemoryPlanError: the device cannot hold the plan; the message has the table.
    """
    import torch

    from model.config import DSA, parameter_count

    tp, cp, ep = run.parallel.tensor_parallel, run.parallel.context_parallel, run.parallel.expert_parallel
    world_size = run.parallel.nnodes * run.parallel.nproc_per_node
    check_parallel_sizes(world_size, tp, cp, ep, mcfg.num_moe_experts)
    counts = parameter_count(mcfg)
    width = 2 if run.dtype == "bfloat16" else 4
    weights = int(((counts["total"] - counts["moe_routed"]) / tp + counts["moe_routed"] / ep) * width)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    tokens = -(-run.seq_len // cp)
    mlp_tokens = min(run.mlp_chunk_tokens, tokens) if run.mlp_chunk_tokens > 0 else tokens
    streams = 2 * mcfg.hc_mult * mcfg.hidden_size * width
    layer = 0
    for i in range(mcfg.num_layers):
        part = activation_bytes_per_token(mcfg, i, tp, width, on_gpu, cp)
        around = part["mhc"] + part["other"] + part["mixer"] + part["core"] + part["cp_state"]
        layer = max(layer, (around + streams) * tokens + part["mlp"] * mlp_tokens)
    has_dsa = DSA in mcfg.layer_types
    gathered = (mcfg.kv_lora_rank + 2 * mcfg.index_head_dim) * width * run.seq_len if cp > 1 and has_dsa else 0
    logits = min(SCORING_LOGITS_CHUNK_TOKENS, tokens) * mcfg.vocab_size // tp * 4 * 3
    reserve = int(ALLOCATOR_RESERVE * (weights + layer + gathered + logits))
    if device_limit is None:
        device_limit = (torch.cuda.mem_get_info()[1] if on_gpu
                        else host_memory_limit_bytes() // run.parallel.nproc_per_node)
    engine = int(device_limit * run.engine_fraction)
    parts = {"weights": weights, "one layer's forward in flight": layer,
             "CP-gathered keys (DSA latent, indexer)": gathered, "logits chunk (float32)": logits,
             f"allocator reserve ({ALLOCATOR_RESERVE:.0%})": reserve, "inference engine on the device": engine}
    device_total = sum(parts.values())
    plan = ForwardPlan(parts, engine, device_total, device_limit)
    if device_total > device_limit:
        raise MemoryPlanError(
            f"forward-only scoring (trainer log-probs): model at seq_len={run.seq_len} with TP={tp} CP={cp} EP={ep} over {world_size} ranks does "
            f"not fit: per-device memory {device_total / 2**30:.2f} GiB exceeds the device's "
            f"{device_limit / 2**30:.2f} GiB. Raise context_parallel (more ranks) or expert_parallel, or shorten "
            f"the windows.\n" + plan.table())
    return plan


def scoring_memory_plan(mcfg, preset, seq_len: int, with_engine: bool, device_limit: int | None = None,
                        on_gpu: bool | None = None) -> ForwardPlan:
    """:func:`forward_memory_plan` of a preset's trainer log-prob rank (verify's trainer leg,
    evaluate's trainer scorer): ``preset.infer_parallel``, ``preset.verify.dtype``, the SFT
    ``mlp_chunk_tokens``; with ``with_engine`` on a GPU, verify's engine takes
    ``preset.verify.engine_gpu_memory_fraction`` of the device (every GPU of rank 0's node).

    Raises:
        MemoryPlanError, ParallelLayoutError: as :func:`forward_memory_plan`.
    """
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    run = ForwardRun(seq_len, preset.verify.dtype, preset.infer_parallel,
                     preset.sft.mlp_chunk_tokens,
                     engine_fraction=preset.verify.engine_gpu_memory_fraction if with_engine and on_gpu else 0.0)
    return forward_memory_plan(mcfg, run, device_limit=device_limit, on_gpu=on_gpu)
