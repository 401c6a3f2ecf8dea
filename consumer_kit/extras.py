"""The one install hint for an optional dependency that is missing."""

from __future__ import annotations


def missing_extra(extra: str, what: str, exc: ModuleNotFoundError) -> ImportError:
    """The error to raise (``from exc``) when ``what`` needs the ``extra`` and ``exc.name`` is not
    installed: it names the module, the extra and the command that installs it."""
    return ImportError(f"{what} needs the '{extra}' extra ({exc.name} is not installed): "
                       f"pip install 'consumer-kit[{extra}]'", name=exc.name)
