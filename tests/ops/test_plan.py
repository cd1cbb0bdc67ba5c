"""`moe-rl plan`: every shipped GPU config plans cleanly; broken ones fail naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moe_rl import cli
from moe_rl.config import load_config
from moe_rl.plan.planner import HEADROOM_GB, PARAM_DTYPES, make_plan, parallel_groups
from tests.tiny_models import QWEN3_MOE, hf_fields

MODELS = sorted(Path("configs/models").glob("*.yaml"))
TINY = hf_fields(QWEN3_MOE, norm_topk_prob=False, tie_word_embeddings=False)


def test_seven_model_configs_ship():
    names = {p.stem for p in MODELS}
    assert names == {
        "qwen3_30b_a3b",
        "qwen3_235b_a22b",
        "deepseek_v3",
        "glm45_air",
        "glm45",
        "kimi_k2",
        "mixtral_8x7b",
    }


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_shipped_config_plans_cleanly(path, capsys):
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    config = load_config(path)
    plan = make_plan(config)
    assert plan.trainer_memory["total"] <= config.cluster.gpu_memory_gb
    assert plan.engine_memory["kv_cache"] > 0
    for word in ("placement:", "trainer ranks 0-", "engine 0", "tp ", "ep ", "sync:", "optimizer"):
        assert word in out
    # every trainer rank and every engine GPU is placed exactly once
    lines = [row for rows in plan.placement.values() for row in rows]
    engine_rows = {row.split(": ", 1)[1] for row in lines if "engine" in row}
    assert len(engine_rows) == config.engines.count


def test_colocated_engines_share_the_trainer_gpus():
    config = load_config(
        "configs/models/qwen3_30b_a3b.yaml",
        ["rl.mode=sync", "rl.colocate=true", "engines.count=2", "engines.tp=4", "engines.ep=4", "engines.attn_dp=1"],
    )
    rows = [row for rows in make_plan(config).placement.values() for row in rows]
    engines = [row for row in rows if "engine" in row]
    assert len(engines) == 2 and all("colocated with trainer ranks" in row for row in engines)
    assert "colocated with trainer ranks 0-3" in engines[0] and "colocated with trainer ranks 4-7" in engines[1]


def test_parallel_groups_match_megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    layout = load_config(MODELS[0]).trainer.__class__  # TrainerConfig
    for tp, cp, pp, ep, etp, world in [
        (2, 1, 2, 4, 1, 16),
        (4, 1, 2, 16, 1, 64),
        (1, 1, 1, 8, 1, 16),
        (2, 1, 1, 2, 2, 8),
        (2, 2, 2, 4, 1, 32),  # EP across CP and DP ranks
        (4, 4, 2, 16, 1, 64),  # Qwen3-235B-A22B at 263K tokens (docs/trainer.md)
        (8, 2, 1, 64, 1, 512),  # DeepSeek-V3 at 263K tokens
    ]:
        t = layout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1)
        dense = RankGenerator(tp=tp, ep=1, dp=t.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=etp, ep=ep, dp=t.expert_dp, pp=pp, cp=1, order="tp-ep-dp-pp")
        groups = parallel_groups(t)
        for axis, gen, token in [
            ("tp", dense, "tp"),
            ("cp", dense, "cp"),
            ("dp", dense, "dp"),
            ("pp", dense, "pp"),
            ("etp", expert, "tp"),
            ("ep", expert, "ep"),
            ("edp", expert, "dp"),
        ]:
            assert groups[axis] == sorted(gen.get_ranks(token)), (axis, tp, cp, pp, ep, etp)


def test_sync_bytes_equal_the_saved_hf_state_dict(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    AutoModelForCausalLM.from_config(hf).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    saved = 0
    for file in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            saved += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    config = _tiny_run(tmp_path)
    assert make_plan(config).sync_bytes == saved


def test_fp8_sync_bytes_are_about_the_fp8_stream(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_rl.engine.embedded.runner import load_checkpoint_state
    from parallel.fp8 import BlockFP8

    fields = dict(TINY)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    AutoModelForCausalLM.from_config(hf).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    tensors = sorted(load_checkpoint_state(tmp_path / "hf").items())
    sent = sum(t.numel() * t.element_size() for _, t in BlockFP8(8, 8).quantize_stream(tensors))
    config = _tiny_run(tmp_path)
    full = make_plan(config).sync_bytes
    config.sync.fp8_blocks = 8
    plan = make_plan(config)
    assert abs(plan.sync_bytes - sent) <= 0.03 * sent and plan.sync_bytes < 0.75 * full
    assert any("sync.fp8_blocks=8" in note for note in plan.notes)


def test_activations_follow_the_token_budget():
    """With trainer.max_tokens_per_microbatch a micro-batch computes at most the budget's tokens:
    activations scale with it instead of micro_batch_size x data.seq_length."""
    config = "configs/models/qwen3_30b_a3b.yaml"
    base = load_config(config, ["cluster.gpu_memory_gb=1000"])
    rows = make_plan(base)
    tokens = base.data.seq_length * base.trainer.micro_batch_size
    same = make_plan(load_config(config, ["cluster.gpu_memory_gb=1000", f"trainer.max_tokens_per_microbatch={tokens}"]))
    double = make_plan(
        load_config(config, ["cluster.gpu_memory_gb=1000", f"trainer.max_tokens_per_microbatch={2 * tokens}"])
    )
    assert same.trainer_memory["activations"] == pytest.approx(rows.trainer_memory["activations"])
    assert double.trainer_memory["activations"] == pytest.approx(2 * rows.trainer_memory["activations"])


LONG = ["rollout.max_new_tokens=262144", "data.seq_length=263168", "trainer.max_tokens_per_microbatch=263168"]
"""The 263K-token sequences of docs/trainer.md's "Planning long sequences" (issue 42's table)."""
LONG_CP = {"deepseek_v3": ["trainer.cp=2"], "qwen3_235b_a22b": ["trainer.cp=4", "engines.attn_dp=4"]}
"""What docs/trainer.md gives for them: the trainer's CP, and for Qwen3 engines whose KV cache holds one."""


