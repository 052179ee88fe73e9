"""qlora-pipeline: the command line.

    qlora-pipeline run [--config FILE.yaml] [--preset NAME] [--set SECTION.FIELD=VALUE ...] [--json]
    qlora-pipeline validate [--config FILE.yaml] [--preset NAME] [--set ...]
    qlora-pipeline sweep --grid GRID.yaml [--config FILE.yaml] [--preset NAME] [--set ...] [--json]
    qlora-pipeline start DEPLOYMENT [--set ...] [--watch] [--host H]  # a deployment run (--host: pinned to host H)
    qlora-pipeline presets                          # each preset's one-line description
    qlora-pipeline --version                        # this checkout, and whether its libraries are the tested ones
    qlora-pipeline history [--export-name NAME] [--runs-dir DIR]  # the registry's versions, verdicts and losses
    qlora-pipeline promote NAME VERSION [--config FILE.yaml] [--set serve.url=URL ...]  # a rollback; serves it too
    qlora-pipeline setup [--gpus N] [--host H] [--notify-url URL]  # work pool, GPU pool (N GPUs), failure automation
    qlora-pipeline deploy [--git URL [--branch B]]  # register deployments/prefect.yaml
    qlora-pipeline worker [--pool qlora-process] [--host H]  # a worker that runs flow runs in this checkout
    qlora-pipeline serve [--config FILE.yaml | --preset NAME] [--cron "0 2 * * *"] [--timezone Europe/Berlin]

User errors (bad config, missing files, bad data, unknown module names, a full disk) print one paragraph and
exit with status 2; they are never retried and never print a traceback. A run, sweep or promote that leaves
serve.url's server not serving the champion exits with status 3 (the registry changed; the server did not). SIGTERM
ends a run or a sweep within seconds as Crashed, with its hooks, and exits 143.
"""

from __future__ import annotations

import argparse
import json
import os
import reprlib
import signal
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NoReturn

USER_ERROR_EXIT = 2
SERVING_NOT_UPDATED_EXIT = 3  # the run did its work, but serve.url's server still serves the previous champion
EPHEMERAL_STARTUP_S = 120
_SERVER_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qlora-pipeline", description="QLoRA fine-tuning as a Prefect flow.")
    parser.add_argument("--version", action=_Version, help="print the version, the checkout and whether its "
                        "libraries are the tested ones (constraints.txt), and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run the pipeline"), ("validate", "check a config and print it"),
                            ("start", "start a run of a deployment on the server (what the UI's Run does)")):
        cmd = sub.add_parser(name, help=help_text)
        if name == "start":
            cmd.add_argument("deployment", help="deployment name, e.g. nightly or embedded-default")
            cmd.add_argument("--watch", action="store_true", help="follow the run: states and artifact contents")
            cmd.add_argument("--host", help="pin the run to this GPU host (its work queue); default: the first host "
                             "with a free GPU")
        cmd.add_argument("--config", type=Path, help="a YAML file mirroring RunConfig")
        cmd.add_argument("--preset", help="a preset from data/presets (see `qlora-pipeline presets`)")
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                         help="override one field; repeatable (values are parsed as YAML)")
        if name == "run":
            cmd.add_argument("--json", action="store_true", help="print the run summary as JSON, last line")
    _sweep_parser(sub)
    sub.add_parser("presets", help="list the presets, each with its one-line description")
    history = sub.add_parser("history", help="print an exports registry's versions: losses, verdicts, dates")
    history.add_argument("--export-name", default=None, help="the registry (export.name; default: the default's)")
    history.add_argument("--runs-dir", type=Path, default=None, help="runs_dir (default: the default config's)")
    promote = sub.add_parser("promote", help="make a version of a registry the champion by hand (a rollback) and, "
                             "with serve.url, load it into that vLLM server as the champion is after a run")
    promote.add_argument("name", help="the registry (export.name)")
    promote.add_argument("version", help="the version to make champion, e.g. v0001")
    promote.add_argument("--config", type=Path, help="a YAML file mirroring RunConfig (its runs_dir and serve section)")
    promote.add_argument("--preset", help="a preset from data/presets")
    promote.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                         help="override one field, e.g. serve.url=http://127.0.0.1:8000 or runs_dir=/data/runs")
    setup = sub.add_parser("setup", help="create the work pool, the GPU concurrency limit and the failure automation")
    setup.add_argument("--notify-url", help="webhook URL to POST to when a flow run fails")
    setup.add_argument("--gpus", type=int, help="GPUs of the worker for the GPU pool (default: those visible here, "
                       "CUDA_VISIBLE_DEVICES honoured; 0: one slot, one training at a time)")
    setup.add_argument("--runs-dir", type=Path, default=None, help="the runs_dir the runs share, checked for what "
                       "several hosts need of it: atomic renames, file locks (default: the default config's)")
    setup.add_argument("--host", help="this GPU host's name, for a pool per host under one server (default: "
                       "$QLORA_HOST; none: the single host's pool)")
    deploy = sub.add_parser("deploy", help="register the deployments in deployments/prefect.yaml")
    deploy.add_argument("--git", metavar="URL", help="flow runs clone this repository instead of running in the "
                        "worker's checkout (the worker's directory)")
    deploy.add_argument("--branch", help="with --git: the branch or tag to clone")
    worker = sub.add_parser("worker", help="start a Prefect worker that runs flows in this checkout")
    worker.add_argument("--pool", default="qlora-process", help="work pool (default: qlora-process)")
    worker.add_argument("--limit", help="most flow runs at a time (with a host: its GPUs)")
    worker.add_argument("--host", help="this GPU host's name (default: $QLORA_HOST): the worker of that host's pool "
                        "and work queue")
    serve = sub.add_parser("serve", help="serve the flow in this process, with its nightly schedule")
    serve.add_argument("--config", type=Path, help="a YAML file mirroring RunConfig")
    serve.add_argument("--preset", help="a preset from data/presets")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    serve.add_argument("--cron", default="0 2 * * *", help="schedule (cron syntax); '' for none")
    serve.add_argument("--timezone", default="Europe/Berlin", help="time zone of the schedule")
    return parser


