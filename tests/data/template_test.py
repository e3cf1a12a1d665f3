"""Prompt templates: format strings, and chat templates rendered exactly like transformers."""

from __future__ import annotations

import json

import pytest
import transformers
from data_fixtures import (
    LLAMA_LIKE_TEMPLATE,
    QWEN_LIKE_TEMPLATE,
    write_hf_tokenizer_dir,
)

from dora_jax.data import template_lib

# transformers' `{% generation %}` block (assistant-token masks), around every turn's content so
# that its body is rendered in a prompt too: it did not parse here.
GENERATION_BLOCK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ["What is 2+2?", "  spaced  \n multi-line ", 'quotes " and {braces} and ünïcode']


def test_format_template():
    assert template_lib.make_template("Q: {prompt}\nA:").render("2+2?") == "Q: 2+2?\nA:"
    assert template_lib.make_template("{prompt}").render("x{y}") == "x{y}"
    with pytest.raises(ValueError, match="does not contain"):
        template_lib.make_template("no field")
    with pytest.raises(ValueError, match="only field"):
        template_lib.make_template("{prompt} {other}")


@pytest.mark.parametrize(
    "template,config",
    [
        (QWEN_LIKE_TEMPLATE, {"eos_token": "<|im_end|>"}),
        (LLAMA_LIKE_TEMPLATE, {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}),
        (GENERATION_BLOCK_TEMPLATE, {"eos_token": "<|im_end|>"}),
    ],
)
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chat_template_matches_transformers(tmp_path, template, config, system):
    directory = write_hf_tokenizer_dir(tmp_path, {**config, "chat_template": template})
    ours = template_lib.make_template("chat", directory, system=system)
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.render(prompt) == expected


def test_chat_template_file_takes_precedence_and_named_lists_pick_default(tmp_path):
    directory = write_hf_tokenizer_dir(
        tmp_path,
        {
            "eos_token": "<|im_end|>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
                {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
            ],
        },
    )
    assert template_lib.make_template("chat", directory).render("hi") == "DEFAULT hi"
    (directory / "chat_template.jinja").write_text("FILE {{ messages[0]['content'] }}")
    assert template_lib.make_template("chat", directory).render("hi") == "FILE hi"


def test_chat_template_errors_name_the_problem(tmp_path):
    directory = write_hf_tokenizer_dir(tmp_path, {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match="no chat_template"):
        template_lib.make_template("chat", directory)
    with pytest.raises(ValueError, match="checkpoint directory"):
        template_lib.make_template("chat")
    with pytest.raises(ValueError, match="system prompt"):
        template_lib.make_template("{prompt}", system="x")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('no ' + messages[0]['role']) }}"})
    )
    with pytest.raises(Exception, match="no user"):
        template_lib.make_template("chat", directory).render("hi")
