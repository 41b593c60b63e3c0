"""The one sha256 helper: of a file, read in 4 MiB chunks (weight files are gigabytes)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path | str, progress: bool = False) -> str:
    """Hex sha256 of the file at ``path``; ``progress`` shows a byte bar on stderr (multi-GB files)."""
    from tqdm.auto import tqdm

    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, desc=f"sha256 {path.name}", unit="B",
                                     unit_scale=True, disable=not progress, leave=False) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


__all__ = ["sha256_file"]
