"""``python -m consumer_kit.cli``: the ``consumer-kit`` command, for a Python without the script on its path."""

from consumer_kit.cli.main import main

raise SystemExit(main())
