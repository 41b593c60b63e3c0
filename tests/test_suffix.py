"""Method suffix (SuffixDecoding): the occurrence search, counts and tree shape, the bounded global cache
and its eviction, greedy equality with plain decoding (batched, ragged), the sampled distribution, and
the repeated-workload gain that the global cache exists for."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.suffix import SEP, SuffixCache, SuffixDrafter, _grow, _Local, _occurrences
from draftwise.errors import InvalidParameterError
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from tests.test_decode import PROMPTS, exact_joint, joint_pvalue, run


def store(*seqs: list[int]) -> np.ndarray:
    cache = SuffixCache()
    for s in seqs:
        cache.add(s)
    return cache.buffer


def started(tokens: list[int], max_tokens: int = 8) -> Sequence:
    seq = Sequence(list(tokens), SamplingParams(max_tokens=max_tokens))
    SuffixDrafter().start(seq)
    return seq


# ---- the structure -------------------------------------------------------------------------------
def test_occurrences_are_nested_suffix_matches():
    buf = store([5, 1, 2, 3, 9], [1, 2, 3, 7], [4, 2, 3, 8])
    rev = np.array([3, 2, 1], dtype=np.int32)  # context ... 1 2 3
    sets = _occurrences(buf, len(buf), rev)
    ends = [[int(buf[p]) for p in s] for s in sets]
    assert ends == [[3, 3, 3], [3, 3, 3], [3, 3]]  # "3" three times, "2 3" three times, "1 2 3" twice
    assert [int(buf[p + 1]) for p in sets[2]] == [9, 7]  # what followed "1 2 3"
    assert _occurrences(buf, len(buf), np.array([42], dtype=np.int32)) == []


def test_match_never_crosses_a_sequence_boundary():
    buf = store([1, 2], [3, 4])  # "2 3" never occurred: 2 ends one request, 3 starts the next
    assert len(_occurrences(buf, len(buf), np.array([3, 2], dtype=np.int32))) == 1
    tree = _grow(buf, np.flatnonzero(buf == 2), budget=4, depth=4, min_prob=0.0)
    assert tree.paths == []  # nothing is known to follow "2"


def test_counts_give_path_probabilities_best_first():
    # after "1": 2 (x3, then 5 twice and 6 once), 3 (x1)
    buf = store([1, 2, 5], [1, 2, 5], [1, 2, 6], [1, 3])
    tree = _grow(buf, np.flatnonzero(buf == 1), budget=10, depth=5, min_prob=0.0)
    assert tree.paths == [(2,), (2, 5), (3,), (2, 6)]
    assert tree.probs == pytest.approx([0.75, 0.5, 0.25, 0.25])
    assert tree.score == pytest.approx(1.75)


def test_budget_depth_and_min_prob_bound_the_tree():
    buf = store([1, 2, 5], [1, 2, 5], [1, 2, 6], [1, 3])
    ends = np.flatnonzero(buf == 1)
    assert _grow(buf, ends, budget=2, depth=5, min_prob=0.0).paths == [(2,), (2, 5)]
    assert _grow(buf, ends, budget=10, depth=1, min_prob=0.0).paths == [(2,), (3,)]
    assert _grow(buf, ends, budget=10, depth=5, min_prob=0.3).paths == [(2,), (2, 5)]


def test_local_store_excludes_the_context_itself_and_grows():
    seq = started([1, 2, 3, 1, 2])
    local: _Local = seq.drafter_state
    assert local.buf[0] == SEP and local.buf[local.n + 1] == SEP and local.n == 5
    d = SuffixDrafter().propose([seq], [4])[0]
    assert d.tokens == [3, 1]  # "1 2" occurred once before, followed by 3 1 2; a 2-token match earns 2 nodes
    assert SuffixDrafter(alpha=4.0).propose([seq], [4])[0].tokens == [3, 1, 2]  # then the context's end
    seq.tokens += list(range(10, 40))  # past the initial capacity: the store grows
    local.sync(seq.tokens)
    assert local.n == len(seq.tokens) and local.buf[1:local.n + 1].tolist() == seq.tokens


def test_draft_size_adapts_to_the_match_length():
    """max_spec = alpha * match length: a 1-token match earns 1 node with alpha 1, a long match more."""
    cache = SuffixCache()
    cache.add([7, 8, 9, 10, 11, 12, 13, 14])
    short = started([50, 9])  # matches "9" only
    assert len(SuffixDrafter(cache, alpha=1.0).propose([short], [6])[0].tokens) == 1
    assert len(SuffixDrafter(cache, alpha=2.0).propose([short], [6])[0].tokens) == 2
    long = started([7, 8, 9])  # matches "7 8 9"
    assert SuffixDrafter(cache, alpha=1.0).propose([long], [6])[0].tokens == [10, 11, 12]
    assert SuffixDrafter(cache, alpha=1.0, max_nodes=2).propose([long], [6])[0].tokens == [10, 11]
    assert SuffixDrafter(cache, alpha=1.0).propose([long], [2])[0].tokens == [10, 11]  # γ bounds the depth


def test_local_and_global_candidates_merge_into_one_tree():
    cache = SuffixCache()
    cache.add([1, 2, 3, 4, 5, 6])
    seq = started([1, 2, 3, 9, 9, 1, 2, 3])  # locally "1 2 3" was followed by 9 9, globally by 4 5 6
    d = SuffixDrafter(cache).propose([seq], [3])[0]
    assert d.is_tree
    branches = {tuple(d.tokens[i] for i in _path(d.parents, leaf))
                for leaf in range(len(d.tokens)) if leaf not in d.parents}
    assert branches == {(4, 5, 6), (9, 9, 1)}
    assert len(SuffixDrafter(None).propose([seq], [3])[0].tokens) == 3  # share=False: the local branch only


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_cache_evicts_whole_oldest_requests_and_stays_bounded():
    cache = SuffixCache(max_tokens=100)
    rng = np.random.default_rng(0)
    for i in range(200):
        cache.add(rng.integers(0, 50, size=int(rng.integers(1, 40))).tolist())
        assert len(cache) <= 100
        assert cache.buffer[0] == SEP and cache.buffer[-1] == SEP
        assert len(cache.buffer) == 1 + len(cache) + cache.sequences  # tokens + one separator each
    assert cache.nbytes <= 4 * (1 + 100 + 100)
    cache.add(list(range(300)))  # longer than the cache: its last 100 tokens, everything else evicted
    assert cache.buffer.tolist() == [SEP] + list(range(200, 300)) + [SEP]
    cache.clear()
    assert len(cache) == 0 and cache.sequences == 0


def test_deferred_additions_wait_for_the_block_and_come_once():
    """bench runs every method on a prompt inside ``deferred``: none drafts from another's output of it."""
    cache = SuffixCache()
    cache.add([1, 2, 3])
    with cache.deferred():
        cache.add([4, 5, 6])
        cache.add([4, 5, 6])  # the same output from a second method
        cache.add([7, 8])
        assert cache.buffer.tolist() == [SEP, 1, 2, 3, SEP]
    assert cache.buffer.tolist() == [SEP, 1, 2, 3, SEP, 4, 5, 6, SEP, 7, 8, SEP]
    cache.add([9])  # no longer deferred
    assert cache.sequences == 4


