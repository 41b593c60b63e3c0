"""The method registry: every drafting method, with what it needs, in one table that the library
(``SpeculativeDecoder``), the server, the benchmark and the command line read.

A drafter module registers its method(s) at its end::

    register(Method("pld", build=lambda dw, rows, capacity, **opts: PromptLookupDrafter(**opts),
                    help="prompt lookup", seq2seq=True, auto_child=True, tree_variant=True))

``build(dw, rows, capacity, **opts)`` makes the drafter for a ``SpeculativeDecoder`` ``dw`` (its target,
``dw.draft``, ``dw.heads(...)``, ``dw.suffix_cache`` ... are there to use), a batch of ``rows`` and
``capacity`` tokens per row; ``opts`` are the request's drafter options (``options`` below). A new method is
one file plus one ``register`` line (docs/adding-a-drafter.md); a module outside draftwise registers the
same way once imported. The built-in drafter modules are imported on the first look-up (``BUILTIN``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Callable

from ..errors import InvalidParameterError

TREE_SUFFIX = "-tree"  # "pld-tree": the same drafter proposing a token tree (``branches`` > 1)
TREE_WIDTH = 3  # a tree variant's branches when --tree-width is not given
# the drafter modules that register the built-in methods, in the order the methods are listed
BUILTIN = ("draft_model", "pld", "nasd", "suffix", "medusa", "eagle", "auto", "layerskip", "lookahead")


@dataclass(frozen=True)
class Method:
    name: str
    build: Callable  # (dw, rows, capacity, **opts) -> Drafter | None (None: plain decoding)
    help: str = ""
    draft_model: bool = False  # drafts with the draft model (--draft): loaded only for such methods
    heads: str | None = None  # drafts with trained draft heads of this kind (``draftwise train-head``)
    seq2seq: bool = False  # works with an encoder-decoder target (T5, BART, Marian; backend hf)
    auto_child: bool = False  # among the drafters method auto chooses from by default
    tree_variant: bool = False  # also register "<name>-tree": the same drafter with branches (TREE_WIDTH)
    tree: bool = False  # this is such a tree variant (its ``branches`` default to TREE_WIDTH)
    width_option: str | None = None  # the drafter option --tree-width sets (e.g. "branches", "max_nodes")
    takes_heads: bool = False  # --heads is passed on as option "heads"
    # γ: None = 'auto' is the adaptive policy; an int N = the drafter sizes its own drafts, and 'auto'
    # means a fixed policy of N (the deepest it may go)
    own_gamma: int | None = None
    options: Callable | None = None  # (width, heads, lookahead) -> drafter options, instead of the above


_METHODS: dict[str, Method] = {}
_loaded = False


def register(method: Method, *, replace_existing: bool = False) -> Method:
    """Add ``method`` (and its tree variant) to the registry; a name taken already is an error unless
    ``replace_existing``."""
    variants = [method]
    if method.tree_variant:
        variants.append(replace(method, name=method.name + TREE_SUFFIX, tree_variant=False, tree=True,
                                auto_child=False, seq2seq=False, help=f"{method.help}, as a token tree"))
    for m in variants:
        if m.name in _METHODS and not replace_existing and _METHODS[m.name] != m:
            raise ValueError(f"method {m.name!r} is registered already")
    for m in variants:
        _METHODS[m.name] = m
    return method


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in BUILTIN:
            importlib.import_module(f"{__package__}.{mod}")


def _rank(m: Method) -> int:
    """"ar" first, then the built-in methods in BUILTIN's order of their modules, then any others."""
    package, _, module = getattr(m.build, "__module__", "").rpartition(".")
    if package != __package__:
        return len(BUILTIN) + 1
    return 0 if module == "registry" else BUILTIN.index(module) + 1 if module in BUILTIN else len(BUILTIN) + 1


def methods() -> dict[str, Method]:
    """Every registered method, by name: "ar", the built-in ones (in BUILTIN's order; a method's tree
    variant right after it), then others in the order they were registered."""
    _load_builtin()
    return {m.name: m for m in sorted(_METHODS.values(), key=_rank)}  # a stable sort


def names(*, seq2seq: bool = False) -> tuple[str, ...]:
    """The method names (``seq2seq``: those an encoder-decoder target can use)."""
    return tuple(n for n, m in methods().items() if m.seq2seq or not seq2seq)


def get(name: str) -> Method:
    """The method called ``name``; an unknown name is a clear error listing the known ones."""
    m = methods().get(name)
    if m is None:
        raise InvalidParameterError(f"unknown method {name!r}; choose one of {', '.join(names())}")
    return m


def find(name: str) -> Method | None:
    return methods().get(name)


def drafter_options(method: str, width: int | None, heads: str | None = None, lookahead: str | None = None) -> dict:
    """A method's drafter options from ``--tree-width`` (None: the method's default), ``--heads`` and
    ``--lookahead W,N,G``: a tree variant's branches (default TREE_WIDTH), the option the method names for
    the width (suffix's node budget, a head method's branches), the heads for those that take them. Nothing
    for a name that is no registered method (beam search, a benchmark peer)."""
    m = find(method)
    if m is None:
        return {}
    if m.options is not None:
        return m.options(width, heads, lookahead)
    opts: dict = {}
    if m.tree:
        opts["branches"] = width or TREE_WIDTH
    elif width and m.width_option:
        opts[m.width_option] = width
    if heads and m.takes_heads:
        opts["heads"] = heads
    return opts


register(Method("ar", build=lambda dw, rows, capacity, **opts: None, help="plain autoregressive decoding",
                seq2seq=True))

__all__ = ["BUILTIN", "TREE_SUFFIX", "TREE_WIDTH", "Method", "drafter_options", "find", "get", "methods", "names",
           "register"]
