"""One test per patch of parallel/cpu_compat.py: the failure it prevents is gone.

(The end-to-end proof is tests/trainer: every layout trains and checkpoints on gloo.)
"""

import sys

import pytest
import torch

from parallel import cpu_compat
from parallel.world import spawn

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA"),
    pytest.mark.usefixtures("cpu_patches"),  # tests/conftest.py: applied here, in pytest's process
    pytest.mark.world,
]


def test_triton_kernel_module_is_stubbed_or_real():
    import megatron.core.transformer.moe.moe_layer  # noqa: F401  (0.19.x imports paged_stash here)

    stub = sys.modules.get("megatron.core.transformer.moe.ops.paged_stash")
    try:
        import triton  # noqa: F401
    except ImportError:
        assert stub is not None
        with pytest.raises(RuntimeError, match="GPU only"):
            stub.some_kernel()


def test_cuda_streams_events_and_device_queries_run_on_cpu():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        event = side.record_event()
    event.synchronize()
    torch.cuda.synchronize()
    assert torch.cuda.current_device() == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_megatron_rng_tracker_forks_reproducibly_on_the_cpu_generator():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def draw():
        tracker = get_cuda_rng_tracker()
        tracker.reset()
        torch.manual_seed(1)
        tracker.add("model-parallel-rng", 7)  # what model_parallel_cuda_manual_seed does per rank
        outside = torch.rand(3)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(3)
        return outside, inside, torch.rand(3)

    first, second = draw(), draw()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1])  # the forked stream is a different stream
    assert not torch.equal(first[1], first[2])  # and the default stream resumed after the fork


def test_cuda_device_literals_land_on_cpu():
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"  # the optimizer's fp32-param check


def test_torch_norm_accepts_sequence_parallel_and_marks_its_params():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(p.sequence_parallel for p in norm.parameters())  # grads summed over TP


def test_alltoall_split_sizes_become_host_arrays():
    from megatron.core.transformer.moe import token_dispatcher

    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True)
    assert list(sizes) == [2, 3] and sizes.tolist() == [2, 3]


def _uneven_collectives():
    cpu_compat.apply()  # a spawned rank is a fresh process: it applies the patches itself
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    sizes = [2, 3]
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 10 * rank
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    full = torch.arange(10, dtype=torch.float32).reshape(5, 2) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=sizes)
    return gathered, scattered


def test_uneven_gather_and_reduce_scatter_on_gloo():
    (gathered0, scattered0), (gathered1, scattered1) = spawn(_uneven_collectives, 2)
    expected = torch.cat([torch.arange(4.0).reshape(2, 2), torch.arange(6.0).reshape(3, 2) + 10])
    assert torch.equal(gathered0, expected) and torch.equal(gathered1, expected)
    total = torch.arange(10, dtype=torch.float32).reshape(5, 2) * 3  # ranks contribute x1 and x2
    assert torch.equal(scattered0, total[:2]) and torch.equal(scattered1, total[2:])


def test_router_gating_runs_without_transformer_engine():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    inputs, weight = torch.randn(3, 4), torch.randn(5, 4)
    logits = router_gating_linear(inputs, weight, None, torch.float32)
    assert torch.allclose(logits, inputs @ weight.T, atol=1e-6)


# patch 8 (distributed-optimizer checkpoints with torch's Adam): its behaviour is tested where a
# trainer resumes, tests/trainer/test_checkpoint.py (under another layout, and
# test_distributed_optimizer_resume_gives_each_parameter_its_own_adam_step).


def _build_mla_layer() -> list[int]:
    cpu_compat.apply()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from parallel.eager_attention import EagerAttention

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)  # the layer trains: attention dropout forks Megatron's RNG
    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        rope_type="rope",
        use_cpu_initialization=True,
        add_bias_linear=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = EagerAttention
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(spec, config=config, layer_number=1)  # TypeError on the mock TELinear without patch 9
    out, _ = layer(torch.randn(5, 1, 32), attention_mask=None)
    return list(out.shape)


def test_mla_layer_builds_and_runs_without_transformer_engine():
    from megatron.core.transformer import multi_latent_attention

    assert multi_latent_attention.HAVE_TE is False
    assert spawn(_build_mla_layer, 1) == [[5, 1, 32]]


def test_device_literals_also_land_on_cpu_in_another_thread():
    import threading

    devices = []

    def worker():
        cpu_compat.apply()  # what a thread that runs Megatron does (e.g. a Ray actor's executor)
        devices.append(torch.zeros(1, device="cuda").device.type)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert devices == ["cpu"]


def _train_with_recompute() -> float:
    cpu_compat.apply()
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer
    from tests.tiny_models import hf_config

    trainer = MegatronTrainer(TrainerConfig(world_size=1, recompute=True, global_batch_size=2), hf_config())
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    return trainer.train_step({"tokens": tokens, "loss_mask": torch.ones_like(tokens)}).grad_norm


def test_activation_recompute_runs_backward_on_cpu():
    (grad_norm,) = spawn(_train_with_recompute, 1)
    assert grad_norm > 0
