"""Hashes that key caches: the canonical JSON hash every key is made from.

Imports nothing of the pipeline: every layer keys something with it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def hash_json(obj: Any) -> str:
    """sha256 of a canonical JSON dump (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()

