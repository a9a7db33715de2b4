"""The command line (`mla-convert`): the app and `main` in `app`, one module per command."""

from mla_convert.cli.app import app, main

__all__ = ["app", "main"]