@pytest.mark.parametrize("model", sorted(LONG_CP))
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallel_divides_activations_by_cp(model, cp):
    """Each CP rank holds 1/cp of a micro-batch's tokens: activations (the fp32 logits included)
    fall by exactly cp; weights, grads and optimizer state stay (the distributed optimizer shards
    dense state over DP x CP, and DP x CP is the same GPUs), so does the sync."""
    path, big = f"configs/models/{model}.yaml", "cluster.gpu_memory_gb=1000"
    one = make_plan(load_config(path, [*LONG, big]))
    split = make_plan(load_config(path, [*LONG, big, f"trainer.cp={cp}"]))
    assert split.trainer_memory["activations"] == pytest.approx(one.trainer_memory["activations"] / cp, rel=1e-12)
    for part in ("weights", "grads", "optimizer", "sync buffers"):
        assert split.trainer_memory[part] == pytest.approx(one.trainer_memory[part], rel=1e-12), part
    assert split.sync_bytes == one.sync_bytes and split.sync_seconds == pytest.approx(one.sync_seconds)


@pytest.mark.parametrize("model", sorted(LONG_CP))
def test_263k_token_sequences_fit_with_the_documented_cp(model, capsys):
    """issue 42's proof: refused without CP; with docs/trainer.md's trainer.cp the plan passes, leaves
    its headroom, and the sequences are within the model's positions where the model has them
    (Qwen3-235B-A22B's YaRN; DeepSeek-V3's positions stop at 163,840: the plan says so)."""
    path, chosen = f"configs/models/{model}.yaml", LONG_CP[model]
    assert cli.main(["plan", path, *LONG, *chosen[1:]]) == 2
    assert "raise trainer.cp" in capsys.readouterr().err
    assert cli.main(["plan", path, *LONG, *chosen]) == 0
    out = capsys.readouterr().out
    config = load_config(path, [*LONG, *chosen])
    plan = make_plan(config)
    assert plan.trainer_memory["total"] <= config.cluster.gpu_memory_gb - HEADROOM_GB
    assert f"each CP rank holds {263168 // config.trainer.cp} of a micro-batch's 263168 tokens" in out
    assert "sequences of 263168 tokens" in out  # the engines' KV cache holds at least one
    assert ("exceed the model's 163840 positions" in out) == (model == "deepseek_v3")


