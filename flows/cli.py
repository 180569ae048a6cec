"""The Hydra CLI: `python -m flows.train` and `loraflow` (flows/train.py's main hands over to `main`).

Before Hydra and Prefect start it refuses a bad config (exit 2, one line naming the key) and a server that
wants an auth string; then it installs the signal handlers (Ctrl-C / SIGTERM: exit 130 / 143, the temporary
Prefect server shielded), runs the flow once per run or sweep member, and turns user errors into one line
and exit 2, a Prefect API it cannot reach or start into one line and exit 3 (flows/prefect_api.py). A sweep
goes on past a failed member; its summary lists it and the sweep exits 1."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from flows import auth, console, engine_tweaks, prefect_api, run_names, sweep, sweep_parent
from flows.errors import USER_ERRORS
from flows.train import train_flow
from tasks import validate
from tasks.config import ConfigError, compose, held_hydra_mode, resolve_paths
from tasks.store import StoreFull
from tasks.training import interrupt

# An absolute path: Hydra reads a relative one against the module (a package "conf") when run with -m.
CONF = str(Path(__file__).resolve().parents[1] / "conf")


def check_config_only(config_name: str, overrides: list[str], hold: bool = False) -> None:
    """The config checks that read no file and load no model; ConfigError naming every bad key. `hold`:
    the flow run that follows takes this config instead of composing it again (tasks/config.py)."""
    errors = validate.config_errors(resolve_paths(compose(config_name, overrides, hold=hold)[0]))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _stop_on_bad_config() -> None:
    """A single run's bad override (misspelt key, wrong type, syntax, bad value) stops here, before Hydra
    and Prefect's API start: exit 2 and one message naming the key, no traceback. Anything but a plain
    run of conf/ (-m, --cfg, --help, -cp/-cd) is left to Hydra."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args()
    if args.multirun and "hydra/launcher=prefect" in args.overrides:  # no server or deployment: one line
        _stop_unless_launcher_ready(args.overrides)
    if any((args.multirun, args.cfg, args.help, args.hydra_help, args.info, args.shell_completion, args.config_path,
            args.config_dir, args.experimental_rerun, args.package, args.resolve)):
        return
    try:
        check_config_only(args.config_name or "train", args.overrides, hold=True)
    except ConfigError as e:
        print(f"loraflow: stopped before training: {e}", file=sys.stderr)
        sys.exit(2)
    _tell_hydra_the_mode()


def _tell_hydra_the_mode() -> None:
    """Hydra's main composes the config twice: once only to read `hydra.mode` (a run or a sweep), once to run
    it. The check above composed the same config with the same overrides and kept its mode: Hydra is given it
    instead of composing again (60-80 ms of a no-op's start-up, bench/RESULTS.md figure 6). Other calls (a
    sweep's members, another config) are Hydra's as before."""
    from hydra._internal.hydra import Hydra

    composed = Hydra.get_mode

    def get_mode(self, config_name, overrides):
        known, mode = held_hydra_mode(config_name or "train", list(overrides))
        return mode if known else composed(self, config_name, overrides)

    Hydra.get_mode = get_mode


def _stop_unless_launcher_ready(overrides: list[str]) -> None:
    from hydra_plugins.loraflow_prefect_launcher.prefect_launcher import why_not_ready

    named = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.launcher.deployment=")]
    if problem := why_not_ready(named[-1] if named else "loraflow/train"):
        print(f"loraflow: sweep not started: {problem}", file=sys.stderr)
        sys.exit(2)


def _multirun() -> bool:
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args()
    return bool(args.multirun) and not any((args.cfg, args.help, args.hydra_help, args.info, args.shell_completion))


def _stop_unless_api_answers() -> None:
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if url:
        try:
            prefect_api.check_configured(url)
        except prefect_api.PrefectUnavailable as e:
            print(f"loraflow: not started: {e}", file=sys.stderr)
            sys.exit(prefect_api.EXIT_NO_API)


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    _stop_on_bad_config()
    _stop_unless_api_answers()  # a configured PREFECT_API_URL that does not answer: one line, exit 3
    auth.stop_on_auth_failure()  # a server that wants PREFECT_API_AUTH_STRING: one line, before any work
    console.install_signal_handlers()
    console.shield_temporary_server()
    engine_tweaks.stop_joining_heartbeats()  # a flow run ends when its work does, not at the heartbeat's next second

    @hydra.main(config_path=CONF, config_name="train", version_base="1.3")
    def main(cfg) -> float | dict | None:
        for noisy in ("httpx", "httpcore"):  # Hydra's job logging turns on INFO for every library
            logging.getLogger(noisy).setLevel(logging.WARNING)
        hc = HydraConfig.get()
        # Unresolved: iterating the ListConfig would resolve a "train.lr=${...}" override's text here.
        overrides = [*OmegaConf.to_container(hc.overrides.task), f"hydra.run.dir={hc.runtime.output_dir}"]
        console.quiet_user_errors(USER_ERRORS)
        try:
            if hc.mode == RunMode.MULTIRUN:  # a sweep member's bad config: no flow run (a single run's was checked)
                check_config_only(hc.job.config_name, overrides)
            sweep_of = run_names.sweep_id(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
            out = train_flow(config_name=hc.job.config_name, overrides=overrides, sweep=sweep_of)
        except interrupt.Interrupted as e:  # Ctrl-C / SIGTERM: one line, exit 130 / 143
            console.exit_interrupted(e)
        except USER_ERRORS as e:  # bad data or config: the message names the file/key and the fix
            if hc.mode == RunMode.MULTIRUN:  # the sweep goes on; its summary lists the member as failed
                return sweep.member_failed(hc.runtime.output_dir, e)
            console.exit_user_error(e, "stopped" if isinstance(e, StoreFull) else "stopped before training")
        except prefect_api.PrefectUnavailable as e:  # no temporary server could start: one line, exit 3
            if hc.mode == RunMode.MULTIRUN:
                return sweep.member_failed(hc.runtime.output_dir, e)
            console.exit_no_api(str(e))
        except Exception as e:
            auth.stop_on_auth_failure(e)
            if (lost := prefect_api.lost_mid_run(e)) and hc.mode != RunMode.MULTIRUN:
                console.exit_no_api(lost)
            if hc.mode == RunMode.MULTIRUN:
                return sweep.member_failed(hc.runtime.output_dir, e)
            raise
        print(f"\nloraflow: done. LoRA, samples (grid.png) and report.json are in {out['run_dir']}")
        return sweep.objective(out["report"])  # what hydra/sweeper=optuna minimises

    sweep.seed_optuna(sys.argv)  # hydra/sweeper=optuna: a seeded sampler unless the command line seeds it
    if _multirun():  # one parent flow run, the members under it (flows/sweep_parent.py)
        sweep_parent.run_sweep(main, lambda: sweep.failed_members)
    else:
        main()
    if sweep.failed_members:  # a sweep: exit non-zero, one line (each member's error is in the summary)
        names = ", ".join(m["member"] for m in sweep.failed_members)
        print(f"loraflow: sweep: {len(sweep.failed_members)} member(s) failed ({names}); errors in "
              f"{sweep.summary_path}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
