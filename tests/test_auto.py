"""Method auto: the per-step choice among drafters (and none) follows the cost model and measured
acceptance; whatever it chooses, greedy output equals plain decoding and sampled output has the target's
distribution."""

from __future__ import annotations

import pytest
import torch

from draftwise.costs import PassCosts
from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.auto import NONE, OBSERVE, START_WAIT, AutoDrafter, _State, matched_depth
from draftwise.drafters.base import Draft, StatelessDrafter
from draftwise.drafters.draft_model import DraftModelDrafter
from draftwise.drafters.nasd import NASDDrafter
from draftwise.drafters.pld import PromptLookupDrafter
from draftwise.errors import InvalidParameterError
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from tests.test_decode import CAP, PROMPTS, exact_joint, joint_pvalue, run


def flat(T: int) -> float:  # a CPU where verifying many tokens costs what one costs (AMX)
    return 1.0


def linear(T: int) -> float:  # a CPU where every verified token costs a pass
    return float(T)


class Fixed(StatelessDrafter):
    """Always proposes the same tokens (a bad drafter) or the target's reference continuation (a perfect one)."""

    name = "fixed"

    def __init__(self, reference: list[int] | None = None, token: int = 0):
        self.ref, self.token = reference, token

    def propose(self, seqs, ks):
        if self.ref is None:
            return [Draft([self.token] * k) for k in ks]
        return [Draft(self.ref[len(s.tokens):len(s.tokens) + k]) for s, k in zip(seqs, ks)]


def test_matched_depth_chain_tree_and_unknown_positions():
    assert matched_depth(Draft([5, 6, 7]), [5, 6, 9]) == (2, 3)  # miss at the third
    assert matched_depth(Draft([5, 6, 7]), [5, 6]) == (2, 2)  # third position not emitted: unknown
    assert matched_depth(Draft([5, 6]), [5, 6, 7]) == (2, 2)  # the draft ended: nothing tried past it
    assert matched_depth(Draft([4]), [5]) == (0, 1)
    tree = Draft([1, 2, 3, 4], parents=[-1, -1, 1, 2])  # 1 | 2 -> 3 -> 4
    assert matched_depth(tree, [2, 3, 8]) == (2, 3)
    assert matched_depth(tree, [1, 9]) == (1, 1)  # node 1 has no child: nothing tried at depth 2
    assert matched_depth(Draft([]), [3]) == (0, 0)


def test_greedy_equals_plain_with_every_child_batched(tiny_target, tiny_draft):
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    for rows in (1, 3):
        for cost in (flat, linear):
            auto = AutoDrafter({"pld": PromptLookupDrafter(), "nasd": NASDDrafter(),
                                "draft": DraftModelDrafter(tiny_draft, rows, CAP)}, cost, draft_cost={"draft": 0.01})
            out = run(tiny_target, auto, PROMPTS, params, gamma=5, rows=rows)
            assert [s.output_ids for s in out] == ref, (rows, cost.__name__)
            if cost is flat:  # drafting is free: every child gets tried, the draft model included
                assert auto.chosen["draft"] > 0 and auto.chosen["pld"] + auto.chosen["nasd"] > 0


