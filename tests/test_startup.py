"""Start-up: what ``load_model`` spends its time on, kept short — the kernel imported directly once built,
no gguf import for reading a GGUF in place, no random init of layers the checkpoint replaces, no garbage
collection while loading, the tokenizer read on a spare core meanwhile."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from draftwise import kernels, memory


def test_ggml_ids_are_the_gguf_packages():
    from gguf import GGMLQuantizationType

    from draftwise.kernels.gguf_quant import GGML_IDS, ggml_type_id

    assert all(int(GGMLQuantizationType[k]) == v for k, v in GGML_IDS.items())
    assert ggml_type_id("IQ4_NL") == int(GGMLQuantizationType.IQ4_NL)  # one not in the table: from gguf
    assert ggml_type_id("NOT_A_TYPE") is None


def test_the_built_kernel_is_imported_directly(tmp_path, monkeypatch):
    """Once built, a process imports the module its note names (no torch builder); a note for another
    torch or another TORCH_EXTENSIONS_DIR, or naming a missing file, sends it back to the builder (None)."""
    ext = kernels.extension()
    if ext is None:
        pytest.skip("the kernel is not built here")
    monkeypatch.setattr(kernels, "_built_record", lambda: tmp_path / "built.json")
    assert kernels._import_built() is None  # no note
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    rec = {"module": ext.__file__, "torch": torch.__version__, "python": sys.version, "extensions_dir": None}
    (tmp_path / "built.json").write_text(json.dumps(rec))
    os.utime(tmp_path / "built.json", (1e9, 1e9))
    mod = kernels._import_built()
    assert mod is not None and mod.isa() == ext.isa() and mod.available_isas() == ext.available_isas()
    assert (tmp_path / "built.json").stat().st_mtime > time.time() - 600  # in use: kept by _prune_builds
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "fresh"))  # another build folder: build there
    assert kernels._import_built() is None
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    for bad in ({**rec, "torch": "0.0.1"}, {**rec, "module": str(tmp_path / "gone.so")}, {"module": 3}):
        (tmp_path / "built.json").write_text(json.dumps(bad))
        assert kernels._import_built() is None
    (tmp_path / "built.json").write_text("{not json")
    assert kernels._import_built() is None


def test_old_kernel_builds_are_pruned_after_a_new_build(tmp_path, monkeypatch):
    """_prune_builds: a build whose note no import touched for BUILD_KEEP_DAYS goes (its folder and note); the
    current build, a recently imported one, and a folder the note's build name does not match stay."""
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    notes, exts = tmp_path / "home" / "kernels", tmp_path / "ext"
    notes.mkdir(parents=True)
    old = time.time() - (kernels.BUILD_KEEP_DAYS + 1) * 86400

    def build(name: str, folder: str | None = None, age: float | None = None) -> Path:
        d = exts / (folder or name)
        d.mkdir(parents=True)
        (d / f"{name}.so").write_bytes(b"x" * 100)
        rec = notes / f"built-{name}.json"
        rec.write_text(json.dumps({"module": str(d / f"{name}.so")}))
        if age is not None:
            os.utime(rec, (age, age))
        return d

    stale = build("draftwise_kernels_x86_64_aaaaaaaaaaaa", age=old)
    recent = build("draftwise_kernels_x86_64_bbbbbbbbbbbb")
    other = build("draftwise_kernels_x86_64_cccccccccccc", folder="someone_else", age=old)
    current = build(kernels.build_name(), age=old)  # this build is never pruned
    (notes / "built-draftwise_kernels_x86_64_dddddddddddd.json").write_text("{not json")
    assert sorted(kernels._prune_builds()) == ["draftwise_kernels_x86_64_aaaaaaaaaaaa",
                                               "draftwise_kernels_x86_64_cccccccccccc"]
    assert not stale.exists() and not (notes / "built-draftwise_kernels_x86_64_aaaaaaaaaaaa.json").exists()
    assert recent.exists() and current.exists()
    assert other.exists()  # a folder of another name is never removed, only its stale note
    assert not (notes / "built-draftwise_kernels_x86_64_cccccccccccc.json").exists()
    assert kernels._prune_builds() == []


def test_meta_layers_skip_their_random_init(monkeypatch):
    from draftwise.models import transformer

    calls = []
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: calls.append(self.weight.device.type))
    with torch.device("meta"):
        transformer.Linear(8, 4)
    assert calls == []  # the checkpoint replaces the weight: nothing drawn
    transformer.Linear(8, 4)
    assert calls == ["cpu"]  # a real layer initialises as nn.Linear does


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with memory.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with memory.gc_paused():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()
    with pytest.raises(ValueError), memory.gc_paused():
        raise ValueError
    assert gc.isenabled()


def test_tokenizer_read_meanwhile_on_a_spare_core(hf_folder, monkeypatch):
    """With a core to spare the tokenizer is parsed on a thread while the weights load, and the model's
    tokenizer is the one that parse made (cached by content) and gives the plain path's ids and
    end-of-sequence set; without a spare core it is read after the weights."""
    import draftwise.models as models
    from draftwise import cpus

    started = []
    real = models._read_tokenizer_meanwhile

    def spy(folder):
        fut = real(folder)
        started.append(fut is not None)
        return fut

    monkeypatch.setattr(models, "_read_tokenizer_meanwhile", spy)
    monkeypatch.setattr(cpus, "usable_cores", lambda: 64)
    a = models.load_model(str(hf_folder), "fp32", progress=False)
    monkeypatch.setattr(cpus, "usable_cores", lambda: 1)
    b = models.load_model(str(hf_folder), "fp32", progress=False)
    assert started == [True, False]
    from draftwise.models.tokenizer import _RUST

    assert a.tokenizer.fast in _RUST.values()
    text = "def f(x):\n    return x * 2  # héllo"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.eos_ids == b.tokenizer.eos_ids
