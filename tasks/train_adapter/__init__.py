"""The train_adapter stage: 4-bit base + tokenized data -> LoRA adapter. The task is in stage.py; the rest of this
package is its own helpers, which no other stage imports."""