class _Version(argparse.Action):
    """--version: computed only when asked (argparse's own version action formats its text for every command)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib import metadata

        from tasks.config import PROJECT_ROOT
        from tasks.tested_versions import CONSTRAINTS, KEY_LIBRARIES, version_drift

        print(f"qlora-pipeline {metadata.version('qlora-pipeline')} ({PROJECT_ROOT})")
        libraries = ", ".join(f"{name} {metadata.version(name)}" for name in KEY_LIBRARIES)
        if not CONSTRAINTS.is_file():
            print(f"{libraries}; not checked: no {CONSTRAINTS}")
        elif drift := version_drift():
            print(f"{libraries}; differ from {CONSTRAINTS.name}: {', '.join(drift)}")
        else:
            print(f"{libraries}: as tested ({CONSTRAINTS.name})")
        parser.exit()


def _sweep_parser(sub: Any) -> None:
    sweep = sub.add_parser("sweep", help="train and evaluate a grid of candidates, publish the best (README: Sweeps)")
    sweep.add_argument("--grid", type=Path, required=True, help="YAML: SECTION.FIELD keys to lists of values (every "
                       "combination is a candidate), or a list of overrides, one mapping per candidate")
    sweep.add_argument("--config", type=Path, help="the base config, a YAML file mirroring RunConfig")
    sweep.add_argument("--preset", help="a preset from data/presets as the base config")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="override one field of the base config; repeatable")
    sweep.add_argument("--json", action="store_true", help="print the sweep summary as JSON, last line")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qlora-pipeline` command."""
    # no network here or on most workers: a temporary server must not try to phone home
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's temporary server gets 20 s to start by default; several runs starting at once on a busy 2-core
    # machine need longer (they died at 20 s: "Timed out while attempting to connect to ephemeral ...")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EPHEMERAL_STARTUP_S))
    args = _parser().parse_args(argv)
    if (host := _host(args)) is not None:
        return host
    if args.command == "worker":
        from deployments import setup

        return setup.worker(args.pool, ["--limit", args.limit] if args.limit else [])
    if args.command in ("setup", "deploy"):
        return _setup(args)
    if args.command == "history":
        return _history(args.export_name, args.runs_dir)
    if args.command == "presets":
        return _presets()
    try:
        config = _config(args)
    except Exception as exc:  # noqa: BLE001 - every config problem is the user's to fix
        return _user_error(_config_message(exc))
    if args.command in ("run", "start", "serve") and (too_large := _parameters_too_large(config)):
        return _user_error(too_large)
    if args.command in ("run", "validate", "serve") and (gpus := _gpus_problem(config)):  # `start`: on a worker
        return _user_error(gpus)
    if args.command == "validate":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    if args.command == "serve":
        return _serve(config, args.cron, args.timezone)
    if args.command == "promote":
        return _promote(config, args.name, args.version)
    if args.command == "start":
        return _start_deployment(args.deployment, config, args.watch, args.host)
    if args.command == "sweep":
        return _sweep(config, args.grid, args.json)
    return _run(config, as_json=args.json)


