"""The exceptions Lumen raises. Every user-facing failure is one of these, with a message a user can act on.
ContextWarning is the one warning: the API warns where the command-line tools refuse."""
import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


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


def user_stacklevel() -> int:
    """warnings.warn's stacklevel for its caller that names the first frame outside Lumen, the user's line, however
    deep the call (stacklevel=2 in lumen.Model named lumen.load's own line when the user called load)."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, level = f.f_back, level + 1
    return level
