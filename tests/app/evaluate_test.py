"""Held-out evaluation samples as `eval.*` says: greedy pass@1 is brute-force argmax decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from configs import default
from dora_jax import app_lib, models, settings_lib, task_lib


class _RecordingReward:
    """The reward runner's `score`, keeping each completion's text: the decoding under test."""

    def __init__(self):
        self.texts: dict[tuple[int, int], str] = {}

    def score(self, items, counted=True):
        del counted
        self.texts.update({key: text for key, text, _ in items})
        return [0.0] * len(items)


def _greedy(fn, params, prompt, max_new, eos_ids):
    """Argmax decoding by full forward passes over the sequence so far, padded to one length
    (causal attention: the padding after the last token cannot change its logits)."""
    width = len(prompt) + max_new
    logits_at = jax.jit(lambda p, ids, i: fn.logits(p, ids)[0, i])
    tokens = list(prompt)
    for _ in range(max_new):
        ids = jnp.asarray([tokens + [0] * (width - len(tokens))], jnp.int32)
        token = int(jnp.argmax(logits_at(params, ids, len(tokens) - 1)))
        tokens.append(token)
        if token in eos_ids:
            break
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-6}, {}],
    ids=["temperature_0", "top_k_1", "top_p_tiny", "engine"],
)
def test_held_out_samples_decode_with_the_eval_sampling(sampling):
    """Each of eval's fields alone makes decoding greedy (the rest keep the engine's
    temperature 1); with none set, samples leave the argmax path."""
    config = default.get_config()
    config.eval.num_prompts = 4
    config.eval.samples_per_prompt = 2
    config.eval.update(sampling)
    settings = settings_lib.validate(config)
    data = task_lib.load_task(config)
    model = app_lib.load_policy(config, data.tokenizer.vocab_size, settings.plan.train_mesh)
    engine = app_lib.make_engines(config, model, settings.plan, data.tokenizer.eos_ids)[0]
    records = task_lib.heldout_records(config, data)
    reward = _RecordingReward()
    task_lib.evaluate(engine, engine.load_params(), records, config, reward, data.tokenizer)
    fn, params = models.Functional.of(model)
    greedy = [
        data.tokenizer.decode(
            _greedy(
                fn,
                params,
                [int(t) for t in r["prompt_tokens"]],
                config.engine.max_decode_length,
                set(data.tokenizer.eos_ids),
            )
        )
        for r in records
    ]
    sampled = [[reward.texts[(i, j)] for j in range(2)] for i in range(len(records))]
    if sampling:
        assert sampled == [[text, text] for text in greedy]
    else:  # sampled at temperature 1, not greedily: some sample leaves the argmax path
        assert any(
            text != want for texts, want in zip(sampled, greedy, strict=True) for text in texts
        )


def test_a_bad_eval_sampling_setting_names_its_field():
    config = default.get_config()
    config.eval.top_p = 1.5
    with pytest.raises(ValueError, match=r"eval\.top_p must be in \(0, 1\]"):
        settings_lib.validate(config)
    config.eval.top_p = None
    config.eval.temperature = -1.0
    with pytest.raises(ValueError, match=r"eval\.temperature must be 0"):
        settings_lib.validate(config)
