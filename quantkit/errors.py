"""The one error type quantkit raises on purpose: bad input, or a run that cannot start or continue as
asked. Each layer's errors subclass it (and keep the built-in type they refine), so a caller, the CLI's
one-line error report among them, knows quantkit's errors without importing the module that raised one."""


class QuantkitError(Exception):
    """An error quantkit raised on purpose; its message is the whole story for the user."""


class CheckpointError(QuantkitError, ValueError):
    """A checkpoint that is missing, corrupt or does not match what it should contain."""
