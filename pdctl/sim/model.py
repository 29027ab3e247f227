"""The sim's model: a tiny decoder-only transformer over bytes, in torch, on CPU.

Computation is float64 so that greedy output does not depend on batch composition (a
batched matmul may sum in another order than a single row; at float32 that flips rare
near-ties, at float64 it does not). Weights come from a seed (``sim://tiny``,
``sim://tiny?seed=7``, ``--load-format dummy``) or from a directory written by
``save_checkpoint`` (``config.json`` + ``model.safetensors``). Parameter names follow the
HF/SGLang convention (``model.layers.0.self_attn.q_proj.weight``) so that weight updates
look like real ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from pdctl.errors import SimError

BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
DTYPE = torch.float64


@dataclass(frozen=True)
class SimModelConfig:
    """The shape of the sim's tiny model (a ``sim://`` preset or a checkpoint's config.json) and the context it
    serves."""

    vocab_size: int = 260
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    """Head dim = hidden / heads = 32: nearer real models' 64-128 than 16, and on CPU fewer,
    wider heads make attention (the part of a decode step that grows with the batch) cheaper."""
    mlp: int = 256
    max_positions: int = 2048
    seed: int = 0
    context_length: int | None = None
    """The positions the engine serves (a request's prompt + output, KV per running request);
    None: ``max_positions``. Smaller than the position table, it keeps a model whose bytes are
    mostly that table (benchmarks/refit_stall.py's 256 MiB update) cheap to run."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``hidden // heads``."""
        return self.hidden // self.heads

    @property
    def context(self) -> int:
        """Positions a request may hold: ``context_length``, else ``max_positions``."""
        return self.context_length or self.max_positions


PRESETS = {
    "tiny": SimModelConfig(),
    "small": SimModelConfig(hidden=128, layers=4, heads=4, mlp=512),
}


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: UTF-8 bytes are the token ids."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Inverse of encode; special tokens are skipped, broken UTF-8 becomes U+FFFD."""
    return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")


class RMSNorm(nn.Module):
    """RMS normalization with a learned scale (epsilon 1e-6), as in Llama-style models."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normalized over its last dimension and scaled by ``weight``."""
        return F.rms_norm(x, self.weight.shape, self.weight, 1e-6)


class Block(nn.Module):
    """One pre-norm transformer layer, with Llama's parameter names (``self_attn.*_proj``,
    ``mlp.gate_proj``/``up_proj``/``down_proj``, the two layernorms) so weight updates address it as they would a
    real model."""

    def __init__(self, c: SimModelConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(c.hidden)
        self.self_attn = nn.ModuleDict(
            {
                n: nn.Linear(c.hidden, c.hidden, bias=False, dtype=DTYPE)
                for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            }
        )
        self.post_attention_layernorm = RMSNorm(c.hidden)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(c.hidden, c.mlp, bias=False, dtype=DTYPE),
                "up_proj": nn.Linear(c.hidden, c.mlp, bias=False, dtype=DTYPE),
                "down_proj": nn.Linear(c.mlp, c.hidden, bias=False, dtype=DTYPE),
            }
        )

    def forward(self, x: torch.Tensor, attend: Callable[[Block, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The residual stream after this layer (what a forward hook on ``model.layers.N`` sees);
        ``attend(block, normed)`` is the attention output, which prefill and decode compute
        differently (their KV lives outside the model)."""
        x = x + attend(self, self.input_layernorm(x))
        return x + self.mlp_out(x)

    def mlp_out(self, x: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP's output for the residual stream ``x`` (normed first); not yet added to ``x``."""
        h = self.post_attention_layernorm(x)
        return self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class TinyLM(nn.Module):
    """Pre-norm transformer with learned positions; KV lives outside (see KVPool)."""

    def __init__(self, config: SimModelConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(config.vocab_size, config.hidden, dtype=DTYPE),
                "embed_positions": nn.Embedding(config.max_positions, config.hidden, dtype=DTYPE),
                "layers": nn.ModuleList(Block(config, i) for i in range(config.layers)),
                "norm": RMSNorm(config.hidden),
            }
        )
        # A bias keeps random weights' output readable: printable ASCII, rare EOS, no control bytes.
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=True, dtype=DTYPE)
        generator = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    continue
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(param.shape[-1])
                param.copy_(torch.randn(param.shape, generator=generator, dtype=DTYPE) * std)
            bias = torch.full((config.vocab_size,), -8.0, dtype=DTYPE)
            bias[32:127] = 0.0
            bias[EOS_ID] = -2.5
            self.lm_head.bias.copy_(bias)
        self.requires_grad_(False)

    @property
    def blocks(self) -> list[Block]:
        """The transformer blocks (names stay ``model.layers.N.*``, as in HF checkpoints)."""
        return [block for block in self.model["layers"].children() if isinstance(block, Block)]

    # -- forward passes ----------------------------------------------------------
    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # [..., T, hidden] -> [..., heads, T, head_dim]
        *lead, t, _ = x.shape
        return x.view(*lead, t, self.config.heads, self.config.head_dim).transpose(-3, -2)

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a prompt. Returns (logits [T, V], kv [layers, 2, heads, T, head_dim])."""
        c = self.config
        if not ids:
            raise SimError("empty prompt")
        if len(ids) > c.context:
            raise SimError(f"prompt of {len(ids)} tokens exceeds the context length {c.context}")
        t = torch.tensor(ids)
        x = self.model["embed_tokens"](t) + self.model["embed_positions"](torch.arange(len(ids)))
        kv = []

        def attend(block: Block, h: torch.Tensor) -> torch.Tensor:
            q, k, v = (self._split(block.self_attn[n](h)) for n in ("q_proj", "k_proj", "v_proj"))
            kv.append(torch.stack([k, v]))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return block.self_attn["o_proj"](att.transpose(0, 1).reshape(len(ids), c.hidden))

        for block in self.blocks:
            x = block(x, attend)
        logits = self.lm_head(self.model["norm"](x))
        return logits, torch.stack(kv)

    def decode_step(self, ids: torch.Tensor, positions: torch.Tensor, pool: KVPool) -> torch.Tensor:
        """One token for each of B requests held in pool slots 0..B-1 (the scheduler keeps
        running requests dense). Appends K/V at ``positions``; returns logits [B, V]."""
        c = self.config
        batch = ids.shape[0]
        rows = torch.arange(batch)
        x = self.model["embed_tokens"](ids) + self.model["embed_positions"](positions)  # [B, hidden]
        span = int(positions.max()) + 1
        mask = torch.arange(span)[None, :] <= positions[:, None]  # [B, span]

        def attend(block: Block, h: torch.Tensor) -> torch.Tensor:
            layer = block.index
            q, k, v = (block.self_attn[n](h).view(-1, c.heads, c.head_dim) for n in ("q_proj", "k_proj", "v_proj"))
            pool.k[layer, rows, :, positions] = k
            pool.v[layer, rows, :, positions] = v
            # Views, not copies: [B, heads, span, head_dim], each head's positions contiguous.
            keys = pool.k[layer, :batch, :, :span]
            values = pool.v[layer, :batch, :, :span]
            att = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :])
            return block.self_attn["o_proj"](att.reshape(-1, c.hidden))

        for block in self.blocks:
            x = block(x, attend)
        return self.lm_head(self.model["norm"](x))

    # -- weights -----------------------------------------------------------------
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in by name (any dtype; cast to the model's). Unknown names fail first; a tensor
        that is the parameter itself is left as it is."""
        params = dict(self.named_parameters())
        for name, tensor in named:
            if name not in params:
                raise SimError(f"unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise SimError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in named:
                if tensor is not params[name]:  # received in place already (sim/weights.py receive)
                    params[name].copy_(tensor.to(DTYPE))


class KVPool:
    """Preallocated KV for ``slots`` running requests: [layers, slots, heads, positions, head_dim].

    Slot-major, so a batch of dense slots 0..B-1 is read as a view that attention takes as is.
    """

    def __init__(self, config: SimModelConfig, slots: int):
        shape = (config.layers, slots, config.heads, config.context, config.head_dim)
        self.slots = slots
        self.k = torch.zeros(shape, dtype=DTYPE)
        self.v = torch.zeros(shape, dtype=DTYPE)

    def write(self, slot: int, kv: torch.Tensor) -> None:
        """Store a prompt's kv [layers, 2, heads, T, head_dim] into ``slot``."""
        t = kv.shape[3]
        self.k[:, slot, :, :t] = kv[:, 0]
        self.v[:, slot, :, :t] = kv[:, 1]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into ``dst`` (compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def resolve_model(model_path: str, load_format: str, context_length: int | None) -> TinyLM:
    """Build the model named by ``--model-path``: ``sim://PRESET[?seed=N]`` or a checkpoint dir."""
    if model_path.startswith("sim://"):
        spec = model_path[len("sim://") :]
        name, _, query = spec.partition("?")
        if name not in PRESETS:
            raise SimError(f"unknown sim model {name!r}; choose from {', '.join(PRESETS)}")
        seed = 0
        for part in filter(None, query.split("&")):
            key, _, value = part.partition("=")
            if key != "seed" or not value.isdigit():
                raise SimError(f"bad sim model option {part!r}; only seed=N is known")
            seed = int(value)
        config = PRESETS[name]
        config = SimModelConfig(**{**asdict(config), "seed": seed})
        if context_length and context_length > config.max_positions:  # a preset's table grows to fit
            config = SimModelConfig(**{**asdict(config), "max_positions": context_length})
        return TinyLM(_serving(config, context_length))
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise SimError(f"{model_path}: not a sim checkpoint (no config.json); use sim://tiny or save_checkpoint()")
    config = _serving(SimModelConfig(**json.loads((path / "config.json").read_text())), context_length)
    model = TinyLM(config)
    if load_format != "dummy":
        try:
            tensors = load_file(str(path / "model.safetensors"))
        except Exception as exc:  # missing, unreadable or corrupt (safetensors' own error is no OSError)
            raise SimError(f"{path / 'model.safetensors'}: cannot load it: {type(exc).__name__}: {exc}") from exc
        model.load_weights(list(tensors.items()))
    return model


def _serving(config: SimModelConfig, context_length: int | None) -> SimModelConfig:
    """``config`` serving ``context_length`` positions (``--context-length``), at most its table's."""
    if not context_length:
        return config
    if context_length > config.max_positions:
        raise SimError(f"--context-length {context_length} exceeds the model's {config.max_positions} positions")
    return SimModelConfig(**{**asdict(config), "context_length": context_length})


def save_checkpoint(model: TinyLM, path: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` that ``--model-path`` can load."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(model.config), indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
