"""The README's "Testing your handlers" example, as a user runs it: the file alone in a fresh project
(no configuration, so pytest-asyncio's default strict mode), run by pytest in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_block(language: str, first_line: str) -> str:
    """The code block of ``language`` in the README's "Testing your handlers" that starts with ``first_line``."""
    section = (ROOT / "README.md").read_text().split("\n## Testing your handlers\n", 1)[1].split("\n## ", 1)[0]
    blocks = [part.split("```", 1)[0] for part in section.split(f"```{language}\n")[1:]]
    return next(block for block in blocks if block.startswith(first_line + "\n"))


def test_the_readme_example_passes_in_a_fresh_project(tmp_path: Path) -> None:
    (tmp_path / "test_orders.py").write_text(readme_block("python", "# test_orders.py"))
    (tmp_path / "pyproject.toml").write_text(readme_block("toml", "# pyproject.toml"))
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTEST_", "PYTHONPATH", "DATABASE_URL", "IDEMPOTENCY_"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_orders.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "1 passed" in output and "warning" not in output.lower(), output
    # The proofs that apply to a handler without a coordinator session, each held.
    for step in ("crash before completion", "same work again", "same work after completion",
                 "changed body, same key", "destination effects after 4 deliveries"):
        assert any(line.startswith(step) and line.endswith(" yes") for line in output.splitlines()), (step, output)
    assert "changed session field" not in output  # no session: the coordinator's proofs do not apply
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pyproject.toml", "test_orders.py"]  # nothing else
