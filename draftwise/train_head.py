"""``draftwise train-head``: train draft heads on the target itself, on this CPU, from an offline corpus.

Self-distillation in two phases within ``--minutes``:

1. **Features** (up to FEATURE_SHARE of the budget), in records of CHUNK tokens: at every position the target's final
   hidden state h_t, the outputs of a low and a middle decoder layer (``selfgen.feature_taps``), its own
   greedy next token a_t (what it would write there) and its top-8 distribution are recorded, with the
   token. Labels are the target's predictions, never a corpus text, so the heads learn the target. Two
   sources (``--corpus``, repeatable; the budget is shared equally):
   - ``self`` (the default): the target *writes* the corpus — batched greedy answers to prompts built from
     offline material (selfgen.py), prompt positions included; the distribution it drafts on.
   - a text file or folder: the target *reads* it in chunks (SmolLM2 on Zen 3: 2.2x as many
     positions per second as writing), but text the target would not write.
2. **Training** (cross-entropy over the draft vocabulary — the most frequent target predictions — half on
   the greedy token, half on the target's top-8 distribution), AdamW with a warm-up and a cosine decay
   over the time left, with checkpoints every minute; held-out top-1 accuracy per head (medusa) or per
   drafted depth (eagle) is written into the head's config.
   - ``--kind medusa``: head k learns a_{t+k} from h_t.
   - ``--kind eagle``: over whole chunks, the layer learns f_{t+1} (smooth L1) and a_{t+1} from (f_t,
     x_{t+1}) and the tapped layers at t (EAGLE-3's fused features; ``--no-fuse``: f_t alone), at
     ``--num-heads`` depths by EAGLE-3's training-time test (heads.py).

Resumable: the features are saved in ``OUT/features.safetensors`` and the heads at each checkpoint; a
second run with the same ``--out`` continues from both.

The corpus must exist offline and must not be the benchmark: the self-written answers' prompts come from
the Python standard library's sources and the text files installed packages ship (selfgen.py); Spec-Bench
prompts are refused (``--corpus`` pointing into a ``spec_bench`` folder is an error).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import InvalidParameterError
from .heads import HeadConfig, default_heads_dir, eagle_arch, load_heads, new_head, save_heads, target_identity
from .selfgen import SOFT_K, feature_taps, soft_labels

KINDS = ("medusa", "eagle")
FEATURES = "features.safetensors"
CHUNK = 256  # tokens per record (a target forward over text; a prompt + answer when self-generated)
# features are what the heads lack: on SmolLM2's own answers (42k positions) the EAGLE head's held-out
# accuracy stops rising after ~400 steps while its training accuracy climbs to 0.70 (held-out 0.37), and
# neither feature noise nor weight decay helped; so two thirds of the budget go to collecting them
FEATURE_SHARE = 2 / 3
SELF = "self"  # --corpus self: the target writes its own corpus (selfgen.py)
STDLIB = "stdlib"  # --corpus stdlib: the target reads the Python stdlib's sources and the packages' docs


def default_corpus() -> list[Path]:
    """Offline text that every machine with Python has: stdlib sources, then packages' docs."""
    from .selfgen import package_docs, stdlib_sources

    return stdlib_sources() + package_docs(200)


def corpus_files(spec: list[str] | None) -> list[Path]:
    """The text files of the text entries of ``--corpus`` ("stdlib": the Python standard library and the
    packages' docs; a file or folder), [] when there are none."""
    spec = [s for s in spec or [] if s != SELF]
    if not spec:
        return []
    out: list[Path] = []
    for s in spec:
        if s == STDLIB:
            out += default_corpus()
            continue
        p = Path(s)
        if "spec_bench" in p.resolve().as_posix():
            raise InvalidParameterError(f"{s!r} is the benchmark (Spec-Bench): heads are never trained on it")
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (".py", ".md", ".txt", ".rst"))
        elif p.is_file():
            out.append(p)
        else:
            raise InvalidParameterError(f"corpus path {s!r} does not exist")
    if not out:
        raise InvalidParameterError("the corpus has no text files")
    return out


