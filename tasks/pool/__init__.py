"""The GPU pool (gpus.py) and the host's CPU share (cpus.py), on Prefect's global concurrency limits, whose slots
are held under leases that outlive a server restart (leases.py)."""
