"""`EngineClient`: one async client for SGLang and the embedded engine, over SGLang's HTTP API.

Every method is one route with SGLang 0.5.23's field names (`moe_rl.engine.protocol`). Errors:
`EngineError` (a RuntimeError) carries the route, HTTP status and the engine's message (status None:
no HTTP answer at all, e.g. connection refused or reset because the engine process died). Transient
failures (connection refused/reset, timeouts, HTTP 502/503/504) are retried with exponential
backoff; `/generate` is retried only when the request never reached the engine (connect errors,
503), so a retry cannot run a rollout twice.

The client implements `sync.engine_api.EngineEndpoint` (the weight sender drives it). Sessions are
kept per event loop, so one client may be used from the trainer's loop and the sender's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any, Iterable, Mapping
from urllib.parse import quote

import aiohttp
import numpy as np
import torch

from moe_rl.engine import protocol
from moe_rl.engine.lora_tensors import LoraTensorsBody
from moe_rl.engine.sampling import SamplingParams
from moe_rl.sample import decode_routed_experts

TRANSIENT_STATUS = (502, 503, 504)
KINDS = ("embedded", "sglang")


def _lora_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
    return name


class EngineError(RuntimeError):
    def __init__(self, engine: str, path: str, status: int | None, message: str):
        super().__init__(f"{engine} {path}: HTTP {status}: {message}" if status else f"{engine} {path}: {message}")
        self.path, self.status, self.message = path, status, message


@dataclasses.dataclass(kw_only=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    logprobs: list[float] | None
    """Per output token: the model's log-softmax at temperature 1 of the sampled token."""
    finish_reason: str
    """"stop" | "length" | "abort" (SGLang's finish_reason["type"])."""
    weight_version: int
    weight_versions: list[int]
    """Weight version of each output token (from SGLang's `weight_versions` spans when present).
    Engines label versions with strings ("3", SGLang's form); they are integers from here on."""
    routed_experts: np.ndarray | None
    """[prompt + output - 1 - routed_experts_start_len, num_hidden_layers, topk], or None; of
    `routing_dtype(num_experts)` (uint8 / int16) when the client knows the model's expert count."""
    meta_info: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreResult:
    """What `EngineClient.score` read from a prefill-only `/generate` of exact ids."""

    logprobs: list[float]
    """[len(ids) - 1]: log p(ids[t] | ids[:t]) for t = 1.. (temperature 1), under the served weights."""
    routed_experts: np.ndarray | None
    """[len(ids) - 1, num_hidden_layers, topk]: the experts of every token but the last (SGLang's rows),
    or None when not asked for."""
    weight_version: int
    """The version the engine served the request with."""


def engine_name(index: int) -> str:
    """The RL job's name of engine `index` (its clients, the weight sender, the rollout pool and
    the restart bookkeeping all use it); `engine_index` reads it back."""
    return f"engine-{index}"


def engine_index(name: str) -> int:
    return int(name.removeprefix("engine-"))


def _generate_options(
    return_logprob: bool, return_routed_experts: bool, routed_experts_start_len: int, lora_path: str | None
) -> dict:
    """The /generate fields beside the prompt and its sampling (those at SGLang's default left out)."""
    options = {"return_logprob": return_logprob, "return_routed_experts": return_routed_experts}
    if routed_experts_start_len:
        options["routed_experts_start_len"] = routed_experts_start_len
    if lora_path is not None:
        options["lora_path"] = lora_path
    return options


