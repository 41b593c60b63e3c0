"""End to end on tiny random models: every method's greedy output equals plain decoding, including
forced partial acceptance, EOS and max_tokens inside an accepted block, stop strings, batches; and
sampled speculative output has the target's distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.base import Draft, StatelessDrafter
from draftwise.drafters.draft_model import DraftModelDrafter
from draftwise.drafters.nasd import NASDDrafter
from draftwise.drafters.pld import PromptLookupDrafter
from draftwise.errors import InvalidParameterError, PromptTooLongError
from draftwise.sampling import SamplingParams
from draftwise.sequence import ACCEPTED, BONUS, RECOVERED, Sequence

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [4], [10, 11, 12, 10, 11, 12, 10, 11, 30, 31]]
CAP = 160


def run(model, drafter, prompts, params, gamma=4, rows=1, eos=frozenset(), detok=None):
    dec = Decoder(model, drafter, FixedGamma(gamma), rows=rows, capacity=CAP, eos_ids=eos, detokenize=detok)
    seqs = [Sequence(list(p), params) for p in prompts]
    dec.run(seqs)
    return seqs


class OracleDrafter(StatelessDrafter):
    """Proposes the target's own greedy continuation (from a reference run), corrupting draft position
    ``corrupt_at`` — forces partial acceptance at a known place."""

    name = "oracle"

    def __init__(self, reference: list[int], corrupt_at: int | None, vocab: int):
        self.ref, self.corrupt_at, self.vocab = reference, corrupt_at, vocab

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            n = len(s.tokens)
            d = self.ref[n:n + k]
            if self.corrupt_at is not None and self.corrupt_at < len(d):
                d[self.corrupt_at] = (d[self.corrupt_at] + 1) % self.vocab
            out.append(Draft(d))
        return out


def drafters(tiny_draft, rows=1):
    return [DraftModelDrafter(tiny_draft, rows, CAP), PromptLookupDrafter(), NASDDrafter()]


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_every_method_greedy_equals_plain(tiny_target, tiny_draft, gamma):
    params = SamplingParams(max_tokens=48)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    for d in drafters(tiny_draft):
        out = [s.output_ids for s in run(tiny_target, d, PROMPTS, params, gamma=gamma)]
        assert out == ref, d.name


def test_plain_decoding_tau_is_one(tiny_target):
    s = run(tiny_target, None, [PROMPTS[0]], SamplingParams(max_tokens=20))[0]
    assert s.stats.mean_accepted_length == 1.0 and s.stats.drafted == 0 and s.stats.new_tokens == 20


def test_draft_model_equal_to_target_accepts_everything(tiny_target):
    s = run(tiny_target, DraftModelDrafter(tiny_target, 1, CAP), [PROMPTS[1]], SamplingParams(max_tokens=41),
            gamma=4)[0]
    assert s.stats.acceptance_rate == 1.0
    assert s.stats.new_tokens == 41
    # prefill emits 1; then 8 steps of 4 drafts + bonus = 40
    assert s.stats.target_passes == 9 and s.stats.mean_accepted_length == pytest.approx(41 / 9)


@pytest.mark.parametrize("corrupt_at", [0, 1, 2, 3])
def test_forced_partial_acceptance(tiny_target, corrupt_at):
    params = SamplingParams(max_tokens=30)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0]
    s = run(tiny_target, OracleDrafter(ref.tokens, corrupt_at, 96), [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids
    assert s.stats.accepted_by_position[corrupt_at] == 0
    assert all(a == d for a, d in zip(s.stats.accepted_by_position[:corrupt_at],
                                      s.stats.drafted_by_position[:corrupt_at]))
    # each full step emits corrupt_at accepted + 1 recovered token; only the last step, clipped to the
    # token budget below the corrupted position, may end with a bonus token
    assert RECOVERED in s.kinds and s.kinds.count(BONUS) <= 1
    assert s.kinds.count(ACCEPTED) == s.stats.accepted


def test_eos_inside_accepted_block_ends_output(tiny_target):
    params = SamplingParams(max_tokens=40)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0].output_ids
    eos_tok = ref[6]  # a token the target emits at position 6 (inside a 4-token block)
    first = ref.index(eos_tok)
    oracle = OracleDrafter(list(PROMPTS[0]) + ref, None, 96)
    for drafter in [None, oracle]:
        s = run(tiny_target, drafter, [PROMPTS[0]], params, gamma=4, eos=frozenset({eos_tok}))[0]
        assert s.output_ids == ref[:first + 1] and s.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_exact_inside_block(tiny_target, max_tokens):
    params = SamplingParams(max_tokens=max_tokens)
    ref = run(tiny_target, None, [PROMPTS[2]], SamplingParams(max_tokens=20))[0].output_ids
    oracle = OracleDrafter(list(PROMPTS[2]) + ref, None, 96)
    s = run(tiny_target, oracle, [PROMPTS[2]], params, gamma=4)[0]
    assert s.output_ids == ref[:max_tokens] and s.finish_reason == "length"


def test_stop_string_cuts_text(tiny_target):
    detok = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731 — a toy detokenizer
    ref = run(tiny_target, None, [PROMPTS[0]], SamplingParams(max_tokens=30))[0].output_ids
    stop = detok(ref[5:7])
    s = run(tiny_target, OracleDrafter(list(PROMPTS[0]) + ref, None, 96), [PROMPTS[0]],
            SamplingParams(max_tokens=30, stop=(stop,)), detok=detok)[0]
    text = detok(s.output_ids)
    assert s.finish_reason == "stop" and stop in text
    assert text[:s.stop_text_end] == detok(ref)[:detok(ref).find(stop)]


def test_batched_ragged_acceptance_matches_single(tiny_target, tiny_draft):
    params = SamplingParams(max_tokens=30)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    for rows in (2, 4):
        for d in [None] + drafters(tiny_draft, rows):
            out = run(tiny_target, d, PROMPTS, params, rows=rows)
            assert [s.output_ids for s in out] == ref, (rows, getattr(d, "name", "ar"))


def test_rows_with_shorter_drafts_feed_only_their_own_tokens(tiny_target, tiny_draft, monkeypatch):
    """A batch where prompt lookup finds matches for some rows only: the step's pass gets each row's real
    token count (``lengths``), so a row without a draft costs one token, and the output stays plain decoding's."""
    params = SamplingParams(max_tokens=30)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    seen = []
    real = type(tiny_target).forward

    def spy(self, x, cache, **kw):
        if kw.get("lengths") is not None:
            seen.append(list(kw["lengths"]))
        return real(self, x, cache, **kw)

    monkeypatch.setattr(type(tiny_target), "forward", spy)
    out = run(tiny_target, PromptLookupDrafter(), PROMPTS, params, rows=4)
    assert [s.output_ids for s in out] == ref
    assert seen and all(min(L) < max(L) for L in seen)  # only ragged steps pass lengths
    assert any(1 in L for L in seen)  # a row that drafted nothing fed its one token


