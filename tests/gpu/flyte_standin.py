"""A permissive stand-in for flytekit on machines without it (the device machine of the GPU scripts).

``tasks.*`` import flytekit only for their ``@task`` wrappers; the GPU scripts call the plain
training functions, so a stand-in that accepts any decoration or attribute access is enough.
:func:`install_flytekit_stand_in` does nothing where flytekit and its PyTorch plugin import.
"""

from __future__ import annotations

import sys
import types


class _FlyteStandIn:
    """Accepts any construction, decoration or attribute access (``@task(...)`` returns the function)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _FlyteStandIn()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _FlyteStandIn()


def _module_attr(name: str):
    if name.startswith("__"):      # __file__, __path__ ...: inspect and importlib probe these
        raise AttributeError(name)
    return _FlyteStandIn()


def install_flytekit_stand_in() -> None:
    try:
        import flytekit  # noqa: F401
        import flytekitplugins.kfpytorch  # noqa: F401
        return
    except ImportError:
        pass
    for name in ("flytekit", "flytekit.core", "flytekit.core.hash", "flytekit.types", "flytekit.types.directory",
                 "flytekit.extras", "flytekit.extras.accelerators", "flytekitplugins", "flytekitplugins.kfpytorch"):
        module = types.ModuleType(name)
        module.__getattr__ = _module_attr
        sys.modules[name] = module
