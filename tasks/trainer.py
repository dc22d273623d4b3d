"""The training machinery SFT and RL share: parallel init, the megatron trainer, the optimizer step,
manual garbage collection and step metrics.

One process per device, launched by torch elastic (``torchrun``, or flytekitplugins-kfpytorch
``Elastic``); :func:`init_parallel` splits the world into TP x CP x DP with megatron-core
``parallel_state`` (EP inside the TP x CP x DP ranks for the MoE experts) and returns the one
:class:`model.parallel.ParallelLayout` the model and the loop receive. On a machine without a
GPU the same code runs on gloo through :mod:`model.cpu_compat`. Checkpoints:
:mod:`tasks.checkpoint`; the memory plan: :mod:`tasks.memory_plan`.
"""

from __future__ import annotations

import contextlib
import gc
import os

from model.cpu_compat import foreach_multi_tensor_ops, megatron_optimizer_on_cpu
from model.parallel import ParallelLayout


class ParallelLayoutError(ValueError):
    """TP/CP/EP sizes that do not divide the job's ranks or the model's experts; the message names them."""


def check_parallel_sizes(world_size: int, tensor_parallel: int, context_parallel: int, expert_parallel: int,
                         num_experts: int | None = None) -> int:
    """The data-parallel size of ``world_size`` ranks split into TP x CP x DP, after checking EP.

    Raises:
        ParallelLayoutError: TP x CP does not divide ``world_size``, or EP does not divide the
            DP x CP x TP ranks or ``num_experts``.
    """
    tp, cp, ep = tensor_parallel, context_parallel, expert_parallel
    if world_size % (tp * cp):
        raise ParallelLayoutError(f"world_size={world_size} is not divisible by tensor_parallel={tp} x "
                                  f"context_parallel={cp}")
    dp = world_size // (tp * cp)
    if (dp * cp * tp) % ep or (num_experts or ep) % ep:
        raise ParallelLayoutError(f"expert_parallel={ep} must divide the DPxCPxTP ranks ({dp * cp * tp}) and the "
                                  f"{num_experts} experts")
    return dp


def recompute_overrides(recompute: str, modules: tuple[str, ...]) -> dict:
    """megatron config fields of an activation-recompute mode (SFT's and RL's ``recompute`` knob).

    ``"none"``; ``"selective"`` (the MLP/MoE ``modules`` of each layer recomputed in backward);
    ``"full"`` (each whole layer, uniform, one layer per checkpoint).

    Raises:
        KeyError: an unknown mode.
    """
    return {
        "none": {},
        "selective": dict(recompute_granularity="selective", recompute_modules=list(modules)),
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }[recompute]


