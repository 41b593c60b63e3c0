"""``draftwise cache ls|rm``: what draftwise keeps in $DRAFTWISE_HOME (models/cache.py)."""

from __future__ import annotations

from ..models import cache

HELP = "list (ls) or remove (rm) what draftwise keeps in $DRAFTWISE_HOME"
add_arguments = cache.add_arguments
run = cache.cmd_cache
