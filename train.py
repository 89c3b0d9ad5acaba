"""
The baseline recipe: a nanochat-style GPT trained with Muon + AdamW for a fixed wall-clock budget, the one file a
participant edits. The recipe comes first, top to bottom (hyperparameters, the model and its loss, the optimizer,
the schedules, the data, the loop, load_for_eval); under the banner "Machinery" follows what a run needs around it.

    NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 train.py   # Trainium2, 4 ranks of 2 cores
    NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=64 train.py --preset phase2   # 16 chips, 4 h
    python train.py --preset cpu      # a laptop: 5 minutes that learn something
    python train.py --help            # every hyperparameter is a flag; the organisers' spellings work too

It imports from prepare.py only the organisers' names, so it runs under their harness too. The run writes
out/final.pt and a summary after `---`; the scorer imports this file and calls load_for_eval().
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from prepare import (TOKENIZER_VOCAB_SIZE, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS, TRAIN_STARTUP_STEPS_EXCLUDED,
                     TRAIN_TIME_BUDGET_SECONDS, ensure_tokenizer, evaluate_bpb, get_dist_info, make_dataloader, print0,
                     record_step_boundary)


# ======== THE RECIPE ==================================================================================================
@dataclass
class Recipe:
    """The hyperparameters: everything that changes the training trajectory, each a flag (--depth 12); --resume
    continues only a run of the same recipe. How a run executes around it is RunOptions, under the banner below."""
    # Model: its size here; what it is made of is Architecture (the model section), whose fields are flags too
    depth: int = 10  # transformer blocks; depth 10 at aspect ratio 64 is ~59.6M parameters
    aspect_ratio: int = 64  # width = depth * aspect_ratio, rounded up to a multiple of head_dim
    head_dim: int = 128  # 128 matches the 128x128 TensorEngine and the 128-lane SBUF partitions
    seq_len: int = 2048  # training context; the scorer evaluates at EVAL_SEQ_LEN
    architecture: Architecture = field(default_factory=lambda: Architecture())
    # Batch
    total_batch_size: int = 2**18  # tokens per step, all ranks together: half autoresearch's (more steps win)
    device_batch_size: int = 8  # rows per micro-batch on each rank (at most: batch_geometry); accumulation: the rest
    # Optimizer (learning rates as in nanochat/autoresearch; AdamW ones scale with 1/sqrt(width/768))
    embedding_lr: float = 0.6  # AdamW, token embedding
    unembedding_lr: float = 0.004  # AdamW, lm_head
    matrix_lr: float = 0.04  # Muon, every matrix in the blocks
    scalar_lr: float = 0.5  # AdamW, per-layer residual scalars
    adam_beta1: float = 0.8  # AdamW's decay of its gradient average
    adam_beta2: float = 0.95  # ... and of its squared-gradient average
    weight_decay: float = 0.2  # Muon's cautious weight decay, decayed linearly to 0 over the budget
    muon_momentum_start: float = 0.85  # Muon momentum ramps from start to end ...
    muon_momentum_end: float = 0.95  # ...
    muon_momentum_warmup_ratio: float = 0.15  # ... over this fraction of the budget
    muon_ns_steps: int = 5  # Polar Express iterations
    muon_beta2: float = 0.95  # NorMuon's second-moment decay
    # Schedule, keyed to training progress (see training_progress: charged time, or steps when max_steps is set)
    warmup_ratio: float = 0.0  # the first part of the budget ramps the learning rate up from 0
    warmdown_ratio: float = 0.5  # the last half of the budget decays the learning rate linearly
    final_lr_frac: float = 0.0  # learning rate at the end, as a fraction of the peak
    # Length and numerics
    time_budget: float = float(TRAIN_TIME_BUDGET_SECONDS)  # seconds of charged time (see BudgetClock), save included
    max_steps: int = 0  # stop after this many steps, and schedule on steps instead of time (0: the budget decides)
    seed: int = 42  # the weights' initialisation and the data's order after the first pass
    dtype: str = "auto"  # compute dtype of matmuls: auto (bf16 where the device is fast at it), bf16, fp32

    def __post_init__(self):
        check_values(self, RECIPE_RULES)


def check_values(settings, rules: dict) -> None:
    """A value no run can use is one clear error naming its flag, before any data, device or process group."""
    for name, (ok, what) in rules.items():
        if not ok(getattr(settings, name)):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(settings, name)}: must be {what}")


AT_LEAST_1, NON_NEGATIVE = (lambda v: v >= 1, "at least 1"), (lambda v: v >= 0, "0 or more")
RECIPE_RULES = {**dict.fromkeys("depth aspect_ratio head_dim seq_len total_batch_size device_batch_size "
                                "muon_ns_steps".split(), AT_LEAST_1),
                **dict.fromkeys("embedding_lr unembedding_lr matrix_lr scalar_lr weight_decay max_steps".split(),
                                NON_NEGATIVE),
                **dict.fromkeys("warmup_ratio warmdown_ratio final_lr_frac muon_momentum_warmup_ratio adam_beta1 "
                                "adam_beta2 muon_momentum_start muon_momentum_end muon_beta2".split(),
                                (lambda v: 0 <= v <= 1, "between 0 and 1")),
                "time_budget": (lambda v: v > 0, "a positive number of seconds")}


# ---- Model: GPT with untied embedding/head, RMSNorm, rotary embeddings, QK-norm, ReLU^2, softcap ---------------------
EVAL_SEQ_LEN = 1024  # the scorer's evaluation context (the organisers' and this kit's): the rotary tables cover it


def ingredient(off, on):
    """An Architecture field, off by default (the default d10 stays the organisers' baseline); `on` turns it on."""
    return field(default=off, metadata={"on": on})


@dataclass
class Architecture:
    """What the GPT is made of beyond its size: each field a flag and a key of the checkpoint's model_config."""
    logit_softcap: float = 15.0  # logits = cap * tanh(logits / cap): stabilises early training
    rope_base: float = 10000.0  # rotary embedding base frequency
    n_kv_head: int = 0  # key/value heads (grouped-query attention), a divisor of the query heads; 0: as many
    # nanochat's value embeddings: "alternate" layers (every other one, the last one included) add a token
    # embedding of their own to the attention's values, through a gate per key/value head; "": none
    value_embeds: str = ingredient("", on="alternate")
    # attention context per layer, the pattern tiled over the layers: S a window of short_window tokens, L a training
    # row (the scorer's longer rows reach no further back); the last layer is always L
    window_pattern: str = ingredient("L", on="SSSL")
    short_window: int = 0  # tokens an S layer sees, itself included (0: a quarter of the sequence length)


@dataclass
class GPTConfig(Architecture):
    """The model, its architecture and size, checked here once: a malformed flag fails before any data or device."""
    sequence_len: int = 2048
    vocab_size: int = TOKENIZER_VOCAB_SIZE
    n_layer: int = 10
    n_head: int = 5
    n_embd: int = 640

    def __post_init__(self):
        check_values(self, dict.fromkeys(("logit_softcap", "rope_base"), (lambda v: v > 0, "positive")))
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} is not {self.n_head} heads of even size (an even --head-dim)")
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            divisors = ", ".join(str(k) for k in range(1, self.n_head + 1) if self.n_head % k == 0)
            raise ValueError(f"--n-kv-head {self.n_kv_head}: must divide the {self.n_head} query heads (width / "
                             f"--head-dim): {divisors}; 0: as many")
        self.window_pattern = self.window_pattern.upper()
        self.short_window = (self.short_window or max(1, self.sequence_len // 4)) if "S" in self.window_pattern else 0
        self.value_embed_layers = value_embed_layers(self.value_embeds, self.n_layer)
        self.windows = layer_windows(self.window_pattern, self.short_window, self.n_layer, self.sequence_len)
        self.kv_width = self.n_kv_head * self.n_embd // self.n_head  # channels of the keys, values, value embeddings


def model_config(recipe: Recipe, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> GPTConfig:
    """The recipe's model: its architecture, and the width from depth x aspect ratio in whole heads."""
    width = -(-recipe.depth * recipe.aspect_ratio // recipe.head_dim) * recipe.head_dim
    return GPTConfig(**asdict(recipe.architecture), sequence_len=recipe.seq_len, vocab_size=vocab_size,
                     n_layer=recipe.depth, n_head=width // recipe.head_dim, n_embd=width)


VALUE_EMBED_GATE_CHANNELS = 32  # the gate of a value embedding reads this many channels of the layer's input


def value_embed_layers(spec: str, n_layer: int) -> list[int]:
    """The layers with a value embedding, from --value-embeds: every other one counted back from the last, or none."""
    if spec not in ("", "alternate"):
        raise ValueError(f"--value-embeds {spec!r}: use alternate (nanochat's layers), or leave it empty for none")
    return [i for i in range(n_layer) if i % 2 == (n_layer - 1) % 2] if spec == "alternate" else []


def layer_windows(pattern: str, short_window: int, n_layer: int, sequence_len: int) -> list[int]:
    """Each layer's attention window in tokens, from --window-pattern: short_window for S, for L the training rows'
    length, so that a longer row (the scorer's) never asks a layer to look further back than it learned to."""
    if not pattern or set(pattern) - set("SL"):
        raise ValueError(f"--window-pattern {pattern!r}: use the letters L (a training row) and S (a window of "
                         "--short-window tokens), e.g. SSSL")
    if "S" in pattern and short_window < 1:
        raise ValueError(f"--window-pattern {pattern} needs a --short-window of at least 1 token")
    windows = [short_window if pattern[i % len(pattern)] == "S" else sequence_len for i in range(n_layer)]
    return windows[:-1] + [sequence_len]  # the last layer sees the whole training row


# The ops a kernel may replace, plain PyTorch: each --nki-* flag binds its kernel in place of one (KERNEL_OPS, below).

def norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without a learned scale (--nki-rmsnorm: kernels/rmsnorm.py)."""
    return F.rms_norm(x, (x.size(-1),))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """The MLP activation (--nki-relu2: the inline NKI kernel pair, under the banner below)."""
    return F.relu(x).square()


def rope_qknorm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, then QK-norm; x is [B, T, H, D] (--nki-rope-qknorm: kernels/rope_qknorm.py)."""
    return norm(apply_rotary(x, cos, sin))


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [1, seq_len, 1, head_dim / 2]."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels; x is [B, T, H, D]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(x.dtype)


def autocast_context(device_type: str, dtype: torch.dtype | None):
    """Matmuls in `dtype`; None or fp32: no autocast (the meta device has none; a CPU's warns at fp32)."""
    return contextlib.nullcontext() if dtype in (None, torch.float32) else torch.autocast(device_type, dtype=dtype)


def uses_flex_attention(device: torch.device) -> bool:
    """Whether window layers run FlexAttention (CUDA, compiled: it skips blocks outside the window), not masked SDPA."""
    return device.type == "cuda" and torch.compiler.is_compiling()


def sliding_window_block_mask(T: int, window: int, device: torch.device) -> BlockMask:
    """FlexAttention's mask of a causal window: query q sees keys k with q - window < k <= q."""
    return create_block_mask(lambda b, h, q, k: (k <= q) & (q - k < window), None, None, T, T, device=device)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, value_embed: bool = False):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_k = nn.Linear(config.n_embd, config.kv_width, bias=False)
        self.c_v = nn.Linear(config.n_embd, config.kv_width, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # value embedding: a gate per key/value head, read from the first channels of the layer's input
        self.ve_gate = nn.Linear(min(VALUE_EMBED_GATE_CHANNELS, config.n_embd), config.n_kv_head, bias=False) \
            if value_embed else None

    def forward(self, x, cos, sin, mask=None, ve=None):
        """mask: [B, 1, T, T] bool, True where a query may attend; None: causal. ve: this layer's value
        embedding of the tokens [B, T, C], or None."""
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # the gate is in (0, 2), 1 at the start
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))
            v = v + gate.unsqueeze(-1) * ve.view_as(v).to(v.dtype)
        q, k = rope_qknorm(q, cos, sin), rope_qknorm(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = self.n_kv_head < self.n_head  # (only then: with as many k/v heads, the kernels stay as they were)
        if isinstance(mask, BlockMask):  # a sliding window on a compiled CUDA model (GPT.layer_masks); autocast
            y = flex_attention(q.to(v.dtype), k.to(v.dtype), v, block_mask=mask, enable_gqa=gqa)  # passes it by
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(relu_squared(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, value_embed: bool = False):
        super().__init__()
        self.attn = CausalSelfAttention(config, value_embed)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask=None, ve=None):
        x = x + self.attn(norm(x), cos, sin, mask, ve)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        V, C, L = config.vocab_size, config.n_embd, config.n_layer
        self.wte = nn.Embedding(V, C)
        self.blocks = nn.ModuleList(Block(config, i in config.value_embed_layers) for i in range(L))
        self.lm_head = nn.Linear(C, V, bias=False)
        # Per-layer mix of the residual stream and the (normed) embedding x0, as in nanochat.
        self.resid_lambdas = nn.Parameter(torch.ones(L))
        self.x0_lambdas = nn.Parameter(torch.full((L,), 0.1))
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(V, config.kv_width) for i in config.value_embed_layers})
        # Rotary tables cover the training context and the scorer's evaluation context.
        cos, sin = rotary_tables(max(config.sequence_len, EVAL_SEQ_LEN), C // config.n_head, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.compute_dtype: torch.dtype | None = None  # autocast dtype of forward(); set for the device

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init, by what each weight is, drawn once each in nanochat's order (the token embedding, the head,
        then the rest as declared). A head, any Linear to the vocabulary (a second head, one tied to the embedding):
        normal, std 0.001. The token embedding: normal, std 1 (tied, the head's wins: the forward norms the embedding,
        and a unit-normal head starts at twice uniform guessing's loss). The Linear that writes to the residual
        stream, the last each branch of a block (attention, MLP, one of yours) applies, and a value-embedding gate:
        zero (each block starts as the identity). Any other Linear or Embedding: uniform in +-sqrt(3 / width).
        Scalars keep their values; a rule of yours is one more branch below."""
        bound, drawn, V = 3**0.5 * self.config.n_embd**-0.5, set(), self.config.vocab_size
        writers = forward_on_meta(self.config, type(self)).writers
        heads = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear) and m.out_features == V}
        for name, module in [("wte", self.wte), ("lm_head", self.lm_head), *self.named_modules()]:
            weight = getattr(module, "weight", None)
            if not isinstance(weight, nn.Parameter) or id(weight) in drawn:
                continue
            drawn.add(id(weight))
            if id(weight) in heads:
                nn.init.normal_(weight, std=0.001)
            elif module is self.wte:
                nn.init.normal_(weight, std=1.0)
            elif name in writers or name.endswith("ve_gate"):
                nn.init.zeros_(weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.uniform_(weight, -bound, bound)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per weight but a table only looked up (an Embedding's: tied to a head, it is the
        head's matmul too), plus attention's scores and values over each layer's context or window (PaLM's rule)."""
        c = self.config
        lookups = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)} - \
            {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
        multiplied = sum(p.numel() for p in self.parameters() if id(p) not in lookups)
        context = sum(min(w, c.sequence_len) for w in c.windows)
        return 6 * multiplied + 12 * c.n_embd * context

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32), or the training loss when targets are given. positions [B, T] (each token's
        rotary position; default 0..T-1) and attn_mask [B, 1, T, T] (bool, True where a query may attend; default
        causal) let one row hold several sequences (inference.py's shared prefix and its continuations), each token
        getting the logits its own sequence alone would; a sliding window derives from the positions."""
        cos, sin = self.rotary(idx.shape[1], positions)
        masks = self.layer_masks(idx.shape[1], positions, attn_mask)
        with autocast_context(idx.device.type, self.compute_dtype):
            x = x0 = norm(self.wte(idx))
            for i, block in enumerate(self.blocks):
                ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
                x = block(self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0, cos, sin, masks[i], ve)
            logits = self.lm_head(norm(x))
        cap = self.config.logit_softcap
        if targets is not None:
            return training_loss(logits, targets, cap)
        logits = logits.float()  # where no gradient flows (the scorers), in place: no [B, T, V] copies
        return softcap(logits, cap) if logits.requires_grad else logits.div_(cap).tanh_().mul_(cap)

    def layer_masks(self, T: int, positions: torch.Tensor | None, attn_mask: torch.Tensor | None) -> list:
        """Each layer's mask: the caller's (None: causal), in a window layer within the window by rotary position."""
        windows = [w if w < T else None for w in self.config.windows]  # None: no narrower than causal here
        if all(w is None for w in windows):
            return [attn_mask] * len(windows)
        device = self.cos.device
        if positions is None and attn_mask is None and uses_flex_attention(device):
            masks = {w: sliding_window_block_mask(T, w, device) for w in set(windows) if w}
            return [masks[w] if w else None for w in windows]
        pos = positions if positions is not None else torch.arange(T, device=device)[None]
        allowed = attn_mask if attn_mask is not None else \
            torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
        masks = {w: allowed & ((pos[:, :, None] - pos[:, None, :]) < w)[:, None] for w in set(windows) if w}
        return [masks[w] if w else attn_mask for w in windows]

    def rotary(self, T: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at positions 0..T-1 ([1, T, 1, head_dim / 2]), or at `positions` ([B, T, 1, head_dim / 2])."""
        if positions is not None:
            return self.cos[0, positions], self.sin[0, positions]
        if T > self.cos.shape[1]:
            raise ValueError(f"sequence of {T} tokens exceeds the rotary tables ({self.cos.shape[1]})")
        return self.cos[:, :T], self.sin[:, :T]


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits stay within +-cap."""
    return cap * torch.tanh(logits / cap)


def training_loss(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """What training minimises: the softcapped logits' mean cross-entropy, in fp32. An auxiliary term goes here
    (--nki-softcap-ce then refuses the loss, which its kernel no longer computes)."""
    logits = softcap(logits.float(), cap)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(config: GPTConfig, device="cpu", dtype: str = "auto", init: bool = True) -> GPT:
    """The GPT on `device`, initialised or left for a state dict, autocast to the compute dtype: how all build it."""
    model = GPT(config).to(device)
    if init:
        model.init_weights()
    # what forward() autocasts to, fp32 named too: inference.py sizes its packed-row probe's tolerance by it
    model.compute_dtype = compute_dtype_for(torch.device(device).type, dtype) or torch.float32
    return model


# ---- Optimizer: Muon (Polar Express, NorMuon, cautious weight decay) for matrices, AdamW for the rest ----------------
# Polar Express (Amsel et al. 2025) coefficients for 5 iterations, as in modded-nanogpt and nanochat.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalize each matrix of g [B, M, N] (U V^T of its SVD). bf16 is enough
    for the iteration (and fast); fp32 runs keep it in fp32."""
    x = g.to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b g + c g²) x
    return x.mT if tall else x


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, weight_decay, beta1: float, beta2: float, eps: float):
    """One AdamW step, in place, on a parameter or on this rank's slice of one. The step count and the
    per-step lr and weight decay are 0-D tensors on the device, so the compiled graph never changes."""
    step.add_(1)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    # lr / (1 - beta1^step) divides the denominator, so addcdiv_ needs no temporary (lr = 0: infinite, a zero step)
    denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps).div_(lr / (1 - beta1 ** step))
    param.mul_(1 - lr * weight_decay)
    param.addcdiv_(exp_avg, denom, value=-1.0)


