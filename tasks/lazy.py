"""Heavy libraries (torch, diffusers, transformers, peft, safetensors.torch) imported on first use.

A no-op re-run answers every node from keys and stat calls; importing torch and the model libraries for it
would be most of its start-up (about 4 s of 5 on 2 cores, and another second tearing them down at exit).
So modules on that path name them through a proxy:

    torch = lazy("torch")            # nothing imported yet
    torch.zeros(3)                   # imports torch here, once; later uses are a dict lookup

The proxy imports with `importlib.import_module` on the first attribute read and is never put in
sys.modules, so other libraries see the real module or none. Annotations stay strings
(`from __future__ import annotations`), so `x: torch.Tensor` imports nothing. What runs at import time
(a decorator, a class attribute) must not read the proxy; tests/test_startup.py checks that a no-op run
never imports these libraries."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

HEAVY = ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors.torch")


class LazyModule:
    """Stands for a module until an attribute is read; then is a thin forwarder to it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


def lazy(name: str) -> LazyModule:
    return LazyModule(name)


class LazyClass:
    """A class attribute naming a class of a heavy library (an adapter's `pipeline_cls`), imported when read:

        pipeline_cls = LazyClass("diffusers", "FluxPipeline")
    """

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __get__(self, obj, owner=None) -> type:
        return getattr(importlib.import_module(self.module), self.name)


def no_grad(fn):
    """`@torch.no_grad()` without importing torch when the module is: torch's own, applied at the first call."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return call