def _chunks(files: list[Path], tokenizer, seed: int = 0):
    """Token chunks of CHUNK tokens from the corpus files, in a fixed shuffled order."""
    files = list(files)
    random.Random(seed).shuffle(files)
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        ids = tokenizer.encode(text)
        for i in range(0, len(ids) - 32, CHUNK):
            yield ids[i:i + CHUNK]


@torch.inference_mode()
def collect_features(model, tokenizer, files: list[Path], seconds: float, max_positions: int, progress=None,
                     batch: int = 8) -> dict[str, torch.Tensor]:
    """Features of full corpus chunks of CHUNK tokens, ``batch`` chunks per target forward, within
    ``seconds`` (text read: every position valid); the keys of ``selfgen.generate_features``."""
    from .kernels import fp32_gemm

    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden", "labels", "tokens", "taps", "soft_ids",
                                                             "soft_logp")}
    n, t0 = 0, time.perf_counter()
    cache = model.new_cache(batch, CHUNK)
    taps = feature_taps(model.config.num_layers)
    chunks = (c for c in _chunks(files, tokenizer) if len(c) == CHUNK)
    while time.perf_counter() - t0 < seconds and n < max_positions:
        group = [c for _, c in zip(range(batch), chunks)]
        if not group:
            break
        view = cache.view(slice(0, len(group)))
        view.reset()
        with fp32_gemm():  # features need no bit-exactness: the fastest GEMM this CPU has
            out = model.forward(torch.tensor(group), view, logits_for="all", taps=taps)  # (b, CHUNK, V)
        D = out.hidden.shape[-1]
        ids, logp = soft_labels(out.logits.reshape(-1, out.logits.shape[-1]))
        for key, t in (("hidden", out.hidden.reshape(-1, D).to(torch.bfloat16)),
                       ("labels", out.logits.argmax(-1).reshape(-1)), ("tokens", torch.tensor(group).reshape(-1)),
                       ("taps", out.taps.reshape(-1, len(taps), D).to(torch.bfloat16)), ("soft_ids", ids),
                       ("soft_logp", logp)):
            parts[key].append(t)
        n += len(group) * CHUNK
        if progress is not None:
            progress(n, time.perf_counter() - t0)
    if not parts["hidden"]:
        raise InvalidParameterError(f"no features collected: the corpus has no text of {CHUNK} tokens, or the "
                                    "budget is too small")
    f = {k: torch.cat(v) for k, v in parts.items()}
    f["valid"] = torch.ones_like(f["labels"], dtype=torch.bool)
    return f


