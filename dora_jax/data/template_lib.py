"""Prompt templates: how a dataset's raw `prompt` becomes the text the policy sees.

Two kinds, chosen by one config string: a plain format string containing `{prompt}` (base
models, the built-in task) or `"chat"`, the checkpoint's own chat template. The chat template is
rendered here with jinja2 the way transformers' `apply_chat_template(...,
add_generation_prompt=True, tokenize=False)` renders it (same environment flags, filters and
globals), so training prompts match what the model saw in instruction tuning without importing
transformers at run time.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Protocol

import jinja2
import jinja2.ext
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dora_jax.data.tokenizer_lib import special_token

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class PromptTemplate(Protocol):
    # Whether the rendered text writes the model's special tokens itself (a chat template
    # writes its BOS); if not, the tokenizer adds them, as transformers' `tokenizer(text)` does.
    writes_special_tokens: bool

    def render(self, prompt: str) -> str: ...


class FormatTemplate:
    """`fmt.format(prompt=...)`, e.g. `"Q: {prompt}\\nA:"`; `"{prompt}"` passes it through."""

    writes_special_tokens = False

    def __init__(self, fmt: str):
        try:
            fmt.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt template {fmt!r} must be a format string whose only field is "
                f"{{prompt}} (or 'chat'): {e!r}"
            ) from e
        if "{prompt}" not in fmt:
            raise ValueError(f"prompt template {fmt!r} does not contain {{prompt}}")
        self.fmt = fmt

    def render(self, prompt: str) -> str:
        return self.fmt.format(prompt=prompt)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers overrides jinja's tojson, which would HTML-escape characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block, rendered as its body.

    transformers uses it to mark assistant tokens for training masks; a prompt holds no
    assistant turn, so the body is all it needs. Without it a checkpoint's template that uses
    the block does not even parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` tag itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatTemplate:
    """A jinja chat template applied to one user turn (and an optional system turn)."""

    writes_special_tokens = True

    def __init__(self, source: str, special_tokens: dict[str, str], system: str | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._special_tokens = special_tokens
        self._system = system

    def render(self, prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        if self._system is not None:
            messages.insert(0, {"role": "system", "content": self._system})
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self._special_tokens,
        )

    @classmethod
    def from_checkpoint(cls, directory: str | Path, system: str | None = None) -> ChatTemplate:
        """Reads `chat_template.jinja` if present, else `chat_template` in tokenizer_config.json.

        That is transformers' precedence. A list of named templates picks the one named
        `default`.
        """
        directory = Path(directory)
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        jinja_file = directory / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise ValueError(
                f"{directory} has no chat_template "
                "(neither chat_template.jinja nor a chat_template string in tokenizer_config.json)"
            )
        special = {}
        for name in _SPECIAL_TOKENS:
            if (value := special_token(config.get(name), name)) is not None:
                special[name] = value
        return cls(source, special, system)


def make_template(
    spec: str, checkpoint_dir: str | Path | None = None, system: str | None = None
) -> PromptTemplate:
    """`"chat"` -> the checkpoint's chat template; anything else is a `{prompt}` format string."""
    if spec == "chat":
        if checkpoint_dir is None:
            raise ValueError("prompt_template='chat' needs a checkpoint directory")
        return ChatTemplate.from_checkpoint(checkpoint_dir, system)
    if system is not None:
        raise ValueError("a system prompt needs prompt_template='chat'")
    return FormatTemplate(spec)
