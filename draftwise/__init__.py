"""draftwise: lossless speculative decoding — one decode loop, every drafting method."""

from . import settings as _settings

_settings.openmp_spin_default()  # before torch loads GNU OpenMP (see its docstring)

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
