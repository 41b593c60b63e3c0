"""GNU OpenMP's idle spin: torch imported before draftwise leaves libgomp's default (~3 ms of a core after every
torch op, which the kernel's own threads need), and draftwise then keeps the decode loop's torch ops on one
thread (settings.openmp_spins_long, kernels.decode_threads)."""

from __future__ import annotations

import os
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


def _imports(first: str, **env) -> bool:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = (f"import {first}\nimport torch, draftwise\nfrom draftwise.settings import openmp_spins_long\n"
            "print(openmp_spins_long())")
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_import_order_decides_the_spin():
    assert _imports("torch") is True
    assert _imports("draftwise") is False
    assert _imports("torch", OMP_WAIT_POLICY="PASSIVE") is False


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
    monkeypatch.setattr(settings, "_spins_long", False)
    short = _ThreadsSeen()
    want = _decode(model, short)
    assert set(short.seen) == {2}
    with serial_torch(), parallel_torch(light=True):
        assert torch.get_num_threads() == 2  # a short spin: the light op gets its threads
    monkeypatch.setattr(settings, "_spins_long", True)
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
    monkeypatch.setattr(settings, "_spins_long", True)
    _decode(lm.model, _ThreadsSeen())
    assert seen and set(seen) == {2}


def test_beam_search_runs_in_the_decode_threads_too(two_threads, monkeypatch):
    from draftwise.beam import beam_search

    model = random_model(TINY, seed=5)
    params = SamplingParams(max_tokens=5)
    want = beam_search(model, [1, 5, 9], params, num_beams=3).token_ids
    seen = _record_threads(model, monkeypatch)
    monkeypatch.setattr(settings, "_spins_long", True)
    assert beam_search(model, [1, 5, 9], params, num_beams=3).token_ids == want
    assert seen and set(seen) == {1}
