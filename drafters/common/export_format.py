"""What every family's export shares (docs/adding-a-family.md, step 4): `EngineFormatBase` (the
manifest round trip and engine arguments; four abstract methods a family writes), `DecoderFormat`,
the directory writer `write_export` and the checked readers `check_export_dir` / `load_checked`."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from drafters.common.contract import EXPORT_META_FILE
from drafters.common.engine_args import sglang_chain_args, vllm_speculative_config

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what an export's floating tensors may be

F = TypeVar("F", bound="EngineFormatBase")
C = TypeVar("C")


class EngineFormatBase(ABC):
    """The shared methods of a family's engine format (module docstring); subclasses are frozen dataclasses."""

    family: ClassVar[str]  # the catalog name ("eagle3")
    label: ClassVar[str]  # the family in messages ("EAGLE-3")
    __dataclass_fields__: ClassVar[dict[str, Any]]  # set by @dataclass on the subclass

    def to_dict(self) -> dict[str, Any]:
        """JSON for a publish manifest (`{"family": name, field: value, ...}`, tuples as lists);
        `from_dict` inverts it."""
        body = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {"family": self.family, **body}

    @classmethod
    def from_dict(cls: type[F], data: Mapping[str, Any]) -> F:
        """The format `to_dict` wrote; refuses, naming them, another family, unknown keys and missing
        required keys."""
        if data.get("family", cls.family) != cls.family:
            raise ValueError(f"engine format: family {data.get('family')!r}, expected {cls.family!r}")
        body = {k: v for k, v in data.items() if k != "family"}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - names)
        missing = sorted(f.name for f in fields(cls) if f.name not in body and f.default is MISSING)
        if unknown or missing:
            raise ValueError(f"{cls.label} engine format: unknown keys {unknown}, missing keys {missing} "
                             f"(expected the fields of {cls.__name__}: {sorted(names)})")
        return cls(**body)

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM's `speculative_config`: the catalog's method for this family, `draft_dir`, K."""
        return vllm_speculative_config(self.family, draft_dir, num_speculative_tokens)

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """A chain of `num_speculative_tokens` steps (topk 1: num_draft_tokens = steps + 1)."""
        return sglang_chain_args(self.family, draft_dir, num_speculative_tokens)

    @abstractmethod
    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Training state dict -> the tensors of format `fmt`, checkpoint names, on CPU."""

    @abstractmethod
    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path:
        """Write the export directory of format `fmt` (through `write_export`); returns it."""

    @abstractmethod
    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every tensor SGLang receives live (ValueError where it cannot serve)."""

    @abstractmethod
    def sglang_never_published(self) -> Mapping[str, str]:
        """Engine tensors deliberately not sent to SGLang live -> why."""


@dataclass(frozen=True)
class DecoderFormat(EngineFormatBase):
    """An engine format whose first fields are the target's decoder sizes (`TargetSpec.layer_sizes()`);
    checks the heads group into the kv heads and `dtype` is an export dtype."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the full target vocab V

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        dtype = getattr(self, "dtype", EXPORT_DTYPES[0])
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype: got {dtype!r}, expected one of {EXPORT_DTYPES}")

    def check_positive(self, *names: str) -> None:
        """Refuse, naming it, a field among `names` below 1 (a size)."""
        for name in names:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 1")


def export_meta(fmt_obj: EngineFormatBase, fmt: str, meta: Mapping[str, Any] | None,
                export_config: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """verl_speco_meta.json: {family, format, export_config (default: the dataclass fields),
    engine_format (`to_dict()`), **extra, **meta}, in that key order."""
    return {"family": fmt_obj.family, "format": fmt,
            "export_config": dict(export_config) if export_config is not None else asdict(fmt_obj),
            "engine_format": fmt_obj.to_dict(), **extra, **dict(meta or {})}


def written_dtype(tensors: Mapping[str, Tensor]) -> str:
    """The dtype name ("bfloat16") of the floating tensors of an export (float32 when there are none)."""
    return next((str(v.dtype).removeprefix("torch.") for v in tensors.values() if v.is_floating_point()), "float32")


def write_export(out_dir: str | Path, tensors: dict[str, Tensor], config: Mapping[str, Any],
                 meta_doc: Mapping[str, Any]) -> Path:
    """`model.safetensors` (metadata format pt), `config.json` and `verl_speco_meta.json`, JSON
    indented by 2 with a final newline; returns the directory (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (out / EXPORT_META_FILE).write_text(json.dumps(dict(meta_doc), indent=2) + "\n")
    return out


def check_export_dir(export_dir: str | Path, parse_config: Callable[[dict[str, Any], str], C],
                     refuse_names: Callable[[Iterable[str], str], None],
                     check_tensors: Callable[[Mapping[str, Tensor], C, str], None]) -> C:
    """The export config of a servable directory: `parse_config` rebuilds it, `refuse_names` sees the
    names before any value is read, `check_tensors` checks every tensor; ValueError names the file."""
    root = Path(export_dir)
    cfg = parse_config(json.loads((root / CONFIG_FILE).read_text()), str(root / CONFIG_FILE))
    weights = root / WEIGHTS_FILE
    with safe_open(str(weights), framework="pt") as f:
        names = list(f.keys())
    refuse_names(names, str(weights))
    check_tensors(load_file(str(weights)), cfg, str(weights))
    return cfg


def recorded_settings(export_dir: str | Path) -> dict[str, Any]:
    """The drafter config an export recorded (`drafter_config` in verl_speco_meta.json); {} without one."""
    meta_path = Path(export_dir) / EXPORT_META_FILE
    return dict(json.loads(meta_path.read_text()).get("drafter_config", {})) if meta_path.is_file() else {}


def load_checked(export_dir: str | Path, cfg: object, want: object, build: Callable[[], nn.Module],
                 skip: tuple[str, ...] = (), frozen: tuple[str, ...] = ()) -> nn.Module:
    """A checked export's weights in a fresh model (`build()`), eval mode; `cfg` must equal `want` (the
    target's). `skip`: exported names without a parameter; `frozen`: target pieces never exported."""
    if want != cfg:
        raise ValueError(f"{export_dir}: export config {cfg} does not match the target's sizes {want}")
    tensors = load_file(str(Path(export_dir) / WEIGHTS_FILE))
    model = build()
    model.to(next(v.dtype for v in tensors.values() if v.is_floating_point()))
    result = model.load_state_dict({k: v for k, v in tensors.items() if k not in skip}, strict=False)
    if result.unexpected_keys or sorted(result.missing_keys) != sorted(frozen):
        raise ValueError(f"{export_dir}: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    return model.eval()
