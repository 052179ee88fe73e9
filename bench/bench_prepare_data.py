"""prepare_data against a plain `datasets.map(tokenizer, batched=True)` on the same file, in one run.

    python bench/bench_prepare_data.py [--rows 200000] [--seed-file F.jsonl | --source F.jsonl] [--tokenizer DIR]

Writes a dolly-format JSON-lines file of --rows records (cycled from --seed-file: the embedded sample by default,
or Dolly's open_qa records from bench/dolly_open_qa.py; each made unique), then, after both sides'
imports and a tokenizer load (so neither pays them), times:
  prepare_data   the stage through .fn(): read, format, tokenize on all cores, split, write Parquet;
  baseline       load_dataset("json") + .map(tokenizer, batched=True) on the same prompt+response text
                 (datasets' defaults: one process; the fast tokenizer's own threads), fresh cache.
Prints tokens/s of each side by side, their ratio, and peak RSS. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.config import EMBEDDED_DATA, EMBEDDED_MODEL, DataArgs, ModelArgs  # noqa: E402
from tasks.prepare_data.formats import CONTEXT_TEMPLATE, INSTRUCTION_TEMPLATE, RESPONSE_HEADER  # noqa: E402


def make_file(path: Path, rows: int, seed_file: Path) -> Path:
    """`rows` unique dolly records, cycled from seed_file's."""
    records = [json.loads(line) for line in seed_file.read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        for i in range(rows):
            r = records[i % len(records)]
            f.write(json.dumps({"instruction": f"{r['instruction']} (#{i})", "context": r.get("context", ""),
                                "response": r["response"]}) + "\n")
    return path


class PeakMemory:
    """Samples the RSS of this process and of its worker processes every 50 ms (psutil), keeping the peaks."""

    def __init__(self) -> None:
        import psutil

        self.me, self.peak_main, self.peak_total, self.peak_worker = psutil.Process(), 0, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        while not self.stop.wait(0.05):
            main, workers = self.me.memory_info().rss, []
            for child in self.me.children(recursive=True):
                try:
                    workers.append(child.memory_info().rss)
                except psutil.Error:
                    pass
            self.peak_main = max(self.peak_main, main)
            self.peak_worker = max(self.peak_worker, *workers, 0)
            self.peak_total = max(self.peak_total, main + sum(workers))

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def __str__(self) -> str:
        mib = 2**20
        return (f"peak RSS {self.peak_total / mib:,.0f} MiB in all ({self.peak_main / mib:,.0f} main, "
                f"{self.peak_worker / mib:,.0f} largest worker)")


def run_prepare_data(source: Path, tokenizer_dir: str, max_len: int, runs: Path) -> tuple[float, int, dict]:
    from tasks.prepare_data.stage import prepare_data

    start = time.perf_counter()
    folder = prepare_data.fn(DataArgs(source=str(source), max_seq_length=max_len),
                             ModelArgs(base_model=tokenizer_dir), runs)
    seconds = time.perf_counter() - start
    metrics = json.loads((Path(folder) / "manifest.json").read_text())["metrics"]
    return seconds, metrics["tokens"], metrics


def run_baseline(source: Path, tokenizer_dir: str, max_len: int, cache: Path) -> tuple[float, int]:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def tokenize(batch: dict) -> dict:
        texts = [INSTRUCTION_TEMPLATE.format(instruction=i) + (CONTEXT_TEMPLATE.format(context=c) if c else "")
                 + RESPONSE_HEADER + r for i, c, r in zip(batch["instruction"], batch["context"], batch["response"],
                                                          strict=True)]
        return tokenizer(texts, truncation=True, max_length=max_len)

    start = time.perf_counter()
    dataset = load_dataset("json", data_files=str(source), split="train", cache_dir=str(cache))
    dataset = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for batch in dataset.iter(batch_size=10_000) for ids in batch["input_ids"])
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--source", type=Path, help="an existing dolly-format .jsonl (default: generate one)")
    parser.add_argument("--seed-file", type=Path, default=EMBEDDED_DATA,
                        help="dolly-format records to cycle through when generating the file")
    parser.add_argument("--tokenizer", default=str(EMBEDDED_MODEL), help="a local model folder with a tokenizer")
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--skip-baseline", action="store_true", help="only prepare_data (e.g. for peak RSS)")
    parser.add_argument("--no-pool", action="store_true", help="tokenize in the main process only (rayon threads)")
    args = parser.parse_args()
    if args.no_pool:
        import tasks.data_tokenize

        tasks.data_tokenize.POOL_AFTER_CHUNKS = 10**9
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source or make_file(Path(tmp) / "bench.jsonl", args.rows, args.seed_file)
        # warm-up on 100 rows: imports and the tokenizer's first load are paid before the clock starts
        run_prepare_data(make_file(Path(tmp) / "warm.jsonl", 100, args.seed_file), args.tokenizer,
                         args.max_seq_length, Path(tmp) / "warm")
        print(f"file {source} ({source.stat().st_size / 2**20:.0f} MiB, from {args.seed_file.name}), tokenizer "
              f"{args.tokenizer}, max_seq_length {args.max_seq_length}; {len(os.sched_getaffinity(0))} cores "
              f"{platform.machine()}; main RSS before {PeakMemory().me.memory_info().rss / 2**20:,.0f} MiB")
        with PeakMemory() as memory:
            seconds, tokens, metrics = run_prepare_data(source, args.tokenizer, args.max_seq_length, Path(tmp) / "runs")
        ours = tokens / seconds
        label = "prepare_data (no pool)" if args.no_pool else "prepare_data"
        print(f"{label:<22}{seconds:8.2f} s  {tokens:>12,} tokens  {ours:>12,.0f} tokens/s  "
              f"({metrics['rows_out']:,} examples; {memory})")
        if args.skip_baseline:
            return
        import datasets
        import tokenizers
        import transformers

        AutoTokenizer = transformers.AutoTokenizer  # noqa: N806
        AutoTokenizer.from_pretrained(args.tokenizer)  # the baseline's imports and first load, off the clock
        print(f"datasets {datasets.__version__}, transformers {transformers.__version__}, "
              f"tokenizers {tokenizers.__version__}")
        seconds, tokens = run_baseline(source, args.tokenizer, args.max_seq_length, Path(tmp) / "hf-cache")
        base = tokens / seconds
        print(f"{'datasets.map':<22}{seconds:8.2f} s  {tokens:>12,} tokens  {base:>12,.0f} tokens/s")
        print(f"{'speed-up':<22}{ours / base:8.2f}x")


if __name__ == "__main__":
    main()
