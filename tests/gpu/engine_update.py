"""The transformers engine's weight update on a GPU: every parameter stays on the device.

RL hands :meth:`tasks.engines.TransformersEngine.update_weights` the trainer's new weights as
host tensors every step. Builds the ``tiny`` glm5_next export, loads it on ``cuda`` in bf16,
updates it with a host state dict whose one expert weight is scaled by 3, and checks that no
parameter left the GPU and that the log-probs equal those of a fresh engine on the new export::

    python tests/gpu/engine_update.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).parent))
    from stages_small import random_init_export

    from tasks.engines import TransformersEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a dry run
    work = Path(tempfile.mkdtemp(prefix="engine_update_"))
    old = random_init_export(work / "old", "tiny")
    (weights,) = old.glob("*.safetensors")
    state = load_file(weights)
    name = next(n for n in state if ".experts." in n and "down_proj" in n)
    new_state = {**state, name: state[name] * 3}
    new = work / "new"
    new.mkdir()
    for f in old.iterdir():
        (new / f.name).write_bytes(f.read_bytes())
    save_file(new_state, new / weights.name, metadata={"format": "pt"})
    prompt = np.random.default_rng(0).integers(4, 8, 2048)
    engine = TransformersEngine(old, "bfloat16", 4096, device=device)
    before = engine.prompt_logprobs([prompt])[0]
    engine.update_weights(new_state)                   # host tensors, as RL hands them over
    stray = [n for n, p in engine.model.named_parameters() if p.device.type != device]
    after = engine.prompt_logprobs([prompt])[0]
    fresh = TransformersEngine(new, "bfloat16", 4096, device=device).prompt_logprobs([prompt])[0]
    print(f"parameters off the GPU after update_weights: {len(stray)}; mean |after - before| "
          f"{np.abs(after - before).mean():.3e}; max |after - fresh| {np.abs(after - fresh).max():.3e}")
    assert not stray
    assert np.abs(after - before).mean() > 1e-4 and np.array_equal(after, fresh)
    print("PASS")


if __name__ == "__main__":
    main()
