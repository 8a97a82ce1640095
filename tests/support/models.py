"""Small real models for tests, made or found offline (no hub access)."""
from __future__ import annotations

from pathlib import Path


def make_tiny_llama(out: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, seed: int = 0, tie_embeddings: bool = False) -> Path:
    """Random-weight Llama with a byte-level BPE tokenizer trained on a few lines of text."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Reinforcement learning from verifiable rewards trains reasoning models.",
        "def add(a, b):\n    return a + b\n",
        "<think> 1 + 1 = 2. 2 + 2 = 4. 3 + 5 = 8. </think> \\boxed{8}",
    ] * 50
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>")
    hf_tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}assistant: {% endif %}")
    hf_tok.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, bos_token_id=hf_tok.bos_token_id,
                      eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
                      tie_word_embeddings=tie_embeddings, torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out

