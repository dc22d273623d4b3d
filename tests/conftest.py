"""Shared pytest fixtures (keep small)."""

import importlib.util

import pytest


@pytest.fixture(scope="session")
def plain_torch_transformers():
    """transformers' glm5_next on its plain-torch paths: fla / causal_conv1d must not be importable."""
    for name in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(name) is not None:
            pytest.fail(f"{name} is importable: transformers' glm5_next would bind its GPU kernels on CPU")
