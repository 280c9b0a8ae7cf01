"""The exceptions jtile raises. Every user-facing failure is a `JtileError`."""


class JtileError(Exception):
    """Base class of every error jtile raises on purpose."""


class ConfigError(JtileError, ValueError):
    """A transform, selector or command was given a bad argument."""


class UnsupportedError(JtileError, NotImplementedError):
    """The user asked for something jtile cannot do for this layer or op."""


class OnnxError(JtileError):
    """An ONNX model could not be imported or exported."""


class KernelsUnavailableWarning(UserWarning):
    """jtile's C kernels are not built or not found, so `"auto"` keeps XLA."""


def reject_unknown(where: str, unknown: dict, known: tuple[str, ...]) -> None:
    """Raise `ConfigError` naming the unknown keywords and the valid ones."""
    if unknown:
        names = ", ".join(sorted(unknown))
        raise ConfigError(
            f"{where}: unknown keyword(s) {names}; valid keywords are {', '.join(known)}"
        )


def require_positive_int(where: str, name: str, value) -> int:
    """Return `value` if it is a positive int, else raise `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} must be a positive int, got {value!r}")
    return value
