"""Typed errors: the CLI turns each into one line and exit code 2, the server into an OpenAI error object."""


class FastdecodeError(Exception):
    """A user's mistake or a bad input file; never a bug in fastdecode."""


class ModelFileError(FastdecodeError):
    """A model file or directory that is missing, truncated or malformed."""


class UnsupportedModelError(FastdecodeError):
    """An architecture, tensor type or tokenizer we do not implement."""


class InvalidRequestError(FastdecodeError):
    """Bad sampling parameters, or a prompt that does not fit the context."""


class EngineUnavailable(Exception):
    """The engine that was serving a request went away (a cluster's replica died mid-stream): not the request's
    fault, so the server answers 503 and the client may retry."""