def muon_update(grads: list[torch.Tensor], weights: list[torch.Tensor], momentum_buffer: torch.Tensor,
                second_moment: torch.Tensor, lr: torch.Tensor, momentum: torch.Tensor, weight_decay: torch.Tensor,
                beta2: float, ns_steps: int, ns_dtype: torch.dtype) -> torch.Tensor:
    """The new values of same-shaped matrices, stacked: Nesterov momentum, Polar Express, NorMuon
    rescaling, cautious weight decay. The momentum and second-moment buffers are updated in place."""
    grads, weights = torch.stack(grads), torch.stack(weights)
    rows, cols = weights.shape[-2:]
    # Nesterov momentum
    momentum_buffer.lerp_(grads, 1 - momentum)
    update = polar_express(grads.lerp_(momentum_buffer, momentum), ns_steps, ns_dtype).float()
    # NorMuon: normalise each row (or column) by a running second moment, keeping the total norm
    reduce_dim = -1 if rows >= cols else -2
    row_sq = update.square().mean(dim=reduce_dim, keepdim=True)
    second_moment.lerp_(row_sq, 1 - beta2)
    scale = second_moment.clamp_min(1e-10).rsqrt()
    norm_before = (row_sq.sum(dim=(-2, -1), keepdim=True) * update.size(reduce_dim)).sqrt()
    norm_after = (row_sq * scale.square()).sum(dim=(-2, -1), keepdim=True).mul(update.size(reduce_dim)).sqrt()
    update = update * (scale * norm_before / norm_after.clamp_min(1e-10))
    # Cautious weight decay: only where the update and the weight agree in sign
    lr = lr * max(1.0, rows / cols) ** 0.5
    decay = (update * weights >= 0) * (lr * weight_decay)
    return weights - (lr * update + decay * weights)


def update_groups(work: list[dict], hyper: list[dict]) -> None:
    """One optimizer step, in place, for every group: `work` holds each group's parameters, gradients, state
    and fixed settings, `hyper` its lr, momentum and weight decay as 0-D device tensors."""
    for w, h in zip(work, hyper):
        if w["kind"] == "muon" and w["params"]:
            new = muon_update(w["grads"], w["params"], w["momentum"], w["second_moment"], h["lr"], h["momentum"],
                              h["weight_decay"], w["beta2"], w["ns_steps"], w["ns_dtype"])
            for p, value in zip(w["params"], new.unbind(0)):
                p.copy_(value)
        elif w["kind"] == "adamw":
            for p, grad, state in zip(w["params"], w["grads"], w["states"]):
                adamw_update(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], h["lr"],
                             h["weight_decay"], *w["betas"], w["eps"])


class MuonAdamW(torch.optim.Optimizer):
    """The update rule, from each parameter's value and gradient alone: groups of kind 'muon' hold same-shaped matrices,
    updated together, 'adamw' the rest. Under torchrun DataParallelOptimizer (below the banner) wraps it. The per-step
    values (SCHEDULED) are plain numbers in each param group (`group["lr"] = ...`, as in nanochat), copied each step
    into 0-D device tensors: a new value is data, never a new graph."""

    SCHEDULED = ("lr", "momentum", "weight_decay")

    def __init__(self, param_groups, compile_backend: str | None = None):
        super().__init__(param_groups, defaults={})
        device = next(p.device for g in self.param_groups for p in g["params"])
        self._hyper_keys = [(i, k) for i, g in enumerate(self.param_groups) for k in self.SCHEDULED if k in g]
        self._hyper = torch.zeros(len(self._hyper_keys), device=device)
        self._group_keys = [set(g) for g in self.param_groups]  # a key a group did not start with is a mistake
        # State, created now so that state_dict() is complete before a step.
        for group in self.param_groups:
            params = group["params"]
            if group["kind"] == "muon" and params:
                rows, cols = params[0].shape
                self.state[params[0]].update(
                    momentum=torch.zeros(len(params), rows, cols, device=device),
                    second_moment=torch.zeros((len(params), rows, 1) if rows >= cols else (len(params), 1, cols),
                                              device=device))
            elif group["kind"] == "adamw":
                for p in params:
                    self.state[p].update(step=torch.zeros((), device=device), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
        # One graph for the whole step (one per update and shape compiles in twice the time)
        self._update = torch.compile(update_groups, backend=compile_backend, dynamic=False, fullgraph=True) \
            if compile_backend else update_groups

    def _device_hyperparameters(self) -> list[dict]:
        """Each group's lr, momentum and weight_decay as it stands now, as 0-D device tensors (one copy)."""
        for i, group in enumerate(self.param_groups):
            added = set(group) - self._group_keys[i]
            if added:
                raise KeyError(f"param group {i} ({group['kind']}) got {sorted(added)}, which its update does not "
                               f"read; it schedules {[k for g, k in self._hyper_keys if g == i]}")
        self._hyper.copy_(torch.tensor([float(self.param_groups[i][k]) for i, k in self._hyper_keys]))
        values = [{} for _ in self.param_groups]
        for j, (i, k) in enumerate(self._hyper_keys):
            values[i][k] = self._hyper[j]
        return values

    @torch.no_grad()
    def step(self):
        work = []
        for group in self.param_groups:
            if group["kind"] == "muon" and group["params"]:  # a stack: every matrix has a gradient
                params, state = group["params"], self.state[group["params"][0]]
                work.append(dict(kind="muon", params=params, grads=[p.grad for p in params],
                                 momentum=state["momentum"], second_moment=state["second_moment"],
                                 beta2=group["beta2"], ns_steps=group["ns_steps"], ns_dtype=group["ns_dtype"]))
            else:
                params = [p for p in group["params"] if p.grad is not None]
                work.append(dict(kind=group["kind"], params=params, grads=[p.grad for p in params],
                                 states=[self.state[p] for p in params], betas=group.get("betas"),
                                 eps=group.get("eps")))
        self._update(work, self._device_hyperparameters())

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))


