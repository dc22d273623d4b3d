"""Shared pytest fixtures (keep small)."""

import importlib.util

import pytest


@pytest.fixture(scope="session")
def plain_torch_transformers():
    """transformers' glm5_next on its plain-torch paths: fla / causal_conv1d must not be importable."""
    for name in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(name) is not None:
            pytest.fail(f"{name} is importable: transformers' glm5_next would bind its GPU kernels on CPU")


@pytest.fixture(scope="session")
def tiny_glm5_next_hf(plain_torch_transformers):
    """Builder of the tiny glm5_next preset as a transformers model (published HF layout, minimal
    vision tower), text weights moved off their init by ``0.05 * N(0, 1)`` from ``seed``."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from model.config import MINIMAL_VISION_CONFIG, preset_hf

    def build(seed: int = 0):
        torch.manual_seed(seed)
        hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=preset_hf("tiny"),
                                                             vision_config=MINIMAL_VISION_CONFIG))
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if "visual" not in name:
                    param.add_(0.05 * torch.randn_like(param))
        return hf.eval()

    return build


@pytest.fixture(scope="module")
def glm5_next_export(tmp_path_factory, tiny_glm5_next_hf):
    """The tiny glm5_next preset in the published HF layout, weights moved off their init."""
    path = tmp_path_factory.mktemp("glm5_next_tiny")
    tiny_glm5_next_hf().save_pretrained(path)
    return path


@pytest.fixture(autouse=True, scope="session")
def pinned_cpu_isa_branch():
    """vLLM's CPU paths branch on AMX (vllm/platforms/cpu.py: chunked prefill and block size for
    MLA models; vllm/v1/attention/backends/cpu_attn.py: the attention ISA): every in-process
    engine of the test run takes the no-AMX branch, whatever the host, so no outcome depends on
    the machine. Tests of the other branch set it themselves."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        yield
