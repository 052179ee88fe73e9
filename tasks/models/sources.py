"""Where models come from: a Hugging Face hub id at its resolved revision or a local folder in save_pretrained's
layout; the content identity a cache key hashes for it, and the files a tokenizer is made of.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.errors import UserError
from tasks.hashing.files import files_fingerprint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def is_local(source: str) -> bool:
    """A source is a local path if it exists or is written like one (not like `org/name`)."""
    return Path(source).expanduser().exists() or source.startswith(("/", ".", "~")) or "\\" in source


def _check_local_model(source: str, weights: bool = True) -> Path:
    path = Path(source).expanduser()
    fix = "Give a folder written by save_pretrained, or a Hugging Face hub id such as meta-llama/Llama-3.1-8B."
    if not (path / "config.json").is_file():
        raise UserError(f"model.base_model={source!r} is not a model folder (no config.json there). {fix}")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"model.base_model={source!r}: its config.json cannot be read as JSON ({exc}). Restore the "
                        f"file (save_pretrained writes it) or download the model again. {fix}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"model.base_model={source!r}: its config.json has no model_type, so transformers cannot "
                        f"tell the architecture. Restore the file or download the model again. {fix}")
    if weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"model.base_model={source!r} has no weights (no *.safetensors or *.bin files beside "
                        f"config.json). Copy the weight files there or download the model again. {fix}")
    return path.resolve()


def max_positions(model_folder: Path) -> int | None:
    """The longest sequence the model's position embeddings cover (config.json), None when it does not say."""
    try:
        config = json.loads((model_folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def resolve_hub_revision(repo_id: str, revision: str | None, repo_type: str = "model") -> str:
    """The commit sha a hub revision points to now (from the local cache when HF_HUB_OFFLINE=1).

    Every failure is a UserError, never retried: a wrong id or revision does not heal, and without network
    a retry only delays the message (HF_HUB_OFFLINE=1 reads the local cache instead).
    """
    import huggingface_hub
    from huggingface_hub import HfApi, snapshot_download

    field = "model.base_model" if repo_type == "model" else "data.source"
    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    try:
        if offline:
            folder = snapshot_download(repo_id, revision=revision, repo_type=repo_type, local_files_only=True)
            return Path(folder).name  # snapshots/<commit sha>
        return HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, timeout=10).sha
    except Exception as exc:  # noqa: BLE001 - sorted below into a message with its fix
        name = type(exc).__name__
        what = f"{field}={repo_id!r} (revision {revision or 'default'})"
        if offline:
            why = (f"HF_HUB_OFFLINE=1 and the {repo_type} is not in the local hub cache. Fetch it first "
                   f"(hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}) or give "
                   "a local path")
        elif "NotFound" in name or "Gated" in name or name == "HfHubHTTPError":
            why = (f"the hub says: {str(exc).splitlines()[0]}. Check the id and revision, and your access "
                   "(hf auth login)")
        else:
            why = (f"the hub cannot be reached ({name}). Check the network, or set HF_HUB_OFFLINE=1 to use the "
                   "local hub cache, or give a local path")
        raise UserError(f"{what} cannot be resolved: {why}.") from None


def model_fingerprint(source: str, revision: str | None, only: tuple[str, ...] | None = None,
                      runs_dir: Path | None = None) -> dict[str, str]:
    """Content identity of a base model: its files' bytes (their hashes memoised in runs_dir), or the resolved hub
    commit."""
    if is_local(source):
        path = _check_local_model(source, weights=only is None)  # a tokenizer alone needs no weights
        files = [p for p in path.iterdir() if p.is_file() and (only is None or p.name in only)]
        return {"files_sha256": files_fingerprint(files, runs_dir=runs_dir)}
    return {"hub_repo": source, "hub_commit": resolve_hub_revision(source, revision)}


def model_path(source: str, revision: str | None, weights: bool = True) -> Path:
    """A local folder with the model's files, downloading a hub model at its resolved commit."""
    if is_local(source):
        return _check_local_model(source, weights)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=resolve_hub_revision(source, revision)))
