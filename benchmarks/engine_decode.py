"""Decode throughput against the number of active slots and of decode steps per engine call,
and prefill throughput.

    .venv/bin/python benchmarks/engine_decode.py [--slots 16] [--steps 32] [--prompt 64]

A decode step costs about the same whatever the number of active slots (every slot row is
computed), so tokens/s grows with the slots kept full: the intra-instance bubble that DORA's
slot refilling removes. Each call ends with a device-to-host copy of its tokens, as continuous
batching does; `generate_steps` runs several steps per call, which saves the host's per-call
cost (`rollout.decode_steps_per_turn`). A prefill runs the model once per distinct prompt, so a
GRPO group's G samples admitted together cost one prompt's prefill: the last table admits every
slot with G samples of each prompt. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax
import numpy as np

from dora_jax.engine import Engine, Request, SamplingParams
from dora_jax.models import ModelConfig, create


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_layers=args.layers,
        num_heads=args.hidden // 32,
        num_kv_heads=max(1, args.hidden // 64),
        head_dim=32,
        qk_norm=True,
    )


def _requests(rng, count: int, prompt: int, max_new: int, seed0: int = 0) -> list[Request]:
    return [
        Request(
            prompt_tokens=rng.randint(0, 1000, prompt).tolist(),
            max_new_tokens=max_new,
            ignore_eos=True,
            seed=seed0 + i,
        )
        for i in range(count)
    ]


def _decode_row(engine, params, rng, active: int, steps: int, prompt: int) -> tuple[float, float]:
    ds = engine.init_decode_state()
    prefix, _ = engine.prefill_requests(
        params, _requests(rng, active, prompt, engine.max_decode_length)
    )
    ds = engine.insert(prefix, ds, list(range(active)))
    for _ in range(2):  # warm-up (compiles on the first row)
        ds, result = engine.generate(params, ds)
        result.convert_to_numpy()
    start = time.perf_counter()
    for _ in range(steps):
        ds, result = engine.generate(params, ds)
        result = result.convert_to_numpy()
    elapsed = time.perf_counter() - start
    assert result.valid[:active].all()
    return active * steps / elapsed, elapsed / steps * 1e3


def _steps_per_call_row(engine, params, rng, per_call: int, steps: int, prompt: int) -> float:
    """ms per decode step with every slot busy, `per_call` steps per `generate_steps` call."""
    slots = engine.max_concurrent_decodes
    ds, _ = engine.admit(
        params,
        engine.init_decode_state(),
        _requests(rng, slots, prompt, engine.max_decode_length),
        list(range(slots)),
    )
    ds, results = engine.generate_steps(params, ds, per_call)  # warm-up (compiles)
    results.convert_to_numpy()
    calls = max(steps // per_call, 1)
    start = time.perf_counter()
    for _ in range(calls):
        ds, results = engine.generate_steps(params, ds, per_call)
        results = results.convert_to_numpy()
    elapsed = time.perf_counter() - start
    assert all(r.valid.all() for r in results)
    return elapsed / (calls * per_call) * 1e3


def _prefill_seconds(engine, params, requests, repeats: int) -> float:
    """Seconds per `prefill_requests` call of `requests`, its first tokens read back."""
    prefix, first = engine.prefill_requests(params, requests)  # warm-up / compile
    jax.block_until_ready((prefix, first.data))
    start = time.perf_counter()
    for _ in range(repeats):
        prefix, first = engine.prefill_requests(params, requests)
        first.convert_to_numpy()
    jax.block_until_ready(prefix)
    return (time.perf_counter() - start) / repeats


def _prefill_row(engine, params, rng, rows: int, prompt: int, repeats: int) -> float:
    seconds = _prefill_seconds(engine, params, _requests(rng, rows, prompt, 1), repeats)
    return rows * prompt / seconds


def _group_prefill_ms(engine, params, rng, group: int, prompt: int, repeats: int) -> float:
    """ms per call admitting every slot: slots / group prompts, `group` samples of each."""
    slots = engine.max_concurrent_decodes
    prompts = [rng.randint(0, 1000, prompt).tolist() for _ in range(slots // group)]
    requests = [
        Request(prompt_tokens=prompts[i // group], max_new_tokens=1, ignore_eos=True, seed=i)
        for i in range(slots)
    ]
    return _prefill_seconds(engine, params, requests, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16, help="max_concurrent_decodes")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per row")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-length", type=int, default=128, help="max_decode_length")
    parser.add_argument("--prefill-repeats", type=int, default=5)
    args = parser.parse_args()

    config = _config(args)
    model = create(config, seed=0)
    engine = Engine(
        model,
        max_concurrent_decodes=args.slots,
        max_prefill_length=max(args.prompt, 8),
        max_decode_length=args.decode_length,
        sampling=SamplingParams(temperature=1.0, top_p=0.95),
    )
    params = engine.load_params()
    n_params = sum(x.size for x in jax.tree.leaves(params.state))
    rng = np.random.RandomState(0)
    print(
        f"# engine_decode: {n_params / 1e6:.2f}M params (hidden {config.hidden_size}, "
        f"{config.num_layers} layers, vocab {config.vocab_size}), {args.slots} slots, cache "
        f"{engine.cache_length}, prompt {args.prompt}, sampling temperature 1 top_p 0.95"
    )
    print(
        f"# jax {jax.__version__} on {jax.devices()[0].platform} ({platform.processor() or '?'}, "
        f"{os.cpu_count()} CPUs), python {sys.version.split()[0]}"
    )
    print()
    print("| active slots | decode tokens/s | ms/step |")
    print("| ---: | ---: | ---: |")
    active = 1
    while True:
        tps, ms = _decode_row(engine, params, rng, active, args.steps, args.prompt)
        print(f"| {active} | {tps:.1f} | {ms:.2f} |", flush=True)
        if active == args.slots:
            break
        active = min(active * 2, args.slots)
    print()
    print(f"| decode steps per call ({args.slots} slots busy) | ms/step |")
    print("| ---: | ---: |")
    for per_call in (1, 2, 4, 8):
        ms = _steps_per_call_row(engine, params, rng, per_call, args.steps, args.prompt)
        print(f"| {per_call} | {ms:.2f} |", flush=True)
    print()
    print("| prompts per prefill call | prompt length | prefill tokens/s |")
    print("| ---: | ---: | ---: |")
    for rows in sorted({1, min(4, args.slots), args.slots}):
        tps = _prefill_row(engine, params, rng, rows, args.prompt, args.prefill_repeats)
        print(f"| {rows} | {args.prompt} | {tps:.0f} |", flush=True)
    print()
    print("| samples per prompt (G) | rows per call | ms per prefill call | vs G = 1 |")
    print("| ---: | ---: | ---: | ---: |")
    groups = [g for g in (1, 2, 4, 8, 16) if g <= args.slots and args.slots % g == 0]
    for group in groups:  # every group size in turn, twice, for a noisy host
        times = [
            _group_prefill_ms(engine, params, rng, g, args.prompt, args.prefill_repeats)
            for _ in range(2)
            for g in [group, 1]
        ]
        ms, alone = min(times[0::2]), min(times[1::2])
        print(f"| {group} | {args.slots} | {ms:.2f} | {alone / ms:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
