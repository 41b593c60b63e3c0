"""A draft model whose tokenizer differs from the target's (SmolLM2-135M drafting for Qwen2.5).

Two ways across the vocabularies, both lossless because the verifier only ever sees target tokens:

- **greedy: text.** The draft reads the text so far re-tokenized with its own tokenizer, drafts freely,
  and its text is re-tokenized with the target's (HF "universal assisted generation"). The last target
  tokens are re-tokenized together with the draft text, and the draft counts only where they come out
  unchanged, so a word split across the boundary ("quick" + "sort") becomes the target's own tokens.
  Greedy verification needs no q: any draft leaves the output the target's argmax sequence.
- **sampling: the shared vocabulary** (token-level intersection, Timor et al. 2025, "TLI"). The draft's
  distribution is restricted to the tokens both vocabularies have (same string) and renormalized; every
  draft token then *is* a target token and q is a distribution over the target's vocabulary (zero
  elsewhere), so standard rejection sampling (``verify_sampled``) keeps the target's distribution.
  Seeded requests draw the coupled ``sample_at(q, seed, i)`` from that same q.

The draft's context is always the target's text so far (prompt decoded with special tokens, then the
output) in the draft's tokenization; its cache row holds ``state.ids``, the draft tokens it has keys for,
and each step keeps their longest common prefix with the new context: rollback is that prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import IncompatibleModelsError, InvalidParameterError
from ..models.base import CausalLM
from ..sampling import logits_to_probs, sample, sample_at
from ..sequence import Sequence
from .base import Draft

MIN_SHARED = 0.25  # a bridgeable draft shares at least this fraction of its vocabulary with the target
PROBES = ("def quicksort(arr):\n    return sorted(arr)  # O(n log n)\n",
          "The quick brown fox jumps over the lazy dog. 1234567890!?\n\tTabs, \"quotes\" and 'apostrophes'.")
BOUNDARY = 3  # target tokens re-tokenized with the draft text (at most)
DRAFT_RATIO = 1.5  # draft tokens per target token, about (the cost model's estimate for text mode)


def draft_steps(k: int) -> int:
    """At most this many draft-model tokens for ``k`` target tokens in text mode: a row stops as soon as
    its text covers k + 1 target tokens (a draft token is shorter than a target token, or as long)."""
    return 0 if k <= 0 else 2 * k + 1


class VocabBridge:
    """The map between two tokenizers: shared tokens (same string in both vocabularies, same text when
    decoded alone), and text round trips. Raises ``IncompatibleModelsError`` when they cannot be bridged:
    either tokenizer loses text on a round trip, or they share too little."""

    def __init__(self, target_tok, draft_tok, target_vocab: int, draft_vocab: int):
        self.target_tok, self.draft_tok = target_tok, draft_tok
        for name, tok in (("target", target_tok), ("draft", draft_tok)):
            for text in PROBES:
                back = tok.fast.decode(tok.fast.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
                if back != text:
                    raise IncompatibleModelsError(
                        f"the draft's vocabulary cannot be bridged to the target's: the {name} tokenizer does not "
                        f"give back the text it encodes ({text[:24]!r}... -> {back[:24]!r}...)")
        tv, dv = target_tok.vocab_signature(), draft_tok.vocab_signature()
        names = sorted(n for n in set(tv) & set(dv) if tv[n] < target_vocab and dv[n] < draft_vocab)
        t_ids, d_ids = [tv[n] for n in names], [dv[n] for n in names]
        same = [a == b for a, b in zip(target_tok.fast.decode_batch([[i] for i in t_ids], skip_special_tokens=False),
                                       draft_tok.fast.decode_batch([[i] for i in d_ids], skip_special_tokens=False))]
        self.target_ids = torch.tensor([i for i, s in zip(t_ids, same) if s], dtype=torch.long)  # (S,)
        self.draft_ids = torch.tensor([i for i, s in zip(d_ids, same) if s], dtype=torch.long)  # (S,)
        self.target_vocab, self.draft_vocab = target_vocab, draft_vocab
        if len(self.draft_ids) < MIN_SHARED * draft_vocab:
            raise IncompatibleModelsError(
                f"the draft's vocabulary cannot be bridged to the target's: they share {len(self.draft_ids)} of the "
                f"draft's {draft_vocab} tokens (at least {MIN_SHARED:.0%} needed); use a draft whose tokenizer is "
                "of the target's kind (byte-level BPE for byte-level BPE)")
        self.shared_mask = torch.zeros(draft_vocab, dtype=torch.bool)  # (V_d,)
        self.shared_mask[self.draft_ids] = True
        self.to_draft = torch.full((target_vocab,), -1, dtype=torch.long)  # (V_t,) draft id of a shared token
        self.to_draft[self.target_ids] = self.draft_ids

    @property
    def shared(self) -> int:
        return len(self.draft_ids)

    def restricted_probs(self, logits: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits (V_d,) -> (q over the target vocabulary (V_t,), q over the draft's (V_d,)): the
        sampling transform applied to the draft's distribution restricted to the shared tokens."""
        q_d = logits_to_probs(logits.masked_fill(~self.shared_mask, float("-inf")), params)  # (V_d,)
        q_t = torch.zeros(self.target_vocab, dtype=q_d.dtype)
        q_t[self.target_ids] = q_d[self.draft_ids]
        return q_t, q_d

    def draft_context(self, seq: Sequence, prompt_ids: list[int]) -> list[int] | None:
        """The sequence so far in the draft's tokens (``prompt_ids``: the prompt's, computed once), or
        None while the output ends inside a character (a byte-level token split a multi-byte one)."""
        text = self.target_tok.decode(seq.output_ids, skip_special=False)
        if text.endswith("\ufffd"):
            return None
        return prompt_ids + self.draft_tok.fast.encode(text, add_special_tokens=False).ids or None

    def prompt_context(self, prompt: list[int]) -> list[int]:
        text = self.target_tok.decode(prompt, skip_special=False)
        return self.draft_tok.fast.encode(text, add_special_tokens=True).ids

    def target_tokens(self, tail: list[int], draft_text: str) -> list[int]:
        """``draft_text`` (continuing after the target tokens ``tail``) as target tokens: re-tokenized with
        the last few tail tokens, counted only where those come back unchanged."""
        enc = self.target_tok.fast.encode
        for w in range(min(BOUNDARY, len(tail)), 0, -1):
            head = self.target_tok.decode(tail[-w:], skip_special=False)
            if "\ufffd" in head:
                continue
            ids = enc(head + draft_text, add_special_tokens=False).ids
            if ids[:w] == tail[-w:]:
                return ids[w:]
        return enc(draft_text, add_special_tokens=False).ids


