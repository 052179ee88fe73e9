"""sha256 of a few large files: one after another as before (hashlib.file_digest, one thread) against
tasks.hashing.files.files_sha256 (one file per thread), and a memoised second look from runs_dir. With --contended,
both also beside a thread that runs Python the whole time (as prepare_data's imports run beside the flow's prefetch of
the base model's hashes), which is where file_digest's 256 KiB reads wait for the GIL.

    python bench/bench_hashing.py --files 4 --mib 768 --threads 2 [--contended]

The files are written into a temporary folder (--dir, default /tmp) and deleted afterwards. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tasks.hashing import files as file_hashes
from tasks.log import logger


def _sequential(paths: list[Path]) -> dict[Path, str]:
    """How file_sha256 hashed before: one file after another, hashlib.file_digest's 256 KiB reads."""
    found = {}
    for path in paths:
        with path.open("rb") as f:
            found[path] = hashlib.file_digest(f, "sha256").hexdigest()
    return found


def _timed(fn, *args):  # noqa: ANN001, ANN202 - a bench helper
    started = time.perf_counter()
    result = fn(*args)
    return result, round(time.perf_counter() - started, 3)


def _memoised_in_a_new_process(paths: list[Path], runs_dir: Path) -> float:
    code = ("import sys, time; from pathlib import Path; from tasks.hashing.files import files_fingerprint; "
            "t = time.perf_counter(); files_fingerprint([Path(p) for p in sys.argv[2:]], runs_dir=Path(sys.argv[1])); "
            "print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code, str(runs_dir), *map(str, paths)], capture_output=True,
                          text=True, check=True)
    return round(float(done.stdout.strip()), 4)


class _BusyPython:
    """A thread running Python bytecode (holding the GIL but for the interpreter's switches) while the block runs."""

    def __enter__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        total = 0
        while not self.stop.is_set():
            for i in range(1000):
                total += i * i

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=768, help="size of each file")
    parser.add_argument("--threads", type=int, default=2, help="QLORA_CPU_THREADS for the parallel hashing")
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--contended", action="store_true", help="also time both beside a busy Python thread")
    args = parser.parse_args()
    os.environ["QLORA_CPU_THREADS"] = str(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bench-hashing-", dir=args.dir))
    try:
        block = os.urandom(64 << 20)
        paths = []
        for i in range(args.files):
            path = folder / f"model-{i:05d}.safetensors"
            with path.open("wb") as f:
                for _ in range(args.mib // 64):
                    f.write(block)  # the same bytes in every file: sha256's speed does not depend on them
            paths.append(path)
        gb = sum(p.stat().st_size for p in paths) / 1e9
        _sequential(paths)  # once to settle the page cache: both sides then read from memory
        logger()  # imports Prefect, as in a flow run: else its import (seconds) lands in the first timing
        before, before_s = _timed(_sequential, paths)
        file_hashes._FILE_HASH_CACHE.clear()  # nothing memoised in this process: every file read
        after, after_s = _timed(file_hashes.files_sha256, paths)
        assert after == before, "parallel hashing must give the same sha256"
        file_hashes._FILE_HASH_CACHE.clear()
        _, first_s = _timed(file_hashes.files_fingerprint, paths, None, folder / "runs")
        memo_s = _memoised_in_a_new_process(paths, folder / "runs")
        contended = {}
        if args.contended:
            with _BusyPython():
                _, contended["sequential_beside_python_s"] = _timed(_sequential, paths)
                file_hashes._FILE_HASH_CACHE.clear()
                _, contended["parallel_beside_python_s"] = _timed(file_hashes.files_sha256, paths)
        print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
                          "cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 1), "files": args.files,
                          "gb": round(gb, 2), "threads": args.threads, "sequential_s": before_s,
                          "sequential_gb_s": round(gb / before_s, 2), "parallel_s": after_s,
                          "parallel_gb_s": round(gb / after_s, 2), "first_fingerprint_s": first_s,
                          "memoised_new_process_s": memo_s, **contended}))
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
