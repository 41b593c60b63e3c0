"""A separate, smaller draft model with its own KV cache (same tokenizer as the target). For an
encoder-decoder target the draft is a smaller encoder-decoder model: it encodes the source once, in ``start``."""

from __future__ import annotations

import torch

from ..errors import IncompatibleModelsError, InvalidParameterError
from ..models.base import CausalLM, is_encoder_decoder
from ..models.transformer import VocabSubset
from ..prefix import prefill
from ..sampling import logits_to_probs, sample, sample_at, top_indices
from ..sequence import Sequence
from .base import Draft
from .pld import NgramIndex
from .registry import Method, register


class DraftModelDrafter:
    """Drafts autoregressively with a small model; q is its (transformed) distribution.

    Seeded sampled sequences draft the coupled draw ``sample_at(q, seed, i)`` (the target's position-keyed
    noise applied to q) as a one-hot draft; the verifier keeps it while it equals the target's own keyed
    draw, so the output is plain decoding's seeded text (see sampling.py).

    ``branches`` > 1 drafts a token tree: the chain, plus at every depth the next ``branches - 1`` choices
    of the draft as leaves beside the chain's token (greedy: the next best tokens; sampling: further draws
    without replacement from the same q; seeded: the next best by q). They cost no draft forward, and
    where the chain's token is rejected the target may still accept one of them.

    A greedy row feeds, with each drafted token, the tokens its context's n-gram lookup expects next
    (``_Lookup``; ``lookup=False``: never) and keeps those the draft's own choice equals, so one draft pass may
    add several tokens to the chain; the chain is the one the draft alone would draft.

    Its cache row mirrors the sequence's engine row. ``seq.drafter_state`` is the number of the
    sequence's leading tokens whose keys/values are valid in the draft cache.

    A draft whose head computes part of its vocabulary (``transformer.VocabSubset``) also computes every token
    a running sequence holds — its prompt's and output's — from ``start`` to ``release``.
    """

    name = "draft"

    def __init__(self, model: CausalLM, rows: int, capacity: int, branches: int = 1, lookup: bool = True,
                 prefix_cache=None):
        if not isinstance(branches, int) or branches < 1:
            raise InvalidParameterError(f"branches must be an integer >= 1, got {branches!r}")
        self.model = model
        self.lookup = lookup
        self.prefix_cache = prefix_cache  # prefix.PrefixCache of the draft model's prompt keys and values, or None
        self._looks: dict[int, _Lookup] = {}  # id(seq) -> its tokens' n-gram index (greedy rows)
        self.cache = model.new_cache(rows, capacity)
        self.branches = branches
        head = getattr(model, "lm_head", None)
        self.vocab = head if isinstance(head, VocabSubset) else None
        self._held: dict[int, set[int]] = {}  # id(seq) -> the head tiles its tokens hold (VocabSubset.hold)

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        cache = self.cache.view(slice(seq.row, seq.row + 1))
        cache.reset()
        self._looks[id(seq)] = _Lookup()
        if self.vocab is not None:
            self.vocab.hold(seq.tokens, self._held.setdefault(id(seq), set()))
        if is_encoder_decoder(self.model):  # an encoder-decoder draft encodes the source into its own cache
            self.model.encode(cache, seq.encoder_ids)
        prefix = seq.tokens[:-1]
        pc = self.prefix_cache if seq.encoder_ids is None else None
        prefill(self.model, prefix, cache, prefix=pc, logits_for="last")
        seq.drafter_state = len(prefix)

    def cached_prefix(self, context: list[int]) -> int:
        """The tokens of ``context`` a start would read from the prefix cache instead of computing."""
        return self.prefix_cache.cached_length(context) if self.prefix_cache is not None else 0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        K = max(ks, default=0)
        if K == 0:
            return [Draft([]) for _ in seqs]
        B = len(seqs)
        assert all(s.row == i for i, s in enumerate(seqs)), "engine rows must be 0..B-1"
        cache = self.cache.view(slice(0, B))
        # 1) catch up on tokens the draft cache lacks (the last target token, and after a fully accepted
        #    block the last draft too), right-padded to a common length
        pending = [s.tokens[s.drafter_state:] for s in seqs]  # each has >= 1 token
        P = max(len(p) for p in pending)
        x = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(pending):
            x[i, :len(p)] = torch.tensor(p)
        cache.set_lengths([s.drafter_state for s in seqs])
        last = torch.tensor([len(p) - 1 for p in pending])  # (B,) each row's last real token
        step_logits = self.model.forward(x, cache, logits_for=last).logits[:, 0]  # (B, V)
        fed = [len(s.tokens) for s in seqs]  # each row's tokens whose keys/values the draft cache holds
        nxt = list(step_logits)  # per row (V,): the draft's scores for the row's next token
        # 2) draft each row's ks[i] tokens autoregressively (and, for a tree, the alternatives beside each);
        #    a greedy row also feeds the tokens its context's lookup expects next (LOOKUP) and keeps those the
        #    draft itself would choose, so one pass may draft several tokens: the chain is the same either way
        W = self.branches
        chains: list[list[int]] = [[] for _ in seqs]
        alts: list[list[list[int]]] = [[] for _ in seqs]  # [row][depth] -> alternative tokens
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        looks = [self._lookup(s) if self.lookup and s.params.greedy else None for s in seqs]
        while True:
            feeds: list[list[int]] = []
            for i, s in enumerate(seqs):
                if len(chains[i]) < ks[i]:
                    self._pick(s, nxt[i], chains[i], alts[i], probs[i], W)
                room = ks[i] - len(chains[i])  # tokens the row still drafts after its newest
                if room <= 0:
                    feeds.append([])
                else:
                    feeds.append([chains[i][-1]] + (looks[i].expect(s.tokens, chains[i], room) if looks[i] else []))
            if not any(feeds):
                break
            T = max(len(f) for f in feeds)
            x = torch.zeros(B, T, dtype=torch.long)
            for i, f in enumerate(feeds):
                x[i, :len(f)] = torch.tensor(f or [seqs[i].tokens[-1]])  # a finished row rides along, ignored
            cache.set_lengths(fed)
            if T == 1:
                step = self.model.forward(x, cache, logits_for="last").logits  # (B, 1, V)
            else:
                # rows of fewer tokens are right-padded: packed (the native model), else computed and ignored
                packed = {"lengths": [max(len(f), 1) for f in feeds]} if B > 1 else {}
                step = self.model.forward(x, cache, logits_for="all", **packed).logits  # (B, T, V)
            for i, f in enumerate(feeds):
                if not f:
                    continue
                a = 0  # the expected tokens the draft chose itself, each with its depth's alternatives
                while a + 1 < len(f):
                    top = top_indices(step[i, a], W).tolist()
                    if top[0] != f[a + 1]:
                        break
                    chains[i].append(f[a + 1])
                    alts[i].append(top[1:])
                    a += 1
                fed[i] += 1 + a
                nxt[i] = step[i, a]
                if looks[i] is not None:
                    looks[i].record(len(f), 1 + a)
        cache.set_lengths(fed)
        drafts = []
        for i, s in enumerate(seqs):
            k = ks[i]
            s.drafter_state = fed[i]  # the chain's tokens fed so far (the newest one is not, unless expected)
            chain = chains[i]
            q = torch.stack(probs[i]) if probs[i] else None
            if W == 1 or k == 0:
                drafts.append(Draft(chain, q))
                continue
            # the chain's nodes first (0..k-1), then each depth's alternatives as leaves of the same parent
            toks, parents, rows = list(chain), list(range(-1, k - 1)), list(range(k))
            for j in range(k):
                for t in alts[i][j]:
                    toks.append(t)
                    parents.append(j - 1)
                    rows.append(j)
            drafts.append(Draft(toks, None if q is None else q[rows], parents))
        return drafts

    @staticmethod
    def _pick(s: Sequence, logits: torch.Tensor, chain: list[int], alts: list[list[int]],
              probs: list[torch.Tensor], W: int) -> None:
        """The row's next draft token from the draft's scores (V,), appended to ``chain`` with the depth's
        ``W - 1`` alternatives (``alts``) and, for a sampled row, the distribution it was drawn from."""
        if s.params.greedy:
            top = top_indices(logits, W).tolist()
            x, alt = top[0], top[1:]
        elif s.params.seed is not None:  # coupled draw: the target's keyed noise at that position
            q = logits_to_probs(logits, s.params)
            pos = s.num_output + len(chain)
            x = int(sample_at(q, s.params.seed, pos, s.uniforms(pos, q.shape[-1])))
            alt = [t for t in q.topk(min(W, q.shape[-1])).indices.tolist() if t != x][:W - 1]
        else:
            q = logits_to_probs(logits, s.params)  # (V,)
            x = int(sample(q, s.generator))
            probs.append(q)
            alt = _without_replacement(q, [x], W - 1, s.generator)
        chain.append(x)
        alts.append(alt)

    def pass_share(self, seq: Sequence) -> float:
        """One-token draft passes per token of ``seq``'s chains lately (below 1 where its lookup pays): what a
        drafted token of it costs against the draft's one-token pass (method auto prices it so)."""
        look = self._looks.get(id(seq))
        return look.share() if look is not None and self.lookup and seq.params.greedy else 1.0

    def _lookup(self, seq: Sequence) -> _Lookup:
        look = self._looks.setdefault(id(seq), _Lookup())
        if look.index.upto >= len(seq.tokens):  # a stale entry (a sequence gone without release): start over
            look = self._looks[id(seq)] = _Lookup()
        return look

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        # the draft cache holds the chain: valid up to the first accepted node that is not a chain node
        on_chain = num_accepted if path is None else next(
            (d for d, node in enumerate(path) if node != d), len(path))
        seq.drafter_state = min(seq.drafter_state, n_before + on_chain)
        if self.vocab is not None:
            self.vocab.hold(seq.tokens[n_before:], self._held.setdefault(id(seq), set()))

    def release(self, seq: Sequence) -> None:
        if self.prefix_cache is not None and seq.encoder_ids is None and isinstance(seq.drafter_state, int):
            # the keys and values of the tokens it holds, for a later start on a prompt that begins with them
            self.prefix_cache.store(seq.tokens, self.cache.view(slice(seq.row, seq.row + 1)), seq.drafter_state)
        self.cache.reset(seq.row)
        self._looks.pop(id(seq), None)
        if self.vocab is not None:
            self.vocab.release(self._held.pop(id(seq), set()))

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)


