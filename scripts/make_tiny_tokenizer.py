#!/usr/bin/env python
"""Build a servable dummy-weight model dir: a config.json plus a local tokenizer.

    python scripts/make_tiny_tokenizer.py --config scripts/sweep_configs/models/g4tiny_config.json \
        --out /tmp/g4tiny
    vllm serve /tmp/g4tiny --load-format dummy --enforce-eager

The tokenizer (byte-level BPE trained on a fixed corpus with the `tokenizers` library) has
exactly the model's vocab size (<= 4096 for the tiny Gemma-4 configs), pad 0 / eos 1 / bos 2,
and a Gemma-style chat template; see kvshare_connector/toolkit/tokenizer.py.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvshare_connector.toolkit.tokenizer import make_model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="model config.json")
    parser.add_argument("--out", type=Path, required=True, help="model dir to write")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="default: the config's vocab_size"
    )
    args = parser.parse_args()
    out = make_model_dir(args.config, args.out, args.vocab_size)
    print(f"wrote {out} (config.json, tokenizer.json, tokenizer_config.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
