"""``draftwise bench-forward`` (bench/passcost.py): the forward-cost table on a tiny model."""

from __future__ import annotations

import pytest

from draftwise.bench.passcost import draftwise_costs, markdown
from draftwise.cli.main import main
from draftwise.models.transformer import random_model
from tests.conftest import TINY


def test_costs_table_and_markdown():
    model = random_model(TINY, seed=1)
    costs = draftwise_costs(model, sizes=(1, 2, 4), context=4, repeats=2, prefill=(8, 16))
    assert set(costs["forward_s"]) == {1, 2, 4} and all(v > 0 for v in costs["forward_s"].values())
    assert set(costs["prefill_tok_s"]) == {8, 16} and all(v > 0 for v in costs["prefill_tok_s"].values())
    md = markdown({"target": "tiny", "context": 4, "threads": 1, "cpu": "cpu", "isa": "scalar", "draftwise": costs})
    assert "| draftwise | " in md and "T=4" in md and "P=16" in md and "llama.cpp" not in md


@pytest.mark.parametrize("args", [["--sizes", "2,4"], ["--sizes", "0,1"], ["--sizes", "x"], ["--repeats", "0"]])
def test_bad_options_are_one_clear_line(args, capsys):
    assert main(["bench-forward", *args]) == 2
    assert capsys.readouterr().err.startswith("draftwise: error:")
