"""What a run reports: the Prefect UI's artifacts (artifacts.py), the run folder and its run.json (run_record.py), a
sweep's comparison and record (sweep.py), and experiment tracking, one module per backend (tracking/)."""