def test_batched_different_lengths_and_params(tiny_target, tiny_draft):
    """Mixed greedy / sampled / max_tokens in one batch: the greedy ones are unaffected."""
    ref = run(tiny_target, None, [PROMPTS[0]], SamplingParams(max_tokens=25))[0].output_ids
    dec = Decoder(tiny_target, DraftModelDrafter(tiny_draft, 3, CAP), FixedGamma(3), rows=3, capacity=CAP)
    seqs = [Sequence(PROMPTS[0], SamplingParams(max_tokens=25)),
            Sequence(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=9, seed=1)),
            Sequence(PROMPTS[3], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, seed=2))]
    dec.run(seqs)
    assert seqs[0].output_ids == ref
    assert seqs[1].num_output == 9 and seqs[2].num_output <= 40


def test_rollback_leaves_cache_consistent(tiny_target, tiny_draft):
    """After decoding, the cache equals one built by a fresh prefill of all tokens but the last."""
    dec = Decoder(tiny_target, DraftModelDrafter(tiny_draft, 1, CAP), FixedGamma(5), rows=1, capacity=CAP)
    seq = Sequence(PROMPTS[0], SamplingParams(max_tokens=100))
    dec.add(seq)
    for _ in range(6):
        dec.step()
    n = len(seq.tokens) - 1
    assert dec.cache.length(0) == n
    fresh = tiny_target.new_cache(1, CAP)
    tiny_target.forward(torch.tensor([seq.tokens[:-1]]), fresh)
    torch.testing.assert_close(dec.cache.k[:, 0, :, :n], fresh.k[:, 0, :, :n], atol=1e-4, rtol=1e-4)


