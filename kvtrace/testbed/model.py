"""A tiny Llama built locally, so a real vLLM prefill/decode pair can run with no model hub.

Two layers, hidden size 256, 4 attention heads over 2 KV heads of 64 dimensions (the CPU
attention backend wants head sizes of 32 to 512), random weights from a fixed seed, bf16,
about 3 M parameters; a byte-level BPE tokenizer (vocabulary 4096) trained with
``tokenizers`` on this Python's own standard-library sources, read in sorted order. The
same inputs give the same folder; its name carries a hash of the recipe so a changed
recipe never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

RECIPE = {
    "architecture": "LlamaForCausalLM",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "seed": 0,
    "dtype": "bfloat16",
    "tokenizer_corpus_files": 120,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "kvtrace" / f"tiny-llama-{recipe_hash()}"


def corpus_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[: RECIPE["tokenizer_corpus_files"]]


def kv_bytes_per_token(dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token occupies across all layers (K and V)."""
    return (RECIPE["num_hidden_layers"] * 2 * RECIPE["num_key_value_heads"] * RECIPE["head_dim"]
            * dtype_bytes)


def build(out_dir: Path | None = None) -> Path:
    """Build the model folder if it is not there yet; returns its path."""
    out_dir = Path(out_dir) if out_dir is not None else default_dir()
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
    trainer = trainers.BpeTrainer(vocab_size=RECIPE["vocab_size"], special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    config = LlamaConfig(
        vocab_size=RECIPE["vocab_size"], hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"], num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"], head_dim=RECIPE["head_dim"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(RECIPE["seed"])
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "READY").write_text(recipe_hash())
    tmp.rename(out_dir)
    return out_dir


if __name__ == "__main__":
    print(build())
