"""Write the open_qa records of databricks-dolly-15k as JSON lines: the real data bench_job.py's whole job trains on.

    python bench/dolly_open_qa.py /tmp/dolly_open_qa.jsonl [--revision COMMIT]

Reads the hub dataset `databricks/databricks-dolly-15k` (needs network, or its snapshot in the hub cache with
HF_HUB_OFFLINE=1), keeps the `open_qa` category in the dataset's order, drops exact duplicates (3 of its 3,742
open_qa records are), and writes one `json.dumps` line per record with the keys instruction, context, response and
category: 3,739 lines, the prepare_data `dolly` format. The data is CC BY-SA 3.0 (Databricks, Inc.); nothing of it is
kept in this repository.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DATASET = "databricks/databricks-dolly-15k"
KEYS = ("instruction", "context", "response", "category")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--revision", default=None, help="the dataset's commit (default: its main branch)")
    a = ap.parse_args()
    from datasets import load_dataset

    seen: set[tuple[str, ...]] = set()
    lines = []
    for row in load_dataset(DATASET, split="train", revision=a.revision):
        record = tuple(str(row[k]) for k in KEYS)
        if row["category"] == "open_qa" and record not in seen:
            seen.add(record)
            lines.append(json.dumps(dict(zip(KEYS, record, strict=True))))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} records to {a.out}")


if __name__ == "__main__":
    main()