def parameter_table(model: GPT, recipe: Recipe, ns_dtype: torch.dtype | None = torch.bfloat16) -> list[tuple]:
    """The per-parameter table, (parameters, rule) a row. A new parameter is one row; parameter_groups (below the
    banner) names a parameter without a row or in two. ns_dtype: Polar Express's precision (None: fp32)."""
    width_scale = (model.config.n_embd / 768) ** -0.5  # AdamW learning rates were tuned at width 768
    adamw = dict(kind="adamw", betas=(recipe.adam_beta1, recipe.adam_beta2), eps=1e-10, weight_decay=0.0)
    muon = dict(kind="muon", lr=recipe.matrix_lr, momentum=recipe.muon_momentum_start, ns_steps=recipe.muon_ns_steps,
                ns_dtype=ns_dtype or torch.float32, beta2=recipe.muon_beta2, weight_decay=recipe.weight_decay)
    return [  # AdamW for the head, the embedding tables and the scalars, Muon for the matrices
        ([model.lm_head.weight], dict(adamw, lr=recipe.unembedding_lr * width_scale)),
        ([model.wte.weight], dict(adamw, lr=recipe.embedding_lr * width_scale)),
        (list(model.value_embeds.parameters()), dict(adamw, lr=recipe.embedding_lr * width_scale * 0.5)),  # nanochat
        ([model.resid_lambdas], dict(adamw, lr=recipe.scalar_lr * 0.01)),
        ([model.x0_lambdas], dict(adamw, lr=recipe.scalar_lr, betas=(0.96, 0.95))),
        ([p for p in model.blocks.parameters() if p.dim() >= 2], muon),  # the blocks' matrices (gates included)
    ]


# ---- Schedules: functions of progress = charged seconds / training seconds, in [0, 1] --------------------------------
def lr_multiplier(progress: float, recipe: Recipe) -> float:
    if progress < recipe.warmup_ratio:
        return progress / recipe.warmup_ratio
    if progress <= 1.0 - recipe.warmdown_ratio:
        return 1.0
    cooldown = max(0.0, (1.0 - progress) / recipe.warmdown_ratio)
    return cooldown + (1.0 - cooldown) * recipe.final_lr_frac


def muon_momentum(progress: float, recipe: Recipe) -> float:
    ramp = min(1.0, progress / recipe.muon_momentum_warmup_ratio) if recipe.muon_momentum_warmup_ratio > 0 else 1.0
    return recipe.muon_momentum_start + (recipe.muon_momentum_end - recipe.muon_momentum_start) * ramp


def apply_schedules(optimizer: MuonAdamW, progress: float, recipe: Recipe) -> float:
    """This step's learning rates, Muon momentum and weight decay, written into the param groups."""
    lrm = lr_multiplier(progress, recipe)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = muon_momentum(progress, recipe)
            group["weight_decay"] = recipe.weight_decay * (1.0 - progress)
    return lrm


def training_progress(step: int, charged_seconds: float, training_seconds: float, recipe: Recipe) -> float:
    """Where the run is in its schedules, in [0, 1]: step / max_steps with a step count (--max-steps), the same in
    every run of the same flags, resumed or not; otherwise charged time over training time."""
    if recipe.max_steps > 0:
        return min(1.0, step / recipe.max_steps)
    return min(1.0, max(0.0, charged_seconds / training_seconds))


# ---- Data: which tokens the steps train on ---------------------------------------------------------------------------
# prepare.py's make_dataloader packs documents best-fit into rows that each start at a document's start, and crops
# a document that does not fit. A sampler of your own builds on _document_batches (docs/recipes.md has one).


def training_batches(recipe: Recipe, tokenizer, batch_size: int, device: torch.device, start_batch: int):
    """The training data: an endless iterator of (inputs, targets, state) micro-batches, this rank's share."""
    return make_dataloader(tokenizer, batch_size, recipe.seq_len, "train", device, seed=recipe.seed,
                           start_batch=start_batch)


# ---- Training: one step, and the loop --------------------------------------------------------------------------------
def train_step(model: nn.Module, optimizer, batches, grad_accum_steps: int):
    """One optimizer step over grad_accum_steps micro-batches: (this rank's mean loss, the last loader state)."""
    loss_sum = None
    for _ in range(grad_accum_steps):
        x, y, state = next(batches)
        loss = model(x, y)
        (loss / grad_accum_steps).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return loss_sum / grad_accum_steps, state


def train(recipe: Recipe, run: Run) -> None:
    """Train for the budget, save out_dir/final.pt, score public_val; `run` is the bookkeeping around the loop."""
    model = build_model(model_config(recipe, run.tokenizer.get_vocab_size()), run.device, recipe.dtype)
    optimizer = build_optimizer(model, recipe, run.options, model.compute_dtype, run.profile.compile_backend,
                                run.geometry.grad_accum_steps)
    step_model = run.start(model, optimizer)  # resumes, same weights on every rank, compiles
    skipped = run.state.step * run.geometry.grad_accum_steps  # a resumed run skips the micro-batches its steps used
    batches = training_batches(recipe, run.tokenizer, run.geometry.device_batch_size, run.device, skipped)
    while True:
        progress = training_progress(run.state.step, run.clock.charged_seconds(), run.training_seconds, recipe)
        lrm = apply_schedules(optimizer, progress, recipe)
        loss, loader_state = train_step(step_model, optimizer, batches, run.geometry.grad_accum_steps)
        if run.step_done(loss, loader_state, progress, lrm):
            break
    run.finish()


# ---- The scorer's entry point ----------------------------------------------------------------------------------------
def load_for_eval(checkpoint_path: str, device: torch.device) -> GPT:
    """The scorer's entry point: the trained model from checkpoint_path on `device`, in eval mode,
    frozen, with a pure causal forward: logits[:, t] depend only on tokens 0..t of their own row."""
    config, state, meta = read_checkpoint(checkpoint_path)
    try:  # a config field this GPTConfig lacks (TypeError), or weights of another shape
        trained_in = meta.get("recipe", {}).get("dtype", "auto")  # scored in the dtype it trained in
        model = build_model(GPTConfig(**config), torch.device(device), trained_in, init=False)
        model.load_state_dict(state, strict=True)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{checkpoint_path} does not fit this train.py's GPT with config {config}: "
                         f"{str(e).splitlines()[0]} ...") from None
    return model.eval().requires_grad_(False)


# ======== MACHINERY: what a run needs around the recipe, rarely edited ================================================
# The run's bookkeeping, devices, kernels, data parallelism, batch geometry, the budget clock, checkpoints, command line
# ---- The run: everything around the training loop --------------------------------------------------------------------
class TrainingDiverged(RuntimeError):
    pass


def out_of_time(charged_seconds: float, step_times: list[float], snapshot_seconds: float,
                training_seconds: float) -> bool:
    """Whether another step (as long as the longest of the last five after start-up: a cold compile predicts nothing)
    and the snapshot due after it would end past training_seconds (the save's reserve kept)."""
    timed = step_times[TRAIN_STARTUP_STEPS_EXCLUDED:]
    return charged_seconds + (max(timed[-5:]) if timed else 0.0) + snapshot_seconds > training_seconds


