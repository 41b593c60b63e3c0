"""GNU OpenMP's idle spin: torch imported before draftwise leaves libgomp's default (~3 ms of a core after every
torch op, which the kernel's own threads need), and draftwise then keeps the decode loop's torch ops on one
thread (settings.openmp_spins_long, kernels.decode_threads)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from draftwise import settings
from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.base import Draft, StatelessDrafter
from draftwise.kernels import extension, parallel_torch, serial_torch
from draftwise.models.transformer import random_model
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence

from .conftest import TINY


@pytest.mark.parametrize("loaded,policy,spin,long", [
    (True, None, None, True),  # torch first: libgomp read the environment with its default spin
    (False, None, None, False),  # draftwise first: GOMP_SPINCOUNT=2000 was in place
    (True, "PASSIVE", None, False),
    (True, "passive ", None, False),
    (False, "ACTIVE", None, True),
    (True, None, "2000", False),
    (False, None, "300k", True),
    (False, None, "infinite", True),
    (True, "PASSIVE", "1M", True),  # libgomp: an explicit GOMP_SPINCOUNT wins over the policy's default
    (True, None, "bogus", True),
])
def test_long_spin_follows_libgomps_own_rules(loaded, policy, spin, long):
    assert settings._long_spin(loaded, policy, spin) is long


@pytest.mark.parametrize("started,policy,blocktime,ms", [
    (True, None, "0", 200.0),  # the runtime started before draftwise set KMP_BLOCKTIME: its default
    (False, None, None, 200.0),
    (False, None, "0", 0.0),  # what draftwise sets
    (False, "ACTIVE", None, float("inf")),
    (False, "passive", None, 0.0),
    (False, "PASSIVE", "1", 1.0),  # KMP_BLOCKTIME wins over the policy
    (False, None, "infinite", float("inf")),
    (False, None, "20us", 0.02),
    (False, None, "5ms", 5.0),
    (False, None, "soon", 200.0),  # the runtime warns and keeps its default
])
def test_kmp_blocktime_follows_intels_own_rules(started, policy, blocktime, ms):
    assert settings._kmp_blocktime_from_env(started, policy, blocktime) == ms


def test_openmp_runtimes_are_found_by_their_file_names(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libgomp-a34b3233.so.1\n"
        "7f01-7f02 r--p 00001000 08:01 1 /usr/lib/libgomp-a34b3233.so.1\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/intel/lib/libiomp5.so\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /opt/conda/lib/libomp.so\n"
        "7f04-7f05 r-xp 00000000 08:01 4 /usr/lib/libompitrace.so\n"  # not an OpenMP runtime
        "7f05-7f06 rw-p 00000000 00:00 0\n")
    assert settings._openmp_libraries(str(maps)) == [
        "/usr/lib/libgomp-a34b3233.so.1", "/opt/intel/lib/libiomp5.so", "/opt/conda/lib/libomp.so"]
    assert settings._openmp_libraries(str(tmp_path / "absent")) is None


_OPENMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")  # what this process's draftwise set


def _run(code: str, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in _OPENMP_ENV}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().splitlines()


def _imports(first: str, **env) -> bool:
    code = (f"import {first}\nimport torch, draftwise\nfrom draftwise.settings import openmp_spins_long\n"
            "print(openmp_spins_long())")
    return _run(code, **env)[-1] == "True"


def test_import_order_decides_the_spin():
    assert _imports("torch") is True
    assert _imports("draftwise") is False
    assert _imports("torch", OMP_WAIT_POLICY="PASSIVE") is False


# an Intel / LLVM OpenMP runtime as far as draftwise sees one: a libiomp5.so whose kmp_get_blocktime() reads
# KMP_BLOCKTIME when the runtime first starts (its first call), as the real one does (200 ms by default)
_FAKE_IOMP = """
#include <stdlib.h>
static int started = 0, blocktime = 200;
int kmp_get_blocktime(void) {
  if (!started) { const char *v = getenv("KMP_BLOCKTIME"); if (v && *v) blocktime = atoi(v); started = 1; }
  return blocktime;
}
"""


@pytest.fixture(scope="module")
def fake_iomp(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in OpenMP runtime")
    folder = tmp_path_factory.mktemp("iomp")
    (folder / "iomp.c").write_text(_FAKE_IOMP)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(folder / "libiomp5.so"), str(folder / "iomp.c")], check=True)
    return str(folder / "libiomp5.so")


def test_intel_openmp_started_before_draftwise_is_found_by_its_block_time(fake_iomp):
    """Preloaded (Intel's tuning guides' LD_PRELOAD=libiomp5.so) but not started: draftwise's KMP_BLOCKTIME=0
    is what it starts with. Started before draftwise (torch first does that): its default 200 ms is long. A
    block time the user set is read back from the runtime."""
    report = "from draftwise.settings import openmp_spinning_runtime as r\nprint(repr(r()))"
    start = f"import ctypes\nctypes.CDLL({fake_iomp!r}).kmp_get_blocktime()\n"
    assert _run("import draftwise\n" + report, LD_PRELOAD=fake_iomp)[-1] == "''"
    assert _run(start + "import draftwise\n" + report, LD_PRELOAD=fake_iomp)[-1] == "'libiomp5'"
    assert _run("import draftwise\n" + report, LD_PRELOAD=fake_iomp, KMP_BLOCKTIME="1")[-1] == "'libiomp5'"
    assert _run(start + "import draftwise\n" + report, LD_PRELOAD=fake_iomp, KMP_BLOCKTIME="0")[-1] == "''"


@pytest.fixture
def two_threads():
    """torch at 2 threads for the test (serial_torch has something to take away), the kernel built."""
    if extension() is None:
        pytest.skip("the C++ kernel is not built here (serial_torch hands nothing to it)")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class _ThreadsSeen(StatelessDrafter):
    """Drafts nothing; records torch's thread count inside the loop."""

    name = "threads-seen"

    def __init__(self):
        self.seen = []

    def start(self, seq, **_):
        self.seen.append(torch.get_num_threads())

    def propose(self, seqs, ks):
        self.seen.append(torch.get_num_threads())
        return [Draft([]) for _ in seqs]


