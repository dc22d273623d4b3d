"""Run by torchrun from tests: the trainer's log-probs of verify's sampled windows in a CP layout.

``python -m torch.distributed.run --nproc-per-node N tests/cp_trainer_logprobs.py EXPORT PACK OUT CP LENGTH...``:
rank 0 scores the windows ``tasks.verify.sample_windows`` draws (seed 0, two per length, held-out
split) and saves them to ``OUT`` (``.npz``, ``"<length>/<i>"`` -> float32 ``[length - 1]``); the
other ranks serve its requests.
"""

import sys

import numpy as np

from tasks.engines import TrainerLogProbs
from tasks.trainer import finish_parallel
from tasks.verify import sample_windows


def main(export: str, pack: str, out: str, context_parallel: str, *lengths: str) -> None:
    source = TrainerLogProbs(export, "float32", context_parallel=int(context_parallel))
    if not source.is_main:
        source.serve()
        source.close()
        finish_parallel()
        return
    windows = sample_windows(pack, tuple(map(int, lengths)), 2)
    scores = {f"{length}/{i}": lp for length, ws in windows.items()
              for i, lp in enumerate(source.prompt_logprobs([w.tokens for w in ws]))}
    source.close()
    np.savez(out, **scores)
    finish_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:])
