"""The prepare_data stage: dataset -> formatted, tokenized train.parquet and eval.parquet. The task is in stage.py;
the rest of this package is its own helpers, which no other stage imports."""
