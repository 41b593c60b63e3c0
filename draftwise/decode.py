"""The one decode loop: propose → verify → accept → roll back, for a batch of sequences.

Plain autoregressive decoding is this loop with no drafter (every step drafts 0 tokens and emits the
target's own token). Every method — draft model, prompt lookup, NASD, later ones — is only a Drafter.

Cache invariant: the target cache row of a sequence holds keys/values of all its tokens but the last.
A step feeds [last token, d_1..d_k] (k+1 new entries); after n drafts are accepted the valid length is
(tokens before the step) + n, so rolling back is setting the length.

Token trees go through the same step: the drafter returns a tree (``Draft.parents``), the row feeds
[last token, nodes...] with a tree attention mask (each node sees the cached prefix and its ancestors, at
position prefix + depth), and after verification the accepted path's entries are moved to contiguous
slots (``KVCache.keep_path``) — a chain needs no move. A batch mixes chains and trees freely.
A drafter whose ``needs`` say ``all_logits`` also gets, in ``accept``, the draft as fed and the target's logits
after every one of its nodes (lookahead decoding learns from the nodes off the accepted path).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from .drafters.base import Draft, Drafter, needs_of
from .errors import InvalidParameterError, PromptTooLongError
from .kernels import in_decode_threads
from .models.base import MAX_TREE_TOKENS, CausalLM, is_encoder_decoder
from .prefix import Prefill, PrefixCache
from .sampling import argmax, logits_to_probs, sample, sample_at
from .sequence import ACCEPTED, BONUS, PLAIN, RECOVERED, Sequence
from .verify import (VerifyResult, verify_greedy, verify_keyed, verify_sampled, verify_tree_greedy,
                     verify_tree_keyed, verify_tree_sampled)


def tree_inputs(tokens: list[list[int]], parents: list[list[int]], starts: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of one target pass over a token tree per row. tokens[b]: [root, nodes...]; parents[b]: the
    parent of each (-1 for the root, then indices into the same list); starts[b]: the row's cache length.
    Returns x (B, T) right-padded, positions (B, T) = start + depth, mask (B, T, T): ancestors + self."""
    B, T = len(tokens), max(len(t) for t in tokens)
    x = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    mask = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)  # padding sees itself only
    for b in range(B):
        x[b, :len(tokens[b])] = torch.tensor(tokens[b])
        depth = []
        for i, q in enumerate(parents[b]):
            if q >= 0:
                mask[b, i] |= mask[b, q]
            depth.append(0 if q < 0 else depth[q] + 1)
        positions[b, :len(depth)] = starts[b] + torch.tensor(depth)
        positions[b, len(depth):] = starts[b]
    return x, positions, mask


def _features(out) -> torch.Tensor:
    """The target's states a drafter reads: the final hidden states (B, T', D), followed by the tapped
    inner layers' outputs when the forward was asked for them -> (B, T', D * (1 + taps))."""
    if out.taps is None:
        return out.hidden
    taps = out.taps[:, -out.hidden.shape[1]:]  # (B, T', taps, D): the positions ``hidden`` holds
    return torch.cat([out.hidden, taps.flatten(-2).to(out.hidden.dtype)], -1)


class GammaPolicy(Protocol):
    """Chooses the draft length of each step (fixed, or adaptive from measured costs)."""

    max_gamma: int

    def choose(self, seqs: list[Sequence]) -> int: ...

    def observe(self, k: int, accepted: list[int], step_s: float) -> None: ...


@dataclass
class FixedGamma:
    gamma: int

    def __post_init__(self):
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise InvalidParameterError(f"gamma must be an integer >= 1, got {self.gamma!r}")

    @property
    def max_gamma(self) -> int:
        return self.gamma

    def choose(self, seqs: list[Sequence]) -> int:
        return self.gamma

    def observe(self, k: int, accepted: list[int], step_s: float) -> None:
        pass


