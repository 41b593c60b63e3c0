"""draftwise: lossless speculative decoding — one decode loop, every drafting method."""

import os as _os

# Before torch loads GNU OpenMP: its threads spin ~300k iterations (milliseconds) after each torch op, and
# between torch ops the kernel's own threads (kernels/csrc/pool.h) run the matmuls; a spinning OpenMP
# thread takes a core from them. A short spin: Qwen 1.5B, 60-token prompt, prefill 1.4-1.9 s -> 1.2-1.4 s
# (AMD Zen 3, 2 threads). Only when unset, and only if torch is not imported yet.
_os.environ.setdefault("GOMP_SPINCOUNT", "2000")

from .api import DEFAULT_DRAFT, DEFAULT_TARGET, METHODS, GenerationResult, SpeculativeDecoder  # noqa: E402
from .decode import Decoder, FixedGamma  # noqa: E402
from .errors import DraftwiseError  # noqa: E402
from .models import load_model  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .sequence import GenerationStats, Sequence  # noqa: E402

__version__ = "0.1.0"
__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "METHODS", "Decoder", "DraftwiseError", "FixedGamma",
           "GenerationResult", "GenerationStats", "SamplingParams", "Sequence", "SpeculativeDecoder",
           "load_model"]
