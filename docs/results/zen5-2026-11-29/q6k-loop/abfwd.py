# ruff: noqa
# one process: forward costs T=sizes of the 1.5B (bench-forward's timing), JSON on stdout's last line
import sys, json
import draftwise  # noqa: F401
from draftwise.models import load_model
from draftwise.bench.passcost import draftwise_costs
from draftwise import kernels
sizes = [int(x) for x in sys.argv[1].split(",")]
lm = load_model("qwen2.5-coder-1.5b-instruct", "auto").model
res = draftwise_costs(lm, sizes=sizes, context=64, repeats=int(sys.argv[2]) if len(sys.argv) > 2 else 3, prefill=())
print(kernels.kernel_info()["build"], file=sys.stderr)
print(json.dumps(res))
