"""GGUF file -> a model whose matrices keep the file's own formats, built one module at a time: no float copy of the
model ever exists.

- Q8_0 -> Int8Linear, Q4_0/Q4_1 -> Int4Linear (groups of 32), Q4_K/Q5_K/Q6_K -> KQuantLinear, MXFP4 (gpt-oss's
  experts) -> Fp4Linear, value for value (block_tensors). Q5_0/Q5_1 have no 5-bit kernel: their values go into
  Int8Linear, still exactly (d * (q - 16) is int8 q with Q8_0's scale, d * q + m the asymmetric int8 block), at 8.5
  bits a weight instead of 5.5.
- A module holds one layout, so a packed q/k/v of Q4_K q/k beside a Q6_K v (Q4_K_M files do this in about half
  their layers) is a RowSplitLinear of two kept modules; a qkv of Q5_0 q/k beside a Q8_0 v is one (both int8 blocks
  without offsets). Other quantized types (Q2_K/Q3_K), and other packed modules whose shards need different layouts:
  that module alone is dequantized and requantized to int8 (a second rounding, logged). F32/F16/BF16 matrices,
  norms and biases are float.
- The token embedding reads its rows from kept blocks (QuantEmbedding, one module with a tied lm_head; K-quants
  included), else it is a float table.

The model is built on the meta device and each module made real as its tensors are read; a tensor's pages leave the
mapping once copied (GGUFFile.release), so memory holds the finished modules plus the one in flight. The LM head and
the embedding go first: their transient copies are the largest, and little else is resident yet.
"""
from __future__ import annotations

import ctypes
import logging
import math
from collections import Counter
from itertools import groupby

import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from fastdecode.errors import ModelFileError
from fastdecode.loading.build import check_parameter_count
from fastdecode.loading.gguf_file import GGUFFile, read_gguf
from fastdecode.loading.gguf_loader import (GLOBAL_NAMES, block_tensors, dequantize_tensor, float_tensor, gguf_config,
                                            hf_name, permuted_heads)
from fastdecode.loading.gguf_moe import expert_tensors
from fastdecode.loading.weight_image import WeightImage
from fastdecode.models.transformer import PACKED_MODULES
from fastdecode.quant import build_linear, encode_linear, fits
from fastdecode.quant.embedding import QuantEmbedding
from fastdecode.quant.repack import ShardArena
from fastdecode.quant.split import RowSplitLinear

log = logging.getLogger(__name__)

KEPT = {QType.Q8_0: "int8", QType.Q5_0: "int8", QType.Q5_1: "int8",  # GGML type -> the scheme that holds it as is
        QType.Q4_0: "int4", QType.Q4_1: "int4", QType.Q4_K: "q4_k", QType.Q5_K: "q5_k", QType.Q6_K: "q6_k",
        QType.MXFP4: "mxfp4"}
WITH_MINS = {QType.Q5_1}  # int8 blocks with an offset: a module cannot mix them with symmetric ones
FLOAT_TYPES = {QType.F32, QType.F16, QType.BF16}
SHARDS: dict[str, list[str]] = {}  # our packed module -> its Hugging Face shards, in packing order
for _hf, (_ours, _) in sorted(PACKED_MODULES.items(), key=lambda item: item[1]):
    SHARDS.setdefault(_ours, []).append(_hf)
GGUF_NAMES = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}


