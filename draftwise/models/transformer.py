"""Native PyTorch Llama / Qwen2 decoder (both real model families), with an explicit KV cache.

Weights use HF names on disk (``model.layers.N.self_attn.q_proj.weight`` ...); in memory Q/K/V and
gate/up are fused into one matmul each, which halves the per-token kernel launches of the small draft.

Numerics: decoding must be *batch-invariant* — the logits of a token must not depend on how many other
tokens share its forward pass — or speculative decoding would not be token-identical to plain decoding.
Linear layers run the kernel (kernels/csrc), whose rule computes each row the same way for any row count
and on every instruction set; attention is made invariant by computing short forwards (decode,
verification: T <= EXACT_MAX_T) one query row at a time over exactly the keys it sees, i.e. the same call
plain decoding makes. Long prefills take one batched SDPA call per sequence.

Short forwards of a model whose projections are all K-quant tensors run the decoder layers in one compiled
call (``Transformer._stack``: kernels/csrc/bindings/stack.cpp), which makes the modules' kernel calls in
their order; the modules stay the reference it is tested against, and the path for every other model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import WatchedModule, bulk, extension, parallel_torch, serial_torch
from .base import MAX_TREE_TOKENS, KVCache, LogitsFor, ModelConfig, ModelOutput

# Forwards of at most this many new tokens use the row-by-row (invariant) attention and the fused Stack: decode
# steps, verification (trees of up to MAX_TREE_TOKENS) and prompt chunks (prefix.PREFILL_CHUNK). A token's
# attention there costs what it costs alone, so the limit sets only how many rows share each weight pass: on an
# Intel Xeon (2026-12-07, AMX) a 512-token prompt in chunks of 32 / 64 / 128 / 256 tokens took 2.72 / 2.60 / 2.52 /
# 2.60 s on AVX512-VNNI and 2.53 / 2.34 / 2.11 / 2.25 s on the tiles (the matmuls 10 % and 1.3x faster a row at
# 128 rows than at 32: the weights streamed a quarter as often, the tiles' fixed cost a super-block shared by 8 groups).
EXACT_MAX_T = 128
assert EXACT_MAX_T >= MAX_TREE_TOKENS


def _row_ops(t: torch.Tensor):
    """The compiled row-wise layer ops (kernels/layers.cpp: RMSNorm, silu(gate) * up, rotary + KV append,
    short forwards' attention) when ``t`` holds fp32 activations and the kernel is built; else None (torch's
    ops). Row-wise, so a token's bits do not depend on how many tokens share the call: decode steps,
    verification (padded or packed) and prompts all take them, a prompt's rows spread over the kernel's
    threads (torch's element-wise ops run on one thread inside ``serial_torch``: 1 s of a 1024-token
    prefill of the 1.5B went to silu and its product alone)."""
    return extension() if t.dtype == torch.float32 else None


class Linear(nn.Linear):
    """``nn.Linear`` that skips its random initialisation on the meta device (where a model is built before
    the checkpoint's tensors replace every weight): ``kaiming_uniform_`` there runs torch's decomposition,
    ~0.6 ms a layer, ~0.09 s of a 1.5B's load. Elsewhere (``random_model``, tests) it initialises as usual."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    @classmethod
    def frozen(cls, w: torch.Tensor, b: torch.Tensor | None = None) -> Linear:
        """A linear holding the weight w (N, K) and bias b (N,) themselves (views stay views): no
        initialisation, no gradients."""
        lin = cls(w.shape[1], w.shape[0], bias=b is not None, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b, requires_grad=False)
        return lin


class RMSNorm(WatchedModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = _row_ops(x) if self.weight.dtype == torch.float32 else None
        if ext is not None:  # one fused call
            return ext.rms_norm(x.contiguous(), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary:
    """cos/sin tables (positions, head_dim) in float32, grown on demand.

    Computed in float64 and rounded once: torch's float32 cos/sin are vectorized differently per
    instruction set (AVX2 vs AVX-512 builds of SLEEF), and the tables must be the same bits on every
    CPU for the same GGUF to give the same tokens everywhere."""

    def __init__(self, head_dim: int, theta: float):
        # device="cpu" even inside a meta-device context (model construction): ops on meta tensors go
        # through torch's Python references, whose first use imports torch._dynamo (seconds of start-up)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        self.cos = torch.empty(0, head_dim, device="cpu")
        self.sin = torch.empty(0, head_dim, device="cpu")

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float64), self.inv_freq)  # (n, hd/2)
            emb = torch.cat([freqs, freqs], dim=-1)  # (n, hd)
            self.cos, self.sin = emb.cos().float(), emb.sin().float()
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # (B, T, hd)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(WatchedModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        self.o = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, start: list[int], tree: "TreeMask | None",
                packed: "Packing | None" = None) -> torch.Tensor:
        # x: (B, T, D), or (N, D) with ``packed`` (the rows' real tokens only; see Packing);
        # cos/sin: (B, T, hd); k_cache/v_cache: (B, nkv, cap, hd); start[b] = row b's length
        qkv = self.qkv(x)  # (B, T, (nh + 2 nkv) hd), or (N, ...) packed
        if packed is not None:
            qkv = packed.unpack(qkv)  # (B, T, ...): padding positions zero (their keys lie past the row's end)
        B, T, _ = qkv.shape
        fused = k_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
        ext = _row_ops(qkv) if fused else None
        if ext is not None and T <= EXACT_MAX_T:
            # the same computation as below, fused: one call instead of ~35 ops
            vis, nvis = (tree.vis, tree.nvis) if tree is not None else (_NONE, _NONE)
            out = ext.decode_attention(qkv.contiguous(), cos.contiguous(), sin.contiguous(), k_cache, v_cache,
                                       start, self.nh, self.nkv, vis, nvis)  # (B, T, nh hd)
            return self.o(out if packed is None else packed.pack(out))
        if ext is not None:  # a long prefill: rotary and KV append compiled (q rotated in place), attention torch's
            qkv = qkv.contiguous()
            ext.rope_append(qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, start, self.nh, self.nkv)
            q = qkv[..., :self.nh * self.hd].view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        else:
            q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
            q = q.view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
            k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
            v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
            q = q * c + _rotate_half(q) * s
            k = k * c + _rotate_half(k) * s
            for b in range(B):
                k_cache[b, :, start[b]:start[b] + T] = k[b]
                v_cache[b, :, start[b]:start[b] + T] = v[b]
        out = torch.empty_like(q)  # (B, nh, T, hd)
        for b in range(B):
            L = start[b]
            if T <= EXACT_MAX_T:
                for t in range(T):  # exactly the call plain decoding makes for this token
                    if tree is None:
                        keys = slice(0, L + t + 1)
                    else:  # the cached prefix, then the node's path in order
                        keys = torch.cat([torch.arange(L), L + tree.vis[b, t, :int(tree.nvis[b, t])]])
                    out[b, :, t] = self._attend_one(q[b, :, t], k_cache[b, :, keys], v_cache[b, :, keys])
                continue
            mask, causal = None, False
            if tree is not None:  # tree: whole prefix + the new tokens the mask allows
                mask = torch.cat([torch.ones(T, L, dtype=torch.bool), tree.mask[b]], dim=1)
            elif L == 0:  # a prompt from an empty cache: torch's causal kernel skips the keys past the diagonal
                causal = True
            else:  # causal, offset by the cached prefix
                keys = torch.arange(L + T)
                mask = keys[None, :] <= (L + torch.arange(T))[:, None]  # (T, L+T)
            with parallel_torch(light=T < LIGHT_ATTENTION):
                out[b] = F.scaled_dot_product_attention(
                    q[b:b + 1], k_cache[b:b + 1, :, :L + T], v_cache[b:b + 1, :, :L + T],
                    attn_mask=mask, is_causal=causal, enable_gqa=True)[0]
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o(out if packed is None else packed.pack(out))

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query token over its keys, grouped-query. q: (nh, hd); k, v: (nkv, S, hd) -> (nh, hd).
        Three small ops: torch's CPU flash-attention kernel costs ~5 ms per call for a single query."""
        g = self.nh // self.nkv
        k, v = k.contiguous(), v.contiguous()  # a slice and a gathered copy of the same keys: the same call
        qg = q.view(self.nkv, g, self.hd)  # (nkv, g, hd)
        scores = torch.matmul(qg, k.transpose(1, 2)) * (self.hd ** -0.5)  # (nkv, g, S)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.matmul(probs, v).view(self.nh, self.hd)  # (nh, hd)