def gather_features(model, tokenizer, corpus: list[str], seconds: float, max_positions: int, prog=None,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Features from every source in ``corpus`` ("self" and/or text paths; the time and position budgets
    shared equally), as records of CHUNK positions shuffled together: the keys of
    ``selfgen.generate_features`` (hidden (N, D) bf16, labels (N,) the target's greedy next token or -1,
    tokens (N,), valid (N,) bool, taps, soft_ids, soft_logp)."""
    from .selfgen import generate_features

    texts = [c for c in corpus if c != SELF]
    sources = ([SELF] if SELF in corpus else []) + (["text"] if texts else [])
    parts = []
    for src in sources:
        task = prog.add_task(f"features ({'self-written' if src == SELF else 'text'})", total=seconds / len(sources),
                             info="") if prog is not None else None

        def progress(n, s, task=task):
            if prog is not None:
                prog.update(task, completed=s, info=f"{n} positions, {n / max(s, 1e-9):.0f}/s")

        if src == SELF:
            f = generate_features(model, tokenizer, seconds / len(sources), max_positions // len(sources),
                                  record=CHUNK, seed=seed, progress=progress)
        else:
            f = collect_features(model, tokenizer, corpus_files(texts), seconds / len(sources),
                                 max_positions // len(sources), progress)
        if prog is not None:
            prog.update(task, completed=seconds / len(sources))
        parts.append(f)
    f = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    order = torch.randperm(f["hidden"].shape[0] // CHUNK, generator=torch.Generator().manual_seed(seed))
    pos = (order[:, None] * CHUNK + torch.arange(CHUNK)).reshape(-1)  # whole records, shuffled
    return {k: v[pos].contiguous() for k, v in f.items()}


WARMUP = 20  # steps of linear warm-up
FUSE = True  # eagle heads read the target's low and middle layers too (EAGLE-3's fused features)
SOFT = 0.5  # weight of the target's top-k distribution in the token loss (the rest: its greedy token)


def lr_factor(step: int, frac: float) -> float:
    """The learning rate's factor at ``step`` (since this run started) and ``frac`` of the training time
    spent: a linear warm-up, then a cosine from 1 down to 0.1 at the end of the budget."""
    return min(1.0, (step + 1) / WARMUP) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0))))


def soft_targets(f: dict[str, torch.Tensor], to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's recorded top-k next tokens as draft-vocabulary ids (N, k) (0 where outside it) and their
    probabilities renormalised over the ones inside it (N, k) (all 0 where none is)."""
    ids = f["soft_ids"].long()
    d = torch.where(ids >= 0, to_draft[ids.clamp_min(0)], torch.full_like(ids, -1))
    p = torch.where(d >= 0, f["soft_logp"].float().exp(), torch.zeros(()))
    return d.clamp_min(0), p / p.sum(-1, keepdim=True).clamp_min(1e-12)


def token_loss(logits: torch.Tensor, y: torch.Tensor, soft_ids: torch.Tensor | None, soft_p: torch.Tensor | None,
               soft: float) -> torch.Tensor:
    """logits (N, Vd); y (N,) draft id of the target's greedy token or -1; soft_ids, soft_p (N, k): its
    top-k distribution over the draft vocabulary. (1 - soft) * CE(greedy) + soft * CE(top-k distribution)."""
    hard = F.cross_entropy(logits, y, ignore_index=-1)
    if not soft or soft_ids is None:
        return hard
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, soft_ids)  # (N, k)
    m = (y >= 0).float()
    cross = -(soft_p * logq).sum(-1)
    return (1 - soft) * hard + soft * (cross * m).sum() / m.sum().clamp_min(1.0)


