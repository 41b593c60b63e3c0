"""The AMX path (csrc/amx.h): the K-quant rule on AMX-INT8 tiles. The tile kernel (csrc/kquant_amx.h) runs
here on emulated tiles (csrc/amx_emu.h: the tile instructions as the Intel SDM defines them, on any CPU)
and must give the scalar reference's bits for every row count; the hardware kernel runs only on a CPU with
AMX where the forked check verified it (skipped elsewhere, with the reason); the check itself must refuse
a fault and a one-bit difference without harming the process that asked."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import draftwise.kernels as k
from draftwise.kernels import amx_info, extension, using_isa
from tests.test_kquant import TID, random_blocks

pytestmark = pytest.mark.skipif(extension() is None, reason="the kernel is not built here")


def _case(qtype: str, N: int, K: int = 768, rows: int = 33):
    """(x (rows, K), w (x16 layout, flat), bits, the scalar reference's (rows, N) output)."""
    raw = torch.from_numpy(random_blocks(qtype, N, K, seed=N + 7 * len(qtype)).reshape(-1).copy())
    bits = TID[qtype]
    w = extension().kq_pack(raw, bits, N, K, torch.empty(0, dtype=torch.uint8))  # the x16 layout
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(N)) * 2
    x[0, :256] = 0  # an all-zero activation block
    x[1, 300] = 1e4  # a block with one huge value
    with using_isa("scalar"):
        ref = extension().qmm_kq(x, w, bits, N)
    return x, w, bits, ref


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("N", [37, 48])  # a partial last tile; three whole ones
def test_the_tile_kernel_on_emulated_tiles_gives_the_reference_bits_for_every_row_count(qtype, N):
    x, w, bits, ref = _case(qtype, N)
    for M in range(1, 34):  # one A tile, two (rows 16..31), two passes (33)
        got = extension().kq_amx(x[:M].contiguous(), w, bits, N, True)
        assert torch.equal(got, ref[:M]), M


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_tile_kernel_in_row_blocks_gives_the_reference_bits(qtype):
    """Rows taken in blocks of groups of 16 (each block over every column tile, dw::amx_block_groups): one group,
    two (40 rows: a block of two, then the last group overlapping the one before it alone), all of them."""
    ext = extension()
    x, w, bits, ref = _case(qtype, 37, rows=72)
    assert ext.amx_block_groups(8960) >= 2 and ext.amx_block_groups(1 << 20) == 1  # from the bytes: at least one
    try:
        for groups in (1, 2, 3, 0):
            ext.set_amx_block_groups(groups)
            for M in (17, 32, 40, 48, 72):
                assert torch.equal(ext.kq_amx(x[:M].contiguous(), w, bits, 37, True), ref[:M]), (groups, M)
                if not _hardware_skip():
                    assert torch.equal(ext.kq_amx(x[:M].contiguous(), w, bits, 37, False), ref[:M]), (groups, M)
    finally:
        ext.set_amx_block_groups(0)


def test_the_row_tuning_times_long_calls_on_a_leading_part_of_its_matrix():
    w = torch.arange(10 * 64, dtype=torch.uint8)  # 10 tiles of 16 columns, 64 bytes each
    part, N, K = k._leading((w, 160, 512), 0.25)
    assert (N, K) == (32, 512) and torch.equal(part, w[:128])
    assert k._leading((w, 160, 512), 1.0)[1] == 160 and k._leading((w, 160, 512), 0.01)[1] == 16


def _hardware_skip() -> str:
    info = amx_info()
    if info["state"] == "verified":
        return ""
    return f"the AMX hardware path cannot run here ({info['state']}: {info['reason']})"


@pytest.mark.skipif(bool(_hardware_skip()), reason=_hardware_skip())
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_hardware_tiles_give_the_reference_bits(qtype):
    ext = extension()
    for N in (37, 48):
        x, w, bits, ref = _case(qtype, N)
        for M in range(1, 34):
            assert torch.equal(ext.kq_amx(x[:M].contiguous(), w, bits, N, False), ref[:M]), (N, M)
        before = ext.amx_min_rows(bits)
        with using_isa("amx"):  # the path: the tiles from amx_min_rows (threads over tiles, the call's split
            try:                # activations), AVX512-VNNI below; both from 2 rows, then every call on AVX512-VNNI
                for least in (2, 1 << 30):
                    ext.set_amx_min_rows(bits, least)
                    for M in (1, 2, 8, 16, 17, 31, 32, 33):
                        assert torch.equal(ext.qmm_kq(x[:M].contiguous(), w, bits, N), ref[:M]), (N, M, least)
            finally:
                ext.set_amx_min_rows(bits, before)


def test_the_hardware_kernels_byte_work_gives_the_emulations_bytes():
    """The weights' B operands and the activations' two parts, on AVX-512BW (any AVX-512 CPU, AMX or not)."""
    got = extension().amx_bytes_check()
    if got.startswith("skipped"):
        pytest.skip(got)
    assert got == ""