def test_an_engine_kv_cache_must_hold_the_longest_sequence(capsys):
    """Qwen3-235B-A22B's engines attend with DP attention over 8 groups of one GPU, each holding
    all 4 KV heads of its requests: 94 layers x 2 x 4 heads x 128 x 2 bytes = 192,512 bytes a token,
    50.7 GB for 263,168 tokens, more than the 46 GB of KV cache a GPU has left. Attention over two
    GPUs (engines.attn_dp=4) halves it."""
    path = "configs/models/qwen3_235b_a22b.yaml"
    assert cli.main(["plan", path, *LONG, "trainer.cp=4"]) == 2
    err = capsys.readouterr().err
    assert f"one 263168-token sequence needs {192512 * 263168 / 1e9:.1f} GB of KV cache" in err
    assert "attention TP = engines.tp/engines.attn_dp = 1" in err and "lower engines.attn_dp" in err
    assert cli.main(["plan", path, *LONG, "trainer.cp=4", "engines.attn_dp=4"]) == 0
    assert f"({192512 * 263168 / 2 / 1e9:.1f} GB each per GPU)" in capsys.readouterr().out


def test_the_layout_printout_places_cp_in_megatrons_order(capsys):
    """tp fastest, then cp, dp, pp; EP groups formed across the TP x CP x DP ranks of a stage."""
    assert cli.main(["plan", "configs/models/qwen3_235b_a22b.yaml", *LONG, *LONG_CP["qwen3_235b_a22b"]]) == 0
    out = capsys.readouterr().out
    assert "trainer layout: tp 4 x cp 4 x dp 2 x pp 2 = 64 ranks (order tp-cp-ep-dp-pp)" in out
    assert "experts etp 1 x ep 16 x edp 2 x pp 2" in out
    assert "cp   16 x 4: [0..12 step 4], [1..13 step 4]" in out
    assert "dp   32 x 2: [0..16 step 16]" in out and "ep   4 x 16: [0..15], [16..31]" in out


def test_trainer_memory_and_sync_bytes_follow_the_trainer_precision():
    """bf16 (the shipped GPU configs): 2-byte weights, activations and syncs, Adam with fp32 main
    params (12 bytes); fp32: all at 4 bytes, Adam without main params (8 bytes)."""
    path, big = "configs/models/qwen3_30b_a3b.yaml", "cluster.gpu_memory_gb=1000"
    config = load_config(path, [big])
    bf16, fp32 = make_plan(config), make_plan(load_config(path, [big, "trainer.precision=fp32"]))
    for part, ratio in (("weights", 2), ("optimizer", 8 / 12), ("grads", 1)):
        assert fp32.trainer_memory[part] == pytest.approx(ratio * bf16.trainer_memory[part]), part
    # the last stage's logits are fp32 in both (micro-batches of one sequence)
    logits = 4 * config.data.seq_length * config.model.hf_config["vocab_size"] / config.trainer.tp / 1e9
    assert fp32.trainer_memory["activations"] - logits == pytest.approx(
        2 * (bf16.trainer_memory["activations"] - logits)
    )
    assert fp32.sync_bytes == 2 * bf16.sync_bytes
    assert fp32.engine_memory["weights"] == bf16.engine_memory["weights"]  # cluster.param_dtype
    assert any("trainer.precision=fp32" in note for note in fp32.notes)
    assert not any("trainer.precision" in note for note in bf16.notes)


