"""Workers for the tensor-parallelism tests (run inside spawned gloo processes), the library models
they split (Hugging Face BERT and Llama built from configs: nothing is downloaded), and the
single-process reference training they are compared with."""

from __future__ import annotations

import torch

from _checkpoint_workers import CONTEXT, VOCAB, lm_loss, tiny_bert
from _engine_workers import batches, make_optimizer
from _fsdp_workers import full_state
from synctune.models import build_model
from synctune.spec import ClusterSpec
from synctune.strategy import Strategy


def tiny_llama():
    """A two-layer Llama (``LlamaForCausalLM``: RMSNorm, rotary positions, a gated MLP, grouped
    key-value heads) from a config; no KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                        use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0))


class HeadCountAttention(torch.nn.Module):
    """Self-attention that reshapes its projections by the head count (``view(b, s, heads,
    head_dim)``), as older attention code does: correct whole, wrong to split column-wise."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for m in (self.query, self.key, self.value))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class HeadCountModel(torch.nn.Module):
    """An embedding, one :class:`HeadCountAttention` and an output layer."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.attention = HeadCountAttention(dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids):
        return self.head(self.embed(ids) + self.attention(self.embed(ids)))


def head_count():
    """:class:`HeadCountModel` as a workload."""
    import synctune.workload as sw

    return sw.define(name="head-count", model=HeadCountModel, batch=lambda n, rank, generator: tokens(n, generator),
                     batch_size=4, family="transformer",
                     loss=lambda model, batch: torch.nn.functional.cross_entropy(
                         model(batch[0]).flatten(0, 1), batch[0].flatten()))


class _Block(torch.nn.Module):
    """A pre-norm MLP block: ``x + fc2(gelu(fc1(norm(x))))`` (Megatron splits fc1 and fc2)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, inner)
        self.fc2 = torch.nn.Linear(inner, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class EmbeddingLM(torch.nn.Module):
    """A tiny language model whose token embedding has a weight of its own (no output layer tied
    to it): embedding, two MLP blocks, a final norm and an output layer; ``factorised``: the
    embedding is narrower than the blocks and a linear ``proj`` widens it (ALBERT's factorised
    embedding), so a column-wise embedding can feed a row-wise ``proj``. Its ``forward`` takes and
    returns what Hugging Face's language models do (``input_ids``, ``labels``; ``.loss``)."""

    def __init__(self, factorised: bool = False, hidden: int = 32) -> None:
        super().__init__()
        width = 16 if factorised else hidden
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.proj = torch.nn.Linear(width, hidden) if factorised else None
        self.layers = torch.nn.ModuleList(_Block(hidden, 64) for _ in range(2))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        x = self.embed(input_ids)
        if self.proj is not None:
            x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def embedding_lm():
    return EmbeddingLM()


def factorised_lm():
    return EmbeddingLM(factorised=True)


#: The library models by name: factory of the model.
LIBRARY = {"hf-bert": tiny_bert, "hf-llama": tiny_llama, "emb-lm": embedding_lm, "emb-factorised": factorised_lm}


def tokens(batch_size: int, generator) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=generator),)


def model_and_batches(name: str, split, step: int):
    """A fresh model of ``name`` (a zoo model or :data:`LIBRARY`'s, seeded 0), its loss
    ``loss(model, batch)`` and the per-group batches of step ``step`` (one per entry of ``split``)."""
    torch.manual_seed(0)
    if name in LIBRARY:
        model = LIBRARY[name]()
        parts = []
        for r, n in enumerate(split):
            gen = torch.Generator().manual_seed(step * 1009 + r)
            parts.append(tokens(n, gen))
        return model, lm_loss, parts
    return build_model(name), (lambda m, b: m(*b)), batches(name, split, step)