_NONE = torch.empty(0, dtype=torch.long)
# a prompt's attention over fewer new tokens than this gains less from torch's threads than a long OpenMP spin
# after it costs (kernels.parallel_torch's ``light``): the 1.5B's 33 / 128 / 512-token prefills 349 / 809 /
# 3211 ms with the threads, 214 / 702 / 3338 ms without (AMD Zen 4, torch imported before draftwise)
LIGHT_ATTENTION = 512


class Packing:
    """The real tokens of a right-padded (B, T) batch whose rows feed different numbers of new tokens
    (``lengths[b]`` <= T: a verification step where some rows drafted fewer tokens, or none). The projections,
    MLPs and LM head run on the N = sum(lengths) real tokens only — (N, D) instead of (B, T, D) — and
    attention on the padded layout; padding positions get zero projections (their keys and values land
    past the row's valid length, where no real token looks). The kernel computes each row alone (batch
    invariance), so a real token's bits do not depend on the packing."""

    def __init__(self, lengths: list[int], T: int):
        self.B, self.T = len(lengths), T
        mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
        self.index = mask.reshape(-1).nonzero().squeeze(1)  # (N,) flat positions of the real tokens

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...)"""
        return x.reshape(self.B * self.T, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, T, ...), zeros at padding positions"""
        out = x.new_zeros(self.B * self.T, *x.shape[1:])
        out.index_copy_(0, self.index, x)
        return out.view(self.B, self.T, *x.shape[1:])


