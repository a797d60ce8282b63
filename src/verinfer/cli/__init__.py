"""The `verinfer` command (entry point `verinfer.cli:app`); its commands live in cli/main.py."""

from verinfer.cli.main import app, main

__all__ = ["app", "main"]
