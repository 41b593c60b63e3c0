"""``--method auto``: at every step, for every sequence, the drafter (or none) that maximises expected
tokens per second — chosen among several drafters from a measured cost model and each drafter's running
acceptance on *this* request, so a request lands on the method that suits it without being told.

Children are ordinary drafters behind the same protocol, of two kinds:

- **free** (prompt lookup, NASD, suffix, …): deterministic and cheap (a table look-up). Every free child
  proposes at every step; only the chosen proposal is verified, but all of them are scored afterwards
  against the tokens the target really emitted (a deterministic draft token x is accepted with probability
  p(x), the chance that the target's own token is x: matching the emitted tokens is an unbiased estimate,
  greedy or sampled). So the free children's acceptance is measured at every step at no cost. Cheap is
  not free, though: a server's step at 8 rows spent ~5 % of its time on proposals it then did not take.
  So a free child that cannot win this step — at the best acceptance among the rows, no depth up to the
  deepest asked for beats drafting nothing at the step's start (done = fed = B, the test ``_choose`` makes
  for the first row) — does not propose, except every ``PROBE_EVERY``-th step, which keeps its acceptance
  measured (the children catch up with the sequences' tokens at their next proposal).
- **costly** (a draft model, a draft head): a proposal costs forwards of another model, so it is only
  made when chosen. Its acceptance is measured when it runs; before that an optimistic prior (and the
  pooled estimate from earlier requests) lets it be tried. A draft model starts lazily (its cache is
  filled the first time it is chosen); a draft head (``Needs.state_from_target``) at once, as its context is the
  target's states the loop gives at the prefill.

The choice, per sequence and step, over options o = (child, depth j) and "none", for the whole step's
rate: the B rows of a batch share one target pass over every row's fed tokens, so a row's draft costs
what it adds to that pass. Rows choose in turn; ``done`` and ``fed`` are the tokens the step is expected
to yield and the tokens it feeds with the choices made so far (each row counted with its own 1 token):

    rate(o) = (done + A_o(j)) / (C(fed + n_o) + j · c_child)        A(j) = Σ_{l=1..j} α^l
    rate(none) = done / C(fed)

and the chosen option adds A_o(j) to ``done`` and its n_o nodes to ``fed``. With one row (done = fed = 1)
this is (1 + A(j)) / C(1 + n) against 1 / C(1). In a batch the first tokens of a pass are cheap per token
(a decode step of 8 rows costs ~1.4 single ones), so the same draft that pays alone need not pay in a
full batch: a server under load drafts less, by the same rule. C(T) is the measured target pass over T
new tokens (T = 1 + the nodes fed), c_child a costly child's seconds per drafted token, α the child's
decayed acceptance: accepted positions / positions tried (up to the first miss; positions past the
emitted tokens are unknown and not counted). On a CPU where verifying k tokens costs nearly k passes
(AVX2), "none" wins unless acceptance is high; where a pass over 32 tokens costs what one costs (AMX),
long drafts win — the same rule, measured.

A costly child not yet started on a request (a draft model: its first use prefills the whole context) is
charged its start S too, spread over the tokens the row may still write (R = its remaining tokens, at most
START_HORIZON), the start paying when S < R · (1/rate without it − 1/rate with it):

    rate(o) = (done + A_o(j)) / (C(fed + n_o) + j · c_child + S · (1 + A_o(j)) / R)

S is the child's seconds per context token (timed at each start; before the first, the caller's
estimate) times the context lengths of the rows that have not started it (a batch starts it on every row).
The start must also beat, for the row alone, the rate the free children gave it lately (their best option's
expected tokens over pass seconds, summed over the steps with weight ``decay`` per step back): otherwise a
step where prompt lookup has no match would start the draft model on a row where it matches most steps. A
start dearer than START_WAIT one-token passes (a long prompt's) waits for OBSERVE steps of that history; a
short prompt's starts at once.
In a batch a costly child's forwards run over every row, costing about C(B) / C(1) times one row's: the
first row to choose it pays j · c_child times that, a later row only the depth beyond the deepest chosen.

Per-sequence child states live in this drafter's own state on the sequence and are swapped into
``seq.drafter_state`` around each child call, so children stay unaware of each other. Output is the
target's whatever is chosen (every draft is verified as usual): the choice moves speed only.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..acceptance import Acceptance, expected_accepted
from ..errors import InvalidParameterError
from ..gamma import MAX_GAMMA
from ..models.base import MAX_TREE_TOKENS
from ..sequence import Sequence
from .base import NO_NEEDS, Draft, Drafter, needs_of
from .registry import Method, methods as registered, register

NONE = "none"  # the option of drafting nothing this step (plain decoding)
# a draft model's acceptance before a request has shown its own (and before earlier requests pooled one): a
# draft of the target's family agrees with it most of the time (Qwen2.5-Coder 0.5B / 1.5B: α 0.82 on
# Spec-Bench, 0.85 on code); the arm moves to the request's own from its first steps
DRAFT_MODEL_PRIOR = 0.75
POOL_SHRINK = 8.0  # tries at its prior a costly child's pooled acceptance is shrunk with (``_prior``)
START_HORIZON = 256  # a costly child's start is spread over at most this many of a row's remaining tokens
# a costly child whose start costs more than START_WAIT one-token passes (a draft model's prefill of a long
# prompt) starts only once the row has OBSERVE steps of the free children's rates to weigh it against
START_WAIT = 8.0
OBSERVE = 4
PROBE_EVERY = 4  # a free child that cannot win still proposes (and is scored) at every this many steps


@dataclass
class _State:
    states: dict[str, object] = field(default_factory=dict)  # child -> its drafter_state for this sequence
    started: set[str] = field(default_factory=set)
    arms: dict[str, Acceptance] = field(default_factory=dict)
    proposals: dict[str, Draft] = field(default_factory=dict)  # this step's proposals, scored in accept
    chosen: str = NONE
    # the free options' recent rate for this row alone: decayed sums of the best one's expected tokens and
    # pass seconds per step (``_free_best``), what a costly child's start must beat (``_choose``)
    free_typical: tuple[float, float] = (0.0, 0.0)
    steps: int = 0  # steps this row has been through


def matched_depth(draft: Draft, emitted: list[int]) -> tuple[int, int]:
    """(accepted, tried) had ``draft`` been verified and the target emitted ``emitted`` (its accepted
    tokens then its own): the deepest path of ``draft`` agreeing with ``emitted``; tried counts the
    positions up to the first miss, not those past what was emitted (unknown)."""
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    node, depth = -1, 0
    while depth < len(emitted):
        nxt = next((i for i, (t, q) in enumerate(zip(draft.tokens, parents)) if q == node and t == emitted[depth]), None)
        if nxt is None:
            has_child = any(q == node for q in parents)
            return depth, depth + int(has_child)
        node, depth = nxt, depth + 1
    return depth, depth


class AutoDrafter:
    """Chooses, per sequence and step, among ``children`` (name -> drafter) and drafting nothing.

    ``pass_cost(T)``: seconds of a batch-1 target pass over T new tokens. ``draft_cost``: seconds per
    drafted token of each costly child (children not named there are free). ``pooled``: arms shared
    across requests (the prior of a new request: what this process has seen). ``stats``: per child, how
    often it was chosen (read by the CLI / bench)."""

    name = "auto"

    def __init__(self, children: dict[str, Drafter], pass_cost: Callable[[int], float], *,
                 draft_cost: dict[str, float] | None = None, pooled: dict[str, Acceptance] | None = None,
                 decay: float = 0.9, prior_alpha: float = 0.6, prior_weight: float = 3.0,
                 max_nodes: int = MAX_TREE_TOKENS - 1, start_cost: dict[str, float] | None = None,
                 priors: dict[str, float] | None = None):
        if not children:
            raise InvalidParameterError("method 'auto' needs at least one drafter to choose from")
        # what any child reads: the loop gives it to auto, which hands each child what it declared (the
        # inner layers of a fused eagle head, every prompt position's state, the target's cache, ...)
        self.needs = NO_NEEDS
        for name, c in children.items():
            try:
                self.needs |= needs_of(c)
            except InvalidParameterError as e:
                raise InvalidParameterError(f"auto's children: {e}") from None
        self.children = children
        self.pass_cost = pass_cost
        self.draft_cost = dict(draft_cost or {})
        unknown = set(self.draft_cost) - set(children)
        if unknown:
            raise InvalidParameterError(f"draft costs for drafters auto does not have: {sorted(unknown)}")
        self.free = [n for n in children if n not in self.draft_cost]
        self.costly = [n for n in children if n in self.draft_cost]
        # seconds per context token of starting a costly child on a request: the caller's dict, updated in
        # place with each timed start (so a decoder's later requests price it from the last one)
        self.start_cost = start_cost if start_cost is not None else {}
        self.priors = dict(priors or {})  # per child: the acceptance a request starts from before any is seen
        self.pooled = pooled if pooled is not None else {}
        self.decay, self.prior_alpha, self.prior_weight = decay, prior_alpha, prior_weight
        self.max_nodes = max_nodes
        self.chosen: dict[str, int] = {NONE: 0, **{n: 0 for n in children}}  # steps per choice
        self.skipped: dict[str, int] = {n: 0 for n in self.free}  # steps a free child did not propose (_hopeless)
        self._steps = 0

    # ---- child plumbing ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _as(self, seqs: list[Sequence], name: str):
        """Swap each sequence's state for child ``name`` into ``seq.drafter_state`` (and back)."""
        mine = [s.drafter_state for s in seqs]
        for s, st in zip(seqs, mine):
            s.drafter_state = st.states.get(name)
        try:
            yield
        finally:
            for s, st in zip(seqs, mine):
                st.states[name] = s.drafter_state
                s.drafter_state = st

    def _start_child(self, seq: Sequence, name: str, hidden: torch.Tensor | None) -> None:
        child = self.children[name]
        if hidden is not None and not needs_of(child).prompt_hidden:
            hidden = hidden[-1:]  # (1, D'): the last prompt position's, as the loop gives such a drafter
        computed = self._to_compute(name, seq)
        t0 = time.perf_counter()
        with self._as([seq], name):
            child.start(seq, hidden=hidden)
        if name in self.start_cost:  # what the next start of it costs, per context token it computes
            self.start_cost[name] = (time.perf_counter() - t0) / max(computed, 1)
        seq.drafter_state.started.add(name)

    def _to_compute(self, name: str, seq: Sequence) -> int:
        """The context tokens child ``name``'s start would compute for ``seq``: all but those its prefix cache
        holds (a draft model's: ``DraftModelDrafter.cached_prefix``)."""
        cached = getattr(self.children[name], "cached_prefix", None)
        return len(seq.tokens) - (cached(seq.tokens[:-1]) if cached is not None else 0)

    def _prior(self, name: str) -> Acceptance:
        """A new request's arm for ``name``: the acceptance pooled over earlier requests, or the prior before
        any. A costly child's pool is shrunk towards its prior (POOL_SHRINK tries): it is measured only on
        the steps it was chosen, so a few unlucky ones (a draft model tried at the start of a prose answer)
        would otherwise keep it from ever being tried again; a free child is scored at every step."""
        pooled = self.pooled.get(name)
        base = self.priors.get(name, self.prior_alpha)
        if pooled is None or pooled.tried <= 0:
            alpha = base
        elif name in self.costly:
            alpha = pooled.shrunk(base, 1.0, POOL_SHRINK)[0]
        else:
            alpha = pooled.alpha
        return Acceptance(alpha * self.prior_weight, self.prior_weight, 1.0, 1.0)

    # ---- protocol -------------------------------------------------------------------------------
    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        seq.drafter_state = _State(arms={n: self._prior(n) for n in self.children})
        # a costly child starts the first time it is chosen, unless its state is the target's states (a
        # draft head): those are given here, not later
        for name, child in self.children.items():
            if name in self.free or needs_of(child).state_from_target:
                self._start_child(seq, name, hidden)

    def _hopeless(self, name: str, seqs: list[Sequence], ks: list[int]) -> bool:
        """Whether free child ``name`` cannot win this step for any row, judged before it proposes: at the
        rows' best acceptance, a chain of any depth up to the deepest asked for (the fewest nodes a proposal
        that deep feeds) does not beat drafting nothing at the step's start. A bound for the first row; a
        later one sees other rows' choices, which the periodic probe (PROBE_EVERY) leaves room for."""
        k = max(ks, default=0)
        if k <= 0:
            return True
        alpha = max(s.drafter_state.arms[name].alpha for s in seqs)  # expected_accepted grows with α
        done = fed = len(seqs)
        none = done / self.pass_cost(fed)
        return all((done + expected_accepted(alpha, j)) / self.pass_cost(fed + j) <= none for j in range(1, k + 1))

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        self._steps += 1
        probe = self._steps % PROBE_EVERY == 0
        proposals: dict[str, list[Draft]] = {}
        for name in self.free:
            if not probe and self._hopeless(name, seqs, ks):
                self.skipped[name] += 1
                continue
            with self._as(seqs, name):
                proposals[name] = self.children[name].propose(seqs, ks)
        drafts: list[Draft] = []
        want: dict[str, list[int]] = {n: [0] * len(seqs) for n in self.costly}
        done, fed = float(len(seqs)), len(seqs)  # the step so far: expected tokens, tokens fed (1 per row)
        # a costly child drafts for the whole batch at once (every row takes part, if only to catch up): its
        # forward over the B rows costs about what the target's over B tokens does against one (``shape``),
        # paid by the first row that chooses it, and by a later one only for depth beyond the deepest so far
        paid = {n: 0 for n in self.costly}
        shape = self.pass_cost(len(seqs)) / self.pass_cost(1) if len(seqs) > 1 else 1.0
        # the start of each costly child this step would make: every row that has not started it
        start = {n: self.start_cost[n] * sum(self._to_compute(n, s) for s in seqs if n not in s.drafter_state.started)
                 for n in self.costly if n in self.start_cost}
        for i, (s, k) in enumerate(zip(seqs, ks)):
            st: _State = s.drafter_state
            st.proposals = {n: p[i] for n, p in proposals.items()}  # scored in accept: the ones made
            # this step's best free option for the row alone, while a costly child's start is still to price
            free1 = self._free_best(st, k) if k > 0 and any(n not in st.started for n in self.costly) else None
            # a costly child's drafted token may cost less than its one-token pass (a draft model's lookup)
            share = {n: self.children[n].pass_share(s) for n in self.costly if hasattr(self.children[n], "pass_share")}
            name, depth, gain, nodes = self._choose(st, k, done, fed, start, s.remaining, paid, shape, free1, share)
            st.steps += 1
            if free1 is not None:
                t1, s1 = free1
                st.free_typical = (self.decay * st.free_typical[0] + t1, self.decay * st.free_typical[1] + s1)
            if name in start:
                start[name] = 0.0  # started for every row below: the rows after this one pay nothing more
            if name in paid:  # the batched draft forwards run this deep now: a later row pays only deeper ones
                paid[name] = max(paid[name], depth)
            done, fed = done + gain, fed + nodes
            st.chosen = name
            self.chosen[name] += 1
            s.stats.choices[name] = s.stats.choices.get(name, 0) + 1
            if name in self.costly:
                want[name][i] = depth
                drafts.append(Draft([]))  # filled below
            elif name == NONE:
                drafts.append(Draft([]))
            else:
                drafts.append(st.proposals[name].truncated(self.max_nodes, depth))
        for name, depths in want.items():
            rows = [i for i, d in enumerate(depths) if d > 0]
            if not rows:
                continue
            # a costly child (a draft model) batches over the engine's rows: every row takes part (0 tokens
            # for those that chose otherwise), so every row must have started it
            for s in seqs:
                if name not in s.drafter_state.started:
                    self._start_child(s, name, None)
            with self._as(seqs, name):
                made = self.children[name].propose(seqs, depths)
            for i in rows:
                drafts[i] = made[i]
                seqs[i].drafter_state.proposals[name] = made[i]
        return drafts

    def _choose(self, st: _State, k: int, done: float = 1.0, fed: int = 1, start: dict[str, float] | None = None,
                remaining: int = START_HORIZON, paid: dict[str, int] | None = None, shape: float = 1.0,
                free1: tuple[float, float] | None = None, share: dict[str, float] | None = None
                ) -> tuple[str, int, float, int]:
        """(child or NONE, depth, expected accepted tokens, nodes fed) maximising the step's rate, given the
        tokens ``done`` and ``fed`` by the rows that chose before, the seconds ``start`` of starting each costly
        child this step, the row's ``remaining`` tokens, and for a batch the depth each costly child drafts
        already (``paid``) and its batched forward's cost against one row's (``shape``): see ``propose``.
        ``free1``: ``_free_best`` of this step, if the caller has it. ``share``: per costly child, the row's
        recent cost of a drafted token against ``draft_cost`` (``DraftModelDrafter.pass_share``; 1 if absent)."""
        horizon = max(1, min(remaining, START_HORIZON))
        best, best_rate = (NONE, 0, 0.0, 0), done / self.pass_cost(fed)
        if k <= 0:
            return best
        typical = None  # the free options' recent rate: computed when a start is priced
        for name, j, gain, nodes in self._free_options(st, k):
            rate = (done + gain) / self.pass_cost(fed + nodes)
            if rate > best_rate:
                best, best_rate = (name, j, gain, nodes), rate
        for name in self.costly:
            starting = (start or {}).get(name, 0.0)  # seconds of its start this step (0: started)
            if starting > START_WAIT * self.pass_cost(1) and st.steps < OBSERVE:
                continue  # a dear start waits until the free options have shown what they do on this row
            arm = st.arms[name]
            width = getattr(self.children[name], "branches", 1)
            per_token = self.draft_cost[name] * (share or {}).get(name, 1.0)
            for j in range(1, k + 1):
                nodes = min(j * width, self.max_nodes)
                gain = arm.pi * expected_accepted(arm.alpha, j)
                begin = starting * (1 + gain) / horizon  # its start, spread over the row
                if begin > 0:  # a start must beat what the free options have done lately, not only this step
                    typical = self._typical(st, free1 or self._free_best(st, k)) if typical is None else typical
                    if (1 + gain) / (self.pass_cost(1 + nodes) + j * per_token + begin) <= typical:
                        continue
                drafting = max(0, j - (paid or {}).get(name, 0)) * per_token * shape
                rate = (done + gain) / (self.pass_cost(fed + nodes) + drafting + begin)
                if rate > best_rate:
                    best, best_rate = (name, j, gain, nodes), rate
        return best

    def _free_options(self, st: _State, k: int):
        """(child, depth j, expected accepted tokens A(j), nodes fed) of each free child's proposal this step,
        every depth up to ``k``; none for a child that did not propose (``_hopeless``) or proposed nothing."""
        for name in self.free:
            d = st.proposals.get(name)
            if d is None or not d.tokens:
                continue
            alpha, depths = st.arms[name].alpha, d.depths()
            for j in range(1, min(k, max(depths)) + 1):
                yield name, j, expected_accepted(alpha, j), sum(1 for x in depths[:self.max_nodes] if x <= j)

    def _free_best(self, st: _State, k: int) -> tuple[float, float]:
        """(expected tokens, pass seconds) of this step's best free option for the row alone, drafting
        nothing included: the option of the highest rate (1 + A(j)) / C(1 + nodes)."""
        costs: dict[int, float] = {}
        tokens, seconds = 1.0, self.pass_cost(1)
        for _, _, gain, nodes in self._free_options(st, k):
            n = 1 + nodes
            cost = costs[n] if n in costs else costs.setdefault(n, self.pass_cost(n))
            if (1 + gain) * seconds > tokens * cost:
                tokens, seconds = 1 + gain, cost
        return tokens, seconds

    def _typical(self, st: _State, free1: tuple[float, float]) -> float:
        """The rate the free options give this row lately, this step's (``free1``, ``_free_best``) included:
        the best one's tokens over its pass seconds, each summed over the steps with weight ``decay`` per step
        back. A costly child's first use must beat it, not only this step's best (``_choose``): a step where
        prompt lookup has nothing to propose would otherwise start a draft model (a prefill of the whole
        context) on a row where prompt lookup drafts well on most steps (a 642-token Spec-Bench RAG prompt on
        AMD Zen 4: 7.6 s against 6.1)."""
        tok, sec = st.free_typical
        return (self.decay * tok + free1[0]) / (self.decay * sec + free1[1])

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None, draft: Draft | None = None,
               all_logits: torch.Tensor | None = None) -> None:
        st: _State = seq.drafter_state
        emitted = seq.tokens[n_before:n_before + num_accepted + 1]
        for name, d in st.proposals.items():  # score every proposal (the chosen one's whole, untruncated
            acc, tried = matched_depth(d, emitted)  # form too) against what the target emitted
            for arm in (st.arms[name], self.pooled.setdefault(name, self._prior(name))):
                arm.update(acc, tried, bool(d.tokens), self.decay)
        st.proposals = {}
        for name in list(st.started):
            chosen = name == st.chosen
            # the draft as fed and the target's scores at its nodes: the chosen child's, if it asked for them
            every = {"draft": draft, "all_logits": all_logits} \
                if chosen and draft is not None and needs_of(self.children[name]).all_logits else {}
            with self._as([seq], name):
                self.children[name].accept(seq, n_before, num_accepted, target_logits,
                                           path=path if chosen else None, hidden=hidden, **every)

    def release(self, seq: Sequence) -> None:
        st = seq.drafter_state
        if not isinstance(st, _State):
            return
        for name in list(st.started):
            with self._as([seq], name):
                self.children[name].release(seq)

    def move_row(self, src: int, dst: int) -> None:
        for child in self.children.values():
            child.move_row(src, dst)

    def bind_target_cache(self, cache) -> None:
        """The decoder's target cache, for the children that draft in it (``Needs.target_cache``)."""
        for child in self.children.values():
            if needs_of(child).target_cache:
                child.bind_target_cache(cache)


