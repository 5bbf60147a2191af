"""Errors raised for bad input. Each message names what was wrong and where."""


class DFlashError(Exception):
    """Base class for every error dflash-robot raises on bad input."""


class DraftLoadError(DFlashError):
    """A draft checkpoint is missing, truncated, corrupt or malformed."""


class IncompatibleDraftError(DFlashError):
    """A draft does not fit the target it was paired with."""


class TargetLoadError(DFlashError):
    """A target model could not be loaded."""


class UnsupportedModelError(DFlashError):
    """The target or draft uses a feature this runtime refuses rather than risk wrong tokens."""


class ConfigError(DFlashError, ValueError):
    """A runtime or sampling setting is out of range."""
