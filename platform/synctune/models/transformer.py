"""Attention models in plain PyTorch: BERT pre-training (Devlin et al. 2019) at several depths and
widths, and the Transformer encoder-decoder (Vaswani et al. 2017, "base").

Attention keeps separate query/key/value/output projections, as BERT's checkpoints do, so a
model spec lists the same variables the papers' TensorFlow graphs had. No dropout: the
engine measures synchronization, and determinism keeps equivalence tests exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BertPretraining", "TransformerSeq2Seq"]


def _init_normal(module: nn.Module, std: float) -> None:
    """BERT's initialisation: N(0, std) weights, zero biases, unit LayerNorm (Devlin et al. 2019)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            if m.weight.is_meta:
                continue
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        # Heads are reshaped by their size, not their count: a tensor-parallel split of the
        # projections then holds whole heads per device (as Hugging Face's attention does).
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        b, t, h = x.shape
        src = x if memory is None else memory

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, z.shape[1], -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(src)), split(self.value(src)),
                                             is_causal=causal)
        return self.output(out.transpose(1, 2).reshape(b, t, -1))


class _FeedForward(nn.Module):
    def __init__(self, hidden: int, inner: int, activation) -> None:
        super().__init__()
        self.intermediate = nn.Linear(hidden, inner)
        self.output = nn.Linear(inner, hidden)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.activation(self.intermediate(x)))


class _EncoderLayer(nn.Module):
    """Post-norm encoder layer (BERT and the original Transformer both normalise after the residual)."""

    def __init__(self, hidden: int, heads: int, inner: int, activation, eps: float) -> None:
        super().__init__()
        self.attention = _Attention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.ffn = _FeedForward(hidden, inner, activation)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(x + self.ffn(x))


class BertPretraining(nn.Module):
    """BERT with its pre-training heads: masked LM (decoder tied to the word embedding) and
    next-sentence prediction. ``forward(tokens, segments, mlm_labels, nsp_labels) -> loss``."""

    def __init__(self, *, layers: int, hidden: int, heads: int, inner: int, vocab: int = 30522,
                 max_positions: int = 512, type_vocab: int = 2) -> None:
        super().__init__()
        eps = 1e-12
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(_EncoderLayer(hidden, heads, inner, F.gelu, eps) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.mlm_transform = nn.Linear(hidden, hidden)
        self.mlm_norm = nn.LayerNorm(hidden, eps=eps)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.nsp = nn.Linear(hidden, 2)
        _init_normal(self, 0.02)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor, mlm_labels: torch.Tensor,
                nsp_labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions) + self.token_type_embeddings(segments)
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        nsp_loss = F.cross_entropy(self.nsp(pooled), nsp_labels)
        h = self.mlm_norm(F.gelu(self.mlm_transform(x)))
        logits = h @ self.word_embeddings.weight.t() + self.mlm_bias
        # Every position is a prediction target: synthetic batches need no [MASK] bookkeeping,
        # and the per-sample loss stays independent of batch mates.
        mlm_loss = F.cross_entropy(logits.flatten(0, 1), mlm_labels.flatten())
        return mlm_loss + nsp_loss


class _DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.self_attention = _Attention(hidden, heads)
        self.self_norm = nn.LayerNorm(hidden)
        self.cross_attention = _Attention(hidden, heads)
        self.cross_norm = nn.LayerNorm(hidden)
        self.ffn = _FeedForward(hidden, inner, F.relu)
        self.ffn_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.self_norm(x + self.self_attention(x, causal=True))
        x = self.cross_norm(x + self.cross_attention(x, memory=memory))
        return self.ffn_norm(x + self.ffn(x))


def _sinusoid(length: int, hidden: int, device) -> torch.Tensor:
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, hidden, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / hidden))
    pe = torch.zeros(length, hidden, device=device)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class TransformerSeq2Seq(nn.Module):
    """Transformer encoder-decoder with one embedding shared by source, target and the output
    projection (Vaswani et al. 2017 §3.4). ``forward(source, target_in, target_out) -> loss``."""

    def __init__(self, *, vocab: int, hidden: int, heads: int, inner: int, layers: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.embedding = nn.Embedding(vocab, hidden)
        self.encoder = nn.ModuleList(_EncoderLayer(hidden, heads, inner, F.relu, 1e-5) for _ in range(layers))
        self.decoder = nn.ModuleList(_DecoderLayer(hidden, heads, inner) for _ in range(layers))
        # The embedding is scaled by sqrt(hidden) on input and tied to the output (Vaswani §3.4).
        _init_normal(self, hidden ** -0.5)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids) * math.sqrt(self.hidden) + _sinusoid(ids.shape[1], self.hidden, ids.device)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor, target_out: torch.Tensor) -> torch.Tensor:
        memory = self._embed(source)
        for layer in self.encoder:
            memory = layer(memory)
        x = self._embed(target_in)
        for layer in self.decoder:
            x = layer(x, memory)
        logits = x @ self.embedding.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), target_out.flatten())
