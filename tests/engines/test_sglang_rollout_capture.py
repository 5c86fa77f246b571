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
from types import SimpleNamespace
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


def dataclass_fields(relpath: str, name: str) -> set[str]:
    tree = ast.parse((ROOT / relpath).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def generate_fields() -> set[str]:
    return dataclass_fields("srt/managers/io_struct.py", "GenerateReqInput")


class FakeSGLangGenerate:
    """SGLang's `/generate` for one HF model started with `server_args` (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, server_args: dict[str, Any]) -> None:
        self.model, self.args, self.fields = model, server_args, generate_fields()
        self.sampling_fields = dataclass_fields("srt/sampling/sampling_params.py", "SamplingParams")
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
        unknown = sorted(set(body) - self.fields) + sorted(set(body.get("sampling_params", {})) - self.sampling_fields)
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


class FakeServerManager:
    """verl's `LLMServerClient` as our agent loop uses it: the load balancer's choice (the server's
    HTTP address, how verl 0.9.1's router keys SGLang replicas) and its release."""

    def __init__(self, address: str) -> None:
        self.address, self.inflight = address, 0

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        self.inflight += 1
        return self.address, None

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        assert server_id == self.address
        self.inflight -= 1


def _agent_loop(address: str, plan: Any, target_dir: Path, response_length: int) -> Any:
    """Our loop built the way verl 0.9.1's `AgentLoopWorker._run_agent_loop` builds one: hydra
    instantiates the entry of the `agent_loop_config_path` file `arm_rollout_capture` writes."""
    import hydra
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from verl_speco.verl_integration.sglang_agent_loop import agent_loop_config

    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 16, "response_length": response_length,
                                                              "max_model_len": None}}, "data": {}})
    entry = OmegaConf.create(agent_loop_config(plan, HIDDEN, "float32", 60.0)[0])
    return hydra.utils.instantiate(config=entry, trainer_config=DictConfigWrap(config=cfg),
                                   server_manager=FakeServerManager(address), tokenizer=tok, processor=None,
                                   hf_model_type=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data),
                                   tools=ToolListWrap([]))


