"""prepare_data's fixed costs on a small file, then prepare_model, as the job pays them: one process, fresh runs_dir.

    python bench/bench_prepare_overhead.py --source F.jsonl [--runs DIR] [--alone]

Runs prepare_data and then prepare_model (the embedded tiny Llama, whose tokenizer bench_job.py copies beside
its 8B model) in one flow run on a temporary Prefect server, as `qlora-pipeline run` does, and prints each stage's
seconds from its manifest, their sum, the prepare_data key and the sha256 of its Parquet files (to compare trees:
run it from another checkout's root with PYTHONPATH=that root). With --alone, prepare_data only, through .fn()
outside any flow. Imports of this script and Prefect's start-up are not in the figures. Not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree to measure: the working directory's (bench_job.py's --tree idea)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a dolly-format file, e.g. Dolly's open_qa "
                        "records from bench/dolly_open_qa.py")
    parser.add_argument("--runs", type=Path, default=Path(tempfile.gettempdir()) / "bench-prepare-overhead")
    parser.add_argument("--alone", action="store_true", help="prepare_data only, through .fn() outside a flow")
    args = parser.parse_args()
    from tasks.config import EMBEDDED_MODEL, DataArgs, ModelArgs
    from tasks.prepare_data.stage import prepare_data
    from tasks.prepare_model.stage import prepare_model

    shutil.rmtree(args.runs, ignore_errors=True)
    data, model = DataArgs(source=str(args.source.resolve())), ModelArgs(base_model=str(EMBEDDED_MODEL))
    if args.alone:
        folders = [Path(prepare_data.fn(data, model, args.runs))]
    else:
        from prefect import flow
        from prefect.testing.utilities import prefect_test_harness

        @flow(name="bench-prepare-overhead")
        def both() -> tuple[str, str]:
            return prepare_data(data, model, args.runs), prepare_model(model, args.runs)

        with prefect_test_harness(server_startup_timeout=300):
            folders = [Path(f) for f in both()]
    seconds = {f.parent.name: json.loads((f / "manifest.json").read_text())["seconds"] for f in folders}
    print(json.dumps({"tree": str(Path.cwd()), **seconds, "sum": round(sum(seconds.values()), 2),
                      "prepare_data_key": folders[0].name,
                      **{n: hashlib.sha256((folders[0] / n).read_bytes()).hexdigest()
                         for n in ("train.parquet", "eval.parquet")}}))


if __name__ == "__main__":
    main()
