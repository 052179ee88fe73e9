"""qlora-pipeline: the command line.

    qlora-pipeline run [--config FILE.yaml] [--preset NAME] [--set SECTION.FIELD=VALUE ...] [--json]
    qlora-pipeline validate [--config FILE.yaml] [--preset NAME] [--set ...]
    qlora-pipeline start DEPLOYMENT [--set ...] [--watch]  # a deployment run; --watch follows states and artifacts
    qlora-pipeline presets
    qlora-pipeline setup [--gpus N] [--notify-url URL]  # work pool, GPU pool (N GPUs), failure automation
    qlora-pipeline deploy [--git URL [--branch B]]  # register deployments/prefect.yaml
    qlora-pipeline worker [--pool qlora-process]    # a worker that runs flow runs in this checkout
    qlora-pipeline serve [--config FILE.yaml | --preset NAME] [--cron "0 2 * * *"] [--timezone Europe/Berlin]

User errors (bad config, missing files, bad data, unknown module names) print one paragraph and exit
with status 2; they are never retried and never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

USER_ERROR_EXIT = 2
EPHEMERAL_STARTUP_S = 120
_SERVER_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qlora-pipeline", description="QLoRA fine-tuning as a Prefect flow.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run the pipeline"), ("validate", "check a config and print it"),
                            ("start", "start a run of a deployment on the server (what the UI's Run does)")):
        cmd = sub.add_parser(name, help=help_text)
        if name == "start":
            cmd.add_argument("deployment", help="deployment name, e.g. nightly or embedded-default")
            cmd.add_argument("--watch", action="store_true", help="follow the run: states and artifact contents")
        cmd.add_argument("--config", type=Path, help="a YAML file mirroring RunConfig")
        cmd.add_argument("--preset", help="a preset from data/presets (see `qlora-pipeline presets`)")
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                         help="override one field; repeatable (values are parsed as YAML)")
        if name == "run":
            cmd.add_argument("--json", action="store_true", help="print the run summary as JSON, last line")
    sub.add_parser("presets", help="list the presets")
    setup = sub.add_parser("setup", help="create the work pool, the GPU concurrency limit and the failure automation")
    setup.add_argument("--notify-url", help="webhook URL to POST to when a flow run fails")
    setup.add_argument("--gpus", type=int, help="GPUs of the worker for the GPU pool (default: those visible here, "
                       "CUDA_VISIBLE_DEVICES honoured; 0: one slot, one training at a time)")
    deploy = sub.add_parser("deploy", help="register the deployments in deployments/prefect.yaml")
    deploy.add_argument("--git", metavar="URL", help="flow runs clone this repository instead of running in the "
                        "worker's checkout (the worker's directory)")
    deploy.add_argument("--branch", help="with --git: the branch or tag to clone")
    worker = sub.add_parser("worker", help="start a Prefect worker that runs flows in this checkout")
    worker.add_argument("--pool", default="qlora-process", help="work pool (default: qlora-process)")
    worker.add_argument("--limit", help="most flow runs at a time")
    serve = sub.add_parser("serve", help="serve the flow in this process, with its nightly schedule")
    serve.add_argument("--config", type=Path, help="a YAML file mirroring RunConfig")
    serve.add_argument("--preset", help="a preset from data/presets")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    serve.add_argument("--cron", default="0 2 * * *", help="schedule (cron syntax); '' for none")
    serve.add_argument("--timezone", default="Europe/Berlin", help="time zone of the schedule")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qlora-pipeline` command."""
    # no network here or on most workers: a temporary server must not try to phone home
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's temporary server gets 20 s to start by default; several runs starting at once on a busy 2-core
    # machine need longer (they died at 20 s: "Timed out while attempting to connect to ephemeral ...")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EPHEMERAL_STARTUP_S))
    args = _parser().parse_args(argv)
    if args.command == "worker":
        from deployments import setup

        return setup.worker(args.pool, ["--limit", args.limit] if args.limit else [])
    if args.command in ("setup", "deploy"):
        return _setup(args)
    if args.command == "presets":
        from tasks.config import PRESETS_DIR

        for path in sorted(PRESETS_DIR.glob("*.yaml")):
            print(f"{path.stem:24} {path}")
        return 0
    try:
        config = _config(args)
    except Exception as exc:  # noqa: BLE001 - every config problem is the user's to fix
        return _user_error(_config_message(exc))
    if args.command == "validate":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    if args.command == "serve":
        return _serve(config, args.cron, args.timezone)
    if args.command == "start":
        return _start_deployment(args.deployment, config, args.watch)
    return _run(config, as_json=args.json)