def test_bad_input(tiny_target):
    dec = Decoder(tiny_target, None, FixedGamma(2), rows=1, capacity=CAP)
    with pytest.raises(InvalidParameterError):
        dec.add(Sequence([], SamplingParams()))
    with pytest.raises(PromptTooLongError):
        dec.add(Sequence([1] * 100, SamplingParams(max_tokens=100)))
    with pytest.raises(PromptTooLongError):
        Decoder(tiny_target, None, rows=1, capacity=1000).add(Sequence([1] * 600, SamplingParams(max_tokens=1)))
    with pytest.raises(InvalidParameterError):
        FixedGamma(0)


def exact_joint(model, prompt, params, n: int = 3) -> torch.Tensor:
    """Exact joint distribution (V,) * n of the first ``n`` output tokens under the target (enumeration)."""
    from draftwise.sampling import logits_to_probs

    cache = model.new_cache(1, 64)
    l0 = model.forward(torch.tensor([prompt]), cache, logits_for="last").logits[0, -1]
    p0 = logits_to_probs(l0, params)  # (V,)
    if n == 1:
        return p0
    V, base = p0.shape[0], cache.length()
    joint = torch.zeros((V,) * n)

    def grow(prefix: list[int], prob: torch.Tensor) -> None:  # prob: (V,) of the next token after prefix
        for t in torch.nonzero(prob > 0).flatten().tolist():
            if len(prefix) + 1 == n:
                joint[tuple(prefix + [t])] = prob[t]
                continue
            cache.set_lengths(base)
            logits = model.forward(torch.tensor([prefix + [t]]), cache).logits[0, -1]
            grow(prefix + [t], prob[t] * logits_to_probs(logits, params))

    grow([], p0)
    return joint


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["draft", "nasd"])
def test_sampled_output_distribution_matches_target(method):
    """Speculative sampling end to end (model + cache + rollback): the joint distribution of the first
    three output tokens (the second and third from a speculative step) matches the target's exact one
    (chi-square at a fixed seed)."""
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY, perturbed

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    draft = perturbed(target, 0.8, seed=12)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=None)
    exact = exact_joint(target, prompt, params)
    dec_drafter = DraftModelDrafter(draft, 1, 64) if method == "draft" else NASDDrafter()
    dec = Decoder(target, dec_drafter, FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(2024)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3


def joint_pvalue(dec: Decoder, seqs, exact: torch.Tensor) -> float:
    """Decode each sequence alone; chi-square p-value of its first n output tokens' counts against the
    exact joint distribution ``exact`` (V,) * n (cells expected >= 5 times). The first token comes from
    the prefill, so the sequences need max_tokens >= n + 1 for the later ones to come from speculative
    steps (a step drafts at most remaining - 1 tokens); asserts that drafts were really verified."""
    n = exact.dim()
    counts = torch.zeros_like(exact)
    drafted = 0
    for seq in seqs:
        dec.run([seq])
        assert seq.num_output >= n, "max_tokens must be at least the number of tokens compared"
        counts[tuple(seq.output_ids[:n])] += 1
        drafted += seq.stats.drafted
    assert drafted > 0, "nothing was drafted: the test would only check plain sampling"
    total = float(counts.sum())
    mask = exact.flatten() * total >= 5
    obs, exp = counts.flatten()[mask], exact.flatten()[mask] * total
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_primed_adaptive_gamma_follows_measured_costs():
    """Primed with costs where each drafted token costs a full pass, a weak drafter gets γ = 0; with
    free verification, a strong one gets the longest γ — before any step is observed."""
    from draftwise.gamma import AdaptiveGamma

    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=50))
    expensive = AdaptiveGamma(4, prior_alpha=0.3, explore_every=0)
    for k in range(5):
        expensive.prime(1, k, 0.1 * (1 + k))
    assert expensive.choose([seq]) == 0
    cheap = AdaptiveGamma(4, prior_alpha=0.9, explore_every=0)
    for k in range(5):
        cheap.prime(1, k, 0.1)
    assert cheap.choose([seq]) == 4


