"""An independent, plain PyTorch reference of the normative cache semantics (docs/design.md, "The cache").

Written straight from the specification, with Python lists and the `transformers` model's own
sub-modules: nothing is shared with the ONNX graph builder or the numpy ring bookkeeping.

  * each chunk's tokens attend to every cached token and causally to the chunk;
  * positions are ranks: cached tokens 0..L-1 (stream order), the chunk L..L+c-1;
  * then the chunk joins the cache; the first S stream tokens and pinned tokens are never evicted;
    the oldest unpinned tokens beyond W are dropped.
  * the recall region (docs/design.md, "The recall region"), once begin_recall() was called: recalled
    tokens are pinned, rank after the sink and pinned tokens and before the window, and their chunk
    attends to the cached non-window tokens and causally to itself, never to the window;
  * a layer with its own sliding window of w tokens (Gemma 3's local layers, when `local` is set)
    attends instead to the stream's tokens within w of each query (itself included), at their ranks
    among the last w - 1 tokens of the stream, whatever the other layers evicted or pinned; recalled
    tokens are no part of that stream there: a recalled chunk attends in such a layer to the current
    region's earlier tokens and causally to itself only, at their ranks inside the region.
"""

from __future__ import annotations

import torch


class StreamingReference:
    def __init__(self, model, sink: int, window: int, local: bool = False):
        """local: the model's sliding-window layers (config.layer_types) keep only their window."""
        self.m = model
        self.sink, self.window = sink, window
        cfg = model.config
        self.H = cfg.num_attention_heads
        self.Hkv = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        self.local = [local and k == "sliding_attention" for k in kinds]
        self.w = cfg.sliding_window if any(self.local) else 0

        def inv_freq(kind: str) -> torch.Tensor:
            params = cfg.rope_parameters.get(kind, cfg.rope_parameters)  # Gemma 3: one block per layer kind
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, self.D, 2, dtype=torch.float64) / self.D))

        self.inv_freq = [inv_freq(k) for k in kinds]
        # One entry per cached token, in stream order: (stream index, pinned, [per-layer (k, v)]).
        self.entries: list[tuple[int, bool, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        # The last w - 1 tokens of the stream, for the local layers: (index among the stream's tokens but
        # the recalled ones, [per-layer (k, v)]); the current region's tokens there: [per-layer (k, v)].
        self.recent: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.region: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.seen = 0
        self.local_seen = 0  # the stream's tokens but the recalled ones
        self.recalled: set[int] = set()  # stream indices of the recalled tokens cached
        self.recall_mode = False  # a recall region was started: the window ranks after every other token

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        # x (heads, n, D), pos (n,); "rotate half" convention, computed in float64 then cast.
        f = pos.double()[:, None] * inv_freq[None, :]
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        x1, x2 = x[..., : self.D // 2], x[..., self.D // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def begin_recall(self) -> None:
        """The recalled tokens cached are dropped; feed(recall=True) then caches new ones."""
        self.entries = [e for e in self.entries if e[0] not in self.recalled]
        self.recalled = set()
        self.region = []
        self.recall_mode = True

    @torch.no_grad()
    def feed(self, ids: list[int], pin: bool = False, recall: bool = False) -> torch.Tensor:
        """Process one chunk; returns its logits (n, vocab). recall: recalled text (begin_recall first)."""
        if self.recall_mode:  # ranks: the pinned (sink, pinned, recalled) tokens first, then the window's
            self.entries = [e for e in self.entries if e[1]] + [e for e in self.entries if not e[1]]
        seen_by = [e for e in self.entries if e[1]] if recall else self.entries
        m, n, cached = self.m.model, len(ids), len(seen_by)
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
            if self.local[li] and recall:  # the region's earlier tokens, at their ranks inside it
                held = [e[li] for e in self.region]
                r = len(held)
                allowed = torch.cat([torch.ones(n, r, dtype=torch.bool), causal], dim=1)
                kp, qp = torch.arange(r + n), torch.arange(r, r + n)
            elif self.local[li]:  # the last w - 1 stream tokens, each query seeing those within w of it
                held = [e[1][li] for e in self.recent]
                r = len(held)
                allowed = torch.tensor([[e[0] > self.local_seen + i - self.w for e in self.recent] for i in range(n)],
                                       dtype=torch.bool).reshape(n, r)  # fmt: skip
                allowed = torch.cat([allowed, causal], dim=1)
                kp, qp = torch.arange(r + n), torch.arange(r, r + n)
            else:
                held = [e[2][li] for e in seen_by]
                allowed = torch.cat([torch.ones(n, cached, dtype=torch.bool), causal], dim=1)
                kp, qp = k_pos, q_pos
            ks = [kv[0] for kv in held] + [k[:, t] for t in range(n)]
            vs = [kv[1] for kv in held] + [v[:, t] for t in range(n)]
            K = self._rope(torch.stack(ks, dim=1), kp, self.inv_freq[li])  # (Hkv, held + n, D)
            V = torch.stack(vs, dim=1)
            Q = self._rope(q, qp, self.inv_freq[li])
            G = self.H // self.Hkv
            K, V = K.repeat_interleave(G, dim=0), V.repeat_interleave(G, dim=0)
            scores = Q @ K.transpose(1, 2) * a.scaling  # (H, n, held + n); 1/sqrt(D) but for Gemma 3
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = (scores.softmax(-1) @ V).transpose(0, 1).reshape(n, self.H * self.D)
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: attention and MLP outputs normed too
                x = x + layer.post_attention_layernorm(a.o_proj(out))
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + a.o_proj(out)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.m.lm_head(m.norm(x))
        for t in range(n):
            idx = self.seen + t
            self.entries.append((idx, pin or recall or idx < self.sink, new_kv[t]))
            if recall:
                self.recalled.add(idx)
                self.region.append(new_kv[t])
            else:
                self.recent.append((self.local_seen + t, new_kv[t]))
        self.seen += n
        self.local_seen += 0 if recall else n
        self.recent = self.recent[-(self.w - 1) :] if self.w else []
        unpinned = [i for i, e in enumerate(self.entries) if not e[1]]
        drop = set(unpinned[: max(0, len(unpinned) - self.window)])
        self.entries = [e for i, e in enumerate(self.entries) if i not in drop]
        return logits
