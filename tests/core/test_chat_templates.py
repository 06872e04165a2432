"""ChatFormat on real models' chat templates: a multi-turn prompt is the exact generated ids plus only the
newly rendered messages, and it reads as the official template renders the same conversation.

The templates are the models' own (their no-tools branches, as shipped with Qwen2.5-Instruct, Qwen3 and
SmolLM2-Instruct), set on Gyre's tiny tokenizer, which has the ChatML special tokens.

    .venv/bin/python -m pytest tests/core/test_chat_templates.py -q
"""
from __future__ import annotations

import copy

import pytest

from gyre_core.harness.conversation import ChatFormat, TemplateError
from gyre_core.model import IM_END, train_tokenizer

QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TEMPLATES = {"qwen2.5": QWEN25, "qwen3": QWEN3, "smollm2": SMOLLM2}
CORPUS = ["<|im_start|>user\ngo to the red ball<|im_end|>\n<|im_start|>assistant\n<think>\nleft then up\n</think>\n\n"
          f"move {d}<|im_end|>\n" for d in ("up", "down", "left", "right")] * 20


@pytest.fixture(scope="module")
def base_tok():
    return train_tokenizer(CORPUS, vocab_size=300)


def with_template(base_tok, template: str):
    tok = copy.deepcopy(base_tok)
    tok.chat_template = template
    return tok


def converse(fmt: ChatFormat, tok, answers: list[str], users: list[str]) -> list[int]:
    """The ids a multi-turn loop builds: start, then per turn the generated ids (answer + stop token, as a
    model would emit them) and the continuation with the next user message."""
    stop = tok.convert_tokens_to_ids(IM_END)
    ids = fmt.start("You are a navigator.", users[0])
    for answer, user in zip(answers, users[1:]):
        generated = fmt.encode(answer) + [stop]
        before = list(ids)
        ids = ids + generated + fmt.continuation(user, IM_END)
        assert ids[:len(before) + len(generated)] == before + generated     # an exact extension
    return ids


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_multi_turn_prompt_reads_as_the_official_rendering(base_tok, name):
    tok = with_template(base_tok, TEMPLATES[name])
    fmt = ChatFormat(tok)
    users, answers = ["go to the red ball", "you moved; now?", "almost there"], ["move up", "move left"]
    ids = converse(fmt, tok, answers, users)
    msgs = [{"role": "system", "content": "You are a navigator."}]
    for u, a in zip(users, answers + [None]):
        msgs.append({"role": "user", "content": u})
        if a is not None:
            msgs.append({"role": "assistant", "content": a})
    official = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == official
    assert ids[:len(fmt.start("You are a navigator.", users[0]))] == fmt.encode(
        tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True))


def test_qwen3_keeps_generated_thinking_that_its_template_would_drop(base_tok):
    """Qwen3's template renders an earlier assistant turn without its <think> block, so re-rendering the
    conversation would rewrite tokens the model generated; the prompt keeps them."""
    tok = with_template(base_tok, QWEN3)
    fmt = ChatFormat(tok)
    answer = "<think>\nleft then up\n</think>\n\nmove up"
    ids = converse(fmt, tok, [answer], ["go to the red ball", "now?"])
    msgs = [{"role": "system", "content": "You are a navigator."}, {"role": "user", "content": "go to the red ball"},
            {"role": "assistant", "content": answer}, {"role": "user", "content": "now?"}]
    official = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<think>" not in official                   # what the template does to history
    kept = official.replace("<|im_start|>assistant\nmove up", "<|im_start|>assistant\n" + answer)
    assert tok.decode(ids) == kept
    assert fmt.close_assistant == "<|im_end|>\n"


def test_length_cut_completion_is_closed_with_the_stop_text(base_tok):
    tok = with_template(base_tok, QWEN25)
    fmt = ChatFormat(tok)
    assert tok.decode(fmt.continuation("next", None)) == "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(fmt.continuation("next", IM_END)) == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_a_user_turn_is_refused(base_tok):
    tok = with_template(base_tok, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TemplateError, match="no boundary"):
        ChatFormat(tok)
