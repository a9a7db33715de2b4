"""Typed errors. The CLI prints each as one line; set MLA_CONVERT_TRACEBACK=1 for the traceback."""


class ConvertError(Exception):
    """Base class: a problem the user can act on. The message names the file/tensor and the fix."""

    exit_code = 2


class SourceError(ConvertError):
    """The source checkpoint is missing, unsupported or malformed."""


class OutputError(ConvertError):
    """The output location cannot be used (not empty, overlaps the source, disk full, ...)."""


class VerificationError(ConvertError):
    """Verification could not run (not a conversion output, unreadable input)."""