def test_chooses_by_cost_and_measured_acceptance(tiny_target):
    params = SamplingParams(max_tokens=40)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0]
    full = list(PROMPTS[0]) + ref.output_ids
    # a perfect drafter beside a useless one: auto learns which is which and drafts deep with the good one
    auto = AutoDrafter({"bad": Fixed(token=(full[-1] + 1) % 64), "good": Fixed(reference=full)}, flat)
    s = run(tiny_target, auto, [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids
    assert auto.chosen["good"] > 3 * auto.chosen["bad"] and s.stats.mean_accepted_length > 3.5
    assert s.stats.choices == {k: v for k, v in auto.chosen.items() if v}
    # when every verified token costs a full pass, nothing beats plain decoding: auto drafts nothing
    auto = AutoDrafter({"good": Fixed(reference=full)}, linear)
    s = run(tiny_target, auto, [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids and s.stats.drafted == 0 and auto.chosen["good"] == 0 and auto.chosen[NONE] >= 38
    # costs in between: a good drafter pays, a useless one is dropped after a few steps
    auto = AutoDrafter({"bad": Fixed(token=0)}, lambda T: 1.0 + 0.2 * (T - 1))
    s = run(tiny_target, auto, [PROMPTS[0]], params, gamma=4)[0]
    assert auto.chosen[NONE] > 30 and s.output_ids == ref.output_ids


class Counting(Fixed):
    """Fixed, counting its proposal calls."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0

    def propose(self, seqs, ks):
        self.calls += 1
        return super().propose(seqs, ks)


def test_a_free_child_that_cannot_win_proposes_only_to_stay_measured(tiny_target):
    """Where no depth can pay (every verified token costs a pass, or a drafted token costs 0.2 of one and the
    child's acceptance fell near 0), a free child proposes only every PROBE_EVERY-th step (its acceptance still measured then); where drafting
    pays it proposes at every step. Output is plain decoding's either way."""
    from draftwise.drafters.auto import PROBE_EVERY

    params = SamplingParams(max_tokens=40)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0]
    full = list(PROMPTS[0]) + ref.output_ids
    for cost, child, every_step in ((flat, Counting(reference=full), True), (linear, Counting(reference=full), False),
                                    (lambda T: 1.0 + 0.2 * (T - 1), Counting(token=(full[-1] + 1) % 64), False)):
        auto = AutoDrafter({"c": child}, cost)
        s = run(tiny_target, auto, [PROMPTS[0]], params, gamma=4)[0]
        assert s.output_ids == ref.output_ids
        steps = auto._steps
        assert child.calls + auto.skipped["c"] == steps
        if every_step:
            assert auto.skipped["c"] == 0 and s.stats.mean_accepted_length > 3.5
        else:  # a useless child: after its first misses only the probes (a quarter of the steps, and a few)
            assert child.calls <= steps // PROBE_EVERY + 6 and auto.skipped["c"] > 0


def zen5() -> PassCosts:
    """The 1.5B's measured pass-cost shape on AVX512-VNNI (bench-forward: T = 1, 2, 4, 8, 16, 32; the sizes
    auto measures, 3 / 5 / 9, in between), interpolated as the real cost model does."""
    costs = PassCosts(None)
    costs.seconds = {1: 1.0, 2: 1.02, 3: 1.06, 4: 1.10, 5: 1.18, 8: 1.41, 9: 1.525, 16: 2.33, 32: 4.17}
    return costs


class HalfRight(StatelessDrafter):
    """The target's next token at every other position (else a wrong one), then wrong ones: the
    measured acceptance settles near one half."""

    name = "half"

    def __init__(self, reference: list[int]):
        self.ref = reference

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            n = len(s.tokens)
            nxt = self.ref[n] if n < len(self.ref) else 0
            out.append(Draft([nxt if n % 2 == 0 else (nxt + 1) % 64] + [(t + 1) % 64 for t in self.ref[n + 1:n + k]]))
        return out


def test_a_full_batch_drafts_less_than_one_row(tiny_target):
    """A draft that pays for one row (a pass over 2-5 tokens costs ~1.1 one) need not pay in a batch of 8,
    whose pass already feeds 8 tokens: auto prices each row's draft by what it adds to the step's pass."""
    params = SamplingParams(max_tokens=30)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0]
    full = list(PROMPTS[0]) + ref.output_ids
    alone = AutoDrafter({"half": HalfRight(full)}, zen5())
    s = run(tiny_target, alone, [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids
    assert alone.chosen["half"] > 2 * alone.chosen[NONE]  # one row: drafting pays
    batch = AutoDrafter({"half": HalfRight(full)}, zen5())
    out = run(tiny_target, batch, [PROMPTS[0]] * 8, params, gamma=4, rows=8)
    assert all(x.output_ids == ref.output_ids for x in out)
    assert batch.chosen[NONE] > 2 * batch.chosen["half"]  # eight rows: mostly not


def test_requests_share_what_earlier_ones_learned(tiny_target):
    """A new request starts from the acceptance pooled over earlier ones (not from the prior)."""
    auto = AutoDrafter({"bad": Fixed(token=0)}, lambda T: 1.0 + 0.25 * (T - 1), prior_alpha=0.9)
    params = SamplingParams(max_tokens=20)
    run(tiny_target, auto, [PROMPTS[0]], params, gamma=4)
    first = auto.chosen["bad"]
    run(tiny_target, auto, [PROMPTS[0]], params, gamma=4)
    assert auto.pooled["bad"].alpha < 0.3 and auto.chosen["bad"] - first < first


@pytest.mark.statistical
def test_sampled_output_distribution_matches_target():
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY, perturbed

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    draft = perturbed(target, 0.8, seed=12)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=None)
    exact = exact_joint(target, prompt, params)
    auto = AutoDrafter({"pld": PromptLookupDrafter(), "nasd": NASDDrafter(), "draft": DraftModelDrafter(draft, 1, 64)},
                       flat, draft_cost={"draft": 0.1})
    dec = Decoder(target, auto, FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(5)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3
    assert auto.chosen["draft"] > 0 and auto.chosen["pld"] + auto.chosen["nasd"] > 0  # both kinds verified


def test_bad_input(tiny_target):
    with pytest.raises(InvalidParameterError):
        AutoDrafter({}, flat)
    with pytest.raises(InvalidParameterError):
        AutoDrafter({"pld": PromptLookupDrafter()}, flat, draft_cost={"draft": 1.0})


def test_api_auto_method(hf_folder):
    from draftwise import SpeculativeDecoder
    from draftwise.gamma import AdaptiveGamma

    dw = SpeculativeDecoder(str(hf_folder), draft=None, progress=False)
    params = SamplingParams(max_tokens=24, temperature=0)
    ref = dw.generate("hello hello hello", params, method="ar", gamma=4)
    out = dw.generate("hello hello hello", params, method="auto")
    assert out.token_ids == ref.token_ids and 0 < sum(out.stats.choices.values()) < out.stats.target_passes
    assert set(out.stats.choices) <= {NONE, "pld", "nasd", "suffix"}  # no draft model was given
    with pytest.raises(InvalidParameterError):
        dw.generate("hi", params, method="auto", drafter_options={"methods": ["ar"]})
    with pytest.raises(InvalidParameterError):
        dw.generate("hi", params, method="auto", gamma=AdaptiveGamma(4))
    assert dw.pass_cost(1) > 0 and dw.pass_cost(20) >= dw.pass_cost(1)


def test_a_draft_models_start_is_priced_and_timed(tiny_target, tiny_draft):
    """A costly child's first use prefills the context: auto charges that start spread over the row's remaining
    tokens, so a start that cannot pay back is not made (nothing drafted, the draft model never started) and
    one that can is; each start is timed and prices the next (the caller's dict, shared across requests). In
    a batch its forwards are priced once for every row."""
    params = SamplingParams(max_tokens=30)
    ref = run(tiny_target, None, [PROMPTS[0]], params)[0]

    def auto(per_token: float) -> AutoDrafter:
        return AutoDrafter({"draft": DraftModelDrafter(tiny_draft, 1, CAP)}, flat, draft_cost={"draft": 0.01},
                           start_cost={"draft": per_token}, priors={"draft": 0.9})

    dear = auto(1e3)  # seconds per context token: never pays back
    s = run(tiny_target, dear, [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids and dear.chosen["draft"] == 0 and s.stats.drafted == 0
    cheap = auto(1e-6)
    s = run(tiny_target, cheap, [PROMPTS[0]], params, gamma=4)[0]
    assert s.output_ids == ref.output_ids and cheap.chosen["draft"] > 0
    assert 0 < cheap.start_cost["draft"] < 1.0  # the timed start replaced the estimate
    # the rule itself: the start (10 s) against what drafting saves over the tokens left to write
    st = AutoDrafter({"draft": DraftModelDrafter(tiny_draft, 1, CAP)}, flat, draft_cost={"draft": 0.1},
                     priors={"draft": 0.9})
    state = _State(arms={"draft": st._prior("draft")}, steps=OBSERVE)  # a row some steps in
    assert st._choose(state, 4, start={"draft": 10.0}, remaining=4)[0] == NONE
    assert st._choose(state, 4, start={"draft": 10.0}, remaining=1000)[0] == "draft"
    assert st._choose(state, 4, start={"draft": 0.0}, remaining=4)[0] == "draft"  # started: no start to pay
    # a start must also beat what the free options gave the row lately, not only this step's (here nothing):
    # after steps of ~4 tokens a pass (prompt lookup on a RAG answer) a step without a proposal starts nothing
    state.free_typical = (40.0, 10 * flat(1))
    assert st._choose(state, 4, start={"draft": 10.0}, remaining=1000)[0] == NONE
    assert st._choose(state, 4, start={"draft": 0.0}, remaining=1000)[0] == "draft"  # once started, per step
    state.free_typical = (10.0, 10 * flat(1))  # lately 1 token a pass (nothing drafted): the start pays
    assert st._choose(state, 4, start={"draft": 10.0}, remaining=1000)[0] == "draft"
    # a start dearer than START_WAIT passes (a long prompt's prefill) waits for OBSERVE steps of the row
    state.steps = 0
    assert 10.0 > START_WAIT * flat(1) and st._choose(state, 4, start={"draft": 10.0}, remaining=1000)[0] == NONE
    assert st._choose(state, 4, start={"draft": 1.0}, remaining=1000)[0] == "draft"  # a short prompt's: at once
    state.steps = OBSERVE
    assert st._choose(state, 4, start={"draft": 10.0}, remaining=1000)[0] == "draft"
    # in a batch the draft model's forwards run over every row: the first row to choose it pays them (here
    # 20x one row's: not worth it), a later row only depth beyond what is drafted already (here none: free)
    assert st._choose(state, 4, shape=20.0)[0] == NONE
    assert st._choose(state, 4, shape=20.0, paid={"draft": 4})[:2] == ("draft", 4)


def test_auto_takes_a_smaller_draft_model_of_the_target_tokenizer(hf_folder, hf_folder_other_vocab, tmp_path):
    """By default auto also chooses the draft model when there is one of the target's tokenizer, smaller than
    the target and already on the machine; not one as big as the target or one of another tokenizer. A server
    of one row takes it too (a batching one when told), its cache rows counted in the KV budget. Output:
    ``ar``'s either way."""
    from draftwise import SpeculativeDecoder
    from draftwise.api import ModelSpec
    from tests.conftest import make_hf_folder

    small = make_hf_folder(tmp_path / "small", num_layers=1)
    dw = SpeculativeDecoder(str(hf_folder), draft=str(small), progress=False)
    assert dw.auto_takes_draft()
    assert "draft" in dw.make_drafter("auto", 1, 64).children
    assert "draft" not in dw.make_drafter("auto", 1, 64, draft_model=False).children
    assert 0 < dw.auto_start_costs["draft"] < 1.0  # estimated from the draft's measured pass
    params = SamplingParams(max_tokens=24)
    ref = dw.generate("hello hello hello", params, method="ar")
    assert dw.generate("hello hello hello", params, method="auto").token_ids == ref.token_ids
    spec = ModelSpec(str(hf_folder), str(small))
    assert spec.for_method("auto").draft == str(small) and spec.for_method("pld").draft is None
    from draftwise.serve.engine import Engine, EngineConfig

    with_draft = Engine(dw, EngineConfig(method="auto", max_model_len=100, max_batch=1))  # a personal server
    batching = Engine(dw, EngineConfig(method="auto", max_model_len=100, max_batch=2))
    named = Engine(dw, EngineConfig(method="auto", max_model_len=100, max_batch=2,
                                    drafter_options={"methods": ["pld", "draft"]}))
    assert "draft" in with_draft.drafter.inner.children and "draft" not in batching.drafter.inner.children
    assert "draft" in named.drafter.inner.children
    assert with_draft.kv_bytes_per_token == named.kv_bytes_per_token > batching.kv_bytes_per_token  # budgeted
    for draft in (str(hf_folder), str(hf_folder_other_vocab), None):  # as big / another tokenizer / none
        assert not SpeculativeDecoder(str(hf_folder), draft=draft, progress=False).auto_takes_draft()


def test_auto_never_downloads_a_draft_model(hf_folder, tmp_path, monkeypatch):
    """A named draft model not yet fetched is left out of auto (no download starts); fetched, it is sized."""
    from draftwise import SpeculativeDecoder
    from draftwise.api import _weights_bytes
    from draftwise.models import registry

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))

    def no_download(*a, **k):
        raise AssertionError("auto started a download")

    monkeypatch.setattr(registry, "fetch_named", no_download)
    name = "qwen2.5-coder-0.5b-instruct"
    assert _weights_bytes(name) is None
    assert not SpeculativeDecoder(str(hf_folder), draft=name, progress=False).auto_takes_draft()
    monkeypatch.setattr(registry, "trusted", lambda model, dest: True)  # as if fetched and verified
    assert _weights_bytes(name) == registry.MODELS[name].size


def test_a_costly_childs_pool_is_shrunk_towards_its_prior(tiny_draft):
    """A draft model is measured only on the steps it was chosen: a few bad ones pooled from an earlier
    request pull a new request's prior down only part of the way (it gets tried again), many pull it down
    fully; a free child's pool (scored at every step) is taken as it is."""
    from draftwise.acceptance import Acceptance

    auto = AutoDrafter({"pld": PromptLookupDrafter(), "draft": DraftModelDrafter(tiny_draft, 1, CAP)}, flat,
                       draft_cost={"draft": 0.1}, priors={"draft": 0.8})
    auto.pooled["draft"] = Acceptance(accepted=1.0, tried=4.0)  # 0.25 from four tries
    auto.pooled["pld"] = Acceptance(accepted=1.0, tried=4.0)
    assert 0.5 < auto._prior("draft").alpha < 0.8 and auto._prior("pld").alpha == pytest.approx(0.25)
    auto.pooled["draft"] = Acceptance(accepted=25.0, tried=100.0)
    assert auto._prior("draft").alpha < 0.35
