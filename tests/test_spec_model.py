"""Model spec: validation, plain-data round trip, hashing, extraction from nn.Module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from synctune.spec import ModelSpec, SpecError, VariableSpec, extract_model_spec


def test_variable_spec_sizes_and_round_trip():
    v = VariableSpec(name="w", shape=(3, 4), dtype="float16")
    assert v.num_elements == 12 and v.num_bytes == 24
    assert VariableSpec.from_dict(v.to_dict()) == v


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"name": "w", "shape": (0, 4)}, "variable 'w': shape"),
        ({"name": "w", "shape": (2,), "dtype": "int8"}, "variable 'w': dtype"),
        ({"name": "e", "shape": (10,), "sparse": True}, "sparse variable"),
        ({"name": "", "shape": (2,)}, "variable name"),
    ],
)
def test_variable_spec_rejects_bad_fields(kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        VariableSpec(**kwargs)


def test_model_spec_rejects_duplicates_and_names_unknown_variable():
    a = VariableSpec(name="a", shape=(2,))
    with pytest.raises(SpecError, match="'a' appears twice"):
        ModelSpec(name="m", variables=(a, a))
    spec = ModelSpec(name="m", variables=(a,))
    with pytest.raises(SpecError, match="no variable 'b'"):
        spec["b"]


def test_model_spec_round_trip_and_hash_ignores_name():
    spec = ModelSpec(name="m", variables=(VariableSpec(name="a", shape=(2, 3)),
                                          VariableSpec(name="e", shape=(5, 2), sparse=True)), batch_size=4)
    back = ModelSpec.from_dict(spec.to_dict())
    assert back == spec and back.hash == spec.hash
    renamed = ModelSpec(name="other", variables=spec.variables, batch_size=4)
    assert renamed.hash == spec.hash
    changed = ModelSpec(name="m", variables=spec.variables, batch_size=8)
    assert changed.hash != spec.hash


def test_model_spec_from_dict_names_the_bad_entry():
    with pytest.raises(SpecError, match=r"variables\[1\]: missing key 'shape'"):
        ModelSpec.from_dict({"name": "m", "variables": [{"name": "a", "shape": [1]}, {"name": "b"}]})


class _TwoBranch(nn.Module):
    """The forward uses `late` before `early`: registration order differs from backward order."""

    def __init__(self):
        super().__init__()
        self.early = nn.Linear(4, 4)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.late = nn.Linear(4, 4)

    def forward(self, ids):
        x = self.emb(ids).sum(1)
        return self.early(self.late(x)).sum()


def test_extract_traces_real_backward_order_on_meta():
    with torch.device("meta"):
        module = _TwoBranch()
    spec = extract_model_spec(module, name="two", run_step=lambda m: m(torch.zeros(2, 3, dtype=torch.long, device="meta")))
    names = [v.name for v in spec.variables]
    # Backward reaches `early` (last in forward) first and the embedding last.
    assert names.index("early.weight") < names.index("late.weight") < names.index("emb.weight")
    assert spec["emb.weight"].sparse and not spec["late.weight"].sparse
    assert spec.num_parameters == sum(p.numel() for p in module.parameters())


def test_extract_falls_back_to_reverse_registration_order():
    with torch.device("meta"):
        module = _TwoBranch()
    spec = extract_model_spec(module, name="two")
    assert [v.name for v in spec.variables] == [n for n, _ in reversed(list(module.named_parameters()))]


def test_extract_rejects_module_without_parameters():
    with pytest.raises(SpecError, match="no trainable parameters"):
        extract_model_spec(nn.ReLU(), name="relu")
