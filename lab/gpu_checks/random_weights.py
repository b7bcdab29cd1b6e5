#!/usr/bin/env python3
"""Random-init real weights for the packaged Gemma-4 configs, in a directory vLLM 0.26 loads.

Dummy weights give uniform logits, so a KV check built on them proves little; random-init
weights make every layer's KV depend on the prompt. transformers builds the model from the
packaged config (fixed torch seed), saves safetensors; then the packaged config.json goes
back (vLLM needs its exact fields) and placeholders are added for what transformers 5.17
leaves out of KV-sharing layers (``self_attn.k_proj``, ``v_proj``, ``k_norm``) but vLLM
0.26's loader requires (its sharing layers keep a fused ``qkv_proj`` and a ``k_norm``; they
never use them: they read their target's KV).

    python -m lab.gpu_checks.random_weights make --model g4tiny [--dest /tmp/kvshare-weights]
    python -m lab.gpu_checks.random_weights check DIR    # names vs vLLM's Gemma4 (CPU, tiny)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

PLACEHOLDERS = "kvshare-sharing-placeholders.safetensors"
DONE = "kvshare-weights.json"  # written last: a directory without it is incomplete
SHARER_PARAMS = ("k_proj.weight", "v_proj.weight", "k_norm.weight")


def sharing_targets(config: dict[str, Any]) -> dict[int, int]:
    """Gemma-4's rule: each of the last ``num_kv_shared_layers`` layers reads the last
    earlier layer of its attention type."""
    types = config["layer_types"]
    first = config["num_hidden_layers"] - config.get("num_kv_shared_layers", 0)
    return {
        i: max(j for j in range(first) if types[j] == types[i])
        for i in range(first, config["num_hidden_layers"])
    }


def weights_dir(model: str, root: Path, seed: int = 0) -> Path:
    return root / f"{model}-seed{seed}"


def make_weights(model: str, root: Path, device: str = "cuda", seed: int = 0) -> Path:
    """Write (once) random-init bf16 weights of a packaged model under ``root``."""
    target = weights_dir(model, root, seed)
    if (target / DONE).exists():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvshare_connector.demo.cpu_stack import model_dir

    with tempfile.TemporaryDirectory() as tmp:
        packaged = model_dir(model, Path(tmp)) / "config.json"
        config_text = packaged.read_text()
        config = AutoConfig.from_pretrained(packaged.parent)
    if target.exists():
        shutil.rmtree(target)
    torch.manual_seed(seed)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf_model.save_pretrained(target, safe_serialization=True)
    (target / "config.json").write_text(config_text)  # vLLM reads the packaged fields
    state = hf_model.state_dict()
    placeholders = sharer_placeholders(json.loads(config_text), state, seed)
    save_file({k: v.cpu().contiguous() for k, v in placeholders.items()}, target / PLACEHOLDERS)
    index = target / "model.safetensors.index.json"
    if index.exists():  # sharded: vLLM loads only the files the index names
        data = json.loads(index.read_text())
        data["weight_map"].update({k: PLACEHOLDERS for k in placeholders})
        index.write_text(json.dumps(data, indent=2))
    del hf_model, state
    (target / DONE).write_text(
        json.dumps({"model": model, "seed": seed, "placeholders": sorted(placeholders)})
    )
    return target


def sharer_placeholders(config: dict[str, Any], state: dict[str, Any], seed: int) -> dict:
    """Tensors for the k/v projections and k norm of each sharing layer, shaped like its
    target's (small random values: never used, but must be finite)."""
    import torch

    prefix = _layer_prefix(state)
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for sharer, target in sharing_targets(config).items():
        for param in SHARER_PARAMS:
            name = f"{prefix}{sharer}.self_attn.{param}"
            if name in state:
                continue
            like = state[f"{prefix}{target}.self_attn.{param}"]
            if param.startswith("k_norm"):
                value = torch.ones(like.shape, dtype=like.dtype)
            else:
                value = (torch.randn(like.shape, generator=gen) * 0.02).to(like.dtype)
            out[name] = value
    return out


def _layer_prefix(state: dict[str, Any]) -> str:
    """'model.layers.' (or 'model.language_model.layers.'), as transformers named them."""
    for name in state:
        if ".layers.0.self_attn.q_proj.weight" in name:
            return name.split("0.self_attn.q_proj.weight")[0]
    raise ValueError("no layers.0.self_attn.q_proj.weight in the state dict")


def check_against_vllm(weights: Path) -> list[str]:
    """Parameters of vLLM's Gemma4ForCausalLM that the checkpoint leaves unloaded (what
    vLLM's default loader rejects): builds the model on CPU, so tiny configs only."""
    from unittest import mock

    import torch
    from safetensors.torch import load_file
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM
    from vllm.platforms import current_platform

    from kvshare_connector.demo import cpu_stack

    model_config = ModelConfig(
        model=str(weights),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        hf_overrides=cpu_stack.hf_overrides_for(weights / "config.json"),
    )
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    cpu_stack._ensure_distributed(vllm_config)
    choice = classmethod(cpu_stack._cuda_backend_choice)  # the backend as CUDA picks it
    with (
        mock.patch.object(type(current_platform), "get_attn_backend_cls", choice),
        set_current_vllm_config(vllm_config),
        torch.device("cpu"),
    ):
        model = Gemma4ForCausalLM(vllm_config=vllm_config, prefix="")

    def tensors() -> Any:
        for path in sorted(weights.glob("*.safetensors")):
            yield from load_file(path).items()

    with set_current_vllm_config(vllm_config):
        loaded = model.load_weights(tensors())
    expected = {name for name, _ in model.named_parameters()}
    return sorted(expected - set(loaded))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make")
    make.add_argument("--model", required=True)
    make.add_argument("--dest", default="/tmp/kvshare-weights")
    make.add_argument("--device", default="cuda")
    make.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check")
    check.add_argument("dir")
    args = parser.parse_args()
    if args.command == "make":
        print(make_weights(args.model, Path(args.dest), args.device, args.seed))
    else:
        missing = check_against_vllm(Path(args.dir))
        print(json.dumps({"unloaded": missing}))
        sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
