"""train.shard=fsdp: the frozen base sharded over two CPU processes (gloo) with FSDP2, against the same run with
data parallelism only (train.shard=none, 2 processes).

What is promised, and why (docs/scaling.md): both paths run the same maths. Each process runs the same half of
the batch on the same weights (FSDP2 gathers the exact stored values), and its LoRA gradient is summed with the
other's: an all-reduce of two values or a reduce-scatter of two values, a + b either way. What may round
differently is the gradient's norm for clipping (a sum of per-shard partial sums against one sum), so the bound is
the one tests/test_multiprocess.py uses for two processes: each step's loss to `rounding` of its mean, the LoRA
to Adam's step bound (`adam_drift`). A second sharded run, a resumed one and two machines are byte-exact: the same
processes, the same kernels, the same order."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, cli_env
from families import Family
from prefect_server import free_port
from tasks.config import compose
from tolerance import assert_losses_close, assert_within_adam_drift

TWO = ("train.max_steps=4", "train.batch_size=4", "train.log_every=1", "train.num_processes=2")
SHARD = "train.shard=fsdp"


def _compare(fam: Family, dp: dict, sh: dict, *extra) -> None:
    assert sh["computed"] == 1 and sh["key"] != dp["key"]  # its own LoRA, not the data-parallel one reused
    assert_losses_close([x["loss"] for x in sh["losses"]], [x["loss"] for x in dp["losses"]],
                        n=fam.loss_terms(dp, batch=4), what=f"{fam.family} sharded")
    a, b = load_file(dp["lora"]), load_file(sh["lora"])
    cfg = fam.cfg(*TWO, *extra)
    assert_within_adam_drift(b, a, lr=cfg.train.lr, steps=4, what=f"{fam.family} sharded")
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) >= cfg.train.lr  # it trained


@pytest.mark.numerics
@pytest.mark.parametrize("family", ["flux", "wan"])  # two block lists (double, single); a video family's one
def test_a_sharded_run_matches_data_parallel(family, tmp_path):
    fam = Family(family, tmp_path)
    _, dp = fam.train(*TWO)
    _, sh = fam.train(*TWO, SHARD)
    assert sh["runtime"]["shard"]["processes"] == 2 and sh["runtime"]["shard"]["units"] >= 2
    _compare(fam, dp, sh)


@pytest.mark.numerics
def test_a_sharded_fp8_checkpointed_offloaded_run_with_ema_and_validation_matches_data_parallel(tmp_path):
    fam = Family("flux", tmp_path)
    opts = ("model.quantize=fp8", "train.gradient_checkpointing=true", "train.ema_decay=0.9",
            "data.validation_split=0.25")
    _, dp = fam.train(*TWO, *opts)
    _, sh = fam.train(*TWO, *opts, SHARD, "train.shard_offload=true")
    assert sh["runtime"]["shard"]["offload"] is True
    _compare(fam, dp, sh, *opts)
    cfg = fam.cfg(*TWO, *opts)
    assert_within_adam_drift(load_file(sh["lora_ema"]), load_file(dp["lora_ema"]), lr=cfg.train.lr, steps=4,
                             what="EMA, sharded")
    assert [v["step"] for v in sh["validation_loss"]] == [v["step"] for v in dp["validation_loss"]] == [4]


def test_a_second_sharded_run_gives_the_same_bytes(tmp_path):
    runs = [Family("flux", tmp_path / name).train(*TWO, SHARD, "model.quantize=nf4")[1] for name in ("a", "b")]
    assert runs[0]["key"] == runs[1]["key"] and runs[1]["computed"] == 1
    assert Path(runs[0]["lora"]).read_bytes() == Path(runs[1]["lora"]).read_bytes()


def _cli(tmp_path, name, args, **kw):
    return subprocess.Popen([sys.executable, "-m", "flows.train", *args, f"hydra.run.dir={tmp_path / name}"],
                            cwd=REPO, env=cli_env(tmp_path / f"prefect-{name}"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _lora(tmp_path, name) -> bytes:
    return Path(json.loads((tmp_path / name / "report.json").read_text())["artifacts"]["lora"]).read_bytes()


@pytest.mark.parametrize("shard", ["fsdp", "none"])  # sharded, and data parallel's processes alike
def test_ctrl_c_stops_every_process_after_one_step_and_resume_gives_the_uninterrupted_bytes(tmp_path, shard):
    common = [f"data.dir={REPO / 'data' / 'demo'}", "train.max_steps=40", "train.log_every=1", "train.batch_size=4",
              "sample.steps=2", "train.num_processes=2", f"train.shard={shard}"]
    first = _cli(tmp_path, "first", [f"store.root={tmp_path / 'store'}", *common], start_new_session=True)
    seen = []
    for line in first.stdout:
        seen.append(line)
        if re.search(r"train: step +2/40", line):
            os.killpg(first.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the CLI's whole process group
            break
    out = "".join(seen) + first.communicate(timeout=900)[0]
    assert first.returncode == 130, out[-4000:]
    assert "Traceback" not in out and "checkpoint of train step" in out, out[-4000:]
    step = int(re.search(r"checkpoint of train step (\d+)/40", out).group(1))
    assert 2 <= step < 40
    second = _cli(tmp_path, "second", [f"store.root={tmp_path / 'store'}", *common])
    out = second.communicate(timeout=1800)[0]
    assert second.returncode == 0, out[-4000:]
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    assert report["nodes"]["train"]["continued_from_step"] == step
    straight = _cli(tmp_path, "straight", [f"store.root={tmp_path / 'store2'}", *common])
    out = straight.communicate(timeout=1800)[0]
    assert straight.returncode == 0, out[-4000:]
    assert _lora(tmp_path, "second") == _lora(tmp_path, "straight")


def test_two_machines_shard_the_base_as_two_processes_on_one_machine_do(tmp_path):
    common = [f"data.dir={REPO / 'data' / 'demo'}", f"store.root={tmp_path / 'store'}", "train.max_steps=4",
              "train.log_every=1", "train.batch_size=4", "sample.steps=2", "train.num_processes=2", SHARD,
              "export.format=both"]
    port = free_port()
    machines = [_cli(tmp_path, f"machine{r}", [*common, "train.num_machines=2", f"train.machine_rank={r}",
                                                "train.main_process_ip=127.0.0.1", f"train.main_process_port={port}"])
                for r in (0, 1)]
    outs = [m.communicate(timeout=900)[0] for m in machines]
    for m, out in zip(machines, outs):
        assert m.returncode == 0, out[-4000:]
    one = _cli(tmp_path, "one", common)
    out = one.communicate(timeout=900)[0]
    assert one.returncode == 0, out[-4000:]
    assert _lora(tmp_path, "machine1") == _lora(tmp_path, "one")
    report = json.loads((tmp_path / "one" / "report.json").read_text())
    files = report["artifacts"]["lora_files"]  # gathered on rank 0, exported as a one-process run's LoRA is
    assert len(files) >= 2 and all(load_file(f) for f in files.values()), files


@pytest.mark.parametrize("override,named", [
    ("train.num_processes=1", "train.num_processes=2 or more"),
    ("model.quantize=int8", "model.quantize=int8 with train.shard=fsdp"),
    ("train.blocks_to_swap=1", "train.blocks_to_swap=1 with train.shard=fsdp"),
    ("train.network=dora", "train.network=dora with train.shard=fsdp"),
    ("sample.every_n_steps=2", "sample.every_n_steps=2 with train.shard=fsdp"),
    ("model=tiny_sdxl", "declares no repeated blocks"),
])
def test_what_cannot_shard_is_refused_naming_the_key(override, named):
    from tasks.config_checks import config_errors

    cfg = compose("train", ["train.num_processes=2", SHARD, override])[0]
    assert any(named in e for e in config_errors(cfg)), config_errors(cfg)


def test_the_cli_refuses_int8_sharding_in_one_line_with_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flows.train", f"store.root={tmp_path / 'store'}",
                           "train.num_processes=2", SHARD, "model.quantize=int8"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model.quantize=int8 with train.shard=fsdp" in proc.stderr
