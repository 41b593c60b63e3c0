"""Drafter needs are declared (``Drafter.needs``), and the loop, the auto drafter and the server's wrapper
act on the declaration: a drafter that reads something new works under all three without their help."""

from __future__ import annotations

import pytest

from draftwise.drafters.auto import AutoDrafter
from draftwise.drafters.base import NO_NEEDS, Draft, Needs, StatelessDrafter, needs_of
from draftwise.drafters.eagle import EagleDrafter
from draftwise.drafters.layerskip import LayerSkipDrafter
from draftwise.drafters.lookahead import LookaheadDrafter
from draftwise.drafters.medusa import MedusaDrafter
from draftwise.drafters.pld import PromptLookupDrafter
from draftwise.errors import InvalidParameterError
from draftwise.models.base import MAX_TREE_TOKENS
from draftwise.models.transformer import EXACT_MAX_T
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from draftwise.decode import Decoder, FixedGamma
from draftwise.serve.engine import ServeDrafter, ServeSequence
from tests.test_decode import CAP, PROMPTS, run


class Reader(StatelessDrafter):
    """Declares every need and records what it was given."""

    name = "reader"

    def __init__(self):
        self.needs = Needs(all_logits=True, prompt_hidden=True, target_cache=True, state_from_target=True)
        self.cache = None
        self.start_hidden: list[tuple[int, ...]] = []
        self.all_logits: list[int] = []

    def bind_target_cache(self, cache) -> None:
        self.cache = cache

    def start(self, seq, *, hidden=None):
        self.start_hidden.append(tuple(hidden.shape))

    def propose(self, seqs, ks):
        return [Draft([5] * k) for k in ks]

    def accept(self, seq, n_before, num_accepted, target_logits, *, path=None, hidden=None, draft=None,
               all_logits=None):
        if draft is not None:
            self.all_logits.append(all_logits.shape[0] - len(draft.tokens))


def test_declarations():
    assert needs_of(None) is NO_NEEDS and needs_of(PromptLookupDrafter()) == NO_NEEDS
    assert needs_of(LookaheadDrafter()) == Needs(all_logits=True)
    assert LayerSkipDrafter.needs == Needs(target_cache=True) and MedusaDrafter.needs.state_from_target
    assert "needs" in EagleDrafter.__init__.__code__.co_names
    assert Needs(feature_taps=(1, 2)) | Needs(prompt_hidden=True) == Needs(prompt_hidden=True, feature_taps=(1, 2))
    with pytest.raises(InvalidParameterError, match="different inner layers"):
        Needs(feature_taps=(1, 2)) | Needs(feature_taps=(3,))


def test_one_limit_for_tree_size():
    assert EXACT_MAX_T >= MAX_TREE_TOKENS  # a tree is verified on the exact path
    from draftwise.drafters import lookahead

    assert lookahead.MAX_NODES == MAX_TREE_TOKENS - 1
    assert AutoDrafter({"pld": PromptLookupDrafter()}, lambda T: 1.0).max_nodes == MAX_TREE_TOKENS - 1


@pytest.mark.parametrize("wrap", ["plain", "serve", "auto"])
def test_every_declared_need_is_delivered(tiny_target, wrap):
    """The same drafter alone, inside the server's wrapper and as auto's only child gets the target's
    cache, every prompt position's state and every fed node's logits."""
    inner = Reader()
    drafter = {"plain": lambda: inner, "serve": lambda: ServeDrafter(inner),
               "auto": lambda: AutoDrafter({"reader": inner}, lambda T: 1e-3)}[wrap]()
    assert needs_of(drafter) == inner.needs
    params = SamplingParams(max_tokens=8)
    seq = (ServeSequence if wrap == "serve" else Sequence)(list(PROMPTS[0]), params)
    Decoder(tiny_target, drafter, FixedGamma(2), capacity=CAP).run([seq])
    assert seq.error is None
    assert inner.cache is not None and inner.cache.rows == 1
    assert inner.start_hidden == [(len(PROMPTS[0]), tiny_target.config.hidden_size)]
    assert inner.all_logits and set(inner.all_logits) == {1}  # 1 + len(draft) rows each time


def test_auto_hands_a_child_only_its_own_needs(tiny_target):
    """A child that declares nothing gets the last prompt position's state only, next to one that wants
    them all."""
    seen = []

    class Plain(StatelessDrafter):
        name = "plain"

        def start(self, seq, *, hidden=None):
            seen.append(tuple(hidden.shape))

        def propose(self, seqs, ks):
            return [Draft([]) for _ in seqs]

    reader = Reader()
    auto = AutoDrafter({"plain": Plain(), "reader": reader}, lambda T: 1e-3)
    run(tiny_target, auto, [PROMPTS[0]], SamplingParams(max_tokens=4), gamma=2)
    assert seen == [(1, tiny_target.config.hidden_size)]
    assert reader.start_hidden == [(len(PROMPTS[0]), tiny_target.config.hidden_size)]


def test_no_module_sniffs_drafter_attributes():
    """The old optional attributes are gone: nothing asks a drafter for them with getattr / hasattr."""
    import re
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1] / "draftwise"
    sniff = re.compile(r'(getattr|hasattr)\([^)]*"(wants_\w+|reads_hidden|feature_taps|bind_target_cache|needs)"'
                       r"|wants_all_logits|wants_prompt_hidden|reads_hidden")
    hits = [f"{p.name}: {m.group(0)}" for p in pkg.rglob("*.py") for m in sniff.finditer(p.read_text())
            if p.name != "base.py"]  # needs_of: the one place a missing declaration defaults to none
    assert not hits, hits
