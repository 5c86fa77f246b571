"""An eighth family built from docs/adding-a-family.md alone, in a package of its own, through the contract test.

The toy family (`toy`): a one-hidden-layer MLP over the target's post-norm last hidden state, EAGLE-1's
feature recurrence without attention: row t pairs embed(x_{t+1}) with the feature f_t and predicts
f^_{t+1} = f_t + fc2(silu(fc1([embed(x_{t+1}); f_t]))); draft logits = the frozen target head of f^.
Its package is written under tmp_path, one file per checklist step (`SOURCES`, the steps' numbers in
each docstring), wired in family.py (`WIRING`), and registered the two ways step 8 gives: an entry
point in the group `verl_speco_drafters` (a `.dist-info` next to the package, what installing a
package with that pyproject.toml table writes) and `register_family` in the process.

Asserted:
- the registry finds the toy through its entry point, checks it (`contract_gaps` empty) and lists it;
- every function of tests/drafters/test_family_contract.py (the contract test, imported, not copied)
  passes on it, through `get_family("toy")`: finite gradients and micro-batch additivity, an exact
  export round trip, engine tensors equal to the exported file, a lossless reference decoder (greedy
  and sampling); a contract function added later fails `test_every_contract_check_runs_on_the_toy`
  until this file runs it too;
- skipping a step is reported: a package without one role (e.g. no export.py) is refused by
  `get_family` naming what it lacks, and a family never registered is unknown.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import test_family_contract as contract
import torch

from drafters.common.contract import contract_gaps
from drafters.common.family_base import DrafterFamilyBase
from drafters.registry import (
    CATALOG,
    ENTRY_POINT_GROUP,
    CatalogEntry,
    FamilyContractError,
    UnknownFamilyError,
    available_families,
    get_family,
    known_families,
    register_family,
    training_families,
    unregister_family,
)

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("config", "model", "objective", "export", "proposer")  # checklist steps 1-5, one file each

SOURCES: dict[str, str] = {
    "config": '''
"""Step 1: the toy drafter's settings."""
from __future__ import annotations

from dataclasses import dataclass, replace

from drafters.common.target import TargetSpec


@dataclass(frozen=True)
class ToyConfig:
    """hidden: the MLP's width (None: twice the target's hidden size); soft_weight: the loss weight
    (a training-only choice)."""

    hidden: int | None = None
    soft_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"hidden: got {self.hidden}, expected None or >= 1")
        if not self.soft_weight > 0:
            raise ValueError(f"soft_weight: got {self.soft_weight}, expected > 0")

    def resolve(self, target_spec: TargetSpec) -> ToyConfig:
        return replace(self, hidden=self.hidden if self.hidden is not None else 2 * target_spec.hidden_size)
''',
    "model": '''
"""Step 2: the draft module. Row t: x_{t+1} [..] and f_t [.., H] -> f^_{t+1} [.., H]."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from drafters.common.target import TargetHead


class ToyModel(nn.Module):
    target_lm_head: Tensor

    def __init__(self, cfg, target: TargetHead):
        super().__init__()
        self.cfg, self.spec = cfg.resolve(target.spec), target.spec
        h = self.spec.hidden_size
        self.embed_tokens = nn.Embedding(self.spec.vocab_size, h)  # the target's, frozen
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("target_lm_head", target.lm_head.detach().clone(), persistent=False)
        self.fc1 = nn.Linear(2 * h, self.cfg.hidden)
        self.fc2 = nn.Linear(self.cfg.hidden, h)

    def forward(self, token_ids: Tensor, features: Tensor) -> Tensor:
        x = torch.cat([self.embed_tokens(token_ids), features.to(self.fc1.weight.dtype)], dim=-1)
        return features + self.fc2(torch.nn.functional.silu(self.fc1(x)))

    def logits(self, feature: Tensor) -> Tensor:
        return feature.to(self.target_lm_head.dtype) @ self.target_lm_head.T  # [.., V]
''',
    "objective": '''
"""Step 3: soft cross-entropy through the frozen head, as sums.

