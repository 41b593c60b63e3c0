import json, sys
P = {1: 32, 2: 36.4, 3: 39.6, 4: 42.9, 5: 48.8, 6: 54.7, 7: 60.6, 8: 66.5, 9: 72.9}
CD = 0.35 * 32
data = json.load(open("tf.json"))
def run(rows, G, th, after="G"):
    toks = time = 0.0
    for r in rows:
        t, arg, conf = r["target"], r["arg"], r["conf"]
        n = len(t); i = 0
        while i < n:
            k = 0; a = None
            for j in range(G):
                if i + j >= n: break
                k += 1
                ok = arg[i + j] == t[i + j]
                if not ok and a is None:
                    a = j
                    if conf[i + j] < th: break
                    if after == "stop": break
                    # diverged: unknown confidences, continue to G (pessimistic)
                    k = min(G, n - i); break
                if conf[i + j] < th: break
            if a is None: a = k
            time += k * CD + P[k + 1]
            toks += a + 1; i += a + 1
    return toks / time * 1000
base = 1000 / P[1]
for name, sel in (("code", lambda r: r["cat"] == "code"), ("spec", lambda r: r["cat"] != "code")):
    rows = [r for r in data if sel(r)]
    best = max((run(rows, G, 0.0), G) for G in range(1, 9))
    print(name, "no stop: best G", best[1], f"{best[0]/base:.3f}x", " ".join(f"G{G}:{run(rows,G,0)/base:.2f}" for G in range(1,9)))
    for th in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        b = max((run(rows, G, th), G) for G in range(1, 9))
        print(f"  th {th}: best G {b[1]} {b[0]/base:.3f}x   G8 {run(rows,8,th)/base:.3f}x")
