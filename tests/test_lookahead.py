"""Lookahead decoding (drafters/lookahead.py): the pool, the window's tree (the paper's attention pattern),
one Jacobi iteration by hand, the loop handing a drafter every node's logits; end to end its greedy and
seeded output equal plain decoding (batched, ragged, in the server) and its sampled output has the
target's distribution; SmolLM2 greedy equality (slow)."""

from __future__ import annotations

import json
import queue

import pytest
import torch

from draftwise.api import SpeculativeDecoder, tree_options
from draftwise.cli import main
from draftwise.decode import Decoder, FixedGamma, tree_inputs
from draftwise.drafters.base import Draft, Needs, StatelessDrafter
from draftwise.drafters.lookahead import LookaheadDrafter, parse_lookahead
from draftwise.errors import InvalidParameterError
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from tests.test_decode import PROMPTS, exact_joint, joint_pvalue, run

V = 100


def state_for(drafter: LookaheadDrafter, prompt: list[int], chain: list[int], cols: list[list[int]],
              age: int = 0) -> Sequence:
    """A started sequence whose window is set by hand."""
    seq = Sequence(prompt, SamplingParams())
    drafter.start(seq)
    st = seq.drafter_state
    st.chain, st.cols, st.age = list(chain), [list(c) for c in cols], [age] * len(cols)
    return seq


def onehot_logits(best: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(best), V)  # (1 + nodes, V)
    logits[torch.arange(len(best)), torch.tensor(best)] = 1.0
    return logits


# ---- options ------------------------------------------------------------------------------------
def test_options_and_bad_input():
    assert parse_lookahead("4, 3,2") == {"window": 4, "ngram": 3, "guesses": 2}
    assert tree_options("lookahead", None, None, "2,2,0") == {"window": 2, "ngram": 2, "guesses": 0}
    assert tree_options("lookahead", 5, None, None) == {}  # --tree-width is not lookahead's
    for spec in ("3,3", "a,b,c", "0,3,2", "3,1,2", "3,3,-1", "16,3,2"):  # the last feeds (16+2)*2 = 36 > 32 tokens
        with pytest.raises(InvalidParameterError):
            parse_lookahead(spec)
    with pytest.raises(InvalidParameterError):
        LookaheadDrafter(window=True)


# ---- the pool -----------------------------------------------------------------------------------
def test_pool_seeded_from_prompt_latest_first_bounded():
    d = LookaheadDrafter(window=2, ngram=3, guesses=2, pool_size=2)
    seq = Sequence([1, 2, 3, 1, 2, 4, 1, 2, 5], SamplingParams())
    d.start(seq)
    st = seq.drafter_state
    assert d.candidates(st, 1) == [[2, 5], [2, 4]]  # (2, 3) dropped: at most pool_size per first token
    assert d.candidates(st, 2) == [[4, 1], [3, 1]] and d.candidates(st, 5) == []  # (5, ...) is not complete
    seq.tokens += [1, 2, 4]  # emitted tokens: (2, 5, 1), (5, 1, 2), (1, 2, 4) seen again -> latest
    d._observe(st, seq.tokens)
    assert d.candidates(st, 1) == [[2, 4], [2, 5]] and d.candidates(st, 5) == [[1, 2]]
    assert LookaheadDrafter(2, 3, 1).candidates(st, 1) == [[2, 4]]  # G = 1: the latest only


# ---- the tree -----------------------------------------------------------------------------------
def test_tree_has_the_papers_attention_pattern():
    """Chain token c_m sees the root and c_1..c_m; column i's level-j token sees the root, the chain up to
    its column (c_1..c_i) and the tokens above it in its column — the paper's lookahead-branch mask
    (hao-ai-lab/LookaheadDecoding ``j_make_causal_mask_multilevel``) — at offset i + j; the pooled n-grams
    are chains from the root that see nothing of the window."""
    W, N = 4, 4
    d = LookaheadDrafter(window=W, ngram=N, guesses=1)
    chain = [10, 11, 12]  # offsets 1..3
    cols = [[20 + 10 * i, 21 + 10 * i] for i in range(W)]  # column i: offsets i+1, i+2
    seq = state_for(d, [5, 6, 7, 5], chain, cols)  # pool: 5 -> (6, 7, 5)
    draft = d.propose([seq], [31])[0]
    assert len(draft.tokens) == (W + 1) * (N - 1) - 1  # (W + G)(N - 1) fed with the root
    x, pos, mask = tree_inputs([[5] + draft.tokens], [[-1] + [q + 1 for q in draft.parents]], [100])
    where = {t: j for j, t in enumerate(x[0].tolist())}  # token -> input row (all distinct here)
    for m, c in enumerate(chain, 1):
        assert set(mask[0, where[c]].nonzero().flatten().tolist()) == {0} | {where[t] for t in chain[:m]}
        assert pos[0, where[c]] == 100 + m
    for i, col in enumerate(cols):
        for j, t in enumerate(col, 1):
            seen = {0} | {where[c] for c in chain[:i]} | {where[u] for u in col[:j]}
            assert set(mask[0, where[t]].nonzero().flatten().tolist()) == seen, (i, j)
            assert pos[0, where[t]] == 100 + i + j
    assert draft.tokens[:3] == [6, 7, 5] and draft.parents[:3] == [-1, 0, 1]  # the n-gram first


