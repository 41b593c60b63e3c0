"""llama.cpp peers (through llama-cpp-python, an optional extra): the same GGUF file, prompt ids, EOS set,
budget and thread count as the engine's methods.

- ``llama-ar``: plain greedy decoding, ``Llama.generate``.
- ``llama-pld``: llama-cpp-python's prompt-lookup speculative mode,
  ``Llama(draft_model=LlamaPromptLookupDecoding(...))``, with n-grams up to 3 and γ tokens per lookup (10
  for an adaptive γ) like ``hf-pld``.

There is no ``llama-draft``: llama-cpp-python's Python API has no speculative mode with a separate draft
*model* (``LlamaDraftModel`` is an interface whose only implementation is prompt lookup; its server offers
only ``prompt-lookup-decoding`` too), and a drafter written here would measure our code, not llama.cpp's.

The prompt goes in as token ids (no re-tokenization). Sampling is pure greedy: ``temp=0`` gives
llama.cpp's greedy sampler, and ``repeat_penalty=1.0`` (frequency/presence 0) makes the penalty stage
in front of it a no-op. Each run starts from an empty KV cache (``reset()`` first; otherwise
``Llama.generate`` would reuse the cached prompt of the previous run and skip the prefill).

llama.cpp is not batch-invariant (a token's logits depend on how many tokens share the forward pass), so
``llama-pld`` may leave ``llama-ar``'s greedy path; the report counts, per method, whether it equals
``llama-ar`` ("matches own ar") apart from the engine's own output check.

Statistics come from ``Llama.eval`` (one call = one target pass; the prompt is the first), as for the HF
peers: drafted = Σ T − prompt − (passes − 1), accepted = new tokens − passes; the time inside ``eval`` is
prefill (first pass) and verification, the rest (sampling, lookup, Python) is drafting + overhead.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import InvalidParameterError
from .peers import HF_ADAPTIVE_PLD_TOKENS, PLD_MAX_NGRAM, PeerRun
from .report import LLAMA_REFERENCE

LLAMA_PEERS = (LLAMA_REFERENCE, "llama-pld")
MIN_N_CTX = 4096  # context of every llama.cpp peer: at least this, more when a prompt + budget needs it

# instruction sets named one by one (GGML_NATIVE=OFF); AMX never: its kernels segfault on some Intel CPUs
_AVX2_FLAGS = (("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"))
_AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what ggml's GGML_AVX512 compiles for
_AVX512_FLAGS = (("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                 ("avx512_bf16", "GGML_AVX512_BF16"))
_NO_AMX = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def safe_cmake_args(cpuinfo: str | None = None) -> str:
    """CMAKE_ARGS for a llama-cpp-python build that runs on this CPU: what /proc/cpuinfo lists, AMX off.
    The same choice as ``install.sh --peers`` (a test keeps the two equal)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    args = ["-DGGML_NATIVE=OFF"]
    if "avx2" in flags:
        args += ["-DGGML_AVX=ON", "-DGGML_AVX2=ON"] + [f"-D{opt}=ON" for f, opt in _AVX2_FLAGS if f in flags]
    elif "avx" in flags:
        args += ["-DGGML_AVX=ON", "-DGGML_AVX2=OFF"]
    if all(f in flags for f in _AVX512_BASE):
        args += ["-DGGML_AVX512=ON"] + [f"-D{opt}=ON" for f, opt in _AVX512_FLAGS if f in flags]
    return " ".join(args + [_NO_AMX])


