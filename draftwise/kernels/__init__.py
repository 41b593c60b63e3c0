"""Weight-only quantized linear layers for CPU decoding (Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 in the GGUF's
own blocks, int8 / int4 groupwise, or dense bf16 / fp32; batch-invariant). Quantized weights multiply int8
activations (per-row blocks of 256 for Q4_K / Q6_K, of 32 for the block formats and the groupwise code, as
llama.cpp does); ``DRAFTWISE_EXACT_ACTIVATIONS=1`` keeps fp32 activations instead (GGUF blocks then load in the groupwise
code; slower, for measuring what the activation rounding costs). Dense weights always take fp32 activations.

The C++ kernel (``csrc/``: ``core/`` the numeric rules ``qmm.h`` and ``kquant.h``, their scalar references and
the dispatch; ``arch/x86/``, ``arch/arm/`` one file per instruction set, listed in ``core/paths.def``; see
docs/kernels.md "Source layout") is compiled on first use with torch's extension
builder, without ``-march=native``: each instruction-set file carries its own target, and the path is
chosen at run time from what the CPU reports (``isa()``; ``DRAFTWISE_ISA`` forces a lower one). Every
path computes the same bits, so the same GGUF gives the same tokens on every CPU. Where the kernel
cannot be built, a pure-torch path computes the same products (not bit-identical; slower).
``QLinear`` is a drop-in for ``nn.Linear`` in the native model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import re
import threading
from pathlib import Path

import torch
from torch import nn

from .. import settings

log = logging.getLogger(__name__)
_mode = threading.local()
ACT_BLOCK = 32  # activations are quantized per row in blocks of this many values
BULK_MIN_ROWS = 64  # bulk (prefill) calls with more rows than this take the dequantize + bf16 gemm path


def bulk_gemm_pays() -> bool:
    """Whether long prefills should de-quantize to bf16 and run torch's GEMM: only where the CPU has bf16
    matrix hardware (AMX, AVX512-BF16), on which a 32-row matmul costs what one row costs. Elsewhere
    (AVX2, NEON) torch's bf16 GEMM is compute-bound and many times slower than the int8 kernel (a
    100-token prefill of the Qwen 1.5B: 39 s vs 6.8 s on Zen 3), and the kernel keeps prefill on the
    same bits on every CPU. ``DRAFTWISE_PREFILL=gemm|kernel`` overrides."""
    forced = settings.forced_prefill()
    if forced in ("gemm", "kernel"):
        return forced == "gemm"
    if extension() is None:
        return True  # no kernel: de-quantized dense weights either way
    return cpu_has_bf16_matmul()


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix hardware (AMX-BF16 or AVX512-BF16), from the kernel's cpuid look
    (or /proc/cpuinfo when the kernel is not built)."""
    ext = extension()
    if ext is not None:
        feats = set(ext.cpu_features().split())
    else:
        try:
            feats = {f.replace("_", "-") for f in Path("/proc/cpuinfo").read_text().split()}
        except OSError:
            feats = set()
    return bool({"amx-bf16", "avx512bf16", "avx512-bf16"} & feats)


_bulk_pays = functools.cache(bulk_gemm_pays)  # one look at the CPU per process (a per-call hot path)


@contextlib.contextmanager
def _mode_flag(name: str, value: bool):
    """Set the thread's ``_mode.<name>`` within the block, restoring the previous value after."""
    prev = getattr(_mode, name, False)
    setattr(_mode, name, value)
    try:
        yield
    finally:
        setattr(_mode, name, prev)


@contextlib.contextmanager
def serial_torch():
    """Within this block torch's own ops run on one thread and the kernel's matmuls on the threads torch
    had. A short forward (decode, verification: T <= 32 new tokens per row) is a chain of ~10 small torch
    ops per layer between the kernel's calls; an element-wise op over more than 32768 values wakes torch's
    OpenMP threads, and one that shares a core with another thread stalls the op for milliseconds (a
    (24, 1792) bias add: 6.8 ms on 2 threads, 3 us on one; AMD Zen 5, another process busy). The heavy torch
    ops that do pay for threads (a long prefill's GEMM and attention) get them back by ``parallel_torch``.
    Nested blocks keep the outer one's setting. Only speed moves: every op computes the same bits."""
    ext = _ext if _ext is not None else extension()
    n = torch.get_num_threads()
    if ext is None or n <= 1 or ext.get_threads() > 0:
        yield
        return
    ext.set_threads(n)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        ext.set_threads(0)


@contextlib.contextmanager
def parallel_torch(light: bool = False):
    """Inside ``serial_torch``: torch's ops get the caller's threads back for this block (a GEMM). ``light``:
    an op that gains less from them than OpenMP's idle spin after it costs where that spin is long
    (``settings.openmp_spins_long``; a short prompt's attention: a 33-token prefill of the 1.5B took 349 ms
    with it, 214 ms without, AMD Zen 4) stays on one thread there."""
    n = _ext.get_threads() if _ext is not None else 0
    if n <= 1 or (light and settings.openmp_spins_long()):
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def decode_threads():
    """The decode loop (``Decoder.step`` / ``add``: drafting, verification, sampling) inside ``serial_torch``
    where OpenMP's idle threads spin long after each torch op (``settings.openmp_spins_long``: torch was
    imported before draftwise, or an Intel OpenMP runtime started before it): its torch ops then never wake
    them, and the kernel's threads keep both cores.
    Measured there (AMD Zen 4, 2 cores, the six code prompts, `draft`): 18.6-19.1 s -> 15.1-16.1 s; with a
    short spin the loop is left as it is (the same either way). Only speed moves: greedy and seeded text are
    the same (the logits are the kernel's; top-p's renormalization is ``sampling.row_sum``)."""
    return serial_torch() if settings.openmp_spins_long() else contextlib.nullcontext()