Row t (EAGLE-1's layout): input (x_{t+1}, f_t), target distribution softmax(head(f_{t+1})), row mask
loss_mask[t] & real(t) & real(t + 1). Example: tokens [x0, x1, x2], loss_mask [0, 1, 1] -> rows
(x1, f0) masked, (x2, f1) scored against head(f2), row 2 masked (no f3)."""
from __future__ import annotations

import torch
from torch import Tensor

from drafters.common.collate import check_batch
from drafters.common.losses import ObjectiveOutput
from drafters.common.masks import shift_left

REQUIRED_FIELDS = ("input_ids", "loss_mask", "last_hidden")


def toy_objective(model, batch: dict[str, Tensor]) -> ObjectiveOutput:
    check_batch(batch, REQUIRED_FIELDS, "Toy")
    real = batch["attention_mask"].to(torch.bool)  # [B, T]
    features = batch["last_hidden"]  # [B, T, H]
    rows = batch["loss_mask"].to(torch.bool) & real & shift_left(real, 1, fill=False)
    predicted = model(shift_left(batch["input_ids"].long(), 1), features)  # [B, T, H]
    b, t = rows.nonzero(as_tuple=True)
    draft = model.logits(predicted[b, t]).float()  # [N, V]
    target = model.logits(shift_left(features, 1)[b, t]).float().detach()
    ce = -(target.softmax(-1) * draft.log_softmax(-1)).sum(-1)  # [N]
    count = torch.tensor(float(b.numel()))
    hits = (draft.argmax(-1) == target.argmax(-1)).sum().float()
    return ObjectiveOutput(ce.sum()[None], count[None], torch.tensor([model.cfg.soft_weight]),
                           {"acc": (hits.detach(), count)})
''',
    "export": '''
"""Step 4: the engine format, the export and its reader (one format, "native")."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from drafters.common.engine_args import check_format
from drafters.common.export_format import EngineFormatBase, export_meta, write_export, written_dtype
from drafters.registry import engine_method

FORMATS = ("native",)
FROZEN = ("embed_tokens.weight",)  # the target's embedding: never exported


@dataclass(frozen=True)
class ToyExportConfig(EngineFormatBase):
    """to_dict / from_dict and the engine arguments are the base's (the toy has no engine method yet:
    they raise naming it)."""

    hidden_size: int
    vocab_size: int
    mlp_hidden: int
    dtype: str = "float32"

    family: ClassVar[str] = "{name}"
    label: ClassVar[str] = "Toy"

    @classmethod
    def from_drafter(cls, cfg: Any, spec: Any) -> ToyExportConfig:
        return cls(spec.hidden_size, spec.vocab_size, cfg.resolve(spec).hidden)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, m = self.hidden_size, self.mlp_hidden
        return {{"fc1.weight": (m, 2 * h), "fc1.bias": (m,), "fc2.weight": (h, m), "fc2.bias": (h,)}}

    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        check_format(fmt, FORMATS)
        cast = dtype or getattr(torch, self.dtype)
        out = {{k: v.detach().to("cpu", cast).contiguous() for k, v in state_dict.items() if k not in FROZEN}}
        got = {{k: tuple(v.shape) for k, v in out.items()}}
        if got != self.shapes():
            raise ValueError(f"toy state dict: tensors {{got}}, expected {{self.shapes()}}")
        return out

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               dtype: torch.dtype | None = None, meta: Mapping[str, Any] | None = None) -> Path:
        tensors = self.engine_tensors(state_dict, fmt, dtype)
        config = {{"architectures": ["ToyMLPDrafter"], **asdict(self), "torch_dtype": written_dtype(tensors)}}
        return write_export(out_dir, tensors, config, export_meta(self, fmt, meta))

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        engine_method(self.family, "sglang")
        return self.shapes()

    def sglang_never_published(self) -> Mapping[str, str]:
        return {{"embed_tokens.weight": "the target's embedding"}}


