"""A small Llama-style decoder over vLLM-style paged KV caches, in PyTorch.

Seeded random weights (no model download exists here): RMSNorm, rotary
position embeddings, grouped-query attention, SwiGLU. The KV cache of each
layer is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(vLLM's layout) addressed through a block table, so ferry's paged buffers
read and write exactly what the attention uses.
"""
import torch


class TinyLlama:
    def __init__(self, vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=0,
                 dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.dim, self.layers = vocab, dim, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.dtype = dtype

        def w(*shape):
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

        self.embed = w(vocab, dim)
        self.blocks = [dict(attn_norm=torch.ones(dim, dtype=dtype),
                            wq=w(heads * self.head_dim, dim),
                            wk=w(kv_heads * self.head_dim, dim),
                            wv=w(kv_heads * self.head_dim, dim),
                            wo=w(dim, heads * self.head_dim),
                            ffn_norm=torch.ones(dim, dtype=dtype),
                            w1=w(ffn, dim), w3=w(ffn, dim), w2=w(dim, ffn))
                       for _ in range(layers)]
        self.norm = torch.ones(dim, dtype=dtype)
        self.out = w(vocab, dim)

    def new_caches(self, num_blocks, block_size):
        return [torch.zeros(2, num_blocks, block_size, self.kv_heads, self.head_dim,
                            dtype=self.dtype) for _ in range(self.layers)]

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def _rope(self, x, pos):
        half = self.head_dim // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        ang = pos.to(torch.float32)[:, None] * freq[None, :]
        cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, tokens, start, caches, block_table, before_layer=None, after_kv=None):
        """Logits [n, vocab] of tokens[0..n) at positions start..start+n; writes
        their K and V into the caches first, then attends over positions
        0..start+n (earlier ones read from the caches, causally masked).
        before_layer(L) is called before layer L touches its cache (a
        layerwise load waits there), after_kv(L) once layer L's K and V are
        in its cache (a layerwise save hands the layer over there)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n = tokens.numel()
        bs = caches[0].shape[2]
        table = torch.as_tensor(block_table, dtype=torch.long)
        pos = torch.arange(start, start + n)
        total = start + n
        all_pos = torch.arange(total)
        blk, row = table[all_pos // bs], all_pos % bs
        wblk, wrow = table[pos // bs], pos % bs
        x = self.embed[tokens]
        mask = all_pos[None, :] <= pos[:, None]
        rep = self.heads // self.kv_heads
        for L, p in enumerate(self.blocks):
            if before_layer is not None:
                before_layer(L)
            h = self._rms(x, p["attn_norm"])
            q = (h @ p["wq"].T).view(n, self.heads, self.head_dim)
            k = (h @ p["wk"].T).view(n, self.kv_heads, self.head_dim)
            v = (h @ p["wv"].T).view(n, self.kv_heads, self.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            caches[L][0, wblk, wrow] = k
            caches[L][1, wblk, wrow] = v
            if after_kv is not None:
                after_kv(L)
            K = caches[L][0, blk, row].repeat_interleave(rep, dim=1)  # [total, heads, hd]
            V = caches[L][1, blk, row].repeat_interleave(rep, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, K) / self.head_dim ** 0.5
            att = att.masked_fill(~mask[None], float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", att, V).reshape(n, -1)
            x = x + o @ p["wo"].T
            h = self._rms(x, p["ffn_norm"])
            x = x + (torch.nn.functional.silu(h @ p["w1"].T) * (h @ p["w3"].T)) @ p["w2"].T
        return self._rms(x, self.norm) @ self.out.T

    def kv_of(self, caches, block_table, n):
        """[layers, 2, n, kv_heads, head_dim]: the KV of positions 0..n."""
        bs = caches[0].shape[2]
        t = torch.arange(n)
        table = torch.as_tensor(block_table, dtype=torch.long)
        return torch.stack([c[:, table[t // bs], t % bs] for c in caches])
