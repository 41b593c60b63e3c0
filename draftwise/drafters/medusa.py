"""Medusa: K heads on the target's last hidden state draft a token tree (draftwise/heads.py).

Per sequence the state is the target's final hidden state at the position that produced its last token
(from the prefill, then from each verification: the last accepted node's row). A step runs all heads of
all rows in one call, takes each head's top ``branches`` tokens and grows a tree best first by path
confidence (``heads.best_first_tree``), at most ``k`` deep and ``k * branches`` nodes. Drafts are
deterministic given the state (q one-hot): lossless under sampling as every one-hot drafter here.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from ..heads import MedusaHeads, best_first_tree
from ..sequence import Sequence
from .base import Draft, Needs, StatelessDrafter
from .registry import Method, register


class MedusaDrafter(StatelessDrafter):
    name = "medusa"
    needs = Needs(state_from_target=True)  # its state is the target's hidden state (auto starts it with the others)

    def __init__(self, heads: MedusaHeads, branches: int = 3):
        if not isinstance(branches, int) or branches < 1:
            raise InvalidParameterError(f"branches must be an integer >= 1, got {branches!r}")
        self.heads, self.branches = heads, branches

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        if hidden is None:
            raise InvalidParameterError("medusa heads need the target's hidden states (a native-backend target)")
        D = self.heads.cfg.hidden_size  # the final state (beside it, inner layers another drafter reads)
        seq.drafter_state = hidden.reshape(-1, hidden.shape[-1])[-1:, :D].float()

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        h = torch.cat([s.drafter_state for s in seqs])  # (B, D)
        logits = self.heads(h)  # (K, B, Vd)
        w = min(self.branches, logits.shape[-1])
        top = torch.softmax(logits.float(), dim=-1).topk(w, dim=-1)  # (K, B, w)
        ids = self.heads.vocab[top.indices]  # draft vocabulary -> target token ids
        out = []
        for i, k in enumerate(ks):
            tokens, parents = best_first_tree(top.values[:, i], ids[:, i], k * w, k)
            out.append(Draft(tokens, parents=parents))
        return out

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        seq.drafter_state = hidden[-1:, :self.heads.cfg.hidden_size].float()  # the row that produced the last token


def _build(dw, rows: int, capacity: int, heads: str | None = None, branches: int | None = None,
           **opts) -> MedusaDrafter:
    """``heads``: None = the target's default heads folder; ``branches``: None = the machine's width."""
    return MedusaDrafter(dw.heads(heads, "medusa"), branches=branches or dw.head_width(), **opts)


register(Method("medusa", _build, help="Medusa heads trained on the target (draftwise train-head)", heads="medusa",
                width_option="branches", takes_heads=True))
