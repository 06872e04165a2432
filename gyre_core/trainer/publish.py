"""Publishing policy versions: one safetensors file per version, written through fsspec.

A local directory by default; an `s3://` root works the same way. The file is written under a
temporary name and moved into place locally; on object stores the single PUT is atomic per object.
"""
from __future__ import annotations

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def version_uri(root: str, version: int | str) -> str:
    """The file of published policy `version` under `root`: `<root>/v<N>.safetensors` (a named side policy,
    such as the control: `<root>/<name>.safetensors`). A run and its cell agents both name versions so."""
    name = f"v{version}" if isinstance(version, int) else version
    return f"{root.rstrip('/')}/{name}.safetensors"


def publish_weights(state_dict: dict[str, torch.Tensor], uri: str, storage_options: dict | None = None) -> str:
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    data = st_save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})
    if fs.protocol in ("file", ("file", "local")) or "file" in fs.protocol:
        tmp = path + ".tmp"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)
    return uri


def load_weights(uri: str, storage_options: dict | None = None) -> dict[str, torch.Tensor]:
    with fsspec.open(uri, "rb", **(storage_options or {})) as f:
        return st_load(f.read())
