"""Typed errors. The library raises these; only the CLI turns them into messages and exit codes."""


class CabinlmError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class ModelError(CabinlmError):
    """The model source cannot be found, read or is not supported."""


class ManifestError(CabinlmError):
    """An artifact's manifest is missing, corrupt, of an unknown version, or does not match its files."""


class LayoutError(CabinlmError):
    """A cache layout (sink, pinned, window, chunk) is invalid for the model."""


class InputError(CabinlmError):
    """Runtime input that cannot be processed (prompt too long, pinned region full, ...)."""


class OptionError(CabinlmError):
    """An option has a value that cannot work (out of range, or beyond what this machine holds); the
    message names the option and the value. Checked before anything heavy is loaded."""


class BuildError(CabinlmError):
    """The build cannot be done here or for this artifact."""
