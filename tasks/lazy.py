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
never imports these libraries.

The first heavy import is *settled* (`settle`): torch (for torch alone), or torch, diffusers' model core (which
brings transformers, accelerate and the quantization libraries) and peft, are imported with Python's cyclic
garbage collector paused, and what is alive then is frozen (`gc.freeze`: left out of later collections).
Importing them builds millions of objects, and every full collection on the way walked all of those made so
far: 2.9 s of the 6.9 s of CPU that importing them took on a 2-core machine (4.0 s settled; measured 11-27,
docs/caching.md). What is frozen is mostly modules and classes, alive until exit anyway; later collections
walk only what the run makes itself. (In a long-lived process, such as a notebook, objects alive at that
moment are frozen too: a reference cycle among them that becomes garbage later is not collected.)"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import sys
import threading
from types import ModuleType

HEAVY = ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors.torch")
# settled together on the first heavy import: torch alone for torch's and safetensors' users; for the model
# libraries torch, diffusers' model core (transformers, accelerate, bitsandbytes and torchao come with it) and
# peft, which every LoRA run imports (its own part is small once transformers is in)
_CORES = {"torch": ("torch",), "safetensors": ("torch",)}
_MODEL_CORES = ("torch", "diffusers.models.modeling_utils", "peft")
_SETTLING = threading.RLock()
_HEAVY_TOPS = {name.partition(".")[0] for name in HEAVY}


def settle(name: str) -> None:
    """Import the cores that `name` (a module of a heavy library) stands on, each with the cyclic collector
    paused, then freeze what is alive; a no-op once they are imported, and for other modules."""
    top = name.partition(".")[0]
    if top not in _HEAVY_TOPS:
        return
    for core in _CORES.get(top, _MODEL_CORES):
        if core in sys.modules:
            continue
        with _SETTLING:  # one thread at a time: another's pause must not be taken for the collector's state
            if core in sys.modules:
                continue
            with collector_paused():
                importlib.import_module(core)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside; on leaving, what is alive is frozen (`gc.freeze`) and the
    collector is as it was. For imports: what they make lives until exit."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def import_settled(name: str) -> ModuleType:
    """`importlib.import_module(name)`, its library's cores settled first (see the module's note)."""
    settle(name)
    return importlib.import_module(name)


class LazyModule:
    """Stands for a module until an attribute is read; then is a thin forwarder to it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        module = self._module
        if module is None:
            module = self._module = import_settled(self._name)
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
        return getattr(import_settled(self.module), self.name)


def no_grad(fn):
    """`@torch.no_grad()` without importing torch when the module is: torch's own, applied at the first call."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return call