def test_distributed_optimizer_and_recompute_lower_the_estimate():
    base = make_plan(
        load_config("configs/models/qwen3_30b_a3b.yaml", ["trainer.recompute=false", "cluster.gpu_memory_gb=200"])
    )
    recompute = make_plan(load_config("configs/models/qwen3_30b_a3b.yaml"))
    plain = make_plan(
        load_config(
            "configs/models/qwen3_30b_a3b.yaml", ["trainer.optimizer.distributed=false", "cluster.gpu_memory_gb=200"]
        )
    )
    assert recompute.trainer_memory["activations"] < base.trainer_memory["activations"]
    assert plain.trainer_memory["optimizer"] > recompute.trainer_memory["optimizer"]


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        ("qwen3_30b_a3b", ["cluster.nodes=2"], r"cluster: 2 nodes x 8 GPUs = 16 GPUs, .* need 24"),
        ("qwen3_30b_a3b", ["engines.tp=3"], r"engines.ep=2 does not divide engines.tp=3"),
        (
            "qwen3_30b_a3b",
            ["cluster.gpu_memory_gb=40"],
            r"trainer: ~\d+ GB per GPU .* exceeds cluster.gpu_memory_gb=40",
        ),
        (
            "qwen3_30b_a3b",
            [
                "engines.count=1",
                "engines.tp=8",
                "engines.ep=8",
                "trainer.world_size=4",
                "trainer.ep=4",
                "cluster.nodes=2",
            ],
            r"engine 0 .* would straddle nodes 0 and 1",
        ),
        (
            "qwen3_30b_a3b",
            ["engines.tp=6", "engines.ep=6", "engines.count=1"],
            r"engines.tp/engines.attn_dp=6 does not divide the model's 32 attention heads",
        ),
        ("qwen3_30b_a3b", ["engines.kind=embedded"], r"engines.tp=2: the embedded engine is one CPU process"),
        (
            "qwen3_30b_a3b",
            ["engines.dp=2"],
            r"engines.dp=2: .*raise engines.count.*engines.attn_dp \(SGLang --attn-dp-size\)",
        ),
        ("qwen3_30b_a3b", ["cluster.param_dtype=fp8"], r"cluster.param_dtype='fp8': use one of"),
        (
            "qwen3_235b_a22b",
            ["engines.tp=2", "engines.ep=2", "engines.attn_dp=1", "engines.count=16"],
            r"engines: ~\d+ GB of weights per GPU exceed engines.mem_fraction_static",
        ),
        (
            "mixtral_8x7b",
            ["engines.count=1", "engines.tp=16", "engines.ep=16", "engines.attn_dp=16", "cluster.nodes=4"],
            r"engines.ep=16 does not divide the model's 8 experts",
        ),
        ("deepseek_v3", ["trainer.pp=2"], r"trainer.pp=2 does not divide the model's 61 layers"),
        ("qwen3_235b_a22b", ["trainer.tp=8"], r"trainer.tp=8 does not divide the model's 4 KV groups"),
        (
            "deepseek_v3",
            ["trainer.cp=3"],
            r"trainer.world_size=512 is not divisible by tp\*cp\*pp=8\*3\*1=24: change world_size to a multiple",
        ),
        (
            "qwen3_235b_a22b",
            ["trainer.cp=16"],
            r"trainer.world_size=64 is not divisible by tp\*cp\*pp=4\*16\*2=128",
        ),
        (
            "qwen3_235b_a22b",
            ["trainer.cp=2", "trainer.precision=fp32"],
            r"trainer.cp=2 with trainer.precision='fp32': .* Set trainer.precision: bf16",
        ),
    ],
)
def test_broken_configs_fail_with_the_reason(config, overrides, message, capsys):
    path = f"configs/models/{config}.yaml"
    assert cli.main(["plan", path, *overrides]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_plan_needs_a_cluster_section(capsys):
    assert cli.main(["plan", "configs/demo_cpu.yaml"]) == 2
    assert "cluster: missing" in capsys.readouterr().err


def _tiny_run(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"hf_config": TINY},
                "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 8},
                "trainer": {"world_size": 1, "global_batch_size": 4, "precision": "bf16"},
                "rollout": {"groups_per_step": 1, "n_samples_per_prompt": 4},
                "engines": {"kind": "sglang", "count": 1},
            }
        )
    )
    return load_config(path)


TARGETS = {  # issue 24: modelled seconds per sync on the shipped configs
    "qwen3_235b_a22b": ([], 6.0),
    "qwen3_30b_a3b": ([], 2.0),
    "glm45_air": ([], 2.0),
    "deepseek_v3": (["sync.fp8_blocks=128"], 10.0),
}


