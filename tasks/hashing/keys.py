"""The keys of the pipeline's caches: one function (cache_key) and its rule, over one canonical JSON hash.

Imports nothing of the pipeline: every layer keys something with it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def hash_json(obj: Any) -> str:
    """sha256 of a canonical JSON dump (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(inputs: Any, digits: int = 16) -> str:
    """The key of a cached result: the first `digits` hex digits of hash_json(inputs). Every cache of the pipeline
    makes its keys here, by one rule:

    - `inputs` holds everything that decides the cached bytes and nothing else: the VERSION of the code that makes
      them, the settings that shape them, the content of what it reads (a file's sha256, never its path or mtime;
      an upstream stage's key; a hub revision's commit), and the library versions or the device where a change of
      them changes the bytes;
    - the cache's name leads where two caches share a folder or a store ("prepare_data-part", a stage's name);
    - a place (runs_dir) is in a key only where what is cached points into it: Prefect's result records hold stage
      folder paths, so its keys add runs_dir;
    - 16 digits (64 bits) for a folder name; Prefect's keys add their name and place to a stage key (8 digits for
      the place) or take 24.

    The caches: stage folders (StageSpec.key), Prefect's cache of the stage tasks (tasks/on_disk/caching.py) and
    of score_champion, prepare_data's per-file parts and saved tokenizer settings, evaluate_adapter's memo of the
    base model's and the champion's results (the champion named by gate.identity), a sweep's folder; the identities
    that records are compared by (a base model's: registry store.base_identity; a ranking logged to MLflow) are made
    the same way. The one cache not keyed here is the hash memo (tasks/hashing/files.py): it remembers a file's
    sha256, so the content cannot key it; the file's identity (path, size, mtime_ns, ctime_ns, inode, device), which
    every write changes, does.
    """
    return hash_json(inputs)[:digits]
