"""loraflow-lora as a user meets it: bad input gets one line and exit 2 with nothing written, a Ctrl-C while
writing leaves no file, and docs/lora-files.md's commands run as written. The maths: tests/test_lora_tools.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.lora_tools import commands as cli
from tasks.training.export import kohya_metadata
from lora_tools_checks import ALPHA, RANK, peft_lora, run
from support import REPO


# ---------------------------------------------------------------- bad input: one line, exit 2, no file
@pytest.fixture(scope="module")
def files(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    peft_lora("flux", model_dirs("flux"), root)
    kohya = load_file(root / "lora_kohya.safetensors")
    key = "lora_unet_double_blocks_0_img_mlp_2.lora_down.weight"
    wide = dict(kohya, **{key: torch.zeros(kohya[key].shape[0], kohya[key].shape[1] + 1)})
    save_file(wide, root / "wide.safetensors", metadata=kohya_metadata("flux", RANK, ALPHA))
    save_file(dict(kohya, **{key: kohya[key][:3]}), root / "ranks.safetensors")
    save_file({"lora_unet_x.hada_w1_a": torch.zeros(2, 2)}, root / "loha.safetensors")
    (root / "text.safetensors").write_text("not a tensor file\n")
    (root / "model.ckpt").write_bytes(b"\x80\x04pickle")
    return root


BAD = {  # argv (with {root}, {flux}, {sd15}) -> what the one line must say
    "missing file": ("resize {root}/nope.safetensors {out} --rank 2", "no such file"),
    "not safetensors": ("resize {root}/text.safetensors {out} --rank 2", "not a safetensors file"),
    "pickle": ("resize {root}/model.ckpt {out} --rank 2", "pickle"),
    "not a LoRA": ("resize {flux}/transformer/diffusion_pytorch_model.safetensors {out} --rank 2", "not a LoRA"),
    "unknown format": ("convert {root}/loha.safetensors {out} --format kohya", "LoHa"),
    "ranks in a module": ("resize {root}/ranks.safetensors {out} --rank 2", "ranks must match"),
    "rank 0": ("resize {root}/lora_kohya.safetensors {out} --rank 0", "--rank"),
    "weights count": ("merge {root}/lora_kohya.safetensors {root}/wide.safetensors --weights 1 {out}", "--weights"),
    "unknown family": ("convert {root}/pytorch_lora_weights.safetensors {out} --format kohya", "--family"),
    "bad family name": ("convert {root}/pytorch_lora_weights.safetensors {out} --format kohya --family sd2",
                        "--family"),
    "wrong family": ("convert {root}/lora_kohya.safetensors {out} --format diffusers --family sdxl", "sdxl"),
    "shapes between files": ("merge {root}/lora_kohya.safetensors {root}/wide.safetensors {out}", "different models"),
    "shapes against base": ("merge {root}/wide.safetensors --into-base {flux} {out}", "another model"),
    "other model's LoRA": ("merge {root}/lora_kohya.safetensors --into-base {sd15} {out}", "not the same"),
    "two families": ("extract --base {flux} --tuned {sd15} --rank 2 {out}", "one family"),
    "nothing to extract": ("extract --base {flux} --tuned {flux} --rank 2 {out}", "nothing to extract"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, files, model_dirs, tmp_path):
    argv, says = BAD[case]
    out = tmp_path / "out" / "x.safetensors"
    args = argv.format(root=files, flux=model_dirs("flux"), sd15=model_dirs("sd15"), out=out).split()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tasks.lora_tools", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("loraflow-lora: error: ") and says in lines[0], lines[0]
    assert not out.parent.exists() or not any(out.parent.iterdir())  # nothing written, not even a temporary file


def test_a_crash_or_ctrl_c_while_writing_leaves_no_file(files, tmp_path, monkeypatch, capsys):
    out = tmp_path / "x.safetensors"

    def interrupted(*args, **kwargs):
        Path(args[1]).write_bytes(b"half a file")  # as if save_file had written part of it
        raise KeyboardInterrupt
    monkeypatch.setattr("safetensors.torch.save_file", interrupted)
    assert run("resize", files / "lora_kohya.safetensors", out, "--rank", 2) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the docs' commands run
def _doc_commands() -> list[list[str]]:
    from support import doc_commands

    return [c.argv for c in doc_commands() if c.origin.startswith("docs/lora-files.md") and c.argv[:1] == ["loraflow-lora"]]


def test_the_docs_commands_run(model_dirs, tuned, tmp_path, monkeypatch):
    """docs/lora-files.md's loraflow-lora lines, run as written in a folder holding the files they name."""
    commands = _doc_commands()
    assert {c[1] for c in commands} == {"resize", "merge", "convert", "extract"}
    peft_lora("flux", model_dirs("flux"), tmp_path)
    peft_lora("flux", model_dirs("flux"), tmp_path / "two", seed=2, kohya=False)
    shutil.copy(tmp_path / "lora_kohya.safetensors", tmp_path / "style.safetensors")
    shutil.copy(tmp_path / "two" / "pytorch_lora_weights.safetensors", tmp_path / "subject.safetensors")
    os.symlink(tuned[0], tmp_path / "base_model")
    os.symlink(tuned[1], tmp_path / "tuned_model")
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert cli.main(argv[1:]) == 0, " ".join(argv)
