"""Run megatron-core 0.19.2 on a machine without a GPU (CPU tensors, gloo process groups).

This is the only module in the project that patches megatron or ``torch.cuda``. It does
nothing when a CUDA device is present, so GPU runs execute megatron unmodified.
:func:`enable` is idempotent; call it before building megatron modules and before
``parallel_state.initialize_model_parallel``.

Calls covered (each met running megatron-core 0.19.2 on CPU):

``torch.cuda.current_device()``
    Used as ``device=`` for parameters and buffers (router ``expert_bias``, rotary tables, MoE
    token counters, DDP buckets). Mapped to ``torch.device("cpu")``.
``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``manual_seed_all``
    ``model_parallel_cuda_manual_seed`` seeds the CUDA generator and the ``CudaRNGStatesTracker``
    snapshots it for the tensor-parallel RNG streams. Mapped to the CPU default generator, so
    ``tracker.fork()`` swaps CPU generator states exactly as it swaps CUDA ones on GPU.
``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
    Read and restore the generator in ``tracker.fork()`` and in activation recompute
    (``tensor_parallel.checkpoint``), which must replay dropout exactly. Mapped to the CPU
    generator.
``torch.cuda.synchronize``, ``torch.cuda.current_stream``, ``torch.cuda.Stream``, ``torch.cuda.Event``
    The async checkpoint writer synchronises; the alltoall dispatcher and activation offload
    record events on side streams. On CPU every op is already ordered, so these are no-ops
    (a stream/event object whose methods do nothing).
``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu``
    The alltoall dispatcher copies its split sizes to the host as numpy arrays, but only from a
    CUDA tensor: on CPU they stay tensors, which ``all_to_all_single`` rejects as split sizes.
    Mapped to return the numpy array of a CPU tensor too.
``torch.Tensor.pin_memory``
    Host staging buffers (offload, optimizer state) are pinned; pinning needs a CUDA driver.
    Mapped to identity when no GPU is present.
``torch.Tensor.cuda``
    ``.cuda()`` on buffers (DDP grad buffers, RoPE utils). Mapped to identity (the tensor stays on
    CPU).

:func:`cpu_reference` is the one mapping used on a GPU host: for the span of a ``with`` block it
maps ``torch.cuda.current_device()`` to the CPU, so a float32 CPU copy of the model can run as a
reference next to the GPU model (megatron's router otherwise moves its CPU weight to the current
CUDA device in ``gating``).

:func:`megatron_optimizer_on_cpu` is the one scoped patch: megatron's distributed optimizer and
gradient clipping assert ``param.type() == "torch.cuda.FloatTensor"`` and allocate norm buffers
with ``device="cuda"``. Patching ``Tensor.type`` for the whole process would change its meaning for
every library, so the trainer wraps only optimizer construction, ``step()`` and state loading in it.

:func:`foreach_multi_tensor_ops` is the other scoped patch, on any host: without Transformer Engine
or Apex, megatron's gradient norm and clipping fall back to one ``torch.norm`` per tensor and a
``float()`` of each norm (a device sync per parameter: 432 per step for ``small``), and one
multiply per tensor. Inside it they use torch's multi-tensor ``_foreach`` kernels instead.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["enable", "is_active", "init_process_group", "cpu_reference", "megatron_optimizer_on_cpu",
           "foreach_multi_tensor_ops"]

_ACTIVE = False


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``/``Event`` on CPU: ordering is already sequential."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def is_active() -> bool:
    """True once :func:`enable` patched megatron for CPU in this process."""
    return _ACTIVE


def enable() -> bool:
    """Map megatron's CUDA-only calls to CPU when no GPU is present.

    Returns:
        True if the CPU mapping is (now) active, False if a CUDA device is present and nothing
        was changed.
    """
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = lambda tensor, as_numpy=False, record_stream=False: (
        tensor.numpy() if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda
        else move(tensor, as_numpy=as_numpy, record_stream=record_stream))
    _ACTIVE = True
    return True


def init_process_group(rank: int = 0, world_size: int = 1) -> None:
    """Initialise ``torch.distributed`` (gloo on CPU; nccl for CUDA tensors and gloo for CPU ones on a GPU host).

    A single process not started by a launcher (no ``WORLD_SIZE`` in the environment) rendezvouses
    on an in-memory ``HashStore``: no TCP port, so it cannot collide with another job's port or
    with a stale ``MASTER_PORT`` inherited from a parent process. Several processes read
    ``MASTER_ADDR``/``MASTER_PORT`` from the environment (torchrun, kfpytorch Elastic), defaulting
    to 127.0.0.1:29500. Does nothing when a process group is already up.
    """
    enable()
    if torch.distributed.is_initialized():
        return
    # On a GPU host CPU tensors get gloo beside nccl: the float32 CPU reference model
    # (cpu_reference) runs megatron's collectives, e.g. the vocab-parallel cross entropy's
    # all-reduce, on CPU tensors ("No backend type associated with device type cpu" otherwise).
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if world_size == 1 and "WORLD_SIZE" not in os.environ:
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)


@contextlib.contextmanager
def cpu_reference():
    """Run a float32 CPU copy of the model on any host, eagerly; restored after the block.

    Within the block ``torch.cuda.current_device()`` is the CPU, and TorchDynamo is off: on a
    GPU host megatron's ``jit_fuser`` is ``torch.compile`` (megatron/core/jit.py), and compiling
    the router's ``_apply_expert_bias`` for CPU tensors fails there (no CPU inductor toolchain
    in the GPU image); the reference wants the plain torch path anyway.
    """
    import torch._dynamo

    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        torch.cuda.current_device = original


@contextlib.contextmanager
def megatron_optimizer_on_cpu():
    """Let megatron's optimizer code run on CPU tensors (no-op when a GPU is present).

    megatron-core 0.19.2 asserts ``param.type() == "torch.cuda.FloatTensor"`` (distributed
    optimizer, gradient clipping) and allocates norm buffers with ``device="cuda"``
    (``clip_grads``, ``utils.local_multi_tensor_l2_norm``). Inside this context a CPU tensor
    reports its CUDA type name and ``device="cuda"`` allocations in those megatron modules land on
    the CPU; on exit both are restored, so no other code sees them.
    """
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


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: ``([1] float32 L2 norm of all tensors, None)``,
    through ``torch._foreach_norm``: no host sync (megatron's local fallback syncs per tensor)."""
    tensors = tensor_lists[0]
    if per_tensor:
        raise NotImplementedError("per-tensor norms are not used by megatron's gradient clipping")
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract: ``dst = src * scale`` per pair (dtype cast on store),
    as one ``_foreach_mul_`` when scaling in place and a ``_foreach_copy_`` for copies."""
    src, dst = tensor_lists
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _foreach_scale_tensor(chunk_size, noop_flag, tensor_lists, scale):
    """Transformer Engine's ``multi_tensor_scale_tensor`` contract, in place only: ``t *= scale`` for
    a float32 ``[1]`` device ``scale`` (the clip factor), so the factor is never read on the host."""
    src, dst = tensor_lists
    if any(s is not d for s, d in zip(src, dst)):
        raise NotImplementedError("megatron scales gradients by a tensor factor in place only")
    if dst:
        torch._foreach_mul_(dst, scale.reshape(()))


@contextlib.contextmanager
def foreach_multi_tensor_ops():
    """megatron's gradient norm / clipping / copies through torch's ``_foreach`` kernels, for the block.

    Replaces megatron's local (no Transformer Engine, no Apex) ``multi_tensor_l2norm`` and
    ``multi_tensor_scale`` in ``megatron.core.optimizer.clip_grads`` and ``.optimizer``, and
    provides ``multi_tensor_scale_tensor``, with which megatron keeps the gradient norm on the
    device and clips by a tensor factor (its Transformer Engine path: no host read of the norm
    inside the optimizer step). With Transformer Engine or Apex present megatron's fused kernels
    are kept and this does nothing. Same values up to the summation order of the norm; the
    factor ``min(1, clip / (norm + 1e-6))`` multiplies the gradients also when it is 1.
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        yield
        return
    names = ((clip_grads, "l2_norm_impl", _foreach_l2_norm), (clip_grads, "multi_tensor_scale_impl", _foreach_scale),
             (optimizer, "multi_tensor_scale_impl", _foreach_scale),
             (clip_grads, "multi_tensor_scale_tensor_impl", _foreach_scale_tensor))
    saved = [getattr(module, name) for module, name, _ in names]
    for module, name, impl in names:
        setattr(module, name, impl)
    try:
        yield
    finally:
        for (module, name, _), value in zip(names, saved):
            setattr(module, name, value)
