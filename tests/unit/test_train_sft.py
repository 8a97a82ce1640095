"""SFT cold start: completion-only cross-entropy equals HF's own loss/gradients; CLI end to end."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.records import TrainSequence
from megatron_rl.train.sft import SFTExample, read_jsonl, to_sequences, tokenize_record

from test_train_step import SAME_LAYOUT, hf_model, make_config  # noqa: E402  (tests/unit on sys.path)


def _seqs(vocab: int, n: int = 5, seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = 2 + i % 3, 3 + (3 * i) % 6
        ids = torch.randint(3, vocab, (p + c,), generator=g).tolist()
        out.append(TrainSequence(ids, p, [0.0] * c, advantage=0.0))
    return out


def test_sft_loss_and_grads_equal_hf_completion_only_cross_entropy(tiny_llama_dir):
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    seqs = _seqs(hf.config.vocab_size)
    # HF reference: one right-padded batch, labels -100 on prompt and padding; HF averages over tokens
    width = max(len(s.token_ids) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        att[i, :n] = 1
        labels[i, s.prompt_len:n] = ids[i, s.prompt_len:n]
    hf.zero_grad()
    ref = hf(input_ids=ids, attention_mask=att, labels=labels).loss
    ref.backward()

    trainer = Trainer(make_config(tiny_llama_dir, micro_batch_tokens=20))
    out = forward_backward(trainer.model, seqs, trainer.ctx, objective="sft")
    assert out.n_micro_batches >= 2
    assert out.metrics["loss"] == pytest.approx(float(ref), rel=1e-5)
    params = dict(trainer.model_chunks[0].named_parameters())
    hf_params = dict(hf.named_parameters())
    for meg, hf_name in SAME_LAYOUT.items():
        torch.testing.assert_close(params[meg].main_grad, hf_params[hf_name].grad, rtol=1e-4, atol=1e-6)


def test_tokenize_record_forms(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    a = tokenize_record({"prompt": "1 + 1?", "completion": "<think> 2 </think> \\boxed{2}"}, tok)
    b = tokenize_record({"messages": [{"role": "user", "content": "1 + 1?"},
                                      {"role": "assistant", "content": "<think> 2 </think> \\boxed{2}"}]}, tok)
    assert a == b and a.completion_ids[-1] == tok.eos_token_id
    assert tok.decode(a.completion_ids[:-1]) == "<think> 2 </think> \\boxed{2}"
    assert tokenize_record({"prompt_ids": [1, 2], "completion_ids": [3]}) == SFTExample([1, 2], [3])
    with pytest.raises(ValueError, match="neither"):
        tokenize_record({"text": "x"}, tok)
    seqs, dropped = to_sequences([SFTExample([1] * 3, [2] * 10), SFTExample([1] * 9, [2])], max_tokens=8)
    assert dropped == 1 and len(seqs[0].token_ids) == 8 and seqs[0].prompt_len == 3


def test_a_multi_turn_trace_trains_the_assistant_turns_only():
    """A trace with a tool call: its ids are the template's rendering of the whole conversation (as an
    episode lays it out), and the loss mask is 1 exactly on the assistant messages and their stop tokens."""
    from megatron_rl.train.hf_source import resolve_model

    tok = resolve_model("smollm2-135m").tokenizer()
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(123 * 456)"}}</tool_call>'
    msgs = [{"role": "user", "content": "What is 123 * 456?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "56088"}, {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes: \\boxed{56088}"}]
    ex = tokenize_record({"messages": msgs}, tok)
    whole = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
    assert ex.prompt_ids + ex.completion_ids == whole[:-1]  # the template's newline after the last stop token
    end = tok.convert_tokens_to_ids("<|im_end|>")
    trained = [t for t, m in zip(ex.completion_ids, ex.loss_mask) if m]
    assert trained == tok(call, add_special_tokens=False).input_ids + [end] + \
        tok("Yes: \\boxed{56088}", add_special_tokens=False).input_ids + [end]
    (seq,), _ = to_sequences([ex], max_tokens=4096)
    assert seq.loss_mask == ex.loss_mask and seq.n_loss_tokens == len(trained)
    with pytest.raises(ValueError, match="two assistant messages in a row"):
        tokenize_record({"messages": msgs[:2] + [{"role": "assistant", "content": "again"}]}, tok)


def test_an_ids_record_may_carry_its_loss_mask():
    """An episode already laid out in ids (data.synthetic.episode_trace): its mask is kept, one 0/1 per id."""
    ex = tokenize_record({"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "loss_mask": [1, 0, 1]})
    assert ex == SFTExample([1, 2], [3, 4, 5], [1, 0, 1])
    for bad in ([1, 0], [1, 2, 1], "101"):
        with pytest.raises(ValueError, match="loss_mask must be a list of 0/1, one per completion id"):
            tokenize_record({"prompt_ids": [1], "completion_ids": [3, 4, 5], "loss_mask": bad})


def test_sft_cli_trains_logs_and_checkpoints(tiny_llama_dir, tmp_path):
    from megatron_rl import cli
    from megatron_rl.train.checkpoint import read_common

    data = tmp_path / "traces.jsonl"
    lines = [{"prompt": f"{i} + {i}?", "completion": f"<think> {i} + {i} = {2 * i} </think> \\boxed{{{2 * i}}}"}
             for i in range(1, 5)]
    data.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = tmp_path / "run"
    rc = cli.main(["sft", f"trainer.model={tiny_llama_dir}", "trainer.precision=fp32", "trainer.lr=3e-3",
                   "trainer.micro_batch_tokens=64", f"run.output_dir={out}", "--data", str(data),
                   "--batch-size", "4", "--epochs", "4"])
    assert rc == 0
    metrics = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and metrics[-1]["loss"] < metrics[0]["loss"]
    common = read_common(out / "checkpoints")
    assert common["step"] == 4 and common["extra"]["user"]["sft"]["epochs"] == 4
    assert len(read_jsonl(data)) == 4


GOOD_TRACE = '{"prompt": "1 + 1?", "completion": "2"}\n'


@pytest.mark.parametrize("second_line, words", [
    (b'{"prompt": "caf\xe9?", "completion": "1"}\n', "not UTF-8"),  # Latin-1, not UTF-8
    (b'{"prompt": "1 + 2?", \n', "invalid JSON"),
    (b'["1 + 2?", "3"]\n', "must be a JSON object"),
])
def test_a_bad_line_of_the_sft_data_is_a_one_line_error_naming_file_and_line(second_line, words, tmp_path, capsys):
    from megatron_rl import cli

    data = tmp_path / "traces.jsonl"
    data.write_bytes(GOOD_TRACE.encode() + second_line)
    rc = cli.main(["sft", f"run.output_dir={tmp_path / 'run'}", "--data", str(data)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{data}:2:" in lines[0] and words in lines[0], err
    assert not (tmp_path / "run").exists()  # refused before any training or output
