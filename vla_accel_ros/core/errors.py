"""Typed errors raised at the package's boundaries."""


class VlaAccelError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(VlaAccelError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


class BundleError(VlaAccelError):
    """A model bundle is missing, malformed or inconsistent."""


class ParityError(VlaAccelError):
    """The accelerated path disagrees with the reference forward beyond tolerance."""


class PlanError(VlaAccelError, ValueError):
    """An engine step plan is inconsistent (slots, positions, nesting, taps)."""


class ObservationError(VlaAccelError, ValueError):
    """An observation cannot be used (missing camera, wrong dtype or shape, text too long)."""


class SchedulerError(VlaAccelError, ValueError):
    """A chunk or call the scheduler cannot honour (shape, non-finite actions, rate mismatch)."""


class BagError(VlaAccelError):
    """A rosbag2 file cannot be written or read (missing, malformed, unsupported content)."""
