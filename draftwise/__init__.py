"""draftwise: lossless speculative decoding — one decode loop, every drafting method."""

from .api import DEFAULT_DRAFT, DEFAULT_TARGET, METHODS, GenerationResult, SpeculativeDecoder
from .decode import Decoder, FixedGamma
from .errors import DraftwiseError
from .models import load_model
from .sampling import SamplingParams
from .sequence import GenerationStats, Sequence

__version__ = "0.1.0"
__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "METHODS", "Decoder", "DraftwiseError", "FixedGamma",
           "GenerationResult", "GenerationStats", "SamplingParams", "Sequence", "SpeculativeDecoder",
           "load_model"]
