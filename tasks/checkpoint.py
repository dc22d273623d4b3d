"""Training checkpoints: atomic megatron distributed checkpoints with ``latest``/``best`` pointers.

:class:`Checkpointer` writes ``torch_dist`` checkpoints into ``<root>/step-NNNNNNN`` through a
temporary directory and a rename, then replaces the pointer files atomically: a killed run
never leaves a half-written checkpoint behind a pointer. :func:`training_state` is what a
checkpoint holds (model, distributed optimizer ``fully_reshardable``, LR scheduler, every rank's
RNG states, a small ``progress`` dict such as the data position); :func:`restore_training_state`
loads one into a fresh trainer, with the repairs megatron-core 0.19.2's distributed Adam needs
without Apex/TransformerEngine. Used by SFT, RL and the checkpoint export.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from model.cpu_compat import megatron_optimizer_on_cpu
from model.parallel import ParallelLayout
from tasks.atomic import resolve_inside


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
        """Load checkpoint ``path`` into the sharded state dict ``state``; returns the loaded dict.

        torch's distributed checkpoint reader unpickles the checkpoint's ``.metadata``, so only a
        checkpoint inside this run's own root is loaded (the trust boundary the README states).

        Raises:
            tasks.atomic.OutputIntegrityError: ``path`` is not inside the run's checkpoint root.
        """
        from megatron.core import dist_checkpointing

        path = resolve_inside(self.root, path)
        return dist_checkpointing.load(state, str(path))



def model_sharded_state_dict(module):
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
    without Apex/TE, megatron-core 0.19.2). This per-instance setter copies, under ``no_grad``, the keys
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
    step and the bias correction of the next step is wrong (megatron-core 0.19.2). Cloning restores
    per-parameter counters with the same value.
    """
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def training_state(module, optimizer, scheduler, layout: ParallelLayout, is_loading: bool, progress: dict) -> dict:
    """The sharded state dict of a checkpoint: model, optimizer, scheduler, ``progress``, RNG.

    ``progress`` is a small picklable dict (step, data position, ...) stored once (rank 0's).
    """
    from megatron.core.dist_checkpointing import ShardedObject

    model_state = model_sharded_state_dict(module)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}),
        "scheduler": scheduler.state_dict(),
        "progress": progress,
        "rng": ShardedObject("rng_state", _rng_state(), (layout.world_size,), (layout.rank,), replica_id=0),
    }


def restore_training_state(ckpt: Checkpointer, path: Path, template, module, optimizer, scheduler) -> dict:
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
    with megatron_optimizer_on_cpu():
        optimizer.load_state_dict(loaded["optimizer"])
    _untie_adam_step(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    _set_rng_state(loaded["rng"])
    return loaded["progress"]
