"""The evaluate_adapter stage: base vs base + adapter on the held-out split -> metrics.json, samples.jsonl. The task
is in stage.py; the rest of this package is its own helpers, which no other stage imports."""
