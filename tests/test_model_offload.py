"""Activation offload (model.offload.OffloadActivations): one host copy per saved storage, same gradients.

Expected host bytes are the sizes of the distinct tensors, written out by hand; expected
gradients come from the same computation without offload, or from the product rule.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from model.offload import OffloadActivations, OffloadChain, _HostCopy

F32 = 4


class CountingOffload(OffloadActivations):
    """Counts the bytes copied to host memory (by the one method that copies)."""

    def __init__(self):
        super().__init__()
        self.host_bytes = 0

    def _copy_to_host(self, tensor, pin):
        self.host_bytes += tensor.numel() * tensor.element_size()
        return super()._copy_to_host(tensor, pin)


def _leaf(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(fn, shapes, offload=None):
    """Gradients of ``fn(*leaves)`` (a scalar) for leaves of ``shapes``, run under ``offload`` if given."""
    leaves = [_leaf(*shape, seed=i) for i, shape in enumerate(shapes)]
    with offload if offload is not None else contextlib.nullcontext():
        loss = fn(*leaves)
    loss.backward()
    return [t.grad for t in leaves]


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("second_use", ["same tensor", "transposed view", "reshaped view"])
def test_a_tensor_saved_by_two_ops_is_copied_to_host_once(second_use):
    view = {"same tensor": lambda x: x, "transposed view": lambda x: x.t().t(),
            "reshaped view": lambda x: x.view(64, 2, 16).view(64, 32)}[second_use]

    def fn(x, w1, w2):
        h = x * 2                       # a non-leaf activation, saved by both matmuls below
        y = h @ w1
        z = view(h) @ w2
        return (y * z).sum()            # saves y and z

    shapes = [(64, 32), (32, 16), (32, 16)]
    offload = CountingOffload()
    grads = _grads(fn, shapes, offload)
    # h, w1, w2, y, z once each; save_on_cpu would copy h twice.
    assert offload.host_bytes == (64 * 32 + 32 * 16 + 32 * 16 + 64 * 16 + 64 * 16) * F32
    _assert_equal(grads, _grads(fn, shapes))


def test_an_expanded_tensor_is_copied_at_its_storage_size():
    def fn(x, w):
        return (x.exp().expand(64, 32) * w).sum()   # mul saves the [64, 32] expansion of 64 floats

    offload = CountingOffload()
    grads = _grads(fn, [(64, 1), (64, 32)], offload)
    # exp saves its output, mul saves w and the expansion: a view of exp's output, one copy.
    assert offload.host_bytes == (64 + 64 * 32) * F32
    _assert_equal(grads, _grads(fn, [(64, 1), (64, 32)]))


def test_a_slice_is_copied_alone():
    def fn(x):
        rows = (x * 1)[:8]
        return (rows * rows).sum()      # the slice is saved twice: one copy of its 8 rows

    offload = CountingOffload()
    grads = _grads(fn, [(64, 32)], offload)
    assert offload.host_bytes == 8 * 32 * F32
    _assert_equal(grads, _grads(fn, [(64, 32)]))


@pytest.mark.parametrize("modify", ["in place", "in place through a view"])
def test_an_in_place_change_between_two_saves_makes_a_fresh_copy(modify):
    x = _leaf(8, 8, seed=6)
    c = torch.randn(8, 8, generator=torch.Generator().manual_seed(7))
    before = c.clone()
    offload = CountingOffload()
    with offload:
        y = x * c                       # saves c for x's gradient
        if modify == "in place":
            c.mul_(3)
        else:
            c[2:5].mul_(3)
        z = x * c                       # saves the changed c
    after = c.clone()
    (y.sum() + z.sum()).backward()
    # Product rule with the values each op saw; a stale copy would give 2 * before.
    assert torch.equal(x.grad, before + after)
    assert offload.host_bytes == 2 * 8 * 8 * F32


def test_a_new_tensor_in_freed_memory_gets_its_own_copy():
    # Keys are tensors, not addresses: ``a`` dies after its save and ``b`` is made over the same
    # memory (a buffer both borrow) with other values; its save must not reuse ``a``'s copy.
    first, second = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(9))

    def fn(w, shared_memory):
        buffers = [bytearray(64 * 32 * F32) for _ in range(1 if shared_memory else 2)]
        a = torch.frombuffer(buffers[0], dtype=torch.float32).view(64, 32).copy_(first)
        address = a.data_ptr()
        y = a @ w                       # saves a, for w's gradient
        del a
        b = torch.frombuffer(buffers[-1], dtype=torch.float32).view(64, 32).copy_(second)
        assert (b.data_ptr() == address) == shared_memory
        return (y + b @ w).sum()

    offload = CountingOffload()
    grads = _grads(lambda w: fn(w, shared_memory=True), [(32, 16)], offload)
    assert offload.host_bytes == 2 * 64 * 32 * F32   # a and b
    _assert_equal(grads, _grads(lambda w: fn(w, shared_memory=False), [(32, 16)]))


def test_the_cache_is_emptied_when_the_block_exits():
    offload = OffloadActivations()
    with offload:
        x = _leaf(16, 16, seed=0)
        h = x * 1
        rows = h[:4]
        (h @ h).sum() + (rows * rows).sum()
        assert len(offload._storages) == 1 and len(offload._slices) == 1
    assert len(offload._storages) == 0 and len(offload._slices) == 0


def test_a_chain_prefetches_the_previous_layer_at_the_first_unpack_and_releases_every_reload(monkeypatch):
    # Three offloaded "layers" in one chain. In backward (reverse order) the first unpack of layer
    # 3 must start the reload of layer 2's copies, and layer 2's that of layer 1's; layer 1 has
    # none before it. On CPU the prefetch itself (a CUDA copy stream) is recorded instead of run:
    # the contexts are given a stand-in stream, which a CPU tensor's copy never touches.
    chain = OffloadChain()
    chain.stream = object()
    events = []
    monkeypatch.setattr(_HostCopy, "prefetch",
                        lambda copy, device, stream: events.append(("prefetch", owner[id(copy)])))
    owner = {}
    contexts = []

    def layer(x, w, number):
        ctx = chain.context()
        contexts.append(ctx)
        with ctx:
            h = torch.tanh(x @ w)        # saves x, w and h (tanh's output)
            out = h * 2 + x
        for ref in ctx._copies:
            owner[id(ref())] = number
        return out

    def fn(x, w1, w2, w3):
        y = x
        for number, w in enumerate((w1, w2, w3), start=1):
            y = layer(y, w, number)
            y.register_hook(lambda g, n=number: events.append(("grad out", n)) or g)
        return y.sum()

    shapes = [(16, 8), (8, 8), (8, 8), (8, 8)]
    leaves = [_leaf(*shape, seed=i) for i, shape in enumerate(shapes)]
    gc.disable()   # the host copies must go with the graph, not wait for the cycle collector
    try:
        loss = fn(*leaves)
        # strong references taken here, to inspect the copies after the backward
        kept = [ref() for ctx in contexts for ref in ctx._copies]
        loss.backward()
        del loss
        alive = [ref for ctx in contexts for ref in ctx._copies if ref() is not None]
        assert len(alive) == len(kept)   # only the references held here
        assert all(c.uses == 0 and c.device_copy is None for c in kept)   # every reload released
        del kept
        assert all(ref() is None for ctx in contexts for ref in ctx._copies)   # host memory freed
    finally:
        gc.enable()
    _assert_equal([t.grad for t in leaves], _grads(fn, shapes))   # a second, fresh chain: same gradients
    first_run = events[:events.index(("grad out", 1)) + 1]
    prefetches = [e for e in first_run if e[0] == "prefetch"]
    # each layer saves x, w and tanh's output: 3 host copies. Layer 2's prefetched once each
    # after layer 3's backward began, then layer 1's
    assert [len(ctx._copies) for ctx in contexts[:3]] == [3, 3, 3]
    assert [n for _, n in prefetches] == [2, 2, 2, 1, 1, 1]
    assert first_run.index(("grad out", 3)) < first_run.index(prefetches[0])


def test_every_saved_view_of_a_storage_is_reloaded_from_one_device_copy():
    # h is saved by two ops, the second time as its transpose: one host copy with two uses,
    # reloaded once (the second unpack reuses the device copy), released after the last use.
    def fn(x, w1, w2):
        h = x * 2
        return (h @ w1).sum() + (w2.t() @ h.t()).sum()

    shapes = [(64, 32), (32, 16), (32, 16)]
    offload = CountingOffload()
    reloads = []
    original = _HostCopy.to_device

    def counting_to_device(copy, device):
        reloads.append(copy.device_copy is None)   # True: copied from the host now
        return original(copy, device)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_HostCopy, "to_device", counting_to_device)
        grads = _grads(fn, shapes, offload)
    # x*2 saves nothing; the two matmuls save h twice, w1 and w2 once each: 4 unpacks, 3 host reads
    assert len(reloads) == 4 and sum(reloads) == 3
    assert all(ref() is None for ref in offload._copies)   # freed with the graph
    _assert_equal(grads, _grads(fn, shapes))