class Decoder:
    """Runs sequences through the loop on a target model with an optional drafter.

    ``rows`` bounds the running batch; ``capacity`` the tokens per sequence (prompt + output + draft
    headroom). Running sequences always occupy cache rows 0..B-1 (compacted when one leaves).
    ``prefix_cache``: prompts start after the longest prefix it holds; a prompt's blocks, and a sequence's
    when it leaves, are kept there (``prefix.py``; the output is the same bits with or without it).
    """

    def __init__(self, target: CausalLM, drafter: Drafter | None = None, gamma: GammaPolicy | None = None,
                 *, eos_ids: frozenset[int] = frozenset(), detokenize=None, rows: int = 1,
                 capacity: int | None = None, prefix_cache: PrefixCache | None = None):
        self.target = target
        self.prefix_cache = prefix_cache
        self.drafter = drafter
        self.gamma = gamma if gamma is not None else FixedGamma(4)
        self.eos_ids = eos_ids
        self.detokenize = detokenize  # ids -> text, needed for stop strings
        self.capacity = capacity or target.config.max_context
        self.cache = target.new_cache(rows, self.capacity)
        self.needs = needs_of(drafter)  # what the drafter reads beyond the protocol (drafters/base.py)
        if self.needs.target_cache:  # a drafter that drafts with the target itself (layerskip)
            drafter.bind_target_cache(self.cache)
        # a drafter that reads the target's inner layers too (an EAGLE-3 head): every target forward
        # returns them, and the drafter gets them after the final state (see _features)
        taps = self.needs.feature_taps
        if taps and not getattr(target, "supports_taps", False):
            raise InvalidParameterError(f"the {drafter.name} drafter reads the target's inner layers, which this "
                                        "backend does not give; use the native backend")
        self._taps = {"taps": taps} if taps else {}
        self.ragged = bool(getattr(target, "supports_lengths", False))  # the pass runs each row's own tokens
        if hasattr(self.gamma, "packed"):  # a policy pricing steps by the tokens fed (AdaptiveGamma)
            self.gamma.packed = self.ragged
        self.running: list[Sequence] = []
        self.prefilling: Sequence | None = None  # the sequence whose prompt is being prefilled (begin/advance)
        self._prefill: Prefill | None = None

    @property
    def rows_in_use(self) -> int:
        """Cache rows holding a sequence: the running ones (rows 0..B-1) and the one in prefill (the next)."""
        return len(self.running) + (self.prefilling is not None)

    @property
    def free_rows(self) -> int:
        return self.cache.rows - self.rows_in_use

    def check_fits(self, seq: Sequence) -> None:
        headroom = self.gamma.max_gamma + 1 if self.drafter else 1
        need = seq.prompt_len + seq.params.max_tokens + headroom
        if seq.prompt_len == 0:
            raise InvalidParameterError("empty prompt: give at least one token")
        if is_encoder_decoder(self.target):
            self.target.check_source(seq.encoder_ids)
        elif seq.encoder_ids is not None:
            raise InvalidParameterError("a source (encoder_ids) needs an encoder-decoder target")
        if seq.prompt_len >= self.target.config.max_context:
            raise PromptTooLongError(f"prompt is {seq.prompt_len} tokens; the model's context is "
                                     f"{self.target.config.max_context}")
        if need > self.capacity:
            room = self.capacity - seq.prompt_len - headroom
            raise PromptTooLongError(
                f"prompt ({seq.prompt_len} tokens) + max_tokens ({seq.params.max_tokens}) does not fit the "
                f"context ({self.capacity} incl. {headroom} draft slots); max_tokens can be at most {room}")

    # ---- admission -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Prefill a new sequence into a free row and emit its first token."""
        self.begin(seq)
        self.advance()

    @in_decode_threads  # torch's ops off OpenMP's threads where those spin long
    def begin(self, seq: Sequence) -> None:
        """Start prefilling ``seq`` into the next free row (one sequence at a time); ``advance`` runs its prompt,
        all at once or a few chunks between steps of the running batch, and adds it to the batch at the end."""
        self.check_fits(seq)
        if self.free_rows == 0 or self.prefilling is not None:
            raise RuntimeError("no free row" if self.free_rows == 0 else "a prefill is in progress")
        t0 = time.perf_counter()
        seq.row = len(self.running)
        row = self.cache.view(slice(seq.row, seq.row + 1))
        row.reset()
        if seq.encoder_ids is not None:  # encoder-decoder: the encoder runs once, then the decoder prefill
            self.target.encode(row, seq.encoder_ids)
        # a drafter whose context is the target's states at every prompt position (eagle) gets them all
        every = {"all_hidden": True} if self.needs.prompt_hidden else {}
        # the prompt in exact chunks (prefix.PREFILL_CHUNK tokens), after the longest prefix the cache holds (not
        # where the drafter reads every prompt position's state: the cache keeps keys and values only)
        prefix = self.prefix_cache if seq.encoder_ids is None and not every else None
        self._prefill = Prefill(self.target, seq.prompt_ids, row, prefix=prefix, logits_for="last", **every,
                                **self._taps)
        seq.stats.cached_tokens = self._prefill.cached
        self.prefilling = seq
        seq.stats.prefill_s += time.perf_counter() - t0

    @in_decode_threads
    def advance(self, budget: int | None = None) -> tuple[Sequence | None, int]:
        """Prefill the next ``budget`` prompt tokens of the sequence ``begin`` started (at least one token; None:
        the rest). When its prompt is done it joins the running batch (rows 0..B-1: moved to row B if a sequence
        left meanwhile) with its first token. Returns (that sequence, or None while its prefill goes on; the
        prompt tokens computed). A prefill that raises leaves no trace: its row is free again."""
        seq, pre = self.prefilling, self._prefill
        if seq is None:
            return None, 0
        t0 = time.perf_counter()
        try:
            spent = pre.run(budget)
        except BaseException:
            self._end_prefill()
            self.cache.reset(seq.row)
            seq.row = -1
            raise
        seq.stats.prefill_s += time.perf_counter() - t0
        if not pre.done:
            return None, spent
        self._end_prefill()
        if seq.row != len(self.running):  # a running sequence left: rows 0..B-1 stay the running ones
            self.cache.move_row(seq.row, len(self.running))
            self.cache.reset(seq.row)
            seq.row = len(self.running)
        t0 = time.perf_counter()
        self._join(seq, pre.output)
        seq.stats.prefill_s += time.perf_counter() - t0
        return seq, spent

    def _end_prefill(self) -> None:
        self.prefilling, self._prefill = None, None

    def _join(self, seq: Sequence, out) -> None:
        """A prefilled sequence's first token, its drafter's start, its place in the batch."""
        logits = out.logits[0, -1]  # (V,)
        p = seq.params
        if p.greedy:
            first = int(argmax(logits))
        elif p.seed is not None:
            first = sample_at(logits_to_probs(logits, p), p.seed, 0, seq.uniforms(0, logits.shape[-1]))
        else:
            first = int(sample(logits_to_probs(logits, p), seq.generator))
        seq.stats.target_passes += 1
        self._append(seq, [first], [PLAIN])
        if not seq.finished and self.drafter is not None:
            hidden = _features(out)
            self.drafter.start(seq, hidden=hidden[0] if self.needs.prompt_hidden else hidden[0, -1:])
        self.running.append(seq)
        if seq.finished:
            self._remove(seq)

    # ---- the loop --------------------------------------------------------------------------------
    @in_decode_threads  # torch's ops off OpenMP's threads where those spin long
    def step(self) -> list[Sequence]:
        """One propose → verify → accept round for every running sequence. Returns those that finished."""
        seqs = self.running
        if not seqs:
            return []
        B = len(seqs)
        t0 = time.perf_counter()
        # propose: clip the draft length to each sequence's remaining budget
        K = self.gamma.choose(seqs) if self.drafter is not None else 0
        ks = [max(0, min(K, s.remaining - 1)) for s in seqs]
        drafts = self.drafter.propose(seqs, ks) if self.drafter is not None and max(ks) > 0 \
            else [Draft([]) for _ in seqs]
        trees = getattr(self.target, "supports_trees", False)
        # a tree feeds at most MAX_TREE_TOKENS tokens, and no more than the row has room for
        drafts = [d.truncated(min(MAX_TREE_TOKENS - 1, self.capacity - len(s.tokens)), k) if trees
                  else d.first_branch().truncated(k, k) for s, d, k in zip(seqs, drafts, ks)]
        t1 = time.perf_counter()
        # verify: one target pass over [last token, drafts...] per row (right-padded)
        T = 1 + max(len(d.tokens) for d in drafts)
        n_before = [len(s.tokens) for s in seqs]
        view = self.cache.view(slice(0, B))
        # rows that drafted fewer tokens than the longest (or none) cost only their own tokens in the pass
        ragged = {"lengths": [1 + len(d.tokens) for d in drafts]} \
            if self.ragged and any(1 + len(d.tokens) < T for d in drafts) else {}
        if any(d.is_tree for d in drafts):
            x, positions, mask = tree_inputs(
                [[s.tokens[-1]] + d.tokens for s, d in zip(seqs, drafts)],
                [[-1] + [q + 1 for q in (d.parents or range(-1, len(d.tokens) - 1))] for d in drafts],
                [n - 1 for n in n_before])
            out = self.target.forward(x, view, positions=positions, attn_mask=mask, logits_for="all", **ragged,
                                      **self._taps)
        else:
            x = torch.zeros(B, T, dtype=torch.long)
            for i, (s, d) in enumerate(zip(seqs, drafts)):
                x[i, 0] = s.tokens[-1]
                x[i, 1:1 + len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
            out = self.target.forward(x, view, logits_for="all", **ragged, **self._taps)
        logits = out.logits  # (B, T, V)
        hidden = _features(out)  # (B, T, D) or (B, T, D * (1 + taps))
        # per sequence from here on: an exception fails that sequence alone (seq.error), not the batch
        results: list[VerifyResult | None] = []
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            try:
                results.append(self._verify(s, d, logits[i, :1 + len(d.tokens)]))
            except Exception as e:
                self._fail(s, e)
                results.append(None)
        # roll back: a length pointer, plus moving a tree's accepted path to contiguous slots
        for i, (n, r) in enumerate(zip(n_before, results)):
            view.keep_path(i, n - 1, [0] + [j + 1 for j in r.nodes] if r else [0])
        t2 = time.perf_counter()
        for i, (s, d, r) in enumerate(zip(seqs, drafts, results)):
            if r is None:
                continue
            try:
                k = len(d.tokens)
                kinds = [ACCEPTED] * r.num_accepted + [PLAIN if k == 0 else BONUS if r.bonus else RECOVERED]
                s.stats.record_step(k, r.num_accepted, max(d.depths(), default=0) if d.is_tree else None)
                s.stats.gammas.append(ks[i])
                self._append(s, r.tokens, kinds)
                if self.drafter is not None and not s.finished:
                    rows = [0] + [j + 1 for j in r.nodes]
                    # a chain's path is rows 0..a: a view, not a copy of (a + 1) x V logits every step
                    rows = slice(0, len(rows)) if rows == list(range(len(rows))) else rows
                    # a drafter that learns from every node it had fed, not only the accepted path (lookahead)
                    every = {"draft": d, "all_logits": logits[i, :1 + len(d.tokens)]} \
                        if self.needs.all_logits else {}
                    self.drafter.accept(s, n_before[i], r.num_accepted, logits[i, rows], path=r.nodes,
                                        hidden=hidden[i, rows], **every)
            except Exception as e:
                self._fail(s, e)
        t3 = time.perf_counter()
        self.gamma.observe(K, [r.num_accepted if r else 0 for r in results], t3 - t0)
        for s in seqs:
            s.stats.draft_s += (t1 - t0) + (t3 - t2)
            s.stats.verify_s += t2 - t1
        done = [s for s in seqs if s.finished]
        for s in done:
            self._remove(s)
        return done

    def _verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> VerifyResult:
        # logits: (k+1, V) target scores at [last token, d_1..d_k]
        p = seq.params
        if draft.is_tree:
            if p.greedy:
                return verify_tree_greedy(logits, draft.tokens, draft.parents)
            probs = torch.stack([logits_to_probs(row, p) for row in logits])
            if p.seed is not None:
                V = probs.shape[-1]
                return verify_tree_keyed(probs, draft.tokens, draft.parents, p.seed, seq.num_output,
                                         lambda pos: seq.uniforms(pos, V))
            return verify_tree_sampled(probs, draft.tokens, draft.parents, draft.probs, seq.generator)
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        if p.greedy:
            return verify_greedy(logits, tokens)
        if p.seed is not None:  # position-keyed: row by row, exactly as plain decoding computes each row
            probs = torch.stack([logits_to_probs(row, p) for row in logits])
            V = probs.shape[-1]
            return verify_keyed(probs, tokens, p.seed, seq.num_output, lambda pos: seq.uniforms(pos, V))
        return verify_sampled(logits_to_probs(logits, p), tokens, draft.probs, seq.generator)

    @staticmethod
    def _fail(seq: Sequence, error: Exception) -> None:
        """A per-sequence step raised: the sequence ends with finish_reason "error" (``seq.error``)."""
        seq.error, seq.finish_reason = error, "error"

    def abort(self, seq: Sequence) -> None:
        if seq is self.prefilling:  # its prompt half done: the row is free again, nothing is kept
            self._end_prefill()
            self.cache.reset(seq.row)
            seq.finish_reason, seq.row = "abort", -1
            seq.stats.wall_s = time.perf_counter() - seq.started
        elif seq in self.running:
            seq.finish_reason = "abort"
            self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        if self.prefix_cache is not None and seq.error is None and seq.encoder_ids is None:
            # its tokens' keys and values (all but the last's) for a later prompt that starts with them
            self.prefix_cache.store(seq.tokens, self.cache.view(slice(seq.row, seq.row + 1)), len(seq.tokens) - 1)
        if self.drafter is not None:
            self.drafter.release(seq)
        idx = self.running.index(seq)
        last = self.running[-1]
        if last is not seq:  # compaction: the last row moves into the hole
            self.cache.move_row(last.row, seq.row)
            if self.drafter is not None:
                self.drafter.move_row(last.row, seq.row)
            last.row = seq.row
            self.running[idx] = last
        self.running.pop()
        self.cache.reset(len(self.running))
        seq.row = -1
        seq.stats.wall_s = time.perf_counter() - seq.started

    # ---- output bookkeeping ----------------------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int], kinds: list[str]) -> None:
        """Append emitted tokens one by one, ending the output at EOS, a stop string or max_tokens."""
        p = seq.params
        for tok, kind in zip(tokens, kinds):
            seq.tokens.append(tok)
            seq.kinds.append(kind)
            if tok in self.eos_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif p.stop and self.detokenize is not None:
                text = self.detokenize(seq.output_ids)
                cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
                if cut >= 0:
                    seq.finish_reason, seq.stop_text_end = "stop", cut
            if seq.finish_reason is None and seq.num_output >= p.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        seq.stats.new_tokens = seq.num_output

    def run(self, seqs: list[Sequence], on_step=None) -> list[Sequence]:
        """Decode all sequences to completion (admitting waiting ones as rows free up)."""
        waiting = list(seqs)
        for s in waiting:
            self.check_fits(s)
        while waiting or self.running:
            while waiting and self.free_rows:
                self.add(waiting.pop(0))
            if self.running:
                for s in self.step():
                    if s.error is not None:
                        raise s.error
            if on_step is not None:
                on_step(seqs)
        return seqs