def _host(args: argparse.Namespace) -> int | None:
    """`--host NAME` (setup, worker, start) checked; for setup and worker it becomes this process's QLORA_HOST,
    which the worker passes on to its flow runs. An exit status where the name cannot be used, else None."""
    from tasks.pool.hosts import HOST_VARIABLE, host_problem

    given = getattr(args, "host", None)
    name = given if given is not None else (os.environ.get(HOST_VARIABLE, "").strip() or None)
    if args.command == "start" and given is None:
        return None  # the run's host is the worker's, not this terminal's
    if name is not None and (problem := host_problem(name)):
        return _user_error(problem.replace(f"{HOST_VARIABLE}=", "--host " if given is not None else
                                           f"{HOST_VARIABLE}="))
    if given is not None and args.command in ("setup", "worker"):
        os.environ[HOST_VARIABLE] = given
    return None


def _presets() -> int:
    """Each preset with its description (the first line of its file, a comment); where they are, how to use one."""
    from tasks.config import PRESETS_DIR

    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        first = path.read_text(encoding="utf-8").partition("\n")[0]
        print(f"{path.stem:20} {first.removeprefix('#').strip() if first.startswith('#') else '(no description)'}")
    print(f"\n(files in {PRESETS_DIR}; use one with --preset NAME, e.g. qlora-pipeline validate --preset NAME)")
    return 0


def _setup(args: argparse.Namespace) -> int:
    from deployments import setup
    from tasks.pool.gpus import visible_gpus

    if args.command == "deploy":
        return setup.deploy(args.git, args.branch)
    from tasks.pool.leases import uses_server

    if not uses_server():
        print("no PREFECT_API_URL: setting up the local Prefect database that runs in this terminal use (PREFECT_HOME, "
              "through a temporary server); to set up a server, point PREFECT_API_URL at it first "
              "(docs/operations.md)")
    print(setup.ensure_work_pool())
    if args.gpus is not None and args.gpus < 0:
        return _user_error(f"--gpus {args.gpus}: give the number of GPUs of the worker, 0 or more.")
    print(setup.ensure_gpu_limit(args.gpus if args.gpus is not None else len(visible_gpus())))
    if args.notify_url:
        print(setup.apply_automations(args.notify_url))
    else:
        print("no --notify-url: failure automation not applied (the flow's on_failure hook still leaves a "
              "summary artifact on every failed run)")
    return _check_storage(args.runs_dir)


def _check_storage(runs_dir: Path | None) -> int:
    """setup's last step: runs_dir's filesystem against what hosts sharing it need (tasks/on_disk/shared_storage.py)."""
    from tasks.config import RunConfig
    from tasks.on_disk.shared_storage import check_shared_storage

    if runs_dir is None and not RunConfig().runs_dir.is_dir():  # setup creates no folder it was not asked for
        print(f"runs_dir not checked: no {RunConfig().runs_dir} here; `setup --runs-dir DIR` checks the runs_dir "
              "the runs share")
        return 0
    runs_dir = runs_dir or RunConfig().runs_dir
    checked, problems = check_shared_storage(runs_dir)
    if not problems:
        print(f"runs_dir {runs_dir}: {', '.join(checked)}: fit to be shared by several hosts (each host's own "
              "`setup` checks its mount)")
        return 0
    return _user_error(f"runs_dir {runs_dir} cannot be shared safely by several hosts: {'; '.join(problems)}. "
                       "The rest of the set-up is done; a single host may still use it.")


def _serve(config: Any, cron: str, timezone: str) -> int:
    from prefect.schedules import Cron

    from deployments.setup import ensure_gpu_limit
    from flows.qlora_pipeline import qlora_pipeline

    print(ensure_gpu_limit())
    schedules = [Cron(cron, timezone=timezone)] if cron else []
    qlora_pipeline.serve(name="served", parameters={"config": config.model_dump(mode="json")}, schedules=schedules)
    return 0


def _start_deployment(deployment: str, config: Any, follow: bool, host: str | None = None) -> int:
    from prefect.utilities.urls import url_for

    from deployments.watch import start, watch
    from tasks.errors import UserError

    # only what was set: defaults (paths in the checkout among them) are the worker's own
    try:
        run = start(deployment, config.model_dump(mode="json", exclude_unset=True), host)
    except UserError as exc:
        return _user_error(str(exc))
    print(f"started flow run {run.name} ({run.id}): {url_for(run, url_type='ui') or ''}".rstrip(": "))
    if run.state is not None and run.state.message:
        print(run.state.message)
    if not follow:
        return 0
    return 0 if watch(run.id) == "COMPLETED" else _watched_exit(run.id)


