"""Giving memory back to the operating system (Linux; a no-op elsewhere).

- ``release_pages(addr, nbytes)``: ``madvise(MADV_DONTNEED)`` over the whole pages inside a range of
  memory this process owns. The pages leave the resident set at once; the next write commits fresh
  zero pages, so the range stays valid (a freed KV-cache row: ``KVCache.release_rows``).
- ``trim_heap()``: glibc's ``malloc_trim(0)``, which returns the free memory of every malloc arena to the
  OS (an idle server: freed activations, tokenizer buffers, numpy temporaries). Not glibc: nothing.
- ``rss_bytes()``: this process's resident set size now (``/proc/self/statm``).
- ``hold_freed_memory()``: glibc keeps what is freed (blocks up to 32 MiB from its heap, no automatic trim)
  for the next allocation instead of unmapping it at once — a server's steps allocate and free the same
  activations every few milliseconds: its RSS then stays at the working set's high-water mark under load
  (flat, no page faults per step), and ``trim_heap()`` (when it goes idle) gives the memory back.

- ``gc_paused()``: Python's cyclic garbage collector off for a block that builds many long-lived objects
  (loading a model), and ``freeze_heap()``: every object alive now moved out of the collector's reach
  (a server process, once its models are loaded: ``draftwise serve`` and each Ray replica) — a full
  collection otherwise walks the ~10^5 objects torch's
  import made, ~0.1 s on these CPUs, freeing nothing.

Every function is safe to call when the facility is missing: it reports ``False`` / ``None``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import mmap
import os
import sys

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # the same number on every Linux architecture

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _libc = None
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only (not musl)
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
_mallopt = getattr(_libc, "mallopt", None) if _malloc_trim is not None else None  # glibc's
if _mallopt is not None:
    _mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _mallopt.restype = ctypes.c_int
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def can_release() -> bool:
    return _libc is not None


def release_pages(addr: int, nbytes: int) -> int:
    """Drop the whole pages inside ``[addr, addr + nbytes)`` from the resident set; the partial pages
    at either end are kept (they may hold neighbouring data). Returns the bytes released (0 when the
    range holds no whole page or the facility is missing)."""
    if _libc is None or nbytes <= 0:
        return 0
    start = -(-addr // PAGE) * PAGE
    end = (addr + nbytes) // PAGE * PAGE
    if end <= start:
        return 0
    if _libc.madvise(ctypes.c_void_p(start), end - start, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) failed: {os.strerror(err)}")
    return end - start


def trim_heap() -> bool:
    """Return malloc's free memory to the OS (glibc). True when it released something."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


def hold_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """glibc: allocations below ``mmap_threshold`` (32 MiB: glibc's largest) come from the heap and stay
    there when freed; free() trims the heap's top only past ``trim_threshold``. Process-wide; for a server,
    which calls ``trim_heap()`` when idle. True when applied (glibc)."""
    if _mallopt is None:
        return False
    return bool(_mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(_mallopt(M_TRIM_THRESHOLD, trim_threshold))


def rss_bytes() -> int | None:
    """Resident set size of this process in bytes (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off inside the block (restored after, if it was on). For loading a model:
    its ~10^4 modules and tensors live as long as the model, so the collections their allocation triggers
    (one full one, ~0.1 s, for a 1.5B model's load) find nothing to free."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_heap() -> None:
    """``gc.freeze()``: every object alive now (imported modules, loaded models, tokenizers) is left out of
    later collections, which then walk only what is made after — a server's full collections stop costing
    ~0.1 s each (vLLM freezes its heap after start-up likewise). Frozen objects are still freed by reference
    counting; only cycles among them are never collected."""
    gc.freeze()
