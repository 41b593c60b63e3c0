"""Draft heads trained on the target itself: Medusa heads (K heads on the target's last hidden state).

Head k (k = 1..K) reads the target's final hidden state h_t at the position that produced the sequence's
last token x_{t+1}, and predicts x_{t+1+k}:

    z_k = h_t + silu(W_k h_t + b_k)        a residual block per head, (D, D), zero-initialised
    logits_k = U z_k                        one output layer shared by all heads, over a *draft vocabulary*

U is the target's own LM head restricted to the ``vocab`` most frequent tokens (EAGLE-3's reduced draft
vocabulary: a 8-16k-row head instead of 49-152k keeps a drafted token at a few percent of a target
pass on a CPU). All K heads are one matmul over U, so U is read once per step.

Files: ``DIR/heads.safetensors`` (never pickle) + ``DIR/config.json`` naming the target they fit (its
file's sha256); loading heads for another target is an ``IncompatibleModelsError``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import IncompatibleModelsError, ModelNotFoundError

CONFIG, WEIGHTS = "config.json", "heads.safetensors"


@dataclass
class HeadConfig:
    kind: str  # "medusa"
    num_heads: int
    hidden_size: int
    vocab: list[int]  # draft vocabulary: target token ids, row order of the output layer
    target: str  # the target's name or path when trained
    target_sha256: str  # of the target's weight file
    trained: dict = field(default_factory=dict)  # corpus, positions, steps, minutes, held-out accuracy


class MedusaHeads(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        D, K = cfg.hidden_size, cfg.num_heads
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(K))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        self.out = nn.Linear(D, len(cfg.vocab), bias=False)
        self.register_buffer("vocab", torch.tensor(cfg.vocab, dtype=torch.long), persistent=False)

    def features(self, h: torch.Tensor) -> torch.Tensor:
        # h: (N, D) -> (K, N, D)
        return torch.stack([h + F.silu(b(h)) for b in self.blocks])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (N, D) target hidden states -> (K, N, Vd) draft-vocabulary logits."""
        return self.out(self.features(h))

    # ---- inference: the output layer through the batch-invariant kernel, bf16 ------------------------
    def for_inference(self) -> "MedusaHeads":
        from .kernels import QLinear, extension

        self.requires_grad_(False)
        if extension() is not None and self.cfg.hidden_size % 16 == 0:
            self.out = QLinear.dense(self.out.weight.detach().to(torch.bfloat16))
            self.blocks = nn.ModuleList(QLinear.dense(b.weight.detach().to(torch.bfloat16), b.bias.detach())
                                        for b in self.blocks)
        return self.eval()


def file_sha256(path: Path) -> str:
    """sha256 of a weight file (the registry's ``.sha256`` sidecar when there is one)."""
    side = path.with_name(path.name + ".sha256")
    if side.is_file():
        return side.read_text().split()[0]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def target_identity(src: Path | str) -> str:
    """What a head file names as its target: the weight file's sha256 (a folder: of its safetensors)."""
    p = Path(src)
    if p.is_file():
        return file_sha256(p)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        return f"name:{src}"
    return hashlib.sha256("".join(file_sha256(f) for f in files).encode()).hexdigest()


def save_heads(heads: MedusaHeads, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().contiguous() for k, v in heads.state_dict().items()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp))
    tmp.replace(folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps(asdict(heads.cfg), indent=1))


def load_heads(folder: Path | str, target_sha256: str | None = None) -> MedusaHeads:
    """Heads from ``folder``; ``target_sha256`` (the loaded target's) must match the one they were trained on."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ModelNotFoundError(f"no draft heads in {str(folder)!r} (expected {CONFIG} and {WEIGHTS}; "
                                 f"train them with `draftwise train-head`)")
    cfg = HeadConfig(**json.loads((folder / CONFIG).read_text()))
    if target_sha256 is not None and cfg.target_sha256 != target_sha256:
        raise IncompatibleModelsError(
            f"the heads in {str(folder)!r} were trained for another target ({cfg.target}, sha256 "
            f"{cfg.target_sha256[:12]}...), not this one (sha256 {target_sha256[:12]}...); train heads for it "
            f"with `draftwise train-head --target ...`")
    heads = MedusaHeads(cfg)
    heads.load_state_dict(load_file(str(folder / WEIGHTS)))
    return heads


def best_first_tree(probs: torch.Tensor, ids: torch.Tensor, max_nodes: int, max_depth: int
                    ) -> tuple[list[int], list[int]]:
    """A token tree from per-depth candidates whose scores do not depend on the parent (Medusa heads):
    probs, ids: (depth, w) the top-w of each depth, best first. Nodes are added best first by their
    path's product of probabilities (EAGLE-2's confidence expansion), ``max_nodes`` at most, so the
    tree grows where the heads are sure. Returns (tokens, parents) in topological order."""
    depth = min(max_depth, probs.shape[0])
    w = probs.shape[1]
    if depth == 0 or max_nodes <= 0:
        return [], []
    p, t = probs[:depth].tolist(), ids[:depth].tolist()
    tokens: list[int] = []
    parents: list[int] = []
    heap = [(-p[0][0], 0, 0, -1, 1.0)]  # (-score, depth, rank, parent node, parent score)
    while heap and len(tokens) < max_nodes:
        neg, d, r, parent, base = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(t[d][r])
        parents.append(parent)
        if r + 1 < w:  # the next sibling
            heapq.heappush(heap, (-base * p[d][r + 1], d, r + 1, parent, base))
        if d + 1 < depth:  # the first child
            heapq.heappush(heap, (neg * p[d + 1][0], d + 1, 0, node, -neg))
    return tokens, parents
