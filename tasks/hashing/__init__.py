"""Content hashes and cache keys: keys.py makes every key from its inputs, files.py hashes files (memoised)."""
