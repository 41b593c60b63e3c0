"""What draftwise keeps under ``$DRAFTWISE_HOME``, and removing it: ``draftwise cache ls|rm``.

Entries: ``model`` (a GGUF in ``models/`` with its sha256 marker and fetch lock), ``converted`` (a folder of
``converted/``), ``wheels`` (registry wheels left over from an assembly) and one kind per other folder
(e.g. ``heads``). A converted folder is ``current``; ``stale`` when made under an older CONVERT_VERSION,
from a file that has changed since, or abandoned mid-conversion over an hour ago; ``orphan`` when its
source is gone; ``newer`` when a newer draftwise wrote it; ``unknown`` when unrecorded and named by no
known GGUF's key. ``rm --stale`` removes only ``stale`` entries. Nothing outside ``$DRAFTWISE_HOME`` is
ever removed, and a symbolic link is removed, never followed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import DraftwiseError
from .loading import CONVERT_VERSION, conversion_name, read_source_record
from .registry import MODELS, draftwise_home, model_wheels, trusted, wheel_dir

PARTIAL_AGE_S = 3600  # a ``.tmp`` conversion or ``.part`` assembly untouched this long was abandoned


@dataclass
class Entry:
    kind: str  # model | converted | wheels | the name of another folder under $DRAFTWISE_HOME
    name: str  # the named model it belongs to, else its file or folder name
    paths: list[Path]
    size: int = 0  # bytes, each hard-linked file once
    state: str = ""

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "size": self.size, "state": self.state,
                "paths": [str(p) for p in self.paths]}


def human(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


def _files(path: Path):
    if path.is_symlink() or path.is_file():
        yield path
    elif path.is_dir():
        for root, _, names in os.walk(path):
            for n in names:
                yield Path(root) / n


def _size(paths: list[Path]) -> int:
    seen = set()
    total = 0
    for p in paths:
        for f in _files(p):
            st = f.lstat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _abandoned(path: Path, now: float) -> bool:
    newest = max((f.lstat().st_mtime for f in _files(path)), default=path.lstat().st_mtime)
    return now - max(newest, path.lstat().st_mtime) > PARTIAL_AGE_S


def _named_by_file() -> dict[str, str]:
    return {m.filename: m.name for m in MODELS.values()}


def _models(home: Path, now: float) -> list[Entry]:
    folder = home / "models"
    if not folder.is_dir():
        return []
    by_file = _named_by_file()
    out, claimed = [], set()
    for f in sorted(folder.glob("*.gguf")):
        marker = f.with_suffix(f.suffix + ".sha256")
        lock = f.with_name(f.name + ".lock")  # held by a fetch (registry.fetch_named), kept after it
        paths = [f] + [marker] * marker.exists() + [lock] * lock.exists()
        claimed.update(paths)
        name = by_file.get(f.name, f.name)
        state = ""
        if name in MODELS:
            state = "verified" if trusted(MODELS[name], f) else "unverified"  # the next use fetches it again
        out.append(Entry("model", name, paths, state=state))
    for f in sorted(folder.iterdir()):
        if f in claimed:
            continue
        if f.name.endswith(".gguf.part"):
            stem = f.name.removesuffix(".part")
            state = "stale" if _abandoned(f, now) else "partial"
            out.append(Entry("model", by_file.get(stem, f.name), [f], state=state))
        elif f.name.endswith((".gguf.sha256", ".gguf.lock")) and not f.with_suffix("").exists():
            out.append(Entry("model", by_file.get(f.with_suffix("").name, f.name), [f], state="stale"))
        else:
            out.append(Entry("other", f"models/{f.name}", [f]))
    return out


def _classify(d: Path, sources: list[Path], now: float) -> tuple[str | None, str]:
    """(source GGUF or None, state) of converted folder ``d``."""
    if d.name.endswith(".tmp"):
        return None, "stale" if _abandoned(d, now) else "partial"
    rec = read_source_record(d)
    if rec is not None:
        src = Path(rec["source"])
        version = int(rec["convert_version"])
        if version < CONVERT_VERSION:
            return src, "stale"
        if version > CONVERT_VERSION:
            return src, "newer"  # written by a newer draftwise: not ours to judge
        if not src.is_file():
            return src, "orphan"
        return src, "current" if conversion_name(src) == d.name else "stale"
    for src in sources:  # converted before records were kept: match the name against known files' keys
        if not d.name.startswith(src.stem + "-") or not src.is_file():
            continue
        if d.name == conversion_name(src):
            return src, "current"
        if d.name in {conversion_name(src, v) for v in range(CONVERT_VERSION)}:
            return src, "stale"
    return None, "unknown"


def _converted(home: Path, now: float) -> list[Entry]:
    folder = home / "converted"
    if not folder.is_dir():
        return []
    dirs = sorted(d for d in folder.iterdir() if d.is_dir())
    sources = set((home / "models").glob("*.gguf"))
    sources = sorted(sources | {Path(r["source"]) for r in map(read_source_record, dirs) if r is not None})
    models_dir = (home / "models").resolve()
    by_file = _named_by_file()
    out = []
    for d in dirs:
        src, state = _classify(d, sources, now)
        name = d.name
        if src is not None and src.resolve().parent == models_dir and src.name in by_file:
            name = by_file[src.name]
        out.append(Entry("converted", name, [d], state=state))
    return sorted(out, key=lambda e: (e.name, e.state != "current"))


def _wheels() -> list[Entry]:
    folder = wheel_dir()
    if not folder.is_dir():
        return []
    out, claimed = [], set()
    for m in MODELS.values():
        ws = model_wheels(m, folder)
        if ws:
            claimed.update(ws)
            out.append(Entry("wheels", m.name, ws, state="leftover"))
    out += [Entry("wheels", f.name, [f], state="leftover") for f in sorted(folder.iterdir()) if f not in claimed]
    return out


def scan() -> list[Entry]:
    """Every entry under ``$DRAFTWISE_HOME``, sized: models, converted, wheels, then other folders."""
    home = draftwise_home()
    if not home.is_dir():
        return []
    now = time.time()
    entries = _models(home, now) + _converted(home, now) + _wheels()
    for d in sorted(home.iterdir()):
        if d.name in ("models", "converted", "wheels"):
            continue
        if d.is_dir() and not d.is_symlink():
            entries += [Entry(d.name, c.name, [c]) for c in sorted(d.iterdir())]
        else:
            entries.append(Entry("other", d.name, [d]))
    for e in entries:
        e.size = _size(e.paths)
    return entries


def total(entries: list[Entry]) -> int:
    return _size([p for e in entries for p in e.paths])


def select(entries: list[Entry], name: str | None = None, all_: bool = False, wheels: bool = False,
           stale: bool = False) -> list[Entry]:
    """The entries ``draftwise cache rm`` removes. An unknown ``name`` is an error naming the known ones."""
    if all_:
        home = draftwise_home().resolve()
        if home in (Path.home().resolve(), Path(home.anchor)):
            raise DraftwiseError(f"$DRAFTWISE_HOME is {home}, not a cache folder; remove entries by name")
        return list(entries)
    chosen = [e for e in entries if (wheels and e.kind == "wheels")
              or (stale and e.state == "stale") or (name is not None and e.name == name)]
    if name is not None and name not in MODELS and not chosen:
        models = sorted({e.name for e in entries if e.kind in ("model", "converted", "wheels")} | set(MODELS))
        others = len({e.name for e in entries} - set(models))  # kernel notes, heads, ...: hundreds, in time
        more = f"; {others} other entries: draftwise cache ls" if others else ""
        raise DraftwiseError(f"no cache entry named {name!r} (models: {', '.join(models)}{more})")
    return chosen


def remove(entry: Entry) -> None:
    """Delete the entry's files and folders (refusing any outside ``$DRAFTWISE_HOME``)."""
    home = draftwise_home().resolve()
    for p in entry.paths:
        if home not in (p.parent.resolve() / p.name).parents:
            raise DraftwiseError(f"{p} is not under $DRAFTWISE_HOME ({home}); not removed")
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    folder = wheel_dir()
    if entry.kind == "wheels" and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="cache_command", required=True)
    ls = sub.add_parser("ls", help="list models, converted copies, leftover wheels and other entries with sizes")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    rm = sub.add_parser("rm", help="remove a model's files (GGUF, converted copies, wheels), or every entry, "
                                   "or the leftover wheels, or stale conversions")
    what = rm.add_mutually_exclusive_group(required=True)
    what.add_argument("name", nargs="?", help="a name from `draftwise cache ls`")
    what.add_argument("--all", action="store_true", help="everything under $DRAFTWISE_HOME")
    what.add_argument("--wheels", action="store_true", help="leftover registry wheels")
    what.add_argument("--stale", action="store_true", help="stale conversions and abandoned partial files")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask (required when stdin is not a terminal)")


