"""Prompt prefill in exact chunks, and the prefix cache that lets a later prompt skip what it shares.

A prompt is prefilled in chunks of ``PREFILL_CHUNK`` tokens, each a forward of the size a verification pass
has: the path whose every token gets the bits decoding that token alone gives (the kernels compute each row
alone; the attention is the per-token call decoding makes: ``models/transformer.py``, ``EXACT_MAX_T``). So a
position's keys and values are a function of the tokens up to it and nothing else: not of the chunking, not
of whether a prefill, a decode step or a verification pass computed them. On these CPUs the chunked prefill
is as fast as one long pass (the Qwen 1.5B, 64-2048 tokens in chunks of 32: 0.87-1.14x, median 0.96, AMD Zen 4;
chunks of 128 since, 8-20 % faster on an Intel Xeon: ``EXACT_MAX_T``).

``PrefixCache`` keeps those keys and values in blocks of ``BLOCK`` tokens, keyed by a hash chain of all the
tokens from the start to the block's end: a prompt's blocks after its prefill, and a finished sequence's
blocks — prompt and output — when it leaves (``Decoder._remove``). A new prompt starts after the longest run
of blocks it finds: their keys and values are copied into its cache row and only the rest is computed. A cache
hit never changes a bit of the output (``tests/test_prefix.py`` checks the logits, keys and values and every
method's tokens). A chat client resends the whole conversation every turn; with the cache a turn computes
only the new message (from the last answer's final block on), as llama.cpp's server does with a slot's
cache; vLLM calls the block scheme automatic prefix caching.

``DiskBlocks`` keeps the blocks in a folder too (``--prefix-cache-dir``), one safetensors file per block named by
its chain key, under a sub-folder per model identity (weight file, format, kernel build: what decides the bits), so
that the next process — a ``draftwise generate`` run again over the same long document, a restarted server — reads
a prompt's keys and values instead of computing them (llama.cpp's ``--prompt-cache``), least recently used files
first out past the folder's bound. The files are written by a thread of their own (``DiskBlocks.put_chain``), not
by the engine's, which every running stream waits for, and at the lowest CPU priority: a 512 / 2048-token prompt
of the 1.5B is 29 / 117 MB of fp32 keys and values; on an Intel Xeon ``store`` held its caller 30 / 418 ms writing
them and 8 / 30 ms handing them over (the copy out of the cache row), medians of 5. Blocks waiting are served from
memory (``docs/results/xeon-amx-2026-12-07/prefix-writer``).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from pathlib import Path

import torch

from .models.base import KVCache
from .models.transformer import EXACT_MAX_T

PREFILL_CHUNK = EXACT_MAX_T  # tokens per prefill chunk: the longest forward that runs the exact path
BLOCK = 32  # tokens per cached block
# MiB of blocks each model keeps by default (SpeculativeDecoder, `--prefix-cache-mb`): the Qwen 1.5B's keys and
# values are 56 KiB a token, so 512 MiB hold ~9300 tokens; the 0.5B draft's 24 KiB a token
DEFAULT_PREFIX_CACHE_MB = 512
DEFAULT_PREFIX_CACHE_DISK_MB = 4096  # MiB of block files a model keeps in --prefix-cache-dir
DISK_FORMAT = 1  # the block files' layout: part of the folder's name
# bytes of blocks that may wait for a folder's writer; a chain that does not fit waits for none of it (its start
# first: a deeper block is useless without the blocks before it), and the drop is counted
DISK_PENDING_BYTES = 256 << 20
WRITER_NICE = 19  # the writer thread's nice value (Linux)
PRUNE_EVERY = 64  # blocks the writer writes between two prunes of the folder when its queue never drains
CLOSE_TIMEOUT_S = 30.0  # how long the end of a process waits for the writer's last files

log = logging.getLogger("draftwise")
_SHARED: dict[str, "DiskBlocks"] = {}  # DiskBlocks.shared: one instance a folder in this process
_SHARED_LOCK = threading.Lock()


def _block_bytes(k: torch.Tensor, v: torch.Tensor) -> int:
    return k.numel() * k.element_size() + v.numel() * v.element_size()


class DiskBlocks:
    """Blocks of one model's keys and values in ``folder`` (one ``<key>.safetensors`` file each, never pickle),
    least recently used (file modification time) first out past ``budget_bytes``. A file is written whole and
    renamed into place, so another process never reads half of one; a file that does not read back as the
    shapes expected is a miss (and removed). ``put_chain`` hands blocks to a writer thread (started with the
    first, a daemon) and returns; until written they are served from memory (``has``, ``get``). ``flush`` waits
    for the writer; ``close`` (also at the process's end) flushes and stops it. Thread-safe."""

    def __init__(self, folder: Path | str, budget_bytes: int, pending_bytes: int = DISK_PENDING_BYTES):
        self.folder = Path(folder)
        self.budget = int(budget_bytes)
        self.pending_limit = int(pending_bytes)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.read_blocks = self.written_blocks = self.dropped_blocks = 0
        self._pending: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # blocks the writer has not written
        self._order: deque[bytes] = deque()  # their keys, in the order to write them
        self.pending_bytes = 0
        self._cv = threading.Condition()
        self._busy = False  # the writer holds a block it has taken from the queue
        self._writer: threading.Thread | None = None
        self._closed = False
        self._since_prune = 0  # blocks written since the last prune

    @classmethod
    def shared(cls, folder: Path | str, budget_bytes: int) -> "DiskBlocks":
        """The one instance of this process for ``folder`` (made on first use): decoders over the same folder see
        each other's blocks while they wait for the writer."""
        key = str(Path(folder).resolve())
        with _SHARED_LOCK:
            d = _SHARED.get(key)
            if d is None or d._closed:
                d = _SHARED[key] = cls(folder, budget_bytes)
            d.budget = max(d.budget, int(budget_bytes))
            return d

    @property
    def pending_blocks(self) -> int:
        """Blocks waiting for the writer."""
        return len(self._pending)

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.safetensors"

    def has(self, key: bytes) -> bool:
        with self._cv:
            if key in self._pending:
                return True
        return self._path(key).is_file()

    def get(self, key: bytes, shape: tuple[int, ...], dtype: torch.dtype):
        """(k, v) of the block ``key``, or None: not kept, or not of ``shape`` and ``dtype``."""
        from safetensors.torch import load_file

        with self._cv:
            hit = self._pending.get(key)
        if hit is not None:  # waiting for the writer: the tensors themselves
            k, v = hit
            if tuple(k.shape) == tuple(v.shape) == shape and k.dtype == v.dtype == dtype:
                self.read_blocks += 1
                return k, v
            return None
        path = self._path(key)
        try:
            t = load_file(str(path))
            k, v = t["k"], t["v"]
            if tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != dtype or v.dtype != dtype:
                raise ValueError(f"a block of {tuple(k.shape)} {k.dtype}, expected {shape} {dtype}")
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged or foreign file: a miss, and gone
            log.warning("draftwise: prefix cache file %s unreadable (%s); removed", path.name, e)
            path.unlink(missing_ok=True)
            return None
        self.read_blocks += 1
        return k, v

    def touch(self, keys: list[bytes]) -> None:
        """Mark a chain's files used, its start the most recent (as ``PrefixCache._touch``): past the budget its
        deepest blocks go first."""
        for key in reversed(keys):
            try:
                os.utime(self._path(key))
            except OSError:  # removed meanwhile
                pass

    def put_chain(self, blocks: list[tuple[bytes, torch.Tensor, torch.Tensor]]) -> int:
        """Hand a chain's blocks ((key, k, v), its start first; the tensors must not change afterwards) to the
        writer: it writes the deepest first, so the chain's start is the most recently used file. As many of the
        chain's first blocks as the pending bound leaves room for; the rest are dropped (counted). Returns the
        blocks queued."""
        with self._cv:
            if self._closed:
                return 0
            take, room = [], self.pending_limit - self.pending_bytes
            for i, (key, k, v) in enumerate(blocks):
                if key in self._pending:  # queued by an earlier chain: written in its turn
                    continue
                if _block_bytes(k, v) > room:  # this block and every deeper one
                    self.dropped_blocks += sum(b[0] not in self._pending for b in blocks[i:])
                    break
                take.append((key, k, v))
                room -= _block_bytes(k, v)
            for key, k, v in reversed(take):
                self._pending[key] = (k, v)
                self._order.append(key)
                self.pending_bytes += _block_bytes(k, v)
            if take:
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, name="draftwise-prefix-disk",
                                                    daemon=True)
                    self._writer.start()
                    atexit.register(self.close)
                self._cv.notify_all()
        return len(take)

    def _write_loop(self) -> None:
        try:  # the lowest CPU priority (Linux: per thread): the engine's forwards first, the files in idle time
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
            pass
        while True:
            with self._cv:
                while not self._order and not self._closed:
                    self._cv.wait()
                if not self._order:  # closed and drained
                    return
                key = self._order.popleft()
                k, v = self._pending[key]
                self._busy = True
            ok = False
            try:
                ok = self.put(key, k, v)
            except Exception as e:  # never the writer's end: a block not written is a later miss
                log.warning("draftwise: prefix cache block not written to %s (%s)", self.folder, e)
            with self._cv:
                del self._pending[key]
                self.pending_bytes -= _block_bytes(k, v)
                if not ok:  # a full disk: the rest of the queue would fail alike; none of it is written
                    self.dropped_blocks += 1 + len(self._order)
                    for rest in self._order:
                        self.pending_bytes -= _block_bytes(*self._pending.pop(rest))
                    self._order.clear()
                self._since_prune += 1
                prune = not self._order or self._since_prune >= PRUNE_EVERY
            if prune:  # when the queue is drained, and every PRUNE_EVERY blocks under steady traffic
                self._since_prune = 0
                try:
                    self.prune()
                except OSError as e:
                    log.warning("draftwise: prefix cache folder %s not pruned (%s)", self.folder, e)
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block handed to the writer is written (or given up). False on ``timeout``."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._order and not self._busy, timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is pending (up to ``timeout`` seconds) and stop the writer; later chains are not kept."""
        with self._cv:
            if self._closed:
                return
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if not done:
            log.warning("draftwise: prefix cache: %d blocks not written to %s at close", len(self._order), self.folder)
        if self._writer is not None:
            self._writer.join(timeout=1.0 if done else 0.0)
            atexit.unregister(self.close)

    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Write the block now unless it is kept already (then mark it used). False where it could not be written
        (a full disk, ...)."""
        from safetensors.torch import save_file

        path = self._path(key)
        if path.is_file():
            try:
                os.utime(path)
                return True
            except OSError:  # removed meanwhile: write it
                pass
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file({"k": k.contiguous(), "v": v.contiguous()}, str(tmp))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("draftwise: prefix cache block not written to %s (%s)", self.folder, e)
            return False
        self.written_blocks += 1
        return True

    def prune(self) -> int:
        """Remove the least recently used files past the budget. Returns the files removed."""
        files = []
        for p in self.folder.glob("*.safetensors"):
            try:
                st = p.stat()
            except OSError:  # removed by another process meanwhile
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(f[1] for f in files)
        removed = 0
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.budget:
                break
            p.unlink(missing_ok=True)
            total -= size
            removed += 1
        return removed

    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*.safetensors") if p.is_file())


def chunked(model) -> bool:
    """Whether ``model`` prefills in exact chunks (and so can use a prefix cache): the native backend's models on
    the CPU whose projections run on the kernel (``Transformer.batch_invariant``). Elsewhere (dense bf16 / fp32
    weights, the HF backend, a GPU) a prompt runs in one pass and nothing is cached."""
    if not getattr(model, "supports_prefix_cache", False) or not model.batch_invariant():
        return False
    return torch.device(model.device).type == "cpu"


class PrefixCache:
    """Keys and values of token prefixes for one model, in blocks of ``block`` tokens (a block: every layer's
    keys and values of those positions), least recently used first out past ``budget_bytes``."""

    def __init__(self, budget_bytes: int, block: int = BLOCK, disk: DiskBlocks | None = None):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self.block = block
        self.disk = disk  # the blocks kept in a folder too (read where memory lacks them), or None
        # chain key -> (k, v), each (layers, kv_heads, block, head_dim); the most recently used last
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, read from the cache
        self.evicted_blocks = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, ids: list[int], blocks: int) -> Iterator[bytes]:
        """The chain keys of the first ``blocks`` whole blocks of ``ids``: each hashes the one before it and its
        own tokens, so it names every token from the start to its end."""
        key, B = b"", self.block
        for i in range(blocks):
            key = hashlib.blake2b(key + array("q", ids[i * B:(i + 1) * B]).tobytes(), digest_size=16).digest()
            yield key

    def _found(self, ids: list[int], read: tuple[tuple[int, ...], torch.dtype] | None = None
               ) -> list[tuple[bytes, tuple[torch.Tensor, torch.Tensor]]]:
        """The cached blocks of the longest prefix of ``ids``: from memory, else from the disk, read there where
        ``read`` gives the (shape, dtype) a block must have (they then come into memory); without it the disk's
        blocks are only looked for (their tensors are None)."""
        found = []
        for key in self.keys(ids, (len(ids) - 1) // self.block):  # at least one token is left to compute
            hit = self._blocks.get(key)
            if hit is None and self.disk is not None:
                if read is None:
                    if not self.disk.has(key):
                        break
                    found.append((key, None))
                    continue
                hit = self.disk.get(key, *read)
                if hit is not None:
                    self._keep(key, *hit)
            if hit is None:
                break
            found.append((key, hit))
        return found

    def _keep(self, key: bytes, k: torch.Tensor, v: torch.Tensor) -> None:
        self._blocks[key] = (k, v)
        self.bytes += _block_bytes(k, v)

    def _evict(self) -> None:
        while self.bytes > self.budget and self._blocks:
            _, (k, v) = self._blocks.popitem(last=False)
            self.bytes -= _block_bytes(k, v)
            self.evicted_blocks += 1

    def cached_length(self, ids: list[int]) -> int:
        """The tokens of ``ids`` that ``load`` would read from the cache now (nothing is copied or reordered)."""
        with self._lock:
            return len(self._found(ids)) * self.block

    def load(self, ids: list[int], row: KVCache) -> int:
        """Copy the keys and values of the longest cached prefix of ``ids`` (whole blocks, leaving at least one
        token to compute) into cache row ``row`` (a one-row view, reset) and set its length to it. Returns the
        prefix's length in tokens (0: nothing cached)."""
        B = self.block
        layers, _, heads, _, dim = row.k.shape
        with self._lock:
            found = self._found(ids, read=((layers, heads, B, dim), row.k.dtype))  # what a block must be
            self._touch([key for key, _ in found])
            self._evict()  # blocks read from the disk may go past the budget: the deepest first, not these
            self.queried_tokens += len(ids)
            self.hit_tokens += len(found) * B
        if self.disk is not None:
            self.disk.touch([key for key, _ in found])
        for i, (_, (k, v)) in enumerate(found):
            row.k[:, 0, :, i * B:(i + 1) * B] = k
            row.v[:, 0, :, i * B:(i + 1) * B] = v
        row.set_lengths(len(found) * B)
        return len(found) * B

    def store(self, ids: list[int], row: KVCache, end: int | None = None) -> int:
        """Keep the whole blocks of ``ids[:end]`` (default: all) that the cache lacks, whose keys and values cache
        row ``row`` (a one-row view) holds at those positions. Returns the blocks added."""
        B = self.block
        n = (len(ids) if end is None else min(end, len(ids))) // B
        layers, _, heads, _, dim = row.k.shape
        size = 2 * layers * heads * B * dim * row.k.element_size()  # bytes a block holds
        n = min(n, row.length() // B, max(self.budget, self.disk.budget if self.disk is not None else 0) // size)
        if n <= 0:
            return 0
        added = 0
        with self._lock:
            keys = list(self.keys(ids, n))
            blocks = []  # every block of the chain, for the disk
            for i, key in enumerate(keys):
                if key in self._blocks:
                    blocks.append((key, *self._blocks[key]))
                    continue
                k = row.k[:, 0, :, i * B:(i + 1) * B].clone()  # (layers, kv_heads, B, head_dim)
                v = row.v[:, 0, :, i * B:(i + 1) * B].clone()
                blocks.append((key, k, v))
                if (i + 1) * size <= self.budget:  # a chain longer than the memory's budget keeps its start there
                    self._keep(key, k, v)
                    added += 1
            self._touch([key for key in keys if key in self._blocks])
            self._evict()
        if self.disk is not None:  # written by the folder's writer thread: a long prompt is tens of MB
            self.disk.put_chain(blocks)
        return added

    def _touch(self, keys: list[bytes]) -> None:
        """Mark a chain's blocks used, its start the most recent: past the budget its deepest blocks go first
        (a block whose parent is gone can never be found again)."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.bytes = 0

    def snapshot(self) -> dict:
        out = {"blocks": len(self._blocks), "bytes": self.bytes, "budget_bytes": self.budget,
               "block_tokens": self.block, "queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens,
               "evicted_blocks": self.evicted_blocks}
        if self.disk is not None:
            out.update(disk_folder=str(self.disk.folder), disk_budget_bytes=self.disk.budget,
                       disk_read_blocks=self.disk.read_blocks, disk_written_blocks=self.disk.written_blocks,
                       disk_pending_blocks=self.disk.pending_blocks, disk_dropped_blocks=self.disk.dropped_blocks)
        return out


class Prefill:
    """One prompt's prefill into cache row ``row`` (a one-row view, reset), run in pieces: after the longest prefix
    ``prefix`` holds, in chunks of ``PREFILL_CHUNK`` tokens; its whole blocks are kept there at the end. In one pass
    where the model does not chunk (``chunked``). ``forward`` goes to ``model.forward`` (``logits_for``,
    ``all_hidden``, ``taps``; a caller that asks for every position's hidden state gets them all, and must not pass
    a prefix cache: it holds keys and values only). A server runs a long prompt a few chunks at a time between
    decode steps (``Decoder.advance``): the chunks' bits do not depend on when they run."""

    def __init__(self, model, ids: list[int], row: KVCache, *, prefix: PrefixCache | None = None, **forward):
        self.model, self.ids, self.row, self.forward = model, ids, row, forward
        self.every = bool(forward.get("all_hidden"))
        self.chunked = chunked(model) and (len(ids) > PREFILL_CHUNK or prefix is not None)
        self.prefix = prefix if self.chunked else None
        if self.prefix is not None and self.every:
            raise ValueError("a prefill that returns every position's hidden state cannot start from a prefix cache")
        self.cached = self.prefix.load(ids, row) if self.prefix is not None else 0  # prompt tokens read
        self.pos = self.cached  # the next prompt token to compute
        self._outs = []
        self.output = None  # the ModelOutput of the last chunk (every position's hidden states where asked)

    @property
    def done(self) -> bool:
        return self.output is not None

    def run(self, budget: int | None = None) -> int:
        """Compute the next chunks, ``budget`` prompt tokens at most (at least one token; None: to the end).
        Returns the tokens computed."""
        if not self.chunked:
            self.output = self.model.forward(torch.tensor([self.ids]), self.row, **self.forward)
            self.pos = len(self.ids)
            return len(self.ids)
        start, ids = self.pos, self.ids
        while self.pos < len(ids) and (budget is None or self.pos - start < budget or self.pos == start):
            s = self.pos
            # a chunk of PREFILL_CHUNK tokens, or what is left of the budget (the bits do not depend on the chunks)
            n = PREFILL_CHUNK if budget is None else max(1, min(PREFILL_CHUNK, budget - (s - start)))
            last = s + n >= len(ids)
            # the chunks before the last compute no logits (the LM head's weights are ~15 % of a pass's bytes)
            opts = self.forward if last else {**self.forward, "logits_for": "none"}
            out = self.model.forward(torch.tensor([ids[s:s + n]]), self.row, **opts)
            self.pos = min(s + n, len(ids))
            if self.every or last:
                self._outs.append(out)
        if self.pos == len(ids):
            self._finish()
        return self.pos - start

    def _finish(self) -> None:
        if self.prefix is not None:
            self.prefix.store(self.ids, self.row)
        out, outs = self._outs[-1], self._outs
        if self.every and len(outs) > 1:  # every position's final state (and taps), in order
            hidden = torch.cat([o.hidden for o in outs], 1)  # (1, N, D)
            taps = torch.cat([o.taps for o in outs], 1) if out.taps is not None else None
            out = type(out)(logits=out.logits, hidden=hidden, taps=taps)
        self._outs = []
        self.output = out


def prefill(model, ids: list[int], row: KVCache, *, prefix: PrefixCache | None = None, **forward):
    """``Prefill`` run to the end. Returns (the ModelOutput of the prompt's last chunk — every position's hidden
    states and taps where ``all_hidden`` was asked —, the number of prompt tokens read from the cache)."""
    p = Prefill(model, ids, row, prefix=prefix, **forward)
    p.run()
    return p.output, p.cached
