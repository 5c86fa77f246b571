"""A collect_only run whose rows come from SGLang's returned hidden states, over real HTTP.

`FakeSGLangGenerate` is a local `ThreadingHTTPServer` answering SGLang's `/generate` the way
SGLang 0.5.23 does (`sglang_ref`): the body must hold only `GenerateReqInput` fields (read from
SGLang's io_struct.py), `return_hidden_states` is refused unless the server runs with a capture
flag, and `meta_info["hidden_states"]` is one 2-D prefill entry then one 1-D entry per decode
step, computed by the tiny target's HF forward with SGLang's semantics (plain: the post-norm
last hidden; aux: the input of layer `id + 1` for each `--return-aux-hidden-state-layer-ids`).
A planted short response (one decode row missing, sgl-project/sglang#26163) must be dropped and
counted. The store must pass `verl-speco-inspect-features --strict --verify-checksums`, hold the
actor capture's rows for the same tokens, and train a drafter.
"""

from __future__ import annotations

import ast
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3ForCausalLM

from drafters.common.target import TargetSpec
from drafters.registry import export_family, get_family
from feature_store import StoreIndex
from feature_store.inspect import main as inspect_main
from verl_speco.engines.sglang_http import SGLangHTTPClient, SGLangHTTPError
from verl_speco.online.capture import OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig, FeatureStoreSink
from verl_speco.online.rollout_capture import RolloutCapture, choose_capture_source, collect_from_rollout
from verl_speco.online.sink import StoreSink
from verl_speco.train.config import build_family_config
from verl_speco.train.launcher import main as train_main

from .conftest import HIDDEN, VOCAB
from .sglang_ref import ROOT