def _setup(args: argparse.Namespace) -> int:
    from deployments import setup
    from tasks.limits import visible_gpus

    if args.command == "deploy":
        return setup.deploy(args.git, args.branch)
    print(setup.ensure_work_pool())
    if args.gpus is not None and args.gpus < 0:
        return _user_error(f"--gpus {args.gpus}: give the number of GPUs of the worker, 0 or more.")
    print(setup.ensure_gpu_limit(args.gpus if args.gpus is not None else len(visible_gpus())))
    if args.notify_url:
        print(setup.apply_automations(args.notify_url))
    else:
        print("no --notify-url: failure automation not applied (the flow's on_failure hook still leaves a "
              "summary artifact on every failed run)")
    return 0


def _serve(config: Any, cron: str, timezone: str) -> int:
    from prefect.schedules import Cron

    from deployments.setup import ensure_gpu_limit
    from flows.qlora_pipeline import qlora_pipeline

    print(ensure_gpu_limit())
    schedules = [Cron(cron, timezone=timezone)] if cron else []
    qlora_pipeline.serve(name="served", parameters={"config": config.model_dump(mode="json")}, schedules=schedules)
    return 0


def _start_deployment(deployment: str, config: Any, follow: bool) -> int:
    from prefect.utilities.urls import url_for

    from deployments.watch import start, watch

    # only what was set: defaults (paths in the checkout among them) are the worker's own
    run = start(deployment, config.model_dump(mode="json", exclude_unset=True))
    print(f"started flow run {run.name} ({run.id}): {url_for(run, url_type='ui') or ''}".rstrip(": "))
    if not follow:
        return 0
    return 0 if watch(run.id) == "COMPLETED" else 1


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


def _config_message(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        problems = [f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                    + (f" (got {e['input']!r})" if e["type"] != "missing" else "") for e in exc.errors()]
        return (f"Invalid configuration, {len(problems)} problem(s): " + "; ".join(problems)
                + ". Fix these fields in the config file or with --set SECTION.FIELD=VALUE.")
    return f"Invalid configuration: {exc}."


def _run(config: Any, as_json: bool) -> int:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    from deployments.setup import ensure_gpu_limit
    from flows.qlora_pipeline import qlora_pipeline
    from tasks.errors import UserError
    from tasks.limits import uses_server
    from tasks.log import quiet_user_errors
    from tasks.manifest import check_runs_dir

    quiet_user_errors()
    if uses_server():
        ensure_gpu_limit()  # idempotent; a server set up with `qlora-pipeline setup` already has it
    try:
        check_runs_dir(config.runs_dir)  # before a server starts: the quickest way to say it
        summary = _start(qlora_pipeline, config)
    except UserError as exc:
        return _user_error(str(exc))
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
    return 0


def _start(flow: Any, config: Any) -> Any:
    """Run the flow; if Prefect's temporary server timed out starting, say so and try once more."""
    try:
        return flow(config=config)
    except RuntimeError as exc:
        if _SERVER_TIMEOUT not in str(exc):
            raise
        print("Prefect's temporary API server did not start in time; trying once more", file=sys.stderr)
        return flow(config=config)


def _user_error(message: str) -> int:
    print("\n" + textwrap.fill(f"error: {message}", width=100), file=sys.stderr)
    return USER_ERROR_EXIT


def _print_summary(summary: dict[str, Any]) -> None:
    print("\nstage              status    folder")
    for stage, info in summary["stages"].items():
        print(f"{stage:18} {info['status']:9} {info['dir']}")
    m = summary["metrics"]
    print(f"\neval loss: base {m['base_eval_loss']:.4f} -> tuned {m['tuned_eval_loss']:.4f} "
          f"({100 * m['relative_improvement']:.1f}% lower); perplexity {m['base_perplexity']:.2f} -> "
          f"{m['tuned_perplexity']:.2f}")
    if m.get("tuned_rouge_l") is not None:
        print(f"greedy answers ({m['generation_samples']}): exact match {m['base_exact_match']:.3f} -> "
              f"{m['tuned_exact_match']:.3f}, ROUGE-L {m['base_rouge_l']:.3f} -> {m['tuned_rouge_l']:.3f}")
    if "promotion" in m:
        print(f"export {m['export_version']} (published {m['export_published']}) {m['promotion']}: "
              f"{m['promotion_reason']}\nchampion now: {m['champion_version'] or 'none'}; this version: "
              f"{m['export_path']}")
    print(f"adapter: {summary['export_dir']}\nrun record: {summary['run_dir']}/run.json")


if __name__ == "__main__":
    sys.exit(main())
