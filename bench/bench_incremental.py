"""prepare_data on a growing folder of shards: a full preparation, then one new shard, side by side in one run.

    python bench/bench_incremental.py [--rows 1000000] [--shards 100] [--tokenizer DIR] [--max-seq-length 256]

Generates --rows instruction-like dolly records (cycled from the embedded sample, each made unique) in --shards
JSON-lines files, then, each in a fresh process (as a nightly run is: no hash memo, no warm tokenizer), times
prepare_data through .fn():
  full          all shards into an empty runs_dir (every file tokenized into its part);
  incremental   one more shard of the same size added, same runs_dir (that shard tokenized, the others reused);
  fresh full    the grown folder into another empty runs_dir: what a night without parts would cost;
  one file      (--one-file) the grown folder's rows as one file, prepared in one pass without parts: what
                the parts cost a full preparation (their write and read back).
Prints the three side by side, the incremental run's share of the fresh full one (the aim: 10% at
most), whether its train.parquet and eval.parquet equal the fresh full preparation's row for row and byte for
byte, and writes the figures to bench/results/<date>-incremental-<host>.json. Not a test: times depend on the
machine; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.config import EMBEDDED_DATA, EMBEDDED_MODEL, PROJECT_ROOT  # noqa: E402

RESULTS = PROJECT_ROOT / "bench" / "results"


def write_shards(folder: Path, first_shard: int, shards: int, rows_per_shard: int) -> int:
    """Shards first_shard.. of rows_per_shard unique dolly records each; returns the bytes written."""
    seed = [json.loads(line) for line in EMBEDDED_DATA.read_text().splitlines() if line.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for shard in range(first_shard, first_shard + shards):
        lines = []
        for i in range(shard * rows_per_shard, (shard + 1) * rows_per_shard):
            r = seed[i % len(seed)]
            lines.append(json.dumps({"instruction": f"{r['instruction']} (case {i})", "context": r.get("context", ""),
                                     "response": f"{r['response']} (see case {i})"}) + "\n")
        path = folder / f"shard-{shard:05d}.jsonl"
        path.write_text("".join(lines))
        written += path.stat().st_size
    return written


def child(source: str, runs: str, tokenizer: str, max_len: int) -> None:
    """One preparation in this (fresh) process; prints its seconds and metrics as JSON."""
    from tasks.config import DataArgs, ModelArgs
    from tasks.prepare_data.stage import prepare_data

    start = time.perf_counter()
    folder = prepare_data.fn(DataArgs(source=source, max_seq_length=max_len), ModelArgs(base_model=tokenizer),
                             Path(runs))
    seconds = time.perf_counter() - start
    metrics = json.loads((Path(folder) / "manifest.json").read_text())["metrics"]
    print(json.dumps({"seconds": round(seconds, 2), "dir": folder, "metrics": metrics}))


def prepare(source: Path, runs: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", str(source), str(runs), "--tokenizer", args.tokenizer,
                           "--max-seq-length", str(args.max_seq_length)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(a: str, b: str) -> dict[str, dict[str, bool]]:
    import pyarrow.parquet as pq

    return {name: {"rows": pq.read_table(Path(a) / name).equals(pq.read_table(Path(b) / name)),
                   "bytes": (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes()}
            for name in ("train.parquet", "eval.parquet")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--tokenizer", default=str(EMBEDDED_MODEL), help="a local model folder with a tokenizer")
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--one-file", action="store_true", help="also time the rows as one file, without parts")
    parser.add_argument("--child", nargs=2, metavar=("SOURCE", "RUNS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.tokenizer, args.max_seq_length)
    per_shard = args.rows // args.shards
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        size = write_shards(folder, 0, args.shards, per_shard)
        cores = len(os.sched_getaffinity(0))
        print(f"{args.shards} shards x {per_shard:,} rows ({size / 2**20:,.0f} MiB), tokenizer {args.tokenizer}, "
              f"max_seq_length {args.max_seq_length}; {cores} cores {platform.machine()}, {platform.node()}")
        full = prepare(folder, Path(tmp) / "runs", args)
        write_shards(folder, args.shards, 1, per_shard)
        incremental = prepare(folder, Path(tmp) / "runs", args)
        fresh = prepare(folder, Path(tmp) / "fresh-runs", args)
        runs = [("full", "full", full), ("incremental", "incremental (+1 shard)", incremental),
                ("fresh_full", "fresh full", fresh)]
        if args.one_file:
            whole = Path(tmp) / "one.jsonl"
            with whole.open("wb") as out:
                for shard in sorted(folder.iterdir()):
                    out.write(shard.read_bytes())
            runs.append(("one_file", "one file, no parts", prepare(whole, Path(tmp) / "one-runs", args)))
        for _, label, run in runs:
            m = run["metrics"]
            print(f"{label:<24}{run['seconds']:9.2f} s  {m['rows_in']:>11,} rows  {m['tokens']:>13,} tokens  "
                  f"files tokenized/reused {m.get('parts_tokenized', '-')}/{m.get('parts_reused', '-')}")
        share = incremental["seconds"] / fresh["seconds"]
        equal = same(incremental["dir"], fresh["dir"])
        print(f"incremental / fresh full: {share:.1%} (target: 10% at most)")
        print("incremental output == fresh full: " + ", ".join(
            f"{n} rows {'equal' if e['rows'] else 'DIFFER'}, bytes {'equal' if e['bytes'] else 'DIFFER'}"
            for n, e in equal.items()))
        record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
                  "cores": cores, "rows": args.rows, "shards": args.shards, "rows_per_shard": per_shard,
                  "source_mib": round(size / 2**20, 1), "max_seq_length": args.max_seq_length,
                  "seconds": {key: run["seconds"] for key, _, run in runs},
                  "incremental_share_of_fresh_full": round(share, 4), "equal_to_fresh_full": equal,
                  "metrics": {"full": full["metrics"], "incremental": incremental["metrics"]}}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{time.strftime('%Y-%m-%d', time.gmtime())}-incremental-{args.rows}-{platform.node()}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written {out.relative_to(PROJECT_ROOT)}")


if __name__ == "__main__":
    main()
