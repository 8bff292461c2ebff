"""Errors a user can act on. Each says what went wrong, with which file, and what is supported."""


class PagedLLMError(Exception):
    """Base class for pagedllm's own errors."""


class ModelLoadError(PagedLLMError, ValueError):
    """A model could not be loaded: missing, corrupt or truncated file, or an unsupported model."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint names an architecture or a feature pagedllm does not implement."""


class RequestRejected(PagedLLMError, ValueError):
    """A request that can never be served as given (too long, bad token ids, bad parameters).
    Nothing was queued. ``param`` is the request field to blame and ``code`` a machine-readable
    reason, as in OpenAI's error body; the server answers 400 with both."""

    status = 400

    def __init__(self, message: str, *, param: str | None = "prompt", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class CacheDoesNotFitError(PagedLLMError, MemoryError):
    """The requested engine does not fit the memory budget. ``breakdown`` holds what each part
    needs in bytes, ``suggestions`` the largest values that would fit."""

    def __init__(self, message: str, breakdown: dict, suggestions: dict):
        super().__init__(message)
        self.breakdown = breakdown
        self.suggestions = suggestions


class QueueFull(PagedLLMError):
    """More requests are waiting than the server accepts; the client should retry later."""


class EngineStopped(PagedLLMError):
    """The engine (its thread or its process) has failed: nothing more will run in this server."""


class RankLost(PagedLLMError, RuntimeError):
    """Another rank of the split model died or stopped answering: the engine cannot step."""
