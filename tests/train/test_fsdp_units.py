"""Which submodules the trainer shards with FSDP2 (`apply_fsdp` units): maximal all-trainable
submodules, and the members of a ModuleList/ModuleDict (FSDP2 cannot wrap a container without a forward)."""

from __future__ import annotations

from torch import nn

from verl_speco.train.distributed import _shard_units


class _Draft(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4).requires_grad_(False)  # frozen target piece
        self.fc = nn.Linear(8, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2)})


def test_units_are_trainable_modules_and_container_members() -> None:
    model = _Draft()
    units = _shard_units(model)
    assert units == [model.fc, model.layers[0], model.layers[1], model.heads["a"]]
    assert not any(isinstance(u, nn.ModuleList | nn.ModuleDict) for u in units)


def test_a_partly_frozen_container_is_split_further() -> None:
    model = _Draft()
    model.layers[1].weight.requires_grad_(False)
    units = _shard_units(model)
    assert model.layers[0] in units and model.layers[1] not in units


class _Holder(nn.Module):
    """No forward of its own: its pieces are called by other methods (as DSpark's Markov head)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Embedding(10, 4)
        self.w2 = nn.Linear(4, 10, bias=False)

    def bias(self, ids):  # type: ignore[no-untyped-def]
        return self.w2(self.w1(ids))


def test_a_module_without_forward_gives_its_members_and_an_all_trainable_root_is_split() -> None:
    # FSDP2 gathers a unit's parameters around its forward only: a forward-less holder reached through
    # `bias` would compute with the shards, so its members are the units; an all-trainable root is split
    # too (the chunked loss calls head units after the root's forward)
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.head = _Holder()

    root = Root()
    assert _shard_units(root) == [root.fc, root.head.w1, root.head.w2]