@pytest.mark.parametrize("stem", sorted(TARGETS))
def test_shipped_configs_meet_the_sync_targets_and_name_the_bottleneck(stem, capsys):
    overrides, target = TARGETS[stem]
    path = f"configs/models/{stem}.yaml"
    plan = make_plan(load_config(path, overrides), gpu_metrics=Path("absent.json"))
    assert plan.sync_seconds <= target, plan.render()
    assert cli.main(["plan", path, *overrides]) == 0
    out = capsys.readouterr().out
    worst = plan.sync_links.bottleneck
    assert f"s modelled, bottleneck {worst.name} (" in out and "sync links (modelled" in out


def test_one_nic_root_is_bytes_over_one_nic():
    """Without relays the root's node sends through one NIC: every turn is its stage's bytes over
    that NIC at the modelled efficiency, whatever else is done (issue 24's 470 GB >= 10.5 s)."""
    from moe_rl.plan.sync_links import NIC_EFFICIENCY

    absent = Path("absent.json")
    for gbps in (400, 200):
        config = load_config("configs/models/qwen3_235b_a22b.yaml", ["sync.relays=0", f"cluster.nic_gbps={gbps}"])
        plan = make_plan(config, gpu_metrics=absent)
        assert plan.sync_seconds == pytest.approx(plan.sync_bytes / (gbps / 8 * NIC_EFFICIENCY * 1e9))
        assert plan.sync_links.bottleneck.name == "broadcast, each NIC of the root's node"
    relayed = make_plan(load_config("configs/models/qwen3_235b_a22b.yaml"), gpu_metrics=absent)
    assert relayed.sync_links.nics == 8 and relayed.sync_seconds < plan.sync_seconds / 8 * 2


def test_off_node_experts_come_in_over_every_rail():
    """DeepSeek-V3 (EP64, 8 GPUs a node): the root's node holds 8 EP members, the rails; the 56
    off-node members' experts arrive 7 per rail NIC (parallel.gathers.Rails), not 56 on one."""
    config = load_config("configs/models/deepseek_v3.yaml")
    plan = make_plan(config, gpu_metrics=Path("absent.json"))
    share = plan.params.experts * 2 / config.trainer.ep  # one member's bf16 experts
    nic_bytes, _ = plan.sync_links.per_link()["gather, each NIC into the root's node"]
    assert nic_bytes == pytest.approx(7 * share)
    assert plan.sync_links.bottleneck.name != "gather, each NIC into the root's node"


def test_funnel_loads_the_roots_nic_with_the_other_stages():
    absent = Path("absent.json")
    stages = make_plan(load_config("configs/models/glm45_air.yaml", ["sync.relays=0"]), gpu_metrics=absent)
    funnel = make_plan(
        load_config("configs/models/glm45_air.yaml", ["sync.relays=0", "sync.stage_groups=false"]), gpu_metrics=absent
    )
    assert len(stages.sync_links.turns) == 2 and len(funnel.sync_links.turns) == 1
    into_root = funnel.sync_links.per_link()["funnel + gather, the root's NIC in"][0]
    assert into_root > stages.sync_bytes / 2  # the second stage's bytes, and the first stage's off-node gathers
    assert funnel.sync_seconds >= stages.sync_seconds * (1 - 1e-12)


