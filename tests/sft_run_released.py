"""Run by tests: whether an SFT run's model is freed once the run is dropped.

``python tests/sft_run_released.py PACK OUT CONFIG_JSON``: one process, :class:`tasks.sft.SFTRun` of the config,
two steps, then the run deleted and Python's cycle collector run. Prints ``RELEASED {"parameters_alive": n,
"graph_tensors_alive": m}``: the run's parameters still reachable (weak references), and the tensors anywhere
in the process that still carry an autograd graph. A tensor with a graph kept past its step (a module attribute,
a closure of a saved function) keeps the graph's gradient accumulators, and through megatron DDP's hooks on
them the model, its gradient buffers and the optimizer: a second run in the same process (the profiler's
variants, a local pipeline's stages) then starts on top of the first.
"""

import gc
import json
import os
import sys
import weakref


def main(pack: str, out: str, config: str) -> None:
    import torch

    from tasks.sft import SFTConfig, SFTRun, train_step

    run = SFTRun.start(pack, SFTConfig(**json.loads(config)), out)
    train_step(run)
    train_step(run)
    params = [weakref.ref(p) for p in run.model.parameters()]
    del run
    gc.collect()
    graphs = sum(1 for o in gc.get_objects() if torch.is_tensor(o) and o.grad_fn is not None)
    print("RELEASED " + json.dumps({"parameters_alive": sum(p() is not None for p in params),
                                    "parameters": len(params), "graph_tensors_alive": graphs}), flush=True)


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main(*sys.argv[1:])
