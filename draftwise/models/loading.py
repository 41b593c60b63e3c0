"""Load weights, config and tokenizer from a GGUF file or an HF safetensors folder.

GGUF tensors are re-laid out exactly (``gguf`` keeps the file's own integer codes, see
kernels/gguf_quant.py) or de-quantized with the ``gguf`` package (dense formats), renamed to HF names,
with q/k/v and gate/up concatenated where their formats agree (``prefuse``), and cached as safetensors
under ``$DRAFTWISE_HOME/converted/``. Later loads memory-map that file (``mmap_safetensors``): no copy at
start-up, and processes serving the same model share its pages. No pickle is ever loaded. Each converted
folder records its source (``SOURCE_RECORD``); writing a conversion removes the older ones of the same file.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import settings
from ..errors import DraftwiseError, InvalidParameterError, ModelNotFoundError
from .base import ModelConfig
from .registry import draftwise_home

SUPPORTED_ARCHS = ("llama", "qwen2")
CONVERT_VERSION = 7  # bump when the converted layout changes (2: projections stored fused; 3: GGUF read in place;
# 4: Q4_K / Q6_K kept in their own blocks, csrc/core/kquant.h; 5: so are Q4_0 / Q4_1 / Q5_0 / Q8_0; 6: an int8 /
# int4 conversion keeps an untied embedding in the GGUF's blocks, and every tensor starts 64-byte aligned; 7: an
# int8 / int4 conversion quantizes a tied embedding as the output head's code, instead of keeping it fp32)
SOURCE_RECORD = "draftwise_source.json"  # in each converted folder: the GGUF it was made from
LAYOUT_FILE = "gguf_layout.json"  # in each converted folder: where each tensor lies in the GGUF
EMBED = "model.embed_tokens.weight"

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"unsupported GGUF architecture {arch!r} (native backend: {SUPPORTED_ARCHS}); "
                                 "use --backend hf for other models")
    names = {t.name for t in reader.tensors}
    n_vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.token_type"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    return ModelConfig(
        arch=arch,
        vocab_size=int(n_vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_context=int(_field(reader, f"{arch}.context_length", 4096)),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
    )


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores llama's Q/K rows interleaved per head for its RoPE; undo it (HF layout).
    Works on weights and on per-row quantized codes and scales alike."""
    half = t.shape[0] // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None  # e.g. rope_freqs: unused


def gguf_state_dict(reader, cfg: ModelConfig, progress: bool = False, keep_quantized: bool = False
                    ) -> dict[str, torch.Tensor]:
    """HF-named tensors. With ``keep_quantized``, block-quantized matrices stay in their exact integer
    code as ``NAME.q / NAME.scale / NAME.minv / NAME.qmeta`` (see kernels/gguf_quant.py); everything
    else is de-quantized to float32."""
    items = [(t.name, t.data, t.tensor_type.name, [int(x) for x in reversed(t.shape)]) for t in reader.tensors]
    return _state_dict(items, cfg, progress, keep_quantized)


def _state_dict(items, cfg: ModelConfig, progress: bool, keep_quantized: bool, done=None, into=None
                ) -> dict[str, torch.Tensor]:
    """``gguf_state_dict`` over (GGUF name, raw data, type name, shape (out, in)) items; ``done(i)`` is
    called after item i has been read (the in-place loader releases its pages); a quantized matrix named in
    ``into`` is re-packed into that QCode (rows of a fused matrix) instead of becoming entries."""
    from tqdm.auto import tqdm

    from ..kernels.gguf_quant import kq_format, repack

    sd: dict[str, torch.Tensor] = {}
    for i, (gname, data, qtype, shape) in enumerate(tqdm(items, desc="load", disable=not progress, leave=False, delay=3.0)):
        name = _hf_name(gname)
        if name is None:
            continue
        n_head = None
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        dest = (into or {}).get(name)
        if n_head and len(shape) == 2 and kq_format(qtype, tuple(shape)) is not None:
            # the K-quant code interleaves rows by 16: undo llama's Q/K row order on the file's rows first
            with warnings.catch_warnings():  # a read-only map of the file: read (copied by the permutation)
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).view(shape[0], -1)
            data, n_head = _unpermute_rows(raw, n_head).numpy(), None
        code = repack(data, qtype, tuple(shape), out=None if n_head else dest) \
            if dest is not None or (keep_quantized and len(shape) == 2) else None
        if dest is not None:
            if code is None:
                raise ModelNotFoundError(f"{gname}: {qtype} cannot be read in place")
            if n_head:  # re-packed apart: move the rows (llama's Q/K order) into place
                for dst, val in ((dest.q, code.q), (dest.scale, code.scale), (dest.minv, code.minv)):
                    if val is not None:
                        dst.copy_(_unpermute_rows(val, n_head))
        elif code is not None:
            parts = {"q": code.q, "scale": code.scale, "minv": code.minv}
            for key, val in parts.items():
                if val is not None:
                    sd[f"{name}.{key}"] = _unpermute_rows(val, n_head) if n_head else val
            sd[f"{name}.qmeta"] = torch.tensor([code.group, code.bits])
        else:
            w = torch.from_numpy(_dequantize(data, qtype, shape))
            sd[name] = _unpermute_rows(w, n_head) if n_head else w
        if done is not None:
            done(i)
    return sd


