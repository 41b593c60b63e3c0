"""Terminal output of a generation: each token coloured by how it was produced, and a summary line."""

from __future__ import annotations

LEGEND = "  ([green]accepted draft[/] [bold red]corrected[/] [bold blue]bonus[/] plain)"
COLOURS = {"plain": "", "accepted": "green", "recovered": "bold red", "bonus": "bold blue"}


def visible_controls(text: str) -> str:
    """``text`` for a terminal: control characters but newline and tab (C0, DEL, C1) shown as escapes
    (``\\x1b``), so that a model's output cannot move the cursor, retitle the window or ring the bell, and a
    carriage return before a newline (CRLF text) dropped. Rich would pass ESC on and drop the others."""
    return "".join(f"\\x{ord(c):02x}" if _control(c) else c for c in text.replace("\r\n", "\n"))


def _control(c: str) -> bool:
    o = ord(c)
    return (o < 0x20 and c not in "\n\t") or 0x7F <= o < 0xA0


class LiveText:
    """Prints a generation's pieces as they come (``SpeculativeDecoder.generate(on_text=...)``), each
    coloured by how its token was produced; ``end`` finishes the line. To a terminal through rich, control
    characters made visible (``visible_controls``); to a pipe or file the exact text (rich would expand tabs
    to spaces and drop carriage returns: a generated Makefile or CRLF file would differ from the output)."""

    def __init__(self, console, colour: bool = True):
        self.console, self.colour = console, colour

    def __call__(self, pieces: list[tuple[str, str]]) -> None:
        from rich.text import Text

        if not self.console.is_terminal:
            self.console.file.write("".join(piece for piece, _ in pieces))
            self.console.file.flush()
            return
        out = Text()
        for piece, kind in pieces:
            out.append(visible_controls(piece), style=COLOURS.get(kind, "") if self.colour else "")
        # soft_wrap: the terminal wraps; rich must not break a line that later pieces continue
        self.console.print(out, end="", soft_wrap=True)
        self.console.file.flush()

    def end(self) -> None:
        self.console.print()


def summary_line(result) -> str:
    s = result.stats
    cached = f" ({s.cached_tokens} prompt tokens cached)" if s.cached_tokens else ""
    return (f"[{result.method}] {s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.2f} tok/s | "
            f"α {s.acceptance_rate:.2f} | τ {s.mean_accepted_length:.2f} | "
            f"prefill {s.prefill_s:.2f}s{cached} draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s")


def print_summary(result, console, colour: bool = True) -> None:
    """The summary line (with the colours' legend)."""
    from rich.markup import escape

    console.print(f"[dim]{escape(summary_line(result))}[/]{LEGEND if colour else ''}", soft_wrap=True)

