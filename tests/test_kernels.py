"""The int8/int4 weight-only kernel on every instruction-set path this CPU has, and the exact GGUF block
decoding feeding it. Paths the CPU lacks are skipped with the reason; every path must compute the same
bits as the scalar reference (the rule in draftwise/kernels/csrc/core/qmm.h)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from draftwise import kernels
from draftwise.kernels import (QLinear, arch_isas, available_isas, dequantize, extension, isa, isa_paths,
                               quantize_activations, quantize_rtn, using_isa)
from draftwise.kernels.gguf_quant import parse

CASES = [(8, 16), (8, 32), (4, 32)]
KERNELS = Path(__file__).resolve().parents[1] / "draftwise" / "kernels"
# checksums printed by csrc/tests/selftest.cpp: the scalar reference's outputs, which every path on every CPU
# and architecture must reproduce bit for bit (x86 here, AArch64 under qemu-user)
GOLDEN = {
    "int4-g32-min-K256": "bd67b0cc55128b9f", "int4-g32-K192": "e1ea4b7203c71079",
    "int4-g32-min-K576": "16e589defa3cc61b", "int8-g16-K512": "e946fb7ebee36af8",
    "int8-g32-min-K224": "454c5301c26e7dee", "int8-g32-K96": "f25ed0b365513d31",
    "int4-g32-min-f32": "cde3aa550dfbc555", "int8-g16-f32": "853cec546635f707",
    "int8-g32-min-f32": "55c56369582ee678", "bf16-dense": "793e4fdbae01d022", "fp32-dense": "04ae06b98aa381e6",
    "layers": "485e940ff23acc4f",
    "gguf-repack": "2d6efd8a06d30a86",  # csrc/gguf/repack.h over random blocks of every format (tested against numpy too)
    # the K-quant rule (csrc/core/kquant.h): the x16 layout of random Q4_K / Q6_K blocks and the reference's outputs
    "kquant-q4k": "b405ec6ce721fd6a", "kquant-q6k": "16cf73402510a2ff",
    # its block formats: the x16 layout of random Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks and the reference's outputs
    "kblock-q4_0": "6a092a4f8466d774", "kblock-q4_1": "bc1cb4ad4fbdd8b2", "kblock-q5_0": "ab284efcb9f1382b",
    "kblock-q8_0": "ec73ceb0fcce6d66",
}


def _path_param(name: str):
    return pytest.param(name, id=name)


# the paths of this architecture (the other's are checked by the qemu test below)
_ARCH_ISAS = arch_isas()


@pytest.fixture(params=[_path_param(n) for n in _ARCH_ISAS])
def path(request):
    """Run the test on one instruction-set path (skipped where this CPU or build lacks it)."""
    if extension() is None:
        pytest.skip("the C++ kernel is not built here")
    if request.param == "amx" and "amx" not in available_isas():
        from draftwise.kernels import amx_info

        pytest.skip(f"the amx path cannot run here ({amx_info()['state']}: {amx_info()['reason']})")
    if request.param not in available_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path (has: {', '.join(available_isas())})")
    with using_isa(request.param):
        yield request.param


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("with_min", [False, True])
@pytest.mark.parametrize("act_bits", [32, 8])
def test_kernel_matches_dequantized_matmul(path, bits, group, with_min, act_bits):
    g = torch.Generator().manual_seed(bits * 100 + group)
    w = torch.randn(72, 256, generator=g)
    q, scale, minv = quantize_rtn(w, bits, group)
    if with_min and minv is None:
        minv = torch.randn(scale.shape, generator=g) * 0.01
    if not with_min:
        minv = None
    lin = QLinear(q, scale, minv, group, bits, bias=torch.randn(72, generator=g))
    lin.act_bits = act_bits
    x = torch.randn(11, 256, generator=g)
    xr = quantize_activations(x) if act_bits == 8 else x  # int8 activations: the values the kernel multiplies
    ref = xr @ dequantize(q, scale, minv, group, bits).t() + lin.bias
    torch.testing.assert_close(lin(x), ref, atol=2e-4, rtol=2e-4)
    if act_bits == 8:  # and they are not the fp32 result (the int8 path really ran)
        assert not torch.allclose(lin(x), x @ dequantize(q, scale, minv, group, bits).t() + lin.bias, atol=1e-3)


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("act_bits", [32, 8])
def test_kernel_is_batch_invariant(path, bits, group, act_bits):
    """A row's result does not depend on how many rows share the call (incl. row-block chunking)."""
    g = torch.Generator().manual_seed(7)
    lin = QLinear(*quantize_rtn(torch.randn(40, 128, generator=g), bits, group), group, bits)
    lin.act_bits = act_bits
    x = torch.randn(13, 128, generator=g)
    full = lin(x)
    for i in range(13):
        assert torch.equal(lin(x[i:i + 1]), full[i:i + 1])
    assert torch.equal(lin(x[3:9]), full[3:9])