LOOKUP = 3  # the longest n-gram a greedy row's lookup matches; it expects as many tokens as it matched
EXTRA_TOKEN = 0.07  # a draft pass's cost per token fed beyond the first, in one-token passes (0.5B, AMD Zen 4)
SHARE_DECAY = 0.9  # per draft pass, the weight of the earlier ones in a row's passes per chain token


class _Lookup:
    """Where each n-gram (n = 1..LOOKUP) of a sequence's tokens last occurred: the tokens a greedy row's draft
    is likely to choose next, fed with its newest token so that one draft pass may check several (cascaded
    drafting: a draft model's chain sped up by prompt lookup, as prompt lookup speeds up the target). An
    expected token is kept only where the draft's own choice equals it, so the chain is the one the draft
    alone would make; a wrong one costs the pass a little more (a 0.5B draft's pass over 2 / 3 / 4 tokens
    costs 1.03 / 1.14 / 1.21x one). Measured on AMD Zen 4 (teacher-forced on the target's greedy text):
    1.15 tokens of the draft's chain per unit of draft cost on code prompts, 1.7 on translation, 2.1 on
    RAG, 2.8 on summarization (1 without); expecting n tokens after an n-gram beat a fixed count."""

    __slots__ = ("index", "made", "units")

    def __init__(self):
        self.index = NgramIndex({n: {} for n in range(1, LOOKUP + 1)})  # the latest occurrence of each n-gram
        self.units = self.made = 0.0  # decayed sums: one-token draft passes spent, chain tokens they made

    def record(self, fed: int, made: int) -> None:
        """A draft pass fed ``fed`` tokens of this row and added ``made`` to its chain."""
        self.units = SHARE_DECAY * self.units + 1.0 + EXTRA_TOKEN * (fed - 1)
        self.made = SHARE_DECAY * self.made + made

    def share(self) -> float:
        """One-token draft passes per chain token lately (1 before any pass)."""
        return self.units / self.made if self.made > 0 else 1.0

    def expect(self, toks: list[int], chain: list[int], room: int) -> list[int]:
        """Up to ``room`` tokens expected after ``toks + chain`` (the committed tokens and the draft so far):
        the continuation of the longest n-gram of its end seen in ``toks``, as many tokens as that n."""
        self.index.update(toks)
        tail = (toks[-LOOKUP:] + chain)[-LOOKUP:]
        for n in range(len(tail), 0, -1):
            seen = self.index.last[n].get(tuple(tail[-n:]))
            if seen:
                e = seen[-1]
                return toks[e:e + min(n, room)]
        return []


