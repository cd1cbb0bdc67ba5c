"""Shared pieces of the bridge tests: tiny HF models saved with `save_pretrained`, the
transformers reference forward, and the rank function that, for several layouts in one gloo
world, imports the HF checkpoint, exports it back and runs Megatron's forward.

(No tests here; the per-architecture files `test_bridge_<arch>.py` use it.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.layout import ParallelLayout

SEQ, BATCH = 16, 2


def save_tiny_hf_model(config, out_dir: Path, seed: int = 0) -> Path:
    """Random-weight transformers model for `config`, saved with `save_pretrained` (fp32).
    Norm weights are randomised too, so a mis-mapped norm cannot hide behind all-ones."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.state_dict().items():  # buffers too (e_score_correction_bias)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                param.uniform_(-0.1, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def hf_reference(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [b, s, vocab] for `tokens`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    )


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward-only pipeline schedule; the last stage returns the TP-gathered logits
    [b, s, padded vocab], other stages None. Every rank calls it."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)

    from parallel.model import forward

    def step(_iterator, chunk):
        output = forward(chunk, tokens, positions, labels=tokens.roll(-1, 1), loss_mask=torch.ones_like(tokens))
        return output, lambda out, non_loss_data=True: gather_from_tensor_model_parallel_region(out)

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=b,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return outputs[0] if ps.is_pipeline_last_stage() else None


def check_layouts(
    hf_dir: str, layouts: list[ParallelLayout], tokens: torch.Tensor, bucket_bytes: int, drop_mtp: bool = False
) -> list[dict]:
    """Rank function: for each layout, import -> export (compared bit for bit with the HF file,
    as the reader shows it, on the source ranks) -> forward. Returns per layout: exported names,
    mismatches, logits. `drop_mtp`: the model leaves the checkpoint's MTP layers out."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.bridges import bridge_for, without_mtp
    from parallel.export import export_hf_weights, is_export_source
    from parallel.hf_checkpoint import HFCheckpointReader, load_hf_config
    from parallel.hf_import import load_hf_weights
    from parallel.model import build_gpt_model, init_model_parallel

    config = load_hf_config(hf_dir)  # as stored: MTP layers only where the checkpoint holds them
    bridge = bridge_for(without_mtp(config) if drop_mtp else config)
    reader = HFCheckpointReader(hf_dir)
    results = []
    for layout in layouts:
        init_model_parallel(layout, seed=1234 + dist.get_rank())  # init differs per rank: import must overwrite it
        model = build_gpt_model(bridge, layout)
        load_hf_weights(model, bridge, hf_dir)
        names, mismatched = [], []
        for name, tensor in export_hf_weights(model, bridge, bucket_bytes=bucket_bytes):
            names.append(name)
            original = reader.read(name)
            if original.dtype != tensor.dtype or not torch.equal(original, tensor):
                mismatched.append(name)
        model.eval()
        logits = megatron_logits(model, tokens)
        keep = logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        results.append(
            dict(
                layout=repr(layout),
                source=is_export_source(),
                names=names,
                mismatched=mismatched,
                # numpy: torch tensors cross the result queue by fd sharing, which dies with the rank
                logits=logits[..., : bridge.vocab_size].numpy().copy() if keep else None,
                padded_vocab=bridge.padded_vocab_size(layout.tp),
            )
        )
        dist.barrier()
    return results


def assert_layout_results(
    per_rank: list[list[dict]],
    hf_dir: Path,
    reference: torch.Tensor,
    tokens: torch.Tensor,
    left_out: set[str] = frozenset(),
) -> list[float]:
    """Every HF tensor (but `left_out`) exported exactly once per layout, bit-equal; logits
    within 1e-4 of transformers; the same loss under every layout. Returns the losses."""
    from parallel.hf_checkpoint import HFCheckpointReader

    expected = HFCheckpointReader(hf_dir).names() - left_out
    losses = []
    for i in range(len(per_rank[0])):
        results = [rank[i] for rank in per_rank]
        layout = results[0]["layout"]
        exported = [n for r in results for n in r["names"]]
        assert not [n for r in results for n in r["mismatched"]], layout
        assert len(exported) == len(set(exported)), f"{layout}: a tensor was exported twice"
        assert set(exported) == expected, f"{layout}: missing {expected - set(exported)}"
        logits = [torch.from_numpy(r["logits"]) for r in results if r["logits"] is not None]
        assert len(logits) == 1, layout
        diff = (logits[0] - reference).abs().max().item()
        assert diff <= 1e-4, f"{layout}: max |megatron - transformers| logits = {diff}"
        losses.append(next_token_loss(logits[0], tokens))
    reference_loss = next_token_loss(reference, tokens)
    for loss in losses:
        assert abs(loss - reference_loss) <= 1e-5, (losses, reference_loss)
    return losses