def test_evicted_requests_no_longer_propose():
    cache = SuffixCache(max_tokens=40)
    drafter = SuffixDrafter(cache)
    old = list(range(100, 120))
    cache.add(old)
    assert drafter.propose([started(old[:10])], [4])[0].tokens == old[10:14]
    cache.add(list(range(200, 215)))
    assert drafter.propose([started(old[:10])], [4])[0].tokens == old[10:14]  # 35 tokens: still held
    cache.add(list(range(300, 310)))  # 45 > 40: the oldest request goes
    assert cache.sequences == 2 and old[0] not in cache.buffer
    assert drafter.propose([started(old[:10])], [4])[0].tokens == []


def test_cache_is_safe_to_share_between_threads():
    cache = SuffixCache(max_tokens=500)
    stop = threading.Event()
    bad: list[str] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            cache.add(rng.integers(0, 30, size=int(rng.integers(1, 60))).tolist())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    drafter = SuffixDrafter(cache)
    for _ in range(300):
        buf = cache.buffer
        if buf[0] != SEP or buf[-1] != SEP or len(buf) > 1 + 500 + 500:
            bad.append(f"inconsistent snapshot of {len(buf)}")
        drafter.propose([started([1, 2, 3])], [4])
    stop.set()
    for t in threads:
        t.join()
    assert not bad and len(cache) <= 500