def test_tree_respects_depth_cap():
    d = LookaheadDrafter(window=3, ngram=3, guesses=2)
    seq = state_for(d, [5, 6, 8, 5, 6, 7, 5], [10, 11], [[20], [21], [22]])  # pool: 5 -> (6, 7), (6, 8)
    full = d.propose([seq], [31])[0]
    assert full.tokens == [6, 7, 8, 20, 10, 21, 11, 22] and full.parents == [-1, 0, 0, -1, -1, 4, 4, 6]
    shallow = d.propose([seq], [2])[0]  # column 2 (3 deep) does not fit: left out whole
    assert max(shallow.depths()) == 2 and 22 not in shallow.tokens and shallow.tokens[:5] == [6, 7, 8, 20, 10]
    assert d.propose([seq], [0])[0].tokens == []


# ---- one Jacobi iteration -----------------------------------------------------------------------
def test_iteration_moves_every_column_up_and_pools_mature_ones():
    d = LookaheadDrafter(window=3, ngram=3, guesses=0)
    seq = state_for(d, [1, 2, 3], [10, 11], [[20], [21], [22]], age=2)
    draft = d.propose([seq], [31])[0]
    assert draft.tokens == [20, 10, 21, 11, 22]  # column tops: nodes 0 (20), 2 (21), 4 (22)
    n_before = len(seq.tokens)
    seq.tokens.append(9)  # the step emitted the root's own token
    d.accept(seq, n_before, 0, None, path=[], draft=draft, all_logits=onehot_logits([9, 30, 0, 31, 0, 32]))
    st = seq.drafter_state
    assert st.chain == [21, 22] and st.cols == [[30], [31], [32]] and st.age == [3, 3, 3]
    # each column with its base is a trajectory of N tokens: (base, level 1, the target's next)
    assert list(st.pool[3]) == [(20, 30)] and list(st.pool[10]) == [(21, 31)] and list(st.pool[11]) == [(22, 32)]


def test_young_columns_are_not_pooled_and_unfed_columns_wait():
    d = LookaheadDrafter(window=3, ngram=3, guesses=0)
    seq = state_for(d, [1, 2, 3], [10, 11], [[20], [21], [22]], age=1)
    cut = d.propose([seq], [31])[0].truncated(31, 2)  # the loop asked for 2 deep: column 2 not fed
    n_before = len(seq.tokens)
    seq.tokens.append(9)
    d.accept(seq, n_before, 0, None, path=[], draft=cut, all_logits=onehot_logits([9, 30, 0, 31, 0]))
    st = seq.drafter_state
    assert st.chain == [21, 11] and st.cols == [[30], [31], [22]] and st.age == [2, 2, 1]
    assert 3 not in st.pool and 10 not in st.pool  # made of initial guesses: not pooled
    d.accept(seq, len(seq.tokens), 0, None, path=[])  # no logits (a wrapper that does not pass them): no-op
    assert st.chain == [21, 11]


def test_two_gram_window_is_plain_jacobi():
    """N = 2: no columns; the chain itself is iterated (c_i <- the target's token after c_i's prefix)."""
    d = LookaheadDrafter(window=4, ngram=2, guesses=0)
    seq = state_for(d, [1, 2, 3], [10, 11, 12], [[], [], [], []])
    draft = d.propose([seq], [31])[0]
    assert draft.tokens == [10, 11, 12] and draft.parents is None
    n_before = len(seq.tokens)
    seq.tokens.append(9)
    d.accept(seq, n_before, 0, None, path=[], draft=draft, all_logits=onehot_logits([9, 40, 41, 42]))
    assert seq.drafter_state.chain == [40, 41, 42]


