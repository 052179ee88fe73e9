"""The on-disk contract: manifest.json (manifest.py), stage folders and their locks (folders.py), Prefect's cache of
them (caching.py), a finished stage's summary in the UI (summary.py), disk space and whole writes (disk.py), and
prepare_data's tokenized Parquet as a dataset (parquet_dataset.py)."""
