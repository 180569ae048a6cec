"""Multi-process training: the train node under `accelerate launch` (data parallel).

The node (parent) writes the job as JSON, starts `accelerate launch --multi_gpu --num_processes N -m
tasks.train <job.json>` and relays the processes' output to its log. Each process runs the same
`train.train_lora` (through `run_worker`), which splits every step's batch across them; the main process writes the LoRA and a
result JSON into the job's folder. Nothing crosses the process boundary as a pickle.

accelerate's multi-process launcher is torchrun: with CUDA each process takes one GPU (nccl); without
it, the processes join a gloo group on the CPU (accelerate's MULTI_CPU)."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

from tasks.config import Config, as_plain, from_plain
from tasks.config_schema import TrainConfig
from tasks.plan import Plan
from tasks.training import interrupt


log = logging.getLogger("loraflow")
RESULT = "result.json"
STOP, STOPPED = "stop", "stopped.json"  # the parent asks the processes to stop; they say what they kept
_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Artifact|Interrupt)(: |$)")
_STEP_LINE = re.compile(r"train: step\s+(\d+)/(\d+)\s")  # the main process's log line (every train.log_every)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(job_file: Path, tc: TrainConfig, mixed_precision: str) -> list[str]:
    """`accelerate launch` for this machine: one machine (a free local port), or machine `train.machine_rank`
    of `train.num_machines`, all meeting machine 0 at train.main_process_ip:port."""
    one = tc.num_machines == 1
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_machines", str(tc.num_machines), "--machine_rank", str(tc.machine_rank),
            "--num_processes", str(tc.num_processes), "--mixed_precision", mixed_precision, "--dynamo_backend", "no",
            "--main_process_ip", (tc.main_process_ip or "127.0.0.1") if not one else "127.0.0.1",
            "--main_process_port", str(tc.main_process_port or _free_port()) if not one else str(_free_port()),
            "-m", "tasks.train", str(job_file)]


def wait_for_lora(store, kind: str, key: str, timeout: float = 3600.0, poll: float = 1.0) -> None:
    """On a machine other than 0: machine 0's main process stores the LoRA when training ends. Waits for it
    (the store must be shared: a shared file system or an fsspec store.root)."""
    deadline = time.monotonic() + timeout
    while not store.valid(kind, key):
        if time.monotonic() > deadline:
            raise RuntimeError(f"train.machine_rank>0: machine 0 trained, but its LoRA ({kind}/{key}) did not "
                               f"appear in the store within {timeout:.0f} s; is store.root shared with machine 0 "
                               "(a shared file system or an fsspec URL)?")
        time.sleep(poll)


def launch_training(cfg: Config, plan: Plan, latent_keys: dict, text_keys: dict, out_dir: Path, trajectory: str,
                    run_dir: Path | None, on_step: list | None = None) -> dict | None:
    """Train under `accelerate launch` with cfg.train.num_processes processes (over train.num_machines);
    returns what train.train_lora returns on the main process, None on a machine other than 0. `on_step`:
    told (step, max_steps) of each step line the main process logs."""
    n = int(cfg.train.num_processes)
    job = {"cfg": as_plain(cfg), "plan": plan.stored(), "latent_keys": latent_keys, "text_keys": text_keys, "out_dir": str(out_dir),
           "trajectory": trajectory, "run_dir": str(run_dir) if run_dir else None}
    job_file = out_dir / "job.json"
    job_file.write_text(json.dumps(job))
    from tasks.training.train_setup import precision

    tc = cfg.train
    cmd = launch_command(job_file, tc, precision(cfg))
    machines = f", machine {tc.machine_rank} of {tc.num_machines}" if tc.num_machines > 1 else ""
    log.info("train: %d processes under accelerate launch%s", n, machines)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    tail: deque[str] = deque(maxlen=40)
    errors: list[str] = []  # the workers' exception lines (torchrun's own summary follows them)
    # Its own session, so that stopping it (error) stops every training process it started; a terminal's Ctrl-C
    # reaches the node only, which asks the processes through a file to stop after the same step (checkpoint kept)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)

    def ask_to_stop(signum: int) -> None:
        tmp = out_dir / f".{STOP}.tmp"
        tmp.write_text(str(signum))
        os.replace(tmp, out_dir / STOP)

    interrupt.on_stop(ask_to_stop)
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if _EXCEPTION_LINE.match(line) and "ChildFailedError" not in line:  # that one is torchrun's summary
                errors.append(line.strip())
            log.info("train[launch] %s", line.rstrip())
            if on_step and (m := _STEP_LINE.search(line)):
                for tell in on_step:
                    tell(int(m.group(1)), int(m.group(2)))
        code = proc.wait()
    finally:
        interrupt.off_stop(ask_to_stop)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code == 0 and (out_dir / STOPPED).is_file():  # stopped on request after a step, its checkpoint stored
        stopped = json.loads((out_dir / STOPPED).read_text())
        for text in stopped["kept"]:
            interrupt.kept(text)
        raise interrupt.Interrupted(stopped["signum"])
    if code != 0:
        cause = errors[-1] if errors else "see the lines below"  # the last: the outermost of a chain
        raise RuntimeError(f"train.num_processes={n}: the training processes failed (exit {code}): {cause}\n"
                           "their last lines:\n" + "\n".join(tail))
    if not (out_dir / RESULT).is_file() and tc.machine_rank > 0:
        return None  # machine 0's main process writes the LoRA
    result = json.loads((out_dir / RESULT).read_text())
    result["lora"] = Path(result["lora"])
    return result


def run_worker(job_file: str, train_lora: Callable[..., dict | None]) -> None:
    """One process of `accelerate launch`: runs `train_lora` (tasks/train.py's loop, handed over by the
    module the launcher runs, so that this module never imports the node) on the job the parent wrote."""
    from tasks.store.remote_store import open_store

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    job = json.loads(Path(job_file).read_text())
    cfg = from_plain(job["cfg"])
    store = open_store(cfg.store)
    out_dir = Path(job["out_dir"])
    interrupt.watch(out_dir / STOP)
    try:
        out = train_lora(cfg, Plan.from_stored(job["plan"]), store, job["latent_keys"], job["text_keys"], out_dir,
                         job["trajectory"], Path(job["run_dir"]) if job["run_dir"] else None)
    except interrupt.Interrupted as e:  # every process stopped after the same step; one of each machine says so
        if os.environ.get("LOCAL_RANK", "0") == "0":
            _write_json(out_dir / STOPPED, {"signum": e.signum, "kept": interrupt.kept_items()})
        return
    if out is not None:  # the main process
        _write_json(out_dir / RESULT, {**out, "lora": str(out["lora"])})


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
