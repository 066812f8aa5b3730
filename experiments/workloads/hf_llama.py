"""A small Llama for causal language modelling from Hugging Face transformers, built from a config
(no weights downloaded): RMSNorm, rotary positions, a gated MLP, grouped key-value heads, AdamW,
a synthetic corpus. Its attention reshapes heads by their size, so torch's tensor parallelism
splits its projections as torchtitan splits Llama's."""

import torch

import synctune.workload as sw

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, KV_HEADS = 2048, 64, 128, 2, 4, 2


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
                         use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # the loss it computes; unset, transformers warns once per process
    return model


def _batch(batch_size, rank, generator):
    return (torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=generator),)


def _loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss


def workload():
    return sw.define(name="hf-llama-small", model=_model, batch=_batch, batch_size=8, family="transformer",
                     loss=_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
