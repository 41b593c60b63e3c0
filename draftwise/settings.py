"""Every ``DRAFTWISE_*`` environment variable, read here and nowhere else (``tests/test_layers.py`` checks).

| variable                      | read by                          | effect                                                     |
|-------------------------------|----------------------------------|------------------------------------------------------------|
| `DRAFTWISE_HOME`              | models, heads, layerskip, kernels | cache folder (default `~/.cache/draftwise`)                |
| `DRAFTWISE_API_KEY`           | `draftwise serve`                | default of `--api-key` (unset: no key)                     |
| `DRAFTWISE_KEEP_CONVERTED`    | model loading                    | `1` (default): keep a converted safetensors copy of a GGUF where the disk has room (later loads map it; processes share its pages); `0`: the GGUF is the only copy, every load re-packs it |
| `DRAFTWISE_ISA`               | kernels                          | force a kernel path (`scalar`, `avx2`, ...; `auto`)        |
| `DRAFTWISE_NO_KERNELS`        | kernels                          | `1`: do not build / use the C++ kernel (torch ops only)    |
| `DRAFTWISE_PREFILL`           | kernels                          | `gemm` or `kernel`: force how long prefills run            |
| `DRAFTWISE_EXACT_ACTIVATIONS` | kernels                          | `1`: fp32 activations for quantized weights (not int8)     |
| `DRAFTWISE_TUNE`              | kernels                          | `0`: skip timing the kernel paths for multi-row calls and the prefetch level |
| `DRAFTWISE_DRAFT_VOCAB`       | the draft model                  | its head's tokens: `auto` (default: 32768 where the head is 20 %+ of its weights), `full`, or its first N ids; with the special tokens and the context's |

``install.sh`` reads two more, as shell variables at install time only: ``DRAFTWISE_PEERS=1`` (same as
``--peers``) and ``DRAFTWISE_PEERS_REBUILD=1`` (rebuild llama-cpp-python).

Each accessor reads the environment when called (not at import), so a variable set after ``import
draftwise`` (a test's ``monkeypatch.setenv``) takes effect. The C++ kernel reads no variable: Python applies
``DRAFTWISE_ISA`` when it loads the kernel (``kernels.extension``) and reports a value it cannot use.

One process-wide default is set here as well (``openmp_spin_default``): see its docstring.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLES = ("DRAFTWISE_HOME", "DRAFTWISE_API_KEY", "DRAFTWISE_KEEP_CONVERTED", "DRAFTWISE_ISA",
             "DRAFTWISE_NO_KERNELS", "DRAFTWISE_PREFILL", "DRAFTWISE_EXACT_ACTIVATIONS", "DRAFTWISE_TUNE",
             "DRAFTWISE_DRAFT_VOCAB")
INSTALL_VARIABLES = ("DRAFTWISE_PEERS", "DRAFTWISE_PEERS_REBUILD")  # install.sh's, never read by the package


def _get(name: str) -> str:
    assert name in VARIABLES, name
    return os.environ.get(name, "").strip()


def home() -> Path:
    """``$DRAFTWISE_HOME``, default ``~/.cache/draftwise``: models, converted copies, heads, layerskip plans,
    kernel tuning."""
    v = os.environ.get("DRAFTWISE_HOME")
    return Path(v if v else Path.home() / ".cache" / "draftwise").expanduser()


def torch_extensions_dir() -> str | None:
    """torch's own ``TORCH_EXTENSIONS_DIR`` (where its builder compiles the kernel; None: torch's default):
    a kernel noted as built under another value is not imported directly (``kernels._import_built``)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or None


def api_key() -> str | None:
    """``$DRAFTWISE_API_KEY``: the server's default bearer key (None: no key)."""
    return os.environ.get("DRAFTWISE_API_KEY") or None


def keep_converted(default: bool = True) -> bool:
    """``DRAFTWISE_KEEP_CONVERTED``: ``1`` keeps a converted safetensors copy of a GGUF, any other value
    does not; unset, ``default`` (True: a copy is kept where the disk has room for it)."""
    v = _get("DRAFTWISE_KEEP_CONVERTED")
    return default if not v else v == "1"


