"""The n-gram table of these runs: over the Python standard library's sources (tests, idlelib and lib2to3 left out),
the most frequent next token after each context of 1 .. n - 1 tokens, with its count."""
import collections
import glob
import sysconfig
import time
from pathlib import Path


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(root + "/*.py") + glob.glob(root + "/*/*.py")
    return [f for f in files if "/test" not in f and "/idlelib" not in f and "lib2to3" not in f]


def table(tok, n: int) -> list:
    """best[c][context of c tokens] = (next token, count), c = 1 .. n - 1 (best[0] is None)."""
    t0 = time.time()
    ids = [tok.encode(Path(f).read_text(encoding="utf-8", errors="replace")) for f in stdlib_files()]
    print("tokenized", sum(map(len, ids)), "tokens in %.1f s" % (time.time() - t0))
    cnt = [collections.defaultdict(collections.Counter) for _ in range(n)]
    for s in ids:
        for e in range(1, len(s)):
            for c in range(1, min(n - 1, e) + 1):
                cnt[c][tuple(s[e - c:e])][s[e]] += 1
    best = [None] + [{k: v.most_common(1)[0] for k, v in cnt[c].items()} for c in range(1, n)]
    print("table sizes", [len(b) for b in best[1:]], "built in %.1f s" % (time.time() - t0))
    return best