def reference(name: str, split, optimizer: str, lr: float, steps: int, dtype=torch.float32) -> dict:
    """Single-process training on the concatenation of the TP groups' batches."""
    module, loss, _ = model_and_batches(name, split, 0)
    module = module.to(dtype)
    opt = make_optimizer(optimizer, module.parameters(), lr)
    for step in range(steps):
        _, _, parts = model_and_batches(name, split, step)
        joined = tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
        joined = tuple(t.to(dtype) if t.is_floating_point() else t for t in joined)
        opt.zero_grad()
        loss(module, joined).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def tp_train_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train every case with the ``tp`` runtime on this rank as a trial does (its ``prepare``, the
    batch of the rank's TP group, ``loss * loss_scale`` backward); returns the whole parameters
    after the last step and which are DTensors, or the refusal's message."""
    from synctune.engine.runtime import ArmContext
    from synctune.engine.tensor_parallel import TP_RUNTIME
    from synctune.spec.errors import SpecError

    out = []
    for case in cases:
        strategy = Strategy.from_dict(case["strategy"])
        cluster = ClusterSpec.from_dict(case["cluster"])
        t = strategy.tensor_parallel.degree
        group_split = strategy.batch_split[::t]
        device = torch.device("cpu")
        if case.get("device") == "cuda":  # the ranks share the GPUs round-robin (over gloo on one GPU)
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        module, loss, parts = model_and_batches(case["model"], group_split, 0)
        module = module.to(device)
        parts = [tuple(x.to(device) for x in p) for p in parts]
        from synctune.spec.model import ModelSpec

        spec = ModelSpec.from_dict(case["spec"])
        try:
            stepper = TP_RUNTIME.prepare(ArmContext(
                rank=rank, model=module, strategy=strategy, spec=spec, cluster=cluster, device=device,
                seed=0, collective_timeout_s=60.0,
                make_optimizer=lambda ps: make_optimizer(case["optimizer"], ps, case["lr"]),
                loss_of=lambda m: loss(m, parts[rank // t])))
        except SpecError as exc:
            out.append({"refused": str(exc)})
            continue
        for step in range(case["steps"]):
            _, _, parts = model_and_batches(case["model"], group_split, step)
            value = loss(stepper.forward_model, tuple(x.to(device) for x in parts[rank // t]))
            (value * stepper.loss_scale).backward()
            stepper.step()
        stepper.close()
        split = sorted(k for k, p in module.named_parameters() if hasattr(p, "full_tensor"))
        if device.type == "cuda":  # gloo gathers no CUDA tensors: each rank's own shards, stitched by the test
            out.append({"local": {k: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()
                                  for k, v in module.state_dict().items()}, "split": split})
        else:
            out.append({"params": full_state(module), "split": split})
    return out


def hf_llama():
    """The tiny Llama as a workload (the trial's SGD)."""
    import synctune.workload as sw

    return sw.define(name="tiny-hf-llama", model=tiny_llama, batch=lambda n, rank, generator: tokens(n, generator),
                     batch_size=4, family="transformer", loss=lm_loss)


def emb_lm():
    """The tiny :class:`EmbeddingLM` as a workload (the trial's SGD)."""
    import synctune.workload as sw

    return sw.define(name="emb-lm", model=embedding_lm, batch=lambda n, rank, generator: tokens(n, generator),
                     batch_size=4, family="transformer", loss=lm_loss)


def emb_factorised():
    """The factorised :class:`EmbeddingLM` as a workload (the trial's SGD)."""
    import synctune.workload as sw

    return sw.define(name="emb-factorised", model=factorised_lm, batch=lambda n, rank, generator: tokens(n, generator),
                     batch_size=4, family="transformer", loss=lm_loss)


def workload_of(name: str):
    """A zoo model by name, or ``hf-bert`` / ``hf-llama`` / ``emb-lm`` / ``emb-factorised`` (the
    factories here, by import path)."""
    from _checkpoint_workers import HERE
    from synctune.workload import ImportedWorkload, zoo_workload

    if name == "hf-bert":
        return ImportedWorkload("_checkpoint_workers:hf_bert", HERE)
    if name == "hf-llama":
        return ImportedWorkload("_tp_workers:hf_llama", HERE)
    if name in ("emb-lm", "emb-factorised"):
        return ImportedWorkload(f"_tp_workers:{name.replace('-', '_')}", HERE)
    return zoo_workload(name)
