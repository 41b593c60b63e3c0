"""Terminal output of a generation: each token coloured by how it was produced, and a summary line."""

from __future__ import annotations

LEGEND = "  ([green]accepted draft[/] [bold red]corrected[/] [bold blue]bonus[/] plain)"
COLOURS = {"plain": "", "accepted": "green", "recovered": "bold red", "bonus": "bold blue"}


def render(result, tokenizer, console, colour: bool = True) -> None:
    """Print the output text with each token coloured by how it was produced."""
    from rich.text import Text

    if not colour:
        console.print(result.text, markup=False, highlight=False)
        return
    out = Text()
    prev = ""
    ids = result.token_ids
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[:i + 1])
        piece = cur[len(prev):] if cur.startswith(prev) else ""
        limit = len(result.text) - len(prev)
        if limit <= 0:
            break
        out.append(piece[:limit], style=COLOURS.get(result.kinds[i], ""))
        prev = cur
    console.print(out)


def summary_line(result) -> str:
    s = result.stats
    return (f"[{result.method}] {s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.2f} tok/s | "
            f"α {s.acceptance_rate:.2f} | τ {s.mean_accepted_length:.2f} | "
            f"prefill {s.prefill_s:.2f}s draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s")


def print_result(result, tokenizer, console, colour: bool = True) -> None:
    """The coloured text, then the summary line (with the colours' legend)."""
    from rich.markup import escape

    render(result, tokenizer, console, colour=colour)
    console.print(f"[dim]{escape(summary_line(result))}[/]{LEGEND if colour else ''}")
