"""The exceptions Lumen raises. Every user-facing failure is one of these, with a message a user can act on.
ContextWarning is the one warning: the API warns where the command-line tools refuse."""


class LumenError(Exception):
    """Base class of every error Lumen raises on purpose."""


class GGUFError(LumenError, ValueError):
    """A GGUF file is corrupt, truncated, inconsistent or uses something Lumen does not support."""


class UnsupportedError(GGUFError):
    """A valid GGUF file that uses a quant type, architecture or tensor layout Lumen does not support."""


class FetchError(LumenError):
    """A model could not be fetched or verified."""


class ContextError(LumenError, ValueError):
    """A request does not fit in the context window."""


class ContextWarning(UserWarning):
    """A context length beyond the one the model was trained on (the CLIs refuse it unless --force-ctx)."""


def plural(n: int, noun: str) -> str:
    """'1 token', '2 tokens', '0 tokens': a count and its noun, as a message says them."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
