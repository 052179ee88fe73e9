"""A benchmark's tools each in a process of its own (so that each one's GPU memory figures are its own): the script
runs itself with --worker KIND --spec FILE, and its worker prints one `RESULT {json}` line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_worker(script: str, kind: str, spec: dict[str, Any], log: Path, timeout: int) -> dict[str, Any]:
    """Run `script`'s worker `kind` on `spec`; its RESULT with the process's seconds, or {"error", "log_tail"}. The
    worker's whole output goes to `log`."""
    spec_file = log.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, script, "--worker", kind, "--spec", str(spec_file)]
    t = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {timeout} s", "log_tail": str(exc.stdout or "")[-2000:]}
    log.write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    return {**json.loads(lines[-1][len("RESULT "):]), "process_s": round(time.time() - t, 1)}
