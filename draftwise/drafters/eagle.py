"""EAGLE: a one-layer head over the target's features drafts a token tree autoregressively
(draftwise/heads.py ``EagleHead``), EAGLE-2's dynamic tree by path confidence.

Per sequence (``seq.drafter_state``, so a sequence forks without touching the drafter): the head's own
key/value cache over the context's head positions, and the target's final hidden states not yet read by
the head. Head position j reads (f_j, x_{j+1}) — the target's state at j and the token after it — and
predicts f_{j+1}, whose logits draft x_{j+2}. With L tokens in the sequence the last head position with
true inputs is L-2 (f_{L-2} made x_{L-1}): it is the *root* query, whose prediction drafts x_L.

A step (``propose``):
1. catch up: one head forward over every head position not yet cached (the prompt after the prefill; the
   accepted tokens after a verification), the root last; their keys and values are kept (true context);
2. depth 1: the root's top ``branches`` tokens; depth d = 2..k: the ``branches`` depth-(d-1) nodes with
   the highest path probability are expanded in one head forward (each row sees the context, the rows
   that expanded its ancestors, and itself — what the head saw in training), and each gives its top
   ``branches`` children;
3. the ``k * branches`` nodes with the highest path probability over all depths form the tree (a node's
   path probability never exceeds its parent's, so the set is closed under ancestors), in depth order.
The tree's keys and values are dropped after the step; ``accept`` only queues the verified positions'
hidden states for the next catch-up. Drafts are deterministic given the state (q one-hot): lossless under
sampling as every one-hot drafter here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from ..heads import EagleHead
from ..sequence import Sequence
from .base import Draft, Needs, StatelessDrafter
from .registry import Method, register


@dataclass
class _EagleState:
    k: torch.Tensor  # (1, nh, capacity, hd) the head's keys over the context's head positions
    v: torch.Tensor
    first: int  # head position of cache slot 0 (0 when the prompt's hidden states were all given)
    n: int = 0  # cached head positions: first .. first+n-1
    pending: list[torch.Tensor] = field(default_factory=list)  # target states of positions first+n .. L-2

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        R = k.shape[2]
        if self.n + R > self.k.shape[2]:
            cap = max(2 * self.k.shape[2], self.n + R)
            self.k = torch.cat([self.k[:, :, :self.n], self.k.new_zeros(*self.k.shape[:2], cap - self.n, self.k.shape[3])], 2)
            self.v = torch.cat([self.v[:, :, :self.n], self.v.new_zeros(*self.v.shape[:2], cap - self.n, self.v.shape[3])], 2)
        self.k[:, :, self.n:self.n + R] = k
        self.v[:, :, self.n:self.n + R] = v
        self.n += R


class EagleDrafter(StatelessDrafter):
    name = "eagle"

    def __init__(self, head: EagleHead, embed, branches: int = 1):
        if not isinstance(branches, int) or branches < 1:
            raise InvalidParameterError(f"branches must be an integer >= 1, got {branches!r}")
        self.head, self.embed, self.branches = head, embed, branches
        # start() gets the target's state at every prompt position (the head's context), with the inner
        # layers the head reads (the decode loop gives them); its state is those states (auto starts it
        # with the others)
        self.needs = Needs(prompt_hidden=True, feature_taps=tuple(head.taps), state_from_target=True)

    def _split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(R, D * (1 + taps)) target states -> final features (R, D), taps (R, taps, D) or None."""
        D = self.head.cfg.hidden_size
        if not self.head.taps:
            return h[:, :D], None
        return h[:, :D], h[:, D:].reshape(h.shape[0], len(self.head.taps), D)

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        if hidden is None:
            raise InvalidParameterError("eagle heads need the target's hidden states (a native-backend target)")
        h = hidden.reshape(-1, hidden.shape[-1]).float()  # (P, D): positions L-1-P .. L-2
        first = len(seq.tokens) - 1 - h.shape[0]
        hh = self.head
        empty = torch.zeros(1, hh.nh, max(64, 2 * h.shape[0]), hh.hd)
        seq.drafter_state = _EagleState(empty, empty.clone(), first, 0, [h])

    def _emb(self, tokens: list[int]) -> torch.Tensor:
        return self.embed(torch.tensor(tokens, dtype=torch.long)).float()  # (R, D)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [self._tree(s, k) if k > 0 else Draft([]) for s, k in zip(seqs, ks)]

    def _tree(self, seq: Sequence, k: int) -> Draft:
        head, st, w = self.head, seq.drafter_state, self.branches
        L = len(seq.tokens)
        # 1. catch up: head positions first+n .. L-2 (true inputs), the root last
        j0 = st.first + st.n
        feat, taps = self._split(torch.cat(st.pending))  # (R, D), (R, taps, D) or None
        R = feat.shape[0]
        assert j0 + R == L - 1, (j0, R, L)
        g = head.inputs(feat, self._emb(seq.tokens[j0 + 1:L]), taps)[None]  # (1, R, D)
        q, kk, vv = head.qkv_rope(g, torch.arange(j0, L - 1)[None])
        S = st.n
        mask = torch.cat([torch.ones(R, S, dtype=torch.bool), torch.ones(R, R, dtype=torch.bool).tril()], 1)
        st.append(kk, vv)
        st.pending = []
        f = head.finish(g, q, st.k[:, :, :st.n], st.v[:, :, :st.n], mask)[0, -1:]  # (1, D) the root's prediction
        ctx_k, ctx_v = st.k[:, :, :st.n], st.v[:, :, :st.n]
        # 2. expand by path confidence; a node: (token, parent node, log path prob, depth, expanded row
        # that produced it or -1 for the root, that row's prediction)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        src_f: list[torch.Tensor] = []
        src_row: list[int] = []
        row_vis: list[list[int]] = []  # per expanded row: the expanded rows it sees (its ancestors', itself)
        ek: list[torch.Tensor] = []
        ev: list[torch.Tensor] = []

        def children(fs: torch.Tensor, parent_nodes: list[int], rows: list[int], depth: int) -> list[int]:
            logp = torch.log_softmax(head.logits(fs).float(), dim=-1)  # (r, Vd)
            top = logp.topk(min(w, logp.shape[-1]), dim=-1)
            ids = head.vocab[top.indices].tolist()
            lp = top.values.tolist()
            new = []
            for i, (pn, row) in enumerate(zip(parent_nodes, rows)):
                base = scores[pn] if pn >= 0 else 0.0
                for t, l in zip(ids[i], lp[i]):
                    new.append(len(tokens))
                    tokens.append(t)
                    parents.append(pn)
                    scores.append(base + l)
                    depths.append(depth)
                    src_row.append(row)
                    src_f.append(fs[i])
            return new

        frontier = children(f, [-1], [-1], 1)
        for d in range(2, k + 1):
            expand = sorted(frontier, key=lambda n: -scores[n])[:w]
            if not expand:
                break
            r = len(expand)
            base_row = len(row_vis)  # expanded rows so far
            vis_prev = [(row_vis[src_row[n]] if src_row[n] >= 0 else []) for n in expand]
            feat = torch.stack([src_f[n] for n in expand])  # (r, D)
            g = head.inputs(feat, self._emb([tokens[n] for n in expand]))[None]  # (1, r, D)
            pos = torch.full((1, r), L - 3 + d)  # depth-(d-1) nodes are expanded at head position L+d-3
            q, kk, vv = head.qkv_rope(g, pos)
            E = base_row
            m = torch.zeros(r, S + R + E + r, dtype=torch.bool)
            m[:, :S + R] = True
            for i, vis in enumerate(vis_prev):
                for row in vis:
                    m[i, S + R + row] = True
                m[i, S + R + E + i] = True
            keys = torch.cat([ctx_k, *ek, kk], 2) if ek else torch.cat([ctx_k, kk], 2)
            values = torch.cat([ctx_v, *ev, vv], 2) if ev else torch.cat([ctx_v, vv], 2)
            fs = head.finish(g, q, keys, values, m)[0]  # (r, D)
            ek.append(kk)
            ev.append(vv)
            for i in range(r):
                row_vis.append(vis_prev[i] + [base_row + i])
            frontier = children(fs, expand, list(range(base_row, base_row + r)), d)
        # 3. the best k*w nodes, in depth order (parents first), siblings best first
        keep = sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n]))[:k * w]
        keep.sort(key=lambda n: (depths[n], -scores[n]))
        new = {old: i for i, old in enumerate(keep)}
        return Draft([tokens[n] for n in keep], parents=[new[parents[n]] if parents[n] >= 0 else -1 for n in keep])

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        seq.drafter_state.pending.append(hidden.float())  # target positions n_before-1 .. n_before+a-1

    def release(self, seq: Sequence) -> None:
        seq.drafter_state = None


def _build(dw, rows: int, capacity: int, heads: str | None = None, branches: int | None = None,
           **opts) -> EagleDrafter:
    """``heads``: None = the target's default heads folder; ``branches``: None = the machine's width."""
    return EagleDrafter(dw.heads(heads, "eagle"), dw.target.model.embed, branches=branches or dw.head_width(),
                        **opts)


register(Method("eagle", _build, help="an EAGLE head trained on the target (draftwise train-head)", heads="eagle",
                width_option="branches", takes_heads=True))
