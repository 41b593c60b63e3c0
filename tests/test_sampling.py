import pytest
import torch

from draftwise.errors import InvalidParameterError
from draftwise.sampling import TOP_CHUNK, SamplingParams, argmax, logits_to_probs, row_sum, top_indices


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


@pytest.mark.parametrize("shape", [(151936,), (3, 151936), (2, 2, 8192), (2, 96), (2, 1000)])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_top_indices_are_torch_topks(shape, k):
    """The two-pass top-k (chunk maxima, then the best chunks) gives torch.topk's indices, largest first — also
    where the largest values crowd into one chunk or most of a row is -inf (a restricted draft head); small or
    odd vocabularies go to torch.topk itself."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=g)
    assert torch.equal(top_indices(x, k), torch.topk(x, k).indices)
    if shape[-1] % TOP_CHUNK == 0:
        y = x.clone()
        y[..., 5 * TOP_CHUNK:5 * TOP_CHUNK + k] += 100.0  # all k best in one chunk
        assert torch.equal(top_indices(y, k), torch.topk(y, k).indices)
        z = torch.full(shape, float("-inf"))
        z[..., :2 * TOP_CHUNK] = x[..., :2 * TOP_CHUNK]
        assert torch.equal(top_indices(z, k), torch.topk(z, k).indices)


@pytest.mark.parametrize("shape", [(151936,), (4, 151936), (2, 3, 2048), (2, 96), (5, 1000)])
def test_argmax_is_torch_argmax_ties_and_nan_included(shape):
    """Every greedy choice takes ``argmax``: it must be torch.argmax bit for bit, the first of equal maxima
    (within a chunk and across chunks) and NaN counted as the largest."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g)
    assert torch.equal(argmax(x), x.argmax(-1))
    V = shape[-1]
    y = x.clone()
    y[..., V - 1] = y[..., V // 2] = y[..., 3] = y[..., 4] = 100.0  # ties: in one chunk, and across chunks
    assert torch.equal(argmax(y), y.argmax(-1)) and (argmax(y) == 3).all()
    y[..., V // 2 + 1] = float("nan")
    assert torch.equal(argmax(y), y.argmax(-1))
    z = torch.full(shape, float("-inf"))
    z[..., V // 3] = 0.0
    assert torch.equal(argmax(z), z.argmax(-1))


def test_top_p_probabilities_are_the_same_bits_on_any_thread_count():
    """A seeded draw reads these probabilities: their renormalization over a whole vocabulary row must not
    depend on torch's thread count (``row_sum``; ``x.sum()`` of one 152k row differs between 1 and 2 threads)."""
    g = torch.Generator().manual_seed(4)
    cases = [torch.randn(*shape, generator=g) * 4 for shape in [(151936,)] * 12 + [(1, 151936), (2, 49152), (300,)]]
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=64, top_p=0.95)]
    before = torch.get_num_threads()
    try:
        got = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = [logits_to_probs(x, p) for x in cases for p in params]
    finally:
        torch.set_num_threads(before)
    for n in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[n])), f"{n} threads"
    x = torch.rand(5, 3000, generator=g)
    assert torch.allclose(row_sum(x), x.sum(-1, keepdim=True)) and row_sum(x[0]).shape == (1,)
