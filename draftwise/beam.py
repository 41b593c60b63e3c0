"""Beam search, batched over the beams of one KV cache: each beam is a cache row.

The prompt is prefilled once, into row 0; the first step forks it into every row. After each step the
rows are reordered by the surviving beams' parents (``cache.reorder_rows``): a beam kept in place is not
copied, a forked one copies only the tokens generated so far (the prompt is the same in every row).

The search is transformers' (``generate(num_beams=N, do_sample=False)``, its vectorized beam search),
step for step, so on the same weights and numerics it returns the same tokens:

- scores: the log-softmax of every beam's next-token logits plus the beam's running sum, over all
  N x V continuations; the top K = max(2, 1 + #EOS ids) * N are the candidates (the first step starts
  from one beam: the others carry -1e9);
- a candidate ending in EOS, or reaching ``max_tokens``, is finished: among the top N candidates it
  enters the finished list (the best N hypotheses seen, scored sum_logprobs / len ** length_penalty,
  len = generated tokens, EOS included); the best N unfinished candidates are the next beams;
- the search stops when every candidate is finished (max_tokens), when no running beam can beat the
  worst of N finished hypotheses (``early_stopping=False``, the default: judged at the current length;
  ``"never"``: at the longest possible length when length_penalty > 0), or, with
  ``early_stopping=True``, as soon as N hypotheses are finished;
- the output is the best finished hypothesis.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .errors import InvalidParameterError, PromptTooLongError
from .kernels import in_decode_threads
from .models.base import CausalLM
from .sampling import SamplingParams
from .sequence import GenerationStats

NEG = -1.0e9  # transformers' score for "not a candidate"


@dataclass
class BeamResult:
    token_ids: list[int]  # the best finished hypothesis (EOS included when it ended with one)
    score: float  # its sum of log-probabilities / len ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"
    stats: GenerationStats


def check_beam_params(params: SamplingParams, num_beams, length_penalty, early_stopping=False) -> None:
    """Beam search is a greedy search: one clear error for anything it cannot honour."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise InvalidParameterError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not math.isfinite(length_penalty):
        raise InvalidParameterError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping not in (False, True, "never"):
        raise InvalidParameterError(f"early_stopping must be False, True or 'never', got {early_stopping!r}")
    if not params.greedy:
        raise InvalidParameterError(f"beam search is greedy: it takes temperature 0, got {params.temperature:g}")
    if params.stop:
        raise InvalidParameterError("beam search does not take stop strings")


