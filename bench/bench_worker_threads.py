"""A busy host: the CPU share a run takes when a worker started it, beside the same run started in a terminal.

    python bench/bench_worker_threads.py [--load 9] [--set SECTION.FIELD=VALUE ...] [--out bench/results/....json]

The host is made busy with --load processes that spin at the lowest priority (nice 19: they raise the load average
as other work does, and yield the cores to anything else), then the same short run (--set; default 30 optimizer
steps) is started twice, one after the other, each with a runs_dir of its own:
  cli     `qlora-pipeline run` in a terminal, no PREFECT_API_URL (Prefect's temporary server in the process);
  worker  a run of a deployment, taken by `qlora-pipeline worker` of a `prefect server start` on a free localhost
          port (SQLite in a temporary PREFECT_HOME), set up with `qlora-pipeline setup`.
For each: the threads train_adapter chose and why (its log line), the training's real tokens/s and seconds
(train_adapter's manifest), the run's wall time, the load average when it started. Not a test: figures depend on the
machine and on what else it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's packages, whatever the working directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_lines(text: str) -> list[str]:
    return [line.split("train_adapter: ", 1)[1].strip() for line in text.splitlines()
            if "train_adapter: " in line and "thread(s)" in line]


def training(runs_dir: Path) -> dict:
    (folder,) = [f for f in (runs_dir / "train_adapter").iterdir() if (f / "manifest.json").is_file()]
    metrics = json.loads((folder / "manifest.json").read_text())["metrics"]
    return {"real_tokens_per_s": round(metrics["real_tokens_per_s"], 1), "train_seconds": metrics.get("train_seconds")}


def cli_run(work: Path, overrides: list[str], env: dict[str, str]) -> dict:
    runs_dir = work / "cli-runs"
    sets = [a for o in [f"runs_dir={runs_dir}", *overrides] for a in ("--set", o)]
    load, start = os.getloadavg()[0], time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "run", "--json", *sets], cwd=ROOT,
                          env={k: v for k, v in env.items() if k != "PREFECT_API_URL"}, capture_output=True, text=True)
    (work / "cli.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"the terminal's run failed (exit {done.returncode}); log: {work / 'cli.log'}")
    return {"wall_s": round(time.monotonic() - start, 1), "load_average_at_start": round(load, 1),
            "threads": thread_lines(done.stderr + done.stdout), **training(runs_dir)}


def worker_run(work: Path, overrides: list[str], deployment: str) -> dict:
    import yaml
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    runs_dir = work / "worker-runs"
    config: dict = {"runs_dir": str(runs_dir)}
    for item in overrides:
        dotted, _, value = item.partition("=")
        section, name = dotted.split(".")
        config.setdefault(section, {})[name] = yaml.safe_load(value)
    load, start = os.getloadavg()[0], time.monotonic()
    with get_client(sync_client=True) as client:
        run_id = client.create_flow_run_from_deployment(deployment, parameters={"config": config}).id
        while (state := client.read_flow_run(run_id).state) is None or not state.is_final():
            time.sleep(2)
        wall = time.monotonic() - start
        if not state.is_completed():
            raise SystemExit(f"the worker's run ended {state.name}: {state.message}")
        time.sleep(5)  # its last log lines reach the server in batches
        logs = "\n".join(log.message for log in client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[run_id]))))
    (work / "worker-run.log").write_text(logs)
    return {"wall_s": round(wall, 1), "load_average_at_start": round(load, 1), "threads": thread_lines(logs),
            **training(runs_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=9, help="spinning processes at nice 19 (default 9)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "worker-threads-cpu.json")
    args = parser.parse_args()
    overrides = args.overrides or ["train.max_steps=30", "eval.max_samples=16", "eval.generation_samples=4"]
    work = Path(tempfile.mkdtemp(prefix="bench-worker-threads-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "QLORA_CPU_THREADS", "OMP_"))}
    env.update(PREFECT_HOME=str(work / "prefect"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT))
    os.environ.update(PREFECT_API_URL=env["PREFECT_API_URL"], PREFECT_HOME=env["PREFECT_HOME"])
    procs = [subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=(work / "server.log").open("w"), stderr=subprocess.STDOUT)]
    spinners: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        subprocess.run([sys.executable, "-m", "deployments.cli", "setup"], cwd=ROOT, env=env, check=True)
        from prefect import get_client
        from prefect.utilities.callables import parameter_schema

        from flows.qlora_pipeline import qlora_pipeline

        with get_client(sync_client=True) as client:  # what `qlora-pipeline deploy` registers, for one flow
            deployment = client.create_deployment(
                client.create_flow_from_name("qlora-pipeline"), "embedded-default", work_pool_name="qlora-process",
                entrypoint="flows/qlora_pipeline.py:qlora_pipeline", parameters={"config": {}},
                parameter_openapi_schema=parameter_schema(qlora_pipeline).model_dump_for_openapi(),
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {
                    "directory": "{{ $QLORA_PIPELINE_ROOT }}"}}])
        procs.append(subprocess.Popen([sys.executable, "-m", "deployments.cli", "worker"], cwd=work, env=env,
                                      stdout=(work / "worker.log").open("w"), stderr=subprocess.STDOUT))
        spinners = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
                    for _ in range(args.load)]
        deadline = time.monotonic() + 180  # the 1-minute load average climbs
        while os.getloadavg()[0] < 0.8 * args.load and time.monotonic() < deadline:
            time.sleep(5)
        record = {"command": " ".join(["python", *sys.argv]), "date": datetime.now(UTC).isoformat(),
                  "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                              "python": platform.python_version()},
                  "load": f"{args.load} processes spinning at nice 19", "overrides": overrides}
        for name, measure in (("cli", lambda: cli_run(work, overrides, env)),
                              ("worker", lambda: worker_run(work, overrides, deployment))):
            record[name] = measure()
            print(f"{name:7} {record[name]['real_tokens_per_s']:8.1f} tokens/s, {record[name]['wall_s']:6.1f} s wall, "
                  f"load {record[name]['load_average_at_start']}: {'; '.join(record[name]['threads'])}", flush=True)
            args.out.write_text(json.dumps(record, indent=2) + "\n")
    finally:
        for proc in spinners + procs[::-1]:
            proc.terminate()
            proc.wait(60)
    print(f"wrote {args.out}; logs in {work}")


if __name__ == "__main__":
    main()
