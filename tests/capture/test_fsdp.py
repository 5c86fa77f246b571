"""Hooks on an FSDP2-sharded (``fully_shard``) target whose layers are also wrapped by the activation
checkpoint wrapper (as verl wraps its actor): capture equals ``output_hidden_states`` of the plain model.
Runs in a subprocess (real torch.distributed, gloo) so the process group never leaks into other tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[1])
from conftest import make_qwen3
from verl_speco.capture.hooks import capture_features, find_decoder_modules

torch._C.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
ids = torch.randint(5, 90, (2, 9), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[1, 6:] = 0
with torch.no_grad():
    ref = make_qwen3()(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
model = make_qwen3()
for i, layer in enumerate(model.model.layers):
    model.model.layers[i] = checkpoint_wrapper(layer)
    fully_shard(model.model.layers[i])
fully_shard(model)
assert "_checkpoint_wrapped_module" in find_decoder_modules(model).layers[0]._modules
def hooks():   # FSDP2 installs hooks of its own: only ours must go away
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
before = hooks()
for grad in (False, True):
    with torch.set_grad_enabled(grad), capture_features(model, (0, 2, 4, 8), dtype=None) as cap:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)  # as in training
        feats = cap.pop()
        if grad:
            out.logits.sum().backward()   # checkpoint recomputation re-runs layer hooks: must be harmless
            assert cap.pop_all() == []
    for i in (0, 2, 4, 8):
        assert torch.equal(feats.hidden[i], ref[i]), (grad, i)
    assert torch.equal(feats.last_hidden, ref[-1])
assert hooks() == before
dist.destroy_process_group()
print("FSDP2 OK")
'''


def test_capture_under_fsdp2_and_checkpoint_wrapper(tmp_path: Path) -> None:
    script = tmp_path / "fsdp2_capture.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parents[2])
    assert res.returncode == 0 and "FSDP2 OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
