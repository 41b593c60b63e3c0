"""A llama.cpp peer alone in a process (run by path from footprint.py; imports llama-cpp-python only, no
torch, no draftwise): load the GGUF with the benchmark's settings, generate greedily, print one JSON line
with load and generation times and the process's peak RSS (VmHWM)."""

import json
import sys
import time


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    spec = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    import llama_cpp

    t_import = time.perf_counter() - t0
    kw = {}
    if spec["method"] == "llama-pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=spec["max_ngram"],
                                                      num_pred_tokens=spec["pld_tokens"])
        kw["logits_all"] = True  # as llama_peers.py (llama-cpp-python 0.3.36 sizes its buffer from it)
    t1 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=spec["n_ctx"], n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], verbose=False, **kw)
    load = time.perf_counter() - t1
    eos = set(spec["eos_ids"])
    new = []
    t2 = time.perf_counter()
    gen = llm.generate(list(spec["ids"]), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                       repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, reset=True)
    for tok in gen:
        new.append(int(tok))
        if new[-1] in eos or len(new) >= spec["max_tokens"]:
            break
    gen.close()
    out = {"import_s": t_import, "load_s": load, "generate_s": time.perf_counter() - t2, "new_tokens": len(new),
           "peak_rss_mb": peak_rss_mb()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