def in_decode_threads(fn):
    """``fn`` within ``decode_threads`` (decided at each call): ``Decoder.step`` / ``add``, ``beam_search``."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with decode_threads():
            return fn(*args, **kwargs)
    return run


def bulk(enabled: bool = True):
    """Within this block, linears over many rows (a long prefill) de-quantize their weights to bf16 and
    use torch's GEMM (AMX / oneDNN) instead of the kernel, where that pays (``bulk_gemm_pays``).
    The model enters it only for forwards that no other computation must match token for token
    (prefills longer than the exact-attention limit), so decoding stays batch-invariant."""
    return _mode_flag("bulk", enabled)


@contextlib.contextmanager
def exact_prefill():
    """Within this block long prefills keep each format's own numbers: no bf16 bulk GEMM (``bulk``); dense and
    groups-of-32 weights over many rows take torch's fp32 GEMM on fp32 de-quantized weights (``fp32_gemm``),
    the K-quant rule its kernel as always. For measuring what a format costs in quality (``draftwise
    agreement``): an "fp32" reference whose prompt ran through bf16 is not an fp32 reference."""
    with _mode_flag("no_bulk", True), _mode_flag("gemm32", True):
        yield


def fp32_gemm():
    """Within this block, linears over many rows that do not take the bf16 bulk path de-quantize their
    weights to fp32 and use torch's fp32 GEMM, on any CPU: for work whose numbers no decoding output
    depends on (a draft head's training features). On AMD EPYC family 23 (AVX2): SmolLM2 2x the int8
    kernel's speed, the 1.5B 1.24x (fp32 GEMM 67 GFLOP/s against the kernel's ~35 GOP/s, less the
    per-call de-quantization)."""
    return _mode_flag("gemm32", True)


_ext = None
_ext_lock = threading.Lock()
_ext_failed = False
_ext_error = ""
CSRC = Path(__file__).with_name("csrc")
# No -march=native: each instruction-set file sets its own target and the path is picked at run time, so
# a build made on one CPU runs on any other of the same architecture (no SIGILL when a home directory
# moves between machines). No -ffast-math, and no contraction of a * b + c into an FMA the source did not
# ask for: the numeric rule (csrc/core/qmm.h) is the same on every path only if the compiler keeps every
# operation as written.
CFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-pthread"]  # threads: csrc/core/pool.h
PATHS_DEF = CSRC / "core" / "paths.def"  # the one list of instruction-set paths (an X-macro file)


@dataclasses.dataclass(frozen=True)
class IsaPath:
    """One instruction-set path of the kernel, as ``csrc/core/paths.def`` lists it."""

    name: str    # DRAFTWISE_ISA / isa() / available_isas() name
    family: str  # "ANY", "X86" or "ARM": the architecture whose builds can run it
    rank: int    # preference: of the paths a CPU can run, the highest runs by default


@functools.cache
def isa_paths() -> tuple[IsaPath, ...]:
    """Every path, in ``paths.def`` order, read from the file the C++ dispatch table is generated from (so
    Python needs no second list; the extension's ``isa_table()`` gives the same rows, tests check it)."""
    rows = []
    for i, line in enumerate(PATHS_DEF.read_text().splitlines(), 1):
        if not line.strip().startswith("DW_PATH"):
            continue
        m = re.fullmatch(r"DW_PATH\(\s*(\w+)\s*,\s*(ANY|X86|ARM)\s*,\s*\w+\s*,\s*(\d+)\s*\)\s*(//.*)?", line.strip())
        if m is None:
            raise RuntimeError(f"{PATHS_DEF}:{i}: not a DW_PATH(name, ANY|X86|ARM, cpu_check, rank) line: {line!r}")
        rows.append(IsaPath(m.group(1), m.group(2), int(m.group(3))))
    return tuple(rows)


def machine_family() -> str:
    """This machine's path family in ``paths.def`` terms: "X86", "ARM", or "" (only the scalar path)."""
    m = platform.machine().lower()
    return "X86" if m in ("x86_64", "amd64", "x86-64") else "ARM" if m in ("aarch64", "arm64") else ""


def arch_isas() -> list[str]:
    """The paths a build for this architecture has, lowest rank first (the CPU may lack some: available_isas)."""
    return [p.name for p in sorted(isa_paths(), key=lambda p: p.rank) if p.family in ("ANY", machine_family())]


ISAS = tuple(p.name for p in isa_paths())  # every path of every architecture; set_isa also takes "vnni", "auto"


def kernel_sources() -> list[Path]:
    """The extension's translation units: every ``.cpp`` under ``csrc/`` except the torch-free selftest
    (``csrc/tests/``). torch's builder names each object file after the source's base name, so two sources
    with one name in different folders would overwrite each other's object: refused here."""
    srcs = sorted(p for p in CSRC.rglob("*.cpp") if p.relative_to(CSRC).parts[0] != "tests")
    names = [p.name for p in srcs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise RuntimeError(f"kernel sources share a file name ({', '.join(dup)}): each .cpp under {CSRC} needs its own")
    return srcs


KERNEL_SUFFIXES = (".cpp", ".h", ".inc", ".def")  # sources, headers, textual fragments, the path list


def kernel_files() -> list[Path]:
    """Every file the kernel is built from (sources, headers, fragments, paths.def; the selftest too), in a
    fixed order."""
    return sorted(p for p in CSRC.rglob("*") if p.suffix in KERNEL_SUFFIXES)


def build_name() -> str:
    """The extension's cache name: architecture + a hash of the sources and flags, so that a build of
    other sources, flags or another architecture (a home directory shared between machines) is never
    loaded in place of this one."""
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for p in kernel_files():
        h.update(p.relative_to(CSRC).as_posix().encode() + b"\0" + p.read_bytes())
    return f"draftwise_kernels_{platform.machine().lower()}_{h.hexdigest()[:12]}"


def _built_record() -> Path:
    """Where the path of this build's compiled module is noted once built (``$DRAFTWISE_HOME/kernels``)."""
    return settings.home() / "kernels" / f"built-{build_name()}.json"


def _build():
    """Compile (or find up to date) the extension with torch's builder, and note where its module lies so that
    later processes import it directly (``_import_built``)."""
    import json
    import sys

    from torch.utils.cpp_extension import load

    ext = load(name=build_name(), sources=[str(p) for p in kernel_sources()], extra_include_paths=[str(CSRC)],
               extra_cflags=CFLAGS, extra_ldflags=["-pthread"], verbose=False)
    try:
        _save_cache(_built_record(), {"module": str(Path(ext.__file__).resolve()), "torch": torch.__version__,
                                      "python": sys.version, "extensions_dir": settings.torch_extensions_dir()})
    except (OSError, AttributeError, TypeError) as e:  # an unwritable home: the next process builds again
        log.info("draftwise: the kernel's location was not noted (%s)", e)
    try:
        _prune_builds()
    except OSError as e:
        log.info("draftwise: old kernel builds not pruned (%s)", e)
    return ext


BUILD_KEEP_DAYS = 30  # a build no process has imported for this long is removed when another one is built


def _prune_builds(keep_days: float = BUILD_KEEP_DAYS) -> list[str]:
    """Remove the kernel builds (~7 MB each, one per source change, under torch's extensions folder) that no
    process has imported for ``keep_days``: each build's note in ``$DRAFTWISE_HOME/kernels`` is touched by every
    import (``_import_built``), so a build another installation still uses stays. Only folders a note names, whose
    name is the note's build (``draftwise_kernels_*``), are removed, with the note (the build's cached tunings,
    a few hundred bytes each, stay). Runs after a new build, the only time builds accumulate. Returns the builds
    removed."""
    import json
    import shutil
    import time

    folder, current = settings.home() / "kernels", _built_record().name
    cutoff = time.time() - keep_days * 86400
    removed = []
    for rec in folder.glob("built-draftwise_kernels_*.json"):
        try:
            if rec.name == current or rec.stat().st_mtime > cutoff:
                continue
            name = rec.name[len("built-"):-len(".json")]
            build = Path(json.loads(rec.read_text())["module"]).parent
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if build.name == name and build.is_dir():
            shutil.rmtree(build, ignore_errors=True)
        rec.unlink(missing_ok=True)
        removed.append(name)
    if removed:
        log.info("draftwise: removed %d kernel build(s) unused for %d days: %s", len(removed), keep_days,
                 ", ".join(removed))
    return removed


def _import_built():
    """The module an earlier process built from these very sources and flags (its name is their hash) under
    this torch and Python, into the same extensions folder, imported directly: torch's builder costs ~0.15 s
    per process even when there is nothing to build (it imports setuptools and runs ninja). None when there is
    no such note, or it was made under another ``TORCH_EXTENSIONS_DIR`` (a fresh folder means: build it), or
    the module is gone or does not import (then ``_build`` runs)."""
    import importlib.util
    import json
    import sys

    try:
        rec = json.loads(_built_record().read_text())
        path = Path(rec["module"])
        if rec["torch"] != torch.__version__ or rec["python"] != sys.version or not path.is_file() \
                or rec.get("extensions_dir") != settings.torch_extensions_dir():  # a build under another root
            return None
        spec = importlib.util.spec_from_file_location(build_name(), path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.isa()  # a module of the kernel's, callable
        try:
            os.utime(_built_record())  # in use: kept by _prune_builds
        except OSError:
            pass
        return mod
    except Exception as e:  # no note, a module being rebuilt, another ABI, ...: torch's builder decides
        log.debug("draftwise: no directly importable kernel build (%s: %s)", type(e).__name__, e)
        return None


def extension():
    """The compiled kernel module, or None when it cannot be built here."""
    global _ext, _ext_failed, _ext_error
    if _ext is not None or _ext_failed:
        return _ext
    with _ext_lock:
        if _ext is None and not _ext_failed:
            if settings.kernels_disabled():
                _ext_failed, _ext_error = True, "disabled by DRAFTWISE_NO_KERNELS=1"
                return None
            try:
                _ext = _import_built() or _build()
            except Exception as e:  # no compiler, no ninja, ...
                log.warning("draftwise: quantized kernel unavailable (%s); using the slower torch path", e)
                _ext_failed, _ext_error = True, str(e).splitlines()[0] if str(e) else type(e).__name__
                return None
            forced = (settings.forced_isa() or "").strip()
            _check_amx(_ext, forced)
            if forced and not _ext.set_isa(forced):
                from ..errors import InvalidParameterError

                have = ", ".join(_ext.available_isas())
                raise InvalidParameterError(f"DRAFTWISE_ISA={forced!r}: this CPU cannot run that path, or it is unknown"
                                            f"{_amx_why(_ext, forced)} (available here: {have}; also 'vnni', 'auto')")
            if not forced and settings.tune_kernels():
                try:
                    _tune_multi(_ext)
                except Exception as e:  # an unwritable cache, ...: the default path for every call
                    log.warning("draftwise: kernel path tuning skipped (%s: %s)", type(e).__name__, e)
            if not forced and settings.tune_kernels():
                try:
                    _tune_prefetch(_ext)
                except Exception as e:  # as above: prefetching into L1, as before any tuning
                    log.warning("draftwise: kernel prefetch tuning skipped (%s: %s)", type(e).__name__, e)
                try:
                    _tune_kq6(_ext)  # after the prefetch level: each loop is timed as the model will run it
                except Exception as e:  # as above: Q6_K's many-rows loop, as before any tuning
                    log.warning("draftwise: kernel Q6_K loop tuning skipped (%s: %s)", type(e).__name__, e)
                try:
                    _tune_amx(_ext)
                except Exception as e:  # as above: the tiles from dw::kAmxMinRowsDefault rows
                    log.warning("draftwise: AMX row tuning skipped (%s: %s)", type(e).__name__, e)
    return _ext


def _check_amx(ext, forced: str) -> None:
    """The AMX path (csrc/arch/x86/amx.h) is used only after its tile kernel gave the scalar reference's bits
    on this machine: some virtual machines advertise AMX and fault on it. Where cpuid and Linux offer the
    tiles, the check runs once per kernel build, CPU and host, in a forked child (a fault kills only the
    child), and its verdict is cached in ``$DRAFTWISE_HOME/kernels``; a refusal is logged with its reason and
    the K-quant rule stays on AVX512-VNNI. Elsewhere (no AMX: the usual case) nothing runs."""
    import json

    state, _ = ext.amx_status()
    if state != "unchecked":
        return
    cache, sig = _machine_cache(ext, "amx", platform.node(), platform.release())
    try:
        cached = json.loads(cache.read_text())
        ok, reason = bool(cached["verified"]), str(cached["reason"])
        ext.amx_set_verdict(ok, reason)
        fresh = False
    except (OSError, ValueError, KeyError, TypeError):
        ok, reason = ext.amx_verify("hardware")
        fresh = True
        try:
            _save_cache(cache, {"verified": ok, "reason": reason, "signature": sig})
        except OSError as e:  # checked again by the next process
            log.warning("draftwise: the AMX verdict was not cached (%s)", e)
    if ok:
        log.info("draftwise: AMX path verified (%s)", reason)
        if not forced:
            ext.set_isa("auto")  # the best path again, now that amx may be it
    else:
        (log.warning if fresh else log.info)("draftwise: AMX path refused, the K-quant rule stays on avx512vnni: %s",
                                             reason)


def _amx_why(ext, name: str) -> str:
    """`` (AMX <state>: <reason>)`` when ``name`` is ``amx`` and the path is not usable, else ''."""
    if name != "amx":
        return ""
    state, reason = ext.amx_status()
    return f" (AMX {state}: {reason})"


def amx_info() -> dict:
    """The AMX path's state (``not built`` / ``unavailable`` / ``unchecked`` / ``verified`` / ``refused``) and
    why; ``not built`` with the kernel's error when the kernel itself is not built."""
    ext = extension()
    if ext is None:
        return {"state": "not built", "reason": f"the kernel is not built here ({_ext_error})"}
    state, reason = ext.amx_status()
    return {"state": state, "reason": reason}


MULTI_MARGIN = 0.05  # another path takes the calls of 3+ rows only when it is this much faster


def _tune_multi(ext) -> None:
    """Calls of ``kMultiRows`` (3) rows or more — verifying drafts, short prefills — are compute-bound, and
    the groups-of-32 code's default path is not always the fastest there (AMD Zen 5: at 8 rows
    ``avx512vnni`` is slower than ``avx512``; at one row every path waits on memory alike). So each path
    the CPU has is timed once on an 8-row int4 and int8 matmul, and a path more than ``MULTI_MARGIN``
    faster than the default takes those calls. (The K-quant rule, the GGUF formats' own, always runs on the default
    path: AVX512-VNNI is 1.3-1.6x AVX-512 there at 4-16 rows.) Every path computes the same bits: this
    choice moves speed, never a token. The result is cached per kernel build, CPU and thread count in ``$DRAFTWISE_HOME/kernels``;
    ``DRAFTWISE_TUNE=0`` (or ``DRAFTWISE_ISA``) skips it."""
    import json

    default = ext.isa()
    paths = [p for p in ext.available_isas() if p != "scalar"]
    if len(paths) < 2:
        return
    cache, sig = _machine_cache(ext, "tune", str(torch.get_num_threads()))
    try:
        choice = json.loads(cache.read_text())["multi"]
    except (OSError, ValueError, KeyError):
        try:
            times = _time_paths(ext, paths)
        finally:
            ext.set_isa(default)
        best = min(times, key=times.get)
        choice = best if times[best] < (1 - MULTI_MARGIN) * times[default] else default
        _save_cache(cache, {"multi": choice, "default": default, "seconds": times, "signature": sig})
    if choice != default and choice in paths:
        ext.set_isa_multi(choice)


# GGUF bytes of one block (KQ_BLOCK values) of each format the K-quant kernel computes (gguf_quant.KQ_TYPES)
_GGUF_BLOCK_BYTES = {12: 144, 14: 210, 102: 18, 103: 20, 106: 22, 108: 34}
PREFETCH_MARGIN = 0.08  # a format's codes are prefetched into L2 only when that is this much faster (Q4_K on Zen 4: 4-6 %, either way by shape)


def _tune_prefetch(ext) -> None:
    """Where the vector kernels prefetch each format's codes: the first-level cache (as everywhere before
    this was measured) or the second. One-token decoding streams every weight from memory once, and how fast
    a format's codes stream depends on that choice differently per CPU and format: on AMD Zen 4 Q6_K's three
    code streams per super-block ran at ~19 GB/s into L1 and ~27 GB/s into L2, Q5_0 and Q8_0 (the 0.5B draft
    model's) 1.1-1.4x faster into L2, while Q4_K gained nothing. So each format is timed both ways on one row
    over a matrix well beyond the last-level cache (the memory-bound call), and L2 is taken where it is
    ``PREFETCH_MARGIN`` faster. A hint only: the same bits either way. Cached like ``_tune_multi``;
    ``DRAFTWISE_TUNE=0`` (or ``DRAFTWISE_ISA``, as there) keeps L1 for every format."""
    import json

    from .gguf_quant import KQ_TYPES

    cache, sig = _machine_cache(ext, "prefetch", str(torch.get_num_threads()))
    try:
        choice = {int(f): bool(v) for f, v in json.loads(cache.read_text())["l2"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        times = {name: _time_prefetch(ext, fmt) for name, fmt in KQ_TYPES.items()}
        choice = {fmt: times[name]["l2"] < (1 - PREFETCH_MARGIN) * times[name]["l1"] for name, fmt in KQ_TYPES.items()}
        _save_cache(cache, {"l2": {str(f): v for f, v in choice.items()}, "seconds": times, "signature": sig})
    for fmt, l2 in choice.items():
        if fmt in KQ_TYPES.values():
            ext.set_kq_prefetch_l2(fmt, l2)


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size as Linux reports it (0 where it does not)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=0)


def zero_matrix(ext, fmt: int, K: int, nbytes: int) -> tuple[torch.Tensor, int, int]:
    """(packed codes, N, GGUF bytes) of an all-zero format-``fmt`` matrix of K values a row and about ``nbytes`` of
    GGUF codes (N a multiple of 16, at least 16): for timing, where the kernel's time does not depend on the values
    (``_streamed_matrix``; the benchmark's roofline stream)."""
    row = K // KQ_BLOCK[fmt] * _GGUF_BLOCK_BYTES[fmt]  # GGUF bytes of one weight row of K values
    N = max(16, nbytes // row // 16 * 16)
    return ext.kq_pack(torch.zeros(N * row, dtype=torch.uint8), fmt, N, K, torch.empty(0, dtype=torch.uint8)), N, N * row


def _streamed_matrix(ext, fmt: int, K: int = 1536) -> tuple[torch.Tensor, int, int]:
    """(packed codes, N, K) of a format-``fmt`` matrix of 3x the last-level cache (96-256 MB of codes, zero
    bytes: the kernel's time does not depend on the values), so that a call streams it from memory as a model's
    pass does. K = 1536 by default, a 1.5B model's hidden size: the tiles' length matters (Zen 4's Q4_K: prefetched
    into L2 slower at 1536, faster at 4864)."""
    w, N, _ = zero_matrix(ext, fmt, K, min(max(3 * _last_level_cache_bytes(), 96 << 20), 256 << 20))
    return w, N, K


def _time_choices(ext, fmt: int, rows: int, choices: dict, K: int = 1536, N: int | None = None,
                  matrix: tuple[torch.Tensor, int, int] | None = None) -> dict[str, float]:
    """Seconds of a ``rows``-row call of format ``fmt`` over ``_streamed_matrix`` (rows of ``K`` values; ``matrix``:
    one the caller packed already) under each choice (name -> a function that sets it), the best of 5, the choices
    alternated after a round that warms up (the fresh codes' page faults, the threads). With ``N``, the same bytes as
    a model holds them: matrices of N outputs, one call over each in turn (as a 1.5B's ffn_down, N = 1536: 11 MB a
    call)."""
    import time

    w, Nw, K = matrix if matrix is not None else _streamed_matrix(ext, fmt, K)
    parts = [(w, Nw)]
    if N is not None and N < Nw:
        size = N // 16 * (w.numel() // (Nw // 16))  # bytes of N outputs: N / 16 tiles of 16 columns
        parts = [(w[i * size:(i + 1) * size], N) for i in range(w.numel() // size)]
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(0))  # (rows, K)
    best = dict.fromkeys(choices, float("inf"))
    for rnd in range(6):
        for name, choose in choices.items():
            choose()
            t0 = time.perf_counter()
            for part, n in parts:
                ext.qmm_kq(x, part, fmt, n)
            if rnd:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _time_prefetch(ext, fmt: int) -> dict[str, float]:
    """Seconds of a one-row call of format ``fmt`` from memory (``_time_choices``) with each prefetch
    level; the format's setting is restored."""
    before = ext.kq_prefetch_l2(fmt)
    try:
        return _time_choices(ext, fmt, 1, {"l1": lambda: ext.set_kq_prefetch_l2(fmt, False),
                                           "l2": lambda: ext.set_kq_prefetch_l2(fmt, True)})
    finally:
        ext.set_kq_prefetch_l2(fmt, before)


KQ6_MARGIN = 0.05  # Q6_K's few-rows loop takes a call shape's calls only when it is this much faster there
# the call shapes timed for Q6_K's loop, one per bit of dw::kq6_shape (csrc/core/kquant.h): (rows, K) -> its name
KQ6_SHAPES = {(6, 1536): "<=6 rows, K<=4096", (6, 8960): "<=6 rows, K>4096", (8, 1536): "7-8 rows, K<=4096",
              (8, 8960): "7-8 rows, K>4096", (16, 1536): ">8 rows, K<=4096", (16, 8960): ">8 rows, K>4096"}
KQ6_ALL_MANY = (1 << len(KQ6_SHAPES)) - 1  # dw::kKq6AllMany
KQ6_LONG_K = 4096  # dw::kKq6LongK: longer rows are the other shape class


def _kq6_loop_name(mask: int) -> str:
    """kernel_info's ``q6k_loop``: the loop every shape takes, or the few-rows loop's shapes and the rest."""
    if mask == KQ6_ALL_MANY:
        return "many-rows"
    if mask == 0:
        return "few-rows"
    few = [name for bit, name in enumerate(KQ6_SHAPES.values()) if not mask >> bit & 1]
    return "few-rows at " + "; ".join(few) + ", many-rows elsewhere"


AMX_MARGIN = 0.05  # the tiles take a format's calls from a row count on only where they are this much faster
AMX_ROWS = (16, 24, 32, 64, 128)  # the row counts timed (verification up to 32, prompt chunks up to 128)
AMX_NEVER = 1 << 30  # min rows where the tiles never won: every call on AVX512-VNNI


def _leading(matrix: tuple[torch.Tensor, int, int], fraction: float) -> tuple[torch.Tensor, int, int]:
    """The first ``fraction`` of a packed (codes, N, K) matrix's columns, in whole tiles of 16: (codes, N', K)."""
    w, N, K = matrix
    tiles = max(1, int(N // 16 * fraction))
    return w[:tiles * (w.numel() // (N // 16))], 16 * tiles, K


def _amx_min_rows(times: dict[int, dict[str, float]]) -> int:
    """The fewest rows from which the tiles were ``AMX_MARGIN`` faster at every timed row count, else AMX_NEVER."""
    best = AMX_NEVER
    for rows in sorted(times, reverse=True):
        if not times[rows]["tiles"] < (1 - AMX_MARGIN) * times[rows]["vnni"]:
            break
        best = rows
    return best


def _tune_amx(ext) -> None:
    """From how many rows the ``amx`` path's calls run on the tiles (``dw::amx_min_rows``, csrc/arch/x86/amx.h), per
    K-quant format. The tiles' cost per super-block of 16 columns hardly depends on the rows (each tdpbsud takes 16
    cycles for 1 or 16 rows, and the weights' B operands are built once per call), AVX512-VNNI's grows with them: on
    an Intel Xeon (2026-12-07, 2 cores, the 1.5B's matrices from memory) the tiles lost at 8-24 rows (Q4_K 16 rows:
    83 against 64 ms) and were within -5 % / +10 % at 32 (Q4_K 121 against 131 ms, Q6_K 53 against 59 in one run,
    129 / 123 and 50 / 55 in another), ahead at 64-128 rows, a prompt chunk's (Q4_K K = 1536 at 128 rows: 275 against
    374 ms). So both are timed once from memory at ``AMX_ROWS`` rows (~5 s), and the tiles
    take the calls from the fewest rows where they won by ``AMX_MARGIN`` there and at every larger count timed, else
    none (``AMX_NEVER``). Speed only, the same bits (the AMX check and the selftest compare the tiles with
    the reference). Only where the amx path runs; cached like ``_tune_multi``; ``DRAFTWISE_TUNE=0`` (or
    ``DRAFTWISE_ISA``) keeps ``dw::kAmxMinRowsDefault``."""
    import json

    from .gguf_quant import KQ_TYPES

    if ext.isa() != "amx":
        return
    cache, sig = _machine_cache(ext, "amx-rows", str(torch.get_num_threads()))
    try:
        chosen = {int(f): int(r) for f, r in json.loads(cache.read_text())["min_rows"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        chosen, seconds = {}, {}
        for name in ("Q4_K", "Q6_K"):
            fmt = KQ_TYPES[name]
            before = ext.amx_min_rows(fmt)
            try:
                matrix = _streamed_matrix(ext, fmt, 1536)
                choices = {"tiles": lambda f=fmt: ext.set_amx_min_rows(f, 1),
                           "vnni": lambda f=fmt: ext.set_amx_min_rows(f, AMX_NEVER)}
                # past 32 rows a call is compute-bound: a leading part of the matrix (from memory still, 64 MB at
                # 128 rows) keeps each timing as short as the 32-row one
                times = {rows: _time_choices(ext, fmt, rows, choices, matrix=_leading(matrix, min(1.0, 32 / rows)))
                         for rows in AMX_ROWS}
                del matrix
            finally:
                ext.set_amx_min_rows(fmt, before)
            chosen[fmt], seconds[name] = _amx_min_rows(times), {str(r): t for r, t in times.items()}
        _save_cache(cache, {"min_rows": {str(f): r for f, r in chosen.items()}, "seconds": seconds, "signature": sig})
    for fmt, rows in chosen.items():
        ext.set_amx_min_rows(fmt, rows)


def _tune_kq6(ext) -> None:
    """Which loop Q6_K's calls of more than 4 rows take (``dw::kq6_many_at``, csrc/core/kquant.h), per call shape: on
    AVX512-VNNI one that decodes each code vector once for 8 rows a pass, or the few-rows loop (up to 6 rows in one
    pass, more in passes of 4; on AVX2 the same two at 2-4 rows). Which is faster is the CPU's and the shape's: the
    1.5B's 8-token pass took 18 % less with the first on AMD Zen 4 (22.6 -> 18.6 ms in its 29 Q6_K matrices); on AMD
    Zen 5 (since the dot products read their activation bytes themselves) the second ran every call of 6 rows 6-11 %
    faster and the output head (K = 1536) at 8 rows 11 %, the first ffn_down (K = 8960, whose tiles the few-rows
    loop re-reads from L2) at 8 rows 13 % and the head at 16-32 rows 5-7 % (ffn_down there about even). So both loops
    are timed once from memory on each shape of ``KQ6_SHAPES`` (6, 8 and 16 rows of 1536 values, one matrix as the
    output head; of 8960, matrices of 1536 outputs as ffn_down; ~0.4 s, each matrix packed once), and the few-rows
    loop takes a shape where it is ``KQ6_MARGIN`` faster. Speed only, the same bits (the selftest compares both with
    the reference). Cached like ``_tune_multi``; ``DRAFTWISE_TUNE=0`` (or ``DRAFTWISE_ISA``) keeps the many-rows loop."""
    import json

    from .gguf_quant import KQ_TYPES

    cache, sig = _machine_cache(ext, "kq6", str(torch.get_num_threads()))
    try:
        mask = int(json.loads(cache.read_text())["mask"])
    except (OSError, ValueError, KeyError, TypeError):
        mask, seconds, fmt = 0, {}, KQ_TYPES["Q6_K"]
        shapes = list(KQ6_SHAPES.items())
        try:
            for K in sorted({K for _, K in KQ6_SHAPES}):  # each K's matrix packed once, one held at a time
                matrix = _streamed_matrix(ext, fmt, K)
                for bit, ((rows, k), name) in enumerate(shapes):
                    if k != K:
                        continue
                    times = _time_choices(ext, fmt, rows, {"many": lambda: ext.set_kq6_many(True),
                                                           "few": lambda: ext.set_kq6_many(False)},
                                          K, None if K <= KQ6_LONG_K else 1536,  # long rows: as the 1.5B's ffn_down
                                          matrix=matrix)
                    seconds[name] = times
                    if not times["few"] < (1 - KQ6_MARGIN) * times["many"]:
                        mask |= 1 << bit
                del matrix
        finally:
            ext.set_kq6_many(True)
        _save_cache(cache, {"mask": mask, "loops": _kq6_loop_name(mask), "seconds": seconds, "signature": sig})
    ext.set_kq6_many_mask(mask)


def _time_paths(ext, paths: list[str], rows: int = 8) -> dict[str, float]:
    """Seconds per ``rows``-row call on each path: the best of several timings of an int4 matmul (groups of
    32 with mins, as Q4_0 / Q4_1 convert) and an int8 one (groups of 32, as Q8_0 / Q5_0), 2048 × 1536 each,
    summed. (The K-quant rule's calls run on the default path: it is the fastest there at every row count.)"""
    import time

    g = torch.Generator().manual_seed(0)
    N, K = 2048, 1536
    x = torch.randn(rows, K, generator=g)  # (8, K)
    cases = [(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g), 32, 4),
             (torch.randint(-32, 32, (N, K), dtype=torch.int8, generator=g), 32, 8)]
    cases = [(q, torch.rand(N, K // G, generator=g), torch.rand(N, K // G, generator=g) if bits == 4 else
              torch.empty(0), G, bits) for q, G, bits in cases]  # scales (N, K/G); mins for int4
    for p in paths:  # warm-up
        ext.set_isa(p)
        for q, scale, minv, G, bits in cases:
            for _ in range(2):
                ext.qmm(x, q, scale, minv, G, bits, 8)
    # the paths timed in turn, five rounds, the best of each: a busy second slows every path, not just one
    best = {(p, i): float("inf") for p in paths for i in range(len(cases))}
    for _ in range(5):
        for p in paths:
            ext.set_isa(p)
            for i, (q, scale, minv, G, bits) in enumerate(cases):
                t0 = time.perf_counter()
                for _ in range(4):
                    ext.qmm(x, q, scale, minv, G, bits, 8)
                best[p, i] = min(best[p, i], time.perf_counter() - t0)
    return {p: sum(best[p, i] for i in range(len(cases))) / 4 for p in paths}


def cpu_fields() -> dict[str, str]:
    """The first CPU's entries of /proc/cpuinfo ({} where there is none)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines()) if _}


def cpu_name() -> str:
    """The CPU's name as Linux reports it (else what ``platform`` knows)."""
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def _machine_cache(ext, kind: str, *extra: str) -> tuple[Path, str]:
    """(file, signature) of a result that holds for this kernel build and CPU (and ``extra``): a JSON file
    ``<kind>-<hash>.json`` in ``$DRAFTWISE_HOME/kernels`` (the path tuning, the AMX verdict)."""
    sig = " ".join((build_name(), ext.cpu_features(), _cpu_model(), *extra))
    return settings.home() / "kernels" / f"{kind}-{hashlib.sha256(sig.encode()).hexdigest()[:16]}.json", sig


def _save_cache(path: Path, record: dict) -> None:
    """Write ``record`` as JSON to ``path`` whole or not at all (a temporary file renamed into place): two
    processes writing at once leave one complete record, never a torn one."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cpu_model() -> str:
    """Vendor, family, model and name of the first CPU (the tuning cache's key; another CPU re-tunes)."""
    fields = cpu_fields()
    if not fields:
        return platform.processor()
    keep = ("vendor_id", "cpu family", "model", "model name", "CPU implementer", "CPU part")
    return "; ".join(v for k, v in fields.items() if k in keep)


def isa() -> str:
    """The instruction-set path the kernel uses ('none' when it is not built)."""
    ext = extension()
    return ext.isa() if ext is not None else "none"


def isa_multi() -> str:
    """The path of calls with 3 or more rows (``_tune_multi``): ``isa()`` unless another measured faster."""
    ext = extension()
    return (ext.isa_multi() or ext.isa()) if ext is not None else "none"


def available_isas() -> list[str]:
    """Paths compiled in and supported by this CPU, lowest first (empty when the kernel is not built)."""
    ext = extension()
    return list(ext.available_isas()) if ext is not None else []


def set_isa(name: str) -> None:
    """Run the kernel on path ``name`` from now on (process-wide, for every call: a multi-row path chosen by
    ``_tune_multi`` is cleared), e.g. to test the AVX2 path on an AVX-512 machine. Raises
    InvalidParameterError when this CPU cannot run it."""
    from ..errors import InvalidParameterError

    ext = extension()
    if ext is None:
        raise InvalidParameterError(f"the kernel is not built here ({_ext_error})")
    if not ext.set_isa(name):
        raise InvalidParameterError(f"ISA path {name!r} is unknown or this CPU cannot run it{_amx_why(ext, name)} "
                                    f"(available: {', '.join(ext.available_isas())})")


@contextlib.contextmanager
def using_isa(name: str):
    """Within this block the kernel runs on path ``name`` (tests)."""
    ext = extension()
    prev, multi = isa(), ext.isa_multi() if ext is not None else ""
    set_isa(name)
    try:
        yield
    finally:
        set_isa(prev)
        if multi:
            ext.set_isa_multi(multi)


def kernel_info() -> dict:
    """What ``draftwise info`` prints: CPU features, the chosen path, whether the kernel built."""
    ext = extension()
    info = {"machine": platform.machine(), "kernel_built": ext is not None, "build": build_name(),
            "isa": isa(), "isa_multi_row": isa_multi(), "available_isas": available_isas(),
            "forced_by_env": settings.forced_isa(),
            "activations": "fp32" if activation_bits() == 32 else "int8",
            "openmp_spin": f"long ({settings.openmp_spinning_runtime()}: started before draftwise set its spin, "
                           "or set long); the decode loop's torch ops run on one thread"
                           if settings.openmp_spins_long() else "short"}
    if ext is not None:
        info["cpu_features"] = ext.cpu_features().split()
        from .gguf_quant import KQ_TYPES

        info["prefetch_l2"] = [n for n, f in KQ_TYPES.items() if ext.kq_prefetch_l2(f)] or "none"
        info["q6k_loop"] = _kq6_loop_name(ext.kq6_many_mask())
        amx = amx_info()
        info["amx"] = amx["state"] + (f": {amx['reason']}" if amx["reason"] else "")
        if ext.isa() == "amx":  # from how many rows each K-quant format's calls run on the tiles
            info["amx_tiles"] = ", ".join(
                f"{n} from {r} rows" if r < AMX_NEVER else f"{n} never (AVX512-VNNI was faster)"
                for n, r in ((n, ext.amx_min_rows(KQ_TYPES[n])) for n in ("Q4_K", "Q6_K")))
    else:
        info["error"] = _ext_error
    return info


def activation_bits() -> int:
    """8 (int8 activations for int4 / int8 codes, on every path) unless DRAFTWISE_EXACT_ACTIVATIONS=1 or
    inside ``exact_activations()``."""
    if getattr(_mode, "exact", False):
        return 32
    return 32 if settings.exact_activations() else 8


def exact_activations():
    """Within this block models load as with DRAFTWISE_EXACT_ACTIVATIONS=1 (fp32 activations: Q4_K / Q6_K in
    the groups-of-32 code, which has an fp32-activation path; ``draftwise agreement``'s FORMAT:fp32)."""
    return _mode_flag("exact", True)


def set_activation_bits(model: nn.Module, bits: int) -> None:
    """Run every quantized linear of ``model`` with int8 (8) or fp32 (32) activations."""
    for m in model.modules():
        if isinstance(m, QLinear) and m.bits in (4, 8):
            m.act_bits = bits
        elif isinstance(m, QLinear) and m.bits in KQ_BITS and bits != 8:
            raise ValueError(f"a {KQ_NAMES[m.bits]} linear (the K-quant rule) has int8 activations only: load the model with "
                             "DRAFTWISE_EXACT_ACTIVATIONS=1 for fp32 activations")


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """(M, K) fp32 → the fp32 values the int8-activation kernel multiplies by: per row and block of 32,
    round(x · 127 / max|x|) · max|x| / 127 (the reference its tests compare against)."""
    M, K = x.shape
    b = x.float().view(M, K // ACT_BLOCK, ACT_BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).view(M, K)


# QLinear ``bits`` of the K-quant rule (csrc/core/kquant.h: kKq4 ... kKb80) -> bytes of a 16-column tile per
# block, and the block's values: Q4_K, Q6_K (ggml ids 12, 14; super-blocks of 256) and the block formats Q4_0,
# Q4_1, Q5_0, Q8_0 (100 + their ggml ids; blocks of 32)
KQ_BITS = {12: 2368, 14: 3392, 102: 288, 103: 320, 106: 352, 108: 544}
KQ_BLOCK = {12: 256, 14: 256, 102: 32, 103: 32, 106: 32, 108: 32}
KQ_NAMES = {12: "Q4_K", 14: "Q6_K", 102: "Q4_0", 103: "Q4_1", 106: "Q5_0", 108: "Q8_0"}


def kq_shape(q: torch.Tensor, bits: int) -> tuple[int, int]:
    """(N, K) of a K-quant code q: (N / 16 tiles, K / block * tile bytes) uint8."""
    return q.shape[0] * 16, q.shape[1] // KQ_BITS[bits] * KQ_BLOCK[bits]


def dequantize(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, group: int, bits: int) -> torch.Tensor:
    """(N, K) float32 weights from the packed code (the reference the kernel is tested against)."""
    N = q.shape[0]
    if bits in KQ_BITS:  # the K-quant code: its own de-quantization (kquant.h kq_dequant_rows)
        n, K = kq_shape(q, bits)
        return extension().kq_dequant(q.contiguous().view(-1), bits, n, K)
    if bits in (16, 32):  # dense bf16 / fp32, stored as an integer view (see QLinear.dense)
        return q.view(torch.bfloat16 if bits == 16 else torch.float32).float()
    if bits == 4:
        b = q.view(N, -1, 16)  # (N, K/32, 16)
        vals = torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(N, -1).float()  # (N, K)
    else:
        vals = q.float()
    K = vals.shape[1]
    w = vals.view(N, K // group, group) * scale.view(N, -1, 1)
    if minv is not None and minv.numel():
        w = w - minv.view(N, -1, 1)
    return w.view(N, K)


_weights_epoch = 0  # bumped whenever a watched module's attribute is assigned (a weight, a sub-module replaced)


def weights_epoch() -> int:
    """A counter that changes whenever a ``WatchedModule``'s attribute is assigned or a model's tensors are
    converted: what a compiled plan over a model's weights (the transformer's ``Stack``) is keyed on."""
    return _weights_epoch


def bump_weights_epoch() -> None:
    global _weights_epoch
    _weights_epoch += 1


class WatchedModule(nn.Module):
    """An ``nn.Module`` whose attribute assignments (weights, sub-modules) bump ``weights_epoch``."""

    def __setattr__(self, name: str, value) -> None:
        bump_weights_epoch()
        super().__setattr__(name, value)


class QLinear(WatchedModule):
    """y = x @ W^T (+ b) with W held as (q, scale, minv) groups (csrc/core/qmm.h), or, for ``bits`` in ``KQ_BITS``,
    as the GGUF's own Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks interleaved by 16 columns
    (csrc/core/kquant.h; ``scale`` is then (N, 0))."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, group: int, bits: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.bits, self.group = bits, group
        if bits in KQ_BITS:
            self.out_features, self.in_features = kq_shape(q, bits)
        else:
            self.in_features = q.shape[1] * (2 if bits == 4 else 1)
            self.out_features = q.shape[0]
        self.register_buffer("q", q.contiguous())  # (N, K) int8 | (N, K/2) uint8 | (N, K) int16/int32 views
        self.register_buffer("scale", scale.float().contiguous())  # (N, K/G)
        self.register_buffer("minv", (minv if minv is not None else torch.empty(0)).float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._dense: torch.Tensor | None = None  # fallback only
        self.act_bits = activation_bits() if bits in (4, 8) else 8 if bits in KQ_BITS else 32

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "QLinear":
        """Dense bf16 or fp32 weights through the same batch-invariant kernel (one group per row)."""
        bits = {torch.bfloat16: 16, torch.float32: 32}[weight.dtype]
        # held as an integer view, so that module.to(dtype) never converts the stored weights
        raw = weight.contiguous().view(torch.int16 if bits == 16 else torch.int32)
        return cls(raw, torch.ones(weight.shape[0], 1), None, weight.shape[1], bits, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step makes ~130 of these calls: the common case reads its buffers straight from the
        # module's dict and converts nothing (each skipped torch call is ~1 us, the kernel call ~5-20 us)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        ext = _ext if _ext is not None else extension()
        buffers = self._buffers
        scale, minv = buffers["scale"], buffers["minv"]
        if scale.dtype != torch.float32 or minv.dtype != torch.float32:  # someone called .to(dtype)
            scale, minv = scale.float(), minv.float()
        if self.bits in KQ_BITS:  # the K-quant rule, for prompts too: an extra row costs its dot products only
            y = ext.qmm_kq(x2, buffers["q"].view(-1), self.bits, self.out_features)
        elif x2.shape[0] > BULK_MIN_ROWS and getattr(_mode, "bulk", False) and not getattr(_mode, "no_bulk", False) \
                and _bulk_pays():
            with parallel_torch():
                if ext is not None and self.bits in (4, 8):
                    w = ext.dequantize_bf16(self.q, scale, minv, self.group, self.bits)  # (N, K)
                else:
                    w = dequantize(self.q, scale, minv, self.group, self.bits).to(torch.bfloat16)
                y = (x2.to(torch.bfloat16) @ w.t()).float()
        elif getattr(_mode, "gemm32", False) and x2.shape[0] > BULK_MIN_ROWS:
            with parallel_torch():
                y = x2 @ dequantize(self.q, scale, minv, self.group, self.bits).t()
        elif ext is not None:
            y = ext.qmm(x2, buffers["q"], scale, minv, self.group, self.bits, self.act_bits)
        else:
            if self._dense is None:
                self._dense = dequantize(self.q, self.scale, self.minv, self.group, self.bits)
            y = x2 @ self._dense.t()
        bias = self._parameters.get("bias")  # absent when built without one
        if bias is not None:
            if ext is not None and bias.dtype == torch.float32 and y.dtype == torch.float32:
                ext.add_bias_(y, bias)  # y is this call's own output; no torch thread pool (serial_torch)
            else:
                y.add_(bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fmt = {16: "bf16", 32: "fp32", **{b: f"{n} x16" for b, n in KQ_NAMES.items()}}.get(
            self.bits, f"int{self.bits}, group={self.group}")
        return f"in={self.in_features}, out={self.out_features}, {fmt}"


def quantize_rtn(w: torch.Tensor, bits: int, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest groupwise quantization of dense (N, K) weights (for HF folders / F16 GGUFs).
    int8: symmetric; int4: affine (scale and min per group). Returns (q, scale, minv)."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    if bits == 8:
        scale = g.abs().amax(-1) / 127.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(g / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(N, K)
        return q, scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)  # (N, K/G, G)
    return pack4(q.view(N, K)), scale, -lo


def pack4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 values in [0, 15] → (N, K/2): per 32-group, byte j = q[j] | q[j+16] << 4."""
    N, K = q.shape
    b = q.view(N, K // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(N, K // 2).contiguous()
