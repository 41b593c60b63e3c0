import pytest
import torch

from draftwise.errors import InvalidParameterError
from draftwise.sampling import SamplingParams, logits_to_probs


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                dict(max_tokens=0), dict(temperature=float("nan")), dict(stop=("",))])
def test_bad_params_raise_clear_errors(kw):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kw)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    assert logits_to_probs(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.10]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.15, 0.10]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # top_p=0.7: keep the smallest prefix whose mass reaches 0.7 -> {0.5, 0.25}
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))  # reaches exactly at 2 tokens
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))  # always keeps the top token
    torch.testing.assert_close(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    for tiny in (5e-324, 1e-45):  # below float32's smallest value (0 there): still the top token, never NaN
        p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=tiny))
        torch.testing.assert_close(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    hot = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert hot[0] > 0.5 and torch.isclose(hot.sum(), torch.tensor(1.0))
