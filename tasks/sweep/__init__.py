"""Sweeps as pure functions: the candidates of a grid (grid.py) and their ranking (ranking.py). The flow runs them
(flows/sweep_runner.py); the comparison and the record are reporting (tasks/reporting/sweep.py)."""
