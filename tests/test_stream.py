"""Text as it is made: ``generate(on_text=...)`` (``detok.PieceStream``), ``draftwise generate`` printing it as
it comes, and ``draftwise chat`` (its settings commands, Ctrl-C stopping a generation)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from draftwise.api import SpeculativeDecoder
from draftwise.cli import chat, main
from draftwise.detok import PieceStream
from draftwise.models import LoadedModel, load_model
from draftwise.sampling import SamplingParams
from tests.conftest import perturbed

METHODS = ["ar", "draft", "pld", "nasd", "draft-tree"]


@pytest.fixture(scope="module")
def tiny_dw(hf_folder) -> SpeculativeDecoder:
    target = load_model(str(hf_folder), "bf16", progress=False)
    draft = LoadedModel("tiny-draft", perturbed(target.model, 0.3, seed=5).to(target.model.dtype),
                        target.tokenizer, 0.0)
    return SpeculativeDecoder(target, draft, progress=False)


def streamed(dw, prompt, params, method, **kw):
    calls = []
    result = dw.generate(prompt, params, method=method, on_text=calls.append, **kw)
    return result, calls


@pytest.mark.parametrize("method", METHODS)
def test_pieces_join_to_the_text_step_by_step(tiny_dw, method):
    """The pieces of every call join to the result's text, arrive over several calls (not at the end), and
    carry the kinds the result gives its tokens; the text and tokens are those of a run without on_text."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    plain = tiny_dw.generate("the quick brown fox", params, method=method, gamma=3)
    result, calls = streamed(tiny_dw, "the quick brown fox", params, method, gamma=3)
    assert result.token_ids == plain.token_ids and result.text == plain.text
    assert "".join(p for call in calls for p, _ in call) == result.text
    assert len(calls) > 3
    assert all(p and k in set(result.kinds) for call in calls for p, k in call)
    if method != "ar":
        assert {k for call in calls for _, k in call} - {"plain"}, "no drafted token's piece"


@pytest.mark.parametrize("method", ["ar", "draft", "pld"])
@pytest.mark.parametrize("where", [0.3, 0.6])
def test_a_stop_string_is_never_streamed(tiny_dw, method, where):
    """A stop string taken from the middle of the free text: the streamed text stops where the result is cut
    (the last step's tokens are cut at it, and a stop string's start is held back until it is known)."""
    free = tiny_dw.generate("once upon a time", SamplingParams(max_tokens=60, ignore_eos=True), method="ar").text
    at = int(len(free) * where)
    stop = free[at:at + 3]
    params = SamplingParams(max_tokens=60, ignore_eos=True, stop=(stop,))
    result, calls = streamed(tiny_dw, "once upon a time", params, method, gamma=4)
    assert result.finish_reason == "stop" and stop not in result.text
    assert "".join(p for call in calls for p, _ in call) == result.text


