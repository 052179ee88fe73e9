"""The pipeline's stages (one package each) and the contract they share.

Importing this package puts tasks/offline.py's finder in place, so that bitsandbytes, which transformers' Trainer and
peft import at their own import, never asks the Hub for a kernel: it must come before anything imports bitsandbytes.
"""

from tasks.offline import keep_bitsandbytes_offline

keep_bitsandbytes_offline()
