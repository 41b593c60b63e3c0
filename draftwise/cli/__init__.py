"""The command line (``draftwise``): ``main.py`` holds the table of commands, ``common.py`` the options
and argument types they share, ``render.py`` the coloured output, and each command has its own module.

The dependency rule (tests/test_layers.py checks it): the CLI imports the library, the server and the
benchmark; nothing imports the CLI.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
