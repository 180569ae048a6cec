"""A no-op re-run starts fast (issue 20, item 3; issue 46, item 5): it imports none of torch, diffusers,
transformers, peft, accelerate or safetensors.torch (tasks/lazy.py), nor numpy, and the CLI freezes its
start-up's objects for the garbage collector (flows/train.py). Checked by what a fresh interpreter has imported
and its gc state, never by time (the figure is bench/noop_scale.py's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.lazy import HEAVY, LazyClass, lazy
from tasks.models import FAMILIES
from tasks.runtime import _GPU_DRIVERS

REPO = Path(__file__).resolve().parents[1]
# Not heavy, but 0.1 s of start-up that only decoding or rendering images needs (a no-op renders the grid: PIL)
IMAGING = ("numpy", "PIL")
GPU_DRIVER = any(os.path.exists(p) for p in _GPU_DRIVERS)
# Every module a no-op run can import (the tiny-model builders and the fp8 hooks load only to build or train)
MODULES = ["flows.train", "flows.nodes", "flows.runner", "flows.explain", "tasks.training.export", "tasks.publish",
           "tasks.models.bases.losses", *(ref.split(":")[0] for ref, _ in FAMILIES.values())]


# Said from an exit handler: the CLI ends the process itself once the exit handlers have run (flows/entry.py)
_SAY_AT_EXIT = """import atexit, gc, json, sys
atexit.register(lambda: print(json.dumps({{"modules": [m for m in {names!r} if m in sys.modules],
                                          "gc": [gc.isenabled(), gc.get_freeze_count()]}})))
"""


def _state_after(code: str, env: dict | None = None, names: tuple[str, ...] = HEAVY) -> dict:
    """Those of `names` (the heavy libraries) a fresh interpreter holds when it exits after running `code`, and
    its collector's state then: {"modules": [...], "gc": [enabled, frozen objects]}."""
    probe = _SAY_AT_EXIT.format(names=list(names)) + code
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _heavy_after(code: str, env: dict | None = None, names: tuple[str, ...] = HEAVY) -> list[str]:
    return _state_after(code, env, names)["modules"]


def test_importing_the_flow_and_every_adapter_imports_no_model_library():
    assert _heavy_after("\n".join(f"import {m}" for m in MODULES), names=HEAVY + IMAGING) == []


def test_adapters_answer_what_validate_asks_without_torch():
    code = """
from tasks.models import adapter_class
for family in ("flux", "sd3", "sdxl", "sd15", "zimage", "qwenimage", "flux2_klein", "flux2_dev"):
    cls = adapter_class(family)
    a = cls("/nonexistent", "bfloat16", 77)
    assert a.default_lora_targets() and cls.size_multiple and cls.denoiser_components, family
from tasks.runtime import cuda_available, runtime
runtime(); cuda_available()
"""
    if GPU_DRIVER:
        pytest.skip("a GPU driver is present: asking CUDA imports torch here")
    assert _heavy_after(code) == []


def test_cuda_available_agrees_with_torch():
    import torch

    from tasks.runtime import cuda_available

    assert cuda_available() == torch.cuda.is_available()


def test_lazy_module_and_class_resolve_on_first_use():
    import safetensors

    proxy = lazy("safetensors")
    assert repr(proxy) == "<lazy module 'safetensors'>"
    assert proxy.safe_open is safetensors.safe_open and repr(proxy) == "<lazy module 'safetensors' (imported)>"

    class Holder:
        cls = LazyClass("pathlib", "PurePosixPath")

    from pathlib import PurePosixPath

    assert Holder.cls is PurePosixPath and Holder().cls is PurePosixPath


def test_the_first_heavy_use_imports_its_cores_settled():
    """tasks/lazy.py `settle`: a proxy's first use imports its library's cores with the collector paused, then
    frozen (torch alone for torch; torch, diffusers' model core and peft for the model libraries); the collector
    is left as it was, and a light module settles nothing."""
    cores = ("torch", "diffusers.models.modeling_utils", "peft")
    # the interpreter's start-up leaves no frozen objects: any here are the settle's
    assert _state_after("import gc, tasks.lazy", names=cores) == {"modules": [], "gc": [True, 0]}
    torch_only = _state_after("from tasks.lazy import lazy\nlazy('torch').zeros(1)", names=cores)
    assert torch_only["modules"] == ["torch"] and torch_only["gc"][0] and torch_only["gc"][1] > 100_000
    models = _state_after("from tasks.lazy import LazyClass\n"
                          "class A:\n    cls = LazyClass('diffusers', 'UNet2DConditionModel')\nA.cls", names=cores)
    assert models["modules"] == list(cores) and models["gc"][0] and models["gc"][1] > torch_only["gc"][1]
    off = _state_after("import gc\ngc.disable()\nfrom tasks.lazy import settle\nsettle('torch')", names=cores)
    assert off["modules"] == ["torch"] and off["gc"][0] is False  # a paused collector stays paused
    light = _state_after("from tasks.lazy import lazy, settle\nsettle('json')\nlazy('json').dumps(1)", names=cores)
    assert light == {"modules": [], "gc": [True, 0]}
    # two threads settling at once (a caching node's writer beside the main thread): the collector ends on
    threads = _state_after("import threading\nfrom tasks.lazy import settle\n"
                           "ts = [threading.Thread(target=settle, args=(n,)) for n in ('torch', 'peft', 'diffusers')]\n"
                           "[t.start() for t in ts]\n[t.join() for t in ts]", names=cores)
    assert threads["modules"] == list(cores) and threads["gc"][0] is True


def test_a_noop_run_through_the_cli_imports_no_model_library(workspace):
    """The CLI exactly as a user runs it (Hydra, the flow on a running Prefect API), after a run that computed
    everything: every node is answered from keys and stat calls, torch and numpy are never imported, and the
    start-up's objects are frozen (no collection walks them again) with the collector back on for the run."""
    from prefect.settings import PREFECT_API_URL

    workspace.run()  # a first run in the copy: its run record and indexes
    args = workspace.overrides()
    run_dir = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
    code = f"""
import runpy, sys
sys.argv = ["flows.train", *{args!r}]
runpy.run_module("flows.train", run_name="__main__")
raise SystemExit("the CLI returned: it should have ended the process")
"""
    state = _state_after(code, {"PREFECT_API_URL": PREFECT_API_URL.value()}, names=HEAVY + ("numpy", "fastapi"))
    heavy, (collecting, frozen) = state["modules"], state["gc"]
    assert collecting and frozen > 10_000, state
    report = json.loads((run_dir / "report.json").read_text())
    assert {n: e["status"] for n, e in report["nodes"].items()} == {
        "caption": "cached", "validate": "ran", "cache_latents": "cached", "cache_text": "cached", "train": "cached", "sample": "cached"}
    assert Path(report["artifacts"]["lora"]).is_file()
    if not GPU_DRIVER:  # with one, validate's free-memory check imports torch
        assert heavy == []  # fastapi too: the flow's parameters go to the API without its encoder
    else:
        assert "fastapi" not in heavy


def test_the_console_script_starts_as_python_m_flows_train_does():
    """`loraflow` (flows/entry.py) collects nothing while the CLI imports and freezes what they made, with the
    collector back on for the run, as `python -m flows.train` does."""
    code = """
import sys
from flows.entry import main
sys.argv = ["loraflow", "--cfg", "job"]
main()
raise SystemExit("main() returned: it should have ended the process")
"""
    collecting, frozen = _state_after(code)["gc"]
    assert collecting and frozen > 10_000
