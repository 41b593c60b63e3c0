"""Chunked prefill and the prefix cache (draftwise/prefix.py) on tiny random models through the batch-invariant
kernel: a prompt that starts after cached blocks gets bit for bit the logits, keys and values of a prefill from
an empty cache, and so do keys and values a decode made; every method's output is the same with and without
the cache; eviction keeps the budget; dense weights do not chunk; the server reports cached tokens."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from draftwise.api import SpeculativeDecoder
from draftwise.errors import InvalidParameterError
from draftwise.models import LoadedModel, load_model
from draftwise.models.base import ModelConfig
from draftwise.models.transformer import random_model
from draftwise.decode import Decoder, FixedGamma
from draftwise.prefix import BLOCK, PREFILL_CHUNK, DiskBlocks, PrefixCache, chunked, prefill
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from draftwise.serve.engine import Engine, EngineConfig
from draftwise.serve.server import BackgroundServer
from tests.conftest import TINY_QWEN, make_hf_folder, perturbed, through_kernel

C = BLOCK
CTX = 512


@pytest.fixture(scope="module")
def model():
    return through_kernel(random_model(ModelConfig(**{**TINY_QWEN.to_dict(), "max_context": CTX}), seed=0))


def tokens(n: int, seed: int, vocab: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def run(model, ids, prefix=None, **forward):
    row = model.new_cache(1, CTX)
    with torch.inference_mode():
        out, cached = prefill(model, ids, row, prefix=prefix, logits_for="last", **forward)
    if prefix is not None and prefix.disk is not None:
        assert prefix.disk.flush(timeout=30)  # the folder's writer thread has written what the prompt left
    return out, cached, row


@pytest.mark.parametrize("shared,length", [(5 * C + 11, 9 * C + 3), (2 * C, 3 * C), (C, C + 1), (3 * C + 5, 3 * C + 6),
                                           (2 * C + 1, 2 * C + 1)])
def test_a_prompt_after_cached_blocks_gets_the_bits_of_an_empty_cache(model, shared, length):
    first = tokens(6 * C + 40, seed=1)
    second = first[:shared] + tokens(length - shared, seed=2)
    cache = PrefixCache(1 << 30)
    run(model, first, cache)
    out, cached, row = run(model, second, cache)
    ref, none, ref_row = run(model, second)
    assert cached == min(shared // C, (length - 1) // C) * C and cached > 0 and none == 0
    assert torch.equal(out.logits, ref.logits)  # bit for bit
    n = len(second)
    assert row.length() == n and torch.equal(row.k[:, 0, :, :n], ref_row.k[:, 0, :, :n])
    assert torch.equal(row.v[:, 0, :, :n], ref_row.v[:, 0, :, :n])


def test_a_tokens_keys_and_values_do_not_depend_on_what_computed_them(model):
    """A prefill in chunks, one pass over the whole prompt and plain decoding token by token leave the same
    bits in the cache: what lets a cached block stand for any way of computing it."""
    ids = tokens(3 * C + 7, seed=3)
    _, _, chunks = run(model, ids)
    whole, steps = model.new_cache(1, CTX), model.new_cache(1, CTX)
    with torch.inference_mode():
        model.forward(torch.tensor([ids[:PREFILL_CHUNK]]), whole, logits_for="last")  # the exact path's longest
        for t in ids:
            model.forward(torch.tensor([[t]]), steps, logits_for="last")
    n = PREFILL_CHUNK
    assert torch.equal(chunks.k[:, 0, :, :n], whole.k[:, 0, :, :n])
    assert torch.equal(chunks.k[:, 0, :, :len(ids)], steps.k[:, 0, :, :len(ids)])
    assert torch.equal(chunks.v[:, 0, :, :len(ids)], steps.v[:, 0, :, :len(ids)])


def test_a_finished_sequence_leaves_its_output_in_the_cache(model):
    """The keys and values decoding made serve a later prompt that continues the conversation, bit-exact."""
    cache = PrefixCache(1 << 30)
    prompt = tokens(2 * C + 5, seed=11)
    dec = Decoder(model, None, FixedGamma(1), rows=2, capacity=CTX, prefix_cache=cache)
    seq = Sequence(list(prompt), SamplingParams(max_tokens=3 * C, ignore_eos=True))
    with torch.inference_mode():
        dec.run([seq])
    follow = seq.tokens + tokens(20, seed=12)  # the next turn: the history with its answer, then more
    assert cache.cached_length(follow) == (len(seq.tokens) - 1) // C * C > len(prompt)
    out, cached, row = run(model, follow, cache)
    ref, _, ref_row = run(model, follow)
    assert cached == (len(seq.tokens) - 1) // C * C and torch.equal(out.logits, ref.logits)
    assert torch.equal(row.k[:, 0, :, :len(follow)], ref_row.k[:, 0, :, :len(follow)])


def test_dense_weights_prefill_in_one_pass_without_a_cache():
    dense = random_model(TINY_QWEN, seed=2)  # torch's GEMM: a token's bits depend on the row count
    assert not chunked(dense)
    dw = SpeculativeDecoder(LoadedModel("dense", dense, None, 0.0), None, progress=False)
    assert dw.prefix_cache() is None


def test_every_positions_hidden_state_comes_back_across_chunks(model):
    ids = tokens(C + 40, seed=4)
    out, _, _ = run(model, ids, all_hidden=True, taps=(0,))
    assert out.hidden.shape[:2] == (1, len(ids)) and out.taps.shape[:2] == (1, len(ids))
    with pytest.raises(ValueError, match="hidden state"):
        run(model, ids, PrefixCache(1 << 20), all_hidden=True)


def test_eviction_keeps_the_budget_and_the_deepest_blocks_go_first(model):
    block = 2 * model.config.num_layers * model.config.num_kv_heads * C * model.config.head_dim * 4
    cache = PrefixCache(3 * block)
    a = tokens(3 * C + 10, seed=5)
    run(model, a, cache)
    assert len(cache) == 3 and cache.bytes == 3 * block
    b = tokens(C + 10, seed=6)
    run(model, b, cache)  # one new block: a's deepest goes
    assert len(cache) == 3 and cache.bytes <= cache.budget and cache.evicted_blocks == 1
    assert cache.cached_length(a + [1]) == 2 * C and cache.cached_length(b + [1]) == C
    _, cached, _ = run(model, a + [1], cache)
    assert cached == 2 * C
    assert cache.snapshot()["hit_tokens"] == 2 * C
    tiny = PrefixCache(block - 1)  # a block larger than the budget is not kept
    run(model, a, tiny)
    assert len(tiny) == 0 and tiny.bytes == 0
    two = PrefixCache(2 * block)  # a chain longer than the budget keeps its start (never more than the budget)
    run(model, a, two)
    assert len(two) == 2 and two.bytes == 2 * block and two.cached_length(a) == 2 * C


def test_a_different_token_anywhere_before_a_block_misses_it(model):
    a = tokens(2 * C + 10, seed=7)
    cache = PrefixCache(1 << 30)
    run(model, a, cache)
    b = list(a)
    b[C + 3] = (b[C + 3] + 1) % 96  # the second block differs, the first is shared
    assert cache.cached_length(b) == C
    b[0] = (b[0] + 1) % 96
    assert cache.cached_length(b) == 0


# ---- blocks on disk (--prefix-cache-dir) -----------------------------------------------------------------------
def test_blocks_on_disk_serve_a_later_process_bit_for_bit(model, tmp_path):
    """A second cache (a later process: nothing in memory) over the same folder reads the blocks a first one wrote,
    and the prompt gets the logits, keys and values of a prefill from an empty cache."""
    first = tokens(6 * C + 40, seed=11)
    second = first[:4 * C + 7] + tokens(2 * C, seed=12)
    writer = PrefixCache(1 << 30, disk=DiskBlocks(tmp_path, 1 << 30))
    run(model, first, writer)
    assert writer.disk.written_blocks == 7 and len(list(tmp_path.glob("*.safetensors"))) == 7  # 232 tokens
    reader = PrefixCache(1 << 30, disk=DiskBlocks(tmp_path, 1 << 30))
    assert len(reader) == 0 and reader.cached_length(second) == 4 * C  # found without reading them
    out, cached, row = run(model, second, reader)
    ref, _, ref_row = run(model, second)
    assert cached == 4 * C and reader.disk.read_blocks == 4
    assert torch.equal(out.logits, ref.logits)
    n = len(second)
    assert torch.equal(row.k[:, 0, :, :n], ref_row.k[:, 0, :, :n]) and torch.equal(row.v[:, 0, :, :n], ref_row.v[:, 0, :, :n])
    # a memory budget of two blocks still reads the whole prefix from the disk
    small = PrefixCache(2 * writer.bytes // len(writer), disk=DiskBlocks(tmp_path, 1 << 30))
    out2, cached2, _ = run(model, second, small)
    assert cached2 == (len(second) - 1) // C * C  # the reader wrote the rest of second's blocks
    assert torch.equal(out2.logits, ref.logits) and small.bytes <= small.budget


def test_damaged_or_foreign_block_files_are_misses(model, tmp_path):
    ids = tokens(3 * C + 5, seed=13)
    run(model, ids, PrefixCache(1 << 30, disk=DiskBlocks(tmp_path, 1 << 30)))
    files = sorted(tmp_path.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    keys = list(PrefixCache(0).keys(ids, 3))
    (tmp_path / f"{keys[1].hex()}.safetensors").write_bytes(b"not a safetensors file")  # damaged: the 2nd block
    from safetensors.torch import save_file
    save_file({"k": torch.zeros(1, 2, C, 4), "v": torch.zeros(1, 2, C, 4)}, str(tmp_path / f"{keys[2].hex()}.safetensors"))
    cache = PrefixCache(1 << 30, disk=DiskBlocks(tmp_path, 1 << 30))
    out, cached, _ = run(model, ids, cache)
    ref, _, _ = run(model, ids)
    assert cached == C and torch.equal(out.logits, ref.logits)  # the first block only; no error
    assert len(files) == 3 and cache.snapshot()["disk_read_blocks"] == 1
    # the damaged file was removed and written again by this run; the foreign one is found out at its first read
    assert (tmp_path / f"{keys[1].hex()}.safetensors").stat().st_size > 1000
    again = PrefixCache(1 << 30, disk=DiskBlocks(tmp_path, 1 << 30))
    assert run(model, ids, again)[1] == 2 * C
    assert run(model, ids, PrefixCache(1 << 30, disk=DiskBlocks(tmp_path, 1 << 30)))[1] == 3 * C


def test_the_folder_keeps_its_budget_least_recently_used_first(model, tmp_path):
    a, b = tokens(2 * C + 1, seed=14), tokens(2 * C + 1, seed=15)
    probe = PrefixCache(1 << 30, disk=DiskBlocks(tmp_path / "probe", 1 << 30))
    run(model, a, probe)
    size = max(p.stat().st_size for p in (tmp_path / "probe").glob("*.safetensors"))
    disk = DiskBlocks(tmp_path / "x", 3 * size)
    run(model, a, PrefixCache(1 << 30, disk=disk))
    run(model, b, PrefixCache(1 << 30, disk=disk))  # 4 blocks written, 3 fit: a's deepest goes (its start stays)
    assert disk.bytes() <= 3 * size and len(list((tmp_path / "x").glob("*.safetensors"))) == 3
    fresh = PrefixCache(1 << 30, disk=DiskBlocks(tmp_path / "x", 3 * size))
    assert fresh.cached_length(b + [1]) == 2 * C and fresh.cached_length(a + [1]) == C
    run(model, a, fresh)  # a read (its start) and written again: now b's deepest is the oldest
    assert fresh.cached_length(a + [1]) == 2 * C and fresh.cached_length(b + [1]) == C


def test_the_blocks_are_written_by_a_thread_of_their_own(model, tmp_path, monkeypatch):
    """``store`` hands the blocks to the folder's writer and returns: a slow disk does not hold the caller (the
    engine, every running stream) up; until written, the blocks are served from memory, bit for bit."""
    import threading

    release, calls = threading.Event(), []
    real_put = DiskBlocks.put

    def slow_put(self, key, k, v):
        calls.append(threading.current_thread().name)
        release.wait(30)
        return real_put(self, key, k, v)

    monkeypatch.setattr(DiskBlocks, "put", slow_put)
    ids = tokens(3 * C + 5, seed=21)
    disk = DiskBlocks(tmp_path, 1 << 30)
    cache = PrefixCache(0, disk=disk)  # nothing in memory: the disk alone
    row = model.new_cache(1, CTX)
    with torch.inference_mode():
        prefill(model, ids, row, prefix=cache, logits_for="last")  # returns while the writer waits
    assert not list(tmp_path.glob("*.safetensors")) and len(disk._pending) == 3
    assert not disk.flush(timeout=0.05)
    reader = PrefixCache(0, disk=disk)  # another request, the same folder, before any file exists
    row2 = model.new_cache(1, CTX)
    with torch.inference_mode():
        out, cached = prefill(model, ids, row2, prefix=reader, logits_for="last")
    ref, _, ref_row = run(model, ids)
    assert cached == 3 * C and torch.equal(out.logits, ref.logits)
    n = len(ids)
    assert torch.equal(row2.k[:, 0, :, :n], ref_row.k[:, 0, :, :n])
    release.set()
    assert disk.flush(timeout=30) and disk.written_blocks == 3 and not disk._pending and disk.pending_bytes == 0
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 and set(calls) == {"draftwise-prefix-disk"}
    fresh = PrefixCache(0, disk=DiskBlocks(tmp_path, 1 << 30))  # a later process reads the files
    assert fresh.cached_length(ids) == 3 * C
    disk.close()  # stopped: a later chain is not kept
    assert disk.put_chain([(b"k" * 16, torch.zeros(1), torch.zeros(1))]) == 0 and not disk._pending


def test_the_writer_queue_is_bounded_and_a_full_disk_drops_the_rest(model, tmp_path, monkeypatch):
    """A chain past the pending bound keeps its start (a deeper block is useless without the ones before it), the
    rest counted as dropped; a block the disk refuses drops what waits behind it, and the writer lives on."""
    ids = tokens(6 * C + 3, seed=22)
    probe = PrefixCache(1 << 30)
    run(model, ids, probe)
    k0 = next(iter(probe._blocks.values()))[0]
    size = 2 * k0.numel() * k0.element_size()  # bytes of one block, keys and values
    disk = DiskBlocks(tmp_path / "bounded", 1 << 30, pending_bytes=2 * size)
    import threading

    gate = threading.Event()
    real_put = DiskBlocks.put
    monkeypatch.setattr(DiskBlocks, "put", lambda self, *a: gate.wait(30) and real_put(self, *a))
    cache = PrefixCache(0, disk=disk)
    row = model.new_cache(1, CTX)
    with torch.inference_mode():
        prefill(model, ids, row, prefix=cache, logits_for="last")
    assert len(disk._pending) == 2 and disk.dropped_blocks == 4 and disk.pending_bytes == 2 * size
    gate.set()
    assert disk.flush(timeout=30)
    keys = list(cache.keys(ids, 6))
    assert sorted(p.stem for p in (tmp_path / "bounded").glob("*.safetensors")) == sorted(k.hex() for k in keys[:2])
    # a full disk: the first write fails, and the block behind it is given up too; the next chain is written
    full = DiskBlocks(tmp_path / "full", 1 << 30)
    fails = iter([False])
    monkeypatch.setattr(DiskBlocks, "put", lambda self, *a: next(fails, None) is not False and real_put(self, *a))
    blocks = [(key, *probe._blocks[key]) for key in keys[:2]]
    assert full.put_chain(blocks) == 2 and full.flush(timeout=30)
    assert full.written_blocks == 0 and full.dropped_blocks == 2 and not full._pending
    assert full.put_chain(blocks) == 2 and full.flush(timeout=30) and full.written_blocks == 2
    snap = PrefixCache(0, disk=full).snapshot()
    assert snap["disk_written_blocks"] == 2 and snap["disk_dropped_blocks"] == 2 and snap["disk_pending_blocks"] == 0
    full.close()


# ---- through the decoder: every method, with and without the cache -----------------------------------------
@pytest.fixture(scope="module")
def dw(tmp_path_factory) -> SpeculativeDecoder:
    folder = make_hf_folder(tmp_path_factory.mktemp("tiny-long"), max_context=CTX)
    target = load_model(str(folder), "fp32", progress=False)
    draft = LoadedModel("tiny-draft", through_kernel(perturbed(target.model, 0.3, seed=5)), target.tokenizer, 0.0)
    through_kernel(target.model)
    return SpeculativeDecoder(target, draft, progress=False)


@pytest.mark.parametrize("method", ["ar", "draft", "pld", "auto", "draft-tree"])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.9, seed=3)],
                         ids=["greedy", "seeded"])
def test_every_method_gives_the_same_tokens_with_the_cache(dw, method, params):
    vocab = dw.target.config.vocab_size
    history = tokens(4 * C + 20, seed=8, vocab=vocab)
    turn1 = history + tokens(30, seed=9, vocab=vocab)
    dw.prefix_cache().clear()
    dw.prefix_cache(dw.draft.model).clear()
    first = dw.generate(turn1, params, method=method, gamma=3)
    turn2 = turn1 + first.token_ids + tokens(40, seed=10, vocab=vocab)  # the answer, then the next message
    second = dw.generate(turn2, params, method=method, gamma=3)
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens == (len(turn1) + len(first.token_ids) - 1) // C * C
    cold = SpeculativeDecoder(dw.target, dw.draft, progress=False, prefix_cache_mb=0)
    assert cold.prefix_cache() is None
    ref = cold.generate(turn2, params, method=method, gamma=3)
    assert second.token_ids == ref.token_ids and ref.stats.cached_tokens == 0
    if method in ("draft", "draft-tree"):  # the draft model's own cache served its start
        assert dw.prefix_cache(dw.draft.model).hit_tokens >= len(turn1) // C * C


def test_a_decoder_with_a_cache_folder_serves_the_next_one(dw, tmp_path):
    """Two decoders (two processes) over one --prefix-cache-dir: the second reads the first's prompt from the
    folder, the target's in a sub-folder named by its weight file, format and kernel build; the same tokens."""
    vocab = dw.target.config.vocab_size
    prompt = tokens(5 * C + 9, seed=16, vocab=vocab)
    params = SamplingParams(max_tokens=16)
    one = SpeculativeDecoder(dw.target, dw.draft, progress=False, prefix_cache_dir=tmp_path)
    a = one.generate(prompt, params, method="draft", gamma=3)
    assert one.prefix_cache().disk.flush(timeout=30)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 1 and folders[0].startswith(dw.target.name.rsplit("/", 1)[-1][:20])  # the draft: in memory
    two = SpeculativeDecoder(dw.target, dw.draft, progress=False, prefix_cache_dir=tmp_path)
    b = two.generate(prompt, params, method="draft", gamma=3)
    assert a.stats.cached_tokens == 0 and b.stats.cached_tokens == 5 * C and b.token_ids == a.token_ids
    assert two.prefix_cache().snapshot()["disk_read_blocks"] == 5


