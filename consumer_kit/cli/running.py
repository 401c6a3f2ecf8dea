"""How the command loads an app (``module:app`` or ``path/to/file.py:app``) and runs a long-lived
coroutine on the fastest loop. Nothing here imports the app's machinery until an app is loaded."""

from __future__ import annotations

import gc
import importlib
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from consumer_kit.errors import ConfigurationError

if TYPE_CHECKING:
    import asyncio

    from consumer_kit.app import ConsumerApp
    from consumer_kit.settings import Settings
    from consumer_kit.signals import StopSignals

T = TypeVar("T")


def load_app(target: str, *, app_dir: str | None = None) -> ConsumerApp:
    """Import ``module:attribute`` or ``path/to/file.py:attribute`` and return the app; a target that
    cannot be loaded is a ConfigurationError that says why in one line.

    A module is looked up on ``sys.path`` with ``app_dir`` (else the current directory) in front, as
    uvicorn does. A file (relative to ``app_dir``, else the current directory) is imported under its
    dotted name from the first folder above it that is no package, that folder put in front of
    ``sys.path``, as FastStream does: the packages between make the name, so its relative imports work."""
    location, _, attribute = target.rpartition(":")
    if not location or not attribute:
        raise ConfigurationError(f"expected module:app or path/to/file.py:app (say myapp:app), got {target!r}")
    folder = os.path.abspath(app_dir if app_dir is not None else os.getcwd())
    file = None
    if location.endswith(".py") or "/" in location or os.sep in location:
        file = _python_file(Path(folder, location), target)
        folder, module_name = _importable(file)
    else:
        module_name = location
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = _import(module_name, target)
    if file is not None and Path(module.__file__ or "").resolve() != file:
        raise ConfigurationError(f"{location} would be imported as {module_name!r}, which is another module "
                                 f"({module.__file__}): rename the file")
    if not hasattr(module, attribute):
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r} (from {target})")
    app = getattr(module, attribute)
    from consumer_kit.app import ConsumerApp

    if not isinstance(app, ConsumerApp):
        raise ConfigurationError(f"{target} is a {type(app).__name__}, not a consumer_kit.ConsumerApp")
    return app


def _python_file(path: Path, target: str) -> Path:
    if not path.is_file():
        raise ConfigurationError(f"there is no file {os.path.relpath(path)} (from {target})")
    if path.suffix != ".py":
        raise ConfigurationError(f"{os.path.relpath(path)} is not a Python file (from {target})")
    return path.resolve()


def _importable(file: Path) -> tuple[str, str]:
    """The folder to import ``file`` from, and its dotted module name there."""
    parts, folder = [file.stem], file.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return str(folder), ".".join(parts)


def _import(module_name: str, target: str) -> Any:
    from pydantic import ValidationError

    from consumer_kit.settings import explain
    from consumer_kit.signals import StopRequested

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigurationError(f"cannot import {module_name!r} (from {target}): no such module here "
                                     f"(run from the directory that holds it, give --app-dir, or install "
                                     f"it)") from None
        raise ConfigurationError(f"importing {module_name!r} failed: {where_raised(exc)}") from None
    except (ConfigurationError, StopRequested):
        raise
    except ValidationError as exc:  # its Settings(), read from the environment
        raise ConfigurationError(f"importing {module_name!r} failed: invalid setting: {explain(exc)}") from None
    except Exception as exc:  # the app's own module raised while it was imported: say where
        raise ConfigurationError(f"importing {module_name!r} failed: {where_raised(exc)}") from None


def where_raised(exc: BaseException) -> str:
    """``Type: message (file, line N)`` of the innermost frame in the app's own code."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in frame.filename and not frame.filename.startswith("<frozen")]
    place = f" ({os.path.relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        place = f" ({os.path.relpath(exc.filename)}, line {exc.lineno})"
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}{place}"


def settings_from_env() -> Settings:
    """The settings of a command that runs no app: the environment's."""
    from consumer_kit.settings import Settings

    return Settings.from_env()


async def with_stop(signals: StopSignals, main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """``main(stop)``, with ``stop`` set by SIGTERM/SIGINT from inside the loop (or already, if one came
    while the loop was being made)."""
    return await main(signals.event())


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a long-lived service coroutine (a worker, the relay, the coordinator) on the fastest event
    loop installed: the worker's own CPU is mostly spent in the loop and the drivers under it."""
    # What is alive now (modules, the app and its settings) lives as long as the process: move it out
    # of the collector's generations, so that the full collections a busy worker triggers scan only
    # what was made since (measured: a full pass over the startup heap took ~0.1 s on a 2-core host).
    import asyncio

    gc.freeze()
    with asyncio.Runner(loop_factory=fast_loop_factory()) as runner:
        return runner.run(main)


def fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (a dependency except on Windows), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
