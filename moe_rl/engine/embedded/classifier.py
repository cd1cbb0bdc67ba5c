"""The embedded engine for a reward model: an HF `*ForSequenceClassification` directory served with
SGLang's `/classify` route (what SGLang serves with `--is-embedding`), for discriminative judges
(`moe_rl.signals.judge`) on CPU.

`moe-rl serve DIR` picks it when DIR's config names a sequence-classification architecture
(`is_classifier`). Routes: `/classify` (SGLang's `EmbeddingReqInput`: `input_ids`, one list of
token ids or a list of them; the answer is SGLang's, `{"embedding": [the head's outputs],
"meta_info": {"id", "prompt_tokens", "weight_version"}}`, a list of them for a batch),
`/health`, `/health_generate`, `/model_info` (`is_generation: false`). Text, embeddings,
multimodal inputs and the other fields' non-default values are refused naming the field. One
forward at a time, off the event loop; the model runs in float32.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from pathlib import Path

import torch
from aiohttp import web

from moe_rl.engine import protocol

TAKEN = {"rid", "input_ids", "http_worker_ipc"}
DEFAULTS = {"log_metrics": True, "is_cross_encoder_request": False, "return_pooled_hidden_states": False}
"""`/classify` fields the embedded classifier ignores at these values (SGLang's defaults)."""


def is_classifier(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return any(name.endswith("ForSequenceClassification") for name in config.get("architectures") or [])


class ClassifierServer:
    def __init__(self, model_dir: str, weight_version: str = "0", device: str = "cpu"):
        # heavy: transformers, only in the engine process
        from transformers import AutoModelForSequenceClassification

        self.model_dir, self.weight_version = model_dir, weight_version
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.model.eval()
        self.device = device
        self._lock = threading.Lock()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/classify", self.classify)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        return app

    async def health(self, http: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(self, http: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.model_dir, "is_generation": False, "weight_version": self.weight_version}
        )

    async def classify(self, http: web.Request) -> web.Response:
        try:
            body = await http.json()
            batch = self._inputs(body)
        except ValueError as error:
            return web.json_response({"error": {"message": str(error)}, "success": False}, status=400)
        outputs = await asyncio.to_thread(self._forward, batch)
        rid = body.get("rid") or uuid.uuid4().hex
        answers = [
            {
                "embedding": output,
                "meta_info": {"id": f"{rid}-{i}", "prompt_tokens": len(ids), "weight_version": self.weight_version},
            }
            for i, (ids, output) in enumerate(zip(batch, outputs))
        ]
        single = bool(body["input_ids"]) and isinstance(body["input_ids"][0], int)
        return web.json_response(answers[0] if single else answers)

    def _inputs(self, body: object) -> list[list[int]]:
        """The request's token-id lists; ValueError naming a field the classifier does not take."""
        if not isinstance(body, dict):
            raise ValueError("/classify: the body must be a JSON object")
        if unknown := sorted(set(body) - protocol.REQUEST_FIELDS["/classify"]):
            raise ValueError(f"/classify: unknown field(s) {unknown}")
        for name, value in body.items():
            if name not in TAKEN and value is not None and value != DEFAULTS.get(name):
                raise ValueError(f"/classify: {name}={value!r} is not served by the embedded engine; send input_ids")
        ids = body.get("input_ids")
        batch = [ids] if isinstance(ids, list) and ids and isinstance(ids[0], int) else ids
        if not isinstance(batch, list) or not batch or not all(_token_ids(row) for row in batch):
            raise ValueError("/classify: input_ids must be a non-empty list of token ids, or a list of them")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for row in batch for t in row):
            raise ValueError(f"/classify: input_ids holds an id outside the vocabulary [0, {vocab})")
        return batch

    def _forward(self, batch: list[list[int]]) -> list[list[float]]:
        """The head's outputs at each sequence's last token, one sequence per forward (no padding)."""
        with self._lock, torch.no_grad():
            return [self.model(torch.tensor([ids], device=self.device)).logits[0].float().tolist() for ids in batch]


def _token_ids(row: object) -> bool:
    return isinstance(row, list) and bool(row) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)
