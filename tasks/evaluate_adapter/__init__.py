"""The evaluate_adapter stage: base vs base + adapter on the held-out split -> metrics.json, samples.jsonl. The task
is in stage.py, score_champion in champion.py; scorers.py maps each data kind (tasks/methods.py) to the module that
scores it. The rest of this package is their own helpers, which no other stage imports."""

# the stage's code version: in its cache key (stage.py) and in the memo of base results (sequences.py).
# 5: adapters merged into a dequantized base (tuned and champion numbers move in the last digits); 4: attention
# without cuDNN on GPUs (last digits of the losses move, so memoised base results must not mix);
# 3: length-sorted batches, dequantized evaluation; 2: generation metrics, samples.jsonl, lm-evaluation-harness
VERSION = "5"
