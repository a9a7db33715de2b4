"""Typed errors. The CLI prints each as one line; set MLA_CONVERT_TRACEBACK=1 for the traceback."""


class ConvertError(Exception):
    """Base class: a problem the user can act on. The message names the file/tensor and the fix."""

    exit_code = 2
    # The message as the command line names its options (`--target gaudi2`), where it names some: the
    # message itself names them as the library's keywords do (`target='gaudi2'`). The CLI prints this.
    flags: str | None = None


def with_flags(error: ConvertError, flags: str) -> ConvertError:
    """`error` with its command-line wording (ConvertError.flags)."""
    error.flags = flags
    return error


class OptionError(ConvertError):
    """An option refused, worded both ways (ConvertError.flags)."""

    def __init__(self, message: str, flags: str):
        super().__init__(message)
        self.flags = flags


class SourceError(ConvertError):
    """The source checkpoint is missing, unsupported or malformed."""


class OutputError(ConvertError):
    """The output location cannot be used (not empty, overlaps the source, disk full, ...)."""


class VerificationError(ConvertError):
    """Verification could not run (not a conversion output, unreadable input)."""


class UploadError(ConvertError):
    """An upload to the Hub was refused or failed (the directory, the token, the repo, the network)."""


def network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' own transport errors (no network, DNS, a refused or dropped connection),
    which huggingface_hub lets through from some calls; only from client modules already imported."""
    import sys

    found = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def first_line(e: BaseException) -> str:
    """'TypeName: the first line of its message' (at most 160 characters of it), for a reason that
    has to fit in one line of a summary."""
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"
