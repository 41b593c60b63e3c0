"""Self-distillation corpus for ``train-head``: the target answers prompts built from offline material, and
its own hidden states and greedy tokens along its answers are what the heads learn.

A draft head is right when it predicts what the *target* writes next. Reading human text (the stdlib
corpus) teaches it text the target would not write; the target's own answers to prompts like the ones
users send are the distribution it drafts on. The prompts come from material every machine with Python
has, never from the benchmark:

- code: functions and classes of the Python standard library (name, signature, docstring, source) asked
  for, explained, tested, refactored, or given as a ``def ...`` header to complete;
- prose: paragraphs of the documentation installed packages ship (README / METADATA), to summarize,
  translate, question, or rewrite;
- questions about stdlib modules, arithmetic word problems from templates with random numbers, and short
  writing tasks on a fixed list of everyday topics.

Most prompts are fed raw (as ``generate`` and ``bench`` feed them by default), a quarter through the
model's chat template. Generation is batched greedy decoding on the target itself (``rows`` sequences
at a time, a finished row refilled at once), recording every position's final hidden state and greedy next
token, prompt positions included, in records of ``record`` tokens (padded; ``valid`` marks the real ones).
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

TOPICS = (
    "a rainy afternoon in a small harbour town", "learning to ride a bicycle as an adult", "a lighthouse keeper's "
    "last night on duty", "the history of the bicycle", "why people keep houseplants", "a robot that learns to cook",
    "moving to a new city", "the first day at a new job", "a forgotten letter found in a library book",
    "how bread is made", "the importance of sleep", "a trip to the mountains in winter", "saving money on groceries",
    "a chess tournament between friends", "how a bill becomes a law", "the life cycle of a star",
    "a conversation between a cat and a dog", "the benefits of learning a second language", "volcanoes",
    "the invention of the printing press", "a village festival", "working from home", "ocean tides",
    "a detective solving a small mystery", "recycling plastic", "the first moon landing", "a family recipe",
)
GENRES = ("short story", "poem", "formal email", "blog post", "speech", "product description", "diary entry",
          "news report", "dialogue")
LANGUAGES = ("German", "French", "Spanish", "Chinese", "Italian", "Japanese")
NAMES = ("Alice", "Ben", "Carla", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal")
ITEMS = (("apples", "bag"), ("pencils", "box"), ("eggs", "carton"), ("stickers", "sheet"), ("marbles", "jar"))


def stdlib_sources() -> list[Path]:
    """The Python standard library's modules (top level and one package level down, tests left out)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py")) + sorted(p for p in stdlib.glob("*/*.py") if "test" not in p.parts[-2])


def package_docs(limit: int) -> list[Path]:
    """Documentation installed packages ship: up to ``limit`` markdown files, then ``limit`` METADATA files."""
    site = Path(sysconfig.get_paths()["purelib"])
    return sorted(site.glob("*/*.md"))[:limit] + sorted(site.glob("*.dist-info/METADATA"))[:limit]


def _first_sentence(doc: str) -> str:
    s = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", s)
    return (m.group(1) if m else s)[:240]


def _code_items(path: Path) -> list[dict]:
    """Public functions and classes of one file with a docstring: name, signature, first sentence, source."""
    try:
        text = path.read_text(encoding="utf-8", errors="ignore")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        src = ast.get_source_segment(text, node) or ""
        if not doc or len(doc) < 20 or not src or src.count("\n") > 40:
            continue
        sig = ast.unparse(node.args) if isinstance(node, ast.FunctionDef) else ""
        out.append({"name": node.name, "sig": sig, "doc": _first_sentence(doc), "src": src,
                    "cls": isinstance(node, ast.ClassDef), "module": path.stem})
    return out


def _paragraphs(path: Path) -> list[str]:
    """Prose paragraphs (mostly letters, no code or tables) of one documentation file."""
    try:
        text = path.read_text(encoding="utf-8", errors="ignore")
    except OSError:
        return []
    out = []
    for para in re.split(r"\n\s*\n", text):
        p = " ".join(para.split())
        if not 200 <= len(p) <= 1200 or any(c in p for c in ("```", "|", ">>>", "::", "{", "}", "http")):
            continue
        if sum(ch.isalpha() or ch.isspace() for ch in p) / len(p) < 0.85 or p.startswith(("#", "-", "*")):
            continue
        out.append(p)
    return out


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:2] != s[:2].upper() else s


def _code_prompt(it: dict, r: random.Random) -> str:
    name, sig, doc, src = it["name"], it["sig"], it["doc"], it["src"]
    if it["cls"]:
        return r.choice([f"Implement a Python class `{name}`. {doc}",
                         f"Explain what this Python class does:\n\n```python\n{src}\n```"])
    return r.choice([
        f'def {name}({sig}):\n    """{doc}"""\n',
        f"Write a Python function `{name}({sig})`: {_lower_first(doc)}",
        f"Explain what the following Python code does:\n\n```python\n{src}\n```",
        f"Write unit tests with pytest for this function:\n\n```python\n{src}\n```",
        f"Rewrite this function to be more readable, with type hints:\n\n```python\n{src}\n```",
        f"# {doc}\ndef {name}({sig}):\n",
    ])