def export(model: Any, cfg: Any, spec: Any, out_dir: str | Path, fmt: str = "native", **kwargs: Any) -> Path:
    meta = {{"drafter_config": asdict(cfg), **dict(kwargs.pop("meta", None) or {{}})}}
    return ToyExportConfig.from_drafter(cfg, spec).export(model.state_dict(), out_dir, fmt, meta=meta, **kwargs)


def read_config(export_dir: str | Path) -> ToyExportConfig:
    """The export config an export's config.json records."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    return ToyExportConfig(**{{k: config[k] for k in ("hidden_size", "vocab_size", "mlp_hidden", "dtype")}})
''',
    "proposer": '''
"""Step 5: chain drafting. d_i from f^ = model(d_{i-1}, previous feature), starting at (x_n, f_{n-1})."""
from __future__ import annotations

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.sampling import ChainDraws, SamplingParams


class ToyProposer:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        features = ctx.features((len(ctx.target_hidden_states) - 1,))  # [n, H]: post-norm last hidden
        token, feature = ctx.token_ids[-1], features[-1]
        draws = ChainDraws(sampling, generator)
        for _ in range(num_tokens):
            feature = self.model(token.view(1), feature[None])[0]
            token = draws.draw(self.model.logits(feature).float())
        return Proposal(*draws.stacked())
''',
}

# role -> (family.py imports, class attributes, methods): step 6 wires each role
WIRING: dict[str, tuple[str, str, str]] = {
    "config": ("from {pkg}.config import ToyConfig", "    config_cls = ToyConfig", ""),
    "model": ("from {pkg}.model import ToyModel", "    model_cls = ToyModel", ""),
    "objective": ("from {pkg}.objective import REQUIRED_FIELDS, toy_objective", "    required = REQUIRED_FIELDS", '''
    def required_layout(self, cfg, target_spec):
        return Layout(layer_ids=(), last_hidden="post_norm")

    def objective(self, model, batch, progress=0.0):
        return toy_objective(self._as_model(model), batch)
'''),
    "export": ("from drafters.common.export_format import load_checked, recorded_settings\n"
               "from {pkg}.export import FROZEN, ToyExportConfig, read_config\nfrom {pkg}.export import export as export_model",
               "    export_cls = ToyExportConfig", '''
    def export(self, model, cfg, target_spec, out_dir, fmt="native", **kwargs):
        return export_model(self._as_model(model), cfg, target_spec, out_dir, fmt, **kwargs)

    def load_export(self, export_dir, target):
        cfg = self.config_cls(**recorded_settings(export_dir))
        want = ToyExportConfig.from_drafter(cfg, target.spec)
        return load_checked(export_dir, read_config(export_dir), want, lambda: self.build(cfg, target), frozen=FROZEN)
'''),
    "proposer": ("from {pkg}.proposer import ToyProposer", "    proposer_cls = ToyProposer", ""),
}

FAMILY_PY = '''"""Step 6: the {name} family object."""
from __future__ import annotations

from drafters.common.family_base import DrafterFamilyBase
from feature_store import Layout
{imports}


class ToyFamily(DrafterFamilyBase):
    name = "{name}"
    label = "Toy"
    mutable_settings = ("soft_weight",)
{attrs}
{methods}

FAMILY = ToyFamily()
'''

CATALOG_PY = '''"""Step 8: the catalog entry (a light module: the entry point imports it at the first lookup)."""
from drafters.registry import CatalogEntry

ENTRY = CatalogEntry("{name}", "Toy: a one-layer MLP over the last hidden", "{pkg}.family:FAMILY", ())
'''


def write_family(root: Path, pkg: str, name: str, skip: frozenset[str] = frozenset()) -> Path:
    """The package `pkg` of family `name` under `root`, every checklist step but those in `skip`."""
    out = root / pkg
    out.mkdir(parents=True)
    (out / "__init__.py").write_text(f'"""Step 7: the {name} drafter family (family object: {pkg}.family.FAMILY)."""\n')
    for role in ROLES:
        if role not in skip:
            source = SOURCES[role].format(name=name) if role == "export" else SOURCES[role]
            (out / f"{role}.py").write_text(source.lstrip())
    wired = [WIRING[r] for r in ROLES if r not in skip]
    (out / "family.py").write_text(FAMILY_PY.format(
        name=name, imports="\n".join(w[0] for w in wired).format(pkg=pkg),
        attrs="\n".join(w[1] for w in wired), methods="".join(w[2] for w in wired)))
    if "register" not in skip:
        (out / "catalog.py").write_text(CATALOG_PY.format(name=name, pkg=pkg))
    return out


def write_entry_point(root: Path, pkg: str, name: str) -> None:
    """What installing `pkg` with `[project.entry-points.verl_speco_drafters] name = "pkg.catalog:ENTRY"` writes."""
    info = root / f"{pkg}-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {pkg}.catalog:ENTRY\n")


@contextmanager
def on_path(root: Path, pkg: str) -> Iterator[None]:
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(root))
        importlib.invalidate_caches()
        for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[mod]


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The complete toy package, registered by its entry point; the family name."""
    root = tmp_path_factory.mktemp("toy_site")
    write_family(root, "toyfam", "toy")
    write_entry_point(root, "toyfam", "toy")
    with on_path(root, "toyfam"):
        try:
            yield "toy"
        finally:
            if "toy" in CATALOG:
                unregister_family("toy")


