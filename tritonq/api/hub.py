"""Resolve a model name to a local checkpoint folder: a local path, or a Hugging Face hub id.

Hub ids go through huggingface_hub.snapshot_download, so the local cache and HF_HUB_OFFLINE=1
work as usual. Only the files tritonq reads are downloaded: first the small ones (configs,
tokenizer, the safetensors index), then the weights: the shards model.safetensors.index.json
names when there is one (a repo may also ship a merged copy, which is then skipped), else every
*.safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path

SMALL_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve(name_or_path: str | Path, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """Local folder for `name_or_path` (an existing directory, or "org/name" on the hub)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{name!r} is not a checkpoint folder (expected a directory with config.json, "
                                "or a hub id like 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    def download(patterns: list[str]) -> Path:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=patterns))

    try:
        folder = download(SMALL_FILES)
        index = folder / "model.safetensors.index.json"
        shards = ["*.safetensors"]
        if index.exists():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index (expected JSON with a 'weight_map'): {e}") from e
        return download(shards)
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(f"model {name!r} not found on the Hugging Face hub (check the name, or log in "
                                "with `hf auth login` for a gated/private model)") from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"model {name!r} has no revision {revision!r} on the hub") from e
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"model {name!r} (revision {revision or 'main'}) is not in the local cache and the "
                                "hub cannot be reached (offline or HF_HUB_OFFLINE=1); download it once online, "
                                "or pass a local folder") from e


def resolve_gguf(name_or_path: str | Path, gguf_file: str, revision: str | None = None) -> Path:
    """The GGUF file `gguf_file` of a local folder or hub repo `name_or_path` (downloaded alone: no other file)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / gguf_file).is_file():
            raise FileNotFoundError(f"{path} has no file {gguf_file!r}; gguf_file names a .gguf file in the folder")
        return path / gguf_file
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
    try:
        return Path(hf_hub_download(str(name_or_path), gguf_file, revision=revision))
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(f"model {str(name_or_path)!r} not found on the Hugging Face hub") from e
    except EntryNotFoundError as e:
        raise FileNotFoundError(f"{name_or_path} has no file {gguf_file!r} on the hub; list its .gguf files on its "
                                "model page and pass one as gguf_file") from e
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"{gguf_file} of {name_or_path} is not in the local cache and the hub cannot be "
                                "reached; download it once online, or pass the local .gguf path") from e