def _table(entries: list[Entry]):
    from rich.table import Table

    t = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (("kind", "left"), ("name", "left"), ("size", "right"), ("state", "left"),
                         ("path", "left")):
        t.add_column(col, justify=justify, no_wrap=col != "path")
    home = draftwise_home()
    for e in entries:
        t.add_row(e.kind, e.name, human(e.size), e.state, _shown(e, home))
    return t


def _shown(e: Entry, home: Path) -> str:
    """The entry's path relative to ``home``; a model's wheels as their folder and count."""
    many = e.kind == "wheels" and len(e.paths) > 1
    shown = e.paths[0].parent if many else e.paths[0]
    path = str(shown.relative_to(home)) if shown.is_relative_to(home) else str(shown)
    return path + f"/ ({len(e.paths)} files)" if many else path


def cmd_cache(args) -> int:
    from rich.console import Console

    console = Console(highlight=False, **({} if sys.stdout.isatty() else {"width": 200}))
    entries = scan()
    home = draftwise_home()
    if args.cache_command == "ls":
        if args.json:
            print(json.dumps({"home": str(home), "entries": [e.to_json() for e in entries],
                              "total": total(entries)}))
            return 0
        if not entries:
            console.print(f"{home}: empty")
            return 0
        console.print(_table(entries))
        console.print(f"total {human(total(entries))} in {home}", markup=False)
        return 0
    chosen = select(entries, args.name, args.all, args.wheels, args.stale)
    if not chosen:
        print("nothing to remove")
        return 0
    size = total(chosen)
    if not args.yes:
        if not sys.stdin.isatty():
            raise DraftwiseError(f"would remove {len(chosen)} entries ({human(size)}); "
                                 "pass --yes (stdin is not a terminal)")
        console.print(_table(chosen))
        if input(f"remove these {len(chosen)} entries ({human(size)})? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    for e in chosen:
        remove(e)
        print(f"removed {e.kind} {e.name} ({human(e.size)}): {_shown(e, home)}")
    print(f"freed {human(size)}")
    return 0