def init_parallel(tensor_parallel: int = 1, context_parallel: int = 1, expert_parallel: int = 1) -> ParallelLayout:
    """Initialise ``torch.distributed`` (nccl, or gloo on CPU) and megatron ``parallel_state``.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun, kfpytorch
    Elastic); without them runs as a single process (in-memory rendezvous, no port). A job of
    several ranks ends with :func:`finish_parallel`.

    Returns:
        This rank's layout, the one the model (:func:`model.glm5_next.build_model`) and the
        training loop receive.

    Raises:
        ParallelLayoutError: TP x CP does not divide the world size.
    """
    import torch
    from megatron.core import parallel_state as ps

    from model import cpu_compat

    cpu_compat.enable()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    check_parallel_sizes(world, tensor_parallel, context_parallel, 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cpu_compat.init_process_group(rank, world)
    if not ps.model_parallel_is_initialized():
        # Experts are whole on their EP rank (expert TP = 1): the layout model.convert reads/writes.
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                     context_parallel_size=context_parallel,
                                     expert_model_parallel_size=expert_parallel,
                                     expert_tensor_parallel_size=1)
    return ParallelLayout.from_megatron(local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def finish_parallel() -> None:
    """End a job of several ranks at its normal end: a barrier, then megatron's and torch.distributed's groups
    destroyed, while the interpreter is whole.

    Left to interpreter finalization, a gloo process group's worker threads may still hold work when it
    is destructed, and the process aborts ("terminate called without an active exception",
    pytorch/pytorch#190489) after its job had finished: a rank that returned its result then fails the
    job. The barrier keeps a rank from tearing down while a peer is still in a collective with it. One
    process (``WORLD_SIZE`` unset or 1) keeps its group: a local pipeline run's stages share it.
    Call it on every rank, and only on the normal path (after an error the barrier would wait for
    the failed rank).
    """
    import torch
    from megatron.core import parallel_state as ps

    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def local_device():
    """This rank's device: its CUDA device (set by :func:`init_parallel`), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def local_window(arrays, layout: ParallelLayout, device):
    """This rank's contiguous CP slice of equal-length 1-D arrays (a window's ids, labels, target...):
    tensors ``[1, s / cp]`` of the arrays' dtypes on ``device``, one per array (SFT's windows, the
    trainer's log-probs).

    To a GPU the slices go through pinned host memory as non-blocking copies: a copy from pageable
    memory synchronises the stream first (``cudaStreamSynchronize`` after the copy in torch), which
    would drain the device queue at every window. The caching host allocator keeps each pinned
    block until its copy has run, so the caller may drop the host arrays at once.
    """
    import numpy as np
    import torch

    part = len(arrays[0]) // layout.cp_size
    cut = slice(layout.cp_rank * part, (layout.cp_rank + 1) * part)
    host = [torch.from_numpy(np.ascontiguousarray(a[cut]))[None] for a in arrays]
    if torch.device(device).type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in host)
    return tuple(t.to(device) for t in host)


def freeze_indexers(module) -> None:
    """Stop gradients to the DSA lightning indexers' parameters (``requires_grad=False``).

    The indexer gets gradients only from its KL loss (:class:`tasks.sft.IndexerKL`; its top-k selection
    is not differentiable), so without that loss (SFT with ``indexer_kl_coeff`` 0, and RL) it does not
    train. Frozen, it is left out of the optimizer (no weight decay pulls it toward zero) and out of the
    gradient buckets (megatron's overlapped reduction waits for every bucketed parameter's gradient).
    """
    from model.layers import Indexer

    for m in module.modules():
        if isinstance(m, Indexer):
            m.requires_grad_(False)


def build_trainer(mcfg, module, *, lr: float, min_lr: float, weight_decay: float, betas: tuple[float, float],
                  eps: float, grad_clip: float, steps: int, warmup_steps: int, decay_style: str,
                  optimizer_kernels: str = "foreach", overlap_grad_reduce: bool = False,
                  overlap_param_gather: bool = False):
    """Wrap ``module`` for training: megatron DDP, distributed Adam, LR schedule (SFT and RL).

    Gradients reduce in float32 over the DP x CP group; the optimizer state is sharded over DP
    (``use_distributed_optimizer``); parameters are ``mcfg.params_dtype``. ``overlap_grad_reduce``:
    megatron's bucketed reduce-scatter, each bucket issued during the backward as soon as its
    gradients are complete (every parameter that requires a gradient must receive one in every
    step; micro-batches before the last run under ``model.no_sync()``); otherwise one reduction
    after the backward. ``overlap_param_gather``: megatron's bucketed all-gather of the updated
    parameters during the next forward (each module's forward pre-hook waits for its bucket and
    issues the next one), not at the end of the optimizer step; until that forward the weights
    outside this rank's shard are the step's old ones, so anything that reads them without a
    forward calls :func:`sync_params` first (checkpoints, exports). The schedule warms up
    linearly for ``warmup_steps`` then follows ``decay_style`` ("cosine", "constant") to
    ``min_lr`` at ``steps``. ``optimizer_kernels``: ``foreach`` (:func:`optimizer_step` runs the
    gradient norm and clipping through torch's foreach kernels and Adam fused on GPUs) or
    ``megatron`` (megatron's kernels as it picks them: its per-tensor fallbacks without Transformer
    Engine or Apex, torch's foreach Adam).

    Returns:
        (DDP-wrapped model, megatron optimizer, ``OptimizerParamScheduler``).

    Raises:
        ValueError: an unknown ``optimizer_kernels``.
    """
    if optimizer_kernels not in ("foreach", "megatron"):
        raise ValueError(f"optimizer_kernels={optimizer_kernels!r}; valid: 'foreach', 'megatron'")
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = mcfg.params_dtype
    model = DistributedDataParallel(mcfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=True), module)
    with megatron_optimizer_on_cpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], adam_eps=eps, clip_grad=grad_clip, bf16=dtype == torch.bfloat16,
            params_dtype=dtype, use_distributed_optimizer=True, overlap_param_gather=overlap_param_gather), [model])
    optimizer.megabase_kernels = optimizer_kernels
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(steps, 1), lr_decay_style=decay_style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=max(steps, 1), wd_incr_style="constant",
        # On resume the schedule comes from this config; the checkpoint restores the step count.
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    return model, optimizer, scheduler




def sync_params(model) -> None:
    """Finish the parameter all-gather that ``overlap_param_gather`` leaves to the next forward.

    After :func:`optimizer_step` with overlap each rank holds the update of its own shard only; a
    checkpoint or an export taken then would save the other shards' old weights. This gathers them
    now (synchronously; the next forward then finds its buckets done). Collective over DP x CP;
    nothing to do without overlap.
    """
    if model.ddp_config.overlap_param_gather:
        model.start_param_sync(force_sync=True)


def optimizer_step(model, optimizer, scheduler, num_tokens):
    """Reduce the gradients of a summed per-token loss and apply one update; returns the grad norm.

    megatron ``finalize_model_grads`` reduces over DP x CP, divides by the global token count
    (the sum of ``num_tokens``, this rank's float32 count) and updates the MoE expert biases
    (aux-loss-free balancing); then the LR schedule advances (the LR of step k is the schedule at
    k + 1: warm-up starts above 0) and the distributed optimizer steps, with gradient clipping.

    Returns:
        The gradient norm before clipping, over every rank's shard: with ``foreach`` kernels a
        float32 ``[1]`` tensor on the device, read by nobody here, so nothing in the step waits
        for the device (the clip factor is applied on the device, as megatron does with Transformer
        Engine); with ``megatron`` kernels a float (its local norm reads the device); None when
        megatron skips the update.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([model], num_tokens=num_tokens)
    scheduler.step(1)
    foreach = getattr(optimizer, "megabase_kernels", "megatron") == "foreach"
    if foreach:
        fuse_adam(optimizer)
    with megatron_optimizer_on_cpu(), foreach_multi_tensor_ops() if foreach else contextlib.nullcontext():
        _, grad_norm, _ = optimizer.step()
    return grad_norm


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (chained / distributed / mixed-precision) optimizer."""
    if hasattr(optimizer, "chained_optimizers"):
        return [t for o in optimizer.chained_optimizers for t in _torch_optimizers(o)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def fuse_adam(optimizer) -> None:
    """Step megatron's torch Adam with ``fused=True`` (one multi-tensor kernel per group) on GPUs.

    Without Transformer Engine or Apex megatron builds ``torch.optim.AdamW`` with torch's default,
    the ``foreach`` path (on the order of ten launches per tensor group and a host read of every
    step count): host-bound for a few hundred tensors. The fused path is torch's own, the same
    update in float32. Idempotent and cheap (a look at each param group): a checkpoint load
    restores the saved groups' flags and step counts, so it runs before every step and moves step
    counts kept on the host to their parameters' device, where the fused kernel reads them.
    CPU optimizers are left as they are.
    """
    import torch

    for opt in _torch_optimizers(optimizer):
        if not isinstance(opt, torch.optim.Adam) or all(g.get("fused") for g in opt.param_groups):
            continue
        if any(p.device.type != "cuda" for g in opt.param_groups for p in g["params"]):
            continue
        for group in opt.param_groups:
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                state = opt.state.get(p)
                if state and torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


class ManualGC:
    """Python's garbage collector off inside a training loop, with a full collection every ``interval``
    steps, at the same step on every rank (Megatron-LM's ``--manual-gc``).

    An automatic collection pauses one rank's host at a moment its own allocations choose, for tens of
    milliseconds (a full collection: 44 ms in a process that imported torch, on an H200 host). Where the
    device waits on the host's launches (the lightning indexer's first query blocks) the pause is device
    time too: it made every other timing of the 1M-token indexer 5-8% slower (docs/measurements.md). And
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




# ---- step metrics ---------------------------------------------------------------------------


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


def peak_tflops(override: float = 0.0) -> float | None:
    """Dense bf16 peak TFLOP/s of this rank's device: ``override`` when set, else by device name
    (None on CPU or an unknown device)."""
    import torch

    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def peak_memory_gib() -> float:
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def peak_pinned_gib() -> float | None:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return None
    return stats().get("allocated_bytes.peak", 0) / 2**30  # host allocator keys have no ".all"


def moe_overload(module, ep: int):
    """The step's MoE load: float32 ``[2]`` on the device, (busiest EP rank's routed tokens / balanced
    share, busiest expert / mean) over MoE layers; None without MoE layers.

    Reads the routers' ``local_tokens_per_expert`` of this step summed over TP x DP x CP ranks;
    call before ``finalize_model_grads`` (which uses and resets them). Stays on the device (no host
    read), so the step's host work after it overlaps the backward still running.
    """
    import torch
    from megatron.core import parallel_state as ps

    counts = [m.local_tokens_per_expert.detach().clone().float() for m in module.modules()
              if getattr(m, "local_tokens_per_expert", None) is not None and hasattr(m, "expert_bias")]
    if not counts:
        return None
    stacked = torch.stack(counts)                      # [moe layers, experts]
    torch.distributed.all_reduce(stacked, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
    mean = stacked.mean(-1).clamp_min(1e-9)
    per_rank = stacked.unflatten(-1, (ep, -1)).sum(-1)  # [layers, ep]
    return torch.stack([(per_rank.max(-1).values / (mean * stacked.shape[-1] / ep)).max(),
                        (stacked.max(-1).values / mean).max()])
