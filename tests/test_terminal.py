"""The CLI at a terminal: Ctrl-C / SIGTERM to the process group, user errors without tracebacks."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_env, temporary_api_env

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train.max_steps=300", "train.log_every=1", "sample.steps=2"]


def _env(tmp_path, own_api=False):
    """The test process's shared API, or (`own_api`) none: the run starts its temporary one, in its group."""
    return (temporary_api_env if own_api else cli_env)(tmp_path / "prefect-home")


def _start(args, tmp_path, log, own_api=False):
    return subprocess.Popen([sys.executable, "-m", "flows.train", *args], cwd=REPO, env=_env(tmp_path, own_api),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(log: Path, pattern: str, proc, limit=900):
    deadline = time.monotonic() + limit  # generous: only a bound on a hung run
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {log.read_text()[-3000:]}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _interrupt_in_training(tmp_path, signum, name):
    log, run_dir = tmp_path / f"{name}.log", tmp_path / name
    proc = _start([f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}", *TRAIN], tmp_path, log,
                  own_api=True)  # Ctrl-C reaches its temporary API server too
    _wait_for(log, r"train: step +2/", proc)
    os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does: the whole process group
    rc = proc.wait(timeout=600)
    out = log.read_text()
    return rc, out


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_in_training_keeps_a_checkpoint_and_the_rerun_continues(tmp_path, signum, code):
    rc, out = _interrupt_in_training(tmp_path, signum, "first")
    assert rc == code, out[-3000:]
    assert "Traceback" not in out and "ConnectError" not in out, out[-3000:]
    assert "interrupted" in out and "checkpoint of train step" in out and "again to continue" in out
    assert "Crashed" not in out  # Prefect's line repeating the interruption: the CLI's one line says it
    port = re.search(r"temporary server on http://127\.0\.0\.1:(\d+)", out)
    if port:
        assert not _port_open(int(port.group(1)))  # loraflow stopped its temporary API server
    if signum == signal.SIGTERM:
        return
    rerun = subprocess.run([sys.executable, "-m", "flows.train", f"store.root={tmp_path / 'store'}",
                            f"hydra.run.dir={tmp_path / 'second'}", *TRAIN], cwd=REPO, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=1800)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    assert report["nodes"]["train"]["continued_from_step"] >= 2
    straight = subprocess.run([sys.executable, "-m", "flows.train", f"store.root={tmp_path / 'store2'}",
                               f"hydra.run.dir={tmp_path / 'straight'}", *TRAIN], cwd=REPO, env=_env(tmp_path),
                              capture_output=True, text=True, timeout=1800)
    assert straight.returncode == 0, straight.stderr[-3000:]
    lora = lambda d: Path(json.loads((tmp_path / d / "report.json").read_text())["artifacts"]["lora"]).read_bytes()
    assert lora("second") == lora("straight")


def _cli(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "flows.train", f"store.root={tmp_path / 'store'}",
                           f"hydra.run.dir={tmp_path / 'run'}", *args], cwd=REPO, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=900)


def test_missing_data_dir_prints_the_message_once_and_exits_2(tmp_path):
    proc = _cli([f"data.dir={tmp_path / 'nowhere'}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.count(str(tmp_path / "nowhere")) == 1, out


def test_bad_dataset_prints_the_message_once_and_exits_2(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "demo", data)
    img = next(p for p in sorted(data.iterdir()) if p.suffix != ".txt")
    img.with_suffix(".txt").unlink()  # an image without its caption (data.missing_caption=error)
    proc = _cli([f"data.dir={data}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.count(img.stem) >= 1


def test_missing_model_path_says_so(tmp_path):
    proc = _cli([f"model.path={tmp_path / 'no-model'}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "Repo id" not in out, out[-3000:]
    assert "no such file or folder" in out


def test_plus_key_on_an_unknown_key_is_refused_with_a_suggestion(tmp_path):
    proc = _cli(["+train.lrr=1"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.lrr" in proc.stderr and "did you mean train.lr?" in proc.stderr and "Traceback" not in proc.stderr
    assert "+train.lrr" not in proc.stderr  # not Hydra's suggestion to add the misspelt key
    assert not (tmp_path / "store").exists()


def test_console_commands_resolve_to_the_module_entry_points():
    import importlib
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) >= {"loraflow", "loraflow-explain"}
    for target in scripts.values():
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_samples_during_training_appear_while_it_runs(tmp_path):
    """Through the CLI: step_2's images are on disk while training goes on (long before the last step)."""
    log, run_dir = tmp_path / "live.log", tmp_path / "live"
    proc = _start([f"store.root={tmp_path / 'store'}", f"hydra.run.dir={run_dir}", "train.max_steps=100000",
                   "train.log_every=1", "sample.steps=2", "sample.every_n_steps=2"], tmp_path, log)
    try:
        deadline = time.monotonic() + 900
        while len(list((run_dir / "samples" / "step_2").glob("*.png"))) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert proc.poll() is None and not (run_dir / "report.json").exists()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=600)
    assert rc == 130, log.read_text()[-3000:]


def test_quiet_output_that_names_what_changed(tmp_path):
    """Through the CLI: no library noise the user cannot act on, rounded sizes, and after a caption edit
    the log names the caption file (cache_text) and the sample node says only the LoRA changed."""
    data, prompts = tmp_path / "data", tmp_path / "prompts.txt"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    args = [f"store.root={tmp_path / 'store'}", f"data.dir={data}", f"sample.prompts_file={prompts}",
            "train.max_steps=4", "sample.steps=2", "data.buckets=true"]
    first = _cli([*args, f"hydra.run.dir={tmp_path / 'run1'}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout + first.stderr
    for noise in ("torchvision", "No LoRA keys", "Loading pipeline components", "Writing model shards",
                  "Loading weights"):
        assert noise not in out, f"{noise!r} in\n{out[-3000:]}"
    assert re.search(r"budget \d+\.\d\d GiB", out) and not re.search(r"\d\.\d{3,} GiB", out), out[-3000:]
    assert re.search(r"validate: \d+ bucket\(s\): 64x64: 12", out), out[-3000:]

    (data / "img_01.txt").write_text("a red circle, edited\n")
    second = _cli([*args, f"hydra.run.dir={tmp_path / 'run2'}"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    lines = (second.stdout + second.stderr).splitlines()
    text_line = next(line for line in lines if "cache_text:" in line and "computed," in line)
    sample_line = next(line for line in lines if "sample:" in line and "computed," in line)
    assert text_line.endswith("differs from the last run of train: caption img_01.txt"), text_line
    assert sample_line.endswith("differs from the last run of train: lora"), sample_line
