"""Embedding-heavy models: NeuMF (NCF, He et al. 2017, as in MLPerf) and the LM1B LSTM language
model (Jozefowicz et al. 2016, "LSTM-2048-512"), the papers' dense and sparse-gradient cases.

With ``sparse=True`` the embedding lookups produce sparse gradients (rows touched by the
batch), the case Parallax sends to parameter servers and Horovod to all-gather.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["NeuMF", "LSTMLanguageModel"]


class NeuMF(nn.Module):
    """NeuMF: one user and one item embedding, each split into a GMF part (``mf_dim``) and an
    MLP part (``layers[0] // 2``), as the TF official model does; then the MLP tower and a
    final linear layer: 10 variables with three MLP layers. ``forward(users, items, labels)``."""

    def __init__(self, *, num_users: int, num_items: int, mf_dim: int, layers: tuple[int, ...],
                 sparse: bool) -> None:
        super().__init__()
        self.mf_dim = mf_dim
        width = mf_dim + layers[0] // 2
        self.user_embedding = nn.Embedding(num_users, width, sparse=sparse)
        self.item_embedding = nn.Embedding(num_items, width, sparse=sparse)
        self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(layers[:-1], layers[1:]))
        self.output = nn.Linear(mf_dim + layers[-1], 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u, i = self.user_embedding(users), self.item_embedding(items)
        gmf = u[:, : self.mf_dim] * i[:, : self.mf_dim]
        x = torch.cat([u[:, self.mf_dim:], i[:, self.mf_dim:]], dim=1)
        for layer in self.mlp:
            x = F.relu(layer(x))
        logits = self.output(torch.cat([gmf, x], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels)


class LSTMLanguageModel(nn.Module):
    """LSTM with a projection layer and sampled softmax (the AutoDist LM1B benchmark).

    The embedding and the softmax weights/biases are looked up by id, so all three get
    sparse gradients. Negatives are sampled per sequence and passed in with the batch, so a
    sequence's loss does not depend on which replica it lands on.
    ``forward(inputs, targets, negatives) -> loss`` with negatives of shape (batch, samples).
    """

    def __init__(self, *, vocab: int, embedding: int, state: int, projection: int) -> None:
        super().__init__()
        self.state = state
        self.projection = projection
        self.embedding = nn.Embedding(vocab, embedding, sparse=True)
        self.W = nn.Parameter(torch.empty(embedding + projection, 4 * state))
        self.B = nn.Parameter(torch.zeros(4 * state))
        self.W_P = nn.Parameter(torch.empty(state, projection))
        self.softmax_w = nn.Embedding(vocab, projection, sparse=True)
        self.softmax_b = nn.Embedding(vocab, 1, sparse=True)
        if not self.W.is_meta:
            nn.init.uniform_(self.W, -0.05, 0.05)
            nn.init.uniform_(self.W_P, -0.05, 0.05)
            nn.init.zeros_(self.softmax_b.weight)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        b, steps = inputs.shape
        x = self.embedding(inputs)
        h = x.new_zeros(b, self.projection)
        c = x.new_zeros(b, self.state)
        outputs = []
        for t in range(steps):
            gates = torch.cat([x[:, t], h], dim=1) @ self.W + self.B
            i, j, f, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(j)
            h = (torch.sigmoid(o) * torch.tanh(c)) @ self.W_P
            outputs.append(h)
        hs = torch.stack(outputs, dim=1)  # (b, steps, projection)
        true_logit = (hs * self.softmax_w(targets)).sum(-1) + self.softmax_b(targets).squeeze(-1)
        neg_w = self.softmax_w(negatives)  # (b, samples, projection)
        neg_logit = torch.einsum("btd,bsd->bts", hs, neg_w) + self.softmax_b(negatives).squeeze(-1)[:, None, :]
        logits = torch.cat([true_logit.unsqueeze(-1), neg_logit], dim=-1)
        labels = torch.zeros(b * steps, dtype=torch.long, device=inputs.device)
        return F.cross_entropy(logits.flatten(0, 1), labels)
