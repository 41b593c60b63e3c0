"""``draftwise chat``: an interactive conversation. Type a message; slash commands change the settings.

With the chat template (the default) each message goes to the model with the conversation so far, as a chat
client sends it; the prefix cache (``prefix.py``) keeps the history's prefill, so a turn computes only what
is new since the last one. ``/reset`` starts a new conversation; ``/chat`` toggles plain completion, where
every prompt stands alone."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from ..api import SpeculativeDecoder, build_decoder, tree_options
from ..drafters import registry
from ..errors import DraftwiseError
from . import common
from .render import LiveText, print_summary

HELP = """commands:
  /method NAME     drafting method: {methods}
  /gamma N|auto    draft tokens per step (auto: adaptive)
  /temp T          temperature (0 = greedy)    /top_p P   /top_k K   /seed S   /max N
  /chat            toggle the chat template and conversation (on by default; off: each prompt alone)
  /reset           start a new conversation (forget the turns so far)
  /color           toggle the coloured display of accepted / corrected / bonus tokens
  /compare [M]     run plain decoding and method M (default: current) on the last prompt; show speedup
  /stats           statistics of the last generation
  /settings        show the current settings
  /help            this text
  /quit            leave (or Ctrl-D; Ctrl-C stops a generation, at the prompt it leaves)"""


COMMAND_HELP = "interactive conversation (/help inside)"
CONTEXT_SLACK = 16  # tokens kept free beside the conversation and --max-tokens (draft headroom)


class ChatSession:
    def __init__(self, dw: SpeculativeDecoder, args, console: Console):
        self.dw, self.args, self.console = dw, args, console
        self.method, self.gamma, self.chat, self.colour = args.method, args.gamma, True, True
        self.history: list[dict] = []  # the conversation's turns (user and assistant messages), chat on
        self.last_prompt: str | list[dict] | None = None  # what the last generation was given (/compare)
        self.last = None

    def settings(self) -> str:
        a = self.args
        return (f"method={self.method} gamma={self.gamma} temperature={a.temperature} top_p={a.top_p} "
                f"top_k={a.top_k} max_tokens={a.max_tokens} seed={a.seed} chat={self.chat} colour={self.colour} "
                f"turns={len(self.history) // 2}")

    def turn(self, text: str):
        """One user message: with the chat template, answered in the conversation so far (which then holds
        both); else a prompt alone. A turn stopped by Ctrl-C or an error leaves the conversation as it was."""
        prompt: str | list[dict] = text
        if self.chat:
            prompt = self.fit(self.history + [{"role": "user", "content": text}])
        self.last_prompt = prompt
        res = self.generate(prompt)
        if self.chat:
            self.history = prompt + [{"role": "assistant", "content": res.text}]
        return res

    def fit(self, messages: list[dict]) -> list[dict]:
        """``messages`` without their oldest turns where the conversation and --max-tokens would not fit the
        model's context (the newest message always stays; a too-long one alone is the usual clear error)."""
        room = self.dw.target.config.max_context - self.args.max_tokens - CONTEXT_SLACK
        dropped = 0
        while len(messages) > 1 and len(self.dw.encode(messages, True)) > room:
            messages = messages[2:] if len(messages) > 2 else messages[1:]
            dropped += 1
        if dropped:
            self.console.print(f"[dim](the conversation's oldest {dropped} turn{'s' * (dropped > 1)} left out: the "
                               f"context holds {self.dw.target.config.max_context} tokens)[/]")
        return messages

    def generate(self, prompt: str | list[dict], method: str | None = None, show: bool = True):
        """One generation; shown as it is made (``show``). Ctrl-C stops it and returns to the prompt."""
        method = method or self.method
        live = LiveText(self.console, colour=self.colour) if show else None
        try:
            res = self.dw.generate(prompt, common.sampling_params(self.args), method=method, gamma=self.gamma,
                                   chat=self.chat, on_text=live,
                                   drafter_options=tree_options(method, self.args.tree_width, self.args.heads,
                                                                self.args.lookahead))
        finally:
            if live is not None:
                live.end()
        if show:
            print_summary(res, self.console, colour=self.colour)
        self.last = res
        return res

    def command(self, line: str) -> bool:
        """Handle one slash command; False means quit."""
        parts = line.split()
        cmd, arg = parts[0].lower(), (parts[1] if len(parts) > 1 else None)
        a = self.args
        changed = False
        setters = {"/temp": ("temperature", float), "/top_p": ("top_p", float), "/top_k": ("top_k", int),
                   "/seed": ("seed", int), "/max": ("max_tokens", int)}
        if cmd in ("/quit", "/exit", "/q"):
            return False
        if cmd == "/help":
            self.console.print(HELP.format(methods=", ".join(registry.names())), markup=False)
        elif cmd == "/method":
            if registry.find(arg or "") is None:
                self.console.print(f"unknown method {arg!r}; choose one of {', '.join(registry.names())}")
            else:
                self.method = arg
                changed = True
        elif cmd == "/gamma":
            if arg == "auto":
                self.gamma, changed = arg, True
            elif arg is None or not arg.isdigit() or int(arg) < 1:
                self.console.print("gamma must be an integer >= 1 or auto")
            else:
                self.gamma, changed = int(arg), True
        elif cmd in setters:
            name, conv = setters[cmd]
            old = getattr(a, name)
            try:
                setattr(a, name, conv(arg))
                common.sampling_params(a)  # validate
                changed = True
            except (TypeError, ValueError, DraftwiseError) as e:
                setattr(a, name, old)
                self.console.print(f"not changed: {e}", markup=False)
        elif cmd == "/chat":
            self.chat, changed = not self.chat, True
            self.history, self.last_prompt = [], None
        elif cmd in ("/reset", "/clear"):
            self.history, changed = [], True
        elif cmd == "/color":
            self.colour, changed = not self.colour, True
        elif cmd == "/stats":
            if self.last is None:
                self.console.print("no generation yet")
            else:
                for k, v in self.last.stats.summary().items():
                    self.console.print(f"  {k}: {v}", markup=False)
        elif cmd == "/settings":
            self.console.print(self.settings(), markup=False)
        elif cmd == "/compare":
            self.compare(arg or self.method)
        else:
            self.console.print(f"unknown command {cmd}; /help lists them", markup=False)
        if changed:  # say what the next generation will use
            self.console.print(self.settings(), markup=False)
        return True

    def compare(self, method: str) -> None:
        if self.last_prompt is None:
            self.console.print("type a prompt first")
            return
        if registry.find(method) is None:
            self.console.print(f"unknown method {method!r}")
            return
        ar = self.generate(self.last_prompt, "ar", show=False)
        sp = self.generate(self.last_prompt, method, show=False)
        same = "identical" if ar.token_ids == sp.token_ids else "DIFFERENT (sampling, or a bug if greedy)"
        self.console.print(f"ar     : {ar.stats.tokens_per_s:6.2f} tok/s  ({ar.stats.new_tokens} tokens)")
        self.console.print(f"{method:<7}: {sp.stats.tokens_per_s:6.2f} tok/s  α {sp.stats.acceptance_rate:.2f} "
                           f"τ {sp.stats.mean_accepted_length:.2f}")
        speed = sp.stats.tokens_per_s / ar.stats.tokens_per_s if ar.stats.tokens_per_s else 0.0
        self.console.print(f"speedup: {speed:.2f}x   outputs: {same}")

    def loop(self, stdin=sys.stdin) -> int:
        self.console.print(f"draftwise chat — {self.settings()}\n/help for commands, /quit to leave",
                           markup=False)
        while True:
            try:
                self.console.print("[bold]>>> [/]", end="")
                line = stdin.readline()
            except KeyboardInterrupt:
                return 0
            if not line:
                return 0
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return 0
                    continue
                self.turn(line)
            except DraftwiseError as e:
                self.console.print(f"error: {e}", markup=False)
            except KeyboardInterrupt:  # Ctrl-C stops this generation (or /compare); at the prompt it leaves
                self.console.print("[dim](stopped)[/]")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_args(p)
    common.add_sampling_args(p)


def run(args) -> int:
    common.sampling_params(args)  # validate before loading anything
    common.threads(args)
    # the draft model (with --draft-dtype) is loaded when a method first drafts with it: /method can change
    dw = build_decoder(common.model_spec(args))
    return ChatSession(dw, args, Console(highlight=False, soft_wrap=True)).loop()  # the terminal wraps