def test_measure_forward_costs(tiny_target):
    from draftwise.gamma import measure_forward_costs

    costs = measure_forward_costs(tiny_target, 5)
    assert len(costs) == 5 and all(c > 0 for c in costs)


def test_pass_costs_are_kept_per_model_and_machine(tiny_target, tmp_path, monkeypatch):
    """A later process takes the measured pass costs from disk instead of measuring (``draftwise generate``
    started 0.55 s later each time); another weight file, or the same one changed, is measured anew."""
    from draftwise import costs as costs_mod
    from draftwise.costs import PassCosts, model_identity
    from draftwise.kernels import extension
    from draftwise.models import LoadedModel

    if extension() is None:
        pytest.skip("costs are kept per kernel build: the kernel is not built here")
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    loaded = LoadedModel(name=str(weights), model=tiny_target, tokenizer=None, load_s=0.0, weights="auto")
    assert model_identity(loaded) is None  # a small file: timed in milliseconds, nothing kept
    monkeypatch.setattr(costs_mod, "KEEP_MIN_BYTES", 0)
    ident = model_identity(loaded)
    assert ident is not None and str(weights.resolve()) in ident
    first = PassCosts(tiny_target, lambda: ident)
    first.measure([1, 3])
    assert set(first.seconds) == {1, 3} and first.draft_pass(tiny_target) > 0

    calls = []
    real = costs_mod.measure_forward_costs
    monkeypatch.setattr(costs_mod, "measure_forward_costs", lambda *a, **k: calls.append(k) or real(*a, **k))
    # the fresh check agrees with what was kept (a tiny model's millisecond timings would not: see below)
    monkeypatch.setattr(costs_mod, "one_token_seconds", lambda models, **k: [first.seconds[1]] * len(models))
    again = PassCosts(tiny_target, lambda: ident)
    again.measure([1, 3])
    assert again.seconds == {T: first.seconds[T] for T in (1, 3)}
    assert again.draft_pass(tiny_target) == first.seconds[1]  # ratio 1 (the sizes it needs were kept by first)
    assert calls == []
    again.measure([4])  # a size not kept yet: measured, then kept beside the others
    assert len(calls) == 1 and PassCosts(tiny_target, lambda: ident)._store().read().keys() >= {"pass1", "pass3", "pass4"}

    weights.write_bytes(b"GGUF" + bytes(61))  # the file changed: its costs are its own
    assert model_identity(loaded) != ident
    PassCosts(tiny_target, lambda: model_identity(loaded)).measure([1])
    assert len(calls) == 2
    kept = sorted((tmp_path / "home" / "kernels").glob("costs-*.json"))
    assert len(kept) == 2  # one file per identity
    anonymous = PassCosts(tiny_target, lambda: None)  # a model built in memory: measured in every process
    anonymous.measure([1])
    PassCosts(tiny_target, lambda: None).measure([1])
    assert len(calls) == 4 and sorted((tmp_path / "home" / "kernels").glob("costs-*.json")) == kept


def kept_costs(tmp_path, monkeypatch, tiny_target, seconds: dict[str, float]):
    """A PassCosts whose identity has ``seconds`` kept on disk (as an earlier process left them)."""
    from draftwise import costs as costs_mod
    from draftwise.costs import PassCosts, _Kept
    from draftwise.kernels import extension

    if extension() is None:
        pytest.skip("costs are kept per kernel build: the kernel is not built here")
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(costs_mod, "KEEP_MIN_BYTES", 0)
    _Kept("m|1").add(seconds)
    return PassCosts(tiny_target, lambda: "m|1")


