"""The defaults a newcomer meets: `generate`, `chat` and `serve` use method auto (the fastest overall in
`draftwise bench`), which needs no draft model and no heads, and runs on any target."""

from __future__ import annotations

import json

from draftwise.cli import build_parser, main


def test_generate_chat_serve_default_to_auto():
    ap = build_parser()
    for argv in (["generate", "hi"], ["chat"], ["serve"], ["bench-serve"]):
        args = ap.parse_args(argv)
        if hasattr(args, "method"):
            assert args.method == "auto", argv
    assert ap.parse_args(["serve"]).method == "auto"


def test_auto_by_default_needs_no_draft_model(capsys, hf_folder, tmp_path):
    """The README's first command, on a tiny random model: the default method is auto, the draft model is
    never loaded (a missing one is no error); heads join auto only when --heads names them."""
    code = main(["generate", "def quicksort(arr):", "--target", str(hf_folder), "--draft", str(tmp_path / "none"),
                 "--temperature", "0", "--max-tokens", "12", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["method"] == "auto" and out["stats"]["new_tokens"] == 12
    code = main(["generate", "def quicksort(arr):", "--target", str(hf_folder), "--method", "ar",
                 "--temperature", "0", "--max-tokens", "12", "--json"])
    ar = json.loads(capsys.readouterr().out)
    assert code == 0 and ar["token_ids"] == out["token_ids"]  # lossless: auto's greedy text is ar's
