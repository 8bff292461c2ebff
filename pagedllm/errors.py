"""Errors a user can act on. Each says what went wrong, with which file, and what is supported."""


class PagedLLMError(Exception):
    """Base class for pagedllm's own errors."""


class ModelLoadError(PagedLLMError, ValueError):
    """A model could not be loaded: missing, corrupt or truncated file, or an unsupported model."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint names an architecture or a feature pagedllm does not implement."""
