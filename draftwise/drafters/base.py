"""The drafter protocol. The decode loop drives every drafting method through these five methods and
knows nothing else about them.

- ``start(seq, *, hidden)``: a sequence was prefilled; set up its per-sequence state (``seq.drafter_state``).
  ``hidden`` (1, D) is the target's final hidden state at the last prompt token (draft heads read it);
  with ``needs.prompt_hidden`` it is (P, D), every prompt position's (eagle's context); with
  ``needs.feature_taps`` (decoder layer indices) those layers' outputs follow the final state,
  (.., D * (1 + len(feature_taps))), here and in ``accept`` (an EAGLE-3 head's fused features).
- ``propose(seqs, ks)``: a draft for each sequence, at most ``ks[i]`` tokens deep (fewer is fine, 0 is
  fine): a chain of tokens, or a token tree (``Draft.parents``) verified in the same single target pass.
- ``accept(seq, n_before, num_accepted, target_logits, *, path, hidden)``: the sequence grew from
  ``n_before`` tokens by ``num_accepted`` accepted drafts plus one target token; ``target_logits``
  (num_accepted+1, V) and ``hidden`` (num_accepted+1, D) are the target's scores and final hidden states
  at the verified positions, ``path`` the accepted nodes' indices in the draft (a chain: 0..n-1). Roll
  back / update the state here.
- ``release(seq)``: the sequence left the batch.
- ``move_row(src, dst)``: the engine compacted its batch; per-row resources follow (cache rows).

What a drafter reads beyond that it declares in ``needs`` (a ``Needs``; default ``NO_NEEDS``), and the
loop, the auto drafter and the server's wrapper act on the declaration, never on sniffed attributes:

- ``all_logits``: ``accept`` also gets ``draft`` (the draft as fed, after the loop cut it to depth and
  room) and ``all_logits`` (1 + len(draft.tokens), V): the target's scores after the root and after every
  node, accepted or not (drafters/lookahead.py iterates its Jacobi window on them).
- ``prompt_hidden``, ``feature_taps``: as in ``start`` above.
- ``target_cache``: the drafter drafts with the target's own layers (drafters/layerskip.py) and has
  ``bind_target_cache(cache)``, called once with the decoder's target KV cache when the ``Decoder`` is
  built. It may write only at or past each row's length, and must leave the lengths as it found them.
- ``state_from_target``: its per-sequence state is the target's states given at ``start`` (a draft head),
  so a wrapper that starts drafters lazily (auto) must start it at the prefill.

Per-sequence state lives on the sequence (``seq.drafter_state``), shared resources (a draft model) on the
drafter, so a sequence can be forked per branch without touching the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import InvalidParameterError
from ..sequence import Sequence


@dataclass
class Draft:
    """A chain of draft tokens, or a token tree.

    Tree: ``parents[i]`` is node i's parent, an earlier node or -1 for the sequence's last token (the
    root), so nodes are in topological order; siblings are tried in index order. A chain is the tree
    with ``parents = [-1, 0, 1, ...]`` (``parents=None`` says the same).

    ``probs[i]`` is the distribution q node i was drawn from (siblings: drawn without replacement from
    the same q), or ``probs=None`` for a deterministic drafter (q one-hot on each node's token).
    """

    tokens: list[int]  # proposed tokens, in order
    probs: torch.Tensor | None = None  # (len(tokens), V) draft distribution q; None = deterministic
    parents: list[int] | None = None  # None = a chain

    def __post_init__(self):
        if self.parents is not None:
            if len(self.parents) != len(self.tokens) or any(not -1 <= q < i for i, q in enumerate(self.parents)):
                raise ValueError("Draft.parents: one parent per token, each -1 or an earlier node")
            if self.parents == list(range(-1, len(self.tokens) - 1)):
                self.parents = None  # a chain

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def depths(self) -> list[int]:
        """Depth of each node (1 = a child of the root)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        d: list[int] = []
        for q in self.parents:
            d.append(1 if q < 0 else d[q] + 1)
        return d

    def truncated(self, max_nodes: int, max_depth: int) -> "Draft":
        """The nodes among the first ``max_nodes`` at most ``max_depth`` deep (still a tree: a node's
        ancestors are shallower and earlier)."""
        keep = [i for i, d in enumerate(self.depths()[:max_nodes]) if d <= max_depth]
        if len(keep) == len(self.tokens):
            return self
        new = {old: j for j, old in enumerate(keep)}
        parents = None if self.parents is None else [new.get(self.parents[i], -1) for i in keep]
        return Draft([self.tokens[i] for i in keep], None if self.probs is None else self.probs[keep], parents)

    def first_branch(self) -> "Draft":
        """The chain of first children from the root (for a target that cannot verify trees)."""
        if self.parents is None:
            return self
        chain, node = [], -1
        while True:
            kids = [i for i, q in enumerate(self.parents) if q == node]
            if not kids:
                break
            node = kids[0]
            chain.append(node)
        return Draft([self.tokens[i] for i in chain], None if self.probs is None else self.probs[chain])


def trie(branches: list[list[int]]) -> Draft:
    """One draft from candidate continuations (best first): a chain for one, else a tree sharing prefixes."""
    if len(branches) <= 1:
        return Draft(branches[0] if branches else [])
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for branch in branches:
        node = -1
        for t in branch:
            nxt = child.get((node, t))
            if nxt is None:
                nxt = child[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = nxt
    return Draft(tokens, parents=parents)


@dataclass(frozen=True)
class Needs:
    """What a drafter reads from the decode loop beyond the protocol (see the module docstring)."""

    all_logits: bool = False  # accept() also gets draft= and all_logits= (every fed node's target scores)
    prompt_hidden: bool = False  # start() gets every prompt position's state, (P, D), not the last one's
    feature_taps: tuple[int, ...] = ()  # the target's inner layers appended to every hidden state given
    target_cache: bool = False  # bind_target_cache(cache) is called once with the target's KV cache
    state_from_target: bool = False  # its state is the target's states at start (start it at the prefill)

    def __or__(self, other: "Needs") -> "Needs":
        """Both drafters' needs (a wrapper around several); their feature taps must agree."""
        if self.feature_taps and other.feature_taps and self.feature_taps != other.feature_taps:
            raise InvalidParameterError(f"drafters that read different inner layers of the target cannot be "
                                        f"combined: {self.feature_taps} and {other.feature_taps}")
        return Needs(self.all_logits or other.all_logits, self.prompt_hidden or other.prompt_hidden,
                     self.feature_taps or other.feature_taps, self.target_cache or other.target_cache,
                     self.state_from_target or other.state_from_target)


NO_NEEDS = Needs()


def needs_of(drafter) -> Needs:
    """A drafter's declared needs (``NO_NEEDS`` for none, or for a drafter that declares nothing)."""
    return NO_NEEDS if drafter is None else getattr(drafter, "needs", NO_NEEDS)


class Drafter(Protocol):
    name: str
    needs: Needs  # optional: NO_NEEDS when absent

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None: ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]: ...

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...


class StatelessDrafter:
    """Convenience base for drafters without per-sequence resources."""

    name = "base"
    needs = NO_NEEDS

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        pass

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass
