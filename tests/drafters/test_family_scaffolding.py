"""The shared family scaffolding in drafters/common, on hand-written inputs: `collate.check_batch`
(every objective's batch check), `DraftContext.features` (every proposer's preamble),
`Proposal.drawn` (one forward, independent slots) and `export_format` (the engine-format base
class, the export directory writer and the checked reader)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from drafters.common.collate import check_batch
from drafters.common.contract import EXPORT_META_FILE, DraftContext, Proposal
from drafters.common.export_format import (
    EngineFormatBase,
    check_export_dir,
    export_meta,
    load_checked,
    recorded_settings,
    write_export,
    written_dtype,
)
from drafters.common.sampling import SamplingParams

REQUIRED = ("input_ids", "loss_mask", "aux_hidden")


def _batch(b: int = 2, t: int = 5, h: int = 3) -> dict[str, Tensor]:
    return {"input_ids": torch.zeros(b, t, dtype=torch.long), "loss_mask": torch.ones(b, t),
            "attention_mask": torch.ones(b, t, dtype=torch.bool), "aux_hidden": torch.zeros(b, t, h)}


def test_check_batch_names_the_missing_field_and_the_wrong_shape() -> None:
    check_batch(_batch(), REQUIRED, "Toy")
    with pytest.raises(KeyError, match=r"Toy batch: missing fields \['aux_hidden'\]"):
        check_batch({k: v for k, v in _batch().items() if k != "aux_hidden"}, REQUIRED, "Toy")
    with pytest.raises(ValueError, match=r"Toy batch: loss_mask is \(2, 4\), expected \(2, 5\)"):
        check_batch({**_batch(), "loss_mask": torch.ones(2, 4)}, REQUIRED, "Toy")
    with pytest.raises(ValueError, match=r"aux_hidden is \(2, 5\), expected \(2, 5, \.\.\.\)"):  # features: 3 dims
        check_batch({**_batch(), "aux_hidden": torch.zeros(2, 5)}, REQUIRED, "Toy")
    with pytest.raises(ValueError, match=r"aux_hidden is \(2, 6, 3\), expected \(2, 5, \.\.\.\)"):
        check_batch({**_batch(), "aux_hidden": torch.zeros(2, 6, 3)}, REQUIRED, "Toy")
    check_batch(_batch(), REQUIRED, "Toy", exact=("document_ids",))  # optional: absent is fine
    with pytest.raises(ValueError, match=r"document_ids is \(2, 5, 1\), expected \(2, 5\)"):
        check_batch({**_batch(), "document_ids": torch.zeros(2, 5, 1)}, REQUIRED, "Toy", exact=("document_ids",))


def test_draft_context_features_concatenates_the_states_of_the_positions_run() -> None:
    states = tuple(torch.full((3, 2), float(i)) for i in range(4))  # 4 hidden states, n = 3 positions, H 2
    ctx = DraftContext(torch.arange(4), states)
    assert torch.equal(ctx.features((1, 3)), torch.tensor([[1.0, 1, 3, 3]] * 3))
    with pytest.raises(ValueError, match="expand: hidden state id 4: the context has 4 hidden states"):
        ctx.features((1, 4), "expand")
    with pytest.raises(ValueError, match="propose: need >= 2 committed tokens .*got 1"):
        DraftContext(torch.arange(1), states).features((1,))
    with pytest.raises(ValueError, match="3 positions, expected 4"):
        DraftContext(torch.arange(5), states).features((1,))


def test_proposal_drawn_is_the_argmax_or_one_draw_per_slot() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [9.0, 0.0, 0.0]])
    greedy = Proposal.drawn(logits, SamplingParams())
    assert greedy.token_ids.tolist() == [1, 0] and greedy.probs is None
    sampled = Proposal.drawn(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.probs is not None
    torch.testing.assert_close(sampled.probs, torch.softmax(logits, -1))


@dataclass(frozen=True)
class _Format(EngineFormatBase):
    width: int
    ids: tuple[int, ...]
    dtype: str = "float32"

    family: ClassVar[str] = "toyfmt"
    label: ClassVar[str] = "ToyFmt"

    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        return {k: v.to(dtype or torch.float32) for k, v in state_dict.items() if k != "frozen"}

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        tensors = self.engine_tensors(state_dict, fmt, kwargs.get("dtype"))
        return write_export(out_dir, tensors, {"width": self.width, "torch_dtype": written_dtype(tensors)},
                            export_meta(self, fmt, kwargs.get("meta"), note="x"))

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"w": (self.width,)}

    def sglang_never_published(self) -> Mapping[str, str]:
        return {}


def test_engine_format_base_round_trip_and_refusals() -> None:
    fmt = _Format(3, (1, 2))
    doc = fmt.to_dict()
    assert doc == {"family": "toyfmt", "width": 3, "ids": [1, 2], "dtype": "float32"}  # tuples as lists: JSON
    assert _Format.from_dict(json.loads(json.dumps(doc))) == _Format(3, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ToyFmt engine format: unknown keys \['depth'\], missing keys \['width'\]"):
        _Format.from_dict({"ids": [1], "depth": 2})
    with pytest.raises(ValueError, match="family 'eagle3', expected 'toyfmt'"):
        _Format.from_dict({**doc, "family": "eagle3"})

    @dataclass(frozen=True)
    class NoTensors(EngineFormatBase):  # a format without engine_tensors: refused at construction, named
        width: int
        family: ClassVar[str] = "toyfmt"
        label: ClassVar[str] = "ToyFmt"

    with pytest.raises(TypeError, match="abstract.*engine_tensors"):
        NoTensors(3)  # type: ignore[abstract]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)


def test_write_check_and_load_an_export_directory(tmp_path: Path) -> None:
    fmt = _Format(3, (1,))
    state = {"w": torch.tensor([1.0, 2.0, 3.0]), "frozen": torch.ones(2)}
    out = fmt.export(state, tmp_path / "x", dtype=torch.bfloat16, meta={"drafter_config": {"k": 1}})
    assert json.loads((out / "config.json").read_text()) == {"width": 3, "torch_dtype": "bfloat16"}
    assert (out / "config.json").read_text().endswith("}\n")
    meta = json.loads((out / EXPORT_META_FILE).read_text())
    assert list(meta) == ["family", "format", "export_config", "engine_format", "note", "drafter_config"]
    assert meta["export_config"] == {"width": 3, "ids": [1], "dtype": "float32"} and recorded_settings(out) == {"k": 1}
    assert recorded_settings(tmp_path) == {}
    assert load_file(str(out / "model.safetensors"))["w"].dtype == torch.bfloat16

    seen: list[str] = []

    def refuse(names: Any, where: str) -> None:
        seen.extend(names)
        if "bad" in seen:
            raise ValueError(f"{where}: tensor 'bad' must not be exported")

    def check(tensors: Mapping[str, Tensor], cfg: _Format, where: str) -> None:
        assert set(tensors) == {"w"} and cfg == fmt

    assert check_export_dir(out, lambda config, where: _Format(config["width"], (1,)), refuse, check) == fmt
    assert seen == ["w"]

    model = load_checked(out, fmt, fmt, _Model, frozen=("frozen",))
    assert torch.equal(model.w.float(), state["w"]) and model.w.dtype == torch.bfloat16 and not model.training
    with pytest.raises(ValueError, match="does not match the target's sizes"):
        load_checked(out, fmt, _Format(4, (1,)), _Model, frozen=("frozen",))
    with pytest.raises(ValueError, match=r"missing \['frozen'\], unexpected \[\]"):
        load_checked(out, fmt, fmt, _Model)
