"""How quickly the command answers: ``consumer-kit --help`` and ``import consumer_kit``, each against the
same thing done eagerly, in the same run.

``import consumer_kit`` gives its public names lazily (PEP 562), and the command's parser imports
nothing a command runs with. The peer of each is the eager form, what both did before: every public
name resolved at import (``[getattr(consumer_kit, name) for name in __all__]``: SQLAlchemy's asyncio
layer, the store, the embedded coordinator), then the same parser. ``uvicorn --help`` is printed beside
them for scale: the command users of uvicorn compare us with.

Each measurement is a fresh interpreter; rounds alternate contenders (in a rotating order, since the
machine's load drifts). Printed: the median wall time and the median CPU time (user + system of the
child, which moves far less with the neighbours' load than wall time), and the ratio of CPU medians
against the eager peer (target: at most 1/3).

Run: ``python -m bench cli`` (``CK_BENCH_CLI_ROUNDS``, default 15).
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("CK_BENCH_CLI_ROUNDS", "15"))
TARGET = 1 / 3
EAGER = "import consumer_kit; [getattr(consumer_kit, name) for name in consumer_kit.__all__]"
HELP = "from consumer_kit.cli import main; main(['--help'])"

CONTENDERS: dict[str, list[str]] = {
    "import consumer_kit": [sys.executable, "-c", "import consumer_kit"],
    "import, eager": [sys.executable, "-c", EAGER],
    "consumer-kit --help": [sys.executable, "-m", "consumer_kit.cli", "--help"],
    "--help, eager": [sys.executable, "-c", f"{EAGER}\n{HELP}"],
}
PAIRS = (("import consumer_kit", "import, eager"), ("consumer-kit --help", "--help, eager"))
UVICORN = shutil.which("uvicorn", path=os.path.dirname(sys.executable))
if UVICORN:
    CONTENDERS["uvicorn --help"] = [UVICORN, "--help"]


def _once(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``argv`` in a fresh process (its output discarded)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure() -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of each contender over ``ROUNDS`` rotating rounds."""
    names = list(CONTENDERS)
    for name in names:  # one warm-up each: the filesystem cache and the bytecode written once
        _once(CONTENDERS[name])
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            samples[name].append(_once(CONTENDERS[name]))
    return {name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
            for name, runs in samples.items()}


async def main() -> bool:
    medians = measure()
    print(f"command start-up, {ROUNDS} rounds, a fresh interpreter each (median wall, median CPU):")
    ok = True
    for name, (wall, cpu) in medians.items():
        line = f"  {name:22} {wall * 1000:7.0f} ms wall {cpu * 1000:7.0f} ms cpu"
        for lazy, eager in PAIRS:
            if name == lazy:
                ratio = cpu / medians[eager][1]
                ok = ok and ratio <= TARGET
                met = "ok" if ratio <= TARGET else "ABOVE TARGET"
                line += f"   {ratio:5.2f}x {eager!r} (target <= {TARGET:.2f}x: {met})"
        print(line)
    return ok
