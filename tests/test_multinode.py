"""Two "machines" on 127.0.0.1 (accelerate multi-node: two launches, one process each, gloo), each running the
same CLI command with its own train.machine_rank and PREFECT_HOME, sharing one store: they train one LoRA
together, machine 0 stores it, machine 1 waits for it and both finish. The LoRA is byte for byte the one of a
2-process run on one machine: the same two batch shares, the same kernels, and an all-reduce of two
gradients (a + b, the same sum in either order)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from conftest import REPO, cli_env
from prefect_server import free_port

STEPS = ["train.max_steps=4", "train.log_every=1", "train.batch_size=4", "sample.steps=2"]


def _cli(tmp_path, name, args):
    env = cli_env(tmp_path / f"prefect-{name}")  # its own PREFECT_HOME; the test process's shared API
    return subprocess.Popen([sys.executable, "-m", "flows.train", *args, f"hydra.run.dir={tmp_path / name}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_machines_train_the_lora_two_processes_on_one_machine_train(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "demo", data)
    common = [f"data.dir={data}", f"store.root={tmp_path / 'store'}", *STEPS]
    port = free_port()
    machines = [_cli(tmp_path, f"machine{r}", [*common, "train.num_processes=2", "train.num_machines=2",
                                                f"train.machine_rank={r}", "train.main_process_ip=127.0.0.1",
                                                f"train.main_process_port={port}"]) for r in (0, 1)]
    outs = [m.communicate(timeout=900)[0] for m in machines]
    for m, out in zip(machines, outs):
        assert m.returncode == 0, out[-4000:]
    assert "machine 1 of 2" in outs[1] and "machine 0 of 2" in outs[0]

    one = _cli(tmp_path, "one", [*common, "train.num_processes=2"])
    out = one.communicate(timeout=900)[0]
    assert one.returncode == 0, out[-4000:]

    reports = {n: json.loads((tmp_path / n / "report.json").read_text()) for n in ("machine0", "machine1", "one")}
    assert reports["machine0"]["nodes"]["train"]["key"] == reports["machine1"]["nodes"]["train"]["key"]
    assert reports["machine0"]["nodes"]["train"]["key"] != reports["one"]["nodes"]["train"]["key"]
    two_machines, one_machine = reports["machine1"]["artifacts"]["lora"], reports["one"]["artifacts"]["lora"]
    assert Path(two_machines).read_bytes() == Path(one_machine).read_bytes()
    assert max(v.abs().max().item() for k, v in load_file(one_machine).items() if "lora_B" in k) > 0  # trained
    assert reports["machine0"]["loss"] == reports["one"]["loss"]


def test_a_machine_setting_that_cannot_work_is_refused_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flows.train", f"store.root={tmp_path / 'store'}",
                           "train.num_machines=2", "train.num_processes=2"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "train.main_process_ip and train.main_process_port" in proc.stderr
