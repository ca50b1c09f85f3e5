"""Which Python distributions the GPU check needs and this interpreter lacks (no imports run).

Prints one line per missing distribution, pinned as in pyproject.toml where the project pins
it (``vllm==0.26.0``, ``aiokafka==0.12.0``, ...), else unpinned (pip picks what vllm's or the
project's pins allow). Exit status 0 when nothing is missing, 1 otherwise.

The list is what ``bench/gpu/throughput.py`` imports through the infer stage (handler, settings,
telemetry, decode) plus the ``gpu`` extra (vllm, torch, transformers, tokenizers), found by
importing them on a development machine; the check is ``importlib.util.find_spec`` per
top-level module, so it takes well under a second.

Usage: python bench/gpu/missing.py [--gpu-only]
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: top-level module -> distribution
GPU = {"vllm": "vllm", "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers"}
HARNESS = {
    "aiokafka": "aiokafka", "async_timeout": "async-timeout", "boto3": "boto3", "botocore": "botocore",
    "s3transfer": "s3transfer", "jmespath": "jmespath", "cachetools": "cachetools",
    "opentelemetry": "opentelemetry-sdk", "orjson": "orjson", "pydantic": "pydantic", "pydantic_core": "pydantic-core",
    "pydantic_settings": "pydantic-settings", "annotated_types": "annotated-types",
    "typing_inspection": "typing-inspection", "dotenv": "python-dotenv", "prometheus_client": "prometheus-client",
    "rapidfuzz": "rapidfuzz", "tenacity": "tenacity", "PIL": "pillow", "numpy": "numpy",
    "pynvml": "nvidia-ml-py", "dateutil": "python-dateutil", "urllib3": "urllib3", "typing_extensions": "typing-extensions",
}


def pins() -> dict[str, str]:
    """``name -> "name==version"`` for every exact pin in pyproject.toml (all extras too)."""
    text = (ROOT / "pyproject.toml").read_text()
    out = {}
    for name, ver in re.findall(r'"([A-Za-z0-9_.\-]+)==([^"\s;]+)"', text):
        out[name.lower().replace("_", "-")] = f"{name}=={ver}"
    return out


def bundle_pins() -> list[tuple[str, str]]:
    """``(name, version)`` per line of bench/gpu/bundle-requirements.txt (what the offline bundle
    carries), in file order, names lower-cased; comment lines skipped."""
    lines = (ROOT / "bench/gpu/bundle-requirements.txt").read_text().splitlines()
    pairs = [ln.strip().split("==", 1) for ln in lines if ln.strip() and not ln.startswith("#")]
    return [(n.lower(), v) for n, v in pairs]


def missing(modules: dict[str, str]) -> list[str]:
    p = pins()
    out = []
    for mod, dist in modules.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found and dist not in [d.split("==")[0].lower() for d in out]:
            out.append(p.get(dist.lower(), dist))
    return out


def main() -> None:
    modules = dict(GPU) if "--gpu-only" in sys.argv else {**GPU, **HARNESS}
    gone = missing(modules)
    for d in gone:
        print(d)
    sys.exit(1 if gone else 0)


if __name__ == "__main__":
    main()