def _prose_prompt(p: str, r: random.Random) -> str:
    short = p if len(p) < 400 else p[:p.find(". ", 300) + 1 or 400]
    return r.choice([
        f"Summarize the following text in two sentences.\n\n{p}",
        f"Translate the following text into {r.choice(LANGUAGES)}.\n\n{short}",
        f"Write three questions a reader could ask about this text, and answer them.\n\n{p}",
        f"Rewrite this paragraph so that a beginner can understand it.\n\n{p}",
        f"{p}\n\nWhat is the main point of the text above?",
    ])


def _math_prompt(r: random.Random) -> str:
    a, b, c, d = r.randint(2, 30), r.randint(2, 12), r.randint(2, 9), r.randint(10, 90)
    n1, n2 = r.sample(NAMES, 2)
    item, unit = r.choice(ITEMS)
    return r.choice([
        f"{n1} buys {a} {unit}s of {item}. Each {unit} holds {b} {item}. {n1} gives {c} {item} to each of "
        f"{d // 10} friends. How many {item} does {n1} have left?",
        f"A train travels {a * 10} km in {b} hours. At the same speed, how far does it travel in {c} hours?",
        f"{n1} has {d} dollars and {n2} has {a} dollars more than half of that. How much money do they have "
        f"together?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"{n1} reads {b} pages a day. The book has {d * c} pages. After {a} days, how many pages are left, and "
        f"how many more days does {n1} need?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
    ])


def _writing_prompt(r: random.Random, modules: list[str]) -> str:
    topic = r.choice(TOPICS)
    m1, m2 = r.sample(modules, 2) if len(modules) >= 2 else ("os", "sys")
    return r.choice([
        f"Write a {r.choice(GENRES)} about {topic}.",
        f"Give five tips about {topic}.",
        f"What is the Python module `{m1}` used for? Give a short example.",
        f"Compare the Python modules `{m1}` and `{m2}`: what is each for?",
        f"Imagine you are a tour guide. Describe {topic} to a group of visitors.",
    ])


def seed_prompts(seed: int = 0) -> Iterator[tuple[str, bool]]:
    """An endless, deterministic stream of (prompt text, through the chat template?) from offline material."""
    r = random.Random(seed)
    code_files = [p for p in stdlib_sources() if "spec_bench" not in p.as_posix()]
    doc_files = package_docs(300)
    r.shuffle(code_files)
    r.shuffle(doc_files)
    modules = sorted({p.stem for p in code_files if not p.stem.startswith("_")})
    code: list[dict] = []
    prose: list[str] = []
    ci = di = 0
    while True:
        while len(code) < 8 and code_files:  # read files lazily: start-up stays fast
            code += _code_items(code_files[ci % len(code_files)])
            ci += 1
            if ci > 4 * len(code_files):
                break
        while len(prose) < 4 and doc_files and di < 4 * len(doc_files):
            prose += _paragraphs(doc_files[di % len(doc_files)])
            di += 1
        kind = r.choices(("code", "prose", "math", "writing"), weights=(5, 2, 1, 2))[0]
        if kind == "code" and code:
            text = _code_prompt(code.pop(r.randrange(len(code))), r)
        elif kind == "prose" and prose:
            text = _prose_prompt(prose.pop(r.randrange(len(prose))), r)
        elif kind == "math":
            text = _math_prompt(r)
        else:
            text = _writing_prompt(r, modules)
        yield text, r.random() < 0.25


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat([{"role": "user", "content": text}])
    return tokenizer.encode(text)


SOFT_K = 8  # the target's top-k next-token distribution recorded per position (soft labels)


def feature_taps(num_layers: int) -> tuple[int, ...]:
    """The decoder layers whose outputs are recorded beside the final state: a low and a middle one
    (EAGLE-3 fuses low-, mid- and high-level features; the high one is the final state)."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2}))


def soft_labels(logits: torch.Tensor, k: int = SOFT_K) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., V) -> the target's top-k next tokens (..., k) int32 and their log-probabilities (..., k)
    float16 (over the whole vocabulary)."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


_KEYS = ("hidden", "taps", "soft_ids", "soft_logp")  # per-position tensors, one (1, ...) row per position


@torch.inference_mode()
def generate_features(model, tokenizer, seconds: float, max_positions: int, *, record: int = 256, rows: int = 16,
                      seed: int = 0, progress=None, prompts: Iterator[tuple[str, bool]] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The target's greedy answers to seed prompts, as training records of ``record`` tokens.

    Returns {hidden (n·record, D) bf16, labels (n·record,) the target's greedy next token or -1 on padding,
    tokens (n·record,), valid (n·record,) bool, taps (n·record, len(feature_taps), D) bf16 the residual
    stream after the low and middle decoder layers, soft_ids / soft_logp (n·record, SOFT_K) the target's
    top next tokens and their log-probabilities}. A record is a prompt (at most record/2 tokens) and the
    target's greedy continuation up to its end of sequence or the record's end; labels[t] is the argmax of
    the target's logits at t, so along the answer labels[t] == tokens[t + 1]."""
    gen = _Answers(model, tokenizer, prompts if prompts is not None else seed_prompts(seed), record, rows)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds and gen.n < max_positions:
        for i in range(rows):
            if gen.live[i] is None:
                gen.fill(i)
        if any(st is None for st in gen.live):  # a prompt answered by its end of sequence at once
            continue
        gen.step()
        if progress is not None:
            progress(gen.n + sum(len(st["hidden"]) for st in gen.live if st), time.perf_counter() - t0)
    for i in range(rows):
        gen.finish(i)
    if not gen.done:
        from .errors import InvalidParameterError
        raise InvalidParameterError("no self-generated features: the budget is too small")
    return _pack(gen.done, record, model.config.hidden_size, len(gen.taps))


