"""pagedllm: LLM generation with continuous batching over a paged KV cache."""

from .errors import ModelLoadError, PagedLLMError, UnsupportedModelError
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ModelLoadError", "UnsupportedModelError",
           "PagedLLMError"]
__version__ = "0.1.0"
