"""Run by tests: where one SFT step reads device values on the host.

``python tests/step_host_reads.py PACK OUT CONFIG_JSON``: one process, :class:`tasks.sft.SFTRun` of the
config, one step (megatron caches its gradient-norm groups on the first), then a second step with every
tensor-to-host read counted (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``; on a GPU each one
waits for the device). Each read is attributed to the innermost frame outside torch; reads made inside
``torch.optim`` are left out (torch's foreach Adam reads its step counts on the CPU; GPU runs use its
fused Adam, which does not). Prints ``READS {"dir/file.py:line": count, ...}``.
"""

import collections
import json
import os
import sys
import traceback

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def main(pack: str, out: str, config: str) -> None:
    import torch

    from tasks.sft import SFTConfig, SFTRun, train_step

    run = SFTRun.start(pack, SFTConfig(**json.loads(config)), out)
    train_step(run)
    sites = collections.Counter()

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            outside = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename]
            if outside and not any(f"{os.sep}torch{os.sep}optim{os.sep}" in f.filename for f in stack):
                site = outside[-1]
                sites[f"{'/'.join(site.filename.split(os.sep)[-2:])}:{site.lineno}"] += 1
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    for name in READS:
        counted(name)
    train_step(run)
    print("READS " + json.dumps(sites), flush=True)


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main(*sys.argv[1:])