class _Answers:
    """``rows`` cache rows, each answering one seed prompt greedily (one batched forward per token), the
    per-position features of each answer recorded until its end of sequence or ``record`` tokens."""

    def __init__(self, model, tokenizer, prompts: Iterator[tuple[str, bool]], record: int, rows: int):
        self.model, self.tokenizer, self.prompts, self.record = model, tokenizer, prompts, record
        self.eos = getattr(tokenizer, "eos_ids", frozenset())
        self.cache = model.new_cache(rows, record)
        self.taps = feature_taps(model.config.num_layers)
        self.live: list[dict | None] = [None] * rows  # per row: tokens, labels and the _KEYS lists
        self.done: list[dict] = []  # finished records
        self.n = 0  # positions in them

    def finish(self, i: int) -> None:
        """Row i's answer so far becomes a record; the row is free."""
        st = self.live[i]
        self.live[i] = None
        if st is not None and st["tokens"]:
            L = len(st["hidden"])
            self.done.append({"tokens": st["tokens"][:L], "labels": st["labels"][:L],
                              **{key: torch.cat(st[key]) for key in _KEYS}})
            self.n += L

    @staticmethod
    def _record_rows(st: dict, out, row: int, sl: slice) -> None:
        ids, logp = soft_labels(out.logits[row, sl])
        for key, t in (("hidden", out.hidden[row, sl].to(torch.bfloat16)),
                       ("taps", out.taps[row, sl].to(torch.bfloat16)), ("soft_ids", ids), ("soft_logp", logp)):
            st[key].extend(t.split(1))

    def fill(self, i: int) -> None:
        """Row i takes the next prompt of 4 to record/2 tokens: its prefill, recorded, and the first token."""
        while True:
            text, chat = next(self.prompts)
            ids = _encode(self.tokenizer, text, chat)
            if 4 <= len(ids) <= self.record // 2:
                break
        view = self.cache.view(slice(i, i + 1))
        view.reset()
        out = self.model.forward(torch.tensor([ids]), view, logits_for="all", taps=self.taps)  # hidden (1, P, D)
        labels = out.logits[0].argmax(-1).tolist()
        self.live[i] = {"tokens": ids + [labels[-1]], "labels": labels, **{key: [] for key in _KEYS}}
        self._record_rows(self.live[i], out, 0, slice(None))
        if labels[-1] in self.eos:
            self.finish(i)

    def step(self) -> None:
        """One greedy token on every row (all live), recorded; rows at their end finish."""
        rows = len(self.live)
        x = torch.tensor([[st["tokens"][-1]] for st in self.live])  # (rows, 1)
        out = self.model.forward(x, self.cache.view(slice(0, rows)), logits_for="all", taps=self.taps)  # (rows, 1, V)
        nxt = out.logits[:, -1].argmax(-1).tolist()
        for i, st in enumerate(self.live):
            self._record_rows(st, out, i, slice(-1, None))
            st["labels"].append(nxt[i])
            st["tokens"].append(nxt[i])
            if nxt[i] in self.eos or len(st["hidden"]) >= self.record:
                self.finish(i)


def _pack(done: list[dict], record: int, D: int, ntaps: int) -> dict[str, torch.Tensor]:
    """The records, each padded to ``record`` positions (labels -1, valid False), one after the other."""
    N = len(done) * record
    f = {"hidden": torch.zeros(N, D, dtype=torch.bfloat16), "labels": torch.full((N,), -1, dtype=torch.long),
         "tokens": torch.zeros(N, dtype=torch.long), "valid": torch.zeros(N, dtype=torch.bool),
         "taps": torch.zeros(N, ntaps, D, dtype=torch.bfloat16),
         "soft_ids": torch.full((N, SOFT_K), -1, dtype=torch.int32),
         "soft_logp": torch.full((N, SOFT_K), float("-inf"), dtype=torch.float16)}
    for k, d in enumerate(done):
        L, s = len(d["labels"]), k * record
        f["labels"][s:s + L] = torch.tensor(d["labels"])
        f["tokens"][s:s + L] = torch.tensor(d["tokens"])
        f["valid"][s:s + L] = True
        for key in _KEYS:
            f[key][s:s + L] = d[key]
    return f


__all__ = ["SOFT_K", "feature_taps", "generate_features", "package_docs", "seed_prompts", "soft_labels",
           "stdlib_sources"]