def _watched_exit(flow_run_id: Any) -> int:
    """A watched run that did not complete: 3 where it is tagged not-served (its serving failed, as `run` exits),
    else 1."""
    from prefect import get_client

    from tasks.reporting.artifacts import NOT_SERVED

    with get_client(sync_client=True) as client:
        tags = client.read_flow_run(flow_run_id).tags
    return SERVING_NOT_UPDATED_EXIT if NOT_SERVED in tags else 1


def _parameters_too_large(config: Any) -> str | None:
    """Why the config cannot be a flow run's parameters (the server refuses them over its size limit), or None."""
    from prefect.settings import get_current_settings

    limit = get_current_settings().server.api.max_parameter_size  # 0: no limit
    # measured as the server measures it (compact JSON), before a run or a server starts
    size = len(json.dumps({"config": config.model_dump(mode="json")}, separators=(",", ":")).encode())
    if not limit or size <= limit:
        return None
    return (f"the config is {size:,} bytes as flow-run parameters, more than the {limit:,} bytes Prefect's server "
            "accepts (PREFECT_SERVER_API_MAX_PARAMETER_SIZE); nothing was started. Shorten the largest values (a "
            "long data.column_mapping or list): put them in the data itself, or raise that limit on the server.")


def _gpus_problem(config: Any) -> str | None:
    """speed.num_gpus against this machine's GPUs and the server's GPU pool (tasks/pool/gpus.py), and speed.num_nodes
    against what a training across hosts needs (tasks/train_adapter/nodes.py), before any run."""
    from tasks.pool.gpus import num_gpus_problem
    from tasks.train_adapter.nodes import nodes_problem

    return nodes_problem(config.speed.num_nodes) or num_gpus_problem(config.speed.num_gpus)


def _config(args: argparse.Namespace) -> Any:
    from tasks.config import PRESETS_DIR, load_config

    path = args.config
    if args.preset:
        if path is not None:
            raise ValueError("give --config or --preset, not both")
        path = PRESETS_DIR / f"{args.preset}.yaml"
        if not path.is_file():
            names = ", ".join(p.stem for p in sorted(PRESETS_DIR.glob("*.yaml")))
            raise ValueError(f"no preset named {args.preset!r}; presets: {names}")
    if path is not None and not Path(path).is_file():
        raise ValueError(f"config file {path} does not exist")
    return load_config(path, args.overrides)


_SHOWN_PROBLEMS = 10  # a config with thousands of bad entries is one mistake repeated: show a few
_QUOTED = reprlib.Repr()  # keyword arguments need Python 3.12
_QUOTED.maxstring = _QUOTED.maxother = 60
_QUOTED.maxlevel, _QUOTED.maxlist, _QUOTED.maxdict = 2, 4, 4


def _config_message(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        # a value is quoted by a short prefix only: wrapping a 50 MB value into the paragraph took minutes
        errors = exc.errors(include_url=False)
        problems = [_problem(e) for e in errors[:_SHOWN_PROBLEMS]]
        more = f"; and {len(errors) - _SHOWN_PROBLEMS:,} more" if len(errors) > _SHOWN_PROBLEMS else ""
        listed = "; ".join(problems) + more
        return (f"Invalid configuration, {len(errors)} problem(s): {listed}{'' if listed.endswith('?') else '.'} "
                "Fix these fields in the config file or with --set SECTION.FIELD=VALUE.")
    text = str(exc)
    return f"Invalid configuration: {text if len(text) <= 2000 else text[:2000] + ' ...'}."


def _masked(value: Any) -> Any:
    """A config value as it may be quoted: the credentials of a URI in it masked (before it is shortened, which
    could cut the '@' that shows where they end)."""
    from tasks.credentials import mask

    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(v) for v in value]
    return value


def _problem(error: Any) -> str:
    """One field's problem; a field that does not exist gets the nearest one (as a sweep's grid does)."""
    from tasks.config import closest_field

    where = ".".join(map(str, error["loc"])) or "config"
    problem = f"{where}: {error['msg']}" + (f" (got {_QUOTED.repr(_masked(error['input']))})"
                                            if error["type"] != "missing" else "")
    near = closest_field(where) if error["type"] == "extra_forbidden" else None
    return problem + (f", did you mean {near}?" if near else "")


