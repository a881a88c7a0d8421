"""The typed errors etblocks raises. Each message names the value and what is accepted."""


class EtblocksError(Exception):
    """Base class of every error etblocks raises on purpose."""


class UnsupportedModelError(EtblocksError):
    """The model, or one of its modules, cannot be swapped (unknown family or failed probe)."""


class ConfigError(EtblocksError, ValueError):
    """An option or config file holds a value etblocks does not accept."""


class AdapterMismatchError(EtblocksError):
    """An adapter does not fit the model it is loaded into."""


class BackendUnavailableError(EtblocksError):
    """The backend is known but cannot be used on this machine (package or SDK missing)."""


class ContextOverflowError(EtblocksError):
    """A prompt or generation would run past the program's context length."""
