"""The export_adapter stage: the adapter ready to ship, published as a version in the exports registry. The task is
in stage.py; the rest of this package is its own helpers, which no other stage imports."""