class TreeMask:
    """A (B, T, T) attention mask over the new tokens, each token seeing its ancestors and itself (a token
    tree in topological order: a parent before its children), as the kernel takes it: ``vis[b, t, :nvis]``
    the visible new tokens of token t in increasing index order — for a tree, its path from the root."""

    def __init__(self, mask: torch.Tensor):
        B, T, _ = mask.shape
        self.mask = mask  # (B, T, T) bool
        idx = torch.arange(T).expand(B, T, T)
        self.vis = torch.where(mask, idx, T).sort(-1).values.clamp_max(T - 1).contiguous()  # (B, T, T) int64
        self.nvis = mask.sum(-1).contiguous()  # (B, T) int64
        if bool((self.nvis < 1).any()) or not bool(mask.diagonal(dim1=1, dim2=2).all()):
            raise ValueError("attn_mask: every token must see itself")


# rows per MLP call: a 1024-token prompt's (1024, 2 F) gate/up output is 73 MB for Qwen 1.5B, above glibc's
# largest mmap threshold (32 MB), so every such call faults in fresh zeroed pages (~30 ms a layer); 256 rows'
# buffers are reused (the MLP of a 1024-token prefill: 162 ms a layer against 192-208 ms whole). Chunks are
# equal, so none is short enough to leave the bulk GEMM path (kernels.BULK_MIN_ROWS) where the others take it
MLP_ROWS = 256


