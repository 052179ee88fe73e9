"""The exports registry and publishing: its versions, champion and self-repair (store.py), the promotion gate's
rules (gate.py), and train.init_adapter resolved through it to a verified adapter folder (init_adapter.py)."""
