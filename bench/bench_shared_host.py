"""Runs that share a host: four default `qlora-pipeline run`s at once against one alone and four in sequence.

    python bench/bench_shared_host.py [--runs 4] [--set SECTION.FIELD=VALUE ...] [--out bench/results/DATE-....json]

One Prefect server for all of them (`prefect server start` on a free localhost port, SQLite in a temporary
PREFECT_HOME, set up with `qlora-pipeline setup`: on a machine without GPUs the pool is one slot, so trainings
take turns, and `qlora-cpu` counts the runs computing), every run pointed at it with PREFECT_API_URL and given a
runs_dir of its own (nothing is shared or cached between runs). Times, per scenario (in this order, each
written to --out as soon as it is measured):
  concurrent  --runs runs started at once;
  alone       one run;
  sequential  --runs runs, one after another.
Wall time, and total CPU time (user + sys) of the runs' processes and everything they started (their torchrun
ranks, tokenizer workers), from os.wait4; the server's own CPU time beside it. The aim: concurrent wall
at most about runs x alone, concurrent CPU no more than sequential. Not a test: figures depend on the machine.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """user + sys of a live process and its reaped children (psutil)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def start_runs(count: int, env: dict[str, str], work: Path, name: str, overrides: list[str]
               ) -> list[subprocess.Popen]:
    procs = []
    for i in range(count):
        runs_dir = work / f"{name}-{i}"
        log = (work / f"{name}-{i}.log").open("w")
        sets = [a for o in [f"runs_dir={runs_dir}", *overrides] for a in ("--set", o)]
        procs.append(subprocess.Popen([sys.executable, "-m", "deployments.cli", "run", "--json", *sets], cwd=ROOT,
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen]) -> float:
    """Wait for every run; their CPU seconds (user + sys, descendants included). Fails on a failed run."""
    total = 0.0
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"a run failed (exit {proc.returncode}): {' '.join(map(str, proc.args))}; its log is "
                             "beside its runs_dir")
        total += usage.ru_utime + usage.ru_stime
    return total


def scenario(name: str, count: int, at_once: bool, env: dict[str, str], work: Path, server: int,
             overrides: list[str]) -> dict:
    server_before, start = cpu_seconds(server), time.monotonic()
    cpu = 0.0
    if at_once:
        cpu = wait_all(start_runs(count, env, work, name, overrides))
    else:
        for i in range(count):
            cpu += wait_all(start_runs(1, env, work, f"{name}{i}", overrides))
    wall = time.monotonic() - start
    result = {"runs": count, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "server_cpu_s": round(cpu_seconds(server) - server_before, 1),
              "load_average_after": [round(x, 1) for x in os.getloadavg()]}  # other work on the host shows here
    print(f"{name:11} {count} run(s): wall {wall:7.1f} s   CPU {cpu:7.1f} s   server CPU "
          f"{result['server_cpu_s']:6.1f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="passed to every run (default: none, the default run)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        f"{datetime.now(UTC):%Y-%m-%d}-cpu-shared-host.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-shared-host-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "QLORA_CPU_THREADS", "OMP_"))}
    env.update(PREFECT_HOME=str(work / "prefect"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=(work / "server.log").open("w"), stderr=subprocess.STDOUT)
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
        print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; logs in {work}", flush=True)
        record = {"command": " ".join(["python", *sys.argv]), "date": datetime.now(UTC).isoformat(),
                  "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                              "python": platform.python_version(), "load_average_before": os.getloadavg()[0]},
                  "server": "one shared `prefect server start` (SQLite), set up by `qlora-pipeline setup`",
                  "overrides": args.overrides}
        # the most telling pair first, each written as soon as measured (a long bench may be stopped)
        for name, count, at_once in (("concurrent", args.runs, True), ("alone", 1, False),
                                     ("sequential", args.runs, False)):
            record[name] = scenario(name, count, at_once, env, work, server.pid, args.overrides)
            args.out.write_text(json.dumps(record, indent=2) + "\n")
    finally:
        server.terminate()
        server.wait(60)
    alone, seq, conc = record["alone"], record["sequential"], record["concurrent"]
    record |= {"concurrent_wall_over_alone": round(conc["wall_s"] / alone["wall_s"], 2),
               "concurrent_cpu_over_sequential": round(conc["cpu_s"] / seq["cpu_s"], 2)}
    print(f"concurrent wall / alone: {record['concurrent_wall_over_alone']}x (target <= about {args.runs}x); "
          f"concurrent CPU / sequential: {record['concurrent_cpu_over_sequential']}x (target <= 1)")
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
