"""The package's structure, read from its source: which modules import which (the layers and no circles),
and environment variables read in settings.py only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from draftwise import settings

PKG = Path(__file__).resolve().parents[1] / "draftwise"
ENV_READ = re.compile(r"os\.environ|os\.getenv|getenv\(")
ENV_ALLOWED = {"settings.py"}


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_settings_reads_draftwise_variables():
    """No module but settings.py touches os.environ for a DRAFTWISE_* variable (nor reads the environment
    at all, but for HF_HUB_OFFLINE, which belongs to huggingface_hub)."""
    bad = []
    for p in _sources():
        rel = p.relative_to(PKG).as_posix()
        if rel in ENV_ALLOWED:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if ENV_READ.search(line) and "HF_HUB_OFFLINE" not in line:
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "read the environment through draftwise.settings:\n" + "\n".join(bad)


def _kernel_sources():
    from draftwise.kernels import kernel_files

    return kernel_files()  # every .cpp / .h / .inc / .def under kernels/csrc


def test_the_kernel_reads_no_environment():
    """The C++ kernel takes its settings from Python (DRAFTWISE_ISA: kernels.extension -> set_isa), so no
    variable is read in two languages."""
    bad = [f"{p.relative_to(PKG).as_posix()}:{n}: {line.strip()}" for p in _kernel_sources()
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"\b(secure_)?getenv\s*\(|\benviron\b", line)]
    assert _kernel_sources() and not bad, bad


def test_settings_names_every_variable_the_sources_mention():
    """Every DRAFTWISE_* name in the package (docstrings, help, C++) is one settings.py documents."""
    names = set()
    for p in [*PKG.rglob("*.py"), *_kernel_sources()]:
        names |= set(re.findall(r"DRAFTWISE_[A-Z_]+[A-Z]", p.read_text()))
    known = {*settings.VARIABLES, *settings.INSTALL_VARIABLES}
    assert names <= known, names - known
    doc = settings.__doc__
    assert all(f"`{v}`" in doc for v in settings.VARIABLES)
    assert all(f"``{v}" in doc for v in settings.INSTALL_VARIABLES)


def test_settings_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    assert settings.home() == tmp_path
    monkeypatch.delenv("DRAFTWISE_HOME")
    assert settings.home() == Path.home() / ".cache" / "draftwise"
    monkeypatch.delenv("DRAFTWISE_KEEP_CONVERTED", raising=False)
    assert settings.keep_converted() is True and settings.keep_converted(default=False) is False
    monkeypatch.setenv("DRAFTWISE_KEEP_CONVERTED", "0")
    assert settings.keep_converted(default=True) is False
    monkeypatch.setenv("DRAFTWISE_KEEP_CONVERTED", "1")
    assert settings.keep_converted() is True
    monkeypatch.setenv("DRAFTWISE_PREFILL", " GEMM ")
    assert settings.forced_prefill() == "gemm"
    monkeypatch.setenv("DRAFTWISE_PREFILL", "fast")
    assert settings.forced_prefill() is None
    monkeypatch.setenv("DRAFTWISE_TUNE", "0")
    assert not settings.tune_kernels()
    monkeypatch.setenv("DRAFTWISE_API_KEY", "k")
    assert settings.api_key() == "k"


@pytest.mark.parametrize("var", ["DRAFTWISE_ISA", "DRAFTWISE_NO_KERNELS", "DRAFTWISE_EXACT_ACTIVATIONS"])
def test_kernel_switches(monkeypatch, var):
    monkeypatch.delenv(var, raising=False)
    read = {"DRAFTWISE_ISA": settings.forced_isa, "DRAFTWISE_NO_KERNELS": settings.kernels_disabled,
            "DRAFTWISE_EXACT_ACTIVATIONS": settings.exact_activations}[var]
    assert not read()
    monkeypatch.setenv(var, "1")
    assert read()


# ---- imports ---------------------------------------------------------------------------------------------
def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the draftwise modules it imports, at the top or inside a function (a lazy import still
    ties the two modules together)."""
    mods = {_module(p): p for p in _sources()}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}
                deps |= subs if len(subs) == len(node.names) else subs | {target}  # `from .. import settings`
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_models_hf_and_seq2seq_import_no_circle():
    g = import_graph()
    assert "draftwise.models.hf" not in g["draftwise.models.seq2seq"]
    assert "draftwise.models.hf_common" in g["draftwise.models.seq2seq"]


def test_shared_helpers_are_defined_once():
    """One expected-accepted-length formula, one acceptance estimator, one file hash: each defined in one
    module (gamma and auto share acceptance.py; every file hash goes through digest.py)."""
    defs: dict[str, list[str]] = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defs.setdefault(node.name.lstrip("_").lower(), []).append(p.relative_to(PKG).as_posix())
    assert defs["expected_accepted"] == ["acceptance.py"]
    assert defs["acceptance"] == ["acceptance.py"]
    assert defs["sha256_file"] == ["digest.py"]
    assert not [n for n in defs if "expected_accept" in n and n != "expected_accepted"]
