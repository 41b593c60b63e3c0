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
| `DRAFTWISE_TUNE`              | kernels                          | `0`: skip timing the kernel paths for multi-row calls, the prefetch level and Q6_K's loop |
| `DRAFTWISE_DRAFT_VOCAB`       | the draft model                  | its head's tokens: `auto` (default: 32768 where the head is 20 %+ of its weights), `full`, or its first N ids; with the special tokens and the context's |

``install.sh`` reads two more, as shell variables at install time only: ``DRAFTWISE_PEERS=1`` (same as
``--peers``) and ``DRAFTWISE_PEERS_REBUILD=1`` (rebuild llama-cpp-python).

Each accessor reads the environment when called (not at import), so a variable set after ``import
draftwise`` (a test's ``monkeypatch.setenv``) takes effect. The C++ kernel reads no variable: Python applies
``DRAFTWISE_ISA`` when it loads the kernel (``kernels.extension``) and reports a value it cannot use.

Process-wide defaults for torch's OpenMP runtime are set here as well (``openmp_spin_default``: GNU's and
Intel's idle spin), and ``OMP_NUM_THREADS`` is read here (``omp_num_threads_set``): see their docstrings.
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


def omp_num_threads_set() -> bool:
    """Whether the user set ``OMP_NUM_THREADS`` (the Python API then leaves torch's thread count as it is:
    ``cpus.cap_torch_threads``)."""
    return bool(os.environ.get("OMP_NUM_THREADS", "").strip())


def openmp_spin_default() -> None:
    """Short idle spins for torch's OpenMP threads, set before torch loads its OpenMP runtime (``import draftwise``
    calls it): ``GOMP_SPINCOUNT=2000`` for GNU OpenMP (pip's torch) and ``KMP_BLOCKTIME=0`` for Intel's or LLVM's
    (``libiomp5`` / ``libomp``: conda's MKL builds, or ``LD_PRELOAD=libiomp5.so`` as Intel's tuning guides
    advise for pip's torch), each only where unset. Left alone, OpenMP's threads spin after each torch op —
    libgomp ~300k iterations (milliseconds), Intel's runtime 200 ms — while between torch ops the kernel's own
    threads (kernels/csrc/core/pool.h) run the matmuls; a spinning OpenMP thread takes a core from them. A short
    spin: Qwen 1.5B, 60-token prompt, prefill 1.4-1.9 s -> 1.2-1.4 s (AMD Zen 3, 2 threads); with libiomp5
    preloaded, the six code prompts' `draft` 21.2 / 18.8 -> 16.5 / 15.1 s (AMD Zen 4, 2 threads). A value the
    user set is kept. It has no effect on a runtime that already read its environment (``import torch`` before
    ``import draftwise``): ``openmp_spins_long`` then says so, and the decode loop keeps torch's ops off
    OpenMP's threads instead (``kernels.decode_threads``)."""
    global _spins_long
    libs = _openmp_libraries()
    gomp = _long_spin(any(_is_gomp(p) for p in libs) if libs is not None else _torch_imported(),
                      os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    kmp = [p for p in libs or () if _is_kmp(p)]
    blocktime = _kmp_blocktime(kmp) if kmp else None  # what the runtime uses (it reads KMP_BLOCKTIME when first used)
    if kmp and blocktime is None:  # a runtime without kmp_get_blocktime: judge by the environment, as for libgomp
        blocktime = _kmp_blocktime_from_env(_torch_imported(), os.environ.get("OMP_WAIT_POLICY"),
                                            os.environ.get("KMP_BLOCKTIME"))
    long = (["libgomp"] if gomp else []) + (
        [os.path.basename(kmp[0]).split(".")[0]] if blocktime is not None and blocktime >= LONG_BLOCKTIME_MS else [])
    _spins_long = ", ".join(long)


_spins_long = ""  # the OpenMP runtimes whose idle threads spin long in this process, named ("": none)
LONG_SPIN = 100_000  # GOMP_SPINCOUNT above this is "long" (libgomp's estimate: 100k spins a millisecond)
LONG_BLOCKTIME_MS = 1  # KMP_BLOCKTIME (milliseconds) from this up is "long": Intel's tuning guides' 1 ms included


def openmp_spins_long() -> bool:
    """Whether torch's idle OpenMP threads spin for a millisecond or more after each torch op in this process:
    GNU OpenMP was loaded before ``import draftwise`` with its default spin (300k), or the user asked for
    ``OMP_WAIT_POLICY=ACTIVE`` or a ``GOMP_SPINCOUNT`` above ``LONG_SPIN``; or an Intel / LLVM runtime (libiomp5,
    libomp) in the process keeps its threads spinning ``LONG_BLOCKTIME_MS`` or more (it was started before
    draftwise set ``KMP_BLOCKTIME=0``, or the user set a longer one). Then a drafted token of the 0.5B draft took
    14.5 ms instead of 10 (AMD Zen 4, 2 cores: the spinning thread holds the core the kernel's helper needs)."""
    return bool(_spins_long)


def openmp_spinning_runtime() -> str:
    """The OpenMP runtimes ``openmp_spins_long`` found spinning long, named (``libgomp``, ``libiomp5``, ``libomp``;
    "" where none): ``kernel_info`` shows them."""
    return _spins_long


def _long_spin(loaded_before: bool, policy: str | None, spincount: str | None) -> bool:
    """GNU OpenMP's rule: whether its idle threads spin long, given whether it read its environment before
    this module set ``GOMP_SPINCOUNT`` (it reads it once, when it loads)."""
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


def _kmp_blocktime_from_env(started_before: bool, policy: str | None, blocktime: str | None) -> float:
    """Intel's / LLVM's rule (``kmp_settings.cpp``), in milliseconds: ``KMP_BLOCKTIME`` (ms, ``infinite``, or
    with a ``ms`` / ``us`` unit) wins over ``OMP_WAIT_POLICY`` (``ACTIVE``: infinite, ``PASSIVE``: 0); neither
    set, 200. ``started_before``: the runtime read its environment before this module set KMP_BLOCKTIME (its
    default then, whatever the environment says now)."""
    if started_before:
        return 200.0
    if blocktime is not None and blocktime.strip():
        v = blocktime.strip().lower()
        if v in ("infinite", "infinity"):
            return float("inf")
        unit = 1e-3 if v.endswith("us") else 1.0
        try:
            return float(int(v[:-2] if v.endswith(("us", "ms")) else v)) * unit
        except ValueError:
            return 200.0  # the runtime warns and keeps its default
    policy = (policy or "").strip().upper()
    return float("inf") if policy == "ACTIVE" else 0.0 if policy == "PASSIVE" else 200.0


def _kmp_blocktime(paths: list[str]) -> float | None:
    """The block time (ms) an Intel / LLVM OpenMP runtime loaded from one of ``paths`` uses, from its own
    ``kmp_get_blocktime()`` (which starts a runtime not yet started: it then reads ``KMP_BLOCKTIME`` as set
    now); None where no such runtime answers."""
    import ctypes

    for path in paths:
        try:
            fn = ctypes.CDLL(path).kmp_get_blocktime
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return float(fn())
    return None


def _is_gomp(path: str) -> bool:
    return os.path.basename(path).startswith("libgomp")


def _is_kmp(path: str) -> bool:
    return os.path.basename(path).startswith(("libiomp5", "libomp.", "libomp-"))


def _openmp_libraries(maps: str = "/proc/self/maps") -> list[str] | None:
    """Paths of the OpenMP runtimes mapped in this process (libgomp, libiomp5, libomp), each once; None where
    the process's maps cannot be read (not Linux)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = dict.fromkeys(line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6)
    return [p for p in paths if _is_gomp(p) or _is_kmp(p)]


def _torch_imported() -> bool:
    import sys

    return "torch" in sys.modules


__all__ = ["INSTALL_VARIABLES", "VARIABLES", "api_key", "exact_activations", "forced_isa", "forced_prefill", "home",
           "keep_converted", "kernels_disabled", "omp_num_threads_set", "openmp_spin_default", "openmp_spinning_runtime",
           "openmp_spins_long", "tune_kernels"]
