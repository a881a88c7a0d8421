"""The typed errors etblocks raises. Each message names the value and what is accepted."""


class EtblocksError(Exception):
    """Base class of every error etblocks raises on purpose."""


class UnsupportedModelError(EtblocksError):
    """The model, or one of its modules, cannot be swapped (unknown family or failed probe)."""


class ConfigError(EtblocksError, ValueError):
    """An option or config file holds a value etblocks does not accept."""


class ProgramFileError(ConfigError):
    """A file given as an ExecuTorch program (.pte) or data file (.ptd) is missing, of another kind, truncated, or
    refused by the runtime (a `ConfigError`: the path given is the value not accepted)."""


class AdapterMismatchError(EtblocksError):
    """An adapter does not fit the model it is loaded into."""


class BackendUnavailableError(EtblocksError):
    """The backend is known but cannot be used on this machine (package or SDK missing)."""


class ContextOverflowError(EtblocksError):
    """A prompt or generation would run past the program's context length; `fits`: how many new tokens would fit
    after that prompt (when known), so each interface can say which of its settings to change."""

    def __init__(self, message: str, fits: int | None = None) -> None:
        super().__init__(message + (f" (at most {max(fits, 0)} new tokens fit)" if fits is not None else ""))
        self.fits = fits


def exception_summary(exc: BaseException) -> str:
    """`"TypeName: first line of the message"` (the type alone for an empty message): what a `ConfigError` quotes
    of a dependency's exception, whose full text may run to pages."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
