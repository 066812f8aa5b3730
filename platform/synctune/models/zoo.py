"""The model zoo: the papers' benchmark models and small variants that train in seconds on a CPU.

Every entry builds an ``nn.Module`` whose ``forward(*batch)`` returns a scalar mean loss, and
makes synthetic batches of the right shapes (the engine times synchronization, not data
loading). Parameter counts are checked in the tests: against the published figure where a paper
or model card gives one (``source`` cites it), else exactly against a count of ours computed
from the architecture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from ..spec.model import ModelSpec, extract_model_spec
from ..spec.registry import Registry

__all__ = ["ZooEntry", "MODELS", "get_model", "model_spec", "build_model", "make_batch"]


@dataclass(frozen=True, kw_only=True)
class ZooEntry:
    """A zoo model: how to build it, how to make a batch, and its expected size.

    ``expected_params`` is, with ``published`` true, the count a paper or model card gives
    (``source`` cites it); with ``published`` false, a count of ours computed from the
    architecture, for models no paper gives a count for (bert-6l, the small variants).
    """

    name: str
    family: str
    build: Callable[[], Any]
    batch: Callable[[int, Any, Any], tuple]
    batch_size: int
    expected_params: int
    source: str
    published: bool = True
    small: bool = False
    description: str = ""


MODELS: Registry[ZooEntry] = Registry("model")


def _images(classes: int, size: int):
    def make(n: int, generator, device) -> tuple:
        import torch

        images = torch.randn(n, 3, size, size, generator=generator, device=device)
        labels = torch.randint(0, classes, (n,), generator=generator, device=device)
        return images, labels

    return make


def _bert_batch(vocab: int, seq: int):
    def make(n: int, generator, device) -> tuple:
        import torch

        tokens = torch.randint(0, vocab, (n, seq), generator=generator, device=device)
        segments = torch.randint(0, 2, (n, seq), generator=generator, device=device)
        mlm = torch.randint(0, vocab, (n, seq), generator=generator, device=device)
        nsp = torch.randint(0, 2, (n,), generator=generator, device=device)
        return tokens, segments, mlm, nsp

    return make


def _seq2seq_batch(vocab: int, src_len: int, tgt_len: int):
    def make(n: int, generator, device) -> tuple:
        import torch

        src = torch.randint(0, vocab, (n, src_len), generator=generator, device=device)
        tgt = torch.randint(0, vocab, (n, tgt_len + 1), generator=generator, device=device)
        return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()

    return make


def _ncf_batch(users: int, items: int):
    def make(n: int, generator, device) -> tuple:
        import torch

        u = torch.randint(0, users, (n,), generator=generator, device=device)
        i = torch.randint(0, items, (n,), generator=generator, device=device)
        labels = torch.randint(0, 2, (n,), generator=generator, device=device).float()
        return u, i, labels

    return make


def _lm_batch(vocab: int, steps: int, samples: int):
    def make(n: int, generator, device) -> tuple:
        import torch

        inputs = torch.randint(0, vocab, (n, steps), generator=generator, device=device)
        targets = torch.randint(0, vocab, (n, steps), generator=generator, device=device)
        negatives = torch.randint(0, vocab, (n, samples), generator=generator, device=device)
        return inputs, targets, negatives

    return make


def _lazy(path: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A builder that imports ``synctune.models.<module>`` (and so torch) only when called."""

    def build():
        import importlib

        module, cls = path.rsplit(".", 1)
        return getattr(importlib.import_module(f"synctune.models.{module}"), cls)(*args, **kwargs)

    return build


def _bert(layers: int, hidden: int, heads: int, inner: int, vocab: int = 30522):
    return _lazy("transformer.BertPretraining", layers=layers, hidden=hidden, heads=heads, inner=inner, vocab=vocab)


def _bert_count(layers: int, hidden: int, inner: int, vocab: int = 30522, positions: int = 512) -> int:
    """Parameters of BERT pre-training from its configuration (the formula the tests hold the zoo to)."""
    emb = (vocab + positions + 2) * hidden + 2 * hidden
    layer = 4 * (hidden * hidden + hidden) + 2 * hidden + (hidden * inner + inner) + (inner * hidden + hidden) + 2 * hidden
    heads = (hidden * hidden + hidden) + (hidden * hidden + hidden) + 2 * hidden + vocab + (2 * hidden + 2)
    return emb + layers * layer + heads


def _transformer_count(vocab: int, hidden: int, inner: int, layers: int) -> int:
    """Parameters of the tied-embedding Transformer from its configuration."""
    attention = 4 * (hidden * hidden + hidden)
    ffn = hidden * inner + inner + inner * hidden + hidden
    encoder = attention + ffn + 2 * 2 * hidden
    decoder = 2 * attention + ffn + 3 * 2 * hidden
    return vocab * hidden + layers * (encoder + decoder)


