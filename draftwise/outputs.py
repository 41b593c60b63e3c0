"""Output destinations, checked before the work that fills them. A benchmark, a soak or a training run can take
minutes to hours and writes its results last; a destination it cannot write must be refused up front in one
line (``InvalidParameterError``, exit status 2 at the command line), not end the run in a traceback with the
results lost. Used by every command that writes files: ``bench --out``, ``bench-forward --out``, ``agreement
--out``, ``bench-serve --json`` / ``--soak-out``, ``train-head --out``."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InvalidParameterError


def _folder_problem(out: Path) -> str | None:
    """Why the folder ``out`` cannot be created (with its parents) or written to, or None once it exists and can."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "a file, not a folder"
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(out, os.W_OK | os.X_OK) else "permission denied"


def out_folder(path: str | os.PathLike, flag: str) -> Path:
    """The folder given to ``flag``, created (with its parents) and checked writable; InvalidParameterError
    naming the flag otherwise (below a file, a file itself, no permission, a read-only file system)."""
    out = Path(path).expanduser()
    if why := _folder_problem(out):
        raise InvalidParameterError(f"cannot write {flag} {out}: {why}")
    return out


def out_file(path: str | os.PathLike, flag: str) -> Path:
    """The file given to ``flag``: its folder created and checked as ``out_folder`` does, the file itself not a
    folder and, when it exists, writable; InvalidParameterError naming the flag otherwise."""
    out = Path(path).expanduser()
    if why := _folder_problem(out.parent):
        raise InvalidParameterError(f"cannot write {flag} {out}: its folder {out.parent}: {why}")
    if out.is_dir():
        raise InvalidParameterError(f"cannot write {flag} {out}: a folder")
    if out.exists() and not os.access(out, os.W_OK):
        raise InvalidParameterError(f"cannot write {flag} {out}: permission denied")
    return out
