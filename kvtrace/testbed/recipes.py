"""Tiny Llamas built locally, so a real vLLM prefill/decode pair can run with no model hub.

Two recipes (:data:`RECIPES`), random weights from a fixed seed, bf16, and a byte-level BPE
tokenizer (vocabulary 4096) trained with ``tokenizers`` on this Python's own standard-library
sources, read in sorted order:

* ``tiny`` — two layers, hidden size 256, 4 attention heads over 2 KV heads of 64 dimensions
  (the CPU attention backend wants head sizes of 32 to 512), about 3 M parameters: 1 KiB of
  KV cache per token, so prefill and decode dominate and the pair starts fast.
* ``kv-heavy`` — transfer-heavy: 32 layers of 8 KV heads (64 dimensions; 16 query heads) with
  tiny's hidden size of 256 and small MLP, so each layer computes little while the KV cache is
  64 KiB per token (Qwen3-32B: 256 KiB). On a CPU with loopback UCX, moving the KV cache and
  coordinating the move become a visible share of TTFT instead of noise beside prefill. (With
  as many query heads as KV heads, vLLM 0.32's CPU decode worker died of SIGILL on this
  machine's CPU; two query heads per KV head, as in tiny, runs.)

The same inputs give the same folder; its name carries a hash of the recipe so a changed
recipe never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

_COMMON = {"architecture": "LlamaForCausalLM", "head_dim": 64, "vocab_size": 4096,
           "max_position_embeddings": 4096, "seed": 0, "dtype": "bfloat16", "tokenizer_corpus_files": 120}
RECIPES: dict[str, dict] = {
    "tiny": {**_COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "kv-heavy": {**_COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 32,
                 "num_attention_heads": 16, "num_key_value_heads": 8},
}
DEFAULT_RECIPE = "tiny"
RECIPE = RECIPES[DEFAULT_RECIPE]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]


def _recipe(name: str) -> dict:
    if name not in RECIPES:
        raise ValueError(f"model {name!r}: choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_hash(name: str = DEFAULT_RECIPE) -> str:
    return hashlib.sha256(json.dumps(_recipe(name), sort_keys=True).encode()).hexdigest()[:12]


def default_dir(name: str = DEFAULT_RECIPE) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    prefix = "tiny-llama" if name == DEFAULT_RECIPE else f"{name}-llama"
    return cache / "kvtrace" / f"{prefix}-{recipe_hash(name)}"


def corpus_files(recipe: dict = RECIPE) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[: recipe["tokenizer_corpus_files"]]


def kv_bytes_per_token(name: str = DEFAULT_RECIPE, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token occupies across all layers (K and V)."""
    recipe = _recipe(name)
    return recipe["num_hidden_layers"] * 2 * recipe["num_key_value_heads"] * recipe["head_dim"] * dtype_bytes


def build(out_dir: Path | None = None, name: str = DEFAULT_RECIPE) -> Path:
    """Build the model folder of a recipe if it is not there yet; returns its path."""
    recipe = _recipe(name)
    out_dir = Path(out_dir) if out_dir is not None else default_dir(name)
    if (out_dir / "READY").exists():
        return out_dir
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=recipe["vocab_size"], special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(corpus_files(recipe), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    config = LlamaConfig(
        vocab_size=recipe["vocab_size"], hidden_size=recipe["hidden_size"],
        intermediate_size=recipe["intermediate_size"], num_hidden_layers=recipe["num_hidden_layers"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_key_value_heads"], head_dim=recipe["head_dim"],
        max_position_embeddings=recipe["max_position_embeddings"],
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(recipe["seed"])
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "READY").write_text(recipe_hash(name))
    tmp.rename(out_dir)
    return out_dir


if __name__ == "__main__":
    import sys

    print(build(name=sys.argv[1] if len(sys.argv) > 1 else DEFAULT_RECIPE))
