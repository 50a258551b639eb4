"""Every error the api raises on purpose, in one place.

Each says what is wrong in one line that names the field, file or directory at fault;
the `purestep` command prints it without a traceback and exits with code 2.

    ConfigError      a config field (`error.field`, dotted) and where it came from (`error.source`)
    CheckpointError  a checkpoint missing, incomplete, corrupted, or not fitting what it loads into
    RunDirError      a run directory that cannot be used as asked (held by another run, nothing to resume)
    UsageError       a command-line mistake (no such run directory, nothing to plot)

and `check_int`, the argument check the api's own functions share (a ValueError naming it).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used: `field` is the dotted path of the bad field ("" for
    the whole file), `source` the file or `--set` override the value came from."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field, self.message, self.source = field, message, source
        super().__init__(": ".join(part for part in (source, field, message) if part))

    def at(self, source: str | None) -> "ConfigError":
        """The same error, said to come from `source`."""
        return ConfigError(self.field, self.message, source)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit what it is loaded into.

    The message is one line and starts with the path at fault.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (held by another run, nothing to resume, a damaged metrics file)."""


class UsageError(ValueError):
    """A command-line mistake (missing run directory, nothing to plot...)."""


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """`value`, an int (not a bool) >= `minimum`, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