def test_the_tiles_row_threshold_takes_the_rows_where_the_tiles_won_from_there_on():
    t = {16: {"tiles": 1.0, "vnni": 0.9}, 24: {"tiles": 1.0, "vnni": 1.2}, 32: {"tiles": 1.0, "vnni": 1.3}}
    assert k._amx_min_rows(t) == 24
    t[24]["vnni"] = 1.02  # within the margin: not a win, so 32
    assert k._amx_min_rows(t) == 32
    t[32]["vnni"] = 1.0
    assert k._amx_min_rows(t) == k.AMX_NEVER
    assert k._amx_min_rows({16: {"tiles": 1.0, "vnni": 2.0}, 24: {"tiles": 1.0, "vnni": 2.0}}) == 16
    with pytest.raises(RuntimeError):
        extension().set_amx_min_rows(102, 4)  # a block format: never on the tiles
    with pytest.raises(RuntimeError):
        extension().set_amx_min_rows(12, 0)


def test_the_check_runs_in_a_child_and_refuses_a_fault_and_a_difference():
    ext = extension()
    before = ext.amx_status()
    ok, why = ext.amx_verify("emulated")
    assert ok and "reference's bits" in why
    ok, why = ext.amx_verify("corrupt")  # the emulated kernel with one output flipped
    assert not ok and "17 rows: row 16 column 3" in why
    state, reason = before
    if "amx-tile" in reason:  # no AMX here: the hardware kernel must fault, and only the child dies
        ok, why = ext.amx_verify("fault")
        assert not ok and "killed by signal" in why, why
    assert ext.amx_status() == before  # probes record nothing
    if state == "unavailable":
        assert ext.amx_verify("hardware") == (False, reason)


class _FakeExt:
    def __init__(self, verdict: tuple[bool, str], state: tuple[str, str] = ("unchecked", "not verified yet")):
        self.verdict, self.state, self.calls, self.taken, self.isa_set = verdict, state, [], None, []

    def amx_status(self):
        return self.state

    def amx_verify(self, mode):
        self.calls.append(mode)
        return self.verdict

    def amx_set_verdict(self, ok, reason):
        self.taken = (ok, reason)

    def cpu_features(self):
        return "avx512f avx512vnni amx-int8"

    def set_isa(self, name):
        self.isa_set.append(name)
        return True


def test_the_verdict_is_checked_once_cached_and_a_refusal_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "a"))
    fault = (False, "the check was killed by signal 4 (Illegal instruction)")
    first = _FakeExt(fault)
    with caplog.at_level(logging.WARNING, logger="draftwise.kernels"):
        k._check_amx(first, "")
    assert first.calls == ["hardware"] and first.isa_set == []
    assert "AMX path refused" in caplog.text and "signal 4" in caplog.text
    cached = list((tmp_path / "a" / "kernels").glob("amx-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["verified"] is False
    again = _FakeExt((True, "must not run"))  # the same build, CPU and host: the cached verdict
    k._check_amx(again, "")
    assert again.calls == [] and again.taken == fault

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "b"))
    good = _FakeExt((True, "identical"))
    k._check_amx(good, "")
    assert good.calls == ["hardware"] and good.isa_set == ["auto"]  # verified: the best path is picked again
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "c"))
    forced = _FakeExt((True, "identical"))
    k._check_amx(forced, "avx2")
    assert forced.isa_set == []  # a forced path stays
    absent = _FakeExt((True, "must not run"), state=("unavailable", "this CPU lacks amx-tile amx-int8 (cpuid)"))
    k._check_amx(absent, "")
    assert absent.calls == [] and absent.taken is None


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code], check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_forcing_amx_where_it_cannot_run_names_the_reason():
    info = amx_info()
    if info["state"] == "verified":
        pytest.skip("AMX runs here")
    from draftwise.errors import InvalidParameterError
    from draftwise.kernels import set_isa

    want = f"AMX {info['state']}: {info['reason']}"
    with pytest.raises(InvalidParameterError) as e:
        set_isa("amx")
    assert want in str(e.value)
    r = _python(["-c", "from draftwise.kernels import isa; print(isa())"], DRAFTWISE_ISA="amx")
    assert r.returncode != 0 and "DRAFTWISE_ISA='amx'" in r.stderr and want in r.stderr, r.stderr


def test_draftwise_info_shows_the_amx_state():
    r = _python(["-m", "draftwise.cli", "info", "--json"])
    assert r.returncode == 0, r.stderr
    info, amx = json.loads(r.stdout), amx_info()
    assert info["amx"] == f"{amx['state']}: {amx['reason']}"
    if amx["state"] != "verified":
        assert info["isa"] != "amx" and "amx" not in info["available_isas"]