def test_the_checklist_names_every_step() -> None:
    doc = (ROOT / "docs" / "adding-a-family.md").read_text()
    for piece in (*(f"{r}.py" for r in ROLES), "family.py", "__init__.py", "DrafterFamilyBase", "drafters/registry.py",
                  "check_batch", "EngineFormatBase", "write_export", "load_checked", "ctx.features",
                  ENTRY_POINT_GROUP, "register_family", "configs/drafter/<name>.yaml", "test_family_contract.py"):
        assert piece in doc, piece


def test_the_registry_finds_the_toy_through_its_entry_point(toy: str) -> None:
    family = get_family(toy)  # not a built-in: found by its entry point
    assert isinstance(family, DrafterFamilyBase) and family.name == toy and contract_gaps(family) == []
    assert toy in available_families() and CATALOG[toy].import_path == "toyfam.family:FAMILY"
    assert get_family(toy) is family  # checked once


CONTRACT_BY_NAME: tuple[Callable[..., None], ...] = (contract.test_objective_runs_and_gives_finite_gradients,
                                                     contract.test_reference_decoder_is_lossless_sampling)
CONTRACT_ON_TRAINED: tuple[Callable[..., None], ...] = (contract.test_export_load_export_round_trip_is_exact,
                                                        contract.test_engine_tensors_equal_the_exported_file,
                                                        contract.test_reference_decoder_is_lossless_greedy)


def test_every_contract_check_runs_on_the_toy() -> None:
    checks = {n for n in vars(contract) if n.startswith("test_")}
    ran = {f.__name__ for f in CONTRACT_BY_NAME + CONTRACT_ON_TRAINED}
    assert checks - ran == {"test_the_sampling_test_rejects_a_lossy_decoder"}  # a control of the test itself


@pytest.mark.parametrize("check", CONTRACT_BY_NAME, ids=lambda f: f.__name__)
def test_the_toy_passes_the_contract(toy: str, check: Callable[..., None]) -> None:
    check(toy)


@pytest.fixture(scope="module")
def trained_toy(toy: str) -> Iterator[dict[str, Any]]:
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield contract.train_family(toy)
    torch._C.set_num_threads(before)


@pytest.mark.parametrize("check", CONTRACT_ON_TRAINED, ids=lambda f: f.__name__)
def test_the_trained_toy_passes_the_contract(trained_toy: dict[str, Any], check: Callable[..., None],
                                             tmp_path: Path) -> None:
    check(trained_toy, **({"tmp_path": tmp_path} if "tmp_path" in inspect.signature(check).parameters else {}))


