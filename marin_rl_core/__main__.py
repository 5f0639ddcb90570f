"""``python -m marin_rl_core`` is the ``marinrl`` command."""

from marin_rl_core.cli.app import main

main()
