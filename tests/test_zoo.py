"""The model zoo: parameter counts against the published figures (our own where none is
published); small models train on a CPU."""

from __future__ import annotations

import pytest
import torch

from synctune.models import MODELS, build_model, get_model, make_batch

PAPER_COUNTS = {
    # Published figures, independent of the zoo's own table; where each is printed.
    "vgg16": 138_000_000,  # Simonyan & Zisserman 2015, Table 2, configuration D
    "resnet50": 25_600_000,  # torchvision model card (25,557,032); He et al. 2016 give no count
    "resnet101": 44_500_000,  # torchvision model card (44,549,160)
    "densenet121": 8_000_000,  # torchvision model card (7,978,856); Huang et al. 2017 give no count
    "inceptionv3": 23_900_000,  # Keras Applications' table
    "bert-base": 110_000_000,  # Devlin et al. 2019, §3
    "bert-large": 340_000_000,  # Devlin et al. 2019, §3
    "bert-3l": 11_000_000,  # AutoDist §3.2
    "bert-tiny": 4_400_000,  # Turc et al. 2019
    "ncf-dense": 122_000_000,  # AutoDist §3.3, AutoSync §4
    "transformer": 65_000_000,  # Vaswani et al. 2017, Table 3 (base)
    "lm1b": 830_000_000,  # Jozefowicz et al. 2016, Table 1 (LSTM-2048-512)
}


@pytest.mark.parametrize("name", list(PAPER_COUNTS))
def test_parameter_count_within_two_percent_of_published(name, zoo_specs):
    entry = get_model(name)
    count = zoo_specs[name].num_parameters
    assert entry.published, (name, entry.source)
    assert abs(count / PAPER_COUNTS[name] - 1) <= 0.02, (name, count, PAPER_COUNTS[name])
    assert abs(count / entry.expected_params - 1) <= 0.02, (name, count, entry.expected_params)


@pytest.mark.parametrize("name", [name for name in MODELS if name not in PAPER_COUNTS])
def test_a_count_of_ours_is_the_architecture_exactly(name, zoo_specs):
    """No paper gives these models' sizes: the zoo's figure is ours, computed from the layers it
    says the model has, and the built model must have exactly that many parameters."""
    entry = get_model(name)
    assert not entry.published and entry.source.startswith("ours:"), (name, entry.source)
    assert zoo_specs[name].num_parameters == entry.expected_params


def test_sparse_variables_where_the_papers_have_them(zoo_specs):
    assert {v.name for v in zoo_specs["lm1b"].variables if v.sparse} == {
        "embedding.weight", "softmax_w.weight", "softmax_b.weight"}
    assert zoo_specs["ncf-small"].num_sparse == 2
    assert zoo_specs["ncf-dense"].num_sparse == 0
    assert len(zoo_specs["ncf-dense"].variables) == 10  # "a 10-variable model" (AutoDist §3.3)


def test_every_model_has_a_small_variant_family():
    small = {e.family for _, e in MODELS.items() if e.small}
    assert {"bert", "cnn", "ncf", "lm", "transformer"} <= small


@pytest.mark.parametrize("name", [n for n, e in MODELS.items() if e.small])
def test_small_models_train_on_cpu(name):
    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(name, get_model(name).batch_size, generator=gen)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses  # fitting one fixed batch must make progress


def test_sparse_models_really_produce_sparse_gradients():
    model = build_model("ncf-small")
    model(*make_batch("ncf-small", 4, generator=torch.Generator().manual_seed(0))).backward()
    assert model.user_embedding.weight.grad.is_sparse
    assert not model.output.weight.grad.is_sparse


def test_zoo_workloads_record_the_rows_a_batch_touches():
    """A zoo model's sparse embeddings carry the distinct rows one batch of the model's size
    reads (the simulator's sparse message size), counted here from the batch itself."""
    import torch

    from synctune.models import make_batch
    from synctune.workload import zoo_workload

    spec = zoo_workload("ncf-small").spec()
    users, items = make_batch("ncf-small", spec.batch_size, generator=torch.Generator().manual_seed(0),
                              device="cpu")[:2]
    rows = dict(zip([v.name for v in spec.variables], spec.touched_rows))
    sparse = [v.name for v in spec.variables if v.sparse]
    assert sorted(rows[n] for n in sparse) == sorted([len(torch.unique(users)), len(torch.unique(items))])
    assert all(rows[v.name] is None for v in spec.variables if not v.sparse)
    assert zoo_workload("cnn-small").spec().touched_rows is None  # no sparse variable
