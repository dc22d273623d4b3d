"""Activation offload: tensors saved for backward go to (pinned) host memory, each storage copied once.

``torch.autograd.graph.save_on_cpu`` copies a tensor to the host once for every op that saves
it, views included: in a glm5_next layer the mHC streams are saved by the hyper-connection and, as
a view, by the merge, the DSA latent by the attention kernel and by
an einsum, the MoE routing map as a 64x expanded view; its pinned memory was 1.75x the distinct
activation bytes (110.6 GiB for 63.5 GiB, ``small`` at 256k on an H200).
:class:`OffloadActivations` copies such a tensor's storage once and rebuilds every saved view
of it from that copy: 68.6 GiB pinned in the same run (``tasks.memory_plan.OFFLOAD_PINNED_FACTOR``).

With a copy stream (:class:`OffloadChain`) the copies leave the compute stream: device-to-host
copies run beside the forward, and in backward the first use of a layer's saved tensors starts
the host-to-device copy of the previous offloaded layer's, so it arrives while this layer's
backward runs. Measured at 256k tokens, ``small``, 2 H200s (CP=2), 4 of 8 layers offloaded, MLP
recompute (docs/measurements.md):

* with the copies on the compute stream: 5.99 s/step, against 3.80 s without offload in the
  same run;
* with the copy stream and the prefetch: 4.26 s/step, against 3.78 s in the same run. Peak
  memory fell from 89.7 to 53.3 GiB.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakTensorKeyDictionary


class _HostCopy:
    """One host copy of a device tensor (a whole storage or a slice), and its way back.

    ``copied``/``loaded``: CUDA events after the device-to-host copy and after a prefetch
    (host-to-device, on the copy stream) of it; ``device_copy``: the prefetched or first reloaded
    device tensor, kept while ``uses`` (saves packed against this copy, minus unpacks) is above 0
    so every saved view of one storage is reloaded once.
    """

    __slots__ = ("host", "copied", "device_copy", "loaded", "uses", "__weakref__")

    def __init__(self, host: torch.Tensor) -> None:
        self.host, self.copied, self.device_copy, self.loaded, self.uses = host, None, None, None, 0

    def to_device(self, device: torch.device) -> torch.Tensor:
        """The device tensor for one unpack (prefetched, cached or copied now on the compute stream)."""
        on_cuda = device.type == "cuda"
        current = torch.cuda.current_stream(device) if on_cuda else None
        tensor = self.device_copy
        if tensor is not None:
            if self.loaded is not None:   # made on the copy stream: wait for it, and keep its memory
                current.wait_event(self.loaded)   # from that stream's next allocation while in use here
                tensor.record_stream(current)
                self.loaded = None
        else:
            if self.copied is not None:
                current.wait_event(self.copied)
            tensor = self.host.to(device, non_blocking=on_cuda)
        self.uses -= 1
        self.device_copy = tensor if self.uses > 0 else None
        return tensor

    def prefetch(self, device: torch.device, stream) -> None:
        """Start the host-to-device copy on ``stream`` (after this copy's device-to-host copy there)."""
        if self.device_copy is None and self.uses > 0:
            with torch.cuda.stream(stream):
                self.device_copy = self.host.to(device, non_blocking=True)
            self.loaded = stream.record_event()


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager under which tensors saved for backward are kept in host memory, one copy each.

    A drop-in for ``torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=device_type)``:
    host copies are pinned when ``device_type``'s backend is available (``is_available()``) and
    copied asynchronously both ways; backward gets each tensor back on its original device.
    Unlike ``save_on_cpu``, a tensor saved again inside the same ``with`` block, or another view
    of the same tensor, reuses the host copy made for the first save:

    * a saved tensor whose storage holds no more bytes than the tensor itself (the tensor, its
      reshapes, transposes and expansions) copies that whole storage once, cached under the
      view's root tensor (``tensor._base``, or the tensor); each saved view is rebuilt in backward
      with its own size, strides and offset, so backward sees the layout it would without offload;
    * a tensor that covers only part of its storage (a slice) is copied alone, as
      ``save_on_cpu`` does, cached under the tensor itself.

    The cache is a ``WeakTensorKeyDictionary`` (keys are tensors, not addresses: a freed tensor
    whose memory is reused by another cannot hit it), an entry is reused only while the key's
    ``_version`` equals the one copied (views share their root's version counter, so an in-place
    change between two saves makes a fresh copy), and it is emptied when the block exits; the
    host copies live as long as the autograd graph that holds them. Tensors of another layout
    than strided (sparse) are copied per save, as by ``save_on_cpu``. In backward each host copy
    is reloaded once for all the saved views of it.

    Args:
        device_type (str): the accelerator whose availability decides pinning. Default ``"cuda"``.
        stream (torch.cuda.Stream | None): copy stream. ``None``: copies are issued on the stream
            that saves or unpacks (the compute stream). Given: device-to-host copies run on it after
            the producing work (the device memory is kept until they finish, ``record_stream``).
        previous (OffloadActivations | None): the context of the layer before this one (forward
            order) on the same copy stream; this context's first unpack in backward starts the
            reload of ``previous``'s copies on the copy stream (prefetch).
    """

    def __init__(self, device_type: str = "cuda", stream=None, previous: OffloadActivations | None = None) -> None:
        self._pinnable = getattr(torch, device_type, torch.cuda).is_available()
        self._stream = stream
        self._previous = previous
        # weak references to this block's host copies, for the prefetch: the autograd graph holds
        # them, so each is freed with the last saved tensor that needs it (a context is kept
        # alive by its hooks' reference cycle until the garbage collector runs: a strong list
        # here held 40 GiB of pinned memory more per step, 256k tokens, 4 layers offloaded)
        self._copies: list[weakref.ref] = []
        self._reloading = False
        # key -> (key._version when copied, host copy): whole storages under their root tensor,
        # slices under themselves
        self._storages = WeakTensorKeyDictionary()
        self._slices = WeakTensorKeyDictionary()
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> tuple:
        if tensor.layout != torch.strided:
            copy = self._copy_to_host(tensor, pin=self._pinnable and not tensor.is_sparse)
            copy.uses = 1
            return tensor.device, copy
        storage = tensor.untyped_storage()
        if storage.nbytes() > tensor.numel() * tensor.element_size():
            return tensor.device, self._cached_copy(self._slices, tensor, tensor)
        root = tensor if tensor._base is None else tensor._base
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        host = self._cached_copy(self._storages, root, whole)
        return tensor.device, host, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()

    def _cached_copy(self, cache: WeakTensorKeyDictionary, key: torch.Tensor, source: torch.Tensor) -> _HostCopy:
        cached = cache.get(key)
        if cached is None or cached[0] != key._version:
            cached = cache[key] = (key._version, self._copy_to_host(source, pin=self._pinnable))
        cached[1].uses += 1
        return cached[1]

    def _copy_to_host(self, tensor: torch.Tensor, pin: bool) -> _HostCopy:
        copy = _HostCopy(torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin))
        if self._stream is not None and tensor.is_cuda:
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                copy.host.copy_(tensor, non_blocking=pin)
            tensor.record_stream(self._stream)   # its memory outlives the compute stream's free
            copy.copied = self._stream.record_event()
        else:
            copy.host.copy_(tensor, non_blocking=pin)
        self._copies.append(weakref.ref(copy))
        return copy

    def _unpack(self, packed: tuple) -> torch.Tensor:
        device, copy = packed[:2]
        if not self._reloading:
            self._reloading = True
            if self._previous is not None:
                self._previous.prefetch(device)
        tensor = copy.to_device(device)
        if len(packed) == 2:
            return tensor
        dtype, size, stride, offset = packed[2:]
        return torch.empty(0, dtype=dtype, device=device).set_(tensor.untyped_storage(), offset, size, stride)

    def prefetch(self, device: torch.device) -> None:
        """Start reloading this block's host copies still to be used, on its copy stream (none: no-op)."""
        if self._stream is None:
            return
        for ref in self._copies:
            copy = ref()
            if copy is not None:
                copy.prefetch(device, self._stream)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._storages.clear()
        self._slices.clear()


class OffloadChain:
    """The offloaded layers of one forward pass, on one copy stream, each prefetching the one before.

    ``context()`` returns the :class:`OffloadActivations` for the next offloaded layer (forward
    order), linked to the previous one: in backward (reverse order) the first unpack of layer
    ``i``'s saved tensors starts the host-to-device copy of layer ``i - 1``'s on the copy stream.
    The copies of the last offloaded layer, which nothing prefetches, are reloaded when first used.
    Extra device memory: one offloaded layer's saved tensors in flight (``tasks.memory_plan.memory_plan``).
    On a machine without CUDA the contexts copy on the compute stream and nothing is prefetched,
    as a plain :class:`OffloadActivations`.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self.stream = torch.cuda.Stream() if device_type == "cuda" and torch.cuda.is_available() else None
        self._last: OffloadActivations | None = None

    def context(self) -> OffloadActivations:
        """The :class:`OffloadActivations` of the next offloaded layer, linked to the one before."""
        self._last = OffloadActivations(self.device_type, stream=self.stream, previous=self._last)
        return self._last
