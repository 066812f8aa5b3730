"""A small Vision Transformer for image classification from Hugging Face transformers, built from a
config (no weights downloaded): 32x32 images in 4x4 patches, AdamW, synthetic images labelled by
a fixed random teacher. A vision model whose blocks' activations (64 patches of each image
through attention and MLP) set the peak."""

import torch
import torch.nn.functional as F

import synctune.workload as sw

SIZE, PATCH, WIDTH, LAYERS, HEADS, CLASSES = 32, 4, 64, 4, 2, 10


def _model():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=SIZE, patch_size=PATCH, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, intermediate_size=4 * WIDTH, num_labels=CLASSES,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def _batch(batch_size, rank, generator):
    images = torch.randn(batch_size, 3, SIZE, SIZE, generator=generator)
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(3 * SIZE * SIZE, CLASSES, generator=teacher)
    return images, (images.flatten(1) @ w).argmax(1)


def _loss(model, batch):
    return F.cross_entropy(model(pixel_values=batch[0]).logits, batch[1])


def workload():
    return sw.define(name="hf-vit-small", model=_model, batch=_batch, batch_size=16, family="vision",
                     loss=_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
