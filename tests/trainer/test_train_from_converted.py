"""Training from what `moe-rl convert hf-to-megatron` writes: `model.path` may name the converted
checkpoint; the trainer loads it at another layout through Megatron's resharding load, equal bit
for bit to importing the HF original; a converted directory without weights is refused when the
config is built, before any process starts."""

from __future__ import annotations

import shutil

import pytest
import torch

from moe_rl.cli import main
from moe_rl.config import ModelConfig
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE, hf_config, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)


def loaded_tensors(hf_dir: str, converted_dir: str) -> bool:
    """Rank function (EP2): the model imported from HF and the one loaded from the conversion."""
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from parallel.export import model_tensors

    tensors = []
    for path in (hf_dir, converted_dir):
        trainer = MegatronTrainer(TrainerConfig(world_size=2, ep=2), ModelConfig(path=path).load_hf_config())
        trainer.load_hf_weights(path)
        tensors.append(model_tensors(trainer.model.module))
    imported, converted = tensors
    return imported.keys() == converted.keys() and all(torch.equal(imported[k], converted[k]) for k in imported)


def test_model_path_may_be_a_converted_checkpoint(tmp_path):
    hf = save_random_model(hf_config(QWEN3_MOE), tmp_path / "hf")
    (hf / "tokenizer_config.json").write_text("{}")  # a side file: it travels in hf_files/
    converted = tmp_path / "converted"
    args = ["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(converted), "--tp", "2", "--ep", "2"]
    assert main(args) == 0
    model = ModelConfig(path=str(converted))
    fields = lambda config: {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert fields(model.load_hf_config()) == fields(ModelConfig(path=str(hf)).load_hf_config())
    assert (
        model.tokenizer_dir == str(converted / "hf_files")
        and (converted / "hf_files" / "tokenizer_config.json").is_file()
    )
    assert spawn(loaded_tensors, 2, str(hf), str(converted)) == [True, True]  # TP2xEP2 on disk, EP2 here

    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(converted / "moe_rl_meta.json", weightless)
    shutil.copytree(converted / "hf_files", weightless / "hf_files")
    with pytest.raises(ValueError, match="no weights"):
        ModelConfig(path=str(weightless))
