"""Errors the EAGLE trainer raises with a clear message."""


class EagleTrainError(Exception):
    """Base class: the CLI prints the message and exits with status 2."""


class UnsupportedTargetError(EagleTrainError):
    """The target's architecture (or an attention/rope variant) is not supported."""


class HiddenSizeMismatchError(EagleTrainError):
    """A head, resume state or feature cache does not match the target's hidden size."""


class NotEnoughDataError(EagleTrainError):
    """Too few training tokens / sequences to train and hold out a validation split."""