@dataclass
class _State:
    prompt: list[int]  # the prompt in the draft's tokens
    ids: list[int] = field(default_factory=list)  # draft tokens whose keys/values the row holds, in order


@dataclass
class _Drawn:
    """One propose's draws, per row."""

    ids: torch.Tensor  # (B, S) draft-vocabulary ids
    target: list[list[int]]  # sampled rows: the target ids drawn
    probs: list[list[torch.Tensor]]  # sampled rows without a seed: q (V_t,) of each draw
    text_tokens: list[list[int] | None]  # text rows: their k target tokens, once the text went beyond them
    steps: int  # draft tokens drawn per row (all rows move together)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CrossVocabDrafter:
    """Drafts with a model of another tokenizer (see the module docstring), batched over rows; its cache
    row mirrors the sequence's engine row."""

    name = "draft"

    def __init__(self, model: CausalLM, bridge: VocabBridge, rows: int, capacity: int, branches: int = 1):
        if branches != 1:
            raise InvalidParameterError("a draft with another tokenizer drafts chains, not token trees: use "
                                        "--method draft (or a draft with the target's tokenizer)")
        self.model, self.bridge = model, bridge
        # the draft's tokens are shorter than the target's: room for twice the target's capacity
        self.capacity = min(2 * capacity + 64, model.config.max_context)
        self.cache = model.new_cache(rows, self.capacity)

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        state = seq.drafter_state = _State(self.bridge.prompt_context(seq.prompt_ids))
        cache = self.cache.view(slice(seq.row, seq.row + 1))
        cache.reset()
        prefix = state.prompt[:-1]
        if prefix and len(prefix) + 64 < self.capacity:  # else the row never drafts (too long for the draft)
            self.model.forward(torch.tensor([prefix]), cache, logits_for="last")
            state.ids = list(prefix)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        assert all(s.row == i for i, s in enumerate(seqs)), "engine rows must be 0..B-1"
        steps = [k if not s.params.greedy else draft_steps(k) for s, k in zip(seqs, ks)]
        S = max(steps, default=0)
        if S == 0:
            return [Draft([]) for _ in seqs]
        starts, pending, drafting = self._catch_up_plan(seqs, ks, S)
        logits = self._catch_up(seqs, starts, pending)
        drawn = self._draw(seqs, ks, steps, S, drafting, logits)
        return self._drafts(seqs, ks, steps, drafting, drawn)

    def _catch_up_plan(self, seqs: list[Sequence], ks: list[int], S: int
                       ) -> tuple[list[int], list[list[int]], list[bool]]:
        """What each cache row keeps of its old context (``starts``: the longest common prefix with the new
        one), the tokens it is fed to catch up (``pending``), and whether it drafts (its context, the
        batch's padded catch-up and S drafts fit its row; a row that does not refeeds one token it holds)."""
        ctxs = [self.bridge.draft_context(s, s.drafter_state.prompt) for s in seqs]
        starts, pending = [], []
        for s, ctx in zip(seqs, ctxs):
            ids = s.drafter_state.ids
            if ctx is None:  # not now: feed one token the row already holds, to keep the batch together
                ctx = ids if ids else s.drafter_state.prompt[:1]
            n = min(_common_prefix(ids, ctx), len(ctx) - 1)  # at least the last token is fed, for its logits
            starts.append(n)
            pending.append(ctx[n:])
        drafting = [ctx is not None and k > 0 and n + len(p) + S <= self.capacity
                    for ctx, k, n, p in zip(ctxs, ks, starts, pending)]
        P = max((len(p) for p, ok in zip(pending, drafting) if ok), default=1)
        drafting = [ok and n + P <= self.capacity for ok, n in zip(drafting, starts)]
        for i, ok in enumerate(drafting):
            if not ok:  # refeed one token the row holds (or the first), where there is room; draft nothing
                ids = seqs[i].drafter_state.ids
                if ids:
                    starts[i] = max(min(starts[i], len(ids) - 1, self.capacity - P - S), 0)
                    pending[i] = [ids[starts[i]]]
                else:
                    starts[i], pending[i] = 0, seqs[i].drafter_state.prompt[:1]
        return starts, pending, drafting

    def _catch_up(self, seqs: list[Sequence], starts: list[int], pending: list[list[int]]) -> torch.Tensor:
        """Feed every row its pending tokens after its kept prefix, in one right-padded batch; returns the
        draft's logits (B, V_d) after each row's last pending token."""
        B, P = len(seqs), max(len(p) for p in pending)
        cache = self.cache.view(slice(0, B))
        x = torch.zeros(B, P, dtype=torch.long)  # (B, P) right-padded
        for i, p in enumerate(pending):
            x[i, :len(p)] = torch.tensor(p)
        cache.set_lengths(starts)
        last = torch.tensor([len(p) - 1 for p in pending])  # (B,)
        logits = self.model.forward(x, cache, logits_for=last).logits[:, 0]  # (B, V_d)
        for s, n, p in zip(seqs, starts, pending):
            s.drafter_state.ids = s.drafter_state.ids[:n] + p
        cache.set_lengths([len(s.drafter_state.ids) for s in seqs])
        return logits

    def _draw(self, seqs: list[Sequence], ks: list[int], steps: list[int], S: int, drafting: list[bool],
              logits: torch.Tensor) -> _Drawn:
        """Up to S draft tokens per row: text (greedy) rows freely by argmax, until their text covers k + 1
        target tokens; sampled rows in the shared vocabulary (q over the target's); rows not drafting by
        argmax (the batch moves together). Stops when every drafting row is done."""
        B = len(seqs)
        cache = self.cache.view(slice(0, B))
        d = _Drawn(torch.zeros(B, S, dtype=torch.long), [[] for _ in seqs], [[] for _ in seqs], [None] * B, S)
        for j in range(S):
            for i, s in enumerate(seqs):
                if s.params.greedy or not drafting[i] or j >= steps[i]:
                    d.ids[i, j] = int(logits[i].argmax())
                    if s.params.greedy and drafting[i] and d.text_tokens[i] is None:
                        tokens = self._text_tokens(s, d.ids[i, :j + 1].tolist())
                        if len(tokens) > ks[i]:  # k tokens whose text the draft went beyond: done
                            d.text_tokens[i] = tokens[:ks[i]]
                    continue
                q_t, _ = self.bridge.restricted_probs(logits[i], s.params)  # (V_t,)
                if s.params.seed is not None:
                    pos = s.num_output + j
                    t = sample_at(q_t, s.params.seed, pos, s.uniforms(pos, q_t.shape[-1]))
                else:
                    t = int(sample(q_t, s.generator))
                    d.probs[i].append(q_t)
                d.target[i].append(t)
                d.ids[i, j] = int(self.bridge.to_draft[t])
            done = all(not ok or (d.text_tokens[i] is not None if s.params.greedy else j + 1 >= steps[i])
                       for i, (s, ok) in enumerate(zip(seqs, drafting)))
            if done:
                d.steps = j + 1
                break
            if j + 1 < S:
                logits = self.model.forward(d.ids[:, j:j + 1], cache, logits_for="last").logits[:, -1]
        return d

    def _drafts(self, seqs: list[Sequence], ks: list[int], steps: list[int], drafting: list[bool],
                d: _Drawn) -> list[Draft]:
        """Each row's draft in target tokens; the rows' caches record the draft tokens fed."""
        S = d.steps
        drafts = []
        for i, s in enumerate(seqs):
            s.drafter_state.ids += d.ids[i, :S - 1].tolist()  # the last drawn token was never fed
            if not drafting[i]:
                drafts.append(Draft([]))
            elif not s.params.greedy:
                q = torch.stack(d.probs[i][:ks[i]]) if d.probs[i] else None
                drafts.append(Draft(d.target[i][:ks[i]], q))
            elif d.text_tokens[i] is not None:
                drafts.append(Draft(d.text_tokens[i]))
            else:
                tokens = self._text_tokens(s, d.ids[i, :min(steps[i], S)].tolist())
                if len(tokens) > 1:
                    tokens = tokens[:-1]  # the text ends where the draft stopped: its last token may be cut short
                drafts.append(Draft(tokens[:ks[i]]))
        return drafts

    def _text_tokens(self, seq: Sequence, draft_ids: list[int]) -> list[int]:
        """The target tokens of the text the draft wrote after ``seq``'s tokens (see VocabBridge)."""
        text = self.bridge.draft_tok.decode(draft_ids, skip_special=False)
        text = text.rstrip("\ufffd")  # a character the draft did not finish
        return self.bridge.target_tokens(seq.tokens, text) if text else []

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        pass  # the next propose keeps the common prefix of what the row holds and the new context

    def release(self, seq: Sequence) -> None:
        self.cache.reset(seq.row)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