# ---- the loop hands a drafter every node's logits -----------------------------------------------
class Recorder(StatelessDrafter):
    """A fixed tree with a branch deeper than the loop allows; records what accept gets."""

    name = "recorder"
    needs = Needs(all_logits=True)

    def __init__(self):
        self.seen: list[tuple[list[int], Draft, torch.Tensor]] = []

    def propose(self, seqs, ks):
        return [Draft([7, 8, 9, 10], parents=[-1, -1, 1, 2]) for _ in seqs]

    def accept(self, seq, n_before, num_accepted, target_logits, *, path=None, hidden=None, draft=None,
               all_logits=None):
        self.seen.append((seq.tokens[:n_before], draft, all_logits))


def test_loop_hands_every_fed_nodes_logits(tiny_target):
    rec = Recorder()
    run(tiny_target, rec, [PROMPTS[0]], SamplingParams(max_tokens=6), gamma=2)
    assert any(d.tokens == [7, 8, 9] and d.parents == [-1, -1, 1] for _, d, _ in rec.seen)  # cut to depth 2, as fed
    cache = tiny_target.new_cache(1, 64)
    for prefix, draft, logits in rec.seen:
        assert logits.shape == (1 + len(draft.tokens), 96)
        for row, path in enumerate([[], [7], [8], [8, 9]][:1 + len(draft.tokens)]):
            cache.set_lengths(0)
            ref = tiny_target.forward(torch.tensor([prefix + path]), cache, logits_for="last").logits[0, -1]
            assert torch.allclose(logits[row], ref, atol=1e-4), row
    # a drafter without the attribute gets the five-method protocol only (StatelessDrafter.accept is strict)
    plain = StatelessDrafter()
    plain.propose = lambda seqs, ks: [Draft([7, 8], parents=[-1, -1]) for _ in seqs]
    assert run(tiny_target, plain, [PROMPTS[0]], SamplingParams(max_tokens=6))[0].error is None


# ---- end to end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,gamma,rows", [((3, 3, 2), 31, 1), ((3, 3, 2), 31, 4), ((1, 2, 0), 3, 4),
                                             ((4, 2, 2), 1, 4), ((2, 4, 3), 3, 4), ((5, 5, 1), 31, 4)])
def test_greedy_equals_plain(tiny_target, cfg, gamma, rows):
    """Alone and batched (trees of different shapes and sizes in one pass, ragged acceptance), any W, N, G
    and depth cap γ."""
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    seqs = run(tiny_target, LookaheadDrafter(*cfg), PROMPTS, params, gamma=gamma, rows=rows)
    assert [s.output_ids for s in seqs] == ref
    assert cfg == (1, 2, 0) or sum(s.stats.accepted for s in seqs) > 0  # W = 1, N = 2, G = 0 drafts nothing


def test_accepts_along_the_window_and_the_pool(tiny_target):
    """Both branches deliver: with no pooled n-grams (G = 0) only the window is verified, and it is
    accepted at times; with the pool the steps are fewer still."""
    params = SamplingParams(max_tokens=64)
    taus = {}
    for g in (0, 3):
        seqs = run(tiny_target, LookaheadDrafter(3, 3, g), PROMPTS, params, gamma=31)
        taus[g] = sum(s.num_output for s in seqs) / sum(s.stats.target_passes for s in seqs)
    assert 1.0 < taus[0] < taus[3]


def test_seeded_sampling_equals_seeded_plain(tiny_target):
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=3)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    seqs = run(tiny_target, LookaheadDrafter(3, 3, 2), PROMPTS, params, gamma=31, rows=4)
    assert [s.output_ids for s in seqs] == ref and sum(s.stats.accepted for s in seqs) > 0


@pytest.mark.statistical
def test_sampled_output_distribution_matches_target():
    """Sampling through the lookahead tree (multi-branch rejection sampling over the pooled n-grams and
    the window, one-hot q): the joint of the first three output tokens is the target's."""
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=None)
    exact = exact_joint(target, prompt, params)
    dec = Decoder(target, LookaheadDrafter(3, 3, 2), FixedGamma(31), rows=1, capacity=64)
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(1 << 30, (3000,), generator=g).tolist()
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(s)) for s in seeds)
    assert joint_pvalue(dec, seqs, exact) > 1e-3


# ---- API, server, CLI ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dw(hf_folder) -> SpeculativeDecoder:
    return SpeculativeDecoder(str(hf_folder), None, dtype="bf16", progress=False)


