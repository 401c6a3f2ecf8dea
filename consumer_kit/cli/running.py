"""How the command loads an app (``module:app``) and runs a long-lived coroutine on the fastest loop."""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError

from consumer_kit.app import ConsumerApp
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import Settings, explain
from consumer_kit.signals import StopRequested, StopSignals

T = TypeVar("T")


def load_app(target: str) -> ConsumerApp:
    """Import ``module:attribute`` (the current directory is importable) and return the app; a target
    that cannot be loaded is a ConfigurationError that says why in one line."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"expected module:app (say myapp:app), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigurationError(f"cannot import {module_name!r} (from {target}): no such module here "
                                     f"(run from the directory that holds it, or install it)") from None
        raise ConfigurationError(f"importing {module_name!r} failed: {where_raised(exc)}") from None
    except (ConfigurationError, StopRequested):
        raise
    except ValidationError as exc:  # its Settings(), read from the environment
        raise ConfigurationError(f"importing {module_name!r} failed: invalid setting: {explain(exc)}") from None
    except Exception as exc:  # the app's own module raised while it was imported: say where
        raise ConfigurationError(f"importing {module_name!r} failed: {where_raised(exc)}") from None
    if not hasattr(module, attribute):
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r} (from {target})")
    app = getattr(module, attribute)
    if not isinstance(app, ConsumerApp):
        raise ConfigurationError(f"{target} is a {type(app).__name__}, not a consumer_kit.ConsumerApp")
    return app


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