class Run:
    """One run's bookkeeping, so that train() reads as schedule, step, stop: start(), step_done(), finish()."""

    def __init__(self, recipe: Recipe, options: RunOptions, profile: DeviceProfile, device: torch.device,
                 rank: int, world_size: int):
        self.recipe, self.options, self.profile = recipe, options, profile
        self.device, self.rank, self.world_size = device, rank, world_size
        self.geometry = batch_geometry(recipe.total_batch_size, recipe.device_batch_size, recipe.seq_len, world_size)
        self.tokenizer = ensure_tokenizer()
        self.state, self.step_times, self.metrics, self.first_loss = RunState(), [], [], 0.0

    def mfu_percent(self, tokens_per_second: float) -> float:
        return 100 * self.flops_per_token * tokens_per_second / (self.profile.peak_flops * self.world_size)

    def start(self, model: GPT, optimizer: DataParallelOptimizer) -> nn.Module:
        """Same weights on every rank, --resume, the clock, the header; returns the module each step calls."""
        recipe, options, geometry, profile = self.recipe, self.options, self.geometry, self.profile
        self.model, self.optimizer = model, optimizer
        if self.world_size > 1:
            for p in model.parameters():  # every rank starts from rank 0's weights
                dist.broadcast(p.data, src=0)
        if options.resume:
            self.state = load_snapshot(Path(options.resume), model, optimizer, recipe, geometry, self.rank)
        self.clock = BudgetClock(carried_seconds=self.state.charged_seconds)
        self.reserve = checkpoint_save_reserve(model)
        self.training_seconds = recipe.time_budget - self.reserve
        if self.training_seconds <= 0:
            raise SystemExit(f"error: --time-budget {recipe.time_budget}s leaves no time to train after the "
                             f"{self.reserve:.0f}s kept for saving the checkpoint")
        self.snapshot_seconds, self.last_snapshot = self.reserve, clock_seconds()
        self.flops_per_token = model.flops_per_token()
        print0(f"device: {self.device} x {self.world_size} | compute dtype: {profile.compute_dtype or torch.float32} | "
               f"peak {profile.peak_flops / 1e12:.2f} TFLOP/s per rank ({profile.peak_source})")
        c, default = model.config, dataclasses.replace(model.config, **asdict(Architecture()))  # at this size
        on = {k: getattr(c, k) for k in asdict(Architecture()) if getattr(c, k) != getattr(default, k)}
        print0(f"model: {c.n_layer} layers of width {c.n_embd} ({c.n_head} heads of {c.n_embd // c.n_head}), context "
               f"{c.sequence_len}, vocabulary {c.vocab_size}" + "".join(f", {k} {v!r}" for k, v in on.items()))
        print0(f"parameters: {model.num_params():,} | FLOPs per token: {self.flops_per_token:.4e}")
        if geometry.note:
            print0(f"batch geometry: {geometry.note}")
        print0(f"batch: {recipe.total_batch_size:,} tokens = {geometry.device_batch_size} x {recipe.seq_len} x "
               f"{self.world_size} ranks x {geometry.grad_accum_steps} accumulation | budget {recipe.time_budget:.0f}s"
               f", of which {self.reserve:.0f}s kept for the save | schedules on "
               f"{'steps' if recipe.max_steps > 0 else 'charged time'}")
        if options.resume:
            print0(f"resumed: {options.resume} at step {self.state.step}, {self.state.charged_seconds:.1f}s charged")
        self._mark = clock_seconds()  # the first step starts now
        return torch.compile(model, backend=profile.compile_backend, dynamic=False) if options.compile else model

    def step_done(self, loss: torch.Tensor, loader_state: dict, progress: float, lrm: float) -> bool:
        """Account for the step just taken (loss: this rank's); returns whether to stop, alike on every rank."""
        options, state = self.options, self.state
        synchronize(self.device)
        record_step_boundary(self.clock.step_done())  # the harness's budget ledger
        charged, dt = self.clock.charged_seconds(), clock_seconds() - self._mark
        self.step_times.append(dt)
        state.tokens_seen += self.recipe.total_batch_size
        snapshot_due = options.save_every > 0 and any_rank(clock_seconds() - self.last_snapshot >= options.save_every,
                                                           self.device, self.world_size)
        stop = out_of_time(charged, self.step_times, self.snapshot_seconds if snapshot_due else 0.0,
                           self.training_seconds) or 0 < self.recipe.max_steps <= state.step + 1
        loss_value, stop = agree_across_ranks(loss, stop, self.world_size)
        self.first_loss = self.first_loss or loss_value  # a loss of any make diverges from where it started
        if not math.isfinite(loss_value) or loss_value > 2 * self.first_loss:
            raise TrainingDiverged(f"training diverged at step {state.step}: loss {loss_value}, over twice the first "
                                   f"step's {self.first_loss:.2f}; no checkpoint written: lower the learning rates")
        state.smooth_loss = 0.9 * state.smooth_loss + 0.1 * loss_value
        if self.rank == 0 and (len(self.step_times) <= 5 or state.step % options.log_every == 0 or stop):
            tok_per_sec, smooth = self.recipe.total_batch_size / dt, state.smooth_loss / (1 - 0.9 ** (state.step + 1))
            mfu = self.mfu_percent(tok_per_sec)
            print(f"step {state.step:05d} ({100 * progress:4.1f}%) | loss: {smooth:.6f} | lrm: {lrm:.2f} | "
                  f"dt: {dt * 1000:.0f}ms | tok/sec: {tok_per_sec:,.0f} | mfu: {mfu:.1f}% | "
                  f"epoch: {loader_state['epoch']} | remaining: {self.training_seconds - charged:.0f}s", flush=True)
            self.metrics.append(dict(step=state.step, charged_seconds=round(charged, 3), loss=smooth, lrm=lrm, dt=dt,
                                     tokens_per_second=tok_per_sec, mfu_percent=mfu, epoch=loader_state["epoch"]))
        state.step += 1
        if snapshot_due and not stop:
            t0 = clock_seconds()
            save_snapshot(Path(options.out_dir) / STATE_DIR, self.model, self.optimizer, state, self.recipe,
                          self.geometry, self.rank, self.clock)
            self.last_snapshot = clock_seconds()
            self.snapshot_seconds = self.last_snapshot - t0
        self._mark = clock_seconds()  # the next step starts now
        return stop

    def finish(self) -> None:
        """Save out_dir/final.pt (rank 0), score public_val (every rank takes part), print the summary."""
        recipe, options, state = self.recipe, self.options, self.state
        trained, checkpoint = self.clock.status(recipe.time_budget), Path(options.out_dir) / "final.pt"
        if self.rank == 0:
            save_checkpoint(checkpoint, self.model, {
                "step": state.step, "total_train_tokens": state.tokens_seen, "world_size": self.world_size,
                "recipe": recipe_settings(recipe), "run_options": asdict(options), "final_loss": state.train_loss,
                "train_py_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()})
        if self.world_size > 1:
            dist.barrier()  # the checkpoint is on disk before any rank reports
        final, result = self.clock.status(recipe.time_budget), None
        if options.eval_public and options.eval_tokens > 0:
            # Every rank calls evaluate_bpb with the same arguments: under torchrun it shares the rows among them.
            eval_batch = max(1, self.geometry.device_batch_size * recipe.seq_len // EVAL_SEQ_LEN)
            result = evaluate_bpb(self.model, self.tokenizer, eval_batch, EVAL_SEQ_LEN, self.device,
                                  split="public_val", max_tokens=options.eval_tokens)
        if self.rank == 0:
            self._print_summary(result, trained, final, checkpoint)

    def _print_summary(self, result: dict | None, trained: dict, final: dict, checkpoint: Path) -> None:
        """The summary after `---`; trained / final: the clock when training stopped / the checkpoint was saved."""
        model, profile, state = self.model, self.profile, self.state
        timed = self.step_times[TRAIN_STARTUP_STEPS_EXCLUDED:] or self.step_times  # start-up steps compile, warm up
        tok_per_sec = self.recipe.total_batch_size * len(timed) / sum(timed)
        median_step = self.clock.median_step_seconds()
        summary = []
        if result is not None:
            summary += [("val_bpb", f"{result['val_bpb']:.6f}"), ("eval_tokens", result["tokens"]),
                        ("eval_seconds", f"{result['eval_seconds']:.1f}"), ("val_bpb_is", "an estimate on eval_tokens "
                        f"in this process; the score: python prepare.py eval-public --checkpoint {checkpoint}")]
        # Where the organisers' summary names a figure differently (their job runners parse the _est), both names.
        charged, startup = f"{final['charged_seconds']:.1f}", f"{final['startup_allowance_seconds']:.1f}"
        summary += [
            ("train_loss", f"{state.train_loss:.6f}"), ("training_seconds", f"{trained['charged_seconds']:.1f}"),
            ("charged_seconds", charged), ("charged_seconds_est", charged),
            ("budget_seconds", f"{self.recipe.time_budget:.0f}"), ("over_budget", final["over_budget"]),
            ("startup_seconds", startup), ("startup_allowance_est", startup),
            ("median_step_seconds", f"{median_step:.3f}" if median_step is not None else "nan"),
            ("total_seconds", f"{final['elapsed_seconds']:.1f}"), ("num_steps", state.step),
            ("total_tokens_M", f"{state.tokens_seen / 1e6:.1f}"), ("tokens_per_second", f"{tok_per_sec:.0f}"),
            ("mfu_percent", f"{self.mfu_percent(tok_per_sec):.2f}"),
            ("peak_tflops", f"{profile.peak_flops / 1e12:.3f}"),
            ("peak_source", f"{profile.peak_source} (per rank; MFU's denominator)"),
            ("comm_seconds_per_step", f"{self.optimizer.comm_seconds / len(self.step_times):.4f}"),
            ("peak_memory_mb", f"{peak_memory_mb(self.device):.1f}"),
            ("num_params_M", f"{model.num_params() / 1e6:.1f}"), ("depth", model.config.n_layer),
            ("seq_len", self.recipe.seq_len), ("device", f"{self.device.type} x {self.world_size}"),
            ("compute_dtype", str(profile.compute_dtype or torch.float32).replace("torch.", "")),
            ("checkpoint", checkpoint),
        ]
        print("---")
        for key, value in summary:
            print(f"{key + ':':<23}{value}")
        write_run_folder(Path(self.options.out_dir), dict(summary), self.metrics, self.training_seconds,
                         self.recipe.time_budget)


# ---- Devices: everything device-specific lives here ------------------------------------------------------------------
NEURONCORE_BF16_FLOPS = 79e12  # per physical NeuronCore-v3 (Trainium2: 8 per chip, 667 TFLOPS)
CUDA_BF16_FLOPS = {"H100": 989.5e12, "H200": 989.5e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12,
                   "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "4090": 165.2e12}  # dense bf16 datasheets


@dataclass
class DeviceProfile:
    type: str  # neuron, cuda or cpu
    dist_backend: str  # torch.distributed backend for this device
    compute_dtype: torch.dtype | None  # autocast dtype of the forward pass; None: fp32
    compile_backend: str
    peak_flops: float  # per process, for MFU: datasheet peak, or measured (cpu)
    peak_source: str
    dtype_source: str = ""  # how a CPU's dtype was chosen


# A CPU's compute dtype and peak: the model's own matmuls timed in fp32 and bf16 once per machine and kept, so that
# two runs of one recipe train alike (a CPUID flag says bf16 exists, not that it is fast: one Xeon is 1.4x slower).
CPU_MATMUL_MAX_ROWS, CPU_MATMUL_CALLS, CPU_MATMUL_SECONDS = 4096, 5, 1.0  # rows; calls timed, fewer past these seconds


def cpu_threads() -> int:
    """The threads this process's matmuls run on: torch's intra-op threads, at most the CPUs it may use."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), usable))


def model_matmuls(config: GPTConfig, rows: int) -> list[tuple[int, int, int]]:
    """(rows, in, out) of the matmuls that dominate a step: the MLP's two and the head."""
    m, d = min(rows, CPU_MATMUL_MAX_ROWS), config.n_embd
    return [(m, d, 4 * d), (m, 4 * d, d), (m, d, config.vocab_size)]


def time_matmuls(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> float:
    """Seconds of one call of each matmul in `dtype` on one thread: each the best of its calls after a warm-up."""
    threads, total = torch.get_num_threads(), 0.0
    torch.set_num_threads(1)
    try:
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            out, times = a @ b, []
            while not times or len(times) < CPU_MATMUL_CALLS and sum(times) < CPU_MATMUL_SECONDS:
                t0 = time.perf_counter()
                torch.matmul(a, b, out=out)
                times.append(time.perf_counter() - t0)
            total += min(times)
    finally:
        torch.set_num_threads(threads)
    return total


def machine_file() -> Path:
    """This machine's measurements, beside the data set (FRONTIER_CACHE_DIR, else ~/.cache/trainium-frontier)."""
    root = os.environ.get("FRONTIER_CACHE_DIR") or os.environ.get("NEURON_COMPETITION_R1_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "trainium-frontier") / "machine.json"


def cpu_name() -> str:
    """The processor /proc/cpuinfo names, and a hash of its flags (one "AMD EPYC" comes with AVX-512 and without)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name, flags = (re.search(rf"^{key}\s*:\s*(.*)$", info, re.M) for key in ("model name", "flags"))
    flags_hash = hashlib.sha256((flags[1] if flags else "").encode()).hexdigest()[:8]
    return f"{name[1] if name else platform.machine()} [flags {flags_hash}]"


def measured_cpu_matmuls(shapes: list[tuple[int, int, int]]) -> tuple[dict, str]:
    """({"fp32": s, "bf16": s}, the file): time_matmuls of `shapes` here, measured once and kept in machine_file() by
    processor, torch and shapes (a lock: ranks started together measure once; a damaged file is measured again)."""
    path, key = machine_file(), f"{cpu_name()} | torch {torch.__version__} | matmuls {shapes}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table, timings = {}, None
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            table = json.loads(path.read_text()) if path.exists() else {}
            timings = table[key] if all(0 < float(table[key][d]) < math.inf for d in ("fp32", "bf16")) else None
        if timings is None:  # none yet, or damaged: measured (again)
            table = table if isinstance(table, dict) else {}
            timings = table[key] = {name: time_matmuls(shapes, dtype) for name, dtype in (("fp32", torch.float32),
                                                                                          ("bf16", torch.bfloat16))}
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(table, indent=1)))
    return timings, str(path)


def detect_device_type() -> str:
    with contextlib.suppress(Exception):  # no torch.neuron (not the native Neuron backend), or no runtime behind it
        if torch.neuron.is_available():
            return "neuron"
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if getattr(accelerator, "type", None) == "neuron":
        return "neuron"
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype_for(device_type: str, dtype: str = "auto", cpu_timings: dict | None = None) -> torch.dtype | None:
    """The autocast dtype of the forward pass: as given; else bf16 on neuron and on a GPU that has it, and on a CPU
    where its measured matmuls (measured_cpu_matmuls) run faster in bf16; else fp32 (None)."""
    if dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"--dtype must be auto, bf16 or fp32, got {dtype!r}")
    if dtype != "auto":
        return torch.bfloat16 if dtype == "bf16" else None
    if device_type == "neuron":
        return torch.bfloat16
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if cpu_timings and cpu_timings["bf16"] < cpu_timings["fp32"] else None


def dtype_name(compute_dtype: torch.dtype | None) -> str:
    return "bf16" if compute_dtype == torch.bfloat16 else "fp32"


def device_profile(device_type: str, dtype: str = "auto", peak_tflops: float = 0.0,
                   matmuls: list[tuple[int, int, int]] | None = None) -> DeviceProfile:
    """The device's backends, compute dtype and peak FLOP/s per rank (MFU's denominator); on a CPU both from the
    model's `matmuls` (model_matmuls) as measured_cpu_matmuls times them."""
    if device_type == "neuron":
        lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))  # physical cores behind one rank
        profile = DeviceProfile("neuron", "neuron", compute_dtype_for("neuron", dtype), "neuron",
                                NEURONCORE_BF16_FLOPS * lnc, f"datasheet, {lnc} NeuronCore(s) per rank")
    elif device_type == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in CUDA_BF16_FLOPS.items() if k in name), math.nan)  # another: --peak-tflops
        profile = DeviceProfile("cuda", "nccl", compute_dtype_for("cuda", dtype), "inductor", peak,
                                f"datasheet, {name}" if math.isfinite(peak) else f"{name}: not in CUDA_BF16_FLOPS")
    elif device_type != "cpu":
        raise ValueError(f"unknown device {device_type!r}: use neuron, cuda or cpu")
    elif dtype != "auto" and peak_tflops > 0:  # nothing to measure
        profile = DeviceProfile("cpu", "gloo", compute_dtype_for("cpu", dtype), "inductor", 0.0, "")
    else:
        timings, kept = measured_cpu_matmuls(matmuls)
        compute = compute_dtype_for("cpu", dtype, timings)
        peak = sum(2 * m * k * n for m, k, n in matmuls) / timings[dtype_name(compute)] * cpu_threads()
        ms = {name: f"{1e3 * seconds:.1f} ms in {name}" for name, seconds in timings.items()}
        profile = DeviceProfile("cpu", "gloo", compute, "inductor", peak, f"the model's matmuls in "
                                f"{dtype_name(compute)}, best 1-thread call here x {cpu_threads()} threads",
                                f"{dtype_name(compute)}{' (auto)' if dtype == 'auto' else ''}: the model's matmuls "
                                f"take {ms['bf16']} and {ms['fp32']} on one thread (measured once, kept in {kept})")
    if peak_tflops > 0:
        return dataclasses.replace(profile, peak_flops=peak_tflops * 1e12, peak_source="given (--peak-tflops)")
    return profile


def device_profile_for(recipe: Recipe, device_type: str, peak_tflops: float = 0.0) -> DeviceProfile:
    """The profile a run of `recipe` gets: on a CPU, its dtype and peak from the model's own matmuls."""
    rows = recipe.device_batch_size * recipe.seq_len
    return device_profile(device_type, recipe.dtype, peak_tflops, model_matmuls(model_config(recipe), rows))


def init_distributed(profile: DeviceProfile) -> tuple[torch.device, int, int]:
    """(device, rank, world_size) for this process; joins the process group under torchrun."""
    ddp, rank, local_rank, world_size = get_dist_info()
    device = torch.device("cuda", local_rank) if profile.type == "cuda" else torch.device(profile.type)
    if profile.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        kwargs = {"device_id": device} if profile.type == "cuda" else {}
        dist.init_process_group(backend=profile.dist_backend, **kwargs)
    return device, rank, world_size


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "neuron":
        torch.neuron.synchronize()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "neuron":
        with contextlib.suppress(Exception):  # a torch-neuronx without it: not known
            import torch_neuronx
            return torch_neuronx.max_memory_allocated() / 2**20
        return float("nan")
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: the process's peak RSS


# ---- Kernels: the inline NKI kernel relu(x)^2, and the --nki-* flags that bind kernels in place of ops ---------------
# A kernel: a PyTorch reference (the specification and the fallback), the NKI kernels, an autograd.Function that runs
# them, an op that takes the kernel where the tensor fits. A train.py uploaded alone keeps its kernels/common.py copy.

try:
    import nki
    import nki.isa as nisa
    import nki.language as nl
    HAS_NKI = True
except ImportError:
    nki = nisa = nl = None
    HAS_NKI = False

PARTITIONS = 128  # rows per tile: the SBUF partition count
KERNEL_DEVICE = "neuron"  # tensors on this device run the kernels
RELU2_MAX_WIDTH = 8192  # columns per tile: 8 bytes per element in flight, well under 224 KiB per partition
_NOTICES: set[str] = set()


def notice_once(message: str) -> None:  # once per process, on rank 0
    if message not in _NOTICES:
        _NOTICES.add(message)
        print0(f"notice: {message}")


def logical_core_count() -> int:
    """NEURON_LOGICAL_NC_CONFIG, every kernel's launch grid; it must be set, to match the compiler's."""
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG is {value!r}; the NKI kernels launch one instance per "
                         "physical core of the logical core and need it set to 1 or 2, e.g. "
                         "NEURON_LOGICAL_NC_CONFIG=2 torchrun --nproc_per_node=4 train.py ...")
    return int(value)


