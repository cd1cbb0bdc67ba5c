"""What the RL tests that drive their own `RLCluster` subclass (fault injection, fleet changes)
share: one run with that cluster, and one call on an engine by URL."""

from __future__ import annotations

import dataclasses
import json
from typing import Awaitable, Callable, TypeVar

from moe_rl.config import EngineConfig
from moe_rl.engine.client import EngineClient
from tests.rl.test_rl_modes import tiny_config

Answer = TypeVar("Answer")


def run_with_cluster(
    cluster_class, tmp_path, monkeypatch, steps: int, engines: int, **engine_options
) -> tuple[dict, object, list[dict]]:
    """A fully-async `tiny_config` run of `steps` steps on `engines` engines (`engine_options`: more
    `engines.*` fields), with `cluster_class` as the driver's cluster; the summary, the cluster and
    the metrics rows."""
    from moe_rl.jobs import rl

    clusters = []
    monkeypatch.setattr(rl, "RLCluster", lambda *a: clusters.append(cluster_class(*a)) or clusters[-1])
    engine_config = EngineConfig(count=engines, **engine_options)
    config = dataclasses.replace(tiny_config(tmp_path, "fully_async"), steps=steps, engines=engine_config)
    summary = rl.run(config)
    rows = [json.loads(line) for line in open(f"{config.output_dir}/metrics.jsonl")]
    return summary, clusters[0], rows


async def on_engine(url: str, call: Callable[[EngineClient], Awaitable[Answer]]) -> Answer:
    """`call` with a client of the engine at `url`, closed after."""
    client = EngineClient(url)
    try:
        return await call(client)
    finally:
        await client.close()
