import time, torch, statistics
from draftwise.api import SpeculativeDecoder, setup_threads
from draftwise.kernels import QLinear
setup_threads(2)
dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", progress=False)
def wbytes(model):
    return sum(b.numel()*b.element_size() for n, m in model.named_modules() if isinstance(m, QLinear) for b in list(m.buffers())+list(m.parameters()))
ms = {"draft": dw.draft.model, "target": dw.target.model}
caches = {}
for n, m in ms.items():
    caches[n] = m.new_cache(1, 1024); m.forward(torch.randint(0, 30000, (1, 64)), caches[n], logits_for="last")
res = {n: [] for n in ms}
for r in range(30):
    for n, m in ms.items():
        caches[n].set_lengths([64])
        t = time.perf_counter(); m.forward(torch.tensor([[100 + r]]), caches[n], logits_for="last"); res[n].append(time.perf_counter() - t)
for n, m in ms.items():
    b = wbytes(m); t = statistics.median(res[n])
    print(n, f"{b/1e6:.0f} MB {t*1e3:.2f} ms {b/t/1e9:.1f} GB/s")
