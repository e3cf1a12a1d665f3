"""Prompt templates: format strings, and chat templates rendered exactly like transformers."""

from __future__ import annotations

import json

import pytest
import tokenizers
import transformers
from data_fixtures import (
    LLAMA_LIKE_TEMPLATE,
    QWEN_LIKE_TEMPLATE,
    write_hf_tokenizer_dir,
)
from tokenizers import processors

from dora_jax.data import load_tokenizer, memory_rows, prompt_dataset, template_lib

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


@pytest.mark.parametrize("spec", ["Q: {prompt}\nA:", "chat"])
def test_prompt_tokens_carry_one_bos_as_transformers_gives_them(tmp_path, spec):
    """A Llama-style tokenizer adds BOS itself: a format template's prompt gets it, as
    `tokenizer(text)` gives it; a chat template writes its own, and gets no second one."""
    config = {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>",
              "chat_template": LLAMA_LIKE_TEMPLATE}  # fmt: skip
    directory = write_hf_tokenizer_dir(tmp_path, config)
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(str(directory / "tokenizer.json"))
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    template = template_lib.make_template(spec, directory)
    rows = memory_rows([{"prompt": p, "answer": "x"} for p in PROMPTS])
    records = prompt_dataset(rows, load_tokenizer(directory), template, max_prompt_len=256,
                             seed=0, num_epochs=1)  # fmt: skip
    for record in records:
        prompt = PROMPTS[record["row"]]
        if spec == "chat":
            messages = [{"role": "user", "content": prompt}]
            expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            expected = getattr(expected, "input_ids", expected)
        else:
            expected = ref(template.render(prompt))["input_ids"]
        assert record["prompt_tokens"].tolist() == list(expected)
        assert list(expected).count(bos) == 1