class EngineClient:
    def __init__(
        self,
        url: str,
        *,
        kind: str = "embedded",
        name: str | None = None,
        num_hidden_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
        timeout_s: float = 60.0,
        generate_timeout_s: float = 3600.0,
        retries: int = 3,
        backoff_s: float = 0.25,
    ):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: use one of {KINDS}")
        self.url, self.kind = url.rstrip("/"), kind
        self.verifies_checksums = kind == "embedded"  # SGLang has no bucket checksum field
        self.applies_deltas = kind == "embedded"  # SGLang 0.5.23's distributed route has no custom loader
        self.stages_versions = kind == "embedded"  # SGLang loads each bucket into the live model
        self.name = name or f"{kind} engine ({self.url})"
        self._group_ranks: int | None = None
        self.timeout_s, self.generate_timeout_s = timeout_s, generate_timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self._layout = (num_hidden_layers, topk) if num_hidden_layers and topk else None
        # routed experts are stored as uint8/int16 from the decode on (`routing_dtype`); int32 when
        # the model's expert count is not given
        self.num_experts = num_experts
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    # -- transport ---------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = self._sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return session

    async def close(self) -> None:
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    async def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout_s: float | None = None,
        idempotent: bool = True,
    ) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        for attempt in range(self.retries + 1):
            try:
                async with self._session().request(method, self.url + path, json=body, timeout=timeout) as response:
                    text = await response.text()
                    if response.status in TRANSIENT_STATUS and attempt < self.retries:
                        await asyncio.sleep(self.backoff_s * 2**attempt)
                        continue
                    return self._parse(path, response.status, text)
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:  # no HTTP answer (e.g. the engine died)
                never_sent = isinstance(error, aiohttp.ClientConnectorError)
                if attempt == self.retries or not (idempotent or never_sent):
                    raise EngineError(self.name, path, None, f"{type(error).__name__}: {error}") from error
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _parse(self, path: str, status: int, text: str) -> Any:
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = text
        if status != 200 or (isinstance(data, dict) and data.get("success") is False):
            message = data
            if isinstance(data, dict):
                error = data.get("error")
                message = (
                    (error.get("message") if isinstance(error, dict) else error)
                    or data.get("message")
                    or data.get("error_message")
                    or data
                )  # error_message: SGLang's LoRAUpdateOutput
            raise EngineError(self.name, path, status, str(message).strip())
        return data

    # -- timeline ----------------------------------------------------------------------------------

    async def start_trace(self) -> bool:
        """Embedded engines: record their spans (`moe_rl.trace`; an extension route) under this
        client's name; False for SGLang, whose timeline lane is the client's view (`EnginePool`)."""
        if self.kind != "embedded":
            return False
        await self._request("POST", f"/start_trace?process={quote(self.name)}")
        return True

    async def stop_trace(self) -> dict:
        """The spans an embedded engine recorded since `start_trace` (`Tracer.stop`)."""
        return await self._request("POST", "/stop_trace")

    # -- generation --------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """POST /generate for one prompt, sampled as `sampling` says; see `GenerateResult`."""
        rid = rid or uuid.uuid4().hex
        body = {
            "rid": rid,
            "input_ids": list(input_ids),
            "sampling_params": sampling.body(),
            **_generate_options(return_logprob, return_routed_experts, routed_experts_start_len, lora_path),
        }
        data = await self._request("POST", "/generate", body, timeout_s=self.generate_timeout_s, idempotent=False)
        return await self._result(rid, data)

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling: list[SamplingParams],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rids: list[str] | None = None,
        lora_path: str | None = None,
    ) -> list[GenerateResult]:
        """SGLang's batch form of POST /generate: one exchange for several prompts (`input_ids` a list
        of lists, one `sampling_params` and one `rid` each; the other options are the batch's),
        answered once every item has ended, with one `GenerateResult` per item in order."""
        if len(sampling) != len(input_ids) or (rids is not None and len(rids) != len(input_ids)):
            raise ValueError("generate_batch: give one sampling (and one rid) per input_ids entry")
        rids = rids or [uuid.uuid4().hex for _ in input_ids]
        body = {
            "rid": rids,
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": [params.body() for params in sampling],
            **_generate_options(return_logprob, return_routed_experts, routed_experts_start_len, lora_path),
        }
        data = await self._request("POST", "/generate", body, timeout_s=self.generate_timeout_s, idempotent=False)
        if not isinstance(data, list) or len(data) != len(rids):
            raise EngineError(self.name, "/generate", None, f"a batch of {len(rids)} got {str(data)[:200]!r}")
        return [await self._result(rid, item) for rid, item in zip(rids, data)]

    async def score(
        self, input_ids: list[int], *, return_routed_experts: bool = True, lora_path: str | None = None
    ) -> ScoreResult:
        """Score `input_ids` as they are: a prefill-only POST /generate (`max_new_tokens=0`,
        `return_logprob`, `logprob_start_len=0`), SGLang's route for prompt logprobs, the one a served
        teacher answers too. SGLang gives `meta_info.input_token_logprobs` [logprob, id, None] per
        token (the first logprob None) and routed experts for every token but the last. Raises
        EngineError when the engine answers otherwise (an aborted request, a short list)."""
        body = {
            "rid": uuid.uuid4().hex,
            "input_ids": list(input_ids),
            "sampling_params": SamplingParams(max_new_tokens=0).body(),
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_routed_experts": return_routed_experts,
        }
        if lora_path is not None:
            body["lora_path"] = lora_path
        data = await self._request("POST", "/generate", body, timeout_s=self.generate_timeout_s, idempotent=False)
        result = await self._result(body["rid"], data)
        # one entry per id (SGLang reports the id of an entry as 0 at and past vocab_size - 1: the
        # count is what is checked)
        entries = result.meta_info.get("input_token_logprobs") or []
        if result.finish_reason == "abort" or len(entries) != len(input_ids):
            raise EngineError(
                self.name,
                "/generate",
                None,
                f"scoring {len(input_ids)} ids: finish {result.finish_reason!r}, {len(entries)} prompt logprobs",
            )
        return ScoreResult(
            logprobs=[float(entry[0]) for entry in entries[1:]],
            routed_experts=result.routed_experts,
            weight_version=result.weight_version,
        )

    async def classify(self, input_ids: list[int]) -> float:
        """SGLang's /classify (a reward model's sequence-classification head, served with
        `--is-embedding`; the embedded engine on a `*ForSequenceClassification` directory): its first
        output for `input_ids`, the score."""
        data = await self._request(
            "POST", "/classify", {"input_ids": list(input_ids)}, timeout_s=self.generate_timeout_s
        )
        return float(data["embedding"][0])

    async def _result(self, rid: str, data: dict) -> GenerateResult:
        meta = data["meta_info"]
        output_ids = list(data["output_ids"])
        logprobs = (
            [float(entry[0]) for entry in meta["output_token_logprobs"]] if "output_token_logprobs" in meta else None
        )
        served = self._version(meta["weight_version"])
        versions = [served] * len(output_ids)
        for span in meta.get("weight_versions") or []:
            versions[span["start"] : span["end"]] = [self._version(span["version"])] * (span["end"] - span["start"])
        routed = None
        if meta.get("routed_experts") is not None:
            layers, topk = await self._routing_layout()
            routed = decode_routed_experts(meta["routed_experts"], layers, topk, self.num_experts)
        reason = meta.get("finish_reason") or {}
        return GenerateResult(
            rid=rid,
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=reason.get("type", "abort") if isinstance(reason, dict) else str(reason),
            weight_version=served,
            weight_versions=versions,
            routed_experts=routed,
            meta_info=meta,
        )

    def _version(self, label: object) -> int:
        """An engine's weight-version label as the integer the project counts with."""
        version = protocol.weight_version_number(label)
        if version is not None:
            return version
        raise EngineError(
            self.name,
            "/generate",
            None,
            f"weight_version {label!r} is not a non-negative integer: start the engine with an integer "
            "--weight-version (moe-rl's launchers pass the run's version)",
        )

    async def _routing_layout(self) -> tuple[int, int]:
        if self._layout is None:
            info = await self.model_info()
            if "num_hidden_layers" not in info or "num_experts_per_tok" not in info:
                raise ValueError(
                    f"{self.name}: /model_info does not say num_hidden_layers/num_experts_per_tok; pass "
                    "num_hidden_layers= and topk= to EngineClient to decode routed experts"
                )
            self._layout = (int(info["num_hidden_layers"]), int(info["num_experts_per_tok"]))
        return self._layout

    # -- control -----------------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in protocol.PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: use one of {protocol.PAUSE_MODES}")
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None) -> None:
        """Abort one request by rid, or every request when rid is None."""
        await self._request("POST", "/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def model_info(self) -> dict:
        return await self._request("GET", "/model_info")

    async def server_info(self) -> dict:
        """GET /server_info (SGLang 0.5.23; older servers only have /get_server_info)."""
        try:
            return await self._request("GET", "/server_info")
        except EngineError as error:
            if error.status != 404:
                raise
            return await self._request("GET", "/get_server_info")

    async def num_group_ranks(self) -> int:
        """The ranks this engine puts into a weight-update group: SGLang joins every TP rank
        (`rank_offset + tp_rank`), so its `tp_size`; the embedded engine reports 1."""
        if self._group_ranks is None:
            info = await self.server_info()
            for field in ("dp_size", "pp_size"):  # SGLang's ranks join at rank_offset + tp_rank only
                if int(info.get(field, 1)) != 1:
                    raise ValueError(
                        f"{self.name}: {field}={info[field]}; SGLang's weight-update group "
                        f"needs {field} 1: run one engine per replica (engines.count) instead"
                    )
            self._group_ranks = int(info["tp_size"])
        return self._group_ranks

    async def custom_weight_loaders(self) -> list[str]:
        """SGLang's `--custom-weight-loader` import paths (`load_format`s it runs); none on the
        embedded engine."""
        if self.kind == "embedded":
            return []
        return list((await self.server_info()).get("custom_weight_loader") or [])

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=min(self.timeout_s, 10.0))
            return True
        except EngineError:
            return False

    # -- LoRA (SGLang's LoRAUpdateOutput answers: `loaded_adapters` {name: lora_path} is returned) ----

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, str]:
        """Load the PEFT adapter directory `lora_path` (a path on the engine's machine) as `lora_name`;
        `generate(..., lora_path=lora_name)` then uses it. A loaded name is refused (unload it first)."""
        body = {"lora_name": _lora_name(lora_name), "lora_path": str(lora_path), "pinned": bool(pinned)}
        data = await self._request(
            "POST", "/load_lora_adapter", body, timeout_s=max(self.timeout_s, 600.0), idempotent=False
        )  # a repeated load is refused: retry only if never sent
        return dict(data.get("loaded_adapters") or {})

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        tp_size: int = 1,
        *,
        load_format: str | None = "flattened_bucket",
        pinned: bool = False,
        verify: bool = True,
    ) -> dict[str, str]:
        """Load an adapter sent by value: `config_dict` is PEFT's adapter_config.json, `named_tensors`
        its tensors under PEFT names (`lora_tensors.read_adapter_dir(path)` reads a saved adapter).
        `tp_size`: the engine's TP ranks (SGLang decodes one payload per rank; the embedded engine
        has one); `verify` sends `expected_checksums` (every rank checks each tensor's sha256).
        The body is SGLang 0.5.23's `LoadLoRAAdapterFromTensorsReqInput` (see `lora_tensors`)."""
        body = LoraTensorsBody.build(
            _lora_name(lora_name),
            config_dict,
            named_tensors,
            tp_size,
            load_format=load_format,
            pinned=pinned,
            verify=verify,
        )
        data = await self._request(
            "POST",
            "/load_lora_adapter_from_tensors",
            body.to_json(),
            timeout_s=max(self.timeout_s, 600.0),
            idempotent=False,
        )
        return dict(data.get("loaded_adapters") or {})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Unload `lora_name`: new requests naming it fail at once; the engine answers after the
        requests still using it have finished (SGLang's rule), so this may take a generation's time."""
        data = await self._request(
            "POST",
            "/unload_lora_adapter",
            {"lora_name": _lora_name(lora_name)},
            timeout_s=self.generate_timeout_s,
            idempotent=False,
        )
        return dict(data.get("loaded_adapters") or {})

    # -- weights (sync.engine_api.EngineEndpoint) --------------------------------------------------

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str, abort_all_requests: bool = False
    ) -> None:
        await self._request(
            "POST",
            "/update_weights_from_disk",
            {
                "model_path": str(model_path),
                "weight_version": str(weight_version),
                "abort_all_requests": abort_all_requests,
            },
            timeout_s=max(self.timeout_s, 600.0),
        )

    async def feed_peers(
        self, engines: dict[str, str], bucket_bytes: int, timeout_s: float, backend: str | None = None
    ) -> dict:
        """Embedded engines (an extension route): send the version this engine serves to `engines`
        (name -> URL) and commit it there (`sync.peer_feed`); returns {version, bytes, seconds,
        engines}. Not idempotent: a feed cut off is not repeated here (the caller decides)."""
        if self.kind != "embedded":
            raise ValueError(f"{self.name}: only embedded engines feed peers (SGLang 0.5.23 has no such route)")
        body = {"engines": dict(engines), "bucket_bytes": bucket_bytes, "timeout_s": timeout_s, "backend": backend}
        return await self._request("POST", "/feed_peers", body, timeout_s=timeout_s + 30, idempotent=False)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        await self._request(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
            timeout_s=max(self.timeout_s, 600.0),
            idempotent=False,
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        """Open the weight-update session SGLang requires around the bucket routes."""
        await self._request("POST", "/begin_weight_update", {}, timeout_s=max(self.timeout_s, 600.0))

    async def end_weight_update(self) -> None:
        """Close it (SGLang finalizes the loaded weights); also after a failed update."""
        await self._request("POST", "/end_weight_update", {}, timeout_s=max(self.timeout_s, 600.0))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        load_format: str,
        checksum: str | None,
    ) -> None:
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "load_format": load_format,
            "flush_cache": False,
        }
        if weight_version is not None:  # SGLang relabels the engine at once: the sender sends None
            body["weight_version"] = str(weight_version)
        if checksum is not None and self.verifies_checksums:  # not an SGLang field (sync.engine_api)
            body["checksum"] = checksum
        await self._request(
            "POST", "/update_weights_from_distributed", body, timeout_s=max(self.timeout_s, 600.0), idempotent=False
        )

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str, weight_version: str | None
    ) -> None:
        """CUDA-IPC bucket for a colocated SGLang engine (sync's `cuda_ipc` transport; GPU only)."""
        body = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": False,
            "abort_all_requests": False,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._request(
            "POST", "/update_weights_from_tensor", body, timeout_s=max(self.timeout_s, 600.0), idempotent=False
        )

    async def update_weight_version(self, new_version: str) -> None:
        # abort_all_requests=False: requests paused in place keep going under the new version.
        await self._request(
            "POST",
            "/update_weight_version",
            {"new_version": str(new_version), "abort_all_requests": False},
            timeout_s=max(self.timeout_s, 600.0),
        )

    # -- memory occupation (colocated RL: engines share the trainer's GPUs) ------------------------

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the engine's memory for `tags` (protocol.MEMORY_TAGS; None = all) while the trainer
        uses the GPUs. The engine must be idle (pause generation first); SGLang needs
        `--enable-memory-saver`. Generation is refused until resumed and re-synced."""
        body = {"tags": list(tags)} if tags else {}
        await self._request("POST", "/release_memory_occupation", body, timeout_s=max(self.timeout_s, 600.0))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Re-allocate what `release_memory_occupation` freed; released weights hold nothing valid
        until the next full weight update (the trainer re-syncs after resuming)."""
        body = {"tags": list(tags)} if tags else {}
        await self._request("POST", "/resume_memory_occupation", body, timeout_s=max(self.timeout_s, 600.0))
