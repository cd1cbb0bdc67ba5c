"""What `moe-rl eval CONFIG --checkpoint DIR` runs: a saved policy evaluated alone.

The config's `eval:` section is evaluated on engines started on the checkpoint, with the same
`Evaluator` as during training (`moe_rl.rollout.evaluation`):
1. the checkpoint becomes an HF directory the engines load: an HF model directory is used as it
   is (a run's `final_hf/`, `initial_hf/`, any safetensors model); a Megatron checkpoint written by
   `moe-rl convert hf-to-megatron` is converted first, on one gloo rank, into `OUTPUT/hf/`;
2. `engines.count` engines of `engines.kind` start on it (embedded on CPU, SGLang on GPUs);
3. every eval dataset is evaluated; rows go to `OUTPUT/metrics.jsonl` (and TensorBoard) at
   `--step`, samples to `OUTPUT/eval/<name>/step_N.jsonl`.
No Ray: the engines are the only processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from moe_rl.config import RunConfig
from moe_rl.conversion.directory import HF_FILES_DIR, is_converted
from moe_rl.engine.client import EngineClient, engine_name
from moe_rl.engine.pool import EnginePool
from moe_rl.metrics import MetricsLogger
from moe_rl.rollout.dump import SampleDump
from moe_rl.rollout.evaluation import EvalResult, Evaluator

CONVERT_SHARD_BYTES = 5 << 30
CONVERT_BUCKET_BYTES = 512 << 20


def run(config: RunConfig, checkpoint: str, output: Path, step: int = 0) -> list[EvalResult]:
    """Evaluate `checkpoint` on every dataset of `config.eval`; writes into `output`."""
    output.mkdir(parents=True, exist_ok=True)
    hf_dir = hf_directory(checkpoint, output)
    tokenizer_dir = config.model.tokenizer or _tokenizer_of(hf_dir) or config.model.tokenizer_dir
    engines = start_engines(config, hf_dir, output, step)
    try:
        results = asyncio.run(_evaluate(config, [e.url for e in engines], tokenizer_dir, step))
    finally:
        for engine in engines:
            engine.stop()
    logger = MetricsLogger(output)
    try:
        for result in results:
            logger.log(step, result.metrics)
            if config.eval.dump:
                SampleDump(output / "eval" / result.name).write(step, result.records)
    finally:
        logger.close()
    return results


def hf_directory(checkpoint: str, output: Path) -> str:
    """An HF directory the engines can load: `checkpoint` itself, or its conversion."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ValueError(f"--checkpoint={checkpoint!r}: not a directory; pass an HF model or a converted checkpoint")
    if not is_converted(path):
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--checkpoint={checkpoint!r}: neither an HF model (config.json + safetensors) nor a "
                "`moe-rl convert hf-to-megatron` checkpoint (moe_rl_meta.json)"
            )
        return str(path)
    # heavy: megatron-core and a gloo rank, only for a Megatron checkpoint
    from moe_rl.conversion.ranks import megatron_to_hf
    from parallel.layout import ParallelLayout
    from parallel.world import spawn

    out = output / "hf"
    if not (out / "config.json").is_file():
        layout = ParallelLayout(world_size=1)
        spawn(megatron_to_hf, 1, layout, str(path), str(out), CONVERT_SHARD_BYTES, CONVERT_BUCKET_BYTES, None)
    return str(out)


def start_engines(config: RunConfig, hf_dir: str, output: Path, step: int) -> list:
    """`engines.count` engine servers on `hf_dir`, serving weight version `step`."""
    cfg = config.engines
    engines = []
    try:
        for i in range(cfg.count):
            log_path = output / f"{engine_name(i)}.log"
            if cfg.kind == "embedded":
                # heavy: only the engine launcher's process helpers
                from moe_rl.engine.process import EmbeddedConfig, launch_embedded

                engines.append(
                    launch_embedded(
                        EmbeddedConfig(
                            model_path=hf_dir, weight_version=str(step), max_batch=cfg.max_batch, threads=cfg.threads
                        ),
                        log_path=log_path,
                    )
                )
            else:
                from moe_rl.engine.sglang_launcher import launch_sglang
                from moe_rl.plan.launch import engine_sglang_config

                sglang = engine_sglang_config(cfg, hf_dir, host="127.0.0.1", weight_version=str(step))
                engines.append(launch_sglang(sglang, log_path=log_path))
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


async def _evaluate(config: RunConfig, urls: list[str], tokenizer_dir: str | None, step: int) -> list[EvalResult]:
    clients = [EngineClient(url, kind=config.engines.kind, name=engine_name(i)) for i, url in enumerate(urls)]
    pool = EnginePool(clients)
    evaluator = Evaluator(config.eval, config.rollout_or_default, pool, tokenizer_dir)
    try:
        await evaluator.start()
        return await evaluator.evaluate(step)
    finally:
        await evaluator.close()
        await pool.close()


def _tokenizer_of(hf_dir: str) -> str | None:
    """`hf_dir` when it holds a tokenizer (a converted checkpoint's `hf_files/` are copied along)."""
    for directory in (Path(hf_dir), Path(hf_dir) / HF_FILES_DIR):
        if (directory / "tokenizer_config.json").is_file() or (directory / "tokenizer.json").is_file():
            return str(directory)
    return None