class MLP(WatchedModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ffn = cfg.intermediate_size
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if rows > MLP_ROWS:  # a long prompt: a chunk of rows at a time (row-wise, so the same bits)
            flat = x.reshape(rows, x.shape[-1])  # (rows, D)
            n = -(-rows // -(-rows // MLP_ROWS))  # equal chunks of at most MLP_ROWS (none left short)
            return torch.cat([self._mlp(flat[i:i + n]) for i in range(0, rows, n)]).view_as(x)
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)  # (..., 2 F)
        ext = _row_ops(gu)
        if ext is not None:
            return self.down(ext.silu_mul(gu.contiguous()))
        gate, up = gu.split(self.ffn, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(WatchedModule):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)


class Transformer(WatchedModule):
    supports_trees = True  # forward takes a tree attn_mask; its nodes get the bits decoding their paths gives
    supports_taps = True  # forward(taps=...) returns inner layers' outputs (an EAGLE-3 head's features)
    supports_lengths = True  # forward(lengths=...) runs only each row's real tokens through the matmuls
    supports_prefix_cache = True  # prompts prefill in exact chunks, so their keys and values serve later prompts

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        # given a (meta) weight, nn.Embedding skips its random init: normal_ on the meta device would
        # import torch._dynamo (~2.5 s of start-up) for a table the checkpoint replaces anyway
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.requires_grad_(False)
        self.fused_layers = True  # short forwards through the compiled Stack where the layers allow (_stack)
        self._stack_plan, self._stack_epoch = None, -1

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_stack_"):  # the plan itself is not a weight
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __getstate__(self) -> dict:  # a copy (copy.deepcopy) builds its own plan over its own weights
        return {**self.__dict__, "_stack_plan": None, "_stack_epoch": -1}

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, rows: int = 1, capacity: int | None = None) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, rows, cfg.num_kv_heads, capacity or cfg.max_context, cfg.head_dim,
                       self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, *, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, logits_for: LogitsFor = "all",
                layers: tuple[int, ...] | None = None, all_hidden: bool = False,
                taps: tuple[int, ...] = (), lengths: list[int] | None = None) -> ModelOutput:
        # torch's small ops on one thread, the kernel's matmuls on all (kernels.serial_torch)
        with serial_torch():
            return self._forward(input_ids, cache, positions=positions, attn_mask=attn_mask, logits_for=logits_for,
                                 layers=layers, all_hidden=all_hidden, taps=taps, lengths=lengths)

    def _forward(self, input_ids: torch.Tensor, cache: KVCache, *, positions: torch.Tensor | None,
                 attn_mask: torch.Tensor | None, logits_for: LogitsFor, layers: tuple[int, ...] | None,
                 all_hidden: bool, taps: tuple[int, ...], lengths: list[int] | None = None) -> ModelOutput:
        # input_ids: (B, T) new tokens of cache rows 0..B-1; attn_mask: (B, T, T) bool or None (causal)
        # all_hidden: ModelOutput.hidden holds every position's final state (B, T, D), whatever logits_for
        # says (a draft head's context after the prefill: drafters/eagle.py); the logits are unchanged
        # layers: indices of the decoder layers to run, increasing (None: all). A skipped layer passes the
        # hidden state through unchanged and its cache entries are not written (layer-skip drafting:
        # drafters/layerskip.py); the final norm and LM head always run.
        # taps: decoder layer indices whose output (the residual stream, every position) is returned in
        # ModelOutput.taps (B, T, len(taps), D): a draft head's low/mid-level features (EAGLE-3)
        # lengths: row b's real new tokens are its first lengths[b] (right padding after them): only those
        # run through the matmuls (Packing); logits, hidden and taps at padding positions are zero
        B, T = input_ids.shape
        start = cache.lengths[:B].tolist()
        if max(start) + T > cache.capacity:
            raise ValueError(f"KV cache overflow: {max(start)} + {T} > capacity {cache.capacity}")
        if positions is None:
            positions = cache.lengths[:B, None] + torch.arange(T)  # (B, T)
        cos, sin = self.rotary.tables(positions, self.dtype)
        tree = TreeMask(attn_mask) if attn_mask is not None else None
        packed = None
        if lengths is not None and T <= EXACT_MAX_T and sum(lengths) < B * T:
            if len(lengths) != B or min(lengths) < 1 or max(lengths) > T:
                raise ValueError(f"lengths must give 1..{T} real tokens for each of the {B} rows, got {lengths}")
            if isinstance(logits_for, torch.Tensor) or logits_for != "all" or all_hidden:
                raise ValueError("lengths (packed rows) go with logits_for='all'")
            packed = Packing(lengths, T)
        h = self.embed(input_ids)  # (B, T, D)
        if packed is not None:
            h = packed.pack(h)  # (N, D): the real tokens only, up to the LM head
        tapped: dict[int, torch.Tensor] = {}
        stack = self._stack() if T <= EXACT_MAX_T and h.dtype == torch.float32 and cache.k.dtype == torch.float32 \
            else None
        if stack is not None:  # the same kernels in one call (kernels/csrc/bindings/stack.cpp)
            vis, nvis = (tree.vis, tree.nvis) if tree is not None else (_NONE, _NONE)
            ids = list(range(len(self.layers)) if layers is None else layers)
            h, outs = stack.run(h, cos.contiguous(), sin.contiguous(), cache.k, cache.v, start, vis, nvis, ids,
                                list(taps), _NONE if packed is None else packed.index)
            tapped.update(zip([i for i in ids if i in taps], outs))
        else:
            h = self._layers(h, cos, sin, cache, start, tree, packed, T, layers, taps, tapped)
        cache.lengths[:B] += T
        if packed is not None:
            h = self.norm(h)  # (N, D)
            logits = packed.unpack(self.lm_head(h).float())  # (B, T, V)
            tap = packed.unpack(torch.stack([tapped[i] for i in taps], 1)) if taps else None
            return ModelOutput(logits=logits, hidden=packed.unpack(h), taps=tap)
        every = self.norm(h) if all_hidden else None  # (B, T, D)
        tap = torch.stack([tapped[i] for i in taps], 2) if taps else None  # (B, T, len(taps), D)
        if isinstance(logits_for, str) and logits_for == "none":  # a prefill chunk before the last: no LM head
            return ModelOutput(logits=h.new_zeros(B, 0, self.config.vocab_size, dtype=torch.float32),
                               hidden=h[:, :0] if every is None else every, taps=tap)
        if isinstance(logits_for, torch.Tensor):  # one position per row
            h = h[torch.arange(B), logits_for].unsqueeze(1)
        elif logits_for == "last":
            h = h[:, -1:]
        h = self.norm(h)  # (B, T', D)
        return ModelOutput(logits=self.lm_head(h).float(), hidden=h if every is None else every, taps=tap)

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: list[int],
                tree: "TreeMask | None", packed: "Packing | None", T: int, layers: tuple[int, ...] | None,
                taps: tuple[int, ...], tapped: dict[int, torch.Tensor]) -> torch.Tensor:
        """The decoder layers module by module (the reference the fused ``Stack`` computes the bits of)."""
        with bulk(T > EXACT_MAX_T):  # a long prefill: GEMM path (never compared token for token)
            for i in range(len(self.layers)) if layers is None else layers:
                layer = self.layers[i]
                h = h + layer.attn(layer.attn_norm(h), cos, sin, cache.k[i], cache.v[i], start, tree, packed)
                h = h + layer.mlp(layer.mlp_norm(h))
                if i in taps:
                    tapped[i] = h
        return h

    def batch_invariant(self) -> bool:
        """Whether a token's keys, values and logits are the same bits however many tokens its forward holds:
        every decoder projection on the kernel (``QLinear``, with the kernel built) — the attention of a forward of
        up to ``EXACT_MAX_T`` tokens is the per-token call on every path. Dense (bf16 / fp32) projections run
        torch's GEMM, whose rounding depends on the row count."""
        from ..kernels import QLinear

        if extension() is None:
            return False
        for layer in self.layers:
            for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
                if not all(isinstance(p, QLinear) for p in (m.parts if isinstance(m, Concat) else [m])):
                    return False
        return True

    def _stack(self):
        """The compiled ``Stack`` of this model's decoder layers (kernels/csrc/bindings/stack.cpp), built at the
        first short forward, or None where a layer is not all K-quant projections and fp32 norms (dense or
        other codes, torch's ops) or ``fused_layers`` is off. A short forward of the Python loop costs ~60 us a
        layer in interpreter and dispatch (1.4 ms of the 0.5B draft's ~10 ms token); the Stack calls the same
        kernels in the same order, so the bits are the same. Rebuilt when a weight is replaced (``_apply``,
        ``__setattr__`` of the modules it reads: ``kernels.weights_epoch``)."""
        from ..kernels import weights_epoch

        if not self.fused_layers:
            return None
        epoch = weights_epoch()
        if self._stack_epoch != epoch:
            self._stack_plan, self._stack_epoch = _build_stack(self), epoch
        return self._stack_plan

    def _apply(self, fn, recurse=True):  # .to(), .float(), ...: the weights may be new tensors
        from ..kernels import bump_weights_epoch

        bump_weights_epoch()
        return super()._apply(fn, recurse)