def test_kept_pass_costs_from_a_busier_machine_are_measured_again(tiny_target, tmp_path, monkeypatch):
    """Points kept from a busy minute (their one-token pass over STALE times a fresh timing's) are dropped,
    from disk too, and measured again; points faster than now are kept (the machine is busy now). AMD Zen 4:
    kept points from a busy minute stopped ``--gamma auto`` from drafting (``draft`` 0.99x ``ar`` on code)."""
    from draftwise import costs as costs_mod
    from draftwise.costs import STALE, _Kept

    calls = []
    real = costs_mod.measure_forward_costs
    monkeypatch.setattr(costs_mod, "measure_forward_costs", lambda *a, **k: calls.append(k["sizes"]) or real(*a, **k))
    monkeypatch.setattr(costs_mod, "one_token_seconds", lambda models, **k: [0.01] * len(models))
    busy = kept_costs(tmp_path, monkeypatch, tiny_target, {"pass1": STALE * 0.0101, "pass3": 9.0, "pass25": 99.0})
    busy.measure([1, 3])
    assert calls == [[1, 3]] and busy.seconds[1] < 1 and busy.seconds[3] < 9  # tiny: milliseconds
    assert set(_Kept("m|1").read()) == {"pass1", "pass3"}  # pass25 went with the rest
    busy.measure([2])  # checked once per process: a size not kept is measured beside the others
    assert calls == [[1, 3], [2]]

    calls.clear()
    ok = kept_costs(tmp_path / "b", monkeypatch, tiny_target, {"pass1": STALE * 0.0099, "pass3": 9.0})
    ok.measure([1, 3])
    assert calls == [] and ok.seconds == {1: STALE * 0.0099, 3: 9.0}
    busy_now = kept_costs(tmp_path / "c", monkeypatch, tiny_target, {"pass1": 0.001, "pass3": 0.002})
    busy_now.measure([1, 3])
    assert calls == [] and busy_now.seconds == {1: 0.001, 3: 0.002}


def test_a_draft_models_token_is_priced_by_its_ratio_to_the_targets(tiny_target, tiny_draft, monkeypatch):
    """The draft model's one-token pass and the target's, timed alternately in this process: their ratio
    times the target's one-token cost the policy uses, so a busy minute while either was timed cannot make
    drafting look dearer than verifying. Timed once per draft model."""
    from draftwise import costs as costs_mod
    from draftwise.costs import PassCosts, one_token_seconds

    timed = []
    monkeypatch.setattr(costs_mod, "one_token_seconds", lambda models, **k: timed.append(models) or [0.030, 0.009])
    costs = PassCosts(tiny_target)
    costs.seconds = {T: 0.040 for T in (1, 2, 3, 5, 9)}
    assert costs.draft_pass(tiny_draft) == pytest.approx(0.009 / 0.030 * 0.040)
    assert costs.draft_pass(tiny_draft) == pytest.approx(0.012) and timed == [[tiny_target, tiny_draft]]
    real = one_token_seconds([tiny_target, tiny_draft], rounds=2)
    assert len(real) == 2 and all(0 < s < 1 for s in real)


# ---- token trees through the one loop ---------------------------------------------------------------
def tree_drafters(tiny_draft, rows=1, branches=3):
    return [DraftModelDrafter(tiny_draft, rows, CAP, branches=branches), PromptLookupDrafter(branches=branches),
            NASDDrafter(branches=branches)]


@pytest.mark.parametrize("gamma,branches", [(1, 2), (3, 3), (6, 4)])
def test_every_tree_drafter_greedy_equals_plain(tiny_target, tiny_draft, gamma, branches):
    params = SamplingParams(max_tokens=48)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    for d in tree_drafters(tiny_draft, branches=branches):
        seqs = run(tiny_target, d, PROMPTS, params, gamma=gamma)
        assert [s.output_ids for s in seqs] == ref, d.name
    # batched, ragged: trees and chains of different sizes in one pass
    for d in tree_drafters(tiny_draft, rows=4, branches=branches):
        seqs = run(tiny_target, d, PROMPTS, params, gamma=gamma, rows=4)
        assert [s.output_ids for s in seqs] == ref, d.name


class TreeOracle(StatelessDrafter):
    """A tree whose first branch is wrong at a chosen depth and whose second branch is the target's own
    continuation: only tree verification accepts past the error."""

    name = "tree-oracle"

    def __init__(self, reference: list[int], vocab: int):
        self.ref, self.vocab = reference, vocab

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            n = len(s.tokens)
            good = self.ref[n:n + k]
            if not good:
                out.append(Draft([]))
                continue
            bad = [(good[0] + 1) % self.vocab] + good[1:]
            parents = list(range(-1, len(bad) - 1)) + [-1] + [len(bad) + j for j in range(len(good) - 1)]
            out.append(Draft(bad + good, parents=parents))
        return out


