"""The cache semantics with a pinned camera frame, written for the vision-language tests in plain PyTorch from
docs/design.md ("Camera frames") with the transformers model's own sub-modules (nothing shared with the graph or the
slot table). test_idefics3.py runs it as it is (positions are ranks); test_qwen2_vl.py gives it M-RoPE's positions
and rotation.

  * each cached token keeps the K/V it was given when fed;
  * at every chunk the cached tokens, then the chunk, in stream order, get their positions
    (`positions`: ranks 0..L+n-1 here), RoPE is applied with them (`rope`), and every chunk token
    attends to every cached token and causally to the chunk;
  * then the chunk joins the cache: the first `sink` tokens and the frame's tokens stay, the oldest
    others beyond `window` are dropped; a new frame drops the previous frame's tokens (but those in
    the sink).
"""

from __future__ import annotations

import numpy as np
import torch


class FrameStreamingReference:
    def __init__(self, model, text_model, sink: int, window: int, inv_freq: torch.Tensor):
        """model: the transformers ...ForConditionalGeneration; text_model: its decoder's transformer
        (layers, norm); inv_freq (D/2,): RoPE's frequencies."""
        self.m, self.lm, self.sink, self.window = model, text_model, sink, window
        cfg = model.config.text_config
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = cfg.hidden_size // self.H
        self.inv_freq = inv_freq.double()
        self.entries: list[tuple[int, bool, bool, list]] = []  # (stream index, pinned, frame token, [(k, v)] per layer)
        self.seen = 0

    def positions(self, frame: list[bool]) -> np.ndarray:
        """The positions of the cached tokens then the chunk's (frame: which are the frame's tokens)."""
        return np.arange(len(frame))

    def rope(self, x: torch.Tensor, pos: np.ndarray) -> torch.Tensor:  # x (heads, n, D), pos (n,)
        return self.rotate(x, torch.from_numpy(pos).double()[:, None] * self.inv_freq[None, :])

    def rotate(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:  # x (heads, n, D), f (n, D/2) angles
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        x1, x2 = x[..., : self.D // 2], x[..., self.D // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    @torch.no_grad()
    def feed(self, x: torch.Tensor, frame: bool = False) -> torch.Tensor:
        """x (n, hidden): the chunk's input rows (token embeddings, or the frame's image embeddings);
        returns the chunk's logits (n, vocab)."""
        if frame and not (self.entries and self.entries[-1][2]):  # a new frame: the previous one leaves
            self.entries = [e for e in self.entries if e[0] < self.sink or not e[2]]
        logits, new_kv = self.attend(x, self.entries, frame)
        n = len(x)
        for t in range(n):
            idx = self.seen + t
            self.entries.append((idx, frame or idx < self.sink, frame, new_kv[t]))
        self.seen += n
        unpinned = [i for i, e in enumerate(self.entries) if not e[1]]
        drop = set(unpinned[: max(0, len(unpinned) - self.window)])
        self.entries = [e for i, e in enumerate(self.entries) if i not in drop]
        return logits

    def attend(self, x: torch.Tensor, seen: list, frame: bool) -> tuple[torch.Tensor, list]:
        """The chunk x (n, hidden) through the decoder over the cached entries `seen` (in rank order):
        its logits (n, vocab) and each token's [(k, v)] per layer."""
        n, cached = len(x), len(seen)
        pos = self.positions([e[2] for e in seen] + [frame] * n)
        new_kv = [[] for _ in range(n)]
        allowed = torch.cat([torch.ones(n, cached, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
        G = self.H // self.Hkv
        for li, layer in enumerate(self.lm.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(n, self.H, self.D).transpose(0, 1)
            k = a.k_proj(h).view(n, self.Hkv, self.D).transpose(0, 1)
            v = a.v_proj(h).view(n, self.Hkv, self.D).transpose(0, 1)
            for t in range(n):
                new_kv[t].append((k[:, t], v[:, t]))
            K = torch.stack([e[3][li][0] for e in seen] + [k[:, t] for t in range(n)], dim=1)
            V = torch.stack([e[3][li][1] for e in seen] + [v[:, t] for t in range(n)], dim=1)
            K = self.rope(K, pos).repeat_interleave(G, dim=0)
            Q = self.rope(q, pos[..., cached:])
            scores = (Q @ K.transpose(1, 2) * a.scaling).masked_fill(~allowed, float("-inf"))
            out = (scores.softmax(-1) @ V.repeat_interleave(G, dim=0)).transpose(0, 1).reshape(n, -1)
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.m.lm_head(self.lm.norm(x)), new_kv