def _run(config: Any, as_json: bool) -> int:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    from prefect.exceptions import TerminationSignal

    from deployments.setup import ensure_gpu_limit
    from flows.qlora_pipeline import qlora_pipeline
    from tasks.errors import UserError
    from tasks.log import log_user_errors_once, quiet_user_errors
    from tasks.on_disk.folders import check_runs_dir
    from tasks.pool.leases import uses_server
    from tasks.reporting.artifacts import NotServed

    quiet_user_errors()
    log_user_errors_once(printed_by_caller=True)  # _user_error prints it, last
    _stop_on_sigterm("run it again to resume (training from its latest complete checkpoint)")
    try:
        if uses_server():
            ensure_gpu_limit()  # idempotent; a server set up with `qlora-pipeline setup` already has it
            _warn_unnamed_host()
        check_runs_dir(config.runs_dir)  # before a server starts: the quickest way to say it
        with _server():
            summary = _start(qlora_pipeline, config)
    except NotServed as exc:  # the flow run ended Failed for it, its summary whole
        summary = exc.summary
    except UserError as exc:
        return _user_error(str(exc))
    except TerminationSignal:  # cancelled from the UI or the API (flows/cancellation.py): ended Cancelled
        _cancelled("run it again to resume (training from its latest complete checkpoint)")
    except RuntimeError as exc:
        if _SERVER_TIMEOUT not in str(exc):
            raise
        limit = os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]
        print("\n" + textwrap.fill(
            f"error: Prefect's temporary API server did not start within {limit} s, twice (a busy machine, or many "
            "runs starting at once); the pipeline did not run. Raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, "
            "or start one server (prefect server start) and point every run at it with PREFECT_API_URL.", width=100),
            file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    return _serving_exit(summary.get("serving"))


def _serving_exit(serving: dict[str, Any] | None) -> int:
    """3 when serve.url's server was not brought to serve the champion, else 0 (also without serve.url)."""
    from tasks.reporting.artifacts import NOT_UPDATED

    return SERVING_NOT_UPDATED_EXIT if serving and serving["status"] == NOT_UPDATED else 0


def _warn_unnamed_host() -> None:
    """Say so where the server has named GPU hosts and this process has no QLORA_HOST: its training takes the
    unnamed pool, which does not count what the named hosts' runs hold on these same GPUs."""
    from prefect import get_client

    from deployments.setup import WORK_POOL
    from tasks.pool.hosts import HOST_VARIABLE, hosts_of, this_host

    if this_host() is not None:
        return
    with get_client(sync_client=True) as client:
        hosts = hosts_of(client, WORK_POOL)
    if hosts:
        print(textwrap.fill(
            f"warning: this server has GPU hosts ({', '.join(hosts)}) but {HOST_VARIABLE} is not set here, so this "
            f"run takes the unnamed GPU pool, which does not count the runs of those hosts. On one of them, set "
            f"{HOST_VARIABLE} to its name (as its worker has it).", width=100), file=sys.stderr)


def _server() -> Any:
    """The Prefect server this process's runs go to: the shared one (PREFECT_API_URL), else one it serves itself
    from a thread (deployments/temporary_server.py: it lives exactly as long as this process)."""
    from deployments.temporary_server import temporary_server
    from tasks.pool.leases import uses_server

    return nullcontext() if uses_server() else temporary_server(
        float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))


