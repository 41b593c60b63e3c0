"""draftwise serve with --prefix-cache-dir, stopped and started again between two /v1/completions of one prompt."""
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

doc = Path("doc.txt").read_text()
folder = tempfile.mkdtemp()
for i in range(2):
    p = subprocess.Popen(["draftwise", "serve", "--port", "8765", "--prefix-cache-dir", folder, "--method", "ar"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if httpx.get("http://127.0.0.1:8765/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get("http://127.0.0.1:8765/v1/models").json()["data"][0]["id"]
        t0 = time.time()
        r = httpx.post("http://127.0.0.1:8765/v1/completions", json={"model": model, "prompt": doc, "max_tokens": 16,
                       "temperature": 0}, timeout=300).json()
        print("run", i, "%.2f s" % (time.time() - t0), r["usage"], repr(r["choices"][0]["text"]))
    finally:
        p.terminate()
        p.wait()