_EMPTY_F32 = torch.empty(0)


def _build_stack(model: Transformer):
    """``kernels.extension().Stack`` over ``model``'s decoder layers, or None where one is not all K-quant
    projections (``QLinear`` of a ``KQ_BITS`` format, alone or in a ``Concat``) with fp32 norms and biases."""
    from ..kernels import KQ_BITS, QLinear

    ext = extension()
    if ext is None or not hasattr(ext, "Stack"):
        return None

    def parts(m: nn.Module) -> list | None:
        out = []
        for p in m.parts if isinstance(m, Concat) else [m]:
            if not isinstance(p, QLinear) or p.bits not in KQ_BITS:
                return None
            bias = p._parameters.get("bias")
            if bias is not None and bias.dtype != torch.float32:
                return None
            out.append((p.q.view(-1), p.bits, p.out_features, _EMPTY_F32 if bias is None else bias.contiguous()))
        return out

    eps = model.layers[0].attn_norm.eps if len(model.layers) else 0.0
    spec = []
    for layer in model.layers:
        norms = (layer.attn_norm, layer.mlp_norm)
        if any(not isinstance(n, RMSNorm) or n.weight.dtype != torch.float32 or n.eps != eps for n in norms):
            return None
        projs = [parts(m) for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)]
        if any(p is None for p in projs):
            return None
        spec.append((layer.attn_norm.weight.contiguous(), projs[0], projs[1], layer.mlp_norm.weight.contiguous(),
                     projs[2], projs[3]))
    return ext.Stack(spec, model.config.num_heads, model.config.num_kv_heads, float(eps)) if spec else None


