import json
P = {1: 32, 2: 36.4, 3: 39.6, 4: 42.9, 5: 48.8, 6: 54.7, 7: 60.6, 8: 66.5, 9: 72.9}
OPT = False  # True: an oracle stop at the first wrong token (the bound)
CD = 0.35 * 32
data = json.load(open("tf.json"))
def run(rows, G, th, cum):
    toks = time = 0.0
    for r in rows:
        t, arg, conf = r["target"], r["arg"], r["conf"]
        n = len(t); i = 0
        while i < n:
            k = 0; a = None; c = 1.0
            for j in range(G):
                if i + j >= n: break
                k += 1
                c = c * conf[i + j] if cum else conf[i + j]
                if arg[i + j] != t[i + j]:
                    a = j
                    if c >= th and not OPT: k = min(G, n - i)   # diverged, not stopped: pessimistic, drafts to G
                    break
                if c < th: break
            if a is None: a = k
            time += k * CD + P[k + 1]; toks += a + 1; i += a + 1
    return toks / time * 1000
base = 1000 / P[1]
for name, sel in (("code", lambda r: r["cat"] == "code"), ("spec", lambda r: r["cat"] != "code")):
    rows = [r for r in data if sel(r)]
    print(name, "no stop best", max(round(run(rows, G, 0, False) / base, 3) for G in range(1, 9)))
    for th in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7):
        print(f"  cum {th}: G8 {run(rows, 8, th, True)/base:.3f}  best {max(run(rows, G, th, True) for G in range(1, 9))/base:.3f}")
