"""Shared fixtures: one Prefect test API per session, and a baseline run of the demo to copy from."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
_PREFECT_HOME = tempfile.mkdtemp(prefix="loraflow-prefect-")
if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker its own test API and home (inherited from the controller)
    os.environ["PREFECT_HOME"] = _PREFECT_HOME
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = os.path.join(_PREFECT_HOME, "storage")
os.environ.setdefault("PREFECT_HOME", _PREFECT_HOME)
os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", os.path.join(_PREFECT_HOME, "storage"))
import flows  # noqa: E402,F401  (its Prefect defaults: no start-up telemetry, longer SQLite timeout)
from tasks.lazy import settle  # noqa: E402

settle("diffusers")  # torch and the model libraries imported as a run imports them: the collector paused, then frozen

import pytest  # noqa: E402


def _tiny_models_built_once() -> None:
    """Each tiny model (family, seed, arch) built once per test process, then copied into every store that asks
    for it: tests build the same few dozen models into fresh stores hundreds of times (a build: tokenizers
    learned, weights drawn and saved; ~25 s of CPU in 5 test files, 11-28). The builders are deterministic
    (tests/test_tiny_families.py builds twice and compares the bytes, calling them directly, past this cache), so
    a copy is the bytes a build writes; the store keys and verifies it as any entry. Subprocesses build their own."""
    import tasks.models as models

    build, built = models.build_tiny, {}
    root = Path(tempfile.mkdtemp(prefix="loraflow-tiny-models-"))

    def once(family: str, out_dir, seed: int, arch: dict) -> None:
        key = repr((family, seed, sorted((arch or {}).items())))
        if key not in built:
            first = root / str(len(built))
            build(family, first, seed, arch)
            built[key] = first
        shutil.copytree(built[key], out_dir, dirs_exist_ok=True)

    models.build_tiny = once


_tiny_models_built_once()

REPO = Path(__file__).resolve().parents[1]


def prefect_home(path: Path) -> str:
    """A new PREFECT_HOME for a CLI run's own temporary API: empty but for a database already migrated (a
    copy of the session's, prefect_server.migrated_database). Each run still gets its own database, as a user's
    first run does; it only skips migrating it again, about 4 s of CPU a run."""
    from prefect_server import migrated_database

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "prefect.db").exists():
        shutil.copyfile(migrated_database(), path / "prefect.db")
    return str(path)


# Server services no CLI run against the shared API uses (schedules, late or crashed runs, cancellations,
# automations, clean-ups): off, each polls the database all session (a server idle for a minute: 1.4 s of CPU
# with them, 0.7 s without; measured 11-27). Runs, task runs, logs, events and artifacts are unchanged.
UNUSED_SERVICES = ("scheduler", "late_runs", "foreman", "repossessor", "pause_expirations", "cancellation_cleanup",
                   "db_vacuum", "cleanup_reconciler", "triggers")
_SHARED_API: dict | None = None  # {"url": ..., "stack": ExitStack}: the server this process started
# `make test`'s controller starts one server for all its workers (pytest_configure below) and hands them its URL
# here; without xdist, the test process starts its own on first use
SHARED_API_ENV = "LORAFLOW_TESTS_SHARED_API_URL"
# Set by `make test`'s numerics pass, whose tests use no Prefect API: its controller then makes neither the
# shared server nor the migrated database (~13 s of CPU, then the server's polling); a worker that needs one
# makes its own on first use, as a test process without xdist does
ON_DEMAND_ENV = "LORAFLOW_TESTS_PREFECT_ON_DEMAND"


def _start_shared_api(port: int | None = None) -> str:
    global _SHARED_API
    import contextlib

    from prefect_server import prefect_server

    stack = contextlib.ExitStack()
    server = stack.enter_context(prefect_server(Path(tempfile.mkdtemp(prefix="loraflow-shared-api-")),
                                                services={s: False for s in UNUSED_SERVICES}, port=port))
    _SHARED_API = {"url": server.url, "stack": stack}
    return server.url


def shared_api_url() -> str:
    """The URL of one real `prefect server start` for the whole test session: started by xdist's controller
    before its workers (all of them use it), or by the test process on first use without xdist; stopped when
    the session ends. CLI runs that do not test the temporary API itself use it: each run would otherwise start
    its own, about 5 s of CPU a run on 2 cores (a no-op run: 6.2 s of CPU with its own, 1.4 s with a running
    server; measured 11-27). One server rather than one per worker: each costs ~5 s of CPU to start and its
    polling while idle (11-28). The temporary API keeps its own tests (test_concurrent_runs.py, the demo,
    test_cli.py, the Ctrl-C tests of test_terminal.py)."""
    url = os.environ.get(SHARED_API_ENV)
    if url:  # the controller's: it may still be starting (it started as the workers did)
        global _SHARED_API_READY
        if _SHARED_API_READY is False:  # a failed wait fails the next test at once, not after another 300 s
            raise RuntimeError(f"the test session's shared Prefect server at {url} did not answer "
                               "(xdist's controller starts it: see its output)")
        if _SHARED_API_READY is None:
            from prefect_server import wait_until_healthy

            _SHARED_API_READY = False
            wait_until_healthy(url, timeout=300)  # generous: it starts beside 3 busy workers
            _SHARED_API_READY = True
        return url
    return _SHARED_API["url"] if _SHARED_API is not None else _start_shared_api()


_SHARED_API_READY: bool | None = None  # None: not waited for yet; False: the wait failed


def pytest_configure(config):
    """xdist's controller: one shared API server for its workers, started in a thread (the workers start and
    collect meanwhile) on a port chosen now, so that its URL is in the environment the workers inherit."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    if os.environ.get(ON_DEMAND_ENV) == "1":
        return
    import threading

    from prefect_server import MIGRATED_DB_ENV, free_port, make_migrated_database

    port = free_port()
    os.environ[SHARED_API_ENV] = f"http://127.0.0.1:{port}/api"
    # the migrated database every new Prefect database of the session copies (its own server's first), made once
    config._loraflow_migrated = Path(tempfile.mkdtemp(prefix="loraflow-prefect-migrated-"))
    os.environ[MIGRATED_DB_ENV] = str(config._loraflow_migrated / "prefect.db")

    def start() -> None:
        make_migrated_database(config._loraflow_migrated / "prefect.db")
        _start_shared_api(port)

    starting = threading.Thread(target=start, name="shared-prefect-api", daemon=True)
    starting.start()
    config._loraflow_api_start = starting


