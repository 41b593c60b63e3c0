"""``draftwise train-head``: train draft heads on the target itself, on this CPU, from an offline corpus.

Self-distillation in two phases within ``--minutes``:

1. **Features** (up to half the budget): the target reads corpus text in chunks; at every position its
   final hidden state h_t and its own greedy next token a_t (what it would write there) are recorded.
   Labels are the target's predictions, never the corpus text, so the heads learn the target.
2. **Training**: Medusa head k learns a_{t+k} from h_t (cross-entropy over the draft vocabulary: the
   most frequent target predictions), AdamW, with checkpoints every minute; held-out top-1 accuracy per
   head is written into the head's config.

Resumable: the features are saved in ``OUT/features.safetensors`` and the heads at each checkpoint; a
second run with the same ``--out`` continues from both.

The corpus must exist offline and must not be the benchmark: the Python standard library's sources
(code and docstrings) and the text files (README, docs) installed packages ship. Spec-Bench prompts are
refused (``--corpus`` pointing into a ``spec_bench`` folder is an error).
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import InvalidParameterError
from .heads import HeadConfig, MedusaHeads, load_heads, save_heads, target_identity

FEATURES = "features.safetensors"
CHUNK = 256  # tokens per target forward while collecting features


def default_corpus() -> list[Path]:
    """Offline text that every machine with Python has: stdlib sources, then packages' docs."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    files += sorted(p for p in stdlib.glob("*/*.py") if "test" not in p.parts[-2])
    site = Path(sysconfig.get_paths()["purelib"])
    files += sorted(p for p in site.glob("*/*.md"))[:200]
    files += sorted(p for p in site.glob("*.dist-info/METADATA"))[:200]
    return files


def corpus_files(spec: list[str] | None) -> list[Path]:
    if not spec:
        return default_corpus()
    out: list[Path] = []
    for s in spec:
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
                     batch: int = 8):
    """(hidden (N, D) bf16, greedy next token (N,), chunk id (N,)) over full corpus chunks of CHUNK tokens,
    ``batch`` chunks per target forward, within ``seconds``."""
    hs, labels = [], []
    n, t0 = 0, time.perf_counter()
    cache = model.new_cache(batch, CHUNK)
    chunks = (c for c in _chunks(files, tokenizer) if len(c) == CHUNK)
    while time.perf_counter() - t0 < seconds and n < max_positions:
        group = [c for _, c in zip(range(batch), chunks)]
        if not group:
            break
        view = cache.view(slice(0, len(group)))
        view.reset()
        out = model.forward(torch.tensor(group), view, logits_for="all")  # (b, CHUNK, V)
        hs.append(out.hidden.reshape(-1, out.hidden.shape[-1]).to(torch.bfloat16))
        labels.append(out.logits.argmax(-1).reshape(-1))
        n += len(group) * CHUNK
        if progress is not None:
            progress(n, time.perf_counter() - t0)
    if not hs:
        raise InvalidParameterError(f"no features collected: the corpus has no text of {CHUNK} tokens, or the "
                                    "budget is too small")
    labels_all = torch.cat(labels)
    return torch.cat(hs), labels_all, torch.arange(len(labels_all)) // CHUNK


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
    from .kernels import QLinear, dequantize

    if isinstance(lm_head, QLinear):
        minv = lm_head.minv[rows] if lm_head.minv.numel() else None
        return dequantize(lm_head.q[rows], lm_head.scale[rows], minv, lm_head.group, lm_head.bits)
    return lm_head.weight[rows].float()


