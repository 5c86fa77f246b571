"""User errors of `verl-speco-draft-train` (the real CLI in a subprocess): one line
`verl-speco-draft-train: error: <field=value: what was expected>` on stderr, exit 2, no traceback,
on the single-process path and on the torchrun path alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, VOCAB, run_failing

from feature_store import Layout, StoreWriter, standard_schema


@pytest.fixture(scope="module")
def other_layout_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid store captured at layers (1, 3, 6): not what EAGLE-3 on the 8-layer target reads."""
    root = tmp_path_factory.mktemp("other") / "store"
    schema = standard_schema(Layout(layer_ids=(1, 3, 6), last_hidden="post_norm"), hidden_size=HIDDEN,
                             vocab_size=VOCAB, target_model_id="tiny-test")
    with StoreWriter(root, schema, rank=0) as w:
        w.add({"input_ids": torch.arange(8), "loss_mask": torch.ones(8, dtype=torch.uint8),
               "aux_hidden": torch.zeros(8, 3 * HIDDEN), "last_hidden": torch.zeros(8, HIDDEN)}, step=0)
    return root


def _base(target: Path, store: Path, out: Path) -> list[str]:
    return [f"target.path={target}", f"data.store={store}", f"run.out_dir={out}", "run.device=cpu",
            "run.total_steps=2", "run.progress_bar=false"]


CASES = {  # name -> (override, substrings the error line must hold; {tmp}, {store} are filled in)
    "unknown_key": ("data.stroe=/x", ["data.stroe", "unknown", "data.store"]),
    "wrong_type": ("optim.lr=fast", ["optim.lr='fast'", "float"]),
    "negative_lr": ("optim.lr=-0.5", ["optim.lr=-0.5", "> 0"]),
    "missing_store": ("data.store={tmp}/nowhere", ["data.store=", "{tmp}/nowhere", "store.json"]),
    "other_layout": ("data.store={other}", ["data.store=", "layer_ids", "1, 3, 6", "2, 4, 5"]),
    "not_a_model": ("target.path={store}", ["target.path=", "{store}", "config.json"]),
    "bad_resume": ("run.resume={tmp}/ckpt/step_9", ["run.resume=", "{tmp}/ckpt/step_9", "checkpoint"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_single_process_user_errors(case: str, tiny_target: Path, tiny_store: Path, other_layout_store: Path,
                                    tmp_path: Path) -> None:
    override, needles = CASES[case]
    fill = {"tmp": str(tmp_path), "store": str(tiny_store), "other": str(other_layout_store)}
    line = run_failing(["--nproc-per-node", "1", *_base(tiny_target, tiny_store, tmp_path / "out"),
                        override.format(**fill)])
    for needle in needles:
        assert needle.format(**fill) in line, (needle, line)


@pytest.mark.parametrize("case", ["wrong_type", "missing_store"])
def test_torchrun_path_reports_the_same_way(case: str, tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    override, needles = CASES[case]
    fill = {"tmp": str(tmp_path)}
    line = run_failing(["--nproc-per-node", "2", *_base(tiny_target, tiny_store, tmp_path / "out"),
                        override.format(**fill)])
    for needle in needles:
        assert needle.format(**fill) in line, (needle, line)