def test_release_adds_finished_requests_only():
    cache = SuffixCache()
    drafter = SuffixDrafter(cache)
    seq = started([1, 2, 3])
    drafter.release(Sequence([4, 5], SamplingParams()))  # never started (finished at prefill): nothing
    failed = started([6, 7])
    failed.error = RuntimeError("boom")
    drafter.release(failed)
    assert len(cache) == 0
    seq.tokens += [4, 5]
    drafter.release(seq)
    assert cache.buffer.tolist() == [SEP, 1, 2, 3, 4, 5, SEP]


@pytest.mark.parametrize("bad", [dict(max_nodes=0), dict(max_nodes=2.5), dict(max_match=0), dict(alpha=0),
                                 dict(min_prob=1.5), dict(min_prob=-0.1)])
def test_bad_options(bad):
    with pytest.raises(InvalidParameterError):
        SuffixDrafter(**bad)


def test_bad_cache_size():
    with pytest.raises(InvalidParameterError):
        SuffixCache(max_tokens=-1)


# ---- through the decode loop ---------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_plain_batched_and_ragged(tiny_target, gamma):
    params = SamplingParams(max_tokens=48)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    cache = SuffixCache()
    for rows in (1, 4):  # one at a time, then all four in one batch (the cache now holds the first run)
        seqs = run(tiny_target, SuffixDrafter(cache), PROMPTS, params, gamma=gamma, rows=rows)
        assert [s.output_ids for s in seqs] == ref
    fresh = run(tiny_target, SuffixDrafter(SuffixCache()), PROMPTS, params, gamma=gamma, rows=4)
    assert [s.output_ids for s in fresh] == ref
    assert sum(s.stats.drafted for s in fresh) > 0
    if gamma > 1:  # rows accepted different numbers of drafts, some drafts were rejected
        assert len({s.stats.acceptance_rate for s in fresh}) > 1
        assert any(s.stats.accepted < s.stats.drafted for s in fresh)


def test_eos_and_max_tokens_inside_an_accepted_block(tiny_target):
    params = SamplingParams(max_tokens=40)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0].output_ids
    cache = SuffixCache()
    cache.add(PROMPTS[0] + ref)  # the next run's drafts are right: long accepted blocks
    eos = frozenset({ref[17]})
    want = run(tiny_target, None, [PROMPTS[0]], params, eos=eos)[0].output_ids
    got = run(tiny_target, SuffixDrafter(cache), [PROMPTS[0]], params, gamma=6, eos=eos)[0]
    assert got.output_ids == want and got.finish_reason == "stop"
    short = run(tiny_target, SuffixDrafter(cache), [PROMPTS[0]], SamplingParams(max_tokens=13), gamma=6)[0]
    assert short.output_ids == ref[:13]


def test_repeated_request_accepts_far_more(tiny_target):
    """The same request twice: the second finds the first's output in the global cache (τ near γ + 1);
    with the cache off (or after eviction) it does not. (A seeded sample: one text whatever the drafts,
    and less repetitive than the tiny model's greedy loops, which the request's own tokens predict.)"""
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3)
    cache = SuffixCache()
    first = run(tiny_target, SuffixDrafter(cache), [PROMPTS[1]], params, gamma=5)[0]
    second = run(tiny_target, SuffixDrafter(cache), [PROMPTS[1]], params, gamma=5)[0]
    alone = run(tiny_target, SuffixDrafter(None), [PROMPTS[1]], params, gamma=5)[0]
    assert first.output_ids == second.output_ids == alone.output_ids
    assert second.stats.mean_accepted_length >= 4.5
    assert second.stats.mean_accepted_length > 2 * first.stats.mean_accepted_length
    assert alone.stats.mean_accepted_length == first.stats.mean_accepted_length
    small = SuffixCache(max_tokens=len(second.tokens))
    small.add(first.tokens)
    small.add([90] * len(second.tokens))  # another request evicts the first
    evicted = run(tiny_target, SuffixDrafter(small), [PROMPTS[1]], params, gamma=5)[0]
    assert evicted.stats.mean_accepted_length < 0.5 * second.stats.mean_accepted_length