@in_decode_threads  # torch's ops off OpenMP's threads where those spin long (kernels.decode_threads)
def beam_search(model: CausalLM, prompt_ids: list[int], params: SamplingParams, *, num_beams: int = 4,
                length_penalty: float = 1.0, early_stopping: bool | str = False,
                eos_ids: frozenset[int] = frozenset()) -> BeamResult:
    """The best of ``num_beams`` beams for ``prompt_ids`` (at most ``params.max_tokens`` new tokens)."""
    check_beam_params(params, num_beams, length_penalty, early_stopping)
    P, N, budget = len(prompt_ids), num_beams, params.max_tokens
    if P == 0:
        raise InvalidParameterError("empty prompt: give at least one token")
    if P + budget > model.config.max_context:
        raise PromptTooLongError(f"prompt ({P} tokens) + max_tokens ({budget}) does not fit the context "
                                 f"({model.config.max_context}); max_tokens can be at most "
                                 f"{max(0, model.config.max_context - P)}")
    eos = torch.tensor(sorted(() if params.ignore_eos else eos_ids), dtype=torch.long)
    K = max(2, 1 + len(eos)) * N  # candidates kept per step: enough for N unfinished ones
    stats = GenerationStats()
    t0 = time.perf_counter()
    cache = model.new_cache(N, P + budget)
    logits = model.forward(torch.tensor([prompt_ids]), cache, logits_for="last").logits[:, -1]  # (1, V): row 0
    stats.target_passes += 1
    stats.prefill_s = time.perf_counter() - t0

    beams: list[list[int]] = [[] for _ in range(N)]  # generated tokens of the running beams
    beam_scores = torch.zeros(N)  # (N,) running sums of log-probabilities
    beam_scores[1:] = NEG  # one beam to start from: the others are copies of it
    done_ids: list[list[int]] = [[] for _ in range(N)]  # finished hypotheses, best first
    done_scores = torch.full((N,), NEG)  # (N,) length-penalized scores
    done = torch.zeros(N, dtype=torch.bool)  # (N,) slot holds a finished hypothesis
    improvable = True  # a running beam may still beat the finished ones
    top_n = torch.arange(K) < N  # only the top N candidates may finish
    shared = 0  # cache entries before this are the same in every row (the prompt, after the first fork)
    for gen in range(budget):  # gen: tokens generated before this step
        t1 = time.perf_counter()
        logprobs = torch.log_softmax(logits, dim=-1)  # (N, V), or (1, V) at the first step
        V = logprobs.shape[-1]
        flat = (logprobs + beam_scores[:, None]).reshape(1, -1)  # (1, N V)
        cand_scores, cand_idx = torch.topk(flat, k=K)
        cand_scores, cand_idx = cand_scores[0], cand_idx[0]  # (K,) best first
        parent, token = cand_idx // V, cand_idx % V
        cands = [beams[p] + [t] for p, t in zip(parent.tolist(), token.tolist())]
        hits = torch.isin(token, eos) | (gen + 1 >= budget)  # (K,) the candidate is finished
        # the next running beams: the best N unfinished candidates
        alive = cand_scores + hits.to(torch.float32) * NEG
        keep = torch.topk(alive, k=N)[1]
        beams, beam_scores, parents = [cands[j] for j in keep.tolist()], alive[keep], parent[keep]
        # the finished list: the best N of those kept and the top N candidates that just finished
        finished_now = hits & top_n
        penalized = cand_scores / ((gen + 1) ** length_penalty)
        penalized += (done.all() & (early_stopping is True)).to(torch.float32) * NEG  # full: take none
        penalized += torch.tensor(not improvable).to(torch.float32) * NEG
        penalized += (~finished_now) * NEG
        merged = torch.topk(torch.cat((done_scores, penalized)), k=N)[1]
        pool = done_ids + cands
        done_ids = [pool[j] for j in merged.tolist()]
        done_scores = torch.cat((done_scores, penalized))[merged]
        done = torch.cat((done, finished_now))[merged]
        # can a running beam still beat the worst finished hypothesis?
        best_len = budget if early_stopping == "never" and length_penalty > 0.0 else gen + 1
        best_possible = beam_scores[:1] / (best_len ** length_penalty)
        worst_done = torch.where(done, done_scores.min(), NEG)
        improvable = improvable and bool((best_possible > worst_done).any())
        stats.draft_s += time.perf_counter() - t1
        if not improvable or (bool(done.all()) and early_stopping is True) or bool(hits.all()):
            break
        t2 = time.perf_counter()
        cache.reorder_rows(parents, start=shared)
        shared = P
        x = torch.tensor([[b[-1]] for b in beams])  # (N, 1) each beam's newest token
        logits = model.forward(x, cache, logits_for="last").logits[:, -1]  # (N, V)
        stats.target_passes += 1
        stats.verify_s += time.perf_counter() - t2

    # the best finished hypothesis (the last step finishes the top N candidates, so there is one)
    ids, score = (done_ids[0], float(done_scores[0])) if bool(done[0]) else \
        (beams[0], float(beam_scores[0]) / len(beams[0]) ** length_penalty)
    stats.new_tokens = len(ids)
    stats.wall_s = time.perf_counter() - t0
    reason = "stop" if ids and ids[-1] in eos.tolist() else "length"
    return BeamResult(ids, score, reason, stats)
