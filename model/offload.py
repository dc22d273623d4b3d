"""Activation offload: tensors saved for backward go to (pinned) host memory, each storage copied once.

``torch.autograd.graph.save_on_cpu`` copies a tensor to the host once for every op that saves
it, views included: in a glm5_next layer the mHC streams are saved as ``[s, b, 1, n, h]`` by the
recomputed maps and as ``[s, n, h]`` by the merge, the DSA latent by the attention kernel and by
an einsum, the MoE routing map as a 64x expanded view; its pinned memory was 1.75x the distinct
activation bytes (110.6 GiB for 63.5 GiB, ``small`` at 256k on an H200).
:class:`OffloadActivations` copies such a tensor's storage once and rebuilds every saved view
of it from that copy: 68.6 GiB pinned in the same run (``tasks.sft.OFFLOAD_PINNED_FACTOR``).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary


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
    than strided (sparse) are copied per save, as by ``save_on_cpu``.

    Args:
        device_type (str): the accelerator whose availability decides pinning. Default ``"cuda"``.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self._pinnable = getattr(torch, device_type, torch.cuda).is_available()
        # key -> (key._version when copied, host copy): whole storages under their root tensor,
        # slices under themselves
        self._storages = WeakTensorKeyDictionary()
        self._slices = WeakTensorKeyDictionary()
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> tuple:
        if tensor.layout != torch.strided:
            return tensor.device, self._copy_to_host(tensor, pin=self._pinnable and not tensor.is_sparse)
        storage = tensor.untyped_storage()
        if storage.nbytes() > tensor.numel() * tensor.element_size():
            return tensor.device, self._cached_copy(self._slices, tensor, tensor)
        root = tensor if tensor._base is None else tensor._base
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        host = self._cached_copy(self._storages, root, whole)
        return tensor.device, host, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()

    def _cached_copy(self, cache: WeakTensorKeyDictionary, key: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        cached = cache.get(key)
        if cached is None or cached[0] != key._version:
            cached = cache[key] = (key._version, self._copy_to_host(source, pin=self._pinnable))
        return cached[1]

    def _copy_to_host(self, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        return host

    @staticmethod
    def _unpack(packed: tuple) -> torch.Tensor:
        device, host = packed[:2]
        if len(packed) == 2:
            return host.to(device, non_blocking=True)
        dtype, size, stride, offset = packed[2:]
        storage = host.to(device, non_blocking=True).untyped_storage()
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._storages.clear()
        self._slices.clear()
