"""nanochat's GPT (karpathy/nanochat at commit 92d63d4), inference only, as a train.py stand-in for the
kit's scorer: `python prepare.py eval-public --train-py benchmarks/nanochat_adapter.py --checkpoint OUT/final.pt`.

The scorer copies this one file into its sandbox and calls load_for_eval(checkpoint_path, device), so it
needs only the Python standard library and torch. The checkpoint is what `benchmarks/nanochat_peer.py
train` writes: nanochat's own state dict and GPTConfig (plain data, loaded with weights_only=True).

The forward is a port of nanochat/gpt.py GPT.forward at that commit with kv_cache=None, through its
SDPA attention path (nanochat/flash_attention.py `_sdpa_attention`, which gives the same result as its
FA3 path: causal, each layer's window (left, 0)):
  token embedding -> RMSNorm -> smear (previous token's embedding through a gate) -> per layer:
  x = resid_lambda * x + x0_lambda * x0, then pre-norm attention (rotary, then QK RMSNorm, then both
  scaled by 1.2; value embeddings mixed into v on alternating layers through a 3*sigmoid gate; a sliding
  window on the "S" layers of the window pattern) and a pre-norm ReLU^2 MLP; the residual saved after
  layer n_layer // 2 is subtracted (backout) before the final RMSNorm; lm_head, padding cropped, fp32
  logits squashed by a softcap of 15.
Precision as nanochat does it (no autocast): a compute dtype, bf16 on a CUDA device (what nanochat picks
there, SM 80+) and fp32 elsewhere; the embeddings, rotary tables and activations are in that dtype, every
Linear casts its fp32 weight to it, and the logits are cast to fp32 before the softcap. Windows are
nanochat's, from the training sequence length: L = sequence_len, S = a quarter of it rounded up to 128;
an evaluation context longer than a layer's window sees only that window, as in nanochat.

Ported from nanochat (https://github.com/karpathy/nanochat), MIT License:

    Copyright (c) 2025 Andrej Karpathy

    Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
    associated documentation files (the "Software"), to deal in the Software without restriction,
    including without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense,
    and/or sell copies of the Software, and to permit persons to whom the Software is furnished to do so,
    subject to the following conditions:

    The above copyright notice and this permission notice shall be included in all copies or substantial
    portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT
    LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO
    EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY,
    WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE
    SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CHECKPOINT_FORMAT = "nanochat-gpt/92d63d4"
CONFIG_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")
ROPE_BASE = 100000
SOFTCAP = 15
VE_GATE_CHANNELS = 12
SMEAR_CHANNELS = 24


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Linear(nn.Linear):
    """nn.Linear that casts its weight to the input's dtype (nanochat's replacement for autocast)."""

    def forward(self, x):
        return F.linear(x, self.weight.to(dtype=x.dtype))


def has_ve(layer_idx: int, n_layer: int) -> bool:
    return layer_idx % 2 == (n_layer - 1) % 2


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3)


def window_sizes(cfg: dict) -> list[int]:
    """Each layer's left window in tokens (nanochat GPT._compute_window_sizes); the last layer is L."""
    pattern = cfg["window_pattern"].upper()
    if not pattern or any(c not in "SL" for c in pattern):
        raise ValueError(f"invalid window_pattern {cfg['window_pattern']!r}")
    long_window = cfg["sequence_len"]
    short_window = -(-long_window // 4 // 128) * 128
    sizes = [long_window if pattern[i % len(pattern)] == "L" else short_window for i in range(cfg["n_layer"])]
    sizes[-1] = long_window
    return sizes


def sdpa_attention(q, k, v, window: int):
    """nanochat's SDPA fallback for a full sequence (Tq == Tk): plain causal when the window covers it,
    else an explicit mask: key j is seen from query i when j <= i and i - j <= window."""
    T = q.size(2)
    enable_gqa = q.size(1) != k.size(1)
    kw = {"enable_gqa": True} if enable_gqa else {}
    if window < 0 or window >= T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    row = torch.arange(T, device=q.device).unsqueeze(1)
    col = torch.arange(T, device=q.device).unsqueeze(0)
    mask = (col <= row) & ((row - col) <= window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.n_embd = cfg["n_head"], cfg["n_kv_head"], cfg["n_embd"]
        self.head_dim = self.n_embd // self.n_head
        self.c_q = Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = Linear(self.n_embd, self.n_embd, bias=False)
        self.ve_gate = Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) \
            if has_ve(layer_idx, cfg["n_layer"]) else None

    def forward(self, x, ve, cos_sin, window: int):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            ve = ve.view(B, T, self.n_kv_head, self.head_dim)
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)
        q = q * 1.2
        k = k * 1.2
        y = sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window).transpose(1, 2)
        return self.c_proj(y.contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.c_fc = Linear(cfg["n_embd"], 4 * cfg["n_embd"], bias=False)
        self.c_proj = Linear(4 * cfg["n_embd"], cfg["n_embd"], bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)

    def forward(self, x, ve, cos_sin, window: int):
        x = x + self.attn(norm(x), ve, cos_sin, window)
        return x + self.mlp(norm(x))


class NanochatGPT(nn.Module):
    """nanochat's GPT with the same parameter names, so its state dict loads strictly."""

    def __init__(self, cfg: dict, padded_vocab_size: int, compute_dtype: torch.dtype):
        super().__init__()
        self.cfg, self.compute_dtype = dict(cfg), compute_dtype
        self.vocab_size = cfg["vocab_size"]
        self.windows = window_sizes(cfg)
        n_embd, n_layer = cfg["n_embd"], cfg["n_layer"]
        kv_dim = cfg["n_kv_head"] * (n_embd // cfg["n_head"])
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(padded_vocab_size, n_embd),
            "h": nn.ModuleList([Block(cfg, i) for i in range(n_layer)]),
        })
        self.lm_head = Linear(n_embd, padded_vocab_size, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(n_layer))
        self.x0_lambdas = nn.Parameter(torch.zeros(n_layer))
        self.smear_gate = Linear(SMEAR_CHANNELS, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(padded_vocab_size, kv_dim)
                                           for i in range(n_layer) if has_ve(i, n_layer)})
        self._rotary = None  # (length, device, cos, sin), built on first use on the model's device

    def rotary(self, T: int, device):
        """cos, sin [1, T, 1, head_dim / 2] in the compute dtype, computed in fp32 on the model's device as
        nanochat does (for 10x the training length, or T when longer)."""
        if self._rotary is None or self._rotary[0] < T or self._rotary[1] != device:
            length = max(10 * self.cfg["sequence_len"], T)
            head_dim = self.cfg["n_embd"] // self.cfg["n_head"]
            channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
            inv_freq = 1.0 / (ROPE_BASE ** (channel_range / head_dim))
            t = torch.arange(length, dtype=torch.float32, device=device)
            freqs = torch.outer(t, inv_freq)
            cos = freqs.cos().to(self.compute_dtype)[None, :, None, :]
            sin = freqs.sin().to(self.compute_dtype)[None, :, None, :]
            self._rotary = (length, device, cos, sin)
        _, _, cos, sin = self._rotary
        return cos[:, :T], sin[:, :T]

    def forward(self, idx):
        B, T = idx.size()
        dt = self.compute_dtype
        cos_sin = self.rotary(T, idx.device)
        x = self.transformer.wte(idx).to(dt)
        x = norm(x)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]))
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        x0 = x
        backout_layer = self.cfg["n_layer"] // 2
        x_backout = None
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds else None
            x = block(x, ve, cos_sin, self.windows[i])
            if i == backout_layer:
                x_backout = x
        if x_backout is not None:
            x = x - self.backout_lambda.to(x.dtype) * x_backout
        x = norm(x)
        logits = self.lm_head(x)[..., :self.vocab_size].float()
        return SOFTCAP * torch.tanh(logits / SOFTCAP)


