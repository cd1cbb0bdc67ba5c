"""`engines.sglang` checked offline against the shipped table of SGLang 0.5.23's server options
(`moe_rl.engine.sglang_options`); SGLang's own parser checks the table in
tests/conformance/test_sglang_options.py."""

from __future__ import annotations

import pytest

from moe_rl.config import EngineConfig
from moe_rl.engine.sglang_launcher import SGLangConfig, sglang_command
from moe_rl.engine.sglang_options import OWNED, check_options, kv_cache_bytes, option_args, table


def test_what_moe_rl_owns_is_refused_with_the_owning_field():
    assert set(OWNED) <= set(table()["options"])  # every owned name is an SGLang option
    for key, field in [
        ("tp_size", "engines.tp"),
        ("tensor_parallel_size", "engines.tp"),  # an alias names the same option
        ("ep", "engines.ep"),
        ("attn_dp_size", "engines.attn_dp"),
        ("mem_fraction_static", "engines.mem_fraction_static"),
        ("max_running_requests", "engines.max_batch"),
        ("port", "free port"),
        ("model_path", "model.path"),
        ("enable_return_routed_experts", "rollout.return_routed_experts"),
        ("weight_version", "sync"),
        ("max_lora_rank", "lora.rank"),
    ]:
        with pytest.raises(ValueError, match=rf"^engines.sglang.{key}: moe-rl sets this option itself; .*{field}"):
            EngineConfig(kind="sglang", tp=2, sglang={key: 2})
    with pytest.raises(ValueError, match=r"engines.sglang.speculative_num_steps: .* engines.speculative"):
        EngineConfig(kind="sglang", sglang={"speculative_num_steps": 2})


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"moe_a2a_backnd": "deepep"},
            r"moe_a2a_backnd: not a server option of SGLang 0.5.23; did you mean moe_a2a_backend\?",
        ),
        ({"chunked_prefil_size": 4096}, r"did you mean chunked_prefill_size\?"),
        ({"kv_cache_dtype": "fp9"}, r"kv_cache_dtype='fp9': --kv-cache-dtype takes one of \['auto', "),
        ({"chunked_prefill_size": "8K"}, r"chunked_prefill_size='8K': expected an integer"),
        ({"chunked_prefill_size": True}, r"chunked_prefill_size=True: expected an integer"),
        ({"enable_eplb": "yes"}, r"enable_eplb='yes': --enable-eplb is a switch; write true or false"),
        ({"cuda_graph_bs_decode": []}, r"cuda_graph_bs_decode=\[\]: --cuda-graph-bs-decode takes one value or more"),
        ({"cuda_graph_bs_decode": [1, "x"]}, r"cuda_graph_bs_decode='x': expected an integer"),
        ({"attention_backend": None}, r"attention_backend=null: remove it"),
        ({"disable_cuda_graph": True}, r"disable_cuda_graph: deprecated in SGLang 0.5.23; use --cuda-graph-backend"),
        ({"moe_a2a_backend": "deepep"}, r"moe_a2a_backend=deepep spreads experts .* engines.ep=1: set engines.ep=2"),
        ({"enable_eplb": True}, r"enable_eplb: EPLB balances experts across EP ranks; set engines.ep > 1"),
        ({"ep_dispatch_algorithm": "static"}, r"ep_dispatch_algorithm=static .* needs an all-to-all backend"),
        ({"page_size": 16, "page-size": 16}, r"names one option twice \(an alias and its name\); keep one"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        EngineConfig(kind="sglang", tp=2, ep=1, sglang=options)
    assert "\n" not in str(error.value)


def test_options_become_sglang_flags_in_the_launch_command():
    options = {
        "moe_a2a_backend": "deepep",
        "kv_cache_dtype": "fp8_e4m3",
        "chunked_prefill_size": 8192,
        "enable_eplb": True,
        "disable_radix_cache": False,  # a switch left off: no flag
        "enable_tf32_matmul": False,  # --x / --no-x
        "cuda_graph_bs_decode": [1, 2, 4],
        "preferred_sampling_params": {"temperature": 1.0},  # JSON text
    }
    assert option_args(options) == [
        *("--moe-a2a-backend", "deepep", "--kv-cache-dtype", "fp8_e4m3", "--chunked-prefill-size", "8192"),
        *("--enable-eplb", "--no-enable-tf32-matmul", "--cuda-graph-bs-decode", "1", "2", "4"),
        *("--preferred-sampling-params", '{"temperature": 1.0}'),
    ]
    engines = EngineConfig(kind="sglang", tp=4, ep=4, max_batch=128, sglang=options)
    command = sglang_command(
        SGLangConfig(model_path="/m", tp_size=4, ep_size=4, max_running_requests=engines.max_batch, options=options), 1
    )
    assert command[command.index("--max-running-requests") + 1] == "128"
    assert command[-len(option_args(options)) :] == option_args(options)
    with pytest.raises(ValueError, match=r"options.tp_size: moe-rl sets this option itself"):
        SGLangConfig(model_path="/m", options={"tp_size": 2})


def test_options_are_for_sglang_engines_only():
    with pytest.raises(ValueError, match=r"engines.sglang=.* with engines.kind='embedded'; set engines.kind: sglang"):
        EngineConfig(sglang={"kv_cache_dtype": "fp8_e4m3"})


def test_kv_cache_bytes_follow_the_dtype():
    assert kv_cache_bytes({}, 2) == 2
    assert kv_cache_bytes({"kv_cache_dtype": "auto"}, 2) == 2
    assert kv_cache_bytes({"kv_cache_dtype": "fp8_e4m3"}, 2) == 1
    assert kv_cache_bytes({"kv_cache_dtype": "nvfp4"}, 2) == 0.5625
    check_options({"kv_cache_dtype": "nvfp4"}, tp=1, ep=1)
