"""A small local tokenizer for dummy-weight test models (e.g. the tiny Gemma-4 configs).

``vllm serve <dir> --load-format dummy`` needs a tokenizer next to ``config.json`` to serve
text (OpenAI completions/chat, lm-eval). Nothing can be downloaded on the GPU host, so this
builds one with the ``tokenizers`` library: byte-level BPE (any text encodes, no unknowns)
trained on a fixed built-in corpus, so the result is the same on every machine.
Special ids follow the model config: pad 0, eos 1, bos 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"

#: Gemma-style turns; enough for lm-eval's ``--apply_chat_template`` through vLLM.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her they this which be or "
    "are an had not but what all were when we there can more if one about so out up into "
    "question answer what how many much total each left more less than number times sum "
    "apples pencils books dollars hours minutes days cost price buys sells has have gives "
    "plus minus multiplied divided equals is the answer step first then so therefore"
)


_SYLLABLES_TEXT = "ka ri to mu ne sa lo vi da pe zu ho fi ge ba no ta ru mi se"


def training_corpus() -> list[str]:
    """A deterministic corpus: arithmetic Q/A in the local task's style, common words, and
    pseudo-words from a fixed linear congruential sequence (enough pairs for ~4k merges)."""
    words, syllables = _WORDS_TEXT.split(), _SYLLABLES_TEXT.split()
    lines = []
    for a in range(0, 100, 3):
        for b in range(1, 60, 7):
            op = "+-*"[(a + b) % 3]
            lines.append(f"Question: What is {a} {op} {b}?\nAnswer: #### {a}")
    lines += [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    state = 12345
    for _ in range(400):
        pseudo = []
        for _ in range(12):
            word = ""
            for _ in range(1 + state % 4):
                state = (1103515245 * state + 12345) % 2**31
                word += syllables[(state >> 8) % len(syllables)]
            pseudo.append(word)
        lines.append(" ".join(pseudo))
    return lines


def build_tokenizer(vocab_size: int = 4096) -> Any:
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in (PAD, EOS, BOS)}
    if ids != {PAD: 0, EOS: 1, BOS: 2}:
        raise RuntimeError(f"special token ids {ids} do not match pad 0 / eos 1 / bos 2")
    # Dummy weights may emit any id below the model's vocab size: every id must decode.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<unused{i}>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 2)]
    )
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int = 4096, model_max_length: int = 4096) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"vocab {tok.get_vocab_size()} != {vocab_size}")
    tok.save(str(out_dir / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": "<unk>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out_dir


def make_model_dir(config_json: Path, out_dir: Path, vocab_size: int | None = None) -> Path:
    """A servable model dir: the given config.json plus a tokenizer sized to its vocab.

    ``generation_config.json`` pins eos to the config's eos so generation stops there.
    """
    config = json.loads(Path(config_json).read_text())
    vocab = vocab_size or int(config.get("vocab_size", 4096))
    vocab = min(vocab, int(config.get("vocab_size", vocab)))
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_json, out_dir / "config.json")
    write_tokenizer(out_dir, vocab, int(config.get("max_position_embeddings", 4096)))
    gen = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir
