"""LoRA adapters (PEFT format) for the embedded engine: reading one and binding it to the model.

An adapter is a PEFT `adapter_config.json` (`r`, `lora_alpha`, optional `use_rslora`) and its
tensors, named `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r]; it
comes from a directory (`adapter_model.safetensors`, `/load_lora_adapter`) or as tensors
(`/load_lora_adapter_from_tensors`). Targets, once bound to the live model (`bind`):
- any `nn.Linear`: attention projections (q/k/v/o, MLA's q_a/q_b/kv_a/kv_b), dense MLPs, shared
  experts;
- transformers 5's fused routed experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), in
  either format PEFT produces: per expert, `<experts>.<e>.gate_proj|up_proj|down_proj` (2-D
  A/B per expert; Mixtral's checkpoint names `block_sparse_moe.experts.<e>.w1|w3|w2` too, mapped
  with transformers' own checkpoint renamings), or PEFT's `target_parameters` format on the fused
  parameters (`<experts>[.base_layer].lora_A.weight` [E*r, in] expert-major, `lora_B.weight`
  [out, r*E] expert-minor; which parameter a pair belongs to is read from its shapes).

Scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`) is folded into B at load.
PEFT options the engine cannot apply (DoRA, rank/alpha patterns, modules_to_save, LoRA bias,
fan_in_fan_out, added tokens) are refused, as SGLang refuses DoRA and added tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

_PREFIX = "base_model.model."
TENSOR_PATH = "__tensor__"
"""The `lora_path` SGLang records for an adapter loaded from tensors."""
_EXPERT_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT = re.compile(r"^(?P<experts>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_REFUSED = {  # PEFT config key -> what it would need; refused unless at PEFT's default
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained modules",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "trainable_token_indices": "trained token embeddings",
}


@dataclasses.dataclass(frozen=True)
class ExpertsLora:
    """One adapter on one fused-experts module, per expert, scale folded into B."""

    gate_up: tuple[torch.Tensor, torch.Tensor] | None
    """A [E, r, H], B [E, 2I, r] (delta of `gate_up_proj[e]` = B[e] @ A[e]), or None."""
    down: tuple[torch.Tensor, torch.Tensor] | None
    """A [E, r, I], B [E, H, r], or None."""


def is_fused_experts(module: torch.nn.Module) -> bool:
    """transformers 5's experts module: 3-D `gate_up_proj` and `down_proj` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3


def check_experts_layout(module: torch.nn.Module, name: str) -> None:
    """The layout `lora_hooks` computes with: [gate; up] concatenated, [out, in], no bias."""
    expected = {
        "is_transposed": False,
        "has_bias": False,
        "is_concatenated": True,
        "has_gate": True,
        "has_post_expert_norm": False,
    }
    wrong = {k: getattr(module, k) for k, v in expected.items() if getattr(module, k, v) != v}
    if wrong:
        raise ValueError(
            f"lora: experts {name} ({type(module).__name__}) has {wrong}; the embedded engine's "
            f"expert LoRA takes {expected} (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5 experts)"
        )