def launch(kernel, *args):
    """Run an @nki.jit kernel on every physical core of this rank's logical core (via wrap_nki where present)."""
    wrap_nki = _wrap_nki()
    return (kernel if wrap_nki is None else wrap_nki(kernel))[logical_core_count()](*args)


@functools.cache
def _wrap_nki():
    for module in ("torch_neuronx", "torch_neuronx.nki_hop"):  # where torch-neuronx releases keep wrap_nki
        try:
            return importlib.import_module(module).wrap_nki
        except (ImportError, AttributeError):
            pass
    return None  # nki's own launch (as on its simulator)


def pick_kernel(name: str, x: torch.Tensor, fits: bool, why: str, n_rows: int) -> bool:
    """Whether x takes the kernel (its device, nki importable, the shape fits, whole tiles per core); else a notice."""
    if x.device.type != KERNEL_DEVICE:
        return False
    if not HAS_NKI:
        notice_once(f"{name}: the nki package is not importable; using the PyTorch reference")
        return False
    if not fits:
        notice_once(f"{name}: {why}; using the PyTorch reference")
        return False
    cores = logical_core_count()
    if n_rows % (PARTITIONS * cores):
        notice_once(f"{name}: {n_rows} rows do not split into {PARTITIONS}-row tiles evenly over the {cores} "
                    f"physical cores of a logical core (NEURON_LOGICAL_NC_CONFIG={cores}); using the PyTorch reference")
        return False
    return True


relu2_forward_reference = relu_squared  # the model's op as the model section defines it, whatever is bound later


