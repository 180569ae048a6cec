"""Every command in README.md and docs/*.md, checked, so that a renamed config key, module, console command,
Makefile target, deployment or repository path breaks the suite rather than a user who copies the line.

The commands are the lines of fenced blocks marked ```bash or ```sh, and of plain ``` blocks whose first line
starts with a known command (continuation lines joined, `# comments` and leading `VAR=value` set aside).
The cheap ones run: `flows.explain` / `loraflow-explain` on the tiny model and `flows.train --cfg ...`, with
HF_HUB_OFFLINE=1, a temporary store, run folder and PREFECT_HOME, and the demo data standing in for paths the
user fills in. Every other line is checked without running it:
- `python -m flows.train ARGS` / `loraflow ARGS`: the Hydra overrides compose against conf/ (each member of a
  `-m` sweep: comma lists, choice(), the bounds of interval()) and pass the config checks the CLI makes
  before any work, on a machine taken to have CUDA (the docs show GPU configs too);
- `python -m MODULE`: MODULE is importable; console commands (`loraflow`, `loraflow-explain`, `prefect`, ...)
  exist in .venv/bin; `make TARGET`: a Makefile target;
- `prefect ...` (and `python -m flows.worker`, which passes its arguments to `prefect worker start`): the
  arguments parse with Prefect's own CLI, without running it; deployment and pool names are those of
  deploy/prefect.yaml, and a deployment run's `--param overrides=[...]` compose like the CLI's;
- a repository path named as an argument or value (deploy/prefect.yaml, data/...) exists; `PREFECT_*`
  variables are Prefect settings.
Placeholders the user fills in (`data.dir=/path/to/images`, `<id>`) are composed as written: composition and
the config checks read no file. ```python blocks compile and their imports resolve (overrides given to a
call compose) and ```yaml blocks merge into the config section whose keys they are: tests/test_docs_prose.py,
with the settings named in the prose and the links between pages.
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import cli_env
from support import CONSOLE, PYTHONS, Block, Command, DOCS, check_overrides, doc_blocks, doc_commands  # noqa: F401

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
TRAIN_MODULES = {"flows.train": "loraflow", "flows.explain": "loraflow-explain"}
DUMMY_ID = "00000000-0000-0000-0000-000000000000"  # `<id>`: Prefect's CLI wants a UUID there
COMMANDS = doc_commands()


# ---------------------------------------------------------------- the config


def _check_repo_paths(words: list[str], where: str) -> None:
    """A word (or an override's value) that starts with a top-level entry of the repository is a repo path:
    it must exist."""
    top = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - {"outputs", "multirun"}
    for word in words:
        value = word.split("=", 1)[1] if re.match(r"[\w.+/-]+=", word) else word
        if "/" in value and value.split("/")[0] in top:
            assert (REPO / value).exists(), f"{where}: {value} is not in the repository"


def _hydra_args(args: list[str]) -> tuple[dict, list[str]]:
    """Hydra's CLI flags (-m, --cfg job, --config-name x, --help, --json for explain) and the overrides."""
    flags, overrides, it = {}, [], iter(args)
    for a in it:
        if a in ("-m", "--multirun", "--help", "-h", "--hydra-help", "--info", "--json"):
            flags[a] = True
        elif a in ("--cfg", "-c", "--config-name", "-cn", "--package", "-p"):
            flags[a] = next(it)
        elif a.startswith("-"):
            raise AssertionError(f"unknown flag {a}: teach tests/test_docs_commands.py about it")
        else:
            overrides.append(a)
    return flags, overrides


# ---------------------------------------------------------------- running the cheap ones
@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """Demo data and prompts to stand in for the user's, one store for every run (the tiny model is built once)."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "data" / "demo", root / "images")
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", root / "prompts.txt")
    return root


_RAN: dict[tuple, str] = {}


def _run(program: list[str], flags: list[str], overrides: list[str], sandbox: Path, where: str) -> str:
    """Run it with the user's paths swapped for the sandbox's; the same command line runs once."""
    stand_in = {"data.dir": sandbox / "images", "sample.prompts_file": sandbox / "prompts.txt"}
    swapped = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in stand_in and not (REPO / value).exists():
            o = f"{key}={stand_in[key]}"
        if key not in ("store.root", "hydra.run.dir"):
            swapped.append(o)
    args = [*program, *flags, *swapped, f"store.root={sandbox / 'store'}", f"hydra.run.dir={sandbox / 'run'}"]
    if tuple(args) not in _RAN:
        env = cli_env(sandbox / "prefect-home")  # the test process's shared API
        proc = subprocess.run(args, cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
        assert proc.returncode == 0, f"{where}: {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        _RAN[tuple(args)] = proc.stdout
    return _RAN[tuple(args)]


# ---------------------------------------------------------------- one check per kind of command
def _check_train(cmd: Command, module: str, program: list[str], args: list[str], sandbox: Path) -> str:
    flags, overrides = _hydra_args(args)
    where = f"{cmd.origin}: {cmd}"
    config_name = flags.get("--config-name") or flags.get("-cn") or "train"
    if module == "flows.explain":
        check_overrides(overrides, where, config_name)
        tiny = all(not o.startswith("model=") or o.startswith("model=tiny_") for o in overrides)
        if not tiny or "--help" in flags:
            return "checked"
        out = _run(program, [a for a in args if a.startswith("-")], overrides, sandbox, where)
        assert "would" in out, f"{where}: no table in the output:\n{out}"
        return "ran"
    if "--cfg" in flags or "-c" in flags or "--help" in flags or "--info" in flags:
        out = _run(program, [a for a in args if a not in overrides], overrides, sandbox, where)
        assert out.strip(), f"{where}: printed nothing"
        return "ran"
    check_overrides(overrides, where, config_name)
    return "checked"


def _deployments() -> tuple[str, set[str], set[str]]:
    """(flow name, deployment names, work pool names) of deploy/prefect.yaml."""
    from flows.train import train_flow

    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    names = {d["name"] for d in spec["deployments"]}
    pools = {d["work_pool"]["name"] for d in spec["deployments"]}
    return train_flow.name, names, pools


def _check_prefect(cmd: Command, args: list[str]) -> str:
    """Parsed by Prefect's own CLI (cyclopts), which checks commands, options and argument types; nothing
    runs. Names of deployments and pools are those deploy/prefect.yaml creates."""
    from prefect.cli._app import _app

    where = f"{cmd.origin}: {cmd}"
    tokens = [DUMMY_ID if re.fullmatch(r"<[^>]+>", a) else a for a in args]
    while tokens and tokens[0] in ("--no-prompt", "--prompt", "--profile"):  # the root's own options
        tokens = tokens[2:] if tokens[0] == "--profile" else tokens[1:]
    try:
        _app.parse_args(tokens, print_error=False, exit_on_error=False)
    except Exception as e:
        raise AssertionError(f"{where}: prefect does not take it: {e}") from None
    flow, deployments, pools = _deployments()
    words = [w for w in tokens if not w.startswith("-")]
    options = dict(zip(tokens, tokens[1:]))
    if words[:2] in (["deployment", "run"], ["deployment", "schedule"]):
        name = words[2] if words[1] == "run" else words[3]  # deployment schedule ls|pause NAME [ID]
        assert name in {f"{flow}/{d}" for d in deployments}, f"{where}: no deployment {name} in deploy/prefect.yaml"
    if words[:2] == ["work-pool", "create"]:
        assert words[2] in pools, f"{where}: deploy/prefect.yaml's pools are {pools}"
    if words[:2] == ["worker", "start"]:
        assert options.get("--pool") in pools, f"{where}: deploy/prefect.yaml's pools are {pools}"
    if words[:1] == ["deploy"] and "--name" in options:
        assert options["--name"] in deployments, f"{where}: deploy/prefect.yaml's deployments are {deployments}"
    for token in tokens:
        if token.startswith("overrides="):  # --param overrides='[...]': what the flow composes
            check_overrides(json.loads(token.split("=", 1)[1]), where)
    return "checked"


def _importable(module: str) -> bool:
    """As `python -m MODULE` finds it, run from the repository root (the root first on sys.path)."""
    sys.path.insert(0, str(REPO))
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
    finally:
        sys.path.remove(str(REPO))


def _check_lora_tools(cmd: Command, args: list[str]) -> str:
    """pyproject.toml installs it as tasks.lora_tools.commands:main (a .venv made before that has no such script
    until `make install` reinstalls, which `make test` does), and the arguments parse with its own parsers.
    tests/test_lora_tools.py::test_the_docs_commands_run runs the docs' lines on the tiny Flux's files."""
    from tasks.lora_tools.commands import parse
    from tasks.lora_tools.lora_files import LoraToolError

    where = f"{cmd.origin}: {cmd}"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("loraflow-lora") == "tasks.lora_tools.commands:main", f"{where}: pyproject.toml does not install it"
    try:
        parse(args)
    except LoraToolError as e:
        raise AssertionError(f"{where}: {e}") from None
    return "checked"


def check(cmd: Command, sandbox: Path) -> str:
    """'ran' or 'checked'; an AssertionError naming the command's origin if it would not work."""
    where = f"{cmd.origin}: {cmd}"
    assert cmd.argv or cmd.env, f"{where}: an empty command"
    program, *args = cmd.argv or ["export"]
    _check_repo_paths(args, where)
    if program == "export" or cmd.env:
        assignments = dict(a.split("=", 1) for a in args) if program == "export" else cmd.env
        import prefect.settings

        for name in assignments:
            assert not name.startswith("PREFECT_") or hasattr(prefect.settings, name), \
                f"{where}: {name} is not a Prefect setting"
        if program == "export":
            return "checked"
    if program in PYTHONS:
        assert program != ".venv/bin/python" or (REPO / program).exists(), f"{where}: no {program}"
        assert args[:1] == ["-m"], f"{where}: expected `python -m MODULE`"
        module, args = args[1], args[2:]
        assert _importable(module), f"{where}: no module {module}"
        if module in TRAIN_MODULES:
            return _check_train(cmd, module, [sys.executable, "-m", module], args, sandbox)
        if module == "flows.worker":  # `prefect worker start` with the same arguments, after an auth check
            return _check_prefect(cmd, ["worker", "start", *args])
        return "checked"  # bench.*: not part of the tests (minutes each)
    if program == "make":
        targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), re.M))
        for target in args:
            assert target in targets, f"{where}: no Makefile target {target} (targets: {sorted(targets)})"
        return "checked"
    assert program in CONSOLE, f"{where}: {program} is no command this test knows how to check"
    if program == "loraflow-lora":
        return _check_lora_tools(cmd, args)
    assert (BIN / program).exists(), f"{where}: no {program} in .venv/bin"
    if program in ("loraflow", "loraflow-explain"):  # ours: pyproject.toml names it, and what it names exists
        scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
        assert program in scripts, f"{where}: pyproject.toml's [project.scripts] has no {program}"
        module, _, attr = scripts[program].partition(":")
        assert hasattr(importlib.import_module(module), attr), f"{where}: {program} = {scripts[program]}: no such function"
        module = {v: k for k, v in TRAIN_MODULES.items()}[program]
        return _check_train(cmd, module, [str(BIN / program)], args, sandbox)
    if program == "prefect":
        return _check_prefect(cmd, args)
    return "checked"  # pip, tensorboard: third-party commands; that they exist is what can change here


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.origin}:{c.argv[0] if c.argv else 'env'}" for c in COMMANDS])
def test_doc_command_works(cmd, cuda, sandbox):
    """Each command of the docs runs (the cheap ones) or is checked as far as it can be without running."""
    check(cmd, sandbox)


def test_the_docs_have_commands():
    """The extraction finds the docs' commands: the README's two make targets, sweeps, deployments."""
    text = [str(c) for c in COMMANDS]
    assert "make run" in text and "make test" in text
    assert any(c.argv[:1] == ["prefect"] for c in COMMANDS)
    assert any("-m" in c.argv[3:] for c in COMMANDS if c.argv[:3] == [".venv/bin/python", "-m", "flows.train"])
    assert len(COMMANDS) > 30, len(COMMANDS)