def test_sync_buffers_count_in_memory_on_both_sides():
    config = load_config("configs/models/qwen3_30b_a3b.yaml")
    plan = make_plan(config)
    assert plan.trainer_memory["sync buffers"] == pytest.approx(2 * config.sync.bucket_bytes / 1e9)
    assert plan.engine_memory["sync buffer"] == pytest.approx(config.sync.bucket_bytes / 1e9)
    bigger = make_plan(load_config("configs/models/qwen3_30b_a3b.yaml", ["sync.bucket_bytes=4294967296"]))
    assert bigger.engine_memory["kv_cache"] == pytest.approx(plan.engine_memory["kv_cache"] - 3 * 2**30 / 1e9)


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.link_gbps=400", "cluster.link_gbps=400: replaced by cluster.nic_gbps"),
        ("cluster.nic_gbps=0", "cluster.nic_gbps=0: must be > 0"),
        ("cluster.nics_per_node=0", "cluster.nics_per_node=0: must be an integer >= 1"),
        ("sync.relays=-1", "relays: -1 is not a count of ranks"),
    ],
)
def test_link_fields_are_checked(override, message, capsys):
    assert cli.main(["plan", "configs/models/qwen3_30b_a3b.yaml", override]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_shipped_configs_print_sync_seconds_and_their_anchor(path, capsys):
    from moe_rl.plan.planner import SYNC_ANCHORS

    anchors = {
        "qwen3_30b_a3b": SYNC_ANCHORS[("Qwen3MoeForCausalLM", 30.5)],
        "qwen3_235b_a22b": SYNC_ANCHORS[("Qwen3MoeForCausalLM", 235.1)],
        "deepseek_v3": SYNC_ANCHORS[("DeepseekV3ForCausalLM", 671.0)],
        "glm45": SYNC_ANCHORS[("Glm4MoeForCausalLM", 355.0)],
        "kimi_k2": SYNC_ANCHORS[("DeepseekV3ForCausalLM", 1026.4)],
    }
    assert cli.main(["plan", str(path)]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("sync: "))
    assert __import__("re").fullmatch(
        r"sync: [\d.]+ GB to each engine per step, ~[\d.]+ s modelled, bottleneck .+ \([\d.]+ GB at \d+ GB/s\).*",
        line,
    )
    anchor = anchors.get(path.stem)  # GLM-4.5-Air (106 B) is not GLM-4.5 (355 B): no anchor
    assert line.endswith(f" (public: {anchor})") if anchor else "public:" not in line


def test_sync_anchor_matches_architecture_and_size():
    from types import SimpleNamespace

    from moe_rl.plan.planner import ParamCounts, sync_anchor

    def anchor(architecture: str, billions: float) -> str | None:
        return sync_anchor(SimpleNamespace(architectures=[architecture]), ParamCounts((), (), int(billions * 1e9), 0))

    assert anchor("Glm4MoeForCausalLM", 352) == "slime GLM-4.5-355B 48 s"
    assert anchor("Glm4MoeForCausalLM", 106.9) is None  # GLM-4.5-Air
    assert anchor("MixtralForCausalLM", 30.5) is None


def test_gpu_measurements_model_fp8_quantization_and_link_efficiency(tmp_path):
    """Figures from the GPU check (tests/gpu/metrics.py's file) enter the plan; without them nothing changes."""
    config = load_config("configs/models/deepseek_v3.yaml", ["sync.fp8_blocks=128"])
    without = make_plan(config, gpu_metrics=tmp_path / "absent.json")
    metrics = tmp_path / "gpu_metrics.json"
    rate = {"value": 50.0, "unit": "GB/s of bf16 input", "gpu": "NVIDIA H200", "date": "2026-12-02"}
    nic = {"value": 0.4, "unit": "of the NIC's line rate", "gpu": "NVIDIA H200", "date": "2026-12-02"}
    metrics.write_text(json.dumps({"measured": {"fp8_quantize_gb_per_s": rate, "nic_efficiency": nic}}))
    measured = make_plan(config, gpu_metrics=metrics)
    links = measured.sync_links.per_link()
    # the busiest owner (the root: the stage's decoder dense weights and its own experts) at the measured rate
    counts, t = measured.params, config.trainer
    expected = (sum(counts.dense_per_layer) + counts.experts / t.ep) * 2 / (50.0 * 1e9)
    assert links["FP8 quantization (owner GPU)"][1] == pytest.approx(expected)
    assert "FP8 quantization (owner GPU)" not in without.sync_links.per_link()
    nic_link = "broadcast, each NIC of the root's node"
    assert links[nic_link][1] == pytest.approx(without.sync_links.per_link()[nic_link][1] * 0.8 / 0.4)
    assert measured.sync_seconds > without.sync_seconds
    assert "NIC 0.40 (measured on NVIDIA H200" in measured.render()
    assert any("fp8_quantize_gb_per_s 50" in note for note in measured.notes)
    assert not any("measured" in note for note in without.notes)


def test_the_plan_reads_the_file_the_gpu_check_writes():
    """`scripts/gpu_check.sh` writes benchmarks/gpu_metrics.json at the checkout's root; the plan
    reads that file by default (it read moe_rl/benchmarks/, where nothing is written)."""
    from moe_rl.plan.planner import GPU_METRICS

    root = Path(__file__).resolve().parents[2]
    assert GPU_METRICS == root / "benchmarks" / "gpu_metrics.json"
    assert 'MOE_RL_GPU_METRICS="$PWD/benchmarks/gpu_metrics.json"' in (root / "scripts" / "gpu_check.sh").read_text()


def test_the_plan_prints_each_engines_launch_and_sizes_the_kv_cache_by_its_dtype():
    """The printed commands are the launcher's (`engine_sglang_config` + `sglang_command`, checked by
    SGLang's parser in tests/conformance/test_sglang_options.py); an FP8 KV cache holds twice the
    sequences of the default bf16 one."""
    path = "configs/models/qwen3_30b_a3b.yaml"
    colocated = ["rl.mode=sync", "rl.colocate=true", "engines.count=2", "engines.tp=4", "engines.ep=4"]
    plan = make_plan(load_config(path, [*colocated, "engines.sglang.chunked_prefill_size=4096"]))
    assert len(plan.engine_commands) == 2
    first, second = plan.engine_commands
    assert first.startswith("engine 0: SGLANG_RETURN_ORIGINAL_LOGPROB=1 CUDA_VISIBLE_DEVICES=0,1,2,3 python -m ")
    assert second.startswith("engine 1: SGLANG_RETURN_ORIGINAL_LOGPROB=1 CUDA_VISIBLE_DEVICES=4,5,6,7 python -m ")
    assert "--enable-memory-saver" in first and first.endswith(" --chunked-prefill-size 4096")
    max_batch = load_config(path).engines.max_batch
    assert f"--max-running-requests {max_batch} " in first

    def held(overrides):
        (note,) = [n for n in make_plan(load_config(path, overrides)).notes if "KV cache (attention TP" in n]
        return float(note.split(" holds ")[1].split(" ")[0])

    assert held(["engines.sglang.kv_cache_dtype=fp8_e4m3"]) == pytest.approx(2 * held([]), rel=1e-3)


def test_speculative_engines_hold_the_mtp_draft_and_its_kv():
    """`engines.speculative` on DeepSeek-V3: the NEXTN draft's weights (one MoE layer like the last,
    plus eh_proj and two norms) come out of the KV cache, whose every token keeps one more layer;
    the launch carries SGLang's NEXTN flags."""
    path, speculative = "configs/models/deepseek_v3.yaml", ["engines.speculative.algorithm=mtp"]
    plain, drafting = (make_plan(load_config(path, extra)) for extra in ([], speculative))
    config = load_config(path)
    hf, counts, e = config.model.load_hf_config(), plain.params, config.engines
    hidden, layer_bytes = hf.hidden_size, PARAM_DTYPES[config.cluster.param_dtype]  # no sync.fp8_blocks here
    draft_dense = counts.dense_per_layer[-1] + 2 * hidden * hidden + 2 * hidden
    draft = (draft_dense * layer_bytes / (e.tp // e.attn_dp) + counts.expert_per_layer[-1] * layer_bytes / e.tp) / 1e9
    assert drafting.engine_memory["draft (MTP)"] == pytest.approx(draft)
    assert drafting.engine_memory["kv_cache"] == pytest.approx(plain.engine_memory["kv_cache"] - draft)

    def held(plan):
        (note,) = [n for n in plan.notes if "KV cache (attention TP" in n]
        return float(note.split(" holds ")[1].split(" ")[0])

    layers = hf.num_hidden_layers
    expected = (
        held(plain) * drafting.engine_memory["kv_cache"] / plain.engine_memory["kv_cache"] * layers / (layers + 1)
    )
    assert held(drafting) == pytest.approx(expected, rel=1e-3)
    nextn = "--speculative-algorithm NEXTN --speculative-num-steps 2 --speculative-eagle-topk 1"
    assert drafting.engine_commands[0].endswith(nextn + " --speculative-num-draft-tokens 3")