def train_medusa(model, tokenizer, *, target_name: str, target_sha: str, out: Path, minutes: float,
                 files: list[Path], num_heads: int = 3, vocab_size: int = 8192, batch: int = 256,
                 lr: float = 1e-3, max_positions: int = 400_000, corpus: str = "", log=print,
                 bar=True) -> MedusaHeads:
    """Collect features (or reuse OUT/features.safetensors), then train Medusa heads for the rest of
    ``minutes``; checkpoints in ``out``. Returns the trained heads."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from safetensors.torch import load_file, save_file

    if minutes <= 0:
        raise InvalidParameterError(f"--minutes must be > 0, got {minutes}")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    budget = minutes * 60
    D = model.config.hidden_size
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeRemainingColumn(), disable=not bar, transient=False) as prog:
        feat_file = out / FEATURES
        if feat_file.is_file():
            f = load_file(str(feat_file))
            hidden, labels, chunk_ids = f["hidden"], f["labels"], f["chunk_ids"]
            if hidden.shape[1] != D:
                raise InvalidParameterError(f"{feat_file} holds features of another model (D={hidden.shape[1]})")
            log(f"train-head: reusing {hidden.shape[0]} positions of features from {feat_file}")
        else:
            task = prog.add_task("features", total=budget / 2, info="")
            hidden, labels, chunk_ids = collect_features(
                model, tokenizer, files, budget / 2, max_positions,
                lambda n, s: prog.update(task, completed=s, info=f"{n} positions, {n / max(s, 1e-9):.0f}/s"))
            prog.update(task, completed=budget / 2)
            save_file({"hidden": hidden.contiguous(), "labels": labels, "chunk_ids": chunk_ids}, str(feat_file))
        targets = head_targets(labels, chunk_ids, num_heads)  # (K, N)
        vocab = torch.bincount(labels, minlength=model.config.vocab_size).topk(
            min(vocab_size, model.config.vocab_size)).indices.sort().values
        to_draft = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
        to_draft[vocab] = torch.arange(len(vocab))
        y = torch.where(targets >= 0, to_draft[targets.clamp_min(0)], torch.full_like(targets, -1))  # (K, N)
        N = hidden.shape[0]
        n_val = max(1, N // 20)  # the last 5% (whole chunks at the end of the shuffled corpus) held out
        cfg = HeadConfig("medusa", num_heads, D, vocab.tolist(), target_name, target_sha)
        resumed = (out / "config.json").is_file()
        if resumed:
            heads = load_heads(out, target_sha)
            if heads.cfg.vocab != cfg.vocab or heads.cfg.num_heads != num_heads:
                raise InvalidParameterError(f"{out} holds heads of another shape; use a new --out")
            log(f"train-head: resuming the heads in {out}")
        else:
            heads = MedusaHeads(cfg)
            with torch.no_grad():
                heads.out.weight.copy_(output_rows(model.lm_head, vocab))
        heads.out.requires_grad_(False)  # the target's own head, restricted: only the blocks learn
        opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        g = torch.Generator().manual_seed(0)
        left = budget - (time.perf_counter() - t_start)
        task = prog.add_task("training", total=max(left, 1.0), info="")
        t0 = last_ckpt = time.perf_counter()
        steps, loss_ema = int(heads.cfg.trained.get("steps", 0)), None
        while time.perf_counter() - t_start < budget:
            idx = torch.randint(0, N - n_val, (batch,), generator=g)
            h = hidden[idx].float()
            logits = heads(h)  # (K, B, Vd)
            yy = y[:, idx]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yy.reshape(-1), ignore_index=-1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            lv = float(loss.detach())
            loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
            prog.update(task, completed=time.perf_counter() - t0, info=f"step {steps} loss {loss_ema:.3f}")
            if time.perf_counter() - last_ckpt > 60:
                _checkpoint(heads, out, steps, N, minutes, corpus, hidden, y, n_val)
                last_ckpt = time.perf_counter()
        acc = _checkpoint(heads, out, steps, N, minutes, corpus, hidden, y, n_val)
    log(f"train-head: {steps} steps on {N} positions; held-out top-1 accuracy per head: "
        + ", ".join(f"{a:.3f}" for a in acc) + f"; wrote {out}")
    return heads


@torch.no_grad()
def _checkpoint(heads, out, steps, N, minutes, corpus, hidden, y, n_val) -> list[float]:
    val = slice(hidden.shape[0] - n_val, hidden.shape[0])
    pred = heads(hidden[val].float()).argmax(-1)  # (K, n_val)
    yy = y[:, val]
    acc = [float((pred[k] == yy[k])[yy[k] >= 0].float().mean()) if bool((yy[k] >= 0).any()) else 0.0
           for k in range(yy.shape[0])]
    heads.cfg.trained = {"steps": steps, "positions": N, "minutes": minutes, "corpus": corpus,
                         "held_out_top1": [round(a, 4) for a in acc]}
    save_heads(heads, out)
    return acc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default="medusa", choices=["medusa"], help="head kind (default medusa)")
    p.add_argument("--out", required=True, help="folder for the heads (config.json + heads.safetensors)")
    p.add_argument("--minutes", type=float, default=30.0, help="time budget, features + training (default 30)")
    p.add_argument("--corpus", action="append", default=None,
                   help="text file or folder (repeatable); default: the Python stdlib and packages' docs")
    p.add_argument("--num-heads", type=int, default=3, help="Medusa heads (default 3)")
    p.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary rows (default 8192)")


def cmd_train_head(args) -> int:
    from .cli import _setup_threads
    from .models import load_model
    from .models.registry import resolve

    if args.num_heads < 1 or args.vocab_size < 16:
        raise InvalidParameterError("--num-heads must be >= 1 and --vocab-size >= 16")
    files = corpus_files(args.corpus)
    _setup_threads(args)
    lm = load_model(args.target, args.dtype, "native")
    sha = target_identity(resolve(args.target, progress=False))
    train_medusa(lm.model, lm.tokenizer, target_name=args.target, target_sha=sha, out=Path(args.out),
                 minutes=args.minutes, files=files, num_heads=args.num_heads, vocab_size=args.vocab_size,
                 corpus=", ".join(args.corpus) if args.corpus else "python stdlib + installed packages' docs",
                 log=lambda m: print(m, file=sys.stderr))
    return 0


__all__ = ["add_arguments", "cmd_train_head", "collect_features", "corpus_files", "default_corpus",
           "head_targets", "train_medusa"]