# None: nanochat's own choice (compute_dtype_for); benchmarks/side_by_side.py scores with a copy that sets the dtype
# the kit's load_for_eval picks on the machine, so that both models are scored in one dtype.
SCORE_DTYPE = None


def compute_dtype_for(device: torch.device) -> torch.dtype:
    """nanochat's choice: bf16 on a CUDA GPU of SM 80 or newer, fp32 otherwise."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return torch.bfloat16
    return torch.float32


def load_for_eval(checkpoint_path: str, device) -> nn.Module:
    """The scorer's entry point: nanochat's GPT from checkpoint_path on `device`, eval mode, frozen."""
    device = torch.device(device)
    payload = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{checkpoint_path}: format {found!r}, expected {CHECKPOINT_FORMAT!r} "
                         "(written by benchmarks/nanochat_peer.py train)")
    cfg, state = payload["model_config"], payload["model_state"]
    missing = [k for k in CONFIG_FIELDS if k not in cfg]
    if missing:
        raise ValueError(f"{checkpoint_path}: model_config lacks {missing}")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    padded_vocab_size = state["transformer.wte.weight"].shape[0]
    model = NanochatGPT(cfg, padded_vocab_size, SCORE_DTYPE or compute_dtype_for(device))
    model.load_state_dict(state, strict=True)
    # nanochat keeps its embeddings in the compute dtype (init_weights casts them); the rest in fp32
    if model.compute_dtype != torch.float16:
        model.transformer.wte.to(dtype=model.compute_dtype)
        for ve in model.value_embeds.values():
            ve.to(dtype=model.compute_dtype)
    return model.to(device).eval().requires_grad_(False)
