"""Errors a user can cause. The CLI and the server turn these into clear messages, never tracebacks."""


class DraftwiseError(Exception):
    """Base class: a problem with what the user asked for (bad input, unknown model, ...)."""


class ModelNotFoundError(DraftwiseError):
    pass


class IncompatibleModelsError(DraftwiseError):
    pass


class InvalidParameterError(DraftwiseError, ValueError):
    pass


class PromptTooLongError(InvalidParameterError):
    pass


class DownloadError(DraftwiseError):
    pass
