"""The exceptions and warnings jtile raises, and the checks every transform
shares. Every user-facing failure is a `JtileError`; the classes are
re-exported from `jtile` and print as `jtile.ConfigError` etc."""

from collections.abc import Callable


class JtileError(Exception):
    """Base class of every error jtile raises on purpose."""

    __module__ = "jtile"


class ConfigError(JtileError, ValueError):
    """A transform, selector or command was given a bad argument."""

    __module__ = "jtile"


class UnsupportedError(JtileError, NotImplementedError):
    """The user asked for something jtile cannot do for this layer or op."""

    __module__ = "jtile"


class OnnxError(JtileError):
    """An ONNX model could not be imported or exported."""

    __module__ = "jtile"


class KernelsUnavailableWarning(UserWarning):
    """jtile's C kernels are not built or not found, so `"auto"` keeps XLA."""

    __module__ = "jtile"


class StaleKernelsWarning(UserWarning):
    """The kernel library loaded is older than the kernel sources of the
    checkout being run: it may not be what those sources say."""

    __module__ = "jtile"


def reject_unknown(where: str, unknown: dict, known: tuple[str, ...]) -> None:
    """Raise `ConfigError` naming the unknown keywords and the valid ones."""
    if unknown:
        names = ", ".join(sorted(unknown))
        raise ConfigError(
            f"{where}: unknown keyword(s) {names}; valid keywords are {', '.join(known)}"
        )


def reject_positional(where: str, fn: Callable | None, positional: tuple, usage: str) -> None:
    """Raise `ConfigError` unless `fn` is a function (or None, for the decorator
    form) and no configuration came positionally; `usage` shows the keywords,
    e.g. `"axis='H', tiles=4"`."""
    if fn is not None and not callable(fn):
        problem = f"expected a function to transform, got {fn!r}"
    elif positional:
        problem = f"got {', '.join(repr(a) for a in positional)} positionally"
    else:
        return
    if not usage:
        raise ConfigError(f"{where}: {problem}; write {where}(fn) or @{where}")
    raise ConfigError(
        f"{where}: {problem}; the configuration is keyword-only: write {where}(fn, {usage}), "
        f"or @{where}({usage}) as a decorator"
    )


def require_positive_int(where: str, name: str, value) -> int:
    """Return `value` if it is a positive int, else raise `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} must be a positive int, got {value!r}")
    return value