def relu2_backward_reference(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return 2 * F.relu(x) * grad


if HAS_NKI:
    @nki.jit
    def relu2_forward_kernel(x):
        """y = relu(x)^2 for x [N, D] in HBM; N % (128 * cores) == 0, D <= RELU2_MAX_WIDTH."""
        n, d = x.shape
        y = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()  # this core's share of the 128-row tiles
        for i in nl.affine_range(tiles):
            r = nl.ds((nl.program_id(0) * tiles + i) * PARTITIONS, PARTITIONS)
            x_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_tile, src=x[r, :])
            relu = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=relu, op=nl.relu, data=x_tile)
            y_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=y_tile, data1=relu, data2=relu, op=nl.multiply)
            nisa.dma_copy(dst=y[r, :], src=y_tile)
        return y

    @nki.jit
    def relu2_backward_kernel(x, grad):
        """dx = 2 * relu(x) * grad for x, grad [N, D] in HBM; N % (128 * cores) == 0, D <= RELU2_MAX_WIDTH."""
        n, d = x.shape
        dx = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
        tiles = n // PARTITIONS // nl.num_programs()
        for i in nl.affine_range(tiles):
            r = nl.ds((nl.program_id(0) * tiles + i) * PARTITIONS, PARTITIONS)
            x_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_tile, src=x[r, :])
            g_tile = nl.ndarray((PARTITIONS, d), dtype=grad.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_tile, src=grad[r, :])
            relu = nl.ndarray((PARTITIONS, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=relu, op=nl.relu, data=x_tile)
            dx_tile = nl.ndarray((PARTITIONS, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=dx_tile, data=relu, op0=nl.multiply, operand0=2.0,
                                      op1=nl.multiply, operand1=g_tile)
            nisa.dma_copy(dst=dx[r, :], src=dx_tile)
        return dx


def _on_rows(kernel, *tensors: torch.Tensor) -> torch.Tensor:
    """launch() a row-tiled kernel on [N, D] views of same-shaped tensors; the result in their shape."""
    shape = tensors[0].shape
    return launch(kernel, *(t.reshape(-1, shape[-1]).contiguous() for t in tensors)).reshape(shape)


class ReLUSquared(torch.autograd.Function):
    """relu(x)^2, forward and backward as the NKI kernel pair."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _on_rows(relu2_forward_kernel, x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _on_rows(relu2_backward_kernel, x, grad)


def relu_squared_nki(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 as the kernel pair where x fits it (pick_kernel); elsewhere the reference."""
    fits = x.dtype in (torch.bfloat16, torch.float32) and x.shape[-1] <= RELU2_MAX_WIDTH
    why = f"shape {tuple(x.shape)} {x.dtype} does not fit (width <= {RELU2_MAX_WIDTH}, bf16/fp32)"
    if pick_kernel("relu2", x, fits, why, x.numel() // x.shape[-1]):
        return ReLUSquared.apply(x)
    return relu2_forward_reference(x)


# --nki-* flag (a RunOptions field) -> the recipe's function it replaces; setup_kernels binds the kernel there.
KERNEL_OPS = {"nki_relu2": "relu_squared", "nki_rmsnorm": "norm", "nki_rope_qknorm": "rope_qknorm",
              "nki_softcap_ce": "training_loss"}


def nki_kernel(flag: str):
    """The NKI op of a --nki-* flag; kernels/ is imported only here, so a train.py runs without the folder."""
    if flag == "nki_relu2":
        return relu_squared_nki
    module, name = {"nki_rmsnorm": ("rmsnorm", "rms_norm"), "nki_rope_qknorm": ("rope_qknorm", "rope_qknorm"),
                    "nki_softcap_ce": ("softcap_ce", "softcap_cross_entropy")}[flag]
    kernel = getattr(importlib.import_module(f"kernels.{module}"), name)
    return functools.partial(kernel_training_loss, kernel) if flag == "nki_softcap_ce" else kernel


def kernel_training_loss(kernel, logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    """training_loss as the mean of the kernel's per-row softcap cross-entropy (--nki-softcap-ce)."""
    return kernel(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), cap).mean()


def kernel_loss_difference(loss_fn, cap: float = 15.0) -> float:
    """How far loss_fn is from the softcap cross-entropy --nki-softcap-ce computes, on a random batch."""
    from kernels.softcap_ce import softcap_ce_forward_reference
    g = torch.Generator().manual_seed(0)
    logits, targets = 8 * torch.randn(2, 16, 40, generator=g), torch.randint(0, 40, (2, 16), generator=g)
    kernel = softcap_ce_forward_reference(logits.reshape(-1, 40), targets.reshape(-1), cap)[0].mean()
    return abs(float(loss_fn(logits, targets, cap)) - float(kernel))


def setup_kernels(options: RunOptions, device_type: str, config: GPTConfig) -> None:
    """Bind each --nki-* flag's kernel in place of its op, or stop saying why it cannot run here."""
    on = [flag for flag in KERNEL_OPS if getattr(options, flag)]
    if not on:
        return
    flags = " ".join(f"--{flag.replace('_', '-')}" for flag in on)
    for op in {KERNEL_OPS[flag] for flag in on}:
        same = [f"--{flag.replace('_', '-')}" for flag in on if KERNEL_OPS[flag] == op]
        if len(same) > 1:
            raise SystemExit(f"error: {' and '.join(same)} both replace {op}(); one op takes one kernel: drop one")
    called = forward_on_meta(config).ops
    for flag in on:
        if KERNEL_OPS[flag] not in called:
            raise SystemExit(f"error: --{flag.replace('_', '-')} replaces {KERNEL_OPS[flag]}(), which this model "
                             "never calls: drop the flag, or bind a kernel for the op it calls in KERNEL_OPS")
    if options.nki_softcap_ce and kernel_loss_difference(training_loss) > 1e-5:
        raise SystemExit("error: --nki-softcap-ce computes the softcap cross-entropy, and this train.py's "
                         "training_loss computes something else (an added term?) that it would drop: drop the flag")
    if not (device_type == "neuron" and HAS_NKI):
        raise SystemExit(f"error: {flags} run NKI kernels, which need the neuron device and the nki package; this run "
                         f"is on {device_type}{'' if HAS_NKI else ' without nki'}: drop the flag here")
    if options.compile:
        raise SystemExit(f"error: --compile with {flags}: the kernels run eagerly from torch.autograd.Functions, not "
                         "as torch.compile custom ops (torch_neuronx.nki_op): drop --compile or the flags")
    logical_core_count()  # set, or a ValueError that says how
    if on != ["nki_relu2"]:  # the kernels/ modules check the nki release they were written for
        from kernels.common import installed_nki_version, nki_version_problem
        problem = nki_version_problem(installed_nki_version())
        if problem:
            raise SystemExit(f"error: {flags}: {problem}")
    bind_kernels(options)


def bind_kernels(options: RunOptions) -> None:  # setup_kernels checks first
    globals().update({op: nki_kernel(flag) for flag, op in KERNEL_OPS.items() if getattr(options, flag)})


# ---- Data parallelism and ZeRO-1: the gradients averaged over ranks, the update sharded ------------------------------
# A bucket: `parts` equal chunks (world size, sharded), chunk r what rank r owns: a reduce-scatter, then an all-gather.
SHARD_MAX_PADDING = 1 / 8  # matrices are indivisible, and padding is sent like data
# A parameter's place from `offset`: whole in chunk `owner` (a Muon matrix), or (owner None) slice r in chunk r.
Slot = collections.namedtuple("Slot", "owner offset size")


@dataclass
class Bucket:
    """Parameters whose gradients travel together, laid out in `parts` chunks (see layout_bucket)."""
    params: list[torch.Tensor]
    parts: int
    chunk: int  # elements per chunk
    slots: dict  # parameter -> Slot
    flat: torch.Tensor | None = None  # parts x chunk: the gradients sent, then (sharded) the weights gathered
    own: torch.Tensor | None = None  # sharded: this rank's chunk, its summed gradients, then its updated weights
    work: object = None  # the last collective launched (kept after it finishes, see DataParallelOptimizer._wait)

    @property
    def padding(self) -> int:
        return self.parts * self.chunk - sum(p.numel() for p in self.params)

    def region(self, p: torch.Tensor) -> torch.Tensor:
        """p's place in flat as parts x chunk: one row of its owner's chunk, or its slice in every chunk."""
        slot = self.slots[p]
        rows = slice(None) if slot.owner is None else slice(slot.owner, slot.owner + 1)
        return self.flat.view(self.parts, self.chunk)[rows, slot.offset:slot.offset + slot.size]

    def values(self, p: torch.Tensor) -> torch.Tensor:
        """What flat holds of p, in p's shape (a sliced p's padding dropped)."""
        return self.region(p).reshape(-1)[:p.numel()].view_as(p)


def layout_bucket(params: list[torch.Tensor], whole: set, parts: int, load: list[int]) -> Bucket:
    """`parts` equal chunks: each matrix in `whole`, largest first, whole to the chunk with the least data (ties:
    the least `load` so far, which this updates); every other parameter sliced across all chunks, after them."""
    fill, slots = [0] * parts, {}
    for p in sorted((p for p in params if p in whole), key=lambda p: -p.numel()):
        r = min(range(parts), key=lambda r: (fill[r], load[r], r))
        slots[p] = Slot(r, fill[r], p.numel())
        fill[r] += p.numel()
        load[r] += p.numel()
    offset = max(fill)
    for p in params:
        if p not in slots:
            slots[p] = Slot(None, offset, -(-p.numel() // parts))
            offset += slots[p].size
    return Bucket(list(params), parts, offset, slots)


def plan_buckets(params: list[torch.Tensor], whole: set, parts: int, bucket_elements: int) -> list[Bucket]:
    """Buckets of `params` (in gradient-ready order) of bucket_elements or more, padding at most SHARD_MAX_PADDING."""
    def even(group):
        bucket = layout_bucket(group, whole, parts, [0] * parts)
        return bucket.padding <= SHARD_MAX_PADDING * sum(p.numel() for p in group)

    groups, current = [], []
    for p in params:
        current.append(p)
        if sum(q.numel() for q in current) >= bucket_elements and even(current):
            groups.append(current)
            current = []
    if current:
        if groups and not even(current):
            current = groups.pop() + current
        groups.append(current)
    load = [0] * parts
    return [layout_bucket(group, whole, parts, load) for group in groups]


# torch 2.13 renamed the single-tensor collectives; the Neuron venv's torch 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DataParallelOptimizer:
    """MuonAdamW under data parallelism: the gradients averaged over ranks (each bucket sent once the last backward
    has filled it) and, sharded (ZeRO-1), each rank updating only its own Muon matrices and its slice of the rest."""

    def __init__(self, param_groups: list[dict], rank: int = 0, world_size: int = 1, shard: bool = False,
                 ready_order: list[torch.Tensor] | None = None, bucket_bytes: int = 25 * 2**20,
                 accumulation_steps: int = 1, compile_backend: str | None = None):
        self.rank, self.world_size, self.shard = rank, world_size, shard and world_size > 1
        self.accumulation_steps, self.comm_seconds = accumulation_steps, 0.0  # comm: host seconds spent waiting
        params = [p for g in param_groups for p in g["params"]]
        self._matrices = [g["params"] for g in param_groups if g["kind"] == "muon"]  # whole on their owner
        order = ready_order or params[::-1]
        whole, parts = {p for ps in self._matrices for p in ps}, world_size if self.shard else 1
        self.buckets = plan_buckets(order, whole, parts, bucket_bytes // 4) if world_size > 1 else []
        self._slot = {p: (b, b.slots[p]) for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.flat = torch.zeros(b.parts * b.chunk, device=params[0].device)
            if self.shard:
                b.own = torch.zeros(b.chunk, device=params[0].device)
        self._mine = {p: p for p in params}  # parameter -> what this rank updates of it
        if self.shard:  # the matrices it owns, and a tensor of its slice of each sliced parameter
            self._mine = {p: p if slot.owner == rank else torch.zeros(slot.size, device=p.device)
                          for p, (_, slot) in self._slot.items() if slot.owner in (None, rank)}
        mine = [dict(g, params=[self._mine[p] for p in g["params"] if p in self._mine]) for g in param_groups]
        self.optimizer = MuonAdamW(mine, compile_backend)
        self._backwards = collections.Counter()  # backward passes that reached each parameter since the last step
        self._packed, self._launched, self._grads_ready = set(), 0, False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in order] if world_size > 1 else []

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def state_bytes(self) -> int:
        return self.optimizer.state_bytes()

    def state_dict(self) -> dict:
        """Plain tensors and plain data (loads with weights_only=True); sharded, this rank's part only."""
        return {**self.optimizer.state_dict(), "sharding": self.sharding()}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("sharding", {"sharded": False})
        if saved != self.sharding():
            raise ValueError(f"optimizer state saved as {saved} cannot be loaded here ({self.sharding()}): "
                             "resume with the same world size, each rank loading its own file")
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "sharding"})

    def sharding(self) -> dict:
        """What a sharded state depends on: this rank, the world size, and which matrices it owns."""
        if not self.shard:
            return {"sharded": False}
        owned = [[i for i, p in enumerate(ps) if p in self._mine] for ps in self._matrices]
        return {"sharded": True, "rank": self.rank, "world_size": self.world_size, "owned_matrices": owned}

    @torch.no_grad()
    def step(self) -> None:
        self.wait_for_gradients()
        if self.shard:
            for p, mine in self._mine.items():
                if mine is not p:  # this rank's slice: p's current values there, zero-padded
                    values = p.view(-1)[self.rank * mine.numel():(self.rank + 1) * mine.numel()]
                    mine.copy_(F.pad(values, (0, mine.numel() - values.numel())))
                mine.grad = self._own_part(p)
        self.optimizer.step()
        self._finish_step()

    def wait_for_gradients(self) -> None:
        """Send what the backward has not sent, wait, and average: into p.grad, or sharded this rank's chunks."""
        if self.world_size == 1 or self._grads_ready:
            return
        for p in [p for bucket in self.buckets[self._launched:] for p in bucket.params if p not in self._packed]:
            self._pack(p)
        self._launch_full_buckets()
        self._wait()
        for bucket in self.buckets:
            if self.shard:
                bucket.own.div_(self.world_size)
            else:
                bucket.flat.div_(self.world_size)
                for p in bucket.params:
                    p.grad = bucket.values(p).clone()
        self._grads_ready = True

    def _finish_step(self) -> None:
        """Sharded: this rank's new values into its chunks, all-gathered into every rank's parameters."""
        if self.shard:
            for p, mine in self._mine.items():
                part = self._own_part(p)
                part.copy_(mine.view_as(part))
            for bucket in self.buckets:
                bucket.work = _all_gather(bucket.flat, bucket.own, async_op=True)
            self._wait()
            for bucket in self.buckets:
                for p in bucket.params:
                    p.copy_(bucket.values(p))
        self._packed, self._backwards, self._launched, self._grads_ready = set(), collections.Counter(), 0, False

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._backwards[p] += 1
        if self._backwards[p] < self.accumulation_steps:
            return  # an earlier micro-batch: the gradient only accumulates
        if p in self._packed:  # a further backward before step(): what was sent is out of date
            self._wait()
            self._packed.clear()
            self._launched = 0
        self._pack(p)
        self._launch_full_buckets()

    def _pack(self, p: torch.Tensor) -> None:
        bucket, slot = self._slot[p]
        region = bucket.region(p)
        grad = p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=region.device)
        if slot.owner is None:  # sliced: zero-padded to a whole slice in every chunk
            grad = F.pad(grad, (0, region.numel() - p.numel()))
        region.copy_(grad.view_as(region))
        self._packed.add(p)

    def _launch_full_buckets(self) -> None:
        # In bucket order, so that every rank issues the same collectives in the same order.
        while self._launched < len(self.buckets) and \
                all(p in self._packed for p in self.buckets[self._launched].params):
            bucket = self.buckets[self._launched]
            bucket.work = _reduce_scatter(bucket.own, bucket.flat, async_op=True) if self.shard else \
                dist.all_reduce(bucket.flat, async_op=True)
            self._launched += 1

    def _wait(self) -> None:
        # Finished works stay referenced: one that gloo's thread releases last aborts the process at exit.
        t0 = time.perf_counter()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self.comm_seconds += time.perf_counter() - t0

    def _own_part(self, p: torch.Tensor) -> torch.Tensor:
        """Sharded: p's place in this rank's chunk (all of p, or its slice): its gradient, then its new values."""
        bucket, slot = self._slot[p]
        part = bucket.own[slot.offset:slot.offset + slot.size]
        return part.view_as(p) if slot.owner is not None else part


ForwardTrace = collections.namedtuple("ForwardTrace", "first_use ops writers")
HOST_READS = {"item": 0, "tolist": [], "__bool__": False, "__float__": 0.0, "__int__": 0, "__index__": 0}


def forward_on_meta(config: GPTConfig, model_class: type = GPT) -> ForwardTrace:
    """A training forward on the meta device (no memory, no arithmetic; a read sees HOST_READS): its parameters' names
    by first use, the KERNEL_OPS it calls, the Linears that write to the residual stream (each block branch's last)."""
    with torch.device("meta"):
        twin = model_class(config)
    names, modules = {id(p): name for name, p in twin.named_parameters()}, {m: n for n, m in twin.named_modules()}
    originals = {op: globals()[op] for op in KERNEL_OPS.values()}
    first_use, called, applied, writers = {}, set(), [], set()

    class RecordUse(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in HOST_READS:
                return HOST_READS[func.__name__]
            for a in tree_leaves((args, kwargs)):
                if id(a) in names:
                    first_use.setdefault(names[id(a)], len(first_use))
            return func(*args, **(kwargs or {}))

    def call(op, *args, **kwargs):  # the op, counted
        called.add(op)
        return originals[op](*args, **kwargs)

    def branch_done(branch, args, output):  # the last Linear it applied writes to the residual stream
        writers.update([n for n in applied if f"{n}.".startswith(f"{modules[branch]}.")][-1:])

    for m in modules:
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda m, args, output: applied.append(modules[m]))
    for block in twin.blocks:
        for branch in block.children():
            branch.register_forward_hook(branch_done)
    globals().update({op: functools.partial(call, op) for op in originals})
    try:
        tokens = torch.zeros(1, 2, dtype=torch.long, device="meta")
        with RecordUse():
            twin(tokens, tokens)
    finally:
        globals().update(originals)
    return ForwardTrace(list(first_use), called, writers)


def gradient_ready_order(model: nn.Module) -> list[torch.Tensor]:
    """The parameters in the order the backward completes their gradients: the reverse of first use in a forward."""
    first_use, params = forward_on_meta(model.config, type(model)).first_use, dict(model.named_parameters())
    return [params[name] for name in reversed(first_use)] + [p for n, p in params.items() if n not in first_use]


def parameter_groups(model: GPT, recipe: Recipe, ns_dtype: torch.dtype | None = torch.bfloat16) -> list[dict]:
    """parameter_table's rows as the optimizer's param groups (Muon's: one per shape), or an error that names the
    parameters without a row, in two rows, or in a Muon row and not a matrix."""
    table = parameter_table(model, recipe, ns_dtype)
    names = {}  # a weight two modules share has two names
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = f"{names[id(p)]} = {name}" if id(p) in names else name
    rows = collections.defaultdict(list)  # id -> [(row, its learning rate)]
    for r, (params, rule) in enumerate(table):
        rows.update({id(p): rows[id(p)] + [(r, rule["lr"])] for p in params})
    problems = {  # a weight shared with the head takes the head's rate: at the embedding's, a tied head diverges
        "are in more than one row of parameter_table: keep the row with the lowest learning rate": [
            f"{names[i]} (rows {', '.join(f'{r} at lr {lr:.3g}' for r, lr in found)}: keep row "
            f"{min(found, key=lambda f: f[1])[0]})" for i, found in rows.items() if len(found) > 1],
        "have no row in parameter_table: add one (a vector, such as a gain or a temperature: AdamW, like "
        "resid_lambdas)": [names[id(p)] for p in model.parameters() if id(p) not in rows],
        "fall in a Muon row of parameter_table, which updates matrices only: give them a row of their own (AdamW, "
        "like the scalars)": [f"{names[id(p)]} {list(p.shape)}" for params, rule in table if rule["kind"] == "muon"
                              for p in params if p.dim() != 2]}
    for problem, found in problems.items():
        if found:
            raise ValueError(f"parameters {found} {problem}")
    groups = []
    for params, rule in table:  # Muon updates same-shaped matrices together: a group per shape
        shapes = sorted({tuple(p.shape) for p in params}) if rule["kind"] == "muon" else [None]
        groups += [dict(rule, params=[p for p in params if shape in (None, tuple(p.shape))], initial_lr=rule["lr"])
                   for shape in shapes if params]
    return groups


def build_optimizer(model: GPT, recipe: Recipe, options: RunOptions | None = None,
                    ns_dtype: torch.dtype | None = torch.bfloat16, compile_backend: str = "inductor",
                    accumulation_steps: int = 1, shard: bool | None = None, compiled: bool | None = None,
                    bucket_mb: float = 25.0) -> DataParallelOptimizer:
    """MuonAdamW over parameter_groups(model, ...) inside DataParallelOptimizer. ns_dtype: Polar Express's
    precision (None: fp32); shard, compiled (None: the run's choice) and bucket_mb: for benchmarks and tests."""
    groups = parameter_groups(model, recipe, ns_dtype)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    ready_order = gradient_ready_order(model) if world_size > 1 else None
    bucket_bytes = int(bucket_mb * 2**20)
    # Sharding sends as much as averaging, plus padding, and saves state and update work: unless it pads too much.
    whole = {p for g in groups if g["kind"] == "muon" for p in g["params"]}
    padding = sum(b.padding for b in plan_buckets(ready_order or [], whole, world_size, bucket_bytes // 4)) \
        / model.num_params()
    shard = (padding <= SHARD_MAX_PADDING if shard is None else shard) and world_size > 1
    compiled = (options or RunOptions()).compile if compiled is None else compiled
    optimizer = DataParallelOptimizer(groups, rank, world_size, shard, ready_order, bucket_bytes, accumulation_steps,
                                      compile_backend if compiled else None)
    line = f"optimizer: update {f'compiled ({compile_backend})' if compiled else 'eager'}"
    if world_size > 1:
        how = "sharded (ZeRO-1, padding" if shard else "not sharded (sharded, the layout would pad"
        line += f" | gradients in {len(optimizer.buckets)} buckets over {world_size} ranks, {how} {100 * padding:.1f}%)"
    print0(f"{line} | state {optimizer.state_bytes() / 2**20:.1f} MiB on this rank")
    return optimizer


def agree_across_ranks(loss: torch.Tensor, stop: bool, world_size: int) -> tuple[float, bool]:
    """(mean loss over ranks, whether any rank wants to stop), with one small collective."""
    control = torch.stack([loss.float(), torch.tensor(float(stop), device=loss.device)])
    if world_size > 1:
        dist.all_reduce(control)
        control[0] /= world_size
    loss_value, stop_votes = control.tolist()
    return loss_value, stop_votes > 0


def any_rank(flag: bool, device: torch.device, world_size: int) -> bool:
    """Whether flag is true on some rank: for decisions every rank takes together."""
    if world_size > 1:
        vote = torch.tensor(float(flag), device=device)
        dist.all_reduce(vote)
        flag = vote.item() > 0
    return flag


# ---- Batch geometry: the recipe's batch at any world size ------------------------------------------------------------
@dataclass(frozen=True)
class BatchGeometry:
    total_batch_size: int  # tokens per optimizer step, all ranks together
    device_batch_size: int  # rows per micro-batch on each rank
    seq_len: int
    world_size: int
    grad_accum_steps: int  # micro-batches per optimizer step on each rank
    note: str = ""  # why the device batch differs from the one asked for ("" when it does not)


def batch_geometry(total_batch_size: int, device_batch_size: int, seq_len: int, world_size: int) -> BatchGeometry:
    """The recipe's total batch and seq_len never change; the device batch shrinks to the largest value not above the
    one asked for such that device batch x seq_len x world size divides the total batch (Recipe checks each >= 1)."""
    row_tokens = seq_len * world_size  # one row on every rank
    if total_batch_size % row_tokens:
        below, above = row_tokens * (total_batch_size // row_tokens), row_tokens * -(-total_batch_size // row_tokens)
        options = " or ".join(f"--total-batch-size {n}" for n in (below, above) if n > 0)
        fewer = f", or at most {total_batch_size // seq_len} ranks" if total_batch_size % seq_len == 0 and \
            total_batch_size // seq_len < world_size else ""
        raise ValueError(f"no batch geometry: --total-batch-size {total_batch_size} is not a whole number of rows of "
                         f"{seq_len} tokens on each of {world_size} ranks; use {options}{fewer}")
    rows_per_rank = total_batch_size // row_tokens
    rows = max(k for k in range(1, min(device_batch_size, rows_per_rank) + 1) if rows_per_rank % k == 0)
    note = "" if rows == device_batch_size else (
        f"device batch {device_batch_size} -> {rows} rows: the total batch of {total_batch_size:,} tokens is "
        f"{rows_per_rank} rows of {seq_len} on each of {world_size} ranks")
    return BatchGeometry(total_batch_size, rows, seq_len, world_size, rows_per_rank // rows, note)


# ---- The budget clock: charged time, kept by train.py itself as the organisers' baseline keeps it --------------------
# Charged time = wall time since the process started, minus the start-up allowance, plus earlier processes'.
def clock_seconds() -> float:
    """Linux's boot clock (/proc/self/stat's), else a monotonic one; never time.time(), which NTP can step."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


IMPORTED_AT = clock_seconds()
PROCESS_START_LIMIT = 3600.0  # s before the import: an earlier start read from /proc is not believed


def process_start_time() -> float:
    """clock_seconds() when this process started (from /proc on Linux), else when train.py was imported."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # field 22 above: the start, in ticks of the boot clock
        return IMPORTED_AT
    plausible = hasattr(time, "CLOCK_BOOTTIME") and IMPORTED_AT - PROCESS_START_LIMIT <= started <= IMPORTED_AT
    return started if plausible else IMPORTED_AT


class BudgetClock:
    def __init__(self, carried_seconds: float = 0.0):
        self.started, self.carried_seconds = process_start_time(), carried_seconds
        self.step_ends: list[float] = []  # when each optimizer step of this process ended

    def step_done(self) -> int:
        """Note the end of an optimizer step; returns its index in this process (record_step_boundary's)."""
        self.step_ends.append(clock_seconds())
        return len(self.step_ends) - 1

    def status(self, budget_seconds: float) -> dict:
        now = clock_seconds()
        started_up = len(self.step_ends) >= TRAIN_STARTUP_STEPS_EXCLUDED
        startup = (self.step_ends[TRAIN_STARTUP_STEPS_EXCLUDED - 1] if started_up else now) - self.started
        allowance = min(startup, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
        charged = self.carried_seconds + now - self.started - allowance
        return {"charged_seconds": charged, "startup_allowance_seconds": allowance,
                "elapsed_seconds": now - self.started, "over_budget": charged > budget_seconds}

    def charged_seconds(self) -> float:
        return self.status(float("inf"))["charged_seconds"]

    def median_step_seconds(self) -> float | None:
        ends = self.step_ends[TRAIN_STARTUP_STEPS_EXCLUDED - 1:]
        return statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else None


# ---- The run folder: out_dir holds final.pt and what a person looks at, and never loses an earlier run ---------------
RUN_FILES = ("final.pt", "log.txt", "summary.json", "metrics.jsonl", "loss.png")  # state/: --resume


def keep_previous_run(out_dir: Path) -> None:
    """Make out_dir, moving an earlier run's RUN_FILES into out_dir/run-<when it ended> (and saying so)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
    if not found:
        return
    ended = time.strftime("run-%Y%m%d-%H%M%S-", time.localtime(max(p.stat().st_mtime for p in found)))
    kept = Path(tempfile.mkdtemp(prefix=ended, dir=out_dir))  # unique, should two runs end in the same second
    for p in found:
        os.replace(p, kept / p.name)
    print(f"out: the previous run's {', '.join(p.name for p in found)} moved to {kept}")


class Tee:
    """This process's stdout, also written to a log file."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def json_value(value):
    """A summary value as JSON: a number or a boolean where it is one, else its text."""
    try:
        return json.loads({"True": "true", "False": "false", "nan": "NaN"}.get(str(value), str(value)))
    except ValueError:
        return str(value)


def write_run_folder(out_dir: Path, summary: dict, metrics: list[dict], training_seconds: float, budget: float):
    """summary.json, metrics.jsonl and loss.png beside final.pt (after the checkpoint: the budget never pays)."""
    summary = {key: json_value(value) for key, value in summary.items()}
    write_atomically(out_dir / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=1)))
    lines = "".join(f"{json.dumps(m)}\n" for m in metrics)
    write_atomically(out_dir / "metrics.jsonl", lambda tmp: tmp.write_text(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("loss.png: skipped (matplotlib is not installed here)")
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([m["charged_seconds"] for m in metrics], [m["loss"] for m in metrics], marker=".")
        ax.axvline(training_seconds, color="gray", linestyle="--", label=f"stop for the save, {training_seconds:.0f}s")
        ax.axvline(budget, color="red", linestyle=":", label=f"budget, {budget:.0f}s")
        ax.set(xlabel="charged seconds", ylabel="training loss (smoothed)", title=f"val_bpb {summary.get('val_bpb')}")
        ax.legend()
        write_atomically(out_dir / "loss.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)
    print(f"run folder: {out_dir}/ ({', '.join(n for n in RUN_FILES if (out_dir / n).exists())})\n"
          f"next: python prepare.py eval-public --checkpoint {out_dir / 'final.pt'}")


# ---- Checkpoint: model config as plain data + state dict + run metadata, written atomically --------------------------
# The organisers' keys (model_state, model_config, meta) plus our format tag, which their checkpoints lack.
CHECKPOINT_FORMAT = "trainium-frontier-gpt/2"


def write_atomically(path: Path, write) -> None:
    """write(temporary path), then rename: a crash never leaves half a file where a good one is expected."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(path: Path, model: GPT, meta: dict) -> None:
    payload = {"format": CHECKPOINT_FORMAT, "model_config": asdict(model.config), "meta": meta,
               "model_state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    write_atomically(path, lambda tmp: torch.save(payload, tmp))


def checkpoint_save_reserve(model: GPT) -> float:
    """Seconds to keep for writing the checkpoint: generous for a slow disk (100 MB/s), plus slack."""
    return 5.0 + 3.0 * sum(p.numel() * p.element_size() for p in model.parameters()) / 100e6


def read_checkpoint(path) -> tuple[dict, dict, dict]:
    """(model config, state dict, meta) of a checkpoint, loaded with weights_only=True: never code."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a checkpoint that loads safely: torch.load(weights_only=True) refused it "
                         f"({type(e).__name__}); a checkpoint of train.py holds tensors and plain data only") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path} holds a {type(payload).__name__}, not a checkpoint dict")
    found = payload.get("format")
    if found in (CHECKPOINT_FORMAT, None) and {"model_config", "model_state"} <= payload.keys():
        return payload["model_config"], payload["model_state"], payload.get("meta", {})
    raise ValueError(f"{path} has format {found!r} and keys {sorted(payload)}; this train.py reads "
                     f"{CHECKPOINT_FORMAT!r} and the organisers' layout (model_state, model_config, meta)")


# Resumable runs: latest.json moves to a snapshot once every rank's files are on disk, so a crash leaves one whole.
STATE_DIR = "state"


@dataclass
class RunState:
    """Where a run stands between two steps, beyond weights and optimizer state."""
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    smooth_loss: float = 0.0  # exponential moving average of the loss, before bias correction
    charged_seconds: float = 0.0  # charged time when the snapshot was complete

    @property
    def train_loss(self) -> float:  # bias-corrected
        return self.smooth_loss / (1 - 0.9 ** self.step)


def save_snapshot(state_dir: Path, model: GPT, optimizer: MuonAdamW, run: RunState, recipe: Recipe,
                  geometry: BatchGeometry, rank: int, clock: BudgetClock) -> None:
    """Write the full training state after step run.step - 1 (every rank calls this)."""
    folder = state_dir / f"step_{run.step:06d}"
    if rank == 0:
        save_checkpoint(folder / "model.pt", model, {"step": run.step, "total_train_tokens": run.tokens_seen})
    rank_state = {"optimizer": tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), optimizer.state_dict()),
                  "rng": torch.get_rng_state()}
    write_atomically(folder / f"optimizer_rank{rank:05d}.pt", lambda tmp: torch.save(rank_state, tmp))
    if geometry.world_size > 1:
        dist.barrier()  # every rank's files are on disk
    if rank == 0:
        done = dataclasses.replace(run, charged_seconds=clock.charged_seconds())
        pointer = {"snapshot": folder.name, "run": asdict(done), "world_size": geometry.world_size,
                   "geometry": asdict(geometry), "recipe": recipe_settings(recipe)}
        write_atomically(state_dir / "latest.json", lambda tmp: tmp.write_text(json.dumps(pointer, indent=1)))
        for old in state_dir.glob("step_*"):
            if old.name != folder.name:
                shutil.rmtree(old, ignore_errors=True)


def load_snapshot(state_dir: Path, model: GPT, optimizer: MuonAdamW, recipe: Recipe, geometry: BatchGeometry,
                  rank: int) -> RunState:
    """Restore the newest complete snapshot in state_dir into model and optimizer (every rank calls this)."""
    pointer_path = state_dir / "latest.json"
    if not pointer_path.is_file():
        raise ValueError(f"--resume {state_dir}: no snapshot there (no latest.json); pass the state folder of a run "
                         f"started with --save-every, i.e. its --out-dir followed by /{STATE_DIR}")
    pointer = json.loads(pointer_path.read_text())
    if pointer["world_size"] != geometry.world_size:
        raise ValueError(f"--resume {state_dir}: that run had {pointer['world_size']} ranks, this one has "
                         f"{geometry.world_size}; resume with as many (each rank's data and shard depend on it)")
    saved = pointer["recipe"]
    changed = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {v!r}" for k, v in recipe_settings(recipe).items()
               if saved.get(k) != v]
    if changed:
        raise ValueError(f"--resume {state_dir}: the recipe changed since the interrupted run ({'; '.join(changed)}), "
                         "which would change its trajectory; resume with the recipe it was started with")
    folder = state_dir / pointer["snapshot"]
    model_file, rank_file = folder / "model.pt", folder / f"optimizer_rank{rank:05d}.pt"
    for path in (model_file, rank_file):
        if not path.is_file():
            raise ValueError(f"--resume {state_dir}: {path} is missing (rank {rank}); on several servers "
                             "--out-dir must be storage that every server sees")
    model.load_state_dict(read_checkpoint(model_file)[1], strict=True)
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(rank_state["optimizer"])
    torch.set_rng_state(rank_state["rng"])
    return RunState(**pointer["run"])


# ---- The command line: a flag for every setting, presets, the organisers' aliases; main() ----------------------------
@dataclass
class RunOptions:
    """How a run executes around its recipe: flags too, which a resumed run may change (rounding at most)."""
    device: str = ""  # neuron, cuda or cpu; empty (or auto): the fastest present
    compile: bool = False  # torch.compile the model (compile time counts as start-up, capped)
    nki_relu2: bool = False  # the MLP activation as the inline NKI kernel (neuron device only)
    nki_rmsnorm: bool = False  # RMSNorm as kernels/rmsnorm.py (neuron device only)
    nki_rope_qknorm: bool = False  # rotary + QK-norm fused, kernels/rope_qknorm.py (neuron device only)
    nki_softcap_ce: bool = False  # softcap + cross-entropy fused, kernels/softcap_ce.py (neuron device only)
    out_dir: str = "out"  # where final.pt (and state/, the snapshots) go
    save_every: float = 0.0  # seconds between resumable snapshots in out_dir/state (0: none)
    resume: str = ""  # continue the run whose snapshots are in this folder (e.g. out/state), same recipe
    log_every: int = 10  # print a progress line every this many steps
    peak_tflops: float = 0.0  # the peak TFLOP/s per rank that MFU divides by (0: the datasheet's, or measured)
    eval_public: bool = True  # score public_val at the end of the run (every rank takes part)
    eval_tokens: int = 4 * 524_288  # tokens of public_val scored at the end, as the organisers' baseline (0: skip)

    def __post_init__(self):
        check_values(self, {**dict.fromkeys("eval_tokens save_every peak_tflops".split(), NON_NEGATIVE),
                            "log_every": AT_LEAST_1})


# The organisers' flags, and the variables that set a field (theirs, prepare.py's FRONTIER_*; two set must agree).
# Precedence, lowest first: defaults, --preset, environment, command line.
OFFICIAL_FLAG_NAMES = {"max_steps": "--num-steps", "time_budget": "--max-train-seconds", "device": "--device-type"}
ENVIRONMENT = {"max_steps": ("NEURON_COMPETITION_R1_NUM_STEPS",),
               "time_budget": ("NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS",),
               "compile": ("NEURON_COMPETITION_R1_COMPILE",), "nki_relu2": ("NEURON_COMPETITION_R1_NKI_RELU2",),
               "out_dir": ("NEURON_COMPETITION_R1_OUT_DIR", "FRONTIER_OUT_DIR"),
               "eval_public": ("NEURON_COMPETITION_R1_EVAL_PUBLIC", "FRONTIER_EVAL_PUBLIC"),
               "eval_tokens": ("NEURON_COMPETITION_R1_EVAL_TOKENS", "FRONTIER_EVAL_TOKENS")}
BOOL_WORDS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}


ADOPTED_INGREDIENTS: dict = dict(value_embeds="alternate", window_pattern="SSSL")  # cpu, gpu presets; not d10's

PRESETS = {
    # A laptop CPU for 5 minutes: benchmarks/preset_sweep.py's winner at 300 s on 2 cores; compiled (eager elementwise
    # work on the 8192-wide logits dominates a CPU step). For 15 minutes, add --seq-len 512 (tools/plan.py --shapes).
    "cpu": dict(depth=3, aspect_ratio=64, head_dim=64, seq_len=256, device_batch_size=16, total_batch_size=2**12,
                compile=True, time_budget=300.0, eval_tokens=2**18, log_every=20, **ADOPTED_INGREDIENTS),
    # One CUDA GPU for 5 minutes, autoresearch-sized, compiled as autoresearch is (fused elementwise work).
    "gpu": dict(depth=8, seq_len=2048, device_batch_size=32, total_batch_size=2**18, compile=True, time_budget=300.0,
                **ADOPTED_INGREDIENTS),
    # Phase 2: 64 ranks at LNC=2 for 4 hours, as tools/plan.py picks (tested); two rows keep a rank in its 24 GiB (est.)
    "phase2": dict(depth=23, total_batch_size=2**19, device_batch_size=2, time_budget=14400.0, save_every=1800.0),
}


SETTING_KINDS = (Recipe, Architecture, RunOptions)  # each field of each is a flag (Recipe.architecture: its fields)


def kind_fields(kind) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(kind) if f.name != "architecture"]


def setting_fields() -> list[dataclasses.Field]:
    return [f for kind in SETTING_KINDS for f in kind_fields(kind)]


def recipe_settings(recipe: Recipe) -> dict:
    """The recipe as plain data, one key per flag (what checkpoints and snapshots record)."""
    return {**{f.name: getattr(recipe, f.name) for f in kind_fields(Recipe)}, **asdict(recipe.architecture)}


def field_comments(kind) -> dict[str, str]:
    """{field: the comment beside it in this file (continued on the lines below)}: each flag's --help."""
    comments, name, above = {}, None, []
    try:
        source = inspect.getsource(kind)
    except OSError:  # no source beside the code: flags without their comments
        return {}
    for line in source.splitlines():
        field_line = re.match(r"\s+(\w+): [^=]+=.*?(?:  # (.*))?$", line)
        more = re.match(r"\s{5,}# (.*)$", line)  # a continuation sits under the comment
        if field_line:  # its own comment, else the lines just above it
            name, comments[field_line[1]], above = field_line[1], field_line[2] or " ".join(above), []
        elif more and name:
            comments[name] += " " + more[1]
        else:
            name, above = None, above + [line.strip()[2:]] if re.match(r"\s{4}# ", line) else []
    return comments


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    """--preset and a flag per Recipe, Architecture and RunOptions field, its help its comment and default."""
    parser = argparse.ArgumentParser(usage="python train.py [--preset NAME] [--flag VALUE ...]", allow_abbrev=False,
                                     description="Train the GPT of this file for the time budget; `--preset NAME "
                                     "--help` shows what a preset sets.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help=f"settings for a machine or phase: {', '.join(sorted(PRESETS))}")
    titles = {Recipe: "hyperparameters (Recipe)", Architecture: "what the model is made of (Architecture)",
              RunOptions: "how the run executes (RunOptions)"}
    for kind in SETTING_KINDS:
        group, comments = parser.add_argument_group(titles[kind]), field_comments(kind)
        for f in kind_fields(kind):
            official = [OFFICIAL_FLAG_NAMES[f.name]] if f.name in OFFICIAL_FLAG_NAMES else []
            environment = f"; or {' or '.join(ENVIRONMENT[f.name])}" if f.name in ENVIRONMENT else ""
            value = PRESETS.get(preset, {}).get(f.name, f.default)
            shown = f"{preset}: {value!r}" if f.name in PRESETS.get(preset, {}) else f"default {value!r}"
            parse = {"action": argparse.BooleanOptionalAction} if f.type in ("bool", bool) else \
                {"type": {"int": int, "float": float, "str": str}[str(f.type)],
                 "metavar": {"int": "N", "float": "X", "str": "TEXT"}[str(f.type)]}
            group.add_argument("--" + f.name.replace("_", "-"), *official, dest=f.name, default=None,
                               help=f"{comments.get(f.name, '')} ({shown}{environment})", **parse)
    return parser


def environment_settings(parser: argparse.ArgumentParser, environ=os.environ) -> tuple[dict, dict]:
    """Settings made by the environment variables of ENVIRONMENT: ({field: value}, {field: "VAR=value"})."""
    types, values, used = {f.name: str(f.type) for f in setting_fields()}, {}, {}
    for name, variables in ENVIRONMENT.items():
        found = {var: environ[var].strip() for var in variables if environ.get(var, "").strip()}
        if not found:
            continue
        if len(set(found.values())) > 1:
            parser.error(" and ".join(f"{var}={raw!r}" for var, raw in found.items()) + " disagree; they mean the "
                         "same thing: unset one")
        var, raw = next(iter(found.items()))  # (the others say the same)
        try:
            values[name] = BOOL_WORDS[raw.lower()] if types[name] == "bool" else \
                {"int": int, "float": float, "str": str}[types[name]](raw)
        except (KeyError, ValueError):
            kind = {"bool": f"one of {'/'.join(BOOL_WORDS)}", "int": "an integer", "float": "a number"}[types[name]]
            parser.error(f"environment variable {var}={raw!r} is not {kind}; fix it or unset it")
        used[name] = f"{var}={raw}"
    return values, used


def parse_command_line(argv=None) -> tuple[Recipe, RunOptions, list[str]]:
    """(recipe, run options, one note per environment variable used and per preset setting a flag turned off)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    preset = argv[argv.index("--preset") + 1] if "--preset" in argv[:-1] else None
    parser = build_parser(preset)
    return settings_from(parser.parse_args(argv), parser)


def settings_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Recipe, RunOptions, list[str]]:
    """The recipe and run options of build_parser()'s parsed flags, --preset and the environment."""
    from_env, used = environment_settings(parser)
    given = {f.name: getattr(args, f.name) for f in setting_fields() if getattr(args, f.name) is not None}
    notes = [f"environment: {setting} sets --{name.replace('_', '-')}" + (" (overridden by the command line)" if
                                                                           name in given else "")
             for name, setting in used.items()]
    values = {**(PRESETS[args.preset] if args.preset else {}), **from_env, **given}
    recipe, architecture, options = ({f.name: values[f.name] for f in kind_fields(kind) if f.name in values}
                                     for kind in SETTING_KINDS)
    return Recipe(**recipe, architecture=Architecture(**architecture)), RunOptions(**options), notes


def main(argv=None) -> int:
    recipe, options, notes = parse_command_line(argv)
    device_type = options.device if options.device not in ("", "auto") else detect_device_type()
    setup_kernels(options, device_type, model_config(recipe))  # a malformed model flag fails here, before any data
    profile = device_profile_for(recipe, device_type, options.peak_tflops)
    if profile.dtype_source:
        notes.append(f"compute dtype {profile.dtype_source}")
    recipe = dataclasses.replace(recipe, dtype=dtype_name(profile.compute_dtype))  # what the checkpoint records
    device, rank, world_size = init_distributed(profile)
    torch.manual_seed(recipe.seed)
    stdout = sys.stdout
    if rank == 0:  # the run's log beside its checkpoint, an earlier run's files kept
        keep_previous_run(Path(options.out_dir))
        sys.stdout = Tee(stdout, Path(options.out_dir) / "log.txt")
    for note in notes:
        print0(note)
    try:
        train(recipe, Run(recipe, options, profile, device, rank, world_size))
        return 0
    finally:
        if sys.stdout is not stdout:
            sys.stdout.file.close()
            sys.stdout = stdout
        if dist.is_initialized():
            dist.destroy_process_group()


def is_input_error(e: BaseException) -> bool:
    """An error whose message names the cause and the fix (HarnessError by name: no more imports from prepare)."""
    return isinstance(e, (ValueError, TrainingDiverged)) or any(c.__name__ == "HarnessError" for c in type(e).__mro__)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:
        if not is_input_error(e):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