def generate_fields() -> set[str]:
    tree = ast.parse((ROOT / "srt/managers/io_struct.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


class FakeSGLangGenerate:
    """SGLang's `/generate` for one HF model started with `server_args` (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, server_args: dict[str, Any]) -> None:
        self.model, self.args, self.fields = model, server_args, generate_fields()
        self.short: set[int] = set()  # request numbers answered with one decode row missing
        self.sequences: list[list[int]] = []  # every prompt + output served, in order
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.lock = threading.Lock()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    status, reply = fake.answer(self.path, body)
                raw = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        return Handler

    def answer(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        unknown = sorted(set(body) - self.fields)
        if route != "/generate" or unknown:
            return 400, {"object": "error", "message": f"{route}: unknown fields {unknown}", "code": 400}
        capturing = self.args.get("enable_return_hidden_states") or self.args.get("enable_return_aux_hidden_states")
        if body.get("return_hidden_states") and not capturing:
            return 400, {"object": "error", "message": "The requested return_hidden_states mode exceeds the "
                         "server maximum `None`. Restart with --enable-return-hidden-states", "code": 400}
        prompt, n = body["input_ids"], int(body["sampling_params"]["max_new_tokens"])
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            hs = self.model(input_ids=torch.tensor([prompt + out[:-1]]), output_hidden_states=True).hidden_states
        if self.args.get("enable_return_aux_hidden_states"):  # SGLang captures the input of layer id + 1
            layers = [i + 1 for i in self.args["return_aux_hidden_state_layer_ids"]]
            assert max(layers) < len(hs) - 1, "SGLang cannot capture the last layer's output"
            rows = torch.cat([hs[k][0] for k in layers], dim=-1)
        else:
            rows = hs[-1][0]  # the lm_head input: post-final-norm
        entries: list[Any] = [rows[: len(prompt)].tolist()] + [r.tolist() for r in rows[len(prompt):]]
        if len(self.sequences) in self.short:
            del entries[2]  # speculative decoding's missing row (sglang#26163)
        self.sequences.append(prompt + out)
        meta = {"id": str(len(self.sequences)), "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": len(prompt), "completion_tokens": n, "cached_tokens": 0}
        if body.get("return_hidden_states"):
            meta["hidden_states"] = entries
        return 200, {"text": "", "output_ids": out, "meta_info": meta}


@pytest.fixture()
def served(target_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[FakeSGLangGenerate, Any]]:
    name = request.param
    family = get_family(name)
    spec = TargetSpec.from_pretrained(target_dir)
    cfg = DrafterRunConfig(enable=True, family=name, mode="collect_only", capture_source="rollout",
                           settings=SETTINGS[name])
    fam_cfg = family.resolve(build_family_config(family.config_cls, dict(cfg.settings), name), spec)
    plan = choose_capture_source(cfg, "sglang", family, fam_cfg, spec, "0.5.23")
    assert plan is not None
    fake = FakeSGLangGenerate(Qwen3ForCausalLM.from_pretrained(target_dir).eval(), plan.server_args())
    thread = threading.Thread(target=fake.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, plan
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()


# the run's drafter settings (configs/preset/quickstart_<family>.yaml, this target's mask token):
# the rollout's layer ids come from the same resolved config the trainer builds
SETTINGS: dict[str, dict[str, Any]] = {"eagle1": {}, "dflash": {"num_layers": 2, "block_size": 4, "num_target_features": 3,
                                                           "mask_token_id": VOCAB - 1, "attn_backend": "sdpa"}}
TRAIN = {"eagle1": ["preset=quickstart_eagle1"],
         "dflash": ["preset=quickstart_dflash", f"drafter.settings.mask_token_id={VOCAB - 1}"]}


@pytest.mark.parametrize("served", ["eagle1", "dflash"], indirect=True)
def test_collect_only_from_the_rollout(served: tuple[FakeSGLangGenerate, Any], target_dir: Path,
                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake, plan = served
    if plan.family == "dflash":  # the preset's z-lab context layers [1, 3, 5] (output of layer), internal + 1
        assert plan.layout.layer_ids == (2, 4, 6) and plan.sglang_layer_ids == (1, 3, 5)
    client = SGLangHTTPClient(f"http://127.0.0.1:{fake.httpd.server_address[1]}", timeout_s=60)
    with pytest.raises(SGLangHTTPError, match="unknown fields"):  # the double checks SGLang's dataclass
        client.generate([5, 6], {"max_new_tokens": 2}, return_hidden_state=True)
    store = tmp_path / "store"
    sink = StoreSink(FeatureStoreSink(path=str(store), hidden_dtype="float32"), plan.layout.layer_ids, HIDDEN,
                     VOCAB, "tiny-qwen3", last_hidden=plan.mode == "plain")
    capture = RolloutCapture(plan, HIDDEN, CaptureCaps(), seed=0, hidden_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    fake.short = {2}
    m0 = collect_from_rollout(client, prompts[:4], {"max_new_tokens": 6}, capture, sink, step=0, policy_version=0)
    m1 = collect_from_rollout(client, prompts[4:], {"max_new_tokens": 6}, capture, sink, step=1, policy_version=1)
    sink.close()
    assert m0["drafter/capture/rollout_short_decode"] == 1 and m0["drafter/capture/kept"] == 3
    assert m0["drafter/capture/seen"] == 4 and m1["drafter/capture/kept"] == 4
    assert m1["drafter/capture/rollout_short_decode"] == 0
    capsys.readouterr()
    assert inspect_main([str(store), "--strict", "--verify-checksums", "--no-progress"]) == 0

    # the actor capture of the same sequences (hooks on the HF forward), cut to the rollout's rows
    kept = [s for i, s in enumerate(fake.sequences) if i != 2]
    actor = OnlineCapture(plan.layout.layer_ids, CaptureCaps(), hidden_dtype=torch.float32)
    index = StoreIndex.open(store, verify_checksums=True)
    assert index.num_samples == len(kept) == 7
    stored = sorted((index.sample(i, copy=True) for i in range(index.num_samples)),
                    key=lambda s: (int(s["global_step"]), s["input_ids"].tolist()))
    index.close()
    expected = []
    for seq, prompt in zip(kept, [p for i, p in enumerate(prompts) if i != 2]):
        ids = torch.tensor([seq])
        mask = torch.zeros_like(ids)
        mask[0, len(prompt):] = 1
        with torch.no_grad(), actor.hooks(fake.model) as hooked:
            fake.model(input_ids=ids)
            row = actor.collect(hooked.pop_all(), ids, torch.ones_like(ids), mask, 0).records[0]
        expected.append((0 if len(expected) < 3 else 1, {k: v[:-1] for k, v in row.items()}))  # no last token
    expected.sort(key=lambda e: (e[0], e[1]["input_ids"].tolist()))
    for got, (step, want) in zip(stored, expected):
        assert int(got["global_step"]) == step
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        field = plan.field()
        assert field in got and ({"aux_hidden", "last_hidden"} - {field}).isdisjoint(got)
        torch.testing.assert_close(got[field], want[field], rtol=1e-5, atol=1e-5)

    out = tmp_path / "run"
    assert train_main(["--nproc-per-node", "1", *TRAIN[plan.family], f"target.path={target_dir}",
                       f"data.store={store}", f"run.out_dir={out}", "data.micro_batch_size=2", "data.eval_samples=0",
                       "data.prefetch=0", "run.total_steps=2", "run.save_every=2", "run.eval_every=0",
                       "run.progress_bar=false", "run.tensorboard=false"]) == 0
    assert export_family(out / "ckpt" / "step_2" / "export") == plan.family
