"""GPT-2-style decoder-only language model used as the engine's reference workload.

This module owns the model definition (`GPTConfig`, `GPT`, `CausalLMOutput`) and the analytic
size/cost formulas (`num_params`, `flops_per_token`). It deliberately follows a few rules the
PatrickStar engine relies on:

* No registered buffers: the engine builds models on the ``meta`` device and re-points parameter
  storage into chunks; buffers would be silently lost along the way.
* Every module reads only its *own* parameters inside its own ``forward``: the engine gathers a
  module's parameters in a forward pre-hook and may release them right after, so e.g. the LM head
  is always invoked as ``self.lm_head(x)`` and never as ``F.linear(x, self.wte.weight)``.
* Parameter registration order equals first-use order in the forward pass
  (``wte, wpe, blocks..., ln_f``; the tied LM-head weight is the same object as ``wte.weight``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalLMOutput",
    "CausalSelfAttention",
    "GPTConfig",
    "flops_per_token",
    "num_params",
]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    """Shape and hyper-parameters of a GPT model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int = 50257
    seq_len: int = 1024
    ffn_mult: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "seq_len", "ffn_mult"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn_mult * self.hidden_size


@dataclass
class CausalLMOutput:
    """Result of `GPT.forward`: ``loss`` is None when no labels were given."""

    loss: Tensor | None
    logits: Tensor


def num_params(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)``; a tied embedding/LM-head matrix is counted once."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    per_block = (
        2 * h  # ln_1
        + h * 3 * h
        + 3 * h  # attn.qkv
        + h * h
        + h  # attn.proj
        + 2 * h  # ln_2
        + h * f
        + f  # mlp.fc
        + f * h
        + h  # mlp.proj
    )
    total = v * h + cfg.seq_len * h + cfg.num_layers * per_block + 2 * h  # wte, wpe, blocks, ln_f
    if not cfg.tie_embeddings:
        total += v * h  # separate lm_head.weight
    return total


def flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs (forward + backward) per token at full sequence length.

    ``6 * N + 12 * L * h * S``: the first term is the usual 2 FLOPs per multiply-add times 3
    (forward, plus backward ≈ 2x forward) over every parameter N (the tied LM head matmul costs
    ``V * h`` per token, which is why the embedding is included). The second term is attention
    itself, which has no parameters: per layer and token, ``Q @ K^T`` and ``A @ V`` are each
    ``2 * S * h`` forward FLOPs, i.e. ``4 * S * h`` forward and ``12 * S * h`` for training.
    Causal masking is ignored (as in the PaLM/Megatron MFU formulas), so this slightly
    over-counts work an optimal kernel would do; activation recomputation is not included.
    """
    n = num_params(cfg)
    return 6 * n + 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_len


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        b, s, h = x.shape
        # (B, S, 3h) -> 3 x (B, nh, S, hd); the q|k|v column layout matches HF GPT-2's c_attn.
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            # SDPA rejects is_causal together with an explicit mask, so the mask already
            # contains the causal part (see GPT._build_attn_mask).
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: fc -> GELU(tanh) -> proj."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=True)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=True)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style causal language model (learned positions, pre-LN, optional tied LM head)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = nn.Embedding(config.seq_len, h)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(h, eps=config.layer_norm_eps)
        if config.tie_embeddings:
            # Build the head weight on meta so a tied model never allocates a throw-away V x h
            # matrix; tie_weights() then replaces it with wte.weight.
            self.lm_head = nn.Linear(h, config.vocab_size, bias=False, device="meta")
        else:
            self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    # ------------------------------------------------------------------ setup

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``wte.weight`` (if tied).

        Call again after anything that recreates Parameters, e.g. ``Module.to_empty`` from meta,
        which un-ties shared weights; `init_weights` does so automatically.
        """
        if self.config.tie_embeddings and self.lm_head.weight is not self.wte.weight:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, gather: Callable[[list[nn.Parameter]], Any] | None = None) -> None:
        """GPT-2 initialisation, in place on each module's current parameters.

        Only in-place ``torch.nn.init`` ops are used on ``module.weight``/``module.bias`` so that
        parameters whose ``.data`` has been re-pointed (e.g. into engine chunks) are initialised
        where they live; on ``meta`` tensors this is a no-op. `gather`, if given, is a context
        manager factory that makes one module's parameters whole while they are set (a
        sharded model's, e.g. DeepSpeed's ``zero.GatheredParameters``).
        """
        self.tie_weights()
        std = self.config.init_std
        # GPT-2 scales the residual-branch output projections by 1/sqrt(2 * n_layer) so the
        # variance of the residual stream does not grow with depth.
        resid_std = std / math.sqrt(2 * self.config.num_layers)
        resid_proj = set()
        for block in self.blocks:
            resid_proj.add(id(block.attn.proj))
            resid_proj.add(id(block.mlp.proj))
        seen: set[int] = set()
        for module in self.modules():
            whole = gather(list(module.parameters(recurse=False))) if gather else nullcontext()
            with whole:
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    if id(module.weight) in seen:  # tied lm_head: already initialised as wte
                        continue
                    seen.add(id(module.weight))
                    sd = resid_std if id(module) in resid_proj else std
                    nn.init.normal_(module.weight, 0.0, sd)
                    if isinstance(module, nn.Linear) and module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block's activations in backward instead of storing them."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    # ---------------------------------------------------------------- forward

    @staticmethod
    def _build_attn_mask(attention_mask: Tensor, seq_len: int) -> Tensor:
        """Boolean (B, 1, S, S) mask = causal AND key-not-padding (True = may attend).

        Built per call rather than cached, because the model must not own buffers.
        """
        device = attention_mask.device
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
        # A padded query whose keys are all masked would give a NaN softmax row; letting every
        # token see itself keeps the output finite (those positions are ignored anyway).
        eye = torch.eye(seq_len, dtype=torch.bool, device=device)
        return keep | eye[None, None]

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> CausalLMOutput:
        """Compute logits (B, S, V) and, if ``labels`` are given, the shifted next-token loss.

        ``labels`` use HF semantics: ``labels[:, t]`` is predicted from positions ``< t`` (the
        shift happens here), ``-100`` entries are ignored, the loss is the mean over the rest.
        ``attention_mask`` is an optional (B, S) 1/0 key-padding mask; positions are always
        ``0..S-1``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq_len = input_ids.shape[1]
        if seq_len > self.config.seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's seq_len {self.config.seq_len}"
            )
        mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            mask = self._build_attn_mask(attention_mask, seq_len)

        # arange rather than a registered position buffer: the model owns no buffers.
        pos = torch.arange(seq_len, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        use_ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, mask, use_reentrant=False) if use_ckpt else block(x, mask)
        logits = self.lm_head(self.ln_f(x))

        loss = None
        if labels is not None:
            # Upcast like HF so half-precision logits do not lose accuracy in log-softmax.
            shift_logits = logits[:, :-1, :].float()
            shift_labels = labels[:, 1:].to(logits.device)
            loss = F.cross_entropy(
                shift_logits.reshape(-1, shift_logits.size(-1)),
                shift_labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return CausalLMOutput(loss=loss, logits=logits)
