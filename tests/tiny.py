"""Tiny real models and data for service tests: a 2-layer Llama with a BPE tokenizer
trained here (ChatML turn markers as single tokens, a chat template), saved as a Hugging
Face directory, and chat JSONL lines."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [
    "apple",
    "bread",
    "cloud",
    "river",
    "stone",
    "light",
    "music",
    "garden",
    "winter",
    "paper",
    "ocean",
    "mountain",
    "forest",
    "window",
    "candle",
    "silver",
    "thunder",
    "meadow",
    "lantern",
    "harbor",
]


def chat_lines(n: int, offset: int = 0) -> list[str]:
    """`n` chat examples: 'What does <word> mean?' -> a short, learnable answer."""
    out = []
    for i in range(offset, offset + n):
        w = WORDS[i % len(WORDS)]
        out.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What does {w} mean?"},
                        {"role": "assistant", "content": f"{w} is a word about {w} things."},
                    ]
                }
            )
        )
    return out


def make_tiny_llama(out: Path, hidden: int = 64, layers: int = 2, context: int = 256) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from service.data.datasets import CHATML_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [json.loads(x)["messages"][1]["content"] for x in chat_lines(40)] + [
        "system user assistant What does mean?"
    ]
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=context,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    fast.save_pretrained(str(out))
    return out


def make_tiny_embedder(out: Path, hidden: int = 32, window: int = 24) -> Path:
    """A sentence-transformers directory: a 1-layer random BERT with a WordPiece tokenizer
    trained here, mean-pooled and normalized, its window `window` tokens."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        [" ".join(WORDS), *(json.loads(x)["messages"][1]["content"] for x in chat_lines(20))],
        trainers.WordPieceTrainer(vocab_size=200, special_tokens=special, show_progress=False),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    cfg = BertConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    raw = out.with_name(out.name + "-bert")
    BertModel(cfg).save_pretrained(str(raw))
    fast.save_pretrained(str(raw))
    model = SentenceTransformer(
        modules=[
            st.Transformer(str(raw), max_seq_length=window),
            st.Pooling(hidden, pooling_mode="mean"),
            st.Normalize(),
        ],
        device="cpu",
    )
    model.save(str(out))
    return out
