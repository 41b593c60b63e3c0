"""Draft heads trained on the target itself: Medusa heads (K heads on the target's last hidden state)
and an EAGLE-style head (one decoder layer over the target's features, autoregressive over its own).

**Medusa.** 
Head k (k = 1..K) reads the target's final hidden state h_t at the position that produced the sequence's
last token x_{t+1}, and predicts x_{t+1+k}:

    z_k = h_t + silu(W_k h_t + b_k)        a residual block per head, (D, D), zero-initialised
    logits_k = U z_k                        one output layer shared by all heads, over a *draft vocabulary*

U is the target's own LM head restricted to the ``vocab`` most frequent tokens (EAGLE-3's reduced draft
vocabulary: a 8-16k-row head instead of 49-152k keeps a drafted token at a few percent of a target
pass on a CPU). All K heads are one matmul over U, so U is read once per step.

**EAGLE-style** (``EagleHead``, EAGLE-1/2/3 after Li et al.). Head position j reads the target's final
hidden state f_j (the state that produced token x_{j+1}) and the embedding of x_{j+1}, and predicts the
target's next feature f_{j+1}, from which ``U`` gives the draft of x_{j+2}:

    g_j = W_fc [norm(f_j); norm(e(x_{j+1}))]        (2D -> D)
          + W_fuse [norm(l_j); norm(m_j)]           at true positions, when the head taps the target's
                                                    low and middle layers' outputs l_j, m_j (EAGLE-3)
    u_j = g_j + Attn(norm(g_j))                      causal over the head's own earlier positions, RoPE
    f^_{j+1} = u_j + MLP(norm(u_j))                  SwiGLU, a smaller intermediate size than the target's
    logits = U f^_{j+1}                              U as for Medusa (the reduced draft vocabulary)

It drafts autoregressively over its own features: depth 2 reads (f^_{j+1}, its depth-1 token), and so on;
the attention sees the true features of the context (cached per sequence) and the drafted path's own.
Trained with EAGLE-3's "training-time test": pass p feeds pass p-1's predicted features, attending to the
true positions before it and to its own path, so depth p sees at training what it sees drafting.
A tree grows EAGLE-2 style: each depth expands the ``branches`` most confident nodes (cumulative path
probability), and the best nodes overall are kept (``drafters/eagle.py``).

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

from .digest import sha256_file
from .errors import IncompatibleModelsError, InvalidParameterError, ModelNotFoundError

CONFIG, WEIGHTS = "config.json", "heads.safetensors"


@dataclass
class HeadConfig:
    kind: str  # "medusa" | "eagle"
    num_heads: int  # medusa: heads; eagle: depths trained (training-time-test passes)
    hidden_size: int
    vocab: list[int]  # draft vocabulary: target token ids, row order of the output layer
    target: str  # the target's name or path when trained
    target_sha256: str  # of the target's weight file
    trained: dict = field(default_factory=dict)  # corpus, positions, steps, minutes, held-out accuracy
    arch: dict = field(default_factory=dict)  # eagle: attn_heads, head_dim, intermediate, rope_theta, rms_eps


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

    # ---- inference: the matrices through the kernel, int8 (drafting_linear) -------------------------
    def for_inference(self) -> "MedusaHeads":
        from .kernels import extension

        self.requires_grad_(False)
        if extension() is not None and self.cfg.hidden_size % 16 == 0:
            self.out = drafting_linear(self.out.weight.detach())
            self.blocks = nn.ModuleList(drafting_linear(b.weight.detach(), b.bias.detach()) for b in self.blocks)
        return self.eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def eagle_arch(hidden_size: int, head_dim: int, rope_theta: float, rms_eps: float,
               intermediate: int | None = None, taps: tuple[int, ...] = ()) -> dict:
    """The head's shape for a target: the target's head_dim and RoPE, an MLP twice the hidden size (the
    target's is ~4-6x) so that a drafted token costs a few percent of a target pass; ``taps``: the target's
    decoder layers whose outputs it also reads (EAGLE-3's fused low/mid-level features), none by default."""
    return {"attn_heads": max(1, hidden_size // head_dim), "head_dim": head_dim,
            "intermediate": intermediate or 2 * hidden_size, "rope_theta": rope_theta, "rms_eps": rms_eps,
            "taps": list(taps)}


class EagleHead(nn.Module):
    """EAGLE-style draft head: one decoder layer over (target feature, next token's embedding); see the
    module docstring. Plain module, explicit cache: ``layer`` takes the cached keys/values and a mask."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        from .models.transformer import Rotary

        self.cfg = cfg
        a = cfg.arch
        D = cfg.hidden_size
        self.nh, self.hd, self.ffn, self.eps = a["attn_heads"], a["head_dim"], a["intermediate"], a["rms_eps"]
        self.norm_f = nn.Parameter(torch.ones(D))
        self.norm_e = nn.Parameter(torch.ones(D))
        self.attn_norm = nn.Parameter(torch.ones(D))
        self.mlp_norm = nn.Parameter(torch.ones(D))
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.taps = tuple(a.get("taps", ()))  # target layers read at true positions (EAGLE-3 feature fusion)
        if self.taps:
            self.norm_t = nn.Parameter(torch.ones(len(self.taps), D))
            self.fuse = nn.Linear(len(self.taps) * D, D, bias=False)
            nn.init.zeros_(self.fuse.weight)  # starts as the head without them
        self.qkv = nn.Linear(D, 3 * self.nh * self.hd, bias=False)
        self.o = nn.Linear(self.nh * self.hd, D, bias=False)
        self.gate_up = nn.Linear(D, 2 * self.ffn, bias=False)
        self.down = nn.Linear(self.ffn, D, bias=False)
        # starts as the identity on the feature (f^_{j+1} = f_j, Medusa's starting point: the target's own
        # head then predicts x_{j+1}); training learns the step forward. Small random weights on the
        # embedding half, zero attention and MLP outputs
        with torch.no_grad():
            self.fc.weight[:, D:].mul_(0.1)
            self.fc.weight[:, :D].copy_(torch.eye(D))
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)
        self.out = nn.Linear(D, len(cfg.vocab), bias=False)
        self.register_buffer("vocab", torch.tensor(cfg.vocab, dtype=torch.long), persistent=False)
        self.rotary = Rotary(self.hd, a["rope_theta"])

    def inputs(self, feat: torch.Tensor, emb: torch.Tensor, taps: torch.Tensor | None = None) -> torch.Tensor:
        """feat, emb: (..., R, D), taps: (..., R, len(self.taps), D) the target's lower layers' outputs at
        true positions, None at drafted ones -> g (..., R, D), the layer's input."""
        g = self.fc(torch.cat([_rms(feat, self.norm_f, self.eps), _rms(emb, self.norm_e, self.eps)], -1))
        if taps is not None and self.taps:
            g = g + self.fuse(_rms(taps, self.norm_t, self.eps).flatten(-2))
        return g

    def qkv_rope(self, g: torch.Tensor, positions: torch.Tensor):
        """g: (B, R, D), positions: (B, R) -> q, k, v each (B, nh, R, hd), q and k rotated."""
        B, R, _ = g.shape
        q, k, v = (t.view(B, R, self.nh, self.hd).transpose(1, 2)
                   for t in self.qkv(_rms(g, self.attn_norm, self.eps)).chunk(3, dim=-1))
        cos, sin = (t.unsqueeze(1) for t in self.rotary.tables(positions, torch.float32))  # (B, 1, R, hd)
        h = self.hd // 2
        rot = lambda x: torch.cat([-x[..., h:], x[..., :h]], dim=-1)  # noqa: E731
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin, v

    def finish(self, g: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """The attention over ``keys`` (B, nh, S, hd) under ``mask`` (R, S) or (B, R, S) bool, then the MLP:
        -> the predicted next features (B, R, D)."""
        B, _, R, _ = q.shape
        scores = torch.matmul(q, keys.transpose(-1, -2)) * (self.hd ** -0.5)  # (B, nh, R, S)
        scores = scores.masked_fill(~(mask if mask.dim() == 3 else mask[None]).unsqueeze(1), float("-inf"))
        att = torch.matmul(torch.softmax(scores, dim=-1), values)  # (B, nh, R, hd)
        u = g + self.o(att.transpose(1, 2).reshape(B, R, self.nh * self.hd))
        gate, up = self.gate_up(_rms(u, self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return u + self.down(F.silu(gate) * up)

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """(..., D) predicted features -> (..., Vd) draft-vocabulary logits."""
        return self.out(f)

    def train_passes(self, feat: torch.Tensor, emb: torch.Tensor, passes: int,
                     taps: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test over whole sequences. feat: (B, C, D) the target's features f_j, emb: (B, C, D)
        embeddings of x_{j+1}, taps (B, C, len(self.taps), D) or None. Pass p (1-based) at position j reads
        pass p-1's prediction made at j-1 (pass 1: the true f_j and the taps) and attends to the true
        positions <= j-p+1 and to its own path (pass q's row at j-p+q): what depth p sees when drafting.
        Returns each pass's predictions of f_{j+1} (B, C, D); pass p is meaningful at j >= p-1."""
        B, C, D = feat.shape
        pos = torch.arange(C).expand(B, C)
        j = torch.arange(C)[:, None]
        k = torch.arange(C)[None, :]
        outs, ks, vs, x = [], [], [], feat
        for p in range(1, passes + 1):
            g = self.inputs(x, emb, taps if p == 1 else None)
            q, kk, vv = self.qkv_rope(g, pos)
            ks.append(kk)
            vs.append(vv)
            blocks = [k <= j - p + 1] + [k == j - p + qq for qq in range(2, p + 1)]  # (C, C) each
            f = self.finish(g, q, torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(blocks, 1))
            outs.append(f)
            x = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], 1)
        return outs

    def for_inference(self) -> "EagleHead":
        from .kernels import extension

        self.requires_grad_(False)
        if extension() is not None and self.cfg.hidden_size % 16 == 0 and self.ffn % 16 == 0:
            for name in ("fc", "qkv", "o", "gate_up", "down", "out") + (("fuse",) if self.taps else ()):
                setattr(self, name, drafting_linear(getattr(self, name).weight.detach()))
        return self.eval()


def drafting_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A head's (N, K) matrix for drafting, through the kernel: int8 in groups of 32 (round to nearest),
    half the bytes of bf16 and the integer path of the kernel (a drafted token is read from the head's
    weights on every step; drafts need no bit-exactness, the target verifies them); bf16 where K does not
    split into groups."""
    from .kernels import QLinear, quantize_rtn

    if weight.shape[1] % 32 == 0:
        q, scale, _ = quantize_rtn(weight.float(), 8, 32)
        return QLinear(q, scale, None, 32, 8, bias)
    return QLinear.dense(weight.to(torch.bfloat16), bias)


@torch.inference_mode()
def draft_seconds(drafter, context: int = 64, repeats: int = 5) -> float:
    """Seconds a head drafter spends per drafted token on this machine (the median of ``repeats`` timings
    of one head forward over a ``context``-position cache, its output layer included): the price the
    ``auto`` drafter puts on asking it for a token."""
    import time

    head = getattr(drafter, "head", None) or drafter.heads
    D = head.cfg.hidden_size
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if isinstance(head, EagleHead):
            g = head.inputs(torch.zeros(1, 1, D), torch.zeros(1, 1, D))
            q, k, v = head.qkv_rope(g, torch.tensor([[context]]))
            keys = torch.cat([torch.zeros(1, head.nh, context, head.hd), k], 2)
            f = head.finish(g, q, keys, torch.cat([torch.zeros_like(keys[:, :, :context]), v], 2),
                            torch.ones(1, context + 1, dtype=torch.bool))
            head.logits(f)
        else:  # all K Medusa heads come from one forward: a drafted token costs 1/K of it
            head(torch.zeros(1, D))
        times.append(time.perf_counter() - t0)
    per = sorted(times)[len(times) // 2]
    return per if isinstance(head, EagleHead) else per / head.cfg.num_heads


def new_head(cfg: HeadConfig) -> nn.Module:
    return EagleHead(cfg) if cfg.kind == "eagle" else MedusaHeads(cfg)


def file_sha256(path: Path) -> str:
    """sha256 of a weight file (the registry's ``.sha256`` sidecar when there is one)."""
    side = path.with_name(path.name + ".sha256")
    if side.is_file():
        return side.read_text().split()[0]
    return sha256_file(path)


def target_identity(src: Path | str) -> str:
    """What a head file names as its target: the weight file's sha256 (a folder: of its safetensors)."""
    p = Path(src)
    if p.is_file():
        return file_sha256(p)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        return f"name:{src}"
    return hashlib.sha256("".join(file_sha256(f) for f in files).encode()).hexdigest()


def save_heads(heads: nn.Module, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().contiguous() for k, v in heads.state_dict().items()}
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp))
    tmp.replace(folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps(asdict(heads.cfg), indent=1))


def default_heads_dir(src: Path | str, sha: str, kind: str) -> Path:
    """Where ``train-head`` writes, and ``--method medusa|eagle`` looks, when no folder is given:
    ``$DRAFTWISE_HOME/heads/<weight file's stem>-<sha256[:8]>-<kind>`` (one per target file, whatever name
    or path the target was given by)."""
    import re

    from .models.registry import draftwise_home

    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(src).rstrip("/")).stem) or "target"
    return draftwise_home() / "heads" / f"{stem}-{sha.removeprefix('name:')[:8]}-{kind}"


def resolve_heads(spec: str | None, kind: str, src: Path | str, sha: str, target: str = "") -> Path:
    """The folder of ``kind`` heads: among ``spec`` (see pick_heads) or, without one, the target's default
    folder (default_heads_dir), with a clear error saying how to train them when there is none."""
    if spec:
        return pick_heads(spec, kind)
    folder = default_heads_dir(src, sha, kind)
    if not (folder / CONFIG).is_file():
        raise ModelNotFoundError(
            f"method {kind!r} needs draft heads and none were trained for this target yet: run `draftwise "
            f"train-head --kind {kind}{' --target ' + target if target else ''}` (it writes {folder}), "
            f"or pass --heads DIR")
    return folder


def pick_heads(spec: str, kind: str) -> Path:
    """The folder of ``kind`` heads among ``spec`` (one folder, or several separated by commas: ``--heads
    heads/medusa,heads/eagle`` serves both methods in one bench run)."""
    folders = [Path(f) for f in str(spec).split(",") if f.strip()]
    kinds = {}
    for f in folders:
        if not (f / CONFIG).is_file():
            raise ModelNotFoundError(f"no draft heads in {str(f)!r} (expected {CONFIG} and {WEIGHTS}; "
                                     f"train them with `draftwise train-head`)")
        kinds[f] = json.loads((f / CONFIG).read_text()).get("kind", "medusa")
    match = [f for f in folders if kinds[f] == kind]
    if not match:
        have = ", ".join(f"{str(f)!r} ({k})" for f, k in kinds.items())
        raise InvalidParameterError(f"method {kind!r} needs {kind} heads; --heads has {have or 'none'} "
                                    f"(train them with `draftwise train-head --kind {kind}`)")
    return match[0]


def load_heads(folder: Path | str, target_sha256: str | None = None) -> nn.Module:
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
    heads = new_head(cfg)
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