def load_gguf_native(path, dtype: torch.dtype = torch.float32, progress=None, backend: str | None = None, shard=None):
    """`progress` wraps an iterable (of module names); `backend` forces the quant modules' (tests). `shard`: one
    tensor-parallel rank's cut (parallel/load.py's GGUFShard): it shapes the meta model to the rank's shard and cuts
    every tensor to the rank's rows or columns of blocks before a module is built from them; no weight image then."""
    f = read_gguf(path)
    config = gguf_config(f)
    model = check_parameter_count(config, [math.prod(t.shape) for t in f.tensors.values()], f.path, dtype)
    if shard is not None:
        shard.shape(model)
    # what the loader does to each module: replaces it (a matrix, the embedding) or sets its tensors (norms)
    kinds = {name: "module" if name == "embed_tokens" or type(m) is nn.Linear else "tensors"
             for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    kinds = {"lm_head": kinds.pop("lm_head"), "embed_tokens": kinds.pop("embed_tokens"), **kinds}
    # a load that forces a backend is a test's; a rank's shard has no image of its own (yet)
    image = WeightImage(f, dtype, enabled=backend is None and shard is None)
    formats = image.restore(model, kinds)
    if formats is None:
        with image.writing():
            loader = ModuleLoader(f, model.config, dtype, backend, None if shard is None else shard.cut)
            formats = load_modules(loader, model, kinds, progress)
        if "rope_freqs.weight" in f.tensors:
            model.rope_freq_factors = torch.from_numpy(dequantize_tensor(f.tensors["rope_freqs.weight"]).copy())
        image.finish(model, kinds, formats)
    log.info("gguf: kept compressed: %s", formats["kept"] or "none")
    for kind, n in formats["requantized"].items():
        log.warning("gguf: %d matrices of type %s have no kernel that keeps them compressed; requantized to int8",
                    n, kind)
    return model.eval()


def load_modules(loader: "ModuleLoader", model: nn.Module, names, progress) -> dict[str, dict[str, int]]:
    """Fills the meta model module by module -> the matrices kept in their formats and those requantized, by type."""
    trim = heap_trimmer()
    # Loading is byte moves (kernels/copy.cpp, kq_pack) bound by the kernel making the packed weights' fresh pages,
    # which two threads make faster than one: on the machine's threads, 8B Q4_0 loads in 4.1-4.3 s against 8.9 s
    # on one, Q4_K in 3.1-3.3 against 5.8 (a core busy with other work costs more then: each parallel move waits
    # for its slower half).
    for name in progress(names) if progress is not None else names:
        loader.load(model, name)
        trim()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelFileError(f"{loader.f.path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    return {"kept": dict(loader.kept), "requantized": dict(loader.requantized)}


def heap_trimmer():
    """glibc's malloc_trim, or a no-op elsewhere. glibc keeps freed blocks under its mmap threshold (up to 32 MB) in
    its heap, between the modules built since: on an 8B file those conversion copies held ~0.5 GB (10% of the
    model) until the end. Handing them back after each module keeps peak memory at the model plus one module."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    return (lambda: trim(0)) if trim is not None else (lambda: None)


class ModuleLoader:
    def __init__(self, f: GGUFFile, config, dtype: torch.dtype, backend: str | None, cut=None):
        """cut(name, tensor) -> a tensor-parallel rank's part of it (GGUFShard.cut), or None: whole tensors."""
        self.f, self.config, self.dtype, self.backend, self.cut = f, config, dtype, backend, cut
        self.tensors = {hf_name(t.name, config.family): t for t in f.tensors.values()}
        experts, self.expert_stacks = expert_tensors(f)  # an MoE file's experts: a view of the file per expert,
        self.tensors.update(experts)                        # and per layer and projection
        self.expert_modules: dict[tuple[str, str], list[nn.Module] | None] = {}
        self.kept, self.requantized = Counter(), Counter()
        self.arena = ShardArena()
        self.exact: set[str] = set()  # modules that hold the file's blocks as they are

    def tensor(self, name: str):
        if name not in self.tensors:
            raise ModelFileError(f"{self.f.path}: checkpoint lacks {GGUF_NAMES.get(name, name)}")
        t = self.tensors[name]
        return t if self.cut is None else self.cut(name, t)

    def float_weight(self, name: str) -> torch.Tensor:
        t = self.tensor(name)
        w = torch.from_numpy(float_tensor(t, name, self.config))
        self.f.release(t)
        return w

    def load(self, model: nn.Module, name: str):
        module = model.get_submodule(name)
        if name == "embed_tokens":
            model.embed_tokens = self.embedding(model)
        elif type(module) is nn.Linear:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, self.expert(name) or self.linear(name, module))
        else:  # norms
            for key, _ in list(module.named_parameters(recurse=False)):
                w = self.float_weight(f"{name}.{key}").to(self.dtype)
                if self.config.family == "gemma3" and key == "weight":
                    w.add_(1.0)  # the arithmetic of the float path (float_tensor's -1, load_weights' +1)
                setattr(module, key, nn.Parameter(w, requires_grad=False))

    def linear(self, name: str, module: nn.Linear) -> nn.Module:
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head":
            sources = ["lm_head" if "lm_head.weight" in self.tensors else "embed_tokens"]
        else:
            sources = [f"{prefix}.{shard}" for shard in SHARDS.get(leaf, [leaf])]
        return self.matrix(name, sources, module)

    def expert(self, name: str) -> nn.Module | None:
        """An MoE expert's linear (`layers.N.mlp.experts.E.leaf`) as a view of one module holding all the layer's
        experts for that projection, packed once, on the first expert's turn: one join and one packing per layer
        instead of one per expert (Qwen3-30B-A3B has 18k expert matrices), and the experts' weights lie stacked,
        as the native step reads them. None for any other module, or where the stack cannot be one native module
        (then each expert loads as any matrix)."""
        parts = name.split(".")
        if len(parts) != 6 or parts[2:4] != ["mlp", "experts"]:
            return None
        key = (".".join(parts[:4]), parts[5])
        if key not in self.expert_modules:
            self.expert_modules[key] = self.expert_stack(*key)
        modules = self.expert_modules[key]
        return None if modules is None else modules[int(parts[4])]

    def expert_stack(self, prefix: str, leaf: str) -> list[nn.Module] | None:
        shards = [self.expert_stacks.get(f"{prefix}.{s}.weight") for s in SHARDS.get(leaf, [leaf])]
        E = self.config.num_experts
        if any(t is None for t in shards) or len({t.type for t in shards}) != 1 or self.backend not in (None, "native"):
            return None
        scheme, K = KEPT.get(shards[0].type), shards[0].shape[1]
        rows = sum(t.shape[0] for t in shards) // E
        if scheme is None or rows % 4 or not fits(scheme, rows, K, 32):
            return None
        bias = None
        if self.config.moe_bias:  # gpt-oss: (experts, rows) per shard, joined expert by expert as the weights
            biases = [self.expert_stacks.get(f"{prefix}.{s}.bias") for s in SHARDS.get(leaf, [leaf])]
            if any(t is None for t in biases):
                return None
            bias = torch.cat([torch.from_numpy(float_tensor(t, t.name, self.config)).view(E, -1) for t in biases],
                             dim=1).flatten()
        stack = build_linear(self.arena.join([block_tensors(t) for t in shards], groups=E), scheme, bias, K, 32)
        self.arena.release(stack)
        if stack.backend != "native":
            return None
        for t in shards:
            self.f.release(t)
        self.kept[shards[0].type.name] += E
        return stack.split(E)

    def matrix(self, name: str, sources: list[str], module: nn.Module) -> nn.Module:
        """The (N, K) matrix of `module` (a meta nn.Linear, or nn.Embedding) from its shards' tensors, stacked."""
        shards = [self.tensor(f"{s}.weight") for s in sources]
        N, K = module.weight.shape
        if any(len(t.shape) != 2 or t.shape[1] != K for t in shards) or sum(t.shape[0] for t in shards) != N:
            raise ModelFileError(f"{self.f.path}: {name}: checkpoint shapes {[t.shape for t in shards]} do not make "
                                 f"the model's {N} x {K}")
        bias = getattr(module, "bias", None)
        bias = None if bias is None else torch.cat([self.float_weight(f"{s}.bias") for s in sources])
        kinds = {t.type for t in shards}
        kind = kinds.pop() if len(kinds) == 1 else None
        # Runs of shards in one layout (Q5_0 beside Q8_0 is one int8 layout) are kept as they are, one module each; a
        # q/k/v in two layouts (a Q4_K_M file's Q4_K q/k beside a Q6_K v) is a RowSplitLinear of two, which
        # decode_step.cpp runs. Anything else is requantized below.
        layout = lambda t: (KEPT.get(t.type), t.type in WITH_MINS)  # noqa: E731
        runs = [list(run) for _, run in groupby(zip(sources, shards), key=lambda pair: layout(pair[1]))]
        rows = [sum(t.shape[0] for _, t in run) for run in runs]
        schemes = [KEPT.get(run[0][1].type) for run in runs]
        if (len(runs) == 1 or (name.endswith("qkv_proj") and len(runs) == 2)) and all(
                scheme and fits(scheme, n, K, 32) for scheme, n in zip(schemes, rows)):
            parts, start = [], 0
            for run, n in zip(runs, rows):
                parts.append(self.kept_linear(run, None if bias is None else bias[start:start + n], K))
                start += n
            self.exact.add(name)
            return parts[0] if len(parts) == 1 else RowSplitLinear(parts)
        w = torch.cat([self.float_weight(f"{s}.weight") for s in sources]).to(self.dtype)
        if kind in FLOAT_TYPES and all(self.tensors[f"{s}.weight"].type in FLOAT_TYPES for s in sources):
            # float stays float, as in the float model (a shard's slice that had to be dequantized does not)
            module.weight = nn.Parameter(w, requires_grad=False)
            module.bias = None if bias is None else nn.Parameter(bias.to(self.dtype), requires_grad=False)
            return module
        self.requantized["/".join(sorted({self.tensors[f"{s}.weight"].type.name for s in sources}))] += 1
        return build_linear(encode_linear(w, "int8", backend=self.backend), "int8", bias, K, backend=self.backend)

    def kept_linear(self, run: list[tuple[str, object]], bias: torch.Tensor | None, K: int) -> nn.Module:
        """(source name, tensor) shards of one layout -> one quant module holding their blocks as they are. Views of
        the mapped file (block_tensors): a lone matrix is read once, by its packing; shards are joined first (q/k/v,
        gate/up: one copy more, into the loader's reused arena)."""
        parts = [block_tensors(t, permuted_heads(f"{s}.weight", self.config)) for s, t in run]
        linear = build_linear(self.arena.join(parts), KEPT[run[0][1].type], bias, K, 32, self.backend)
        self.arena.release(linear)
        for _, t in run:
            self.f.release(t)
        self.kept["/".join(sorted({t.type.name for _, t in run}))] += 1
        return linear

    def embedding(self, model: nn.Module) -> nn.Module:
        """Rows from the tied lm_head's blocks, or from the file's own embedding blocks, where those are kept as they
        are; else a float table (one parameter with a tied float lm_head, as load_weights ties them)."""
        tied = self.config.tie_word_embeddings
        if tied and isinstance(model.lm_head, nn.Linear):
            model.embed_tokens.weight = model.lm_head.weight
            return model.embed_tokens
        table = model.lm_head if tied and "lm_head" in self.exact else None
        t = self.tensor("embed_tokens.weight")
        if not tied and t.type in KEPT and fits(KEPT[t.type], *t.shape, 32):
            table = self.matrix("embed_tokens", ["embed_tokens"], model.embed_tokens)
        if table is not None and table.backend in table.row_backends:
            rows = QuantEmbedding(table, self.dtype)
            if hasattr(model.embed_tokens, "look_up_in"):  # a tensor-parallel shard's vocabulary slice
                return model.embed_tokens.look_up_in(rows)
            return rows
        model.embed_tokens.weight = nn.Parameter(self.float_weight("embed_tokens.weight").to(self.dtype),
                                                 requires_grad=False)
        return model.embed_tokens