def forced_isa() -> str | None:
    """``$DRAFTWISE_ISA``: the kernel path to use instead of the best the CPU has (None: not forced)."""
    return _get("DRAFTWISE_ISA") or None


def kernels_disabled() -> bool:
    """``DRAFTWISE_NO_KERNELS=1``: never build or use the C++ kernel."""
    return _get("DRAFTWISE_NO_KERNELS") == "1"


def forced_prefill() -> str | None:
    """``DRAFTWISE_PREFILL=gemm|kernel``: how long prefills run (None: chosen from the CPU)."""
    v = _get("DRAFTWISE_PREFILL").lower()
    return v if v in ("gemm", "kernel") else None


def exact_activations() -> bool:
    """``DRAFTWISE_EXACT_ACTIVATIONS=1``: fp32 activations for quantized weights instead of int8."""
    return _get("DRAFTWISE_EXACT_ACTIVATIONS") == "1"


def tune_kernels() -> bool:
    """``DRAFTWISE_TUNE=0`` skips timing the kernel paths for calls of several rows."""
    return _get("DRAFTWISE_TUNE") != "0"


def draft_vocab() -> str | None:
    """``DRAFTWISE_DRAFT_VOCAB``: ``auto``, ``full`` or a token count for the draft model's head (None: unset, which
    is ``auto``: ``api.draft_head_tokens``)."""
    return _get("DRAFTWISE_DRAFT_VOCAB").lower() or None


def openmp_spin_default() -> None:
    """Set ``GOMP_SPINCOUNT=2000`` when unset, before torch loads GNU OpenMP (``import draftwise`` calls it).
    OpenMP's threads spin ~300k iterations (milliseconds) after each torch op, and between torch ops the
    kernel's own threads (kernels/csrc/core/pool.h) run the matmuls; a spinning OpenMP thread takes a core from
    them. A short spin: Qwen 1.5B, 60-token prompt, prefill 1.4-1.9 s -> 1.2-1.4 s (AMD Zen 3, 2 threads).
    A value the user set is kept. It has no effect once GNU OpenMP is loaded (``import torch`` before
    ``import draftwise``): ``openmp_spins_long`` then says so, and the decode loop keeps torch's ops off
    OpenMP's threads instead (``kernels.decode_threads``)."""
    global _spins_long
    loaded = _libgomp_loaded()
    _spins_long = _long_spin(loaded, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")


_spins_long = False
LONG_SPIN = 100_000  # GOMP_SPINCOUNT above this is "long" (libgomp's estimate: 100k spins a millisecond)


def openmp_spins_long() -> bool:
    """Whether GNU OpenMP's idle threads spin for milliseconds after each torch op in this process: it was
    loaded before ``import draftwise`` with its default spin (300k), or the user asked for ``OMP_WAIT_POLICY=
    ACTIVE`` or a ``GOMP_SPINCOUNT`` above ``LONG_SPIN``. Then a drafted token of the 0.5B draft took 14.5 ms
    instead of 10 (AMD Zen 4, 2 cores: the spinning thread holds the core the kernel's helper needs)."""
    return _spins_long


def _long_spin(loaded_before: bool, policy: str | None, spincount: str | None) -> bool:
    policy = (policy or "").strip().upper()
    if policy == "ACTIVE":
        return True
    if spincount is not None and spincount.strip():  # libgomp's syntax: a count with k / M / G / T, or infinite
        v = spincount.strip().lower()
        if v in ("infinite", "infinity"):
            return True
        scale = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(v[-1], 1)
        try:
            return int(v[:-1] if scale > 1 else v) * scale > LONG_SPIN
        except ValueError:
            return loaded_before
    if policy == "PASSIVE":
        return False
    return loaded_before  # libgomp read the environment before this module set GOMP_SPINCOUNT: its default


def _libgomp_loaded() -> bool:
    """Whether GNU OpenMP is already in this process (torch, or another library, loaded it)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:  # not Linux: torch is what would have loaded it
        import sys

        return "torch" in sys.modules


__all__ = ["INSTALL_VARIABLES", "VARIABLES", "api_key", "exact_activations", "forced_isa", "forced_prefill", "home",
           "keep_converted", "kernels_disabled", "openmp_spin_default", "openmp_spins_long", "tune_kernels"]