def _without_replacement(q: torch.Tensor, taken: list[int], m: int, generator) -> list[int]:
    """m further draws from q without replacement, after ``taken`` (each from q without the earlier ones)."""
    out: list[int] = []
    rest = q.clone()
    rest[taken] = 0.0
    for _ in range(m):
        total = rest.sum()
        if total <= 0:
            break
        x = int(sample(rest / total, generator))
        out.append(x)
        rest[x] = 0.0
    return out


def check_compatible(target_tok, draft_tok, target_cfg, draft_cfg) -> None:
    """Draft and target must share the vocabulary (same token ids mean the same strings)."""
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise IncompatibleModelsError(
            f"draft and target have different vocabulary sizes ({draft_cfg.vocab_size} vs "
            f"{target_cfg.vocab_size}); a draft model must use the target's tokenizer")
    fast = getattr(target_tok, "fast", None)
    if fast is not None and fast is getattr(draft_tok, "fast", None):
        return  # one tokenizer, read from byte-identical files (tokenizer.py _rust_tokenizer)
    if target_tok.vocab_signature() != draft_tok.vocab_signature():
        raise IncompatibleModelsError("draft and target tokenizers differ (same size, different tokens); "
                                      "a draft model must use the target's tokenizer")


def _build(dw, rows: int, capacity: int, **opts):
    """The draft model's drafter; one with another tokenizer drafts through a vocabulary bridge."""
    if dw.bridge is not None:
        from .cross_vocab import CrossVocabDrafter

        return CrossVocabDrafter(dw.draft.model, dw.bridge, rows, capacity, **opts)
    return DraftModelDrafter(dw.draft.model, rows, capacity, prefix_cache=dw.prefix_cache(dw.draft.model), **opts)


register(Method("draft", _build, help="a smaller draft model (--draft) proposes tokens", draft_model=True,
                seq2seq=True, tree_variant=True))