def _stop_on_sigterm(again: str) -> None:
    """SIGTERM (systemd, Kubernetes, a pre-empted node, kill) ends this process with 128 + 15. While a flow runs,
    Prefect's own handler takes the signal: its flow engine records the run Crashed and runs the hooks, then passes
    the signal on here. `again`: how to resume, for the message."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: _stopped(signum, again))


def _stopped(signum: int, again: str) -> NoReturn:
    """Say how the run ended and end the process now, without unwinding further. By now the flow function has
    unwound (its slots and stage locks released); what is left are a sweep's trainings in threads, which a signal
    cannot stop: unwinding would close the flow's API client under them (tracebacks, task runs turned Failed after
    the crash hook ended them Crashed) and a waiting interpreter would keep them going for minutes. Child
    processes follow their parent (tasks/train_adapter/launch.py), the temporary server is a thread of this
    process, and slots still held by those threads lapse within a lease."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):  # the crash's log lines and events, while the server is there
        worker.drain_all(timeout=5)
    sys.stdout.flush()
    print("\n" + textwrap.fill(
        f"stopped: the run got {signal.Signals(signum).name} and ended as Crashed (its run-failure artifact says "
        f"during which stage). Finished stages keep their folders; {again}.", width=100), file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _cancelled(again: str) -> NoReturn:
    """A run cancelled from the UI or the API while this command ran it (flows/cancellation.py stopped it with a
    SIGTERM that Prefect's engine took for a cancellation): say so and end as _stopped does, with 128 + 15."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=5)
    sys.stdout.flush()
    print("\n" + textwrap.fill(f"cancelled: the run was cancelled (from the Prefect UI or its API) and ended as "
                               f"Cancelled. Finished stages keep their folders; {again}.", width=100),
          file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGTERM)


def _start(flow: Any, config: Any) -> Any:
    """Run the flow; if Prefect's temporary server timed out starting, say so and try once more."""
    try:
        return flow(config=config)
    except RuntimeError as exc:
        if _SERVER_TIMEOUT not in str(exc):
            raise
        print("Prefect's temporary API server did not start in time; trying once more", file=sys.stderr)
        return flow(config=config)


def _sweep(config: Any, grid_file: Path, as_json: bool) -> int:
    """Run the qlora-sweep flow here; print the ranking, also when a candidate failed (then exit non-zero)."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    from prefect.exceptions import TerminationSignal

    from deployments.setup import ensure_gpu_limit
    from flows.qlora_sweep import qlora_sweep
    from tasks.errors import UserError
    from tasks.log import log_user_errors_once, quiet_user_errors
    from tasks.on_disk.folders import check_runs_dir
    from tasks.pool.leases import uses_server
    from tasks.reporting.artifacts import NotServed
    from tasks.sweep.grid import expand, load_grid

    quiet_user_errors()
    log_user_errors_once(printed_by_caller=True)  # _user_error prints it, last
    _stop_on_sigterm("run the same sweep again to resume (finished candidates are reused)")
    try:
        grid, candidates = load_grid(grid_file)
        plan = expand(config, grid, candidates)  # before a server starts: the quickest way to say it
        if gpus := [f"candidate {c.name} ({c.label}): {p}" for c in plan.candidates if (p := _gpus_problem(c.config))]:
            raise UserError(" ".join(gpus))
        check_runs_dir(config.runs_dir)
        if uses_server():
            ensure_gpu_limit()
            _warn_unnamed_host()
        with _server():
            state = qlora_sweep(config=config, grid=grid, candidates=candidates, return_state=True)
            outcome = state.result(raise_on_failure=False)  # the summary, or what failed it
    except UserError as exc:
        return _user_error(str(exc))
    except TerminationSignal:  # cancelled from the UI or the API (flows/cancellation.py): ended Cancelled
        _cancelled("run the same sweep again to resume (finished candidates are reused)")
    except RuntimeError as exc:
        if _SERVER_TIMEOUT not in str(exc):
            raise
        return _user_error(f"Prefect's temporary API server did not start in time ({exc}); start one server "
                           "(prefect server start) and point runs at it with PREFECT_API_URL")
    not_served = isinstance(outcome, NotServed)  # Failed, the sweep's summary whole
    summary = outcome.summary if not_served else outcome if state.is_completed() else _sweep_record(plan.dir, state)
    if summary is not None and as_json:
        print(json.dumps(summary))
    elif summary is not None:
        _print_sweep(summary)
    if state.is_completed() or not_served:
        return _serving_exit(summary.get("serving"))
    if isinstance(outcome, UserError):
        return _user_error(str(outcome))
    print(f"\nerror: {state.message}", file=sys.stderr)
    return 1


def _sweep_record(folder: Path, state: Any) -> dict[str, Any] | None:
    """sweep.json when this flow run wrote it (it failed after ranking), else None."""
    try:
        record = json.loads((folder / "sweep.json").read_text())
    except FileNotFoundError:
        return None
    return record if str(record.get("flow_run") or "").startswith(str(state.state_details.flow_run_id)) else None


def _print_sweep(summary: dict[str, Any]) -> None:
    print(f"\nsweep {summary['key']}: {len(summary['candidates'])} candidate(s), winner {summary['winner'] or 'none'}")
    print(f"{'rank':5} {'candidate':10} {'status':9} {'tuned eval loss':16} overrides")
    for c in summary["candidates"]:
        loss = c["metrics"].get("tuned_eval_loss")
        status = "reused" if c["status"] == "finished" and _reused(c, summary["flow_run"]) else c["status"]
        print(f"{c['rank'] or '-'!s:5} {c['name']:10} {status:9} {'n/a' if loss is None else f'{loss:.4f}':16} "
              + ", ".join(f"{k}={json.dumps(v)}" for k, v in c["overrides"].items()))
        if c["error"]:
            print(textwrap.indent(textwrap.fill(c["error"], width=94), "      "))
    if "export" in summary:
        e = summary["export"]
        print(f"\nwinner published as {e['export_name']} {e['export_version']} ({e['promotion']}: "
              f"{e['promotion_reason']})\nchampion now: {e['champion_version'] or 'none'}; this version: "
              f"{e['export_path']}")
        print(f"winner config: {summary['sweep_dir']}/winner.yaml")
    if summary.get("serving"):
        print(f"serving (vLLM at {summary['serving']['url']}): {summary['serving']['message']}")
    print(f"comparison: {summary['sweep_dir']}/comparison.png and sweep.json")


def _reused(candidate: dict[str, Any], flow_run: str | None) -> bool:
    """True when neither the candidate's training nor its evaluation was computed by this sweep's flow run."""
    from tasks.on_disk.manifest import read_manifest

    folders = [candidate["adapter_dir"], candidate["eval_dir"]]
    manifests = [read_manifest(Path(folder)) for folder in folders if folder]
    return len(manifests) == 2 and all(m is not None and m.run_attempt != flow_run for m in manifests)


def _user_error(message: str) -> int:
    # paths stay whole, so they can be copied from the terminal
    print("\n" + textwrap.fill(f"error: {message}", width=100, break_on_hyphens=False, break_long_words=False),
          file=sys.stderr)
    return USER_ERROR_EXIT


def _history(name: str | None, runs_dir: Path | None) -> int:
    """Print the registry-history table (the same as the run artifact) of one exports registry, after repairing its
    damaged records (the registry's heal, which says each repair on stderr); a record nothing can restore is the one
    paragraph, after the table."""
    from pydantic import ValidationError

    from tasks.config import ExportArgs, RunConfig
    from tasks.errors import UserError
    from tasks.log import warnings_to_terminal
    from tasks.registry import store as registry
    from tasks.reporting.artifacts import history_markdown

    try:  # validated as export.name is: '..', '/etc' or 'a/b' would read outside runs_dir/exports
        name = ExportArgs(name=name).name if name is not None else ExportArgs().name
    except ValidationError as exc:
        why = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        return _user_error(f"--export-name {name!r}: {why}. Give the export.name of the runs.")
    root = registry.registry_dir(runs_dir or RunConfig().runs_dir, name)
    if not root.is_dir():
        return _user_error(f"no exports registry {name!r} at {root}: give --runs-dir (the runs_dir of the runs) and "
                           "--export-name (their export.name).")
    problem = ""
    try:
        with warnings_to_terminal():  # each repair, said once by the registry itself
            registry.heal(root)
    except UserError as exc:
        problem = str(exc)
    except OSError as exc:  # a registry this user may read but not write
        problem = (f"the exports registry {name} has damaged records, and repairing them failed: {exc}. Run this "
                   "command (or the pipeline) as a user who can write to it.")
    print(f"registry {name} ({root})\n")
    print(history_markdown(registry.history(root)), end="")
    return _user_error(problem) if problem else 0


def _promote(config: Any, name: str, version: str) -> int:
    """Make `version` the champion of registry `name`, then serve it as a run would (serve.url); exit 3, as a run
    does, when the server was not updated (the registry was)."""
    from tasks.errors import UserError
    from tasks.export_adapter import serving
    from tasks.log import warnings_to_terminal
    from tasks.registry import store as registry

    root = registry.registry_dir(config.runs_dir, name)
    if not root.is_dir():
        return _user_error(f"no exports registry {name!r} at {root}: give the runs_dir of its runs (--set "
                           "runs_dir=DIR or --config) and the registry's name (their export.name).")
    try:
        with warnings_to_terminal():  # each repair of the registry, said once by the registry itself
            record = registry.promote(root, version)
    except UserError as exc:  # a record nothing can restore: which version is which would be a guess
        return _user_error(f"{exc} The champion was not changed.")
    except ValueError as exc:
        return _user_error(f"{exc}; nothing was changed.")
    print(f"registry {name}: champion now {record['version']} ({root / record['version']})")
    if config.serve.url is None:
        print("serving: no serve.url given, so no server was updated")
        return 0
    with warnings_to_terminal():
        outcome = serving.sync(config.serve, name, config.runs_dir)
    print(f"serving (vLLM at {config.serve.url}): {outcome['message']}")
    return _serving_exit(outcome)


def _print_summary(summary: dict[str, Any]) -> None:
    from tasks import methods

    print("\nstage              status    folder")
    for stage, info in summary["stages"].items():
        resumed = info["status"] == "resumed" and "resumed_from_step" in info
        status = info["status"] + (f" from step {info['resumed_from_step']}" if resumed else "")
        print(f"{stage:18} {status:9} {info['dir']}")
    m, method = summary["metrics"], methods.method(summary.get("method", methods.METHODS[0].name))
    perplexity = (f"; perplexity {m['base_perplexity']:.2f} -> {m['tuned_perplexity']:.2f}"
                  if m.get("tuned_perplexity") is not None else "")
    print(f"\neval loss: base {m['base_eval_loss']:.4f} -> tuned {m['tuned_eval_loss']:.4f} "
          f"({100 * m['relative_improvement']:.1f}% lower){perplexity}")
    if method.measure != methods.LOSS:  # what the promotion gate compares, with what the method shows beside it
        print(_method_line(method, m))
    if m.get("tuned_rouge_l") is not None:
        print(f"greedy answers ({m['generation_samples']}): exact match {m['base_exact_match']:.3f} -> "
              f"{m['tuned_exact_match']:.3f}, ROUGE-L {m['base_rouge_l']:.3f} -> {m['tuned_rouge_l']:.3f}")
    if m.get("judged_against"):
        measure = method.measure
        print(f"champion {m['judged_against']} on the same eval data: eval loss {m['champion_eval_loss']:.4f}"
              + (f", ROUGE-L {m['champion_rouge_l']:.3f}" if m.get("champion_rouge_l") is not None else "")
              + (f", {measure.label} {m[f'champion_{measure.key}']:.3f} (tuned {m[f'tuned_{measure.key}']:.3f})"
                 if measure != methods.LOSS and m.get(f"champion_{measure.key}") is not None else ""))
    for line in _answers_lines(m):
        print(line)
    if "promotion" in m:
        print(f"export {m['export_version']} (published {m['export_published']}) {m['promotion']}"
              f"{' by the ' + m['gate_rule'] + ' rule' if m.get('gate_rule') else ''}: "
              f"{m['promotion_reason']}\nchampion now: {m['champion_version'] or 'none'}; this version: "
              f"{m['export_path']}")
    _print_tracking(summary.get("tracking"))
    if summary.get("serving"):
        print(f"serving (vLLM at {summary['serving']['url']}): {summary['serving']['message']}")
    print(f"adapter: {summary['export_dir']}\nrun record: {summary['run_dir']}/run.json")


def _answers_lines(m: dict[str, Any]) -> list[str]:
    """The regression suites (base -> tuned, and the champion's) and the judged win rate, when the run had them."""
    lines = []
    for name, suite in (m.get("suites") or {}).items():
        champion = (m.get("champion_suites") or {}).get(name)
        lines.append(f"suite {name} ({suite['metric']}, tolerance {suite['tolerance']:g}): base "
                     f"{_three((m.get('base_suites') or {}).get(name))} -> tuned "
                     f"{_three((m.get('tuned_suites') or {}).get(name))}"
                     + (f"; champion {m.get('judged_against')} {_three(champion)}" if champion is not None else ""))
    judge = m.get("judge") or {}
    if judge.get("status") == "judged":
        lines.append(f"judge {judge['model']} against {judge['against']}: win rate {judge['win_rate']:.3f} over "
                     f"{judge['prompts']} prompts in both orders ({judge['wins']} won, {judge['ties']} tied, "
                     f"{judge['losses']} lost, {judge['unparseable']} unparseable), {judge['confidence']:.0%} lower "
                     f"bound {judge['lower_bound']:.3f} (needed {judge['min_win_rate']:g})")
    elif judge:
        lines.append(f"judge {judge.get('model')}: no verdict ({judge.get('reason')})")
    return lines


def _method_line(method: Any, m: dict[str, Any]) -> str:
    """The numbers the method shows beside the loss (tasks/methods.py), base -> tuned, its gate measure first; a
    number per name (a reward per function) in brackets."""
    measure, parts = method.measure, []
    for label, key in method.shown:
        base, tuned = m.get(f"base_{key}"), m.get(f"tuned_{key}")
        if isinstance(tuned, dict):
            parts.append("(" + ", ".join(f"{name} {(base or {}).get(name)} -> {v}" for name, v in tuned.items()) + ")")
        elif key == measure.key:
            parts.insert(0, f"{label} ({m.get(measure.count)} {measure.noun}): base {_three(base)} -> tuned "
                            f"{_three(tuned)}")
        elif tuned is not None:
            parts.append(f"{label} {_three(base)} -> {_three(tuned)}")
    return "; ".join(parts)


def _three(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _print_tracking(done: dict[str, dict[str, str]] | None) -> None:
    """Where the run is tracked, per backend (or that it is not, or what a backend did not take)."""
    if not done:
        print("tracking: off (track.backend is empty)")
    for name, ref in (done or {}).items():
        if ref.get("reason"):  # tasks.reporting.tracking.NOT_SENT
            print(f"tracking: {name} at {ref['tracking_uri']}: not sent ({ref['reason']}); the run's files keep it "
                  "and the next run that reaches the server sends it")
            continue
        where = ref.get("url") or ref.get("log_dir") or f"{ref.get('tracking_uri')} run {ref.get('run_id')}"
        sent = f"; {ref['steps_sent']} training steps it lacked sent now" if ref.get("steps_sent") else ""
        print(f"tracked in {name}: {where} (logged {ref['logged']}{sent})"
              + (f"; model {ref['registered']}" if ref.get("registered") else ""))


if __name__ == "__main__":
    sys.exit(main())