@pytest.mark.statistical
def test_sampled_output_distribution_matches_target():
    """Sampling end to end with suffix trees — the global cache growing with every earlier sample, so
    the drafts of sample i depend on samples 0..i-1 (never on sample i's own draws): the joint of the
    first three output tokens is the target's."""
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=None)
    exact = exact_joint(target, prompt, params)
    cache = SuffixCache(max_tokens=2000)
    dec = Decoder(target, SuffixDrafter(cache, min_prob=0.0), FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(99)
    seqs = [Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000)]
    assert joint_pvalue(dec, iter(seqs), exact) > 1e-3
    assert cache.sequences > 100
    assert 0 < sum(s.stats.accepted for s in seqs) < sum(s.stats.drafted for s in seqs)


def test_seeded_sampling_equals_seeded_plain(tiny_target):
    params = SamplingParams(temperature=0.9, max_tokens=40, seed=5)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    cache = SuffixCache()
    for _ in range(2):
        assert [s.output_ids for s in run(tiny_target, SuffixDrafter(cache), PROMPTS, params, rows=4)] == ref


# ---- the library front ---------------------------------------------------------------------------
def test_speculative_decoder_shares_one_cache(hf_folder):
    from draftwise import SpeculativeDecoder
    from draftwise.api import METHODS, tree_options

    dw = SpeculativeDecoder(str(hf_folder), draft=None, progress=False)
    assert "suffix" in METHODS
    assert tree_options("suffix", None) == {} and tree_options("suffix", 4) == {"max_nodes": 4}
    assert tree_options("pld-tree", None) == {"branches": 3}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ar = dw.generate("hello world", params, method="ar")
    one = dw.generate("hello world", params, method="suffix", gamma=6)
    two = dw.generate("hello world", params, method="suffix", gamma=6, drafter_options={"max_nodes": 6})
    alone = dw.generate("hello world", params, method="suffix", gamma=6, drafter_options={"share": False})
    assert ar.token_ids == one.token_ids == two.token_ids == alone.token_ids
    assert dw.suffix_cache.sequences == 2  # share=False neither reads nor adds
    assert two.stats.mean_accepted_length > 4.0 > alone.stats.mean_accepted_length
    with pytest.raises(InvalidParameterError):
        dw.generate("hello world", params, method="suffix", drafter_options={"max_nodes": 0})


def test_cli_accepts_suffix(hf_folder, capsys):
    import json

    from draftwise.bench.harness import parse_methods
    from draftwise.cli import build_parser, main

    code = main(["generate", "hello world", "--target", str(hf_folder), "--method", "suffix", "--tree-width", "4",
                 "--max-tokens", "12", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["method"] == "suffix"
    for cmd in ("chat", "serve", "bench-serve"):
        args = build_parser().parse_args([cmd, "--method", "suffix"])
        assert args.method == "suffix" and args.tree_width is None
    assert parse_methods("suffix") == ["ar", "suffix"] and "suffix" in parse_methods("all")


@pytest.mark.slow
def test_real_weights_greedy_equals_plain(smollm):
    """SmolLM2-135M: suffix gives ar's tokens, prompt after prompt (the global cache filling up), and a
    repeated prompt is accepted far more often the second time."""
    from draftwise import SpeculativeDecoder

    dw = SpeculativeDecoder(smollm, None, progress=False)
    prompts = ["def fibonacci(n):", "The three primary colors are", "Question: What is 12 * 7?\nAnswer:",
               "def fibonacci(n):"]
    params = SamplingParams(max_tokens=48)
    taus = []
    for prompt in prompts:
        ar = dw.generate(prompt, params, method="ar")
        for gamma in (3, "auto"):
            r = dw.generate(prompt, params, method="suffix", gamma=gamma)
            assert r.token_ids == ar.token_ids, (prompt, gamma)
            if gamma == 3:  # the first suffix run of this prompt (the "auto" one already finds it cached)
                taus.append(r.stats.mean_accepted_length)
    assert taus[3] > 2.0 and taus[3] > 1.5 * taus[0]
