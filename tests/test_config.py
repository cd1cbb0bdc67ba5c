"""Run configs: YAML + dotted overrides, typed fields, clear errors before any process starts."""

import pytest
import yaml

from moe_rl import cli
from moe_rl.config import RunConfig, load_config
from tests.tiny_models import DEEPSEEK_V3, QWEN3_MOE, hf_fields

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

TINY_MODEL = {"hf_config": hf_fields(QWEN3_MOE, norm_topk_prob=False)}
RL = ("rollout.task=copy_digits", "trainer.global_batch_size=16")  # an RL run's sections (4 groups x 4)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": TINY_MODEL, "trainer": {"world_size": 4, "ep": 2}}))
    return path


def test_yaml_and_overrides_build_typed_config(config_file):
    config = load_config(
        config_file, ["trainer.tp=2", "trainer.sequence_parallel=true", "trainer.optimizer.lr=1", "steps=3"]
    )
    assert isinstance(config, RunConfig)
    assert (config.trainer.tp, config.trainer.ep, config.trainer.dp) == (2, 2, 2)
    assert config.trainer.expert_dp == 1
    assert config.trainer.optimizer.lr == 1.0 and isinstance(config.trainer.optimizer.lr, float)
    assert config.steps == 3


def test_context_parallel_divides_data_parallel_and_pads_sequences(config_file):
    """CP ranks share a DP replica (world = tp x cp x dp x pp); EP spans DP x CP; a sequence is padded
    to 2 x cp chunks, each split over TP under sequence parallel."""
    config = load_config(config_file, ["trainer.cp=2"])
    assert (config.trainer.dp, config.trainer.expert_dp, config.trainer.sequence_multiple) == (2, 2, 4)
    config = load_config(config_file, ["trainer.cp=2", "trainer.tp=2", "trainer.sequence_parallel=true"])
    assert (config.trainer.dp, config.trainer.sequence_multiple) == (1, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.world_size=3"], r"trainer.world_size=3 is not divisible by etp\*ep\*pp"),
        (["trainer.ep=3", "trainer.world_size=3"], r"trainer.ep=3 does not divide the model's 4 experts"),
        (
            ["trainer.tp=4", "trainer.ep=1", "trainer.sequence_parallel=true"],
            r"trainer.tp=4 does not divide the model's 2 KV groups",
        ),
        (
            ["trainer.tp=8", "trainer.ep=1", "trainer.world_size=8"],
            r"trainer.tp=8 does not divide the model's 4 attention heads",
        ),
        (
            ["trainer.pp=3", "trainer.ep=1", "trainer.world_size=3"],
            r"trainer.pp=3 does not divide the model's 4 layers",
        ),
        (["trainer.cp=3"], r"trainer.world_size=4 is not divisible by tp\*cp\*pp=1\*3\*1=3"),
        (
            ["trainer.cp=4", "trainer.ep=1", "trainer.cp_comm_type=a2a"],
            r"cp_comm_type='a2a' splits heads over cp=4, but each TP rank has 2 KV groups.*'p2p'",
        ),
        (["trainer.cp_comm_type=ring"], r"trainer.cp_comm_type='ring': use one of \['p2p', 'all_gather', 'a2a'\]"),
        (["trainer.tp=2"], r"requires sequence parallel.*set trainer.sequence_parallel=true"),
        (["trainer.sequence_parallel=true"], r"sequence_parallel=true needs trainer.tp > 1"),
        (["trainer.global_batch_size=3"], r"global_batch_size=3 is not divisible by micro_batch_size\*dp"),
        (["trainer.tpp=2"], r"unknown config field 'trainer.tpp'; did you mean 'tp'"),
        (["trainer.tp=two"], r"trainer.tp='two': expected int"),
        (["trainer.optimizer.lr=-1"], r"optimizer.lr=-1.0: must be > 0"),
        (["trainer.pack_sequences=true"], r"pack_sequences=true packs the token-budget.*max_tokens_per_microbatch"),
        (["trainer.precision=fp16"], r"trainer.precision='fp16': use one of \['bf16', 'fp32'\]"),
        (["trainer.consistency_probe_every=-1"], r"trainer.consistency_probe_every=-1: must be an integer >= 0"),
        (["trainer.consistency_probe_samples=0"], r"trainer.consistency_probe_samples=0: must be an integer >= 1"),
        (["steps"], r"write it as dotted.key=value"),
        (
            ["trainer.moe.router_bias_update_rate=0.001"],
            r"router_bias_update_rate=0.001, but Qwen3MoeForCausalLM routers have no expert bias.*"
            r"set trainer.moe.router_bias_update_rate: 0",
        ),
        (["trainer.moe.aux_loss_coeff=-0.01"], r"trainer.moe.aux_loss_coeff=-0.01: must be a number >= 0"),
        (["engines.join_from=neighbour"], r"engines.join_from='neighbour': use peer, trainer or leave it unset"),
        (
            ["engines.kind=sglang", "engines.join_from=peer"],
            r"join_from=peer: SGLang 0.5.23 engines cannot send their weights.*set engines.join_from: trainer",
        ),
        (
            [*RL, "engines.kind=sglang", "sync.pause_mode=none"],
            r"pause_mode='none' with engines.kind='sglang'.*SGLang loads buckets into the live model.*"
            r"use pause_mode abort, retract or in_place",
        ),
        (
            [*RL, "rl.mode=sync", "rl.colocate=true", "trainer.world_size=1", "trainer.ep=1", "sync.pause_mode=none"],
            r"pause_mode='none' with rl.colocate: colocated engines stop.*use pause_mode abort",
        ),
        (["sync.pause_mode=never"], r"pause_mode: 'never' is not one of \('abort', 'retract', 'in_place', 'none'\)"),
        (
            ["trainer.moe.freeze_router=true", "trainer.moe.router_bias_update_rate=0.001"],
            r"freeze_router=true with trainer.moe.router_bias_update_rate=0.001.*set router_bias_update_rate: 0",
        ),
    ],
)
def test_impossible_configs_name_the_field_and_fix(config_file, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(config_file, overrides)


def test_router_controls_reach_the_model_build(config_file):
    """trainer.moe defaults to today's behaviour; a model with an expert bias takes an update rate."""
    defaults = load_config(config_file).trainer.moe.router()
    assert (defaults.freeze, defaults.bias_update_rate, defaults.aux_loss_coeff) == (False, 0.0, 0.0)
    config_file.write_text(yaml.safe_dump({"model": {"hf_config": DEEPSEEK_V3}, "trainer": {"world_size": 2, "ep": 2}}))
    router = load_config(
        config_file, ["trainer.moe.router_bias_update_rate=0.001", "trainer.moe.aux_loss_coeff=0.0001"]
    ).trainer.moe.router()
    assert (router.freeze, router.bias_update_rate, router.aux_loss_coeff) == (False, 0.001, 0.0001)


def test_unknown_architecture_is_named(config_file):
    with pytest.raises(ValueError, match=r"no bridge for architectures=\['LlamaForCausalLM'\]"):
        load_config(
            config_file, ["model.hf_config.architectures=[LlamaForCausalLM]", "model.hf_config.model_type=llama"]
        )


def test_cli_rejects_a_bad_layout_without_spawning(config_file, monkeypatch, capsys):
    import parallel.world

    def no_spawn(*args, **kwargs):
        raise AssertionError("a process was spawned for an invalid config")

    monkeypatch.setattr(parallel.world, "spawn", no_spawn)
    assert cli.main(["train", str(config_file), "trainer.ep=3", "trainer.world_size=3"]) == 2
    assert "trainer.ep=3" in capsys.readouterr().err


def test_a_fresh_run_never_mixes_with_an_earlier_one(config_file, tmp_path, monkeypatch, capsys):
    import parallel.world

    def no_spawn(*args, **kwargs):
        raise AssertionError("a process was spawned into a used output_dir")

    monkeypatch.setattr(parallel.world, "spawn", no_spawn)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("a user's file")
    for out, flags, message in [
        (earlier, [], "holds an earlier run; continue it with --resume"),
        (other, [], "is not a moe-rl run directory"),
        (other, ["--overwrite"], "is not a moe-rl run directory"),
    ]:
        assert cli.main(["train", str(config_file), f"output_dir={out}", *flags]) == 2
        assert message in capsys.readouterr().err
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (other / "notes.txt").read_text() == "a user's file"

    from moe_rl.commands.train import fresh_run_dir

    fresh_run_dir(earlier, overwrite=True)  # what --overwrite does before the job starts
    assert not earlier.exists()


def test_fp32_packing_is_refused_on_transformer_engine_gpus(config_file):
    """Transformer Engine's thd attention takes no fp32: refused where it would run, allowed on the
    CPU (whose TE test stand-in packs in fp32) and in bf16."""
    config = load_config(config_file, ["trainer.max_tokens_per_microbatch=64", "trainer.pack_sequences=true"])
    with pytest.raises(ValueError, match=r"pack_sequences=true with trainer.precision='fp32'.*trainer.precision: bf16"):
        config.trainer.check_packing_precision(gpu_te=True)
    config.trainer.check_packing_precision(gpu_te=False)
    bf16 = load_config(
        config_file, ["trainer.max_tokens_per_microbatch=64", "trainer.pack_sequences=true", "trainer.precision=bf16"]
    )
    bf16.trainer.check_packing_precision(gpu_te=True)