def _record_threads(obj, monkeypatch) -> list[int]:
    """torch's thread count at every ``obj.forward`` call from now on."""
    seen, inner = [], obj.forward

    def forward(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return inner(*args, **kwargs)

    monkeypatch.setattr(obj, "forward", forward)
    return seen


def _decode(model, drafter):
    dec = Decoder(model, drafter, FixedGamma(2), rows=1, capacity=64)
    seq = Sequence([1, 5, 9, 3], SamplingParams(max_tokens=6))
    dec.run([seq])
    return seq.output_ids


def test_a_long_spin_keeps_the_loops_torch_ops_on_one_thread(two_threads, monkeypatch):
    model = random_model(TINY, seed=3)
    monkeypatch.setattr(settings, "_spins_long", "")
    short = _ThreadsSeen()
    want = _decode(model, short)
    assert set(short.seen) == {2}
    with serial_torch(), parallel_torch(light=True):
        assert torch.get_num_threads() == 2  # a short spin: the light op gets its threads
    monkeypatch.setattr(settings, "_spins_long", "libgomp")
    spinning = _ThreadsSeen()
    assert _decode(model, spinning) == want  # the same tokens
    assert set(spinning.seen) == {1}
    assert extension().get_threads() == 0 and torch.get_num_threads() == 2  # restored after the loop
    with serial_torch():
        with parallel_torch(light=True):
            assert torch.get_num_threads() == 1
        with parallel_torch():
            assert torch.get_num_threads() == 2  # a heavy op (a GEMM) still gets them


def test_a_transformers_model_keeps_torchs_threads_inside_the_serial_loop(two_threads, hf_folder, monkeypatch):
    """``--backend hf``: transformers' GEMMs are torch's own, so its forward gets torch's threads back."""
    from draftwise.models import load_model

    lm = load_model(str(hf_folder), "fp32", backend="hf", progress=False)
    seen = _record_threads(lm.model.hf, monkeypatch)
    monkeypatch.setattr(settings, "_spins_long", "libgomp")
    _decode(lm.model, _ThreadsSeen())
    assert seen and set(seen) == {2}


def test_beam_search_runs_in_the_decode_threads_too(two_threads, monkeypatch):
    from draftwise.beam import beam_search

    model = random_model(TINY, seed=5)
    params = SamplingParams(max_tokens=5)
    want = beam_search(model, [1, 5, 9], params, num_beams=3).token_ids
    seen = _record_threads(model, monkeypatch)
    monkeypatch.setattr(settings, "_spins_long", "libgomp")
    assert beam_search(model, [1, 5, 9], params, num_beams=3).token_ids == want
    assert seen and set(seen) == {1}