class Concat(WatchedModule):
    """Several linear layers over the same input whose outputs are concatenated (a fused projection
    whose parts could not be merged into one matrix, e.g. differently quantized q/k/v)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class VocabSubset(nn.Module):
    """A draft model's output head over part of its vocabulary: the logits of the tokens in ``ranges`` (row
    ranges of the head's matrix, taken as views: no copy), of the tokens the running sequences hold (``hold``:
    their prompts' and outputs' tokens, whole 16-row tiles copied from ``full``, the whole head) and -inf for
    every other token, so the model's output keeps its full width. Most of a small model's bytes per token can
    be its head (Qwen2.5-0.5B: 152K x 896 of 494M weights); a draft rarely needs the rare tokens (FR-Spec, Zhao
    et al. 2025) unless the context has them — a name, a word of another language, an identifier the answer
    repeats. Lossless: every drafted token is still verified by the target, and a sampled draft's distribution
    q is the restricted one the rejection sampler is given (zero outside the subset)."""

    def __init__(self, parts: list[nn.Module], ranges: list[tuple[int, int]], vocab: int,
                 full: nn.Module | None = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.ranges, self.out_features = ranges, vocab
        # the whole head, outside the module tree (its storage is the parts' own; nothing is counted twice)
        self.__dict__["full"] = full
        self.kept = torch.zeros((vocab + 15) // 16, dtype=torch.bool)  # (V / 16,) tiles the ranges hold
        for a, b in ranges:
            self.kept[a // 16:(b + 15) // 16] = True
        self.held: dict[int, int] = {}  # tile -> how many sequences hold it
        self._extra: tuple | None = None  # _head_tiles: the held tiles' rows, their bias, their token ids
        self._stale = False

    def hold(self, ids, mine: set[int]) -> None:
        """Compute the tokens ``ids`` too, for a sequence whose held tiles are ``mine`` (updated in place; give
        it back to ``release``). Tiles the ranges already keep are not held."""
        if self.full is None:
            return
        tiles = {i // 16 for i in ids if 0 <= i < self.out_features} - mine
        for t in tiles:
            if not self.kept[t]:
                mine.add(t)
                self.held[t] = self.held.get(t, 0) + 1
                self._stale |= self.held[t] == 1

    def release(self, mine: set[int]) -> None:
        """A sequence that held the tiles ``mine`` is done with them."""
        for t in mine:
            n = self.held.pop(t) - 1
            if n:
                self.held[t] = n
            else:
                self._stale = True
        mine.clear()

    def _extra_rows(self) -> tuple | None:
        """``_head_tiles`` of the held tiles (copied from the whole head when the held set changed), or None
        when no tile is held."""
        if self._stale:
            self._stale = False
            self._extra = None
            if self.held:
                self._extra = _head_tiles(self.full, torch.tensor(sorted(self.held)), self.out_features)
        return self._extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_full((*x.shape[:-1], self.out_features), float("-inf"))  # (..., V)
        for (a, b), p in zip(self.ranges, self.parts):
            out[..., a:b] = p(x)
        extra = self._extra_rows()
        if extra is not None:
            part, bias, cols = extra
            y = part(x)[..., :len(cols)]  # (..., R): a K-quant code's last tile may hold padding rows past V
            out[..., cols] = y if bias is None else y + bias
        return out

    def extra_repr(self) -> str:
        return f"{sum(b - a for a, b in self.ranges)} of {self.out_features} tokens: {self.ranges}"


def _head_tiles(head: nn.Module, tiles: torch.Tensor, vocab: int) -> tuple[nn.Module, torch.Tensor | None,
                                                                          torch.Tensor]:
    """Rows of the 16-row tiles ``tiles`` (sorted, (n,)) of an output head, copied into one module of the
    head's kind without its bias, the bias of those rows (or None) and their token ids ((R,), R <= 16 n: a
    last tile past the vocabulary is cut; the module's outputs past R are padding)."""
    from ..kernels import QLinear
    from ..kernels.gguf_quant import QCode, code_tiles

    rows = (tiles[:, None] * 16 + torch.arange(16)).reshape(-1)
    rows = rows[rows < vocab]  # (R,)
    bias = None if head.bias is None else head.bias.detach().index_select(0, rows)
    if isinstance(head, QLinear):
        c = code_tiles(QCode(head.q, head.scale, head.minv if head.minv.numel() else None, head.group, head.bits),
                       tiles, vocab)
        part = QLinear(c.q, c.scale, c.minv, c.group, c.bits)
        part.act_bits = head.act_bits
    else:
        part = Linear.frozen(head.weight.detach().index_select(0, rows))
    return part, bias, rows