def test_api_generate_and_server_batch(tiny_dw):
    from draftwise.serve.engine import Engine, EngineConfig

    prompt = tiny_dw.encode("def quicksort(arr): return arr")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tiny_dw.generate(prompt, params, method="ar").token_ids
    la = tiny_dw.generate(prompt, params, method="lookahead", drafter_options={"window": 2, "ngram": 4})
    assert la.token_ids == ref and la.stats.drafted > 0
    engine = Engine(tiny_dw, EngineConfig(method="lookahead", gamma=4, max_model_len=120, max_batch=3))
    engine.start()
    try:
        jobs = []
        asks = [(prompt, 30, "lookahead"), (prompt[:5], 17, "ar"), (prompt[2:], 25, "lookahead"), (prompt[:3], 9, "lookahead")]
        for i, (p, n, method) in enumerate(asks):
            seq = engine.new_sequence(p, SamplingParams(max_tokens=n, ignore_eos=True), method=method)
            q: queue.Queue = queue.Queue()
            engine.submit(f"r{i}", [seq], q.put)
            jobs.append((p, n, seq, q))
        for p, n, seq, q in jobs:
            events = [q.get(timeout=60)]
            while events[-1].finish_reason is None:
                events.append(q.get(timeout=60))
            assert [t for e in events for t in e.token_ids] == tiny_dw.generate(
                p, SamplingParams(max_tokens=n, ignore_eos=True), method="ar").token_ids
        assert jobs[0][2].stats.drafted > 0 and jobs[1][2].stats.drafted == 0
    finally:
        engine.stop()


def test_cli(capsys, hf_folder):
    code = main(["generate", "def f(x): return x", "--target", str(hf_folder), "--method", "lookahead",
                 "--lookahead", "2,3,1", "--max-tokens", "12", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["method"] == "lookahead" and 0 < len(out["token_ids"]) <= 12
    try:
        code = main(["generate", "hi", "--target", str(hf_folder), "--method", "lookahead", "--lookahead", "1,1,1"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "ngram" in err and "Traceback" not in err


# ---- real weights -------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm_greedy_and_seeded_equal_plain(smollm):
    dw = SpeculativeDecoder(smollm, None, progress=False)
    prompts = ["def fibonacci(n):", "The three primary colors are", "Question: What is 12 * 7?\nAnswer:"]
    for prompt in prompts:
        for params in (SamplingParams(max_tokens=48), SamplingParams(max_tokens=32, temperature=0.8, seed=7)):
            ar = dw.generate(prompt, params, method="ar")
            for opts, gamma in (({}, "auto"), ({"window": 4, "ngram": 4, "guesses": 3}, 3)):
                la = dw.generate(prompt, params, method="lookahead", gamma=gamma, drafter_options=opts)
                assert la.token_ids == ar.token_ids, (prompt, opts, gamma)
                assert la.stats.target_passes <= ar.stats.target_passes


@pytest.mark.slow
def test_smollm_server_batch_equals_plain(smollm):
    """Continuous batching with lookahead rows on real weights: each output is the prompt's own greedy one."""
    from draftwise.serve.engine import Engine, EngineConfig

    dw = SpeculativeDecoder(smollm, None, progress=False)
    engine = Engine(dw, EngineConfig(method="lookahead", gamma=4, max_model_len=256, max_batch=3,
                                     drafter_options={"window": 2, "ngram": 3, "guesses": 2}))
    engine.start()
    try:
        jobs = []
        for i, prompt in enumerate(["def fibonacci(n):", "class Stack:", "Question: What is 12 * 7?\nAnswer:",
                                    "def is_prime(n):"]):
            ids = dw.encode(prompt)
            seq = engine.new_sequence(ids, SamplingParams(max_tokens=40))
            q: queue.Queue = queue.Queue()
            engine.submit(f"r{i}", [seq], q.put)
            jobs.append((ids, seq, q))
        for ids, seq, q in jobs:
            events = [q.get(timeout=120)]
            while events[-1].finish_reason is None:
                events.append(q.get(timeout=120))
            assert [t for e in events for t in e.token_ids] == dw.generate(
                ids, SamplingParams(max_tokens=40), method="ar").token_ids
        assert sum(s.stats.accepted for _, s, _ in jobs) > 0
    finally:
        engine.stop()


@pytest.mark.qwen
def test_qwen_greedy_equals_plain():
    dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", None, progress=False)
    params = SamplingParams(max_tokens=96)
    for prompt in ["def quicksort(arr):", "class Stack:\n    def __init__(self):"]:
        ar = dw.generate(prompt, params, method="ar")
        for opts in ({}, {"window": 3, "ngram": 4, "guesses": 2}):
            la = dw.generate(prompt, params, method="lookahead", drafter_options=opts)
            assert la.token_ids == ar.token_ids, (prompt, opts)
            assert la.stats.mean_accepted_length > 1.1  # pooled n-grams of the prompt and the output hit
