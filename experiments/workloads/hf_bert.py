"""A small BERT for masked language modelling from Hugging Face transformers, built from a config
(no weights downloaded): tied input and output embeddings, AdamW, a synthetic corpus with 15% of
its tokens masked. As with the GPT-2 beside it, an iteration's activations (the logits over the
vocabulary, attention) outweigh the parameters."""

import torch

import synctune.workload as sw

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS = 2048, 64, 64, 2, 2
MASK = 1


def _model():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=4 * WIDTH, max_position_embeddings=CONTEXT, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = BertForMaskedLM(config)
    model.loss_type = "ForMaskedLM"  # the loss it computes; unset, transformers warns once per process
    return model


def _batch(batch_size, rank, generator):
    tokens = torch.randint(2, VOCAB, (batch_size, CONTEXT), generator=generator)
    masked = torch.rand(batch_size, CONTEXT, generator=generator) < 0.15
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    return torch.where(masked, torch.full_like(tokens, MASK), tokens), labels


def _loss(model, batch):
    return model(input_ids=batch[0], labels=batch[1]).loss


def workload():
    return sw.define(name="hf-bert-small", model=_model, batch=_batch, batch_size=8, family="transformer",
                     loss=_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