@pytest.mark.parametrize("served", ["eagle1"], indirect=True)
def test_verl_agent_loop_captures_the_rollout(served: tuple[FakeSGLangGenerate, Any], target_dir: Path,
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's single-turn loop with our generate: SGLang's own request fields over HTTP, the tokens verl
    gets, and the rows (in extra_fields) equal to the actor capture's; through the trainer's side
    (`rollout_entries`, `rows_from_encoded`) into a store that passes inspect --strict. A short
    response travels as its drop reason; a missing or corrupt entry is refused naming it."""
    import asyncio

    from verl_speco.online.config import DrafterConfigError
    from verl_speco.online.rollout_capture import RolloutEntryError
    from verl_speco.verl_integration.rollout_rows import rollout_entries
    from verl_speco.verl_integration.sglang_agent_loop import CAPTURE_KEY

    fake, plan = served
    address = f"127.0.0.1:{fake.httpd.server_address[1]}"
    fake.short = {1}
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    prompts = ["t5 t9 t12 t7", "t30 t31 t2", "t44 t45 t46 t47 t48"]  # the WordLevel vocabulary (conftest)

    async def one(text: str) -> Any:  # built inside the running loop, as verl's worker does
        loop = _agent_loop(address, plan, target_dir, response_length=5)
        out = await loop.run(dict(sampling), raw_prompt=[{"role": "user", "content": text}], global_steps=3)
        assert loop.speco_client.inner.inflight == 0
        return out

    outputs = [asyncio.run(one(text)) for text in prompts]
    assert len(fake.sequences) == len(outputs) == 3
    for out, seq in zip(outputs, fake.sequences):
        assert list(out.prompt_ids) + list(out.response_ids) == seq and len(out.response_ids) == 5
        assert 0 not in out.prompt_ids  # no unknown word: the rows below are not all the pad embedding's
        assert out.extra_fields["min_global_steps"] == out.extra_fields["max_global_steps"] == 3

    extra = [o.extra_fields for o in outputs] + [{CAPTURE_KEY: b"pad"}]
    tags: list[dict[str, Any]] = [{}, {}, {}, {"is_padding": True}]
    entries = rollout_entries(extra, tags)
    capture = RolloutCapture(plan, HIDDEN, CaptureCaps(), seed=0, hidden_dtype=torch.float32)
    rows = capture.rows_from_encoded(entries, policy_version=2)
    assert rows.counts["rollout_short_decode"] == 1 and rows.counts["kept"] == 2 and rows.counts["seen"] == 3
    actor = OnlineCapture(plan.layout.layer_ids, CaptureCaps(), hidden_dtype=torch.float32)
    assert len(rows.records) == 2 and len(fake.sequences) == 3
    for record, seq, out in zip(rows.records, [fake.sequences[0], fake.sequences[2]], [outputs[0], outputs[2]]):
        ids = torch.tensor([seq])
        mask = torch.zeros_like(ids)
        mask[0, len(out.prompt_ids):] = 1
        with torch.no_grad(), actor.hooks(fake.model) as hooked:
            fake.model(input_ids=ids)
            want = actor.collect(hooked.pop_all(), ids, torch.ones_like(ids), mask, 0).records[0]
        assert torch.equal(record["input_ids"], want["input_ids"][:-1])
        assert torch.equal(record["loss_mask"], want["loss_mask"][:-1])
        torch.testing.assert_close(record["last_hidden"], want["last_hidden"][:-1], rtol=1e-5, atol=1e-5)

    # the trainer's side: entries read from TransferQueue before the old-logprob pass, stored after the step
    import numpy as np
    import transfer_queue

    from verl_speco.verl_integration import trainer_step
    from verl_speco.verl_integration.rollout_rows import rollout_store_sink
    from verl_speco.verl_integration.trainer import SpecoTrainerMixin

    batch = SimpleNamespace(keys=["a", "b", "c", "pad"], partition_id="train", tags=tags)

    def kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, Any]:
        assert keys == batch.keys and select_fields == ["extra_fields"]
        return {"extra_fields": np.array(extra, dtype=object)}

    monkeypatch.setattr(transfer_queue, "kv_batch_get", kv_batch_get)
    store = tmp_path / "store"
    driver: Any = object.__new__(type("Driver", (SpecoTrainerMixin,), {}))
    driver.speco = DrafterRunConfig(enable=True, family="eagle1", mode="collect_only", capture_source="rollout",
                                    feature_store=FeatureStoreSink(path=str(store), hidden_dtype="float32"))
    driver.global_steps = driver.total_training_steps = 3
    driver._speco_rollout, driver._speco_pending = capture, None
    driver._speco_sink = rollout_store_sink(driver.speco, plan, HIDDEN, VOCAB, "tiny-qwen3")
    trainer_step.take_rollout_rows(driver, batch)
    metrics = trainer_step.after_rollout_step(driver)
    assert metrics["drafter/capture/kept"] == 2 and metrics["drafter/capture/rollout_short_decode"] == 1
    assert metrics["drafter/store/samples"] == 2 and driver._speco_sink is None  # closed at the last step
    capsys.readouterr()
    assert inspect_main([str(store), "--strict", "--verify-checksums", "--no-progress"]) == 0
    index = StoreIndex.open(store, verify_checksums=True)
    assert sorted(int(index.sample(i, copy=True)["policy_version"]) for i in range(2)) == [2, 2]
    index.close()

    with pytest.raises(DrafterConfigError, match=r"1 of 3 trajectories carry no .*agent_name"):
        rollout_entries([extra[0], {}, extra[2]], [{}, {}, {}])
    corrupt = bytearray(entries[0])
    corrupt[-4:] = b"\xff\xff\xff\xff"
    for bad, want in [(b"not safetensors", "entry 1: not a safetensors"), ("text", "entry 1: got str"),
                      (bytes(corrupt[:40]), "entry 1: not a safetensors")]:
        with pytest.raises(RolloutEntryError, match=want):
            capture.rows_from_encoded([entries[0], bad], policy_version=2)
