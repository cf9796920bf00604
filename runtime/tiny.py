"""A tiny Llama-architecture model for tests, made locally: no downloads.

Random weights (seeded, so the same config gives the same bytes of weights) and a byte-level
BPE tokenizer trained with ``tokenizers`` on the shipped grammar-correction prompt set. The
result is an ordinary Hugging Face safetensors checkpoint that transformers and vLLM load.
The shapes respect vLLM's CPU backend (head_dim >= 32) and keep every Linear dimension a
multiple of 64, as FP8 kernels like.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .prompts import DEFAULT_PROMPTS, load_prompts

log = logging.getLogger(__name__)

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"


@dataclass(frozen=True)
class TinyModelConfig:
    vocab_size: int = 512  # BPE target; the model's vocab is this rounded up to 64
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # head_dim 32: the CPU attention's minimum
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    dtype: str = "bfloat16"
    seed: int = 0
    max_shard_size: str | None = None  # e.g. "200KB" to get a sharded checkpoint


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, UNK, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD
    )


def make_tiny_model(
    out_dir: Path, config: TinyModelConfig = TinyModelConfig(), prompts: Path = DEFAULT_PROMPTS
) -> Path:
    """Write a tiny random Llama checkpoint with a locally trained tokenizer to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = load_prompts(prompts)
    texts = [r.prompt + " " + r.target for r in records]
    tokenizer = train_tokenizer(texts, config.vocab_size)
    vocab = -(-len(tokenizer) // 64) * 64

    mcfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=config.dtype,
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(mcfg).to(getattr(torch, config.dtype))
    kwargs = {"max_shard_size": config.max_shard_size} if config.max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # vLLM reads these keys when it builds its tokenizer; keep them explicit.
    tc = json.loads((out_dir / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["model_max_length"] = config.max_position_embeddings
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    log.info(
        "tiny model written to %s (vocab %d, %d layers)", out_dir, vocab, mcfg.num_hidden_layers
    )
    return out_dir
