"""What the `gpu` tier measures, for `moe-rl plan` (`moe_rl/plan/planner.py`: `measured_efficiency`).

`record(name, value, unit)` merges one figure into the JSON file named by `$MOE_RL_GPU_METRICS`
(`scripts/gpu_check.sh` sets it to `benchmarks/gpu_metrics.json`) with the GPU, torch and date;
without that variable nothing is written (a plain `pytest -m gpu` run just prints the figure).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch


def record(name: str, value: float, unit: str) -> None:
    print(f"gpu tier measured: {name} = {value:.4g} {unit}")
    path = os.environ.get("MOE_RL_GPU_METRICS")
    if not path:
        return
    file = Path(path)
    data = json.loads(file.read_text()) if file.is_file() else {}
    data.setdefault("measured", {})[name] = {
        "value": value,
        "unit": unit,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