@pytest.mark.parametrize(("skipped", "missing"), [
    ("config", ["config_cls"]),
    ("model", ["model_cls"]),
    ("objective", ["required_layout", "objective", "required"]),
    ("export", ["load_export", "export", "export_cls"]),
    ("proposer", ["proposer_cls"]),
])
def test_a_skipped_step_is_reported(tmp_path: Path, skipped: str, missing: list[str]) -> None:
    """The package without one role (its file and its wiring in family.py), registered in the process:
    `get_family` refuses it naming what is missing."""
    pkg, name = f"toyfam_no_{skipped}", f"toy_no_{skipped}"
    write_family(tmp_path, pkg, name, skip=frozenset({skipped}))
    with on_path(tmp_path, pkg):
        register_family(importlib.import_module(f"{pkg}.catalog").ENTRY)
        try:
            with pytest.raises(FamilyContractError) as err:
                get_family(name)
        finally:
            unregister_family(name)
    assert f"does not implement the family contract: missing {missing} " in str(err.value)
    assert name not in available_families()


def test_an_unregistered_family_is_unknown(tmp_path: Path) -> None:
    """Step 8 skipped: the package is importable, but neither an entry point nor register_family names it."""
    write_family(tmp_path, "toyfam_unregistered", "toy_unregistered", skip=frozenset({"register"}))
    with on_path(tmp_path, "toyfam_unregistered"), pytest.raises(UnknownFamilyError, match="'toy_unregistered'"):
        get_family("toy_unregistered")


def test_register_family_refuses_what_it_cannot_serve() -> None:
    entry = CatalogEntry("toy_x", "x", "toyfam_x.family:FAMILY", ())
    with pytest.raises(ValueError, match="'eagle3' is already a built-in family"):
        register_family(CatalogEntry("eagle3", "x", "elsewhere.family:FAMILY", ()))
    with pytest.raises(ValueError, match=r"name 'Toy-X', expected lower-case letters"):
        register_family(CatalogEntry("Toy-X", "x", "toyfam_x.family:FAMILY", ()))
    with pytest.raises(ValueError, match=r"import_path 'toyfam_x\.family', expected 'package\.module:ATTRIBUTE'"):
        register_family(CatalogEntry("toy_x", "x", "toyfam_x.family", ()))
    for trains_as in ("nope", "eagle2"):  # unknown; itself trained as another
        with pytest.raises(ValueError, match=f"trains_as '{trains_as}', expected a known family with a training"):
            register_family(CatalogEntry("toy_x", "x", "toyfam_x.family:FAMILY", (), trains_as=trains_as))
    with pytest.raises(ValueError, match="'eagle3' is a built-in family"):
        unregister_family("eagle3")
    register_family(entry)
    try:
        register_family(entry)  # the same entry again: a no-op
        with pytest.raises(ValueError, match="'toy_x' is already registered from toyfam_x.family:FAMILY"):
            register_family(CatalogEntry("toy_x", "y", "other.family:FAMILY", ()))
    finally:
        unregister_family("toy_x")
    with pytest.raises(UnknownFamilyError, match="'toy_x' is not registered"):
        unregister_family("toy_x")


def test_training_families_leave_out_those_trained_as_another() -> None:
    """What the GPU check steps (scripts/gpu_check.py reads it): every family but EAGLE-2 (EAGLE-1's
    weights); a registered family trained as EAGLE-1 is known but not stepped."""
    assert training_families() == tuple(f for f in known_families() if f != "eagle2")
    register_family(CatalogEntry("toy_tree", "x", "toyfam_tree.family:FAMILY", (), trains_as="eagle1"))
    try:
        assert "toy_tree" in known_families() and "toy_tree" not in training_families()
    finally:
        unregister_family("toy_tree")
