"""The eval set's overlap with the training set: eval examples that are also training examples.

Overlap means identical after formatting: the same text segments (prompt and answer as the template renders them,
or the preference pair) before tokenization, which is what each example's 64-bit content hash covers (the hash
data.eval_fraction splits by, so a split by fraction has no overlap: identical examples fall on the same side).
Why text and not token ids: the hash is made once per example at tokenization and kept in the per-file parts, so
measuring costs a lookup per training example in a set of the eval set's hashes (memory grows with the eval set,
not the training data) and reads nothing again; and it counts an example as the user wrote it, whatever
data.max_seq_length cuts. Near-duplicates (other whitespace, casing or wording) are not counted.

An overlap is reported in the log with its count and a few examples, counted in prepare_data's metrics
(eval_overlap), and fails the stage above data.max_eval_overlap: the eval loss on such examples measures
memorisation, and the registry's gate promotes by it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tasks.config import DataArgs
from tasks.errors import UserError
from tasks.log import logger

SHOWN = 3  # examples quoted in the warning or error
_QUOTE = 80  # characters of each


class Overlap:
    """Collects the eval set's example hashes, then counts the training examples that match one."""

    def __init__(self) -> None:
        self._eval: list[np.ndarray] = []
        self._sorted: np.ndarray | None = None
        self.matched: set[int] = set()  # eval hashes found among the training examples
        self.examples: list[str] = []  # the first few of them, as text

    def add_eval(self, hashes: np.ndarray) -> None:
        """Hashes of eval examples (all eval examples are added before the first training example is matched)."""
        self._eval.append(np.asarray(hashes, dtype=np.uint64))
        self._sorted = None

    def match(self, hashes: np.ndarray, text: Callable[[int], str]) -> None:
        """Training examples' hashes; `text(i)` renders the i-th of them, for the first few that match."""
        if self._sorted is None:
            self._sorted = np.unique(np.concatenate(self._eval)) if self._eval else np.zeros(0, np.uint64)
        hashes = np.asarray(hashes, dtype=np.uint64)
        if not len(self._sorted) or not len(hashes):
            return
        at = np.minimum(np.searchsorted(self._sorted, hashes), len(self._sorted) - 1)
        for i in np.flatnonzero(self._sorted[at] == hashes):
            value = int(hashes[i])
            if value not in self.matched:
                self.matched.add(value)
                if len(self.examples) < SHOWN:
                    self.examples.append(text(int(i)))

    def count(self) -> int:
        """Eval examples (each copy counted) whose hash a training example has."""
        if not self.matched or not self._eval:
            return 0
        found = np.fromiter(self.matched, dtype=np.uint64, count=len(self.matched))
        return int(np.isin(np.concatenate(self._eval), found).sum())


def check(args: DataArgs, overlap: int | None, eval_examples: int, examples: list[str] | None = None) -> None:
    """Warn about eval examples that are also training examples, or fail above data.max_eval_overlap."""
    if not overlap or not eval_examples:
        return
    share = overlap / eval_examples
    shown = f", for example {'; '.join(map(_quoted, examples))}" if examples else ""
    what = (f"{overlap} of the {eval_examples} eval examples ({share:.0%}) of data.eval_source="
            f"{args.eval_source!r} are also training examples of data.source={args.source!r} (identical after "
            f"formatting){shown}")
    if share > args.max_eval_overlap:
        raise UserError(
            f"{what}, more than data.max_eval_overlap={args.max_eval_overlap:g}, so nothing was written: their eval "
            "loss measures memorisation, not what the model learnt, and the registry's gate promotes by it. Point "
            "data.eval_source at examples held out of data.source, remove the shared ones from one of the two, or "
            "raise data.max_eval_overlap (1 only warns).")
    logger().warning("prepare_data: %s. Their eval loss measures memorisation; remove them from one of the two files "
                     "(above data.max_eval_overlap=%g of the eval set this fails the run).", what,
                     args.max_eval_overlap)


def _quoted(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _QUOTE else text[:_QUOTE] + "...")


def preference_text(texts: dict[str, Any]) -> str:
    """A preference example as the warning quotes it: prompt, then the (chosen) answer."""
    return f"{texts.get('prompt', '')} {texts.get('chosen', texts.get('completion', ''))}"
