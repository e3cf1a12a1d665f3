"""Input side of a run: tokenizers, prompt templates, grain prompt pipelines, built-in task."""

from dora_jax.data.longtail_task import LongTailTask, length_stats
from dora_jax.data.pipeline_lib import (
    BAD_ROW_MODES,
    BadRowError,
    NoUsableRowsError,
    PromptIterator,
    prompt_dataset,
    prompt_tokens,
)
from dora_jax.data.source_lib import (
    MissingFieldError,
    RowSource,
    file_list,
    memory_rows,
    open_files,
)
from dora_jax.data.template_lib import ChatTemplate, FormatTemplate, PromptTemplate, make_template
from dora_jax.data.tokenizer_lib import Tokenizer, char_tokenizer, load_tokenizer

__all__ = [
    "BAD_ROW_MODES",
    "BadRowError",
    "ChatTemplate",
    "FormatTemplate",
    "LongTailTask",
    "MissingFieldError",
    "NoUsableRowsError",
    "PromptIterator",
    "PromptTemplate",
    "RowSource",
    "Tokenizer",
    "char_tokenizer",
    "file_list",
    "length_stats",
    "load_tokenizer",
    "make_template",
    "memory_rows",
    "open_files",
    "prompt_dataset",
    "prompt_tokens",
]
