"""One RoPE cos/sin table per configuration, shared by every layer and counted once."""

from __future__ import annotations

import gc
import weakref

import torch

from srt.check_config_weights import loaded_model_nbytes
from srt.configs.model_config import ModelConfig
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.model_executor.memory_sizing import module_nbytes
from srt.model_loader.loader import get_model


def _load(path, dtype="float32"):
    config = ModelConfig.load(str(path), dtype)
    return config, get_model(config, load_format="dummy")


def _ropes(model):
    return [m for m in model.modules(remove_duplicate=False) if isinstance(m, RotaryEmbedding)]


def test_every_layer_reads_the_same_table(llama_model):
    config, model = _load(llama_model)
    ropes = _ropes(model)
    assert len(ropes) == config.num_hidden_layers > 1
    assert ropes[0] is ropes[1]
    assert ropes[0].cos_cache.data_ptr() == ropes[-1].cos_cache.data_ptr()
    assert len({r.cos_cache.data_ptr() for r in ropes}) == 1
    assert len({r.sin_cache.data_ptr() for r in ropes}) == 1


def test_tables_are_counted_once_and_are_not_weights(llama_model):
    config, model = _load(llama_model)
    rope = _ropes(model)[0]
    table = rope.cos_cache.numel() * rope.cos_cache.element_size() * 2
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert module_nbytes(model) == sum(params.values()) + table
    assert not [name for name in model.state_dict() if "rotary" in name or "cos_cache" in name]
    assert loaded_model_nbytes(config) == module_nbytes(model), "the meta-device estimate agrees"


def test_same_configuration_same_module_other_configuration_other_module():
    a = get_rope(16, 128, 10000.0, None, torch.float32)
    assert get_rope(16, 128, 10000, None, torch.float32) is a
    assert get_rope(16, 128, 500000.0, None, torch.float32) is not a
    assert get_rope(16, 128, 10000.0, None, torch.bfloat16) is not a
    assert get_rope(16, 256, 10000.0, None, torch.float32) is not a
    linear = {"rope_type": "linear", "factor": 2.0}
    assert get_rope(16, 128, 10000.0, linear, torch.float32) is not a
    assert get_rope(16, 128, 10000.0, dict(linear), torch.float32) is get_rope(16, 128, 10000.0, linear,
                                                                                torch.float32)
    with torch.device("meta"):
        assert get_rope(16, 128, 10000.0, None, torch.float32) is not a


def test_a_table_lives_only_as_long_as_a_model_holds_it():
    ref = weakref.ref(get_rope(8, 64, 1234.5, None, torch.float32))
    gc.collect()
    assert ref() is None, "the cache must not keep tables of dead models alive"


def test_shared_table_rotates_like_a_private_one():
    shared = get_rope(16, 64, 10000.0, None, torch.float32)
    private = RotaryEmbedding(16, 64, 10000.0, None, torch.float32)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    positions = torch.tensor([0, 3, 17, 40, 63])
    for a, b in zip(shared(positions, q, k), private(positions, q, k)):
        assert torch.equal(a, b)
