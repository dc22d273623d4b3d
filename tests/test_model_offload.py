"""Activation offload (model.offload.OffloadActivations): one host copy per saved storage, same gradients.

Expected host bytes are the sizes of the distinct tensors, written out by hand; expected
gradients come from the same computation without offload, or from the product rule.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from model.offload import OffloadActivations

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
