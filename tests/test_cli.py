"""CLI contract: --json shape, and every bad input gives one clear error line and exit status 2."""

from __future__ import annotations

import json

import pytest

from draftwise.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_shape(capsys, hf_folder):
    code, out, _ = run_cli(capsys, "generate", "def quicksort(arr):", "--target", str(hf_folder), "--method", "pld",
                           "--max-tokens", "12", "--json")
    assert code == 0
    obj = json.loads(out)
    assert set(obj) >= {"text", "token_ids", "method", "stats"}
    assert obj["method"] == "pld" and isinstance(obj["text"], str)
    assert all(isinstance(t, int) for t in obj["token_ids"])
    for key, typ in [("new_tokens", int), ("drafted", int), ("accepted", int), ("acceptance_rate", float),
                     ("mean_accepted_length", float), ("tokens_per_s", float), ("wall_s", float)]:
        assert isinstance(obj["stats"][key], typ), key


def test_methods_same_tokens_through_cli(capsys, hf_folder):
    ids = {}
    for method in ["ar", "draft", "pld", "nasd"]:
        code, out, _ = run_cli(capsys, "generate", "hello world", "--target", str(hf_folder), "--draft",
                               str(hf_folder), "--method", method, "--max-tokens", "16", "--json")
        assert code == 0
        ids[method] = json.loads(out)["token_ids"]
    assert ids["draft"] == ids["pld"] == ids["nasd"] == ids["ar"]


def test_generated_text_to_a_pipe_is_exact(capsys, hf_folder):
    """Not a terminal (a pipe, a file): the text as generated. Rich expanded tabs to spaces and dropped
    carriage returns, so ``draftwise generate ... > Makefile`` differed from the model's text."""
    args = ("generate", "hello world", "--target", str(hf_folder), "--method", "ar", "--max-tokens", "24")
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    text = json.loads(out)["text"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and out.startswith(text + "\n")


def test_live_text_shows_control_characters_on_a_terminal_and_keeps_them_in_a_pipe():
    import io

    from rich.console import Console

    from draftwise.cli.render import LiveText, visible_controls

    pieces = [("a\tb\r\n", "plain"), ("\x1b]0;pwned\x07\x1b[2J", "accepted"), ("\x9b31m é 日本 👍", "bonus")]
    raw = "".join(p for p, _ in pieces)
    pipe = io.StringIO()
    LiveText(Console(file=pipe, force_terminal=False))(pieces)
    assert pipe.getvalue() == raw  # exact: the tab, the carriage return, the escapes
    tty = io.StringIO()
    LiveText(Console(file=tty, force_terminal=True, no_color=True), colour=False)(pieces)
    shown = tty.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown  # nothing reaches the terminal raw
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in shown and "\\x9b31m é 日本 👍" in shown and "\r" not in shown
    assert visible_controls("x\r\ny\rz\t") == "x\ny\\x0dz\t"


def test_coloured_output_and_summary(capsys, hf_folder):
    code, out, _ = run_cli(capsys, "generate", "hello world", "--target", str(hf_folder), "--draft", str(hf_folder),
                           "--max-tokens", "10")
    assert code == 0 and "tok/s" in out and "α" in out and "τ" in out


@pytest.mark.parametrize("args,needle", [
    (["--gamma", "0"], "gamma"),
    (["--gamma", "x"], "gamma"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
])
def test_bad_parameters(capsys, hf_folder, args, needle):
    try:
        code = main(["generate", "hi", "--target", str(hf_folder), *args])
    except SystemExit as e:  # argparse-level errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_unknown_model(capsys):
    code, _, err = run_cli(capsys, "generate", "hi", "--target", "no-such-model", "--method", "ar")
    assert code == 2 and "unknown model 'no-such-model'" in err


def test_empty_prompt(capsys, hf_folder):
    code, _, err = run_cli(capsys, "generate", "", "--target", str(hf_folder), "--method", "ar")
    assert code == 2 and "empty prompt" in err


def test_prompt_longer_than_context(capsys, hf_folder):
    code, _, err = run_cli(capsys, "generate", "hello world " * 200, "--target", str(hf_folder), "--method", "ar")
    assert code == 2 and "context" in err and "Traceback" not in err


def test_chat_template(capsys, hf_folder):
    code, out, _ = run_cli(capsys, "generate", "hello", "--target", str(hf_folder), "--method", "ar", "--chat",
                           "--max-tokens", "4", "--json")
    assert code == 0 and json.loads(out)["stats"]["new_tokens"] >= 1


# every command that writes its results last checks where they go first: a run of minutes (a benchmark, a soak,
# a training) must not end in a traceback with its results lost
@pytest.mark.parametrize("argv, flag", [
    (["bench", "--methods", "ar", "--limit", "1", "--out"], "--out"),
    (["bench-forward", "--sizes", "1", "--prefill", "", "--repeats", "1", "--out"], "--out"),
    (["agreement", "--limit", "1", "--max-tokens", "1", "--out"], "--out"),
    (["bench-serve", "--method", "ar", "--modes", "ar", "--json"], "--json"),
    (["bench-serve", "--method", "ar", "--soak", "0.01", "--soak-out"], "--soak-out"),
    (["train-head", "--minutes", "0.01", "--out"], "--out"),
])
def test_an_unwritable_destination_is_refused_before_the_work(argv, flag, capsys, hf_folder, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    # below a file; and the file itself where a folder is wanted, a folder where a file is
    for bad in (blocker / "deeper", tmp_path if flag == "--json" else blocker):
        assert main([argv[0], "--target", str(hf_folder), *argv[1:], str(bad)]) == 2, bad
        out, err = capsys.readouterr()
        assert f"cannot write {flag} {bad}" in err and "Traceback" not in err and "\n" not in err.strip()
        assert out == ""  # nothing measured, nothing loaded
    assert blocker.read_text() == "x"


def test_output_destinations_created_and_checked(tmp_path):
    import os

    from draftwise.outputs import out_file, out_folder
    from draftwise.errors import InvalidParameterError

    assert out_folder(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    assert out_file(tmp_path / "c" / "r.json", "--json") == tmp_path / "c" / "r.json"
    assert (tmp_path / "c").is_dir() and not (tmp_path / "c" / "r.json").exists()  # the file is the caller's
    (tmp_path / "f").write_text("x")
    for call, path, why in [(out_folder, tmp_path / "f", "a file, not a folder"),
                            (out_folder, tmp_path / "f" / "g", "Not a directory"),
                            (out_file, tmp_path / "f" / "r.json", f"its folder {tmp_path / 'f'}: a file, not a folder"),
                            (out_file, tmp_path / "c", "a folder")]:
        with pytest.raises(InvalidParameterError, match=f"cannot write --x {path}: {why}"):
            call(path, "--x")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(InvalidParameterError, match="permission denied"):
            out_folder(locked, "--x")
        with pytest.raises(InvalidParameterError, match="permission denied"):
            out_file(locked / "r.json", "--x")