def require_llama_cpp(methods: list[str] | tuple[str, ...] = LLAMA_PEERS):
    """The ``llama_cpp`` module, or one clear error line saying how to install it (never a traceback)."""
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401  (llama-pld's drafter)
    except ImportError:
        why = "is not installed"
    except (OSError, RuntimeError) as e:  # installed, but its shared library does not load
        why = f"does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    else:
        return llama_cpp
    raise InvalidParameterError(
        f"{', '.join(methods)} need llama-cpp-python, which {why}: run ./install.sh --peers, or "
        f'CMAKE_ARGS="{safe_cmake_args()}" pip install --no-binary llama-cpp-python -e ".[peers]"')


def gguf_path(src: Path | str) -> Path:
    """The GGUF file llama.cpp loads: the target as the registry resolved it (an HF folder or hub id cannot be
    read by llama.cpp)."""
    p = Path(src)
    if not (p.is_file() and p.suffix == ".gguf"):
        raise InvalidParameterError(f"the llama.cpp peers need a GGUF target (a named model or FILE.gguf), "
                                    f"not {src}")
    return p


def context_size(needed: int, max_context: int) -> int:
    """n_ctx for prompts of up to ``needed`` tokens with their budget: at least MIN_N_CTX (a multiple of 256),
    never above the model's context unless the need itself is."""
    return max(needed, min(max(MIN_N_CTX, -(-needed // 256) * 256), max_context))


class LlamaPeers:
    """One llama.cpp context per peer on the same GGUF file (the weights are mmapped once, shared).

    Two contexts, not one, because llama-cpp-python fixes the drafter at construction and, with one,
    computes and copies the logits of every position (``logits_all``) — a cost ``llama-ar`` should not pay.
    Loading waits for :meth:`load`, when the longest prompt is known and n_ctx can be sized to it.
    """

    def __init__(self, model_path: Path | str, methods: list[str], gamma: int | str, eos_ids: frozenset[int],
                 threads: int):
        unknown = [m for m in methods if m not in LLAMA_PEERS]
        if unknown:
            raise InvalidParameterError(f"unknown peer {unknown[0]!r}; choose from {', '.join(LLAMA_PEERS)}")
        self.llama_cpp = require_llama_cpp(methods)
        self.model_path = gguf_path(model_path)
        self.methods = list(methods)
        self.gamma = gamma
        self.eos_ids = frozenset(eos_ids)
        self.threads = max(1, int(threads))
        self.n_ctx = 0  # 0: not loaded
        self.models: dict = {}
        self.passes: list[tuple[int, float]] = []  # (T tokens fed, seconds) per eval of the current run

    def pld_tokens(self) -> int:
        return self.gamma if isinstance(self.gamma, int) else HF_ADAPTIVE_PLD_TOKENS

    def load(self, n_ctx: int) -> None:
        """Create the contexts (n_ctx tokens each); again only if a larger context is asked for."""
        if n_ctx <= self.n_ctx:
            return
        self.close()
        for m in self.methods:
            kw = {}
            if m == "llama-pld":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                kw["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=PLD_MAX_NGRAM,
                                                              num_pred_tokens=self.pld_tokens())
                # a drafter turns logits_all on inside Llama, but (0.3.36) its logits buffer is sized from this
                # argument: without it, n_batch (512) rows, and a prompt over 512 tokens fails at its second
                # prefill chunk ("could not broadcast ... into shape (0,)"). Same computation, right-sized.
                kw["logits_all"] = True
            try:
                llm = self.llama_cpp.Llama(model_path=str(self.model_path), n_ctx=n_ctx, n_threads=self.threads,
                                           n_threads_batch=self.threads, verbose=False, **kw)
            except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
                raise InvalidParameterError(f"llama.cpp could not load {self.model_path}: {e}") from None
            llm.eval = self._timed(llm)  # an instance attribute: Llama.generate's self.eval(...) finds it
            self.models[m] = llm
        self.n_ctx = n_ctx

    def _timed(self, llm):
        """``llm.eval`` that records (tokens fed, seconds) per call: one call is one target pass."""
        inner = type(llm).eval

        def timed_eval(tokens):
            t0 = time.perf_counter()
            inner(llm, tokens)
            if len(tokens):
                self.passes.append((len(tokens), time.perf_counter() - t0))

        return timed_eval

    def settings(self) -> dict:
        """What each llama peer was asked for (goes into results.json's config)."""
        common = {"n_ctx": self.n_ctx, "n_threads": self.threads, "model_path": str(self.model_path),
                  "sampler": "greedy (temp 0, repeat_penalty 1.0)"}
        s: dict = {m: dict(common) for m in self.methods}
        if "llama-pld" in s:
            s["llama-pld"].update(draft_model="LlamaPromptLookupDecoding", num_pred_tokens=self.pld_tokens(),
                                  max_ngram_size=PLD_MAX_NGRAM)
        s["llama_cpp"] = {"version": getattr(self.llama_cpp, "__version__", None)}
        info = getattr(self.llama_cpp, "llama_print_system_info", None)
        if info is not None:
            raw = info()
            s["llama_cpp"]["system_info"] = (raw.decode() if isinstance(raw, bytes) else str(raw)).strip()
        return s

    def generate(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0) -> PeerRun:
        if method not in self.models:
            raise InvalidParameterError(f"llama peer {method!r} was not loaded; loaded: {', '.join(self.models)}")
        if len(prompt_ids) + max_new_tokens > self.n_ctx:
            raise InvalidParameterError(f"prompt {len(prompt_ids)} + max_tokens {max_new_tokens} tokens > the "
                                        f"llama.cpp context {self.n_ctx}")
        llm = self.models[method]
        # greedy: llama.cpp's greedy sampler (temp 0); sampling: plain softmax at T (no top-k/p, min-p, typical)
        sampling = dict(temp=0.0, top_k=1) if temperature <= 0 else dict(temp=temperature, top_k=0)
        llm.reset()  # an empty KV cache: the prefill is part of every run, as for the other methods
        self.passes = []
        new: list[int] = []
        t0 = time.perf_counter()
        gen = llm.generate(list(prompt_ids), top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                           frequency_penalty=0.0, presence_penalty=0.0, reset=True, **sampling)
        try:
            for tok in gen:
                new.append(int(tok))
                if new[-1] in self.eos_ids or len(new) >= max_new_tokens:
                    break
        finally:
            gen.close()
        wall = time.perf_counter() - t0
        passes = self.passes
        fed = sum(T for T, _ in passes)
        drafted = max(0, fed - len(prompt_ids) - (len(passes) - 1)) if passes else 0
        return PeerRun(token_ids=new, finish_reason="stop" if new and new[-1] in self.eos_ids else "length",
                       wall_s=wall, target_passes=len(passes), drafted=drafted,
                       accepted=max(0, len(new) - len(passes)) if drafted else 0,
                       prefill_s=passes[0][1] if passes else 0.0, verify_s=sum(s for _, s in passes[1:]),
                       past_eos=0)

    def close(self) -> None:
        for llm in self.models.values():
            if hasattr(llm, "close"):
                llm.close()
        self.models = {}
        self.n_ctx = 0


__all__ = ["LLAMA_PEERS", "LLAMA_REFERENCE", "LlamaPeers", "context_size", "gguf_path", "require_llama_cpp",
           "safe_cmake_args"]
