"""Workers for the activation-checkpointing tests (run inside spawned gloo processes), the tiny
Hugging Face models they train (built from configs: nothing is downloaded), and the
single-process reference they are compared with."""

from __future__ import annotations

from pathlib import Path

import torch

import synctune.workload as sw
from _fsdp_workers import full_state

VOCAB, CONTEXT = 128, 16
#: Where the workload factories below are found (``ImportedWorkload(path, root)``).
HERE = str(Path(__file__).resolve().parent)


def tiny_gpt2(dropout: float = 0.0):
    """A two-block GPT-2 (``GPT2LMHeadModel``, tied input and output embeddings) from a config;
    no KV cache (a block that appends to a cache cannot be recomputed exactly)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                      use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                      bos_token_id=0, eos_token_id=0))


def tiny_bert():
    """A two-layer BERT with its masked-LM head (``BertForMaskedLM``, tied decoder) from a
    config, dropout off."""
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=CONTEXT, pad_token_id=0,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def token_batch(batch_size: int, rank: int, generator) -> tuple:
    """Random token sequences of the tiny models' context."""
    return (torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=generator),)


def lm_loss(model, batch):
    """The model's own language-model loss with the inputs as labels: a mean over equally many
    tokens per sequence, so the mean over a concatenated batch is the batch-weighted mean of
    the ranks' losses, as data-parallel training averages them."""
    return model(input_ids=batch[0], labels=batch[0]).loss


def hf_gpt2():
    """The tiny GPT-2 as a workload (the trial's SGD)."""
    return sw.define(name="tiny-hf-gpt2", model=tiny_gpt2, batch=token_batch, batch_size=4, family="transformer",
                     loss=lm_loss)


def hf_bert():
    """The tiny BERT as a workload (the trial's SGD)."""
    return sw.define(name="tiny-hf-bert", model=tiny_bert, batch=token_batch, batch_size=4, family="bert",
                     loss=lm_loss)


def workload_of(name: str):
    """A zoo model by name, or ``hf-gpt2`` / ``hf-bert`` (the factories above, by import path)."""
    from synctune.workload import ImportedWorkload, zoo_workload

    if name.startswith("hf-"):
        return ImportedWorkload(f"_checkpoint_workers:{name.replace('-', '_')}", HERE)
    return zoo_workload(name)


def rank_batch(workload, split, rank: int, seed: int = 0) -> tuple:
    """Rank ``rank``'s batch as a trial makes it (once, for every iteration: ``_Arm``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 100_003 + rank)
    return workload.make_batch(split[rank], rank=rank, generator=gen, device=torch.device("cpu"))


def reference_training(workload, split, lr: float, steps: int, dtype=torch.float32, seed: int = 0,
                       checkpoint=()) -> dict:
    """Single-process SGD on the concatenation of every rank's batch, the model built as a trial
    builds it; ``checkpoint``: (module, mode) pairs applied first (none: plain training)."""
    from synctune.engine.checkpoint import apply_checkpointing

    torch.manual_seed(seed)
    model = workload.build_model().to(dtype)
    apply_checkpointing(model, checkpoint)
    parts = [rank_batch(workload, split, r, seed) for r in range(len(split))]
    joined = tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
    joined = tuple(t.to(dtype) if t.is_floating_point() else t for t in joined)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        workload.loss(model, joined).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trial_arm_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case trained on this rank as a trial trains it: the trial's own arm (the model built,
    the runtime's :meth:`~synctune.engine.runtime.Runtime.checkpoint_of` applied to it, then the
    runtime's ``prepare``), ``steps`` iterations on the rank's batch. Returns the whole
    parameters and the modules that ran checkpointed (module -> mode, read from the model)."""
    from synctune.engine.trial import _Arm
    from synctune.strategy import Strategy

    out = []
    for case in cases:
        payload = case["payload"]
        arm = _Arm(rank, payload, Strategy.from_dict(payload["strategy"]), payload["runtime"], torch.device("cpu"))
        for _ in range(case["steps"]):
            arm.iteration()
        model = arm.stepper.forward_model
        params = full_state(model)
        checkpointed = {name: m._synctune_checkpoint for name, m in model.named_modules()
                        if getattr(m, "_synctune_checkpoint", None)}
        arm.close()
        out.append({"params": params, "checkpointed": checkpointed})
    return out

