"""A small GPT-2 from Hugging Face transformers, built from a config (no weights downloaded):
tied input and output embeddings, AdamW, a synthetic corpus. Its parameters are small beside
what an iteration holds for a batch (the logits over the vocabulary, the attention scores and
their gradients), the shape where activations, not parameters, set a rank's peak."""

import torch

import synctune.workload as sw

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS = 2048, 64, 64, 2, 2


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        bos_token_id=0, eos_token_id=0, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the loss it computes; unset, transformers warns once per process
    return model


def _batch(batch_size, rank, generator):
    # A synthetic corpus: token sequences whose next token is a fixed function of the current one.
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    steps = torch.arange(CONTEXT).unsqueeze(0)
    return ((start + 7 * steps) % VOCAB,)


def _loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss


def workload():
    return sw.define(name="hf-gpt2-small", model=_model, batch=_batch, batch_size=8, family="transformer",
                     loss=_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