def _register(**kw: Any) -> None:
    MODELS.register(kw["name"], ZooEntry(**kw))


# Papers' benchmark models (AutoDist §3 and Appendix E; AutoSync §4).
_register(name="ncf-dense", family="ncf", batch_size=1024, expected_params=122_000_000,
          source="AutoDist (Zhang et al. 2020) §3.3 and AutoSync (Zhang et al. 2021) §4: NCF-dense, 122M",
          description="NeuMF on MovieLens-20M shapes (138,493 users, 26,744 items), GMF 224 + MLP 1024-512-256-128, "
                      "dense embedding gradients",
          build=_lazy("recsys.NeuMF",
              num_users=138_493, num_items=26_744, mf_dim=224, layers=(1024, 512, 256, 128), sparse=False),
          batch=_ncf_batch(138_493, 26_744))
_register(name="vgg16", family="cnn", batch_size=32, expected_params=138_357_544,
          source="Simonyan & Zisserman 2015, Table 2: configuration D, 138M; 138,357,544 in torchvision's vgg16 "
                 "model card",
          description="VGG-16, 224x224 images, 1000 classes",
          build=_lazy("cnn.VGG16"),
          batch=_images(1000, 224))
_register(name="resnet50", family="cnn", batch_size=32, expected_params=25_557_032,
          source="torchvision's resnet50 model card: 25,557,032 (He et al. 2016, Table 1, define it without a "
                 "count)", description="ResNet-50, 224x224 images",
          build=_lazy("cnn.ResNet", (3, 4, 6, 3)),
          batch=_images(1000, 224))
_register(name="resnet101", family="cnn", batch_size=32, expected_params=44_549_160,
          source="torchvision's resnet101 model card: 44,549,160 (He et al. 2016, Table 1, define it without a "
                 "count)", description="ResNet-101, 224x224 images",
          build=_lazy("cnn.ResNet", (3, 4, 23, 3)),
          batch=_images(1000, 224))
_register(name="densenet121", family="cnn", batch_size=32, expected_params=7_978_856,
          source="torchvision's densenet121 model card: 7,978,856 (Huang et al. 2017, Table 1, define it "
                 "without a count)", description="DenseNet-121, growth 32, 224x224 images",
          build=_lazy("cnn.DenseNet121"),
          batch=_images(1000, 224))
_register(name="inceptionv3", family="cnn", batch_size=32, expected_params=23_851_784,
          source="Keras Applications' InceptionV3: 23.9M, no auxiliary head (Szegedy et al. 2016 define it)",
          description="Inception-v3 without the auxiliary classifier, 299x299 images",
          build=_lazy("cnn.InceptionV3"),
          batch=_images(1000, 299))
_register(name="bert-3l", family="bert", batch_size=32, expected_params=11_000_000,
          source="AutoDist (Zhang et al. 2020) §3.2: BERT-3L, 11M; width of BERT-Mini (H=256, 4 heads) with a "
                 "32k vocabulary",
          description="BERT pre-training, 3 layers, hidden 256, 4 heads, FFN 1024, vocab 32,000, seq 128",
          build=_bert(3, 256, 4, 1024, vocab=32_000), batch=_bert_batch(32_000, 128))
_register(name="bert-6l", family="bert", batch_size=16, expected_params=_bert_count(6, 768, 3072),
          published=False,
          source="ours: no published count (AutoDist §3.2 names BERT-6L without one); BERT-base truncated to "
                 "6 layers, counted from that configuration",
          description="BERT pre-training, 6 layers, hidden 768, 12 heads, seq 128",
          build=_bert(6, 768, 12, 3072), batch=_bert_batch(30522, 128))
_register(name="bert-base", family="bert", batch_size=16, expected_params=110_000_000,
          source="Devlin et al. 2019, §3: BERT-base, total parameters 110M",
          description="BERT pre-training, 12 layers, hidden 768, 12 heads, seq 128",
          build=_bert(12, 768, 12, 3072), batch=_bert_batch(30522, 128))
_register(name="bert-large", family="bert", batch_size=8, expected_params=340_000_000,
          source="Devlin et al. 2019, §3: BERT-large, total parameters 340M; AutoDist §3.3 (batch 8 per GPU)",
          description="BERT pre-training, 24 layers, hidden 1024, 16 heads, seq 128",
          build=_bert(24, 1024, 16, 4096), batch=_bert_batch(30522, 128))
