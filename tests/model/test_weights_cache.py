"""The cache of a GGUF file's assembled tensors: written at the first load, read at the next without
the GGUF reader, equal to what the file gives; a stale, broken or unwritable cache costs time only."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from baton.common.model import loader
from baton.common.model.source import ModelSource


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def source(model_path):
    return ModelSource.resolve(model_path)


def _no_gguf_reader(monkeypatch):
    import gguf

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was read although its tensors are cached")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def _same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def test_the_second_load_reads_the_cache_not_the_gguf_file(cache, source, monkeypatch):
    first = loader.load_model(source, torch.bfloat16)
    folder = loader.weights_cache_dir(source)
    assert os.path.dirname(folder) == str(cache / "weights")
    assert sorted(os.listdir(folder)) == ["bfloat16.safetensors", "config.json"]

    from gguf import GGUFReader

    on_file = loader.gguf_config(GGUFReader(source.path))
    _no_gguf_reader(monkeypatch)
    assert loader.read_config(source) == on_file
    second = loader.load_model(source, torch.bfloat16)
    _same_tensors(first, second)
    assert second.lm_head_weight is second.embed_tokens.weight  # tied, as loaded from the file
    assert not any(t.is_meta for t in second.state_dict().values())


def test_each_dtype_is_cached_apart(cache, source):
    bf16 = loader.load_model(source, torch.bfloat16)
    fp32 = loader.load_model(source, torch.float32)
    assert sorted(os.listdir(loader.weights_cache_dir(source))) == [
        "bfloat16.safetensors",
        "config.json",
        "float32.safetensors",
    ]
    assert fp32.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(fp32.embed_tokens.weight.to(torch.bfloat16), bf16.embed_tokens.weight)


def test_a_truncated_cache_is_rebuilt(cache, source, caplog):
    first = loader.load_model(source, torch.bfloat16)
    tensors = os.path.join(loader.weights_cache_dir(source), "bfloat16.safetensors")
    with open(tensors, "r+b") as f:
        f.truncate(os.path.getsize(tensors) // 2)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        again = loader.load_model(source, torch.bfloat16)
    assert "ignoring the weights cache" in caplog.text
    _same_tensors(first, again)
    assert os.path.getsize(tensors) > 2 * 10**8  # written whole again


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch, source, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("BATON_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        model = loader.load_model(source, torch.bfloat16)
    assert "could not cache the model's tensors" in caplog.text
    assert model.embed_tokens.weight.shape[0] == loader.read_config(source).vocab_size


def test_a_modified_file_has_another_cache(tmp_path, cache, source):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(open(source.path, "rb").read())
    other = ModelSource.resolve(str(copy))
    before = loader.weights_cache_dir(other)
    os.utime(copy, ns=(0, os.stat(copy).st_mtime_ns + 10**9))
    assert loader.weights_cache_dir(other) != before
    assert loader.weights_cache_dir(other) != loader.weights_cache_dir(source)