def restrict_vocab(model: Transformer, keep: int, also: set[int]) -> bool:
    """Make ``model``'s head a ``VocabSubset`` over token ids below ``keep`` and the ids in ``also`` (special
    tokens: end of turn, end of text), each range widened to whole 16-row tiles (the K-quant code's unit).
    Byte-level BPE vocabularies (Qwen2, Llama 3, GPT-2, SmolLM2) number their tokens in merge order, so the
    first ids are the most frequent pieces. False (nothing changed) when the head is not a plain matrix this
    can slice, or keeping those tokens would not leave out at least half of the vocabulary."""
    from ..kernels import QLinear
    from ..kernels.gguf_quant import QCode, code_rows

    head = model.lm_head
    V = int(getattr(head, "out_features", 0) or 0)
    if not isinstance(head, (QLinear, nn.Linear)) or isinstance(head, VocabSubset) or keep * 2 > V:
        return False
    if isinstance(head, nn.Linear) and head.weight.is_meta:
        return False
    rows = sorted({i // 16 for i in also if 0 <= i < V} | set(range((keep + 15) // 16)))
    ranges: list[tuple[int, int]] = []
    for r in rows:  # consecutive tiles merged into ranges
        if ranges and ranges[-1][1] == 16 * r:
            ranges[-1] = (ranges[-1][0], min(16 * r + 16, V))
        else:
            ranges.append((16 * r, min(16 * r + 16, V)))
    parts: list[nn.Module] = []
    for a, b in ranges:
        bias = None if head.bias is None else head.bias[a:b]
        if isinstance(head, QLinear):  # rows of its code, as views (dense bf16 / fp32 heads are codes too)
            c = code_rows(QCode(head.q, head.scale, head.minv if head.minv.numel() else None, head.group, head.bits),
                          a, b - a)
            part = QLinear(c.q, c.scale, c.minv, c.group, c.bits, bias)
            part.act_bits = head.act_bits
        else:
            part = Linear.frozen(head.weight[a:b], bias)
        parts.append(part)
    model.lm_head = VocabSubset(parts, ranges, V, full=head)
    return True


def _linear(sd: dict[str, torch.Tensor], name: str, dtype: torch.dtype, bias: str | None = None,
            storage: torch.dtype | None = None) -> nn.Module:
    """A QLinear when the weight is a quantized code, or when ``storage`` asks for dense weights in that
    dtype run by the batch-invariant kernel; else a plain nn.Linear in ``dtype``."""
    from ..kernels import QLinear

    b = sd.get(bias) if bias else None
    if name + ".q" in sd:
        group, bits = (int(v) for v in sd[name + ".qmeta"])
        return QLinear(sd[name + ".q"], sd[name + ".scale"], sd.get(name + ".minv"), group, bits, b)
    if storage is not None and sd[name].shape[1] % 16 == 0:
        return QLinear.dense(sd[name].to(storage), b)
    return Linear.frozen(sd[name].to(dtype), None if b is None else b.to(dtype))


# projections stored fused by the GGUF conversion (models/loading.py prefuse): runs ".0", ".1", ... of parts
# in the same format, each one matrix, so that a memory-mapped checkpoint needs no concatenation copy
FUSED_QKV, FUSED_GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"


def _prefused(sd: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, storage: torch.dtype | None
              ) -> nn.Module | None:
    runs = []
    while f"{prefix}.{len(runs)}.weight" in sd or f"{prefix}.{len(runs)}.weight.q" in sd:
        j = len(runs)
        bias = f"{prefix}.{j}.bias"
        runs.append(_linear(sd, f"{prefix}.{j}.weight", dtype, bias if bias in sd else None, storage))
    if not runs:
        return None
    return runs[0] if len(runs) == 1 else Concat(runs)


def _fuse(parts: list[nn.Module]) -> nn.Module:
    """Merge linears with the same input into one matmul where their storage formats agree."""
    from ..kernels import QLinear

    def key(m):
        if isinstance(m, QLinear):
            return ("q", m.group if m.bits < 16 else 0, m.bits, m.minv.numel() > 0, m.bias is not None)
        return ("dense", m.weight.dtype, m.bias is not None)

    merged: list[nn.Module] = []
    for m in parts:
        prev = merged[-1] if merged else None
        if prev is None or key(prev) != key(m):
            merged.append(m)
            continue
        if isinstance(m, QLinear):
            cat = lambda a, b: torch.cat([a, b]) if a.numel() else a  # noqa: E731
            merged[-1] = QLinear(torch.cat([prev.q, m.q]), torch.cat([prev.scale, m.scale]), cat(prev.minv, m.minv),
                                 m.group, m.bits, None if m.bias is None else torch.cat([prev.bias, m.bias]))
        else:
            merged[-1] = Linear.frozen(torch.cat([prev.weight, m.weight]),
                                       None if m.bias is None else torch.cat([prev.bias, m.bias]))
    return merged[0] if len(merged) == 1 else Concat(merged)


class QEmbedding(nn.Module):
    """The token embedding kept in its quantized code (llama.cpp's ``get_rows``): a lookup de-quantizes
    only the rows it needs, element by element with the same operations as de-quantizing the whole table,
    so the rows equal the dense fp32 table's exactly. A table tied to the output head shares its buffers."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group: int, bits: int,
                 dtype: torch.dtype):
        super().__init__()
        self.group, self.bits, self.dtype = group, bits, dtype
        self.register_buffer("q", q)  # (V, D/2) uint8 | (V, D) int8 | (V/16, D/block * tile) uint8 (K-quant)
        self.register_buffer("scale", scale)  # (V, D/G) float32 | (V, 0)
        self.register_buffer("minv", minv)  # (V, D/G) float32, or empty
        self.num_embeddings = scale.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from ..kernels import KQ_BITS, dequantize, extension, kq_shape

        flat = ids.reshape(-1)  # (n,)
        if self.bits in KQ_BITS:  # the K-quant code (csrc/core/kquant.h): its rows de-quantized in C++
            V, D = kq_shape(self.q, self.bits)
            rows = extension().kq_rows(self.q.view(-1), self.bits, V, D, flat.long())
            return rows.to(self.dtype).view(*ids.shape, -1)
        minv = self.minv[flat] if self.minv.numel() else None
        rows = dequantize(self.q[flat], self.scale[flat], minv, self.group, self.bits)  # (n, D) float32
        return rows.to(self.dtype).view(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, int{self.bits}, group={self.group}"


class GGUFEmbedding(nn.Module):
    """The token embedding read from the GGUF itself (a GGUF read in place, table not tied to the head):
    ``raw`` is a view of the memory-mapped file, one row of blocks per token, so only the rows looked up
    are ever paged in. A lookup re-packs those rows into the kernel's code (``repack_gguf``) and
    de-quantizes them as ``QEmbedding`` does: the same rows, bit for bit, without holding the whole table."""

    def __init__(self, raw: torch.Tensor, qtype: int, dim: int, dtype: torch.dtype):
        super().__init__()
        from ..kernels import extension

        self.raw, self.qtype, self.dim, self.dtype = raw, qtype, dim, dtype  # raw: (V, row bytes) uint8
        self.group, self.bits, self.has_min = extension().repack_format(qtype)
        self.num_embeddings = raw.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from ..kernels import dequantize, extension

        flat = ids.reshape(-1)  # (n,)
        rows = self.raw.index_select(0, flat)  # (n, row bytes): reads only these rows of the file
        n, D, G = flat.numel(), self.dim, self.group
        q = torch.empty(n, D * self.bits // 8, dtype=torch.uint8 if self.bits == 4 else torch.int8)
        scale = torch.empty(n, D // G)
        minv = torch.empty(n, D // G) if self.has_min else torch.empty(0)
        extension().repack_gguf(rows, self.qtype, n, D, q, scale, minv)
        out = dequantize(q, scale, minv if self.has_min else None, G, self.bits)  # (n, D) float32
        return out.to(self.dtype).view(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, ggml type {self.qtype} read from the file, int{self.bits}, group={self.group}"


def _embedding(sd: dict[str, torch.Tensor], name: str, dtype: torch.dtype, head: nn.Module | None) -> nn.Module:
    """The input embedding: quantized tables stay in their code (sharing the tied head's buffers), or in
    the GGUF's own blocks when it was read in place (``GGUFEmbedding``)."""
    if name + ".gguf" in sd:
        return GGUFEmbedding(sd[name + ".gguf"], int(sd[name + ".gguf_type"]), int(sd[name + ".gguf_dim"]), dtype)
    if name + ".q" not in sd:
        return nn.Embedding.from_pretrained(sd[name].to(dtype), freeze=True)
    from ..kernels import QLinear

    if isinstance(head, QLinear):  # tied: the head holds this very code
        return QEmbedding(head.q, head.scale, head.minv, head.group, head.bits, dtype)
    group, bits = (int(v) for v in sd[name + ".qmeta"])
    minv = sd.get(name + ".minv")
    return QEmbedding(sd[name + ".q"].contiguous(), sd[name + ".scale"].float().contiguous(),
                      (minv if minv is not None else torch.empty(0)).float().contiguous(), group, bits, dtype)


def from_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                    storage: torch.dtype | None = None) -> Transformer:
    """Build a Transformer from HF-named tensors (dense or quantized codes), fusing q/k/v and gate/up.
    ``dtype`` is the compute dtype; ``storage`` (bf16 / fp32) runs dense projections through the kernel."""
    with torch.device("meta"):
        model = Transformer(cfg, dtype)
    emb = "model.embed_tokens.weight"
    model.norm.weight = nn.Parameter(sd["model.norm.weight"].to(dtype), requires_grad=False)
    head = "lm_head.weight" if ("lm_head.weight" in sd or "lm_head.weight.q" in sd) else emb
    model.lm_head = _linear(sd, head, dtype, storage=storage) if head != emb or emb + ".q" in sd or storage \
        else None
    model.embed = _embedding(sd, emb, dtype, model.lm_head if head == emb else None)
    if model.lm_head is None:  # tied, dense: share the table
        model.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.embed.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer.attn_norm.weight = nn.Parameter(sd[p + "input_layernorm.weight"].to(dtype), requires_grad=False)
        layer.mlp_norm.weight = nn.Parameter(sd[p + "post_attention_layernorm.weight"].to(dtype), requires_grad=False)
        lin = lambda n, b=None: _linear(sd, p + n, dtype, b, storage)  # noqa: E731
        layer.attn.qkv = _prefused(sd, p + FUSED_QKV, dtype, storage) or _fuse(
            [lin(f"self_attn.{n}_proj.weight", p + f"self_attn.{n}_proj.bias" if cfg.qkv_bias else None)
             for n in "qkv"])
        layer.attn.o = lin("self_attn.o_proj.weight")
        layer.mlp.gate_up = _prefused(sd, p + FUSED_GATE_UP, dtype, storage) or _fuse(
            [lin("mlp.gate_proj.weight"), lin("mlp.up_proj.weight")])
        layer.mlp.down = lin("mlp.down_proj.weight")
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise ValueError(f"weight {name} missing from the checkpoint")
    return model.eval()


def random_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """A randomly initialised model (tests). Weights scaled so logits are spread out, not flat."""
    g = torch.Generator().manual_seed(seed)
    model = Transformer(cfg, dtype)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        scale = 3.0 if "lm_head" in name or "embed" in name else 1.0  # spread-out logits, not flat ones
        p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(fan_in))
    return model.to(dtype).eval()