_register(name="transformer", family="transformer", batch_size=32, expected_params=65_000_000,
          source="Vaswani et al. 2017, Table 3: base, 65M; a shared 40k vocabulary (37k gives 63.1M)",
          description="Transformer base: 6+6 layers, d_model 512, 8 heads, FFN 2048, tied 40k embedding, seq 64",
          build=_lazy("transformer.TransformerSeq2Seq",
              vocab=40_000, hidden=512, heads=8, inner=2048, layers=6),
          batch=_seq2seq_batch(40_000, 64, 64))
_register(name="lm1b", family="lm", batch_size=128, expected_params=830_000_000,
          source="Jozefowicz et al. 2016, Table 1: LSTM-2048-512, 0.83B; AutoDist's LM1B benchmark",
          description="LSTM-2048-512 on the 793,471-word LM1B vocabulary, 20 steps, sampled softmax "
                      "(64 negatives per sequence), sparse embedding and softmax gradients",
          build=_lazy("recsys.LSTMLanguageModel",
              vocab=793_471, embedding=512, state=2048, projection=512),
          batch=_lm_batch(793_471, 20, 64))

# Small variants: one per family, seconds per step on 2 CPU cores.
_register(name="bert-tiny", family="bert", batch_size=8, expected_params=4_400_000, small=True,
          source="Turc et al. 2019 (arXiv:1908.08962): BERT-Tiny (L=2, H=128), 4.4M",
          description="BERT pre-training, 2 layers, hidden 128, 2 heads, seq 32",
          build=_bert(2, 128, 2, 512), batch=_bert_batch(30522, 32))
_register(name="cnn-small", family="cnn", batch_size=16, expected_params=(3 * 16 * 9 + 16) + 32 + (16 * 32 * 9 + 32) + 64 + (32 * 64 * 9 + 64) + (64 * 10 + 10),
          small=True,
          published=False, source="ours: no published count; counted from its layers",
          description="4-layer CNN with GroupNorm, 32x32 images, 10 classes",
          build=_lazy("cnn.SmallCNN"),
          batch=_images(10, 32))
_register(name="ncf-small", family="ncf", batch_size=64, expected_params=3000 * 24 + (32 * 16 + 16) + (16 * 8 + 8) + (16 + 1), small=True,
          published=False, source="ours: no published count; counted from its layers",
          description="NeuMF, 2,000 users, 1,000 items, GMF 8 + MLP 32-16-8, sparse embedding gradients",
          build=_lazy("recsys.NeuMF",
              num_users=2000, num_items=1000, mf_dim=8, layers=(32, 16, 8), sparse=True),
          batch=_ncf_batch(2000, 1000))
_register(name="lm-small", family="lm", batch_size=8, expected_params=2000 * 32 * 2 + 2000 + 64 * 256 + 256 + 64 * 32,
          small=True, published=False, source="ours: no published count; counted from its layers",
          description="LSTM-64-32, 2,000-word vocabulary, 8 steps, 8 negatives per sequence, sparse gradients",
          build=_lazy("recsys.LSTMLanguageModel",
              vocab=2000, embedding=32, state=64, projection=32),
          batch=_lm_batch(2000, 8, 8))
_register(name="transformer-small", family="transformer", batch_size=8, expected_params=_transformer_count(1000, 64, 128, 2), small=True,
          published=False, source="ours: no published count; counted from its layers",
          description="Transformer 2+2 layers, d_model 64, 2 heads, FFN 128, 1,000-word vocabulary, seq 16",
          build=_lazy("transformer.TransformerSeq2Seq",
              vocab=1000, hidden=64, heads=2, inner=128, layers=2),
          batch=_seq2seq_batch(1000, 16, 16))


def get_model(name: str) -> ZooEntry:
    """The zoo entry called ``name``; the error lists the valid names."""
    return MODELS.get(name)


def build_model(name: str, device: Any = None):
    """Instantiate zoo model ``name`` (on ``device``; ``"meta"`` costs no memory)."""
    import torch

    entry = MODELS.get(name)
    with torch.device(device or "cpu"):
        return entry.build()


def make_batch(name: str, batch_size: int, *, generator: Any = None, device: Any = None) -> tuple:
    """A synthetic batch for zoo model ``name``: the positional arguments of its ``forward``."""
    return MODELS.get(name).batch(batch_size, generator, device or "cpu")


@functools.lru_cache(maxsize=None)
def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of zoo model ``name``, variables in true backward order.

    The model is built on the meta device and one forward/backward pass is traced there with
    gradient hooks, so the order is what the engine's hooks see, at no memory cost.
    """
    entry = MODELS.get(name)
    module = build_model(name, device="meta")

    def run_step(m):
        return m(*entry.batch(2, None, "meta"))

    return extract_model_spec(module, name=name, batch_size=entry.batch_size, family=entry.family, run_step=run_step,
                              step_batch=2)
