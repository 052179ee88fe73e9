"""A reward model for inference: prepare_model's 4-bit base loaded as a sequence scorer with a reward model's adapter
and score head (tasks/methods.py's row whose head is "score"), and its scores of rows of token ids in batches.
evaluate_adapter scores held-out pairs with it; a GRPO reward function scores sampled answers with it
(tasks/rewards/reward_model.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_scorer(model_dir: Path, adapter: Path) -> Any:
    """The 4-bit base of `model_dir` as a sequence scorer with the adapter and score head in folder `adapter`, in
    eval mode."""
    from peft import PeftModel

    from tasks.models.loading import load_quantized

    return PeftModel.from_pretrained(load_quantized(model_dir, head="score"), adapter).eval()


def score_batches(model: Any, rows: list[list[int]], batch_size: int) -> list[float]:
    """The score of each row of token ids, `batch_size` rows at a time (right-padded with the model's pad id, which
    the scorer skips to read each row's last real token)."""
    import torch

    pad = model.config.pad_token_id or 0
    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in batch], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in batch], device=device)
            out += model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
    return out
