"""Benchmark prompts: Spec-Bench-shaped JSONL (``question_id``, ``category``, ``turns``), first turn only.

Spec-Bench reports six tasks; its ``mt_bench`` task is stored as MT-Bench's eight sub-categories
(writing, roleplay, ...). A prompt's ``category`` is its task (what is filtered, limited and reported);
``subcategory`` keeps the file's own label. Categories outside ``TASKS`` are their own task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidParameterError

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS: dict[str, str] = {**{c: "mt_bench" for c in MT_BENCH},
                         **{t: t for t in ("translation", "summarization", "qa", "math_reasoning", "rag")}}
# Spec-Bench's 480 prompts ship inside the package (Apache-2.0; LICENSE and NOTICE.md beside the file)
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
SPEC_BENCH_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"


@dataclass(frozen=True)
class Prompt:
    question_id: int | str
    category: str  # task: mt_bench, translation, ... (or the file's own label outside Spec-Bench)
    subcategory: str  # the file's label (writing, roleplay, ... for mt_bench)
    text: str  # first turn


def default_prompts_path() -> Path:
    """Spec-Bench's ``question.jsonl``, shipped as package data (``draftwise/bench/data/spec_bench/``)."""
    return DEFAULT_PROMPTS


def read_jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise InvalidParameterError(f"prompts file {path} not found (give one with --prompts PATH)")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"]
            text = turns[0] if isinstance(turns, list) else turns
            if not isinstance(text, str) or not text:
                raise ValueError("empty first turn")
            sub = str(row["category"])
            out.append(Prompt(row["question_id"], TASKS.get(sub, sub), sub, text))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InvalidParameterError(f"{path}:{n}: not a prompt line with question_id, category and turns "
                                        f"({type(e).__name__}: {e})") from None
    if not out:
        raise InvalidParameterError(f"{path}: no prompts")
    return out


def select(prompts: list[Prompt], categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Keep the given categories (tasks or sub-categories, in file order), at most ``limit`` per task."""
    tasks = list(dict.fromkeys(p.category for p in prompts))
    subs = list(dict.fromkeys(p.subcategory for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in tasks and c not in subs]
        if unknown:
            raise InvalidParameterError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                                        f"{', '.join(map(repr, unknown))}; the prompts have {', '.join(tasks)}"
                                        + (f" (sub-categories {', '.join(s for s in subs if s not in tasks)})"
                                           if set(subs) - set(tasks) else ""))
        prompts = [p for p in prompts if p.category in categories or p.subcategory in categories]
    if limit is not None:
        if limit < 1:
            raise InvalidParameterError(f"--limit must be >= 1, got {limit}")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= limit:
                kept.append(p)
        prompts = kept
    return prompts


def load_prompts(path: str | Path | None, categories: list[str] | None = None,
                 limit: int | None = None) -> tuple[Path, list[Prompt]]:
    if path is None:
        path = default_prompts_path()
        if not path.is_file():  # only an install that dropped the package data
            raise InvalidParameterError(f"the Spec-Bench prompts that ship with draftwise are missing ({path}); "
                                        "reinstall draftwise, or give a prompts file with --prompts PATH")
    path = Path(path).expanduser()
    return path, select(read_jsonl(path), categories, limit)
