"""A workload of a library model (a Hugging Face GPT-2 built from a config: tied embeddings,
AdamW) whose distributed iterations hold memory a single-process probe never sees: a scratch
tensor its loss allocates only when a process group is up (as collectives' staging, a
framework's buffers or a user's own distributed code do). The memory model, judging from the
probe, under-predicts every trial by that much until trials teach it."""

import torch

import synctune.workload as sw

VOCAB, CONTEXT, WIDTH = 256, 32, 32


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the loss it computes; unset, transformers warns once per process
    return model


def _batch(batch_size, rank, generator):
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    return ((start + 3 * torch.arange(CONTEXT).unsqueeze(0)) % VOCAB,)


def _loss_hiding(mib: float):
    def loss(model, batch):
        if mib and torch.distributed.is_available() and torch.distributed.is_initialized():
            # Alive until the next iteration's loss replaces it: inside this iteration's peak.
            model.__dict__["_scratch"] = torch.ones(int(mib * 2**20) // 4)
        return model(input_ids=batch[0], labels=batch[0]).loss
    return loss


def _define(name: str, mib: float):
    return sw.define(name=name, model=_model, batch=_batch, batch_size=4, family="transformer",
                     loss=_loss_hiding(mib), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))


def hides_some():
    """1 MiB hidden: more than the memory model's margin under the budget, less than what
    checkpointing saves."""
    return _define("hf-gpt2-hides-1mib", 1.0)


def hides_much():
    """64 MiB hidden: nothing in the search's space fits once a trial shows it."""
    return _define("hf-gpt2-hides-64mib", 64.0)


def plain():
    """Nothing hidden: what the probe sees is what the trials hold."""
    return _define("hf-gpt2-tiny", 0.0)