def pytest_unconfigure(config):
    starting = getattr(config, "_loraflow_api_start", None)
    if starting is not None:
        starting.join(300)
    if _SHARED_API is not None:
        _SHARED_API["stack"].close()
    if getattr(config, "_loraflow_migrated", None) is not None:
        shutil.rmtree(config._loraflow_migrated, ignore_errors=True)


def cli_env(home: Path, **extra) -> dict[str, str]:
    """The environment of a CLI run in a test: this test's PREFECT_HOME (its result storage), the shared API."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    return {**env, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(Path(home)), "PREFECT_API_URL": shared_api_url(),
            **extra}


def temporary_api_env(home: Path) -> dict[str, str]:
    """The environment of a CLI run that starts its own temporary API, as `make run` does (no PREFECT_API_URL;
    its PREFECT_HOME's database already migrated)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return {**env, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": prefect_home(home)}


FAST = ["train.max_steps=12", "train.log_every=4", "sample.steps=2"]


# The longest files first (each file's summed test time in one `make test`, 11-28), then the rest in their own
# order: `make test` hands whole files to 3 workers, and a long file picked up last keeps one worker busy while the
# others are done (longest first: an even finish). The Makefile passes --no-loadscope-reorder, or pytest-xdist
# would reorder files by their number of tests instead.
LONGEST_FIRST = ["test_learns.py", "test_qwenimage_edit.py", "test_concurrent_runs.py", "test_image_to_video_learns.py",
                 "test_terminal.py", "test_families.py", "test_compiled_blocks.py", "test_demo.py",
                 "test_learns_mutations.py", "test_multiprocess.py", "test_reliability_kill.py", "test_bench_memory.py",
                 "test_quantized_base.py", "test_cancel.py", "test_multinode.py", "test_video.py",
                 "test_fuzz_config.py", "test_edit_matrix.py", "test_prefect_launcher.py", "test_parallel_sweep.py",
                 "test_schedule.py", "test_deploy.py", "test_wan22_both.py", "test_hunyuan_video15.py",
                 "test_fp8_base.py", "test_w8a8.py", "test_bench_host_memory.py", "test_docs_commands.py",
                 "test_lora_tools.py", "test_stream_load.py", "test_lora_tools_cli.py", "test_reliability_store.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_report_header(config):
    """Which CPU kernels the numbers come from: `make test` forces AVX2 (ATEN_CPU_CAPABILITY), then reruns the
    `numerics` tests on this machine's own."""
    import torch

    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    return f"CPU kernels: {torch.backends.cpu.get_cpu_capability()}" + (f" (forced: {forced})" if forced else " (this CPU's own)")


@pytest.fixture(scope="session")
def prefect_api():
    """In-process flow runs report to the test process's real API server (`shared_api_url`, the one its CLI runs
    use). Prefect's test harness started a second server per test process for them, with every service on: the
    22 files that use this fixture, 3 workers, took 270 s of CPU with it, 239 s without (11-28). Tests that read
    the API back filter by their own flow run."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: shared_api_url()}):
        # as the harness does: code in a context copied before this one sees the server too
        with prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
            yield
            # as the harness does: the last log lines and events sent while the server still answers (it stops
            # at the session's end; late ones printed "--- Error logging to API ---")
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)


class Workspace:
    """A demo dataset, prompts file and store in one folder; runs the flow against them."""

    def __init__(self, root: Path):
        self.root = root
        self.data = root / "data"
        self.prompts = root / "prompts.txt"
        self.store = root / "store"
        self.runs = 0

    def overrides(self, extra=()) -> list[str]:
        self.runs += 1
        return [f"data.dir={self.data}", f"sample.prompts_file={self.prompts}", f"store.root={self.store}",
                f"hydra.run.dir={self.root / f'run{self.runs}'}", *FAST, *extra]

    def run(self, *extra: str) -> dict:
        import json

        from flows.train import train_flow

        out = train_flow(config_name="train", overrides=self.overrides(extra))
        return json.loads(Path(out["report"]).read_text())

    def copy_to(self, dst: Path) -> "Workspace":
        shutil.copytree(self.root, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("run[0-9]*"))
        return Workspace(dst)


@pytest.fixture(scope="session")
def baseline(prefect_api, tmp_path_factory) -> Workspace:
    """The demo trained once; tests copy it and edit the copy."""
    ws = Workspace(tmp_path_factory.mktemp("baseline"))
    shutil.copytree(REPO / "data" / "demo", ws.data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", ws.prompts)
    ws.first_report = ws.run()
    return ws


@pytest.fixture
def workspace(baseline, tmp_path) -> Workspace:
    return baseline.copy_to(tmp_path / "ws")


# The LoRA-file tests' models (test_export, test_comfyui_keys, test_lora_tools*, ...)
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """family -> the tiny model's folder, built on first use, once per test module (tests/lora_fixtures.py)."""
    from lora_fixtures import BUILDERS

    cache = {}

    def get(family):
        if family not in cache and family in BUILDERS:
            cache[family] = BUILDERS[family](tmp_path_factory.mktemp(family) / "model")
        elif family not in cache:  # a family BUILDERS does not name: the registry's tiny builder, default arch
            from tasks.models import build_tiny

            cache[family] = tmp_path_factory.mktemp(family) / "model"
            build_tiny(family, cache[family], 0, {})
        return cache[family]
    return get


@pytest.fixture(scope="module")
def tuned(model_dirs, tmp_path_factory):
    """A copy of the tiny Flux with known rank-2 changes to some Linears: fused-group members (q, k but not v;
    the single block's proj_mlp), a plain one, and two with no kohya name (norm_out.linear, proj_out)."""
    import torch
    from safetensors.torch import load_file, save_file

    base = model_dirs("flux")
    root = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(base, root)
    file = root / "transformer" / "diffusion_pytorch_model.safetensors"
    weights, gen, changes = load_file(file), torch.Generator().manual_seed(3), {}
    for m in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.ff.net.2",
              "single_transformer_blocks.0.proj_mlp", "norm_out.linear", "proj_out"):
        w = weights[f"{m}.weight"]
        d = 0.05 * (torch.randn(w.shape[0], 2, generator=gen, dtype=torch.float64)
                    @ torch.randn(2, w.shape[1], generator=gen, dtype=torch.float64))
        weights[f"{m}.weight"] = (w.double() + d).to(torch.float32)
        changes[m] = d
    save_file(weights, file)
    return base, root, changes


@pytest.fixture(scope="module")
def cuda():
    """The config checks answer for a machine with CUDA: the docs show fp16 GPU configs (sdxl_base, sd15)."""
    mp = pytest.MonkeyPatch()
    mp.setattr("torch.cuda.is_available", lambda: True)  # imports torch, so the checks ask it
    yield
    mp.undo()
