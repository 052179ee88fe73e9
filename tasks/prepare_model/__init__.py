"""The prepare_model stage: base model -> 4-bit checkpoint + tokenizer + module report. The task is in stage.py; the
rest of this package is its own helpers, which no other stage imports."""
