"""Expert load: how a batch's routed token slots spread over each MoE layer's experts.

Counts come from routing rows [tokens, num_hidden_layers, topk] (a sample's `routed_experts`, or the
trainer's recorded natural routing): per MoE layer, how many of the tokens' top-k slots each expert
got. Rows of dense layers are not read. From the counts of one layer, with E experts:
- share of expert e = its slots / the layer's slots (the shares sum to 1);
- max violation = max share / mean share - 1 = E x max share - 1 (prime-rl's load-balance
  statistic): 0 when balanced, at most E / topk - 1 (every token sends one of its topk distinct
  slots to the same expert);
- entropy = -sum share x ln share (nats): ln E when balanced.

Logged each RL step (`load_metrics`) as `experts/max_violation/layer{i}`, `experts/entropy/layer{i}`
(i the HF layer index) and `experts/max_violation_mean` over the MoE layers; the trainer's natural
routing under `experts/trainer/...`. The counts themselves (MoE layers x experts per step: too
many scalars for a metrics row on a large model) go to `experts.jsonl` in the run directory, one
row per step, which `moe-rl report` draws as `plots/experts.png`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EXPERTS_FILE = "experts.jsonl"
DUMP_MAX_VALUES = 1024
"""A dump record keeps its sample's counts when MoE layers x experts is at most this (`sample_counts`):
the demo's 2 x 4; a Qwen3-30B-A3B sample (48 x 128) would add more numbers than its text has."""


@dataclass(frozen=True)
class MoELayers:
    """Which rows of routing data name experts, and how many experts there are."""

    layers: tuple[int, ...]
    """HF indices of the MoE layers (`parallel.bridges.Bridge.moe_layers`)."""
    num_experts: int

    def counts(self, routed: np.ndarray) -> np.ndarray:
        """`routed_counts` of routing rows [tokens, num_hidden_layers, topk] over these layers."""
        return routed_counts(routed, list(self.layers), self.num_experts)

    def sample_counts(self, routed: np.ndarray | None) -> list[list[int]] | None:
        """A dump record's per-layer counts of one sample's routing rows, or None without routing or
        past `DUMP_MAX_VALUES`."""
        if routed is None or len(self.layers) * self.num_experts > DUMP_MAX_VALUES:
            return None
        return self.counts(routed).tolist()


def routed_counts(routed: np.ndarray, layers: list[int], num_experts: int) -> np.ndarray:
    """int64 [len(layers), num_experts]: the slots of routing rows `routed` [tokens, num_hidden_layers,
    topk] (every row a routed token) that went to each expert, per MoE layer in `layers`."""
    ids = routed[:, layers].astype(np.int64)  # [tokens, MoE layers, topk]
    offsets = np.arange(len(layers), dtype=np.int64)[None, :, None] * num_experts
    flat = np.bincount((ids + offsets).ravel(), minlength=len(layers) * num_experts)
    return flat.reshape(len(layers), num_experts)


def load_metrics(layers: list[int], counts: np.ndarray, prefix: str = "experts") -> dict[str, float]:
    """`{prefix}/max_violation/layer{i}`, `{prefix}/entropy/layer{i}` and `{prefix}/max_violation_mean`
    of `counts` [len(layers), experts] (module docstring); layers without a routed slot are left out."""
    metrics: dict[str, float] = {}
    violations = []
    for layer, row in zip(layers, np.asarray(counts, dtype=np.float64)):
        if row.sum() == 0:
            continue
        share = row / row.sum()
        violations.append(float(len(share) * share.max() - 1))
        metrics[f"{prefix}/max_violation/layer{layer}"] = violations[-1]
        nonzero = share[share > 0]
        metrics[f"{prefix}/entropy/layer{layer}"] = float(-(nonzero * np.log(nonzero)).sum())
    if violations:
        metrics[f"{prefix}/max_violation_mean"] = sum(violations) / len(violations)
    return metrics


def write_expert_load(run_dir: str | Path, step: int, layers: list[int], counts: np.ndarray) -> None:
    """Append step `step`'s counts [len(layers), experts] to the run's `experts.jsonl`."""
    row = {"step": step, "layers": list(layers), "counts": np.asarray(counts).tolist()}
    with open(Path(run_dir) / EXPERTS_FILE, "a") as file:
        file.write(json.dumps(row) + "\n")


def read_expert_load(run_dir: str | Path) -> list[dict]:
    """The rows of the run's `experts.jsonl` ({step, layers, counts}); [] when it has none."""
    path = Path(run_dir) / EXPERTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