@contextlib.contextmanager
def _threads(n: int):
    """torch.set_num_threads(n) within the block (the kernel's pool takes its thread count from torch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_thread_count_never_changes_a_result():
    """The kernel's pool (csrc/core/pool.h) hands out chunks of output columns to whichever thread is free:
    the result is the same bits for 1, 2, 3 and 5 threads, for matmuls over many and few columns and
    for decode attention."""
    if extension() is None:
        pytest.skip("the C++ kernel is not built here")
    g = torch.Generator().manual_seed(11)
    lins = [QLinear(*quantize_rtn(torch.randn(n, 256, generator=g), 4, 32), 32, 4) for n in (3, 40, 1000)]
    x = torch.randn(5, 256, generator=g)
    ext = extension()
    B, T, nh, nkv, hd, cap = 2, 3, 6, 2, 16, 40
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hd, generator=g)
    cos, sin = torch.randn(B, T, hd, generator=g), torch.randn(B, T, hd, generator=g)
    kc0, vc0 = torch.randn(B, nkv, cap, hd, generator=g), torch.randn(B, nkv, cap, hd, generator=g)

    rows = torch.randn(3, 300, 96, generator=g)  # a prompt's rows: the row-wise ops split them over the pool

    def run():
        kc, vc = kc0.clone(), vc0.clone()
        att = ext.decode_attention(qkv.clone(), cos, sin, kc, vc, [7, 20], nh, nkv, torch.empty(0), torch.empty(0))
        kc2, vc2, roped = kc0.clone(), vc0.clone(), qkv.clone()
        ext.rope_append(roped, cos, sin, kc2, vc2, [7, 20], nh, nkv)
        return [lin(x) for lin in lins] + [att, kc, vc, roped, kc2, vc2, ext.rms_norm(rows, rows[0, 0], 1e-6),
                                           ext.silu_mul(rows)]

    with _threads(1):
        want = run()
    for n in (2, 3, 5):
        with _threads(n):
            for _ in range(3):
                assert all(torch.equal(a, b) for a, b in zip(run(), want)), f"{n} threads"


def _qmm_in_child(conn, lin, x):  # runs in a forked child: the parent's pool threads do not exist there
    conn.send(lin(x).tolist())  # (only the kernel runs here: torch's own OpenMP is not fork-safe)
    conn.close()


def test_kernel_threads_work_in_a_forked_child():
    """A process forked after the kernel ran (multiprocessing's fork start method, a pre-forking
    server) gets a fresh pool instead of waiting for helper threads that were not copied."""
    import multiprocessing as mp

    if extension() is None:
        pytest.skip("the C++ kernel is not built here")
    g = torch.Generator().manual_seed(5)
    lin = QLinear(*quantize_rtn(torch.randn(500, 256, generator=g), 4, 32), 32, 4)
    x = torch.randn(4, 256, generator=g)
    with _threads(2):
        want = lin(x)  # the parent's pool is running now
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_qmm_in_child, args=(child, lin, x))
        proc.start()
        got = parent.recv() if parent.poll(120) else None
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert got is not None, "the forked child did not answer (stuck on the parent's pool?)"
    assert torch.equal(torch.tensor(got), want)


def _every_format(g: torch.Generator) -> list[tuple[str, QLinear, int]]:
    """(name, layer, K) for every weight format and tail shape the kernel has."""
    out = []
    for bits, group, K in [(4, 32, 384), (4, 32, 576), (4, 32, 192), (8, 16, 512), (8, 32, 224), (8, 32, 96)]:
        q, s, m = quantize_rtn(torch.randn(45, K, generator=g), bits, group)
        if m is None:
            m = torch.randn(s.shape, generator=g) * 0.01
        out.append((f"int{bits}-g{group}-K{K}", QLinear(q, s, m, group, bits), K))
        out.append((f"int{bits}-g{group}-K{K}-nomin", QLinear(q, s, None, group, bits), K))
    for dtype in (torch.bfloat16, torch.float32):
        out.append((f"dense-{dtype}", QLinear.dense(torch.randn(33, 272, generator=g).to(dtype)), 272))
    return out


def test_every_path_gives_the_reference_bits(path):
    """The same bits as the scalar reference, for every format, both activation kinds, any row count."""
    g = torch.Generator().manual_seed(42)
    for name, lin, K in _every_format(g):
        x = torch.randn(10, K, generator=g) * 3
        x[0, :32] = 0  # an all-zero activation block
        x[1, 7] = 1e4  # a block with one huge value
        for act_bits in (8, 32):
            lin.act_bits = act_bits if lin.bits in (4, 8) else 32
            got = lin(x)
            with using_isa("scalar"):
                ref = lin(x)
                ref1 = lin(x[4:5])
            assert torch.equal(got, ref), f"{name} act {act_bits}: {path} differs from the scalar reference"
            assert torch.equal(lin(x[4:5]), ref1), f"{name} act {act_bits}: one row differs on {path}"


@pytest.mark.parametrize("nh,nkv,hd", [(6, 2, 128), (9, 3, 64), (8, 1, 64), (4, 4, 32)])
def test_fused_layer_ops_give_the_reference_bits_on_every_path(path, nh, nkv, hd):
    """silu·up and decode attention (causal and tree-masked, cached prefixes below and above a 16-key
    block; grouped-query, multi-query and one KV head per query head) run on the path's vectors through
    the torch bindings, with the scalar reference's bits."""
    ext = extension()
    g = torch.Generator().manual_seed(7)
    gu = torch.randn(3, 2, 2 * 203, generator=g) * 6  # (B, T, 2F), F with a tail past 8 lanes
    gu[0, 0, :4] = torch.tensor([88.5, -88.5, 100.0, -100.0])
    cap, B, T = 80, 2, 4
    qkv = torch.randn(B, T, (nh + 2 * nkv) * hd, generator=g)
    cos, sin = torch.randn(B, T, hd, generator=g), torch.randn(B, T, hd, generator=g)
    kc, vc = torch.randn(B, nkv, cap, hd, generator=g), torch.randn(B, nkv, cap, hd, generator=g)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # a tree
    from draftwise.models.transformer import TreeMask
    tree = TreeMask(mask.expand(B, T, T).contiguous())
    none = torch.empty(0, dtype=torch.long)

    def run():
        att = [ext.decode_attention(qkv.clone(), cos, sin, kc.clone(), vc.clone(), [5, 41], nh, nkv, vis, nvis)
               for vis, nvis in ((none, none), (tree.vis, tree.nvis))]
        return [ext.silu_mul(gu)] + att

    got = run()
    with using_isa("scalar"):
        ref = run()
    for name, a, b in zip(("silu_mul", "attention", "tree attention"), got, ref):
        assert torch.equal(a, b), f"{name}: {path} differs from the scalar reference"