def _dequantize(data: np.ndarray, qtype: str, shape) -> np.ndarray:
    """A GGUF tensor's values as a new fp32 array of ``shape`` (a copy: never a view of the file). F32 / F16
    (norms, biases) directly; other types through the gguf package's de-quantizer."""
    if qtype in ("F32", "F16"):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return raw.view(np.float32 if qtype == "F32" else np.float16).astype(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(data, GGMLQuantizationType[qtype]).astype(np.float32, copy=False).reshape(shape)
    return np.array(arr, dtype=np.float32)


_FUSE = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_CODE_PARTS = ("weight.q", "weight.scale", "weight.minv", "weight", "bias")


def _format(sd: dict[str, torch.Tensor], name: str) -> tuple:
    if name + ".weight.q" in sd:
        group, bits = (int(v) for v in sd[name + ".weight.qmeta"])
        return ("q", group, bits, name + ".weight.minv" in sd, name + ".bias" in sd)
    return ("dense", sd[name + ".weight"].dtype, name + ".bias" in sd)


def _fuse_runs(cfg: ModelConfig, fmt):
    """(fused prefix ``...NAME.j.``, layer prefix, run of part names) for every layer: consecutive parts of
    each fused projection whose ``fmt(module name)`` agree form one run; None parts (absent) are skipped."""
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for fused, parts in _FUSE.items():
            runs: list[list[str]] = []
            for part in parts:
                f = fmt(p + part)
                if f is None:
                    continue
                if runs and fmt(p + runs[-1][-1]) == f:
                    runs[-1].append(part)
                else:
                    runs.append([part])
            for j, run in enumerate(runs):
                yield f"{p}{fused}.{j}.", p, run


def prefuse(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Concatenate each layer's q/k/v and gate/up projections once, at conversion: consecutive parts in
    the same format (Q4_K_M mixes Q4_K and Q6_K) become runs ``NAME.0``, ``NAME.1``, ... of one matrix
    each (transformer.py ``_prefused``), the fusion the model would otherwise copy at every start.
    Parts already fused (absent from ``sd``) are left as they are."""
    def fmt(name):
        return _format(sd, name) if name + ".weight.q" in sd or name + ".weight" in sd else None

    for out, p, run in list(_fuse_runs(cfg, fmt)):
        for key in _CODE_PARTS:
            if p + run[0] + "." + key in sd:
                sd[out + key] = torch.cat([sd.pop(p + r + "." + key) for r in run])
        if p + run[0] + ".weight.qmeta" in sd:
            sd[out + "weight.qmeta"] = sd[p + run[0] + ".weight.qmeta"]
            for r in run:
                del sd[p + r + ".weight.qmeta"]
    return sd


def _fused_targets(table: list[dict], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor], list]:
    """For ``read_in_place``: each run of block-quantized parts (``_fuse_runs``) gets its fused matrix
    allocated once and every part is re-packed straight into its rows (no concatenation copy). Returns
    ({part weight name: QCode of row views}, {fused entries for the state dict}, those runs)."""
    from ..kernels import KQ_BITS
    from ..kernels.gguf_quant import QCode, code_rows, kq_code, kq_format, repack_format

    shapes, fmts, names = {}, {}, {_hf_name(e["name"]) for e in table}
    for e in table:
        name = _hf_name(e["name"])
        if not name.endswith(".weight") or len(e["shape"]) != 2:
            continue
        mod = name.removesuffix(".weight")
        code = kq_format(e["type"], tuple(e["shape"])) or repack_format(e["type"])
        shapes[mod] = e["shape"]
        fmts[mod] = ("q", *code[1:], mod + ".bias" in names) if code is not None else ("dense", mod + ".bias" in names)
    into, fused, runs = {}, {}, []
    every = list(_fuse_runs(cfg, fmts.get))
    dense = {out.rsplit(".", 2)[0] for out, p, run in every if fmts[p + run[0]][0] != "q"}
    for out, p, run in every:
        if out.rsplit(".", 2)[0] in dense:  # a projection with a dense part: prefuse concatenates it whole
            continue
        f = fmts[p + run[0]]
        runs.append((out, p, run))
        _, group, bits, has_min, _ = f
        N, K = sum(shapes[p + r][0] for r in run), shapes[p + run[0]][1]
        if bits in KQ_BITS:  # the K-quant code (kq_format): every part's rows are whole tiles of 16
            code = kq_code(N, K, bits)
        else:
            code = QCode(torch.empty(N, K * bits // 8, dtype=torch.uint8 if bits == 4 else torch.int8),
                         torch.empty(N, K // group), torch.empty(N, K // group) if has_min else None, group, bits)
        fused.update({out + "weight.q": code.q, out + "weight.scale": code.scale,
                      out + "weight.qmeta": torch.tensor([group, bits])})
        if code.minv is not None:
            fused[out + "weight.minv"] = code.minv
        row = 0
        for r in run:
            n = shapes[p + r][0]
            into[p + r + ".weight"] = code_rows(code, row, n)
            row += n
    return into, fused, runs


_ST_DTYPES = {"F64": (np.float64, None), "F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.int16, torch.bfloat16),
              "I64": (np.int64, None), "I32": (np.int32, None), "I16": (np.int16, None), "I8": (np.int8, None),
              "U8": (np.uint8, None), "BOOL": (np.bool_, None)}


_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
ST_ALIGN = 64  # every tensor of a converted copy starts on a cache line (the kernel's tiles are 64-byte groups)
_PAD = "__pad"  # names of the filler tensors between them


def save_aligned(sd: dict[str, torch.Tensor], path: Path | str, align: int = ST_ALIGN) -> None:
    """Write ``sd`` as a safetensors file whose every tensor starts ``align``-aligned in the file (the header
    padded with spaces, U8 filler tensors named ``__pad<i>`` between tensors: the format allows no holes),
    so that a memory map of it (``mmap_safetensors``, page-aligned) gives aligned tensors. safetensors'
    ``save_file`` packs tensors back to back: the 1.5B's kept copy mapped with every tile 16 bytes off a
    cache line ran its prompts 7-10 % slower (loads split across two lines)."""
    names = sorted(sd, key=lambda k: (-sd[k].element_size(), k))
    header: dict[str, dict] = {}
    order: list[torch.Tensor | int] = []  # tensors, and filler byte counts
    off = 0
    for name in names:
        t = sd[name]
        if t.dtype not in _ST_NAMES:
            raise TypeError(f"save_aligned: {name} has dtype {t.dtype}")
        gap = -off % align
        if gap:
            header[f"{_PAD}{len(header)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [off, off + gap]}
            order.append(gap)
            off += gap
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        order.append(t)
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % align)  # the data starts aligned too
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for item in order:
            if isinstance(item, int):
                f.write(bytes(item))
            elif item.numel():
                f.write(memoryview(item.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one private (copy-on-write) memory map: nothing is
    read or copied up front, pages come from the page cache as they are touched, and other processes
    mapping the same file share them. (safetensors' ``load_file`` copies every tensor into anonymous
    memory.) The header is parsed as the format specifies: 8-byte length, JSON, then the data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or name.startswith(_PAD):
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ModelNotFoundError(f"{path}: tensor {name} has dtype {info['dtype']}, not supported")
        np_dtype, view = _ST_DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        arr = data[a:b].view(np_dtype).reshape(info["shape"])
        t = torch.from_numpy(arr)
        out[name] = t.view(view) if view is not None else t
    return out


def hf_folder_config(folder: Path) -> ModelConfig:
    c = json.loads((folder / "config.json").read_text())
    arch = c.get("model_type")
    if c.get("is_encoder_decoder"):
        raise InvalidParameterError(f"{folder}: {arch or 'this'} is an encoder-decoder model; the native backend "
                                    "runs decoder-only Llama/Qwen2 models: use --backend hf")
    if arch not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"{folder}: model_type {arch!r} is not in the native backend "
                                 f"({SUPPORTED_ARCHS}); use --backend hf")
    heads = c["num_attention_heads"]
    return ModelConfig(
        arch=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rope_theta=float(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_eps=c.get("rms_norm_eps", 1e-6), max_context=c.get("max_position_embeddings", 4096),
        qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_folder_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder}: no .safetensors weights (pickled .bin weights are never loaded)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(mmap_safetensors(f))
    return sd


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def conversion_name(gguf_path: Path, version: int = CONVERT_VERSION) -> str:
    """The converted folder's name: the GGUF's stem and a key of its path, size, mtime and ``version``."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}".encode())
    return f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def converted_dir(gguf_path: Path) -> Path:
    return draftwise_home() / "converted" / conversion_name(gguf_path)


def read_source_record(folder: Path) -> dict | None:
    try:
        rec = json.loads((folder / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "source" in rec and "convert_version" in rec else None


def _write_source_record(gguf_path: Path, folder: Path) -> None:
    st = gguf_path.stat()
    rec = {"source": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "convert_version": CONVERT_VERSION}
    (folder / SOURCE_RECORD).unlink(missing_ok=True)  # may be a hard link into the previous folder
    (folder / SOURCE_RECORD).write_text(json.dumps(rec, indent=1))


def prune_conversions(gguf_path: Path, keep: Path) -> list[Path]:
    """Remove the conversions of ``gguf_path`` other than ``keep``: folders whose record names this file
    (made before it changed, or under an older layout) and unrecorded ones named by this file's key under
    an older CONVERT_VERSION. Folders of other files, and in-progress ``.tmp`` folders, are left alone."""
    src = str(gguf_path.resolve())
    older = {conversion_name(gguf_path, v) for v in range(CONVERT_VERSION)}
    removed = []
    for d in keep.parent.glob(f"{glob.escape(gguf_path.stem)}-*"):
        if d == keep or not d.is_dir() or not re.fullmatch(re.escape(gguf_path.stem) + r"-[0-9a-f]{12}", d.name):
            continue
        rec = read_source_record(d)
        if (d.name in older if rec is None
                else rec["source"] == src and int(rec["convert_version"]) <= CONVERT_VERSION):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def keep_converted() -> bool:
    """Whether a GGUF's kernel code is also kept as a converted safetensors copy (``DRAFTWISE_KEEP_CONVERTED``;
    default yes, where the disk has room: ``_keep_copy``). The copy holds the file's own blocks re-laid out
    (1.13 GB beside the 1.5B's 1.12 GB GGUF); later loads memory-map it: start-up skips the re-pack (0.62-0.67
    -> 0.29-0.32 s for the 1.5B on Zen 5) and processes serving the same model share its pages. ``0``: no copy
    is written (one kept earlier is still mapped), and every load re-packs the GGUF's blocks."""
    return settings.keep_converted()


def _write_converted(path: Path, out: Path, sd: dict | None, weights_name: str, cfg: ModelConfig,
                     cfg_name: str, table: list[dict]) -> None:
    """Write a converted folder: into ``<out>.<pid>.tmp`` (a folder a killed or failed run leaves is never read,
    and the next run starts it afresh), then renamed into place. A full disk is a clear error naming the
    space needed, and leaves no partial folder."""
    # one folder per process: two processes converting the same file at once (two test workers, two servers
    # started together) must not write into, or delete, each other's
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    for stale in _stale_tmps(out):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if out.exists():  # another format converted before: keep its files
            for f in out.iterdir():
                if f.is_file():
                    os.link(f, tmp / f.name)
        if not (tmp / "tokenizer_config.json").exists():
            _save_gguf_tokenizer(path, tmp)
        if sd is not None:
            save_aligned(sd, tmp / weights_name)
        (tmp / cfg_name).write_text(json.dumps(cfg.to_dict(), indent=1))
        (tmp / LAYOUT_FILE).unlink(missing_ok=True)
        (tmp / LAYOUT_FILE).write_text(json.dumps(table))
        _write_source_record(path, tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            need = sum(t.numel() * t.element_size() for t in sd.values()) if sd is not None else 2**20
            free = shutil.disk_usage(out.parent).free
            raise DraftwiseError(
                f"not enough disk space to convert {path.name}: the converted copy needs about "
                f"{need / 1e9:.2f} GB free in {out.parent}; {free / 1e9:.2f} GB is free. Free some space (or "
                f"point $DRAFTWISE_HOME elsewhere) and run again") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f"{out.name}.old.{os.getpid()}.tmp")
    try:
        out.rename(old)  # atomic: a reader sees the previous folder or this one, never a half-deleted one
    except FileNotFoundError:
        pass
    try:
        tmp.rename(out)
    except OSError:  # another process put its copy in place meanwhile (the same conversion): keep that one
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.exists():
            raise
    shutil.rmtree(old, ignore_errors=True)


def quantize_linears(sd: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization in blocks of 32 of every projection matrix (not embeddings, not norms):
    the ``int8`` / ``int4`` weight formats. Where the K-quant rule takes them (``kernels.gguf_quant.kq_format``:
    whole 16-row tiles, the kernel built, int8 activations) they are written as GGUF Q8_0 / Q4_1 blocks
    (gguf's own quantizer: fp16 scale, and min for Q4_1; 8.5 / 5 bits a weight) in its x16 layout, which
    runs one float step per block of 32 and shares each decoded weight among a tile of rows; else as the
    groups-of-32 code (``kernels.quantize_rtn``: fp32 scale and min, 9 / 6 bits a weight).

    A tied embedding (no ``lm_head.weight``: the table is also the output head, read whole for every token) is
    quantized like the head it is, and the input embedding then reads its rows from that code (``QEmbedding``);
    kept fp32, SmolLM2-135M's 49152 x 576 head alone cost 12 ms of a 16 ms token, ~4x its 30 layers."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from ..kernels import quantize_rtn
    from ..kernels.gguf_quant import kq_format, repack

    qtype = "Q8_0" if bits == 8 else "Q4_1"
    out = {}
    tied = "lm_head.weight" not in sd
    for k, v in sd.items():
        if v.dim() == 2 and (k != EMBED or tied) and v.shape[1] % 32 == 0:
            if kq_format(qtype, tuple(v.shape)) is not None:
                raw = quantize(np.ascontiguousarray(v.float().numpy()), getattr(GGMLQuantizationType, qtype))
                code = repack(raw, qtype, tuple(v.shape))
                out.update({k + ".q": code.q, k + ".scale": code.scale, k + ".qmeta": torch.tensor([code.group, code.bits])})
                continue
            q, scale, minv = quantize_rtn(v.float(), bits, 32)
            out.update({k + ".q": q, k + ".scale": scale, k + ".qmeta": torch.tensor([32, bits])})
            if minv is not None:
                out[k + ".minv"] = minv
        else:
            out[k] = v
    return out


def load_gguf(path: Path, dtype: torch.dtype | str, progress: bool = True, keep: bool | None = None):
    """Return (config, state_dict, tokenizer folder). ``dtype`` is a torch dtype (dense weights in it),
    "gguf" (keep the file's own quantization, exact) or "int8" / "int4" (``quantize_linears`` of the
    de-quantized weights, done once: the converted copy holds the codes). "gguf" reads the file in place: its blocks are
    re-packed into the kernel's code (``read_in_place``; the converted folder holds the config, tokenizer and
    tensor table), and that code is kept as a safetensors copy (``_keep_copy``) that later loads memory-map,
    unless ``keep`` is False or the disk lacks room. Dense formats (and "gguf" without the C++ kernel) are
    converted once to a safetensors copy, then memory-mapped. ``keep``: whether a "gguf" load keeps its copy
    (None: ``keep_converted()``, from the environment; default yes)."""
    from ..kernels import extension

    out = converted_dir(path)
    from ..kernels import activation_bits

    tag = dtype if isinstance(dtype, str) else _dtype_name(dtype)
    if tag in ("gguf", "int8", "int4") and activation_bits() == 32:  # the groups-of-32 code, not the K-quant rule's
        tag += "-exact"  # (kernels.gguf_quant.kq_format; quantize_linears)
    weights = out / f"model-{tag}.safetensors"
    cfg_file = out / "draftwise_config.json"
    described = cfg_file.exists() and (out / "tokenizer_config.json").exists()
    if weights.exists() and described:
        if not (out / SOURCE_RECORD).exists():  # converted before records were kept
            with contextlib.suppress(OSError):
                _write_source_record(path, out)
        return ModelConfig(**json.loads(cfg_file.read_text())), mmap_safetensors(weights), out
    keep = keep_converted() if keep is None else keep
    in_place = dtype == "gguf" and extension() is not None  # re-packed from the mapped file, then maybe kept
    if in_place and described and (out / LAYOUT_FILE).exists():
        cfg = ModelConfig(**json.loads(cfg_file.read_text()))
        table = json.loads((out / LAYOUT_FILE).read_text())
    else:
        from gguf import GGUFReader

        if progress:
            what = "reading the tensor layout of" if in_place else "converting"
            print(f"draftwise: {what} {path.name} (first load only) ...", file=sys.stderr)
        reader = GGUFReader(str(path))
        cfg = gguf_config(reader)
        table = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(x) for x in reversed(t.shape)],
                  "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors if _hf_name(t.name)]
        sd = None
        if not in_place:
            sd = gguf_state_dict(reader, cfg, progress, keep_quantized=dtype == "gguf")
            if dtype in ("int8", "int4"):
                sd = quantize_linears(sd, 8 if dtype == "int8" else 4)
                _embedding_as_blocks(sd, reader, cfg)
            elif not isinstance(dtype, str):
                sd = {k: v.to(dtype) for k, v in sd.items()}
            sd = prefuse(sd, cfg)
        del reader
        _write_converted(path, out, sd, weights.name, cfg, cfg_file.name, table)
        prune_conversions(path, out)
        if sd is not None:
            del sd  # the converted copy is mapped, like every later load
            return cfg, mmap_safetensors(weights), out
    sd = read_in_place(path, cfg, table, progress)
    if keep and _keep_copy(sd, weights, progress):
        del sd  # mapped from now on: the re-packed pages leave this process
        return cfg, mmap_safetensors(weights), out
    return cfg, sd, out


def _file_embedding(qtype: str, shape, nbytes: int, cfg: ModelConfig) -> int | None:
    """The ggml type id under which a token embedding of GGML type ``qtype`` stays in the GGUF's own blocks
    (``GGUFEmbedding``: a lookup de-quantizes only its rows, equal to the fp32 table's), or None: tied to the
    output head (which holds it as a code), or in a format the re-packer lacks."""
    from ..kernels.gguf_quant import repack_format

    fmt = repack_format(qtype)
    return None if fmt is None or cfg.tie_embeddings or nbytes % shape[0] else fmt[0]


def _embedding_entries(raw: torch.Tensor, tid: int, dim: int) -> dict[str, torch.Tensor]:
    """State-dict entries of an embedding kept in the GGUF's blocks: raw (V, bytes a row) of type ``tid``."""
    return {EMBED + ".gguf": raw, EMBED + ".gguf_type": torch.tensor(tid), EMBED + ".gguf_dim": torch.tensor(dim)}


def _embedding_as_blocks(sd: dict[str, torch.Tensor], reader, cfg: ModelConfig) -> None:
    """An untied token embedding kept as the GGUF's own blocks (as reading in place does) instead of its
    fp32 table, in an int8 / int4 conversion (which quantizes projections, never the embedding):
    Qwen2.5-0.5B's Q5_0 table is 94 MB on disk instead of 545 MB. Lookups read only their rows either way."""
    t = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if t is None or EMBED not in sd:
        return
    V, D = (int(x) for x in reversed(t.shape))
    tid = _file_embedding(t.tensor_type.name, (V, D), int(t.n_bytes), cfg)
    if tid is None:
        return
    del sd[EMBED]
    sd.update(_embedding_entries(torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8).reshape(V, -1)),  # a copy
                                 tid, D))


KEEP_MARGIN = 1 << 30  # a kept copy must leave this much of its disk free


def _keep_copy(sd: dict[str, torch.Tensor], weights: Path, progress: bool) -> bool:
    """Save a GGUF's re-packed code (``read_in_place``'s state dict) as ``weights`` beside its description,
    so that later loads memory-map it (no re-pack; processes share the pages). Written under a name of
    this process's own and renamed into place (concurrent first loads each write theirs, the last rename
    wins, every one complete). False, with a note, where the disk lacks the room (the copy's size plus
    ``KEEP_MARGIN``) or refuses the write: the load goes on from the re-packed code, as every later one will."""
    need = sum(t.numel() * t.element_size() for t in sd.values())
    for stale in _stale_tmps(weights):
        with contextlib.suppress(OSError):
            stale.unlink()
    free = shutil.disk_usage(weights.parent).free
    why = f"{free / 1e9:.2f} GB free in {weights.parent}" if free < need + KEEP_MARGIN else None
    if why is None:
        tmp = weights.with_name(f"{weights.name}.{os.getpid()}.tmp")
        try:
            save_aligned(sd, tmp)
            os.replace(tmp, weights)
            return True
        except OSError as e:
            tmp.unlink(missing_ok=True)
            why = f"{type(e).__name__}: {e.strerror or e}"
    if progress:
        print(f"draftwise: not keeping a converted copy ({need / 1e9:.2f} GB; {why}): each load re-packs the "
              "GGUF (DRAFTWISE_KEEP_CONVERTED=0 stops trying)", file=sys.stderr)
    return False


def _stale_tmps(path: Path) -> list[Path]:
    """The ``<path.name>[.old].<pid>.tmp`` files and folders beside ``path`` that a process now gone left (killed while
    writing): another live process's are in use, this process's its caller handles."""
    stale = []
    for p in path.parent.glob(glob.escape(path.name) + ".*.tmp"):
        with contextlib.suppress(ValueError):
            pid = int(p.name.split(".")[-2])
            if pid != os.getpid() and not _alive(pid):
                stale.append(p)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_in_place(path: Path, cfg: ModelConfig, table: list[dict], progress: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of ``load_gguf(path, "gguf")`` straight from the GGUF: the file is memory-mapped, each
    block-quantized matrix re-packed into the kernel's code (kernels/gguf_quant.py ``repack``: the same
    bytes as a conversion, on the kernel's threads), the rest de-quantized, then q/k/v and gate/up fused.
    Each tensor's pages are released from this process once read, so the peak memory stays close to the
    model's own. ``table``: the tensors' (name, type, shape, offset, nbytes), from the folder's LAYOUT_FILE."""
    import mmap

    size = path.stat().st_size
    if any(e["offset"] + e["nbytes"] > size for e in table):
        raise ModelNotFoundError(f"{path}: the file is shorter than its tensor table says (truncated or changed?); "
                                 f"remove {converted_dir(path)} and load again")
    # an untied token embedding stays in the file: only the rows looked up are ever read
    emb = next((e for e in table if e["name"] == "token_embd.weight"), None)
    emb_tid = _file_embedding(emb["type"], emb["shape"], emb["nbytes"], cfg) if emb is not None else None
    lazy = emb_tid is not None
    entries = [e for e in table if not (lazy and e is emb)]
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, never written
    buf = np.frombuffer(mm, dtype=np.uint8)

    def release(i: int) -> None:  # entry i's pages leave this process (they stay in the page cache)
        a = entries[i]["offset"] // page * page
        b = min(size, -(-(entries[i]["offset"] + entries[i]["nbytes"]) // page) * page)
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, a, b - a)

    try:
        items = [(e["name"], buf[e["offset"]:e["offset"] + e["nbytes"]], e["type"], e["shape"]) for e in entries]
        into, fused, runs = _fused_targets(table, cfg)
        sd = _state_dict(items, cfg, progress, keep_quantized=True, done=release, into=into)
        if lazy:
            V, D = emb["shape"]
            sd.update(_embedding_entries(torch.from_numpy(buf[emb["offset"]:emb["offset"] + emb["nbytes"]]).view(V, -1),
                                         emb_tid, D))
    finally:
        items = None
        del buf
        with contextlib.suppress(BufferError):
            mm.close()  # else when the last view goes (the embedding's)
    for out, p, run in runs:
        if p + run[0] + ".bias" in sd:  # biases of fused runs: small, concatenated
            fused[out + "bias"] = torch.cat([sd.pop(p + r + ".bias") for r in run])
    sd.update(fused)
    return prefuse(sd, cfg)  # runs of dense parts, if any


def _save_gguf_tokenizer(path: Path, dest: Path) -> None:
    """Build the fast tokenizer + chat template from GGUF metadata (transformers' converter) and save it."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(dest))