def test_prefix_cache_folder_is_checked(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    for kw, match in (({"prefix_cache_dir": f}, "is a file"), ({"prefix_cache_disk_mb": 0}, "prefix_cache_disk_mb"),
                      ({"prefix_cache_disk_mb": "1"}, "prefix_cache_disk_mb")):
        with pytest.raises(InvalidParameterError, match=match):
            SpeculativeDecoder(LoadedModel("m", random_model(TINY_QWEN), None, 0.0), None, **kw)


def test_prefix_cache_size_is_checked():
    for bad in (-1, float("nan"), "512", True):
        with pytest.raises(InvalidParameterError, match="prefix_cache_mb"):
            SpeculativeDecoder(LoadedModel("m", random_model(TINY_QWEN), None, 0.0), None, prefix_cache_mb=bad)


def test_the_server_reports_cached_prompt_tokens(dw):
    dw.prefix_cache().clear()
    engine = Engine(dw, EngineConfig(method="pld", max_batch=2))
    system = "You are a careful assistant. " * 8  # a long shared system prompt
    with BackgroundServer(engine, "tiny") as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        got = []
        for question in ("hello world", "the quick brown fox"):
            r = c.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
            assert r.status_code == 200, r.text
            got.append(r.json()["usage"])
        metrics = c.get("/metrics").text
    assert got[0]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = got[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % C == 0 and cached < got[1]["prompt_tokens"]
    assert f"draftwise_prefix_cache_hit_tokens_total {float(cached)}" in metrics
    assert "draftwise_prefix_cache_bytes " in metrics


# ---- a prompt prefilled between steps of the running batch -------------------------------------------------
def alone(model, prompt, max_tokens):
    dec = Decoder(model, None, FixedGamma(1), rows=1, capacity=CTX)
    seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    with torch.inference_mode():
        dec.run([seq])
    return seq.output_ids


@pytest.mark.parametrize("leave", [False, True], ids=["stay", "a-running-one-leaves"])
def test_a_long_prompt_prefills_between_steps_with_the_same_tokens(model, leave):
    """``begin`` / ``advance(32)``: the running sequences step between the new prompt's chunks; the new one joins
    the batch (moved down a row when a running one left meanwhile) and every output is its alone-run's."""
    short = [tokens(10, seed=20), tokens(12, seed=21)]
    long = tokens(6 * C + 9, seed=22)
    dec = Decoder(model, None, FixedGamma(1), rows=3, capacity=CTX)
    limits = [3 if leave else 40, 40]
    seqs = [Sequence(list(p), SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(short, limits)]
    new = Sequence(list(long), SamplingParams(max_tokens=20, ignore_eos=True))
    with torch.inference_mode():
        for s in seqs:
            dec.add(s)
        dec.begin(new)
        assert dec.free_rows == 0 and new.row == 2
        advances = 0
        while dec.prefilling is not None:
            done, spent = dec.advance(C)
            advances += 1
            assert spent <= C
            dec.step()  # the running ones go on between the chunks
        assert advances == 7 and done is new and new in dec.running and new.row == len(dec.running) - 1
        assert new.row == (1 if leave else 2)
        while dec.running:
            dec.step()
    assert [s.output_ids for s in seqs] == [alone(model, p, n) for p, n in zip(short, limits)]
    assert new.output_ids == alone(model, long, 20)


def test_a_prefill_aborted_or_failed_leaves_its_row_free(model, monkeypatch):
    dec = Decoder(model, None, FixedGamma(1), rows=1, capacity=CTX)
    first = Sequence(tokens(PREFILL_CHUNK + 4 * C, seed=23), SamplingParams(max_tokens=4))  # prefilled in chunks
    with torch.inference_mode():
        dec.begin(first)
        assert dec.advance(C) == (None, C)  # a budget of C tokens: a chunk of C, the prompt not done
        dec.abort(first)
        assert first.finish_reason == "abort" and dec.prefilling is None and dec.free_rows == 1
        second = Sequence(tokens(PREFILL_CHUNK + 3 * C, seed=24), SamplingParams(max_tokens=4))
        dec.begin(second)
        real, calls = model.forward, {"n": 0}

        def failing(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real(*a, **kw)
        monkeypatch.setattr(model, "forward", failing)
        with pytest.raises(RuntimeError, match="boom"):
            dec.advance(None)
        monkeypatch.undo()
        assert dec.prefilling is None and dec.free_rows == 1 and not dec.running
        third = Sequence(tokens(2 * C + 3, seed=25), SamplingParams(max_tokens=6, ignore_eos=True))
        dec.run([third])
    assert third.output_ids == alone(model, third.prompt_ids, 6)


def test_the_server_streams_running_requests_while_a_long_prompt_prefills(dw):
    """With ``max_prefill_tokens`` 32 a 500-token prompt takes many iterations; the running stream gets tokens
    in between, and both answers are their alone-runs'."""
    import queue as queue_mod

    from draftwise.serve.engine import Output

    engine = Engine(dw, EngineConfig(method="ar", max_batch=2, max_prefill_tokens=32)).start()
    try:
        events: queue_mod.Queue = queue_mod.Queue()
        vocab = dw.target.config.vocab_size
        short, long = tokens(8, seed=26, vocab=vocab), tokens(16 * C - 20, seed=27, vocab=vocab)
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        engine.submit("short", [engine.new_sequence(short, params)], lambda ev: events.put(("short", ev)))
        while events.get(timeout=60)[0] != "short":
            pass  # the short one runs
        engine.submit("long", [engine.new_sequence(long, SamplingParams(max_tokens=8, ignore_eos=True))],
                      lambda ev: events.put(("long", ev)))
        order, texts = [], {"short": [], "long": []}
        done = set()
        while len(done) < 2:
            rid, ev = events.get(timeout=120)
            assert isinstance(ev, Output), ev
            order.append((rid, len(ev.token_ids)))
            texts[rid] += ev.token_ids
            if ev.finish_reason is not None:
                done.add(rid)
        first_long = next(i for i, (rid, n) in enumerate(order) if rid == "long" and n)
        assert sum(n for rid, n in order[:first_long] if rid == "short") >= 10  # it streamed meanwhile
    finally:
        engine.stop()
    cold = SpeculativeDecoder(dw.target, None, progress=False, prefix_cache_mb=0)
    assert texts["long"] == cold.generate(long, SamplingParams(max_tokens=8, ignore_eos=True), method="ar").token_ids


def test_a_process_that_ends_writes_what_waits_first(tmp_path):
    """The writer is a daemon thread; the end of the process (atexit) waits for the blocks handed to it."""
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
import time, torch
from draftwise.prefix import DiskBlocks
real = DiskBlocks.put
DiskBlocks.put = lambda self, *a: (time.sleep(0.3), real(self, *a))[1]  # a slow disk
d = DiskBlocks({str(tmp_path)!r}, 1 << 30)
t = torch.zeros(2, 3)
assert d.put_chain([(bytes([i]) * 16, t + i, t - i) for i in range(3)]) == 3
"""  # and exits at once
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, timeout=120,
                   env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert sorted(p.name[:2] for p in tmp_path.glob("*.safetensors")) == ["00", "01", "02"]