def head_targets(labels: torch.Tensor, chunk_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(K, N) label of head k at position t: the target's greedy token a_{t+k}, or -1 past its chunk."""
    N = labels.shape[0]
    out = torch.full((num_heads, N), -1, dtype=torch.long)
    for k in range(1, num_heads + 1):
        same = chunk_ids[k:] == chunk_ids[:-k]
        out[k - 1, :-k] = torch.where(same, labels[k:], torch.full_like(labels[k:], -1))
    return out


def output_rows(lm_head, rows: torch.Tensor) -> torch.Tensor:
    """The target LM head's weights for the draft vocabulary: (Vd, D) float32, de-quantized if need be."""
    from .kernels import KQ_BITS, QLinear, dequantize, extension, kq_shape

    if isinstance(lm_head, QLinear) and lm_head.bits in KQ_BITS:  # the K-quant code: rows de-quantized in C++
        V, D = kq_shape(lm_head.q, lm_head.bits)
        return extension().kq_rows(lm_head.q.view(-1), lm_head.bits, V, D, rows.long())
    if isinstance(lm_head, QLinear):
        minv = lm_head.minv[rows] if lm_head.minv.numel() else None
        return dequantize(lm_head.q[rows], lm_head.scale[rows], minv, lm_head.group, lm_head.bits)
    return lm_head.weight[rows].float()


def train_heads(model, tokenizer, *, kind: str = "medusa", target_name: str, target_sha: str, out: Path,
                minutes: float, corpus: list[str] | None = None, num_heads: int = 3, vocab_size: int = 8192,
                batch: int | None = None, lr: float | None = None, max_positions: int = 400_000,
                fuse: bool = FUSE, soft: float = SOFT, log=print, bar=True):
    """Collect features from ``corpus`` (``--corpus`` entries: "self" and/or text paths; default "self"),
    or reuse OUT/features.safetensors, then train the heads (``kind`` medusa: K heads; eagle: one layer,
    ``num_heads`` training-time-test depths) for the rest of ``minutes``; checkpoints in ``out``. ``fuse``
    (eagle): the head also reads the target's low and middle layers (EAGLE-3); ``soft``: the weight of the
    target's top-k distribution beside its greedy token in the token loss. The learning rate warms up and
    decays by a cosine over the training time. Returns the trained heads."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    if kind not in KINDS:
        raise InvalidParameterError(f"unknown head kind {kind!r}; choose one of {', '.join(KINDS)}")
    if minutes <= 0:
        raise InvalidParameterError(f"--minutes must be > 0, got {minutes}")
    eagle = kind == "eagle"
    corpus = list(corpus or [SELF])
    corpus_files(corpus)  # a bad or benchmark path is an error before any work
    batch = batch or (8 if eagle else 256)  # eagle: windows of _EagleData.WINDOW positions; medusa: positions
    lr = lr or (3e-3 if eagle else 1e-3)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    budget = minutes * 60
    cfg_m = model.config
    D = cfg_m.hidden_size
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeRemainingColumn(), disable=not bar, transient=False) as prog:
        f = _load_or_gather_features(model, tokenizer, out / FEATURES, corpus, budget * FEATURE_SHARE, max_positions,
                                     prog, log)
        hidden, labels, valid = f["hidden"], f["labels"], f["valid"]
        chunk_ids = torch.arange(hidden.shape[0]) // CHUNK
        vocab, to_draft = _draft_vocabulary(labels, vocab_size, cfg_m.vocab_size)
        taps = feature_taps(cfg_m.num_layers) if eagle and fuse else ()
        arch = eagle_arch(D, cfg_m.head_dim, cfg_m.rope_theta, cfg_m.rms_eps, taps=taps) if eagle else {}
        cfg = HeadConfig(kind, num_heads, D, vocab.tolist(), target_name, target_sha, arch=arch)
        heads = _resume_or_new_heads(model, out, cfg, hidden, valid, log)
        heads.out.requires_grad_(False)  # the target's own head, restricted: the rest learns
        task_data = (_EagleData if eagle else _MedusaData)(model, f, chunk_ids, to_draft, num_heads, soft)

        def checkpoint(steps: int) -> list[float]:
            return _checkpoint(heads, out, steps, int(valid.sum()), minutes, ", ".join(corpus), task_data)

        steps, acc = _train(heads, task_data, batch, lr, t_start + budget, prog, checkpoint)
    log(f"train-head: {steps} steps on {int(valid.sum())} positions; held-out top-1 accuracy per "
        f"{'depth' if eagle else 'head'}: " + ", ".join(f"{a:.3f}" for a in acc) + f"; wrote {out}")
    return heads


def _load_or_gather_features(model, tokenizer, feat_file: Path, corpus: list[str], seconds: float, max_positions: int,
                             prog, log) -> dict[str, torch.Tensor]:
    """The features saved in ``feat_file`` when they are this model's and this version's, else new ones
    (``gather_features``), saved there."""
    from safetensors.torch import load_file, save_file

    f = load_file(str(feat_file)) if feat_file.is_file() else None
    if f is not None and ("soft_ids" not in f or f["hidden"].shape[1] != model.config.hidden_size):
        log(f"train-head: {feat_file} holds features of another model or an older version; collecting anew")
        f = None
    if f is not None:
        log(f"train-head: reusing {int(f['valid'].sum())} positions of features from {feat_file}")
    else:
        f = gather_features(model, tokenizer, corpus, seconds, max_positions, prog)
        save_file(f, str(feat_file))
    return f


def _draft_vocabulary(labels: torch.Tensor, size: int, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' vocabulary: the ``size`` target tokens most often next in the features (sorted ids), and
    the map target id -> draft id (-1 outside it)."""
    vocab = torch.bincount(labels[labels >= 0], minlength=target_vocab).topk(min(size, target_vocab)).indices.sort().values
    to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    return vocab, to_draft


def _resume_or_new_heads(model, out: Path, cfg: HeadConfig, hidden: torch.Tensor, valid: torch.Tensor, log):
    """The heads saved in ``out`` (which must have ``cfg``'s kind and shape), else new ones whose output
    layer is the target's LM head restricted to the draft vocabulary (eagle: the norm starts at the
    features' scale, so the head starts as the identity on them)."""
    if (out / "config.json").is_file():
        heads = load_heads(out, cfg.target_sha256)
        if heads.cfg.kind != cfg.kind or heads.cfg.vocab != cfg.vocab or heads.cfg.num_heads != cfg.num_heads \
                or heads.cfg.arch.get("taps", []) != cfg.arch.get("taps", []):
            raise InvalidParameterError(f"{out} holds heads of another kind or shape (vocabulary, depths, fused "
                                        f"layers: --no-fuse); use a new --out")
        log(f"train-head: resuming the heads in {out}")
        return heads
    heads = new_head(cfg)
    with torch.no_grad():
        heads.out.weight.copy_(output_rows(model.lm_head, torch.tensor(cfg.vocab)))
        if cfg.kind == "eagle":
            heads.norm_f.fill_(float(hidden[valid][:4096].float().pow(2).mean().sqrt()))
    return heads


def _train(heads, task_data, batch: int, lr: float, deadline: float, prog, checkpoint) -> tuple[int, list[float]]:
    """AdamW on the heads' trainable parameters until ``deadline`` (perf_counter), the learning rate warmed
    up and decayed over the time left (``lr_factor``), a checkpoint each minute and at the end. Returns the
    total steps (a resumed run counts on) and the last checkpoint's held-out accuracies."""
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    left = deadline - time.perf_counter()
    task = prog.add_task("training", total=max(left, 1.0), info="")
    t0 = last_ckpt = time.perf_counter()
    steps, loss_ema = int(heads.cfg.trained.get("steps", 0)), None
    steps0 = steps
    while time.perf_counter() < deadline:
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(steps - steps0, (time.perf_counter() - t0) / max(left, 1.0))
        loss = task_data.loss(heads, task_data.sample(batch, g))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        steps += 1
        lv = float(loss.detach())
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
        prog.update(task, completed=time.perf_counter() - t0, info=f"step {steps} loss {loss_ema:.3f}")
        if time.perf_counter() - last_ckpt > 60:
            checkpoint(steps)
            last_ckpt = time.perf_counter()
    return steps, checkpoint(steps)


def train_medusa(model, tokenizer, **kw):
    return train_heads(model, tokenizer, kind="medusa", **kw)


def train_eagle(model, tokenizer, **kw):
    return train_heads(model, tokenizer, kind="eagle", **kw)


class _MedusaData:
    """Positions: head k learns the target's greedy token a_{t+k} (and its top-k distribution) from h_t.
    The last 5% held out."""

    def __init__(self, model, f, chunk_ids, to_draft, K, soft):
        hidden, labels, valid = f["hidden"], f["labels"], f["valid"]
        targets = head_targets(labels, chunk_ids, K)  # (K, N)
        self.hidden, self.soft = hidden, soft
        self.y = torch.where(targets >= 0, to_draft[targets.clamp_min(0)], torch.full_like(targets, -1))  # (K, N)
        self.soft_ids, self.soft_p = soft_targets(f, to_draft)  # (N, k) at position t: for a_t
        n_chunks = max(1, hidden.shape[0] // CHUNK)
        self.n_val = max(1, n_chunks // 20) * CHUNK if n_chunks > 1 else max(1, hidden.shape[0] // 20)
        # whole records at the end of the shuffled corpus are held out; training samples real positions only
        self.train_pos = valid[:hidden.shape[0] - self.n_val].nonzero().squeeze(1)

    def sample(self, batch, g):
        return self.train_pos[torch.randint(0, len(self.train_pos), (batch,), generator=g)]

    def loss(self, heads, idx):
        logits = heads(self.hidden[idx].float())  # (K, B, Vd)
        N = self.hidden.shape[0]
        total = 0.0
        for k in range(logits.shape[0]):  # head k+1 learns position t+k+1's distribution (same record)
            y = self.y[k, idx]
            at = (idx + k + 1).clamp_max(N - 1)
            total = total + token_loss(logits[k], y, self.soft_ids[at], self.soft_p[at], self.soft)
        return total / logits.shape[0]

    @torch.no_grad()
    def held_out(self, heads) -> list[float]:
        val = slice(self.hidden.shape[0] - self.n_val, self.hidden.shape[0])
        pred = heads(self.hidden[val].float()).argmax(-1)  # (K, n_val)
        yy = self.y[:, val]
        return [float((pred[k] == yy[k])[yy[k] >= 0].float().mean()) if bool((yy[k] >= 0).any()) else 0.0
                for k in range(yy.shape[0])]


class _EagleData:
    """Whole chunks: head position j reads (f_j, x_{j+1}) (and the target's lower layers at j, when the head
    fuses them) and learns f_{j+1} (smooth L1) and the target's next token after it (cross-entropy over the
    draft vocabulary, its greedy token and its top-k distribution), at every training-time-test depth.
    The last 5% of the chunks held out."""

    REG = 1.0  # weight of the feature regression beside the token loss
    WINDOW = 32  # positions per training window: short windows, more steps per minute (measured best of 32/96)

    def __init__(self, model, f, chunk_ids, to_draft, passes, soft):
        C = CHUNK
        hidden = f["hidden"]
        n = hidden.shape[0] // C
        self.model, self.passes, self.soft = model, passes, soft
        self.hidden = hidden[:n * C].view(n, C, -1)  # (n, C, D)
        self.taps = f["taps"][:n * C].view(n, C, *f["taps"].shape[1:])  # (n, C, taps, D)
        self.tokens = f["tokens"][:n * C].view(n, C)
        y = f["labels"][:n * C].view(n, C)
        # (n, C) draft-vocabulary id of the target's next token, or -1 (outside the draft vocabulary, padding)
        self.y = torch.where(y >= 0, to_draft[y.clamp_min(0)], torch.full_like(y, -1))
        sid, sp = soft_targets(f, to_draft)
        self.soft_ids, self.soft_p = sid[:n * C].view(n, C, -1), sp[:n * C].view(n, C, -1)  # (n, C, k)
        self.valid = f["valid"][:n * C].view(n, C)  # (n, C) real positions (a record is a prefix of real ones)
        self.lens = self.valid.sum(1)  # (n,)
        self.n_val = max(1, n // 20)
        self.n_train = max(1, n - self.n_val)

    def sample(self, batch, g):
        """(record, window start) of ``batch`` training windows of WINDOW + 1 positions, starting where the
        window fits inside the record's real positions (or at 0 for a shorter record)."""
        W = min(self.WINDOW, CHUNK - 1)
        c = torch.randint(0, self.n_train, (batch,), generator=g)
        room = (self.lens[c] - W).clamp_min(1)  # (batch,) window starts that keep it inside the record
        return c, (torch.rand(batch, generator=g) * room).long()

    def _outs(self, heads, sel):
        c, s0 = sel
        W = min(self.WINDOW, CHUNK - 1) if s0 is not None else CHUNK - 1
        j = (s0 if s0 is not None else torch.zeros_like(c))[:, None] + torch.arange(W + 1)  # (B, W+1)
        rows = c[:, None]
        feat = self.hidden[rows, j[:, :-1]].float()  # (B, W, D) f_j
        taps = self.taps[rows, j[:, :-1]].float() if heads.taps else None  # (B, W, taps, D)
        with torch.no_grad():
            emb = self.model.embed(self.tokens[rows, j[:, 1:]]).float().clone()  # (B, W, D) e(x_{j+1})
        nxt = (rows, j[:, 1:])
        return (heads.train_passes(feat, emb, self.passes, taps), self.hidden[nxt].float(), self.y[nxt],
                self.valid[nxt], self.soft_ids[nxt], self.soft_p[nxt])

    def loss(self, heads, idx):
        outs, f_next, y, real, sid, sp = self._outs(heads, idx)  # real: (B, W) f_{j+1} is a recorded state
        total = 0.0
        for p, f in enumerate(outs):  # pass p+1 is meaningful from position p on
            logits = heads.logits(f[:, p:])
            m = real[:, p:].unsqueeze(-1).float()  # (B, W-p, 1)
            reg = (F.smooth_l1_loss(f[:, p:], f_next[:, p:], reduction="none") * m).sum() \
                / (m.sum() * f.shape[-1]).clamp_min(1.0)
            k = sid.shape[-1]
            total = total + token_loss(logits.reshape(-1, logits.shape[-1]), y[:, p:].reshape(-1),
                                       sid[:, p:].reshape(-1, k), sp[:, p:].reshape(-1, k), self.soft) \
                + self.REG * reg
        return total / len(outs)

    @torch.no_grad()
    def held_out(self, heads) -> list[float]:
        idx = torch.arange(self.n_train, self.n_train + self.n_val)[:16] if self.n_train < self.hidden.shape[0] \
            else torch.arange(0, min(16, self.n_train))
        outs, _, y, *_ = self._outs(heads, (idx, None))  # whole records
        acc = []
        for p, f in enumerate(outs):
            yy = y[:, p:]
            ok = yy >= 0
            pred = heads.logits(f[:, p:]).argmax(-1)
            acc.append(float((pred == yy)[ok].float().mean()) if bool(ok.any()) else 0.0)
        return acc


def _checkpoint(heads, out, steps, N, minutes, corpus, data) -> list[float]:
    acc = data.held_out(heads)
    heads.cfg.trained = {"steps": steps, "positions": N, "minutes": minutes, "corpus": corpus,
                         "held_out_top1": [round(a, 4) for a in acc]}
    save_heads(heads, out)
    return acc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default="medusa", choices=list(KINDS),
                   help="medusa: K heads on the last hidden state; eagle: one decoder layer over the target's "
                        "features, autoregressive (default medusa)")
    p.add_argument("--out", default=None,
                   help="folder for the heads (config.json + heads.safetensors); default "
                        "$DRAFTWISE_HOME/heads/<target file>-<sha256[:8]>-<kind>, where --method medusa / eagle "
                        "looks when --heads is not given")
    p.add_argument("--minutes", type=float, default=30.0, help="time budget, features + training (default 30)")
    p.add_argument("--corpus", action="append", default=None,
                   help="repeatable: 'self' (the target answers prompts built from offline material and learns "
                        "from its own answers), 'stdlib' (reads the Python stdlib and packages' docs), or a text "
                        "file or folder; several share the budget (default: self)")
    p.add_argument("--num-heads", type=int, default=3,
                   help="medusa: heads; eagle: depths trained by training-time test (default 3)")
    p.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary rows (default 8192)")
    p.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="eagle: read the target's final state only, not also its low and middle layers "
                        "(EAGLE-3's fused features, the default)")
    p.add_argument("--soft", type=float, default=SOFT,
                   help=f"weight of the target's top-{SOFT_K} distribution in the token loss, the rest on its greedy "
                        f"token (default {SOFT})")


def cmd_train_head(args) -> int:
    from .api import setup_threads
    from .outputs import out_folder
    from .models import load_model
    from .models.registry import resolve

    if args.num_heads < 1 or args.vocab_size < 16:
        raise InvalidParameterError("--num-heads must be >= 1 and --vocab-size >= 16")
    if not 0.0 <= args.soft <= 1.0:
        raise InvalidParameterError(f"--soft must be in [0, 1], got {args.soft}")
    corpus_files(args.corpus)  # a bad path is an error before the model loads
    if args.out:
        out_folder(args.out, "--out")  # and so is a destination the heads could not be written to
    setup_threads(args.threads)
    lm = load_model(args.target, args.dtype, "native")
    src = resolve(args.target, progress=False)
    sha = target_identity(src)
    out = out_folder(args.out or default_heads_dir(src, sha, args.kind), "--out")  # before the training
    train_heads(lm.model, lm.tokenizer, kind=args.kind, target_name=args.target, target_sha=sha,
                out=out, minutes=args.minutes, corpus=args.corpus, num_heads=args.num_heads,
                vocab_size=args.vocab_size, fuse=args.fuse, soft=args.soft,
                log=lambda m: print(m, file=sys.stderr))
    return 0


__all__ = ["add_arguments", "cmd_train_head", "collect_features", "corpus_files", "default_corpus",
           "gather_features", "head_targets", "train_eagle", "train_heads", "train_medusa"]