def _build(dw, rows: int, capacity: int, methods: list[str] | tuple[str, ...] | None = None, branches: int = 1,
           heads: str | None = None, draft_model: bool = True, **opts) -> AutoDrafter:
    """The auto drafter over ``methods`` (default: the registered methods marked ``auto_child`` — the
    drafters that cost no model forwards —, the kinds of draft heads in option ``heads`` when it is given,
    and ``draft`` when ``draft_model`` and the decoder's draft model qualifies: ``auto_takes_draft``; a
    draft-model method may be named when a draft model is set), priced by this machine's measured target
    pass costs (and the draft model's or head's cost per drafted token, and a draft model's start: its
    prefill of the context). A head child drafts a chain."""
    from ..heads import draft_seconds, pick_heads

    known = registered()
    if methods is None:
        names = [n for n, m in known.items() if m.auto_child]
        for n, m in known.items() if heads else ():
            if m.heads:
                with contextlib.suppress(InvalidParameterError):
                    pick_heads(heads, m.heads)
                    names.append(n)
        if draft_model and dw.auto_takes_draft():  # a draft model of the target's tokenizer, smaller, here
            names.append("draft")
    else:
        names = list(methods)
    bad = [n for n in names if n not in known or n in (AutoDrafter.name, "ar") or known[n].heads and not heads]
    if bad or not names:
        raise InvalidParameterError(f"method 'auto' chooses among drafting methods; cannot use {bad or names}")
    children = {n: dw.make_drafter(n, rows, capacity, **opts, **({"heads": heads, "branches": 1}
                                                                 if known[n].heads else {}))
                for n in names}
    draft_cost = {n: dw.per_draft_cost(n) for n in names if known[n].draft_model}
    draft_cost.update({n: draft_seconds(children[n]) for n in names if known[n].heads})
    dw.pass_cost(1)  # measured here (once per process), not inside the first decode step
    models = [n for n in names if known[n].draft_model]
    for n in models:  # a draft model's start (its prefill of the context): estimated until one is timed
        dw.auto_start_costs.setdefault(n, dw.draft_start_cost())
    return AutoDrafter(children, dw.pass_cost, draft_cost=draft_cost, pooled=dw.auto_arms,
                       start_cost=dw.auto_start_costs, priors={n: DRAFT_MODEL_PRIOR for n in models})


register(Method("auto", _build, help="per request and step, the drafter (or none) with the most expected "
                "tokens per second", takes_heads=True, own_gamma=MAX_GAMMA))
