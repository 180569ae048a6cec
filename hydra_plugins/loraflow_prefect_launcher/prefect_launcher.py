"""Sweep members as deployment runs: `python -m flows.train -m hydra/launcher=prefect train.lr=1e-4,3e-4`.

Each member becomes a run of the deployment `hydra.launcher.deployment` (default `loraflow/train`) with
that member's overrides and its `hydra.run.dir` (= the member folder of the sweep), so any worker of the
deployment's pool, on any machine, can take it. At most `hydra.launcher.max_concurrent` run at once; the
launcher waits for all of them. Each member folder gets `.hydra/overrides.yaml` (as with every launcher) and
`flow_run.json` ({flow_run_id, state}); a member whose run did not complete gets `error.txt`, so the sweep
summary (flows/sweep.py) lists it as failed, with its flow run, and the command exits 1.

Workers need the member folders and the store: a shared file system or an fsspec `store.root`, and paths
that mean the same on every machine (absolute ones, or relative to the repository root where the
deployment's flow runs start)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from flows.run_names import sweep_id

log = logging.getLogger("loraflow")
FLOW_RUN_FILE = "flow_run.json"


class LauncherError(RuntimeError):
    """The sweep cannot be sent (no server, no such deployment): one line, no traceback."""


class PrefectLauncher(Launcher):
    def __init__(self, deployment: str = "loraflow/train", max_concurrent: int = 4, poll_seconds: float = 2.0,
                 timeout: Optional[float] = None) -> None:
        self.deployment, self.max_concurrent = deployment, max(1, int(max_concurrent))
        self.poll_seconds, self.timeout = float(poll_seconds), timeout
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def _member(self, idx: int, overrides: Sequence[str]) -> dict:
        """The member's folder and the parameters of its deployment run."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id, cfg.hydra.job.num = f"{cfg.hydra.job.name}_{idx}", idx
        out_dir = (Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)).resolve()
        (out_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(list(overrides)), out_dir / ".hydra" / "overrides.yaml")
        task = [o for o in overrides if not o.startswith("hydra.")]
        return {"idx": idx, "overrides": list(overrides), "dir": out_dir, "cfg": cfg,
                "parameters": {"config_name": self.config.hydra.job.config_name or "train",
                               "overrides": [*task, f"hydra.run.dir={out_dir}"],
                               "sweep": sweep_id(str(cfg.hydra.sweep.dir))}}

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment

        if problem := why_not_ready(self.deployment):
            raise LauncherError(problem)
        members = [self._member(initial_job_idx + i, o) for i, o in enumerate(job_overrides)]
        with get_client(sync_client=True) as client:
            log.info("sweep: %d member(s) as runs of %s, at most %d at once", len(members), self.deployment,
                     self.max_concurrent)
            waiting, running, done = list(members), [], []
            while waiting or running:
                while waiting and len(running) < self.max_concurrent:
                    m = waiting.pop(0)
                    run = run_deployment(self.deployment, parameters=m["parameters"], timeout=0,
                                         tags=["loraflow-sweep", f"sweep:{m['parameters']['sweep']}"])
                    m.update(flow_run_id=str(run.id), submitted=time.monotonic())
                    log.info("sweep: member %d (%s) -> flow run %s", m["idx"],
                             " ".join(filter_overrides(m["overrides"])), run.id)
                    running.append(m)
                time.sleep(self.poll_seconds)
                for m in list(running):
                    state = client.read_flow_run(m["flow_run_id"]).state
                    late = self.timeout is not None and time.monotonic() - m["submitted"] > self.timeout
                    final = state is not None and state.is_final()
                    if final or late:
                        m["state"] = state.type.value if state else "UNKNOWN"
                        m["ok"] = final and m["state"] == "COMPLETED"
                        m["message"] = ((state.message or "") if final else
                                        f"no final state within hydra.launcher.timeout={self.timeout} s")
                        running.remove(m)
                        done.append(m)
        return [self._job_return(m) for m in sorted(done, key=lambda m: m["idx"])]

    def _job_return(self, m: dict) -> JobReturn:
        record = {"flow_run_id": m["flow_run_id"], "state": m["state"], "deployment": self.deployment}
        _write(m["dir"] / FLOW_RUN_FILE, json.dumps(record, indent=2))
        ok = m["ok"]
        if not ok:  # the summary lists it as failed; the sweep goes on and exits 1 (flows/train.py)
            _write(m["dir"] / "error.txt", f"flow run {m['flow_run_id']} ended {m['state']}: {m['message']}\n")
            print(f"loraflow: sweep member {m['dir'].name} failed: flow run {m['flow_run_id']} ended {m['state']}")
        ret = JobReturn(overrides=list(m["overrides"]), cfg=m["cfg"], hydra_cfg=m["cfg"],
                        working_dir=str(m["dir"]), task_name=str(m["cfg"].hydra.job.name), status=JobStatus.COMPLETED)
        ret.return_value = record if ok else {"failed": f"flow run {m['flow_run_id']} ended {m['state']}"}
        return ret


def why_not_ready(deployment: str) -> str | None:
    """Why members could not be sent (no server set, or no such deployment on it), or None."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return ("hydra/launcher=prefect sends members to a Prefect server's workers: set PREFECT_API_URL "
                "(e.g. http://127.0.0.1:4200/api after `prefect server start`)")
    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(deployment)
    except Exception as e:  # ObjectNotFound, an unreachable server, a refused auth string
        return (f"hydra.launcher.deployment={deployment}: not found on {PREFECT_API_URL.value()} "
                f"({type(e).__name__}: {e}); deploy it first: prefect deploy --prefect-file deploy/prefect.yaml "
                "--name train, and start a worker on its pool")
    return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


__all__: list[Any] = ["PrefectLauncher", "LauncherError", "why_not_ready"]