def test_piece_stream_holds_back_a_partial_character_and_a_stop_prefix():
    """A byte-level vocabulary where characters span tokens: no piece ends in half a character, a stop
    string's first characters wait until they turn out not to start it, and the pieces join to the text."""
    vocab = {1: b"ab", 2: b"\xc3", 3: b"\xa9", 4: b"X", 5: b"Y", 6: b"c"}

    def decode(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    got = []
    stream = PieceStream(decode, ("XYZ",), got.append)
    ids, kinds = [], []
    for t, k in [(1, "plain"), (2, "accepted"), (3, "accepted"), (4, "bonus"), (5, "plain"), (6, "plain")]:
        ids.append(t)
        kinds.append(k)
        stream.step(ids, kinds)
    stream.finish(ids, kinds, decode(ids))
    pieces = [p for call in got for p in call]
    assert "".join(p for p, _ in pieces) == "abéXYc"
    assert ("é", "accepted") in pieces  # the character, once complete: on the token that completed it
    assert not any(p.endswith("\ufffd") for p, _ in pieces)
    assert pieces.index(("XYc", "plain")) == len(pieces) - 1  # "X", "XY" held back: a stop string's start


def test_generate_command_prints_the_text_as_it_comes(hf_folder, capsys):
    assert main(["generate", "the quick brown fox", "--target", str(hf_folder), "--draft", str(hf_folder),
                 "--dtype", "bf16", "--method", "pld", "--max-tokens", "20", "--temperature", "0", "--no-color",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    text, summary = out.rstrip("\n").rsplit("\n", 1)
    assert re.match(r"\[pld\] \d+ tokens in ", summary), summary
    dw = SpeculativeDecoder(load_model(str(hf_folder), "bf16", progress=False), progress=False)
    want = dw.generate("the quick brown fox", SamplingParams(max_tokens=20, temperature=0), method="pld").text
    assert text == want  # not a terminal: the exact text (its control characters included)


def session(tiny_dw, hf_folder):
    from draftwise.cli.main import build_parser

    args = build_parser().parse_args(["chat", "--target", str(hf_folder), "--max-tokens", "12",
                                      "--temperature", "0"])
    console = Console(file=io.StringIO(), no_color=True, highlight=False, width=200)
    return chat.ChatSession(tiny_dw, args, console), console


def test_chat_commands_say_what_they_changed_and_ctrl_c_stops_one_generation(tiny_dw, hf_folder, monkeypatch):
    s, console = session(tiny_dw, hf_folder)
    real = tiny_dw.generate
    calls = {"n": 0}

    def generate(*a, **kw):  # the second prompt is interrupted (Ctrl-C) after its first step
        calls["n"] += 1
        if calls["n"] != 2:
            return real(*a, **kw)
        sink = kw["on_text"]

        def interrupted(pieces):
            sink(pieces)
            raise KeyboardInterrupt
        return real(*a, **{**kw, "on_text": interrupted})
    monkeypatch.setattr(tiny_dw, "generate", generate)
    lines = ["/method pld", "/gamma 2", "/temp 0.5", "/temp -1", "/method nope", "hello there",
             "and then", "/method ar", "still here", "/quit", "never read"]
    assert s.loop(stdin=io.StringIO("\n".join(lines) + "\n")) == 0
    out = console.file.getvalue()
    assert "method=pld gamma=auto" in out and "method=pld gamma=2" in out and "temperature=0.5" in out
    assert "not changed: temperature must be >= 0" in out and "unknown method 'nope'" in out
    assert out.count("(stopped)") == 1 and calls["n"] == 3  # the session went on after Ctrl-C
    assert re.search(r"\[pld\] \d+ tokens in", out) and re.search(r"\[ar\] \d+ tokens in", out)


def test_chat_keeps_the_conversation_until_reset(tiny_dw, hf_folder, monkeypatch):
    """Each message goes with the turns before it (answers included), as a chat client sends them; /reset
    forgets them; /chat off sends prompts alone; a conversation past the context loses its oldest turns."""
    s, console = session(tiny_dw, hf_folder)
    real, sent, texts = tiny_dw.generate, [], []

    def generate(prompt, *a, **kw):
        sent.append(prompt)
        r = real(prompt, *a, **kw)
        texts.append(r.text)
        return r
    monkeypatch.setattr(tiny_dw, "generate", generate)
    lines = ["hello there", "and then", "/settings", "/reset", "again", "/chat", "plain text", "/quit"]
    assert s.loop(stdin=io.StringIO("\n".join(lines) + "\n")) == 0
    assert sent[0] == [{"role": "user", "content": "hello there"}]
    assert [m["role"] for m in sent[1]] == ["user", "assistant", "user"] and sent[1][2]["content"] == "and then"
    assert sent[1][1]["content"] == texts[0]  # the first answer, as generated
    assert "turns=2" in console.file.getvalue()
    assert sent[2] == [{"role": "user", "content": "again"}]  # after /reset
    assert sent[3] == "plain text"  # /chat off: the prompt alone
    s.chat, s.history = True, []
    room = tiny_dw.target.config.max_context - s.args.max_tokens - chat.CONTEXT_SLACK
    long = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "answer " * 40}] * 8
    kept = s.fit(long + [{"role": "user", "content": "last"}])
    assert kept[-1]["content"] == "last" and len(kept) < len(long) + 1 and kept[0]["role"] == "user"
    assert len(tiny_dw.encode(kept, True)) <= room
    assert "oldest" in console.file.getvalue()
