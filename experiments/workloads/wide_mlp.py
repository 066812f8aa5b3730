"""A wide MLP on synthetic data (1024 -> 4096 -> 4096 -> 10, 80 MiB of gradients, 8 samples per
replica): the shape where sufficient-factor broadcasting (TAG §2.3) should pay, since one
replica's factors of a 4096 x 4096 layer are 8 x (4096 + 4096) values against 16.8 M."""

import torch
import torch.nn.functional as F

import synctune.workload as sw


class WideMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                       torch.nn.ReLU(), torch.nn.Linear(4096, 10))

    def forward(self, x):
        return self.net(x)


def _batch(batch_size, rank, generator):
    # A fixed random "teacher" labels the inputs, so the loss has something to learn.
    x = torch.randn(batch_size, 1024, generator=generator)
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(1024, 10, generator=teacher)
    return x, (x @ w).argmax(1)


def workload():
    return sw.define(name="mlp-wide", model=WideMLP, batch=_batch, batch_size=8, family="mlp",
                     loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))
