#!/usr/bin/env python3
"""Rebuild data/prices.json from the price table the litellm package ships.

pare compiles data/prices.json into its binary: per chat model, its context window and its prices in
USD per million tokens (input, cached read, cache write for 5 minutes and for 1 hour, output). This
script reads litellm's `model_prices_and_context_window.json` (from an installed litellm, or the
path given) and keeps the chat models of the major providers under the names their APIs take.

    pip install litellm            # or: pip download litellm --no-deps, then unzip the wheel
    python3 data/refresh_prices.py [PATH_TO_JSON] > data/prices.json
"""

import importlib.util
import json
import pathlib
import re
import sys

# Providers in order of precedence: a model name two of them list keeps the first's figures (the
# model's own maker first, then the hosts of open models).
PROVIDERS = ["anthropic", "openai", "gemini", "xai", "deepseek", "mistral", "moonshot", "zai", "dashscope"]

# Chat-mode entries that are not conversation models an agent talks to.
SKIP = re.compile(r"^ft:|tts|audio|realtime|image|lyria|robotics|deep-research|computer-use|search|transcribe|embed")

NAMES = ("model_prices_and_context_window.json", "model_prices_and_context_window_backup.json")


def source_path(argv):
    if len(argv) > 1:
        return pathlib.Path(argv[1])
    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        sys.exit("litellm is not installed: pip install litellm, or give the JSON's path")
    root = pathlib.Path(spec.origin).parent
    for name in NAMES:
        if (root / name).exists():
            return root / name
    sys.exit(f"no {NAMES[0]} in {root}")


def package_version(path):
    """The litellm version the file came with: its dist-info beside the package, else `unknown`."""
    for info in sorted(path.parent.parent.glob("litellm-*.dist-info")):
        return info.name[len("litellm-") : -len(".dist-info")]
    return "unknown"


def per_million(cost):
    """A per-token cost as USD per million tokens, to 6 significant digits (no float noise)."""
    if cost is None:
        return None
    return float(f"{cost * 1e6:.6g}")


def entry(spec):
    price = {
        "window": spec.get("max_input_tokens"),
        "input": per_million(spec.get("input_cost_per_token")),
        "cached": per_million(spec.get("cache_read_input_token_cost")),
        "write": per_million(spec.get("cache_creation_input_token_cost")),
        "write_1h": per_million(spec.get("cache_creation_input_token_cost_above_1hr")),
        "output": per_million(spec.get("output_cost_per_token")),
    }
    # A write "price" of 0 (DeepSeek) means writes are not billed apart: they are input.
    for key in ("write", "write_1h"):
        if not price[key]:
            price[key] = None
    return {k: v for k, v in price.items() if v is not None}


def main():
    path = source_path(sys.argv)
    table = json.loads(path.read_text())
    models = {}
    for provider in PROVIDERS:
        for key, spec in table.items():
            if not isinstance(spec, dict) or spec.get("litellm_provider") != provider or spec.get("mode") != "chat":
                continue
            name = key.split("/", 1)[1] if key.startswith(provider + "/") else key
            if SKIP.search(name) or name in models:
                continue
            price = entry(spec)
            if not {"window", "input", "output"} <= price.keys():
                continue
            models[name] = price
            # Anthropic's names with dashes (claude-sonnet-4-5) are written with a dot on OpenRouter
            # and other gateways (anthropic/claude-sonnet-4.5).
            dotted = re.sub(r"^(claude-[a-z]+-\d+)-(\d)$", r"\1.\2", name)
            if provider == "anthropic" and dotted != name:
                models.setdefault(dotted, price)
    version = package_version(path)
    lines = [
        "{",
        '"source": ' + json.dumps(f"litellm {version} {NAMES[0]}") + ",",
        '"unit": "USD per million tokens",',
        '"models": {',
    ]
    names = sorted(models)
    for idx, name in enumerate(names):
        comma = "," if idx + 1 < len(names) else ""
        lines.append(json.dumps(name) + ": " + json.dumps(models[name], separators=(",", ":")) + comma)
    lines += ["}", "}"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
