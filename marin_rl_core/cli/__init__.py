"""The ``marinrl`` command (:mod:`~marin_rl_core.cli.app`) and its ``report`` output
(:mod:`~marin_rl_core.cli.report`)."""

from marin_rl_core.cli.app import app, main

__all__ = ["app", "main"]