def test_second_branch_accepted_and_cache_compacted(tiny_target):
    """Acceptance along a non-first branch: the KV entries of the accepted path move to contiguous slots,
    so the following steps (and the output) equal plain decoding."""
    params = SamplingParams(max_tokens=40)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0]
    s = run(tiny_target, TreeOracle(ref.tokens, 96), [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids
    assert s.stats.mean_accepted_length > 4.0  # every step accepts the whole second branch + bonus


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["draft", "nasd", "pld"])
def test_sampled_tree_output_distribution_matches_target(method):
    """Sampling with token trees end to end (multi-branch rejection sampling, tree attention, path
    compaction): the joint of the first three output tokens is the target's."""
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY, perturbed

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    draft = perturbed(target, 0.8, seed=12)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=None)
    exact = exact_joint(target, prompt, params)
    drafter = {"draft": lambda: DraftModelDrafter(draft, 1, 64, branches=3),
               "nasd": lambda: NASDDrafter(branches=3), "pld": lambda: PromptLookupDrafter(branches=3)}[method]()
    dec = Decoder(target, drafter, FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(77)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(6000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3


def test_tree_bad_branches(tiny_draft):
    for make in (lambda: PromptLookupDrafter(branches=0), lambda: NASDDrafter(branches=-1),
                 lambda: DraftModelDrafter(tiny_draft, 1, CAP, branches=0)):
        with pytest.raises(InvalidParameterError):
            make()


class _Counting:
    """A model whose forward passes are counted (and the tokens they feed)."""

    def __init__(self, model):
        self.model, self.passes, self.fed = model, 0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, input_ids, cache, **kw):
        self.passes += 1
        self.fed += input_ids.shape[1]
        return self.model.forward(input_ids, cache, **kw)


@pytest.mark.parametrize("rows", [1, 3])
def test_draft_lookup_drafts_the_same_chains_in_fewer_passes(tiny_target, rows):
    """A greedy row's draft feeds the tokens its n-gram lookup expects and keeps those the draft itself picks:
    every draft (greedy, seeded and sampled rows, chains and trees) equals the one drafted token by token, in
    fewer draft passes where the text repeats (the target as its own draft: its greedy text loops)."""
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[1]][:rows]
    params = [SamplingParams(max_tokens=60), SamplingParams(temperature=0.8, max_tokens=30, seed=3),
              SamplingParams(temperature=1.0, max_tokens=30)][:rows]
    for branches in (1, 2):
        record = {}
        for lookup in (False, True):
            model = _Counting(tiny_target)
            drafter = DraftModelDrafter(model, rows, CAP, branches=branches, lookup=lookup)
            drafts = record[lookup] = []
            inner = drafter.propose
            drafter.propose = lambda seqs, ks, inner=inner, drafts=drafts: drafts.append(inner(seqs, ks)) or drafts[-1]
            dec = Decoder(tiny_target, drafter, FixedGamma(5), rows=rows, capacity=CAP)
            seqs = [Sequence(list(p), prm) for p, prm in zip(prompts, params)]
            for s in seqs[1:]:
                s.generator = torch.Generator().manual_seed(7)
            dec.run(seqs)
            record[lookup] = ([[(d.tokens, d.parents) for d in step] for step in drafts], model.passes,
                              [s.output_ids for s in seqs])
        (off, off_passes, off_out), (on, on_passes, on_out) = record[False], record[True]
        assert on == off and on_out == off_out, branches
        assert on_passes < off_passes, (on_passes, off_passes)


def test_lookup_expects_the_continuation_of_the_longest_ngram():
    from draftwise.drafters.draft_model import _Lookup

    look = _Lookup()
    toks = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6]
    assert look.expect(toks, [], 3) == [7, 8]  # "5 6" (n = 2; "2 5 6" is new) was followed by 7 8: 2 tokens
    assert look.expect(toks, [7], 3) == [8, 9, 6]  # with the draft's 7: "5 6 7", 3 tokens
    assert look.expect(toks, [7], 1) == [8]  # no more than the room left
    assert look.expect(toks, [1, 6, 7], 3) == [1, 2]  # "6 7": its latest occurrence
    assert look.expect(toks, [42], 3) == []
    assert look.expect(toks + [3, 9], [], 3) == [6]  # indexed as the sequence grows: "9" -> 6 (n = 1)
