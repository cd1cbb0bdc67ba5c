"""The embedded engine's model: a transformers MoE CausalLM on CPU, its KV-cached forward and the
routed-expert capture.

Routing is captured with forward hooks on the model's router modules: transformers 5 declares the
router class of every MoE family in `_can_record_outputs["router_logits"]`, and each router returns
`(logits, weights, topk_indices)`. Hooking the module that computes `topk_indices` gives the real
routing for every family, including DeepSeek-V3 / GLM-4.5 (sigmoid + correction bias + group-limited
top-k), where the top-k of the logits is not the routing. Dense layers keep rows of zeros, as
SGLang's capture buffer does.

Weights: the checkpoint-format state dict (HF names as on disk, per-expert tensors) is kept, so a
weight update is "merge new checkpoint tensors -> load them into a staged model -> swap":
transformers does the per-expert -> fused conversion, and no forward ever sees a half-loaded model.
The staged model is a spare instance (double buffering): the first update builds it, each swap
makes the model it replaced the next spare, and later updates load the merged checkpoint into it in
place, as the copies that transformers' own converter (the one `from_pretrained` runs) makes
(`load_plan`): 0.4 ms for the bench's tiny Qwen3-MoE, against 5.5 ms through the converter and
~12 ms for a build. The weight sync's commit waits on it while generation is paused. Both models'
objects are frozen out of the cyclic garbage collector (`gc.freeze`): its full passes over them
held the GIL for ~0.2 s.

Memory occupation (SGLang's `/release_memory_occupation` tag "weights", for colocated RL):
`release_weights` drops the model and the checkpoint tensors (their memory is freed) and keeps
only names, shapes and dtypes; `reallocate_weights` re-allocates the checkpoint (zeros: like SGLang's
re-mapped memory, it holds no valid weights) and the next weight update must then carry every
tensor, after which the model is built again. Until then there is no model to run.

Speculative decoding (`speculative_steps` > 0): the checkpoint's MTP layer (HF layers from
`num_hidden_layers`, which the main model does not load) is the draft (`draft.MtpDraft`). A staged
version is the pair (model, draft) built from the same merged checkpoint, swapped in together: a
version never serves a draft from another version. The forward then also returns the main model's
final hidden states (the draft's input), captured at its final norm.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, DynamicCache

from moe_rl.engine.embedded.draft import MtpDraft, is_mtp_name
from moe_rl.engine.embedded.load_plan import convert_into, load_plan, load_with_plan, model_tensors
from moe_rl.engine.embedded.lora import LoraAdapter
from moe_rl.engine.embedded.lora_hooks import LoraSet
from parallel.fp8 import BlockFP8
from parallel.hf_checkpoint import check_safetensors

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def load_checkpoint_state(model_dir: str | Path, fp8: BlockFP8 | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files in `model_dir`, under its checkpoint name (FP8
    blocks of a `quantization_config` checkpoint dequantized: `fp8`)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}: save the model with save_pretrained")
    for file in files:  # every header first: a truncated file fails before anything is read
        check_safetensors(file)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    if fp8 is not None:
        state = fp8.dequantize_named(state)
    for name, tensor in state.items():  # NaN logprobs are not even JSON: refuse such weights here
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{model_dir}: tensor {name} holds NaN or infinite values; the engine refuses it")
    return state


@dataclasses.dataclass(frozen=True)
class Staged:
    """A version ready to serve: its model, its draft (None without speculation), its checkpoint."""

    model: torch.nn.Module
    draft: MtpDraft | None
    checkpoint: dict[str, torch.Tensor]


class ModelRunner:
    """Owns the live model, its routing hooks and the forward used by the scheduler.

    Not thread-safe: only the scheduler thread calls `forward` and `swap`.
    """

    def __init__(self, model_dir: str | Path, device: str = "cpu", speculative_steps: int = 0):
        self.model_dir = str(model_dir)
        self.speculative_steps = speculative_steps
        """Draft tokens per verifying forward (0: no speculation, no draft)."""
        self.device = torch.device(device)  # the live model's; the checkpoint tensors stay in host memory
        if self.device.type == "cuda":  # an NCCL weight-update group uses the current device
            if self.device.index is None:  # plain "cuda": set_device needs an index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        architectures = getattr(self.config, "architectures", None) or []
        if not architectures or not hasattr(transformers, architectures[0]):
            raise ValueError(
                f"{model_dir}/config.json names architectures={architectures}: the embedded engine needs "
                "a transformers CausalLM class there (e.g. Qwen3MoeForCausalLM)"
            )
        self.model_class = getattr(transformers, architectures[0])
        text_config = self.config.get_text_config()
        if getattr(text_config, "num_experts_per_tok", None) is None:
            raise ValueError(
                f"{model_dir}: {architectures[0]} is not a Mixture-of-Experts model (no "
                "num_experts_per_tok): the embedded engine serves MoE checkpoints such as Qwen3-MoE"
            )
        # an FP8 checkpoint (sync.fp8_blocks) is served dequantized, and so are its FP8 updates
        self.fp8 = BlockFP8.from_hf_config(self.config.to_dict())
        if self.fp8 is not None:
            del self.config.quantization_config
        self.checkpoint = load_checkpoint_state(self.model_dir, self.fp8)
        self.num_layers = text_config.num_hidden_layers
        self.topk = text_config.num_experts_per_tok
        self.vocab_size = text_config.vocab_size
        self._captured: dict[int, torch.Tensor] = {}
        self._hidden: torch.Tensor | None = None  # the final norm's output of the last forward (speculation)
        self._hooks: list = []
        self.lora = LoraSet()
        self.model = self._install(self._build(self.checkpoint))
        self.draft = self._draft(self.checkpoint)
        self._spare: torch.nn.Module | None = None  # the model the last swap replaced: the next staged one
        self._plan: dict[str, tuple[str, ...]] | None = None  # the spare's loads as copies (`_load`)
        self._converter_only = False  # the plan did not reproduce the converter: no plan
        # The model's objects live as long as the engine: a full pass of the cyclic garbage collector
        # over them stalled a forward or a commit by ~0.2 s every ~20 steps; frozen, it skips them.
        gc.freeze()
        self._layout = {name: (tensor.shape, tensor.dtype) for name, tensor in self.checkpoint.items()}
        self.weights_state = "loaded"
        """"loaded" | "released" (no tensors) | "reallocated" (allocated, waiting for a full update)."""

    # -- model lifecycle -------------------------------------------------------------------------

    def build_staged(self, tensors: dict[str, torch.Tensor]) -> Staged:
        """A new model (and draft) from the current checkpoint with `tensors` (checkpoint names,
        `checked`) replaced. Does not touch the live model: the caller swaps it in between forwards."""
        # copy: the receiver reuses its storage two versions later, the checkpoint must not alias it
        merged = {**self.checkpoint, **{k: v.to(self.checkpoint[k].dtype, copy=True) for k, v in tensors.items()}}
        model = self._build(merged) if self._spare is None else self._load(self._spare, merged)
        return Staged(model, self._draft(merged), merged)

    def checked(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` as an update of this checkpoint (FP8 ones dequantized), before anything is built:
        ValueError for names or shapes the checkpoint does not have, RuntimeError while the weights
        are released."""
        if self.weights_state == "released":
            raise RuntimeError(
                "weights are released (/release_memory_occupation): call /resume_memory_occupation before updating them"
            )
        if self.fp8 is not None:
            tensors = self.fp8.dequantize_named(tensors)
        if self.weights_state == "reallocated" and tensors.keys() != self.checkpoint.keys():
            raise ValueError(
                f"after /resume_memory_occupation the engine holds no valid weights: the update must "
                f"carry all {len(self.checkpoint)} checkpoint tensors, got {len(tensors)}"
            )
        for name, tensor in tensors.items():
            if name not in self.checkpoint:
                raise ValueError(f"weight {name!r} is not a parameter of this checkpoint: send HF checkpoint names")
            if tuple(tensor.shape) != tuple(self.checkpoint[name].shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"checkpoint has {tuple(self.checkpoint[name].shape)}"
                )
        return tensors

    def _main(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` without the MTP layers (the draft's; the main model has no such parameters)."""
        return {name: tensor for name, tensor in state.items() if not is_mtp_name(name, self.num_layers)}

    def _build(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = self.model_class.from_pretrained(
            None, config=self.config, state_dict=self._main(state), dtype=torch.float32
        )
        return model.to(self.device)

    def _draft(self, state: dict[str, torch.Tensor]) -> MtpDraft | None:
        if not self.speculative_steps:
            return None
        return MtpDraft(self.model_class, self.config, state, self.device)

    def _load(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """`model` (not the live one) holding every tensor of `state` (a full checkpoint), converted
        as `from_pretrained` converts them: by the copies of `load_plan`, found at the first load
        and checked there against transformers' converter."""
        main = self._main(state)
        if self._plan is not None:
            load_with_plan(model, main, self._plan)
            return model
        self._convert(model, main)
        if self._converter_only:
            return model
        try:
            plan = load_plan(model, main)
            converted = {name: tensor.clone() for name, tensor in model_tensors(model).items()}
            load_with_plan(model, main, plan)
            for name, tensor in model_tensors(model).items():
                if not torch.equal(tensor, converted[name]):
                    raise ValueError(f"{name} differs from the converter's")
            self._plan = plan
        except ValueError as error:  # a family whose conversion is not copies: its converter each time
            log.warning("weight updates load through transformers' converter (%s)", error)
            self._converter_only = True
            self._convert(model, main)
        return model

    def _convert(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        info = convert_into(model, state, torch.float32)
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = [p for name, p in params.items() if name not in info.missing_keys]
        untied = {name for name in info.missing_keys if not any(params.get(name) is p for p in loaded)}
        problems = untied | info.unexpected_keys | set(info.mismatched_keys) | set(info.conversion_errors)
        assert not problems and not info.error_msgs, (
            f"the checkpoint did not load in place: {problems or info.error_msgs}"
        )

    def swap(self, staged: Staged) -> None:
        """Make a staged version live, model and draft together (scheduler thread, between forwards)."""
        model = staged.model
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if model is not self.model:  # no forward uses the replaced model after this: the next spare
            first, self._spare = self._spare is None, self.model
            if first:  # both models exist from now on: out of the cyclic collector's full passes
                gc.freeze()
        self.model = self._install(model)
        self.draft, self.checkpoint = staged.draft, staged.checkpoint
        self.weights_state = "loaded"

    def release_weights(self) -> None:
        """Free the model and checkpoint tensors (scheduler thread, no request running)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.model, self._spare, self.checkpoint, self.draft = [], None, None, None, None
        self.weights_state = "released"
        gc.unfreeze()  # the models' objects may be collected again
        gc.collect()

    def reallocate_weights(self) -> None:
        """Re-allocate the checkpoint tensors (zeros); a full weight update must follow."""
        if self.weights_state != "released":
            return  # SGLang: resuming what is not released is a no-op
        self.checkpoint = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in self._layout.items()}
        self.weights_state = "reallocated"

    def require_weights(self) -> None:
        if self.weights_state != "loaded":
            raise RuntimeError(
                f"the engine's weights are {self.weights_state} (/release_memory_occupation): "
                "/resume_memory_occupation and a full weight update must come first"
            )

    def weight_bytes(self) -> int:
        """Bytes held by the live and spare models' parameters and buffers and the checkpoint tensors."""
        storages = {}
        tensors = list((self.checkpoint or {}).values())
        for model in (self.model, self._spare):
            if model is not None:
                tensors += list(model.parameters()) + list(model.buffers())
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Bind `adapter` to the live model and hook its targets (scheduler thread, between forwards)."""
        self.require_weights()
        self.lora.add(adapter, self.model)
        self.swap(Staged(self.model, self.draft, self.checkpoint))

    def remove_lora(self, name: str) -> None:
        """Drop an adapter if loaded (scheduler thread; the server first waits until no request uses it)."""
        if name not in self.lora.adapters:
            return
        self.lora.remove(name)
        if self.model is not None:
            self.swap(Staged(self.model, self.draft, self.checkpoint))

    def _install(self, model: torch.nn.Module) -> torch.nn.Module:
        model.eval()
        self._hooks.extend(self.lora.install(model))
        recorder = getattr(model, "_can_record_outputs", {}).get("router_logits")
        if recorder is None:
            raise ValueError(f"{type(model).__name__} declares no router module: not a transformers MoE model")
        router_class = recorder.target_class
        for name, module in model.named_modules():
            if isinstance(module, router_class):
                match = _LAYER_INDEX.search(f".{name}.")
                assert match, f"router {name} is not inside a decoder layer"
                self._hooks.append(module.register_forward_hook(self._capture_hook(int(match.group(1)))))
        if not self._hooks:
            raise ValueError(f"{type(model).__name__} has no {router_class.__name__} modules")
        if self.speculative_steps:
            self._hooks.append(model.model.norm.register_forward_hook(self._hidden_hook))
        return model

    def _hidden_hook(self, module, args, output) -> None:
        self._hidden = output.detach()

    def _capture_hook(self, layer: int):
        def hook(module, args, output):
            self._captured[layer] = output[2].detach()  # (logits, weights, topk_indices)

        return hook

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
        adapters: list[str | None],
        score_inputs: bool = False,
    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor | None]:
        """One forward over `input_ids` [B, S] after `cache`; `attention_mask` [B, past + S] (left pad);
        `adapters`: the LoRA adapter of each row (None: base model).

        Returns the log-softmax of the last position [B, V] (float32, temperature 1), the routed
        experts of every fed position, int32 [B, S, num_layers, topk], and with `score_inputs` the
        fed tokens' own logprobs [B, S - 1] (column t: log p(input_ids[:, t + 1] | ...), for prompt
        logprobs; every position's logits are then computed), else None. Updates `cache` in place.
        """
        logprobs, routed = self._run(input_ids, attention_mask, cache, adapters, 0 if score_inputs else 1)
        inputs = None
        if score_inputs:
            inputs = logprobs[:, :-1].gather(-1, input_ids[:, 1:, None].to(logprobs.device)).squeeze(-1).cpu()
        return logprobs[:, -1].cpu(), routed, inputs

    @torch.no_grad()
    def verify(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache, adapters: list[str | None]
    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """`forward` that keeps every fed position (speculation's verifying forward): the log-softmax
        [B, S, V], the routed experts [B, S, num_layers, topk] and the final hidden states [B, S, H]."""
        logprobs, routed = self._run(input_ids, attention_mask, cache, adapters, 0)
        return logprobs.cpu(), routed, self.hidden

    @property
    def hidden(self) -> torch.Tensor:
        """The main model's final (normed) hidden states [B, S, H] of the last forward (speculation only)."""
        assert self._hidden is not None, "hidden states are captured with speculative_steps > 0"
        return self._hidden

    def _run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache, adapters, keep: int
    ) -> tuple[torch.Tensor, np.ndarray]:
        self.require_weights()
        batch, seq = input_ids.shape
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]
        self._captured.clear()
        self.lora.row_adapters = adapters
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        routed = np.zeros((batch, seq, self.num_layers, self.topk), dtype=np.int32)
        for layer, indices in self._captured.items():
            routed[:, :, layer, :] = indices.reshape(batch, seq, self.topk).cpu().numpy()
        return torch.log_softmax(out.logits.float(), dim=-1), routed

    def describe(self) -> dict:
        return {
            "architectures": list(self.config.architectures),
            "model_type": self.config.model_type,
            "num_hidden_layers": self.num_layers,
            "num_experts_per_tok": self.topk,
            "vocab_size": self.vocab_size,
            "lora_adapters": sorted(self.lora.adapters),
            "weights_state": self.weights_state,
            "weight_bytes": self.weight_bytes(),
        }