class LoraAdapter:
    """A parsed adapter: `name`, `path` (TENSOR_PATH when loaded from tensors), `scale`, and after
    `bind`, `linear` {module name: (A [r, in], B*scale [out, r])} and `experts` {module name: ExpertsLora}."""

    def __init__(self, name: str, path: str, config: dict, tensors: dict[str, torch.Tensor]):
        if not isinstance(config, dict):
            raise ValueError("lora: the adapter config must be a JSON object (PEFT's adapter_config.json)")
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"lora: peft_type={config.get('peft_type')!r}; only LORA adapters are served")
        for key, what in _REFUSED.items():
            if config.get(key):
                raise ValueError(f"lora: {key}={config[key]!r} ({what}) is not supported by the embedded engine")
        if config.get("lora_bias") or config.get("bias", "none") != "none":
            raise ValueError("lora: adapters with bias terms are not supported by the embedded engine")
        rank = config.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lora: adapter_config r={rank!r} must be a positive integer")
        alpha = float(config.get("lora_alpha", rank))
        self.name, self.path, self.rank = name, path, rank
        self.scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """PEFT module path (prefix and `.base_layer` kept) -> (A, B) as given."""
        for key in tensors:
            if not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise ValueError(f"lora: tensor {key!r} is not a lora_A/lora_B weight; the engine applies only those")
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                b = tensors.get(key[: -len("lora_A.weight")] + "lora_B.weight")
                if b is None:
                    raise ValueError(f"lora: {key} has no matching lora_B")
                if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                    raise ValueError(
                        f"lora: {key} {tuple(a.shape)} and its lora_B {tuple(b.shape)} are not [r, in] / [out, r]"
                    )
                self.pairs[key[: -len(".lora_A.weight")]] = (a.float(), b.float())
        if len(self.pairs) * 2 != len(tensors):
            raise ValueError("lora: some lora_B weights have no matching lora_A")
        if not self.pairs:
            raise ValueError("lora: the adapter holds no lora_A/lora_B weights")
        self.linear: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.experts: dict[str, ExpertsLora] = {}

    @classmethod
    def from_dir(cls, name: str, path: str | Path) -> "LoraAdapter":

        path = Path(path)
        config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise ValueError(
                f"lora_path: {path} needs adapter_config.json and adapter_model.safetensors (PEFT save_pretrained)"
            )
        try:
            config = json.loads(config_file.read_text())
            tensors = load_file(str(weights_file))
        except (ValueError, OSError) as error:
            raise ValueError(f"lora_path: {path}: {error}") from None
        return cls(name, str(path), config, tensors)

    # -- binding to the model -------------------------------------------------------------------

    def bind(self, model: torch.nn.Module) -> None:
        """Resolve every target on `model` and check its shapes (raises ValueError naming it)."""
        modules = dict(model.named_modules())
        rename = _renamer(model)
        per_expert: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        fused: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for peft_name, (a, b) in self.pairs.items():
            target = _strip(peft_name)
            if not _resolves(target, modules):  # a checkpoint name (Mixtral's block_sparse_moe): rename it
                target = rename(target)
            module = modules.get(target)
            match = _PER_EXPERT.match(target)
            if isinstance(module, torch.nn.Linear):
                if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
                    raise ValueError(
                        f"lora: {peft_name} A {tuple(a.shape)} / B {tuple(b.shape)} do not fit {target} "
                        f"(in {module.in_features}, out {module.out_features})"
                    )
                self.linear[target] = (a, b * self.scale)
            elif module is not None and is_fused_experts(module):
                fused.setdefault(target, []).append((a, b))
            elif match and is_fused_experts(modules.get(match["experts"], torch.nn.Module())):
                key = (int(match["expert"]), _EXPERT_PROJ[match["proj"]])
                per_expert.setdefault(match["experts"], {})[key] = (a, b)
            else:
                raise ValueError(
                    f"lora: target {peft_name!r} ({target}) is neither an nn.Linear nor the fused "
                    f"experts of this {type(model).__name__}"
                )
        for target in fused.keys() & per_expert.keys():
            raise ValueError(f"lora: {target} has adapters in both the per-expert and the fused (3-D) format")
        for target, pairs in fused.items():
            self.experts[target] = self._fused(target, modules[target], pairs)
        for target, pieces in per_expert.items():
            self.experts[target] = self._per_expert(target, modules[target], pieces)

    def _fused(self, target: str, experts: torch.nn.Module, pairs) -> ExpertsLora:
        check_experts_layout(experts, target)
        num, out_in = experts.gate_up_proj.shape[0], {}
        shapes = {"gate_up": tuple(experts.gate_up_proj.shape[1:]), "down": tuple(experts.down_proj.shape[1:])}
        for a, b in pairs:
            which = [k for k, (out, inp) in shapes.items() if a.shape[1] == inp and b.shape[0] == out]
            if len(which) != 1 or a.shape[0] % num or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"lora: fused adapter on {target} A {tuple(a.shape)} / B {tuple(b.shape)} fits neither "
                    f"gate_up_proj {shapes['gate_up']} nor down_proj {shapes['down']} of {num} experts"
                )
            if which[0] in out_in:
                raise ValueError(f"lora: two fused adapters on {target}.{which[0]}_proj")
            rank = a.shape[0] // num
            out_in[which[0]] = (
                a.reshape(num, rank, -1),  # PEFT: A expert-major, B expert-minor
                b.reshape(b.shape[0], rank, num).permute(2, 0, 1).contiguous() * self.scale,
            )
        return ExpertsLora(gate_up=out_in.get("gate_up"), down=out_in.get("down"))

    def _per_expert(self, target: str, experts: torch.nn.Module, pieces) -> ExpertsLora:
        check_experts_layout(experts, target)
        num, two_inter, hidden = experts.gate_up_proj.shape
        inter = two_inter // 2
        want = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        for (expert, proj), (a, b) in pieces.items():
            if expert >= num or (b.shape[0], a.shape[1]) != want[proj]:
                raise ValueError(
                    f"lora: {target}.{expert}.{proj} A {tuple(a.shape)} / B {tuple(b.shape)} does not fit "
                    f"{num} experts with {proj} [out, in] = {want[proj]}"
                )
        ranks = {proj: max((a.shape[0] for (_, p), (a, _) in pieces.items() if p == proj), default=0) for proj in want}
        gate_up = down = None
        if ranks["gate"] or ranks["up"]:  # [gate; up] rows: A stacks both ranks, B is block diagonal
            r_g, r_u = ranks["gate"], ranks["up"]
            a_all, b_all = torch.zeros(num, r_g + r_u, hidden), torch.zeros(num, two_inter, r_g + r_u)
            for (e, proj), (a, b) in pieces.items():
                if proj == "gate":
                    a_all[e, : a.shape[0]], b_all[e, :inter, : a.shape[0]] = a, b
                elif proj == "up":
                    a_all[e, r_g : r_g + a.shape[0]], b_all[e, inter:, r_g : r_g + a.shape[0]] = a, b
            gate_up = (a_all, b_all * self.scale)
        if ranks["down"]:
            a_all, b_all = torch.zeros(num, ranks["down"], inter), torch.zeros(num, hidden, ranks["down"])
            for (e, proj), (a, b) in pieces.items():
                if proj == "down":
                    a_all[e, : a.shape[0]], b_all[e, :, : a.shape[0]] = a, b
            down = (a_all, b_all * self.scale)
        return ExpertsLora(gate_up=gate_up, down=down)


def _strip(peft_name: str) -> str:
    name = peft_name[len(_PREFIX) :] if peft_name.startswith(_PREFIX) else peft_name
    return re.sub(r"(\.base_layer)+$", "", name.replace(".base_layer.", "."))


def _resolves(target: str, modules: dict) -> bool:
    if target in modules:
        return True
    match = _PER_EXPERT.match(target)
    return bool(match) and is_fused_experts(modules.get(match["experts"], torch.nn.Module()))


def _renamer(model: torch.nn.Module):
    """Checkpoint module names -> the live model's (transformers' WeightRenaming entries for this
    model type, e.g. Mixtral's `.block_sparse_moe.` -> `.mlp.`)."""
    renamings = []
    try:
        # heavy: transformers, only where an HF config, model or tokenizer is read
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        for entry in get_checkpoint_conversion_mapping(model.config.model_type) or []:
            if isinstance(entry, WeightRenaming):
                renamings.append((entry.source_patterns[0], entry.target_patterns[0]))
    except (ImportError, AttributeError):  # an older transformers: names are taken as they are
        pass

    def rename(name: str) -> str:
        key = name + ".weight"
        for source, target in renamings:
            key = re.sub(source, target, key)
        return key[: -len(".weight")]

    return rename
