"""An independent, plain PyTorch reference of the normative cache semantics (DESIGN.md).

Written straight from the specification, with Python lists and the `transformers` model's own
sub-modules: nothing is shared with the ONNX graph builder or the numpy ring bookkeeping.

  * each chunk's tokens attend to every cached token and causally to the chunk;
  * positions are ranks: cached tokens 0..L-1 (stream order), the chunk L..L+c-1;
  * then the chunk joins the cache; the first S stream tokens and pinned tokens are never evicted;
    the oldest unpinned tokens beyond W are dropped.
"""

from __future__ import annotations

import torch


class StreamingReference:
    def __init__(self, model, sink: int, window: int):
        self.m = model
        self.sink, self.window = sink, window
        cfg = model.config
        self.H = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        theta = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.D, 2, dtype=torch.float64) / self.D))
        # One entry per cached token, in stream order: (stream index, pinned, [per-layer (k, v)]).
        self.entries: list[tuple[int, bool, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.seen = 0

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x (heads, n, D), pos (n,); "rotate half" convention, computed in float64 then cast.
        f = pos.double()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        x1, x2 = x[..., : self.D // 2], x[..., self.D // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    @torch.no_grad()
    def feed(self, ids: list[int], pin: bool = False) -> torch.Tensor:
        """Process one chunk; returns its logits (n, vocab)."""
        m, n, cached = self.m.model, len(ids), len(self.entries)
        x = m.embed_tokens(torch.tensor(ids))
        new_kv = [[] for _ in range(n)]
        q_pos = torch.arange(cached, cached + n)
        k_pos = torch.arange(cached + n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for li, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            if hasattr(a, "qkv_proj"):  # Phi-3: q|k|v in one projection
                q, k, v = a.qkv_proj(h).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
            else:
                q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
            q = q.view(n, self.H, self.D)
            k = k.view(n, self.Hkv, self.D)
            if getattr(a, "q_norm", None) is not None:  # Qwen3: RMSNorm of each head before RoPE
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = q.transpose(0, 1), k.transpose(0, 1)
            v = v.view(n, self.Hkv, self.D).transpose(0, 1)
            for t in range(n):
                new_kv[t].append((k[:, t], v[:, t]))
            ks = [e[2][li][0] for e in self.entries] + [k[:, t] for t in range(n)]
            vs = [e[2][li][1] for e in self.entries] + [v[:, t] for t in range(n)]
            K = self._rope(torch.stack(ks, dim=1), k_pos)  # (Hkv, cached + n, D)
            V = torch.stack(vs, dim=1)
            Q = self._rope(q, q_pos)
            G = self.H // self.Hkv
            K, V = K.repeat_interleave(G, dim=0), V.repeat_interleave(G, dim=0)
            scores = Q @ K.transpose(1, 2) / self.D**0.5  # (H, n, cached + n)
            allowed = torch.cat([torch.ones(n, cached, dtype=torch.bool), causal], dim=1)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = (scores.softmax(-1) @ V).transpose(0, 1).reshape(n, self.H * self.D)
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.m.lm_head(m.norm(x))
        for t in range(n):
            idx = self.seen + t
            self.entries.append((idx, pin or idx < self.sink, new_kv[t]))
        self.seen += n
        unpinned = [i for i, e in enumerate(self.entries) if not e[1]]
        drop = set(unpinned[: max(0, len(unpinned) - self.window)])
        self.entries = [e for i, e in enumerate(self.entries) if i not in drop]
        return logits