def test_kernel_builds_here():
    assert extension() is not None, "the C++ kernel should compile on these machines"
    assert isa() in available_isas() and isa() != "none"


# the kernel's feature names (csrc/arch/x86/cpu_features.h) -> Linux's /proc/cpuinfo flags
_LINUX_FLAGS = {"sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avxvnni": "avx_vnni",
                "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
                "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "amx-int8": "amx_int8",
                "amx-bf16": "amx_bf16"}


def test_cpu_features_agree_with_linux():
    """The kernel reads cpuid and XCR0 itself (the same on GCC and clang, whose __builtin_cpu_supports know
    different names); Linux lists a feature only where the CPU has it and the OS enabled its registers: the two
    must agree on every name the kernel reports."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("x86-64 Linux only")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    have = set(extension().cpu_features().split())
    for name, flag in _LINUX_FLAGS.items():
        assert (name in have) == (flag in flags), f"{name}: kernel says {name in have}, /proc/cpuinfo {flag in flags}"


def test_best_path_is_chosen_by_default():
    """Without DRAFTWISE_ISA the widest path the CPU supports runs (amx only once verified; the scalar path
    only on CPUs with no SIMD path compiled in)."""
    if os.environ.get("DRAFTWISE_ISA"):
        pytest.skip("DRAFTWISE_ISA is set for this run")
    rank = {p.name: p.rank for p in isa_paths()}
    assert isa() == max(available_isas(), key=rank.__getitem__)
    assert available_isas() == sorted(available_isas(), key=rank.__getitem__)  # lowest rank first


def test_paths_def_is_the_one_list_python_and_cpp_read():
    """csrc/core/paths.def generates the C++ path table; Python parses the same file: both see the same rows,
    the scalar path is always there, and every path this CPU runs is one of them."""
    ext = extension()
    if ext is None:
        pytest.skip("the C++ kernel is not built here")
    assert [(p.name, p.family, p.rank) for p in isa_paths()] == [tuple(r) for r in ext.isa_table()]
    assert kernels.ISAS == tuple(p.name for p in isa_paths()) and "scalar" in kernels.ISAS
    assert set(available_isas()) <= set(arch_isas()) and arch_isas()[0] == "scalar"
    for name in available_isas():  # each file's IsaOps::name is its paths.def name
        with using_isa(name):
            assert isa() == name


def test_paths_def_bad_line_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "paths.def"
    bad.write_text("// a comment\nDW_PATH(avx2, X86, has_avx2)\n")
    monkeypatch.setattr(kernels, "PATHS_DEF", bad)
    kernels.isa_paths.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"paths.def:2: not a DW_PATH"):
            kernels.isa_paths()
    finally:
        kernels.isa_paths.cache_clear()


def test_kernel_sources_and_build_name_cover_the_folder_tree(tmp_path, monkeypatch):
    """Every .cpp under csrc/ but the selftest is compiled; the build name changes with any source, header,
    fragment or the path list, wherever it lies; two sources with one base name are refused (torch's builder
    names object files by base name)."""
    srcs = {p.relative_to(kernels.CSRC).as_posix() for p in kernels.kernel_sources()}
    assert "core/dispatch.cpp" in srcs and "bindings/ops.cpp" in srcs and "arch/x86/qmm_avx2.cpp" in srcs
    assert "arch/arm/qmm_neon.cpp" in srcs and not any(s.startswith("tests/") for s in srcs)
    # every file of the folder is a kind the build name hashes (a new kind would silently not rebuild)
    assert all(p.suffix in kernels.KERNEL_SUFFIXES for p in kernels.CSRC.rglob("*") if p.is_file())
    copy = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, copy)
    monkeypatch.setattr(kernels, "CSRC", copy)
    base = kernels.build_name()
    for rel in ("core/tiles.inc", "arch/arm/neon.h", "core/paths.def", "tests/selftest.cpp"):
        f = copy / rel
        old = f.read_bytes()
        f.write_bytes(old + b"\n")
        assert kernels.build_name() != base, rel
        f.write_bytes(old)
    assert kernels.build_name() == base
    (copy / "gguf" / "dispatch.cpp").write_text("")
    with pytest.raises(RuntimeError, match="share a file name.*dispatch.cpp"):
        kernels.kernel_sources()


def test_multi_row_calls_may_take_another_path_with_the_same_bits():
    """Calls of 3+ rows may run on a path measured faster there (``_tune_multi``); any path gives the
    reference bits, a forced path (``set_isa``) clears the choice, an unusable name changes nothing."""
    from draftwise.kernels import isa_multi, set_isa

    ext = extension()
    g = torch.Generator().manual_seed(7)
    lin = QLinear(*quantize_rtn(torch.randn(40, 256, generator=g), 4, 32), 32, 4)
    x = torch.randn(8, 256, generator=g)
    with using_isa("scalar"):
        ref8, ref1 = lin(x), lin(x[:1])
    before = ext.isa_multi()
    try:
        for p in available_isas():
            assert ext.set_isa_multi(p) and isa_multi() == p
            assert torch.equal(lin(x), ref8) and torch.equal(lin(x[:1]), ref1), p
        assert not ext.set_isa_multi("sse1") and isa_multi() == available_isas()[-1]
        set_isa(isa())
        assert ext.isa_multi() == "" and isa_multi() == isa()
    finally:
        ext.set_isa_multi(before)


class _FakeExt:
    def __init__(self, default: str, paths: list[str]):
        self.default, self.paths, self.multi, self.forced = default, paths, "", []

    def isa(self):
        return self.default

    def available_isas(self):
        return ["scalar", *self.paths]

    def cpu_features(self):
        return "avx2 fma"

    def set_isa(self, name):
        self.forced.append(name)
        return True

    def set_isa_multi(self, name):
        self.multi = name
        return True


def test_tuning_takes_a_path_only_when_clearly_faster_and_caches_it(tmp_path, monkeypatch):
    import draftwise.kernels as k

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "a"))
    monkeypatch.setattr(k, "_time_paths", lambda ext, paths: {"avx2": 0.9, "avx512": 1.0})
    ext = _FakeExt("avx512", ["avx2", "avx512"])
    k._tune_multi(ext)
    assert ext.multi == "avx2" and ext.forced[-1] == "avx512"  # measured, then the default path restored
    cached = list((tmp_path / "a" / "kernels").glob("tune-*.json"))
    assert len(cached) == 1 and '"multi": "avx2"' in cached[0].read_text()

    def fail(ext, paths):
        raise AssertionError("the cached choice should be used")

    monkeypatch.setattr(k, "_time_paths", fail)
    again = _FakeExt("avx512", ["avx2", "avx512"])
    k._tune_multi(again)
    assert again.multi == "avx2"

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "b"))  # within the margin: the default stays
    monkeypatch.setattr(k, "_time_paths", lambda ext, paths: {"avx2": 0.97, "avx512": 1.0})
    close = _FakeExt("avx512", ["avx2", "avx512"])
    k._tune_multi(close)
    assert close.multi == ""


def test_path_timing_runs_on_this_cpu():
    from draftwise.kernels import _time_paths, isa, set_isa

    prev = isa()
    try:
        times = _time_paths(extension(), available_isas(), rows=3)
    finally:
        set_isa(prev)
    assert set(times) == set(available_isas()) and all(t > 0 for t in times.values())


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_draftwise_isa_forces_a_lower_path():
    """DRAFTWISE_ISA picks the path at load; a path the CPU lacks (or a typo) is one clear error."""
    r = _python("from draftwise.kernels import isa; print(isa())", DRAFTWISE_ISA="scalar")
    assert r.returncode == 0 and r.stdout.strip() == "scalar", r.stderr
    r = _python("from draftwise.kernels import isa; print(isa())", DRAFTWISE_ISA="avx9000")
    assert r.returncode != 0 and "DRAFTWISE_ISA='avx9000'" in r.stderr and "available here" in r.stderr


def test_set_isa_rejects_unknown_paths():
    from draftwise.errors import InvalidParameterError
    from draftwise.kernels import set_isa

    with pytest.raises(InvalidParameterError, match="unknown or this CPU cannot run it"):
        set_isa("sse1")


def _selftest_checksums(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(\S+)\s+([0-9a-f]{16}) ok$", out, flags=re.M))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_selftest_native_paths_bit_identical(tmp_path):
    """The torch-free core's own test: every path of this CPU equals the reference, and the reference's
    checksums are the pinned ones (so the ARM run below is compared with exactly these bits)."""
    r = subprocess.run([str(KERNELS / "build_selftest.sh"), "native", str(tmp_path / "selftest")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _selftest_checksums(r.stdout) == GOLDEN


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                    reason="ARM check needs g++-aarch64-linux-gnu and qemu-user (apt-get install ...)")
def test_selftest_arm_neon_paths_bit_identical_under_qemu(tmp_path):
    """NEON and NEON-dotprod (AArch64, emulated) compute the same bits as the x86 paths."""
    r = subprocess.run([str(KERNELS / "build_selftest.sh"), "aarch64", str(tmp_path / "selftest-arm")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    arm = [p.name for p in sorted(isa_paths(), key=lambda p: p.rank) if p.family in ("ANY", "ARM")]
    assert "paths: " + " ".join(arm) + "\n" in r.stdout  # qemu's "max" CPU runs every ARM path
    assert _selftest_checksums(r.stdout) == GOLDEN


def test_int4_rtn_error_is_small():
    w = torch.randn(64, 512)
    q, s, m = quantize_rtn(w, 4, 32)
    err = (dequantize(q, s, m, 32, 4) - w).abs().max() / w.abs().max()
    assert err < 0.1


def _random_blocks(qtype, n_blocks, block_bytes, d_offsets, rng):
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in d_offsets:  # fp16 scale fields: small finite values, not random NaN/inf bit patterns
        raw[:, off:off + 2] = np.frombuffer(
            rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).tobytes(), dtype=np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("qtype,block_bytes,per_block,d_offsets", [
    ("Q4_0", 18, 32, [0]), ("Q4_1", 20, 32, [0, 2]), ("Q5_0", 22, 32, [0]), ("Q8_0", 34, 32, [0]),
    ("Q4_K", 144, 256, [0, 2]), ("Q5_K", 176, 256, [0, 2]), ("Q6_K", 210, 256, [208]),
])
def test_gguf_blocks_decode_exactly(qtype, block_bytes, per_block, d_offsets):
    """Our integer codes de-quantize to exactly what the gguf package de-quantizes (bit for bit)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(0)
    N, K = 6, 512
    raw = _random_blocks(qtype, N * K // per_block, block_bytes, d_offsets, rng).reshape(N, -1)
    ref = gguf_dequantize(raw, getattr(GGMLQuantizationType, qtype)).reshape(N, K)
    code = parse(raw, qtype, (N, K))
    mine = dequantize(code.q, code.scale, code.minv, code.group, code.bits).numpy()
    np.testing.assert_array_equal(mine, ref)


def test_unsupported_format_returns_none():
    assert parse(np.zeros((2, 8), dtype=np.uint8), "F16", (2, 4)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_weights_through_kernel_are_exact_and_invariant(path, dtype):
    """Dense bf16/fp32 weights: fp32 accumulation of the exact weights, row-invariant (torch's own bf16
    matmul is not, for some shapes: K = 8960 on this CPU)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 8960, generator=g).to(dtype)
    lin = QLinear.dense(w, bias=torch.randn(48, generator=g))
    x = torch.randn(6, 8960, generator=g)
    full = lin(x)
    torch.testing.assert_close(full, x.double().matmul(w.double().t()).float() + lin.bias, atol=2e-3, rtol=1e-4)
    assert all(torch.equal(full[i:i + 1], lin(x[i:i + 1])) for i in range(6))


@pytest.mark.parametrize("K", [128, 384, 576, 64])  # 576, 64: a 32-byte last step
@pytest.mark.parametrize("act_bits", [32, 8])
def test_int4_paths_match_reference_and_are_invariant(path, K, act_bits):
    g = torch.Generator().manual_seed(K)
    lin = QLinear(*quantize_rtn(torch.randn(37, K, generator=g), 4, 32), 32, 4)
    lin.act_bits = act_bits
    x = torch.randn(10, K, generator=g)
    full = lin(x)
    xr = quantize_activations(x) if act_bits == 8 else x
    ref = xr.double() @ dequantize(lin.q, lin.scale, lin.minv, 32, 4).double().t()
    torch.testing.assert_close(full.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
    assert all(torch.equal(lin(x[i:i + 1]), full[i:i + 1]) for i in range(10))
    assert torch.equal(lin(x[2:7]), full[2:7])


@pytest.mark.parametrize("act_bits", [32, 8])
def test_int4_without_min_offsets(path, act_bits):
    """Q4_0-style codes (scale only, no min): no offset term at all."""
    g = torch.Generator().manual_seed(1)
    q, scale, _ = quantize_rtn(torch.randn(20, 256, generator=g), 4, 32)
    lin = QLinear(q, scale, None, 32, 4)
    lin.act_bits = act_bits
    x = torch.randn(3, 256, generator=g)
    xr = quantize_activations(x) if act_bits == 8 else x
    ref = xr.double() @ dequantize(q, scale, None, 32, 4).double().t()
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)


def test_int8_activations_edge_cases(path):
    """All-zero blocks (scale 0), a block with one huge value, and int8 codes at both ends of their range."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (24, 128), generator=g, dtype=torch.int8)
    q[0], q[1] = -128, 127
    scale, minv = torch.rand(24, 8, generator=g), torch.randn(24, 8, generator=g)
    lin = QLinear(q, scale, minv, 16, 8)
    lin.act_bits = 8
    x = torch.randn(4, 128, generator=g)
    x[0, :32] = 0.0
    x[1, 40] = 1e4
    ref = quantize_activations(x).double() @ dequantize(q, scale, minv, 16, 8).double().t()
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def test_quantize_activations_error_is_bounded():
    x = torch.randn(5, 256)
    err = (quantize_activations(x) - x).abs().view(5, 8, 32)
    bound = x.abs().view(5, 8, 32).amax(-1, keepdim=True) / 254 * (1 + 1e-6)  # half a step of max|x| / 127
    assert (err <= bound).all()


@pytest.mark.parametrize("bits,group", CASES)
def test_bf16_dequantize_for_long_prefills_matches_reference(bits, group):
    """The C++ de-quantization the bulk (long prefill) path uses equals the torch reference, bit for bit."""
    g = torch.Generator().manual_seed(11)
    q, scale, minv = quantize_rtn(torch.randn(40, 256, generator=g), bits, group)
    minv = minv if minv is not None else torch.randn(scale.shape, generator=g) * 0.1
    ref = dequantize(q, scale, minv, group, bits).to(torch.bfloat16)
    assert torch.equal(extension().dequantize_bf16(q, scale, minv, group, bits), ref)
    assert torch.equal(extension().dequantize_bf16(q, scale, torch.empty(0), group, bits),
                       dequantize(q, scale, None, group, bits).to(torch.bfloat16))


def test_fp32_gemm_block_for_training_features():
    """Inside ``fp32_gemm`` a many-row call is the de-quantized fp32 matmul (training features); few rows,
    and every call outside it, stay on the kernel's exact path."""
    from draftwise.kernels import BULK_MIN_ROWS, fp32_gemm

    g = torch.Generator().manual_seed(4)
    lin = QLinear(*quantize_rtn(torch.randn(24, 128, generator=g), 4, 32), 32, 4)
    x = torch.randn(BULK_MIN_ROWS + 8, 128, generator=g)
    ref = x @ dequantize(lin.q, lin.scale, lin.minv, 32, 4).t()
    exact = lin(x)
    with fp32_gemm():
        fast = lin(x)
        few = lin(x[:3])
    torch.testing.assert_close(fast, ref)
    assert torch.equal(few, lin(x[:3])) and torch.equal(lin(x), exact)
