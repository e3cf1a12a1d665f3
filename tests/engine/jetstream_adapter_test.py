"""JetStream's own orchestrator (`jetstream.core.orchestrator.Driver`) drives the engine."""

from __future__ import annotations

import asyncio
import logging
import time

import jax
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2
from jetstream.engine import engine_api
from tiny_models import DENSE

from dora_jax.engine import Engine, Request, SamplingParams, generate_all, jetstream_adapter
from dora_jax.models import create

# Importing the orchestrator sets the root logger to DEBUG with a handler on sys.stdout; undo
# that so other tests in this process are not flooded (and nothing logs to a closed stdout).
logging.getLogger().removeHandler(orchestrator.handler)
logging.getLogger().setLevel(logging.WARNING)

BOS = 1
# Generous: a loaded CI machine can take a while to compile; a normal run takes seconds.
TIMEOUT_S = 300


def test_tree_map_alias_present():
    assert jax.tree_map is not None  # JetStream 0.2.2's orchestrator calls it


def test_orchestrator_completes_one_request():
    engine = Engine(
        create(DENSE, seed=3),
        max_concurrent_decodes=2,
        max_prefill_length=16,
        max_decode_length=8,
        sampling=SamplingParams.greedy(),
        eos_ids=(2,),
    )
    adapter = jetstream_adapter.JetStreamEngine(engine, bos_id=BOS)
    assert isinstance(adapter, engine_api.Engine)
    params = adapter.load_params()
    prompt, max_tokens = [5, 7, 9, 11], 4
    (want,) = generate_all(
        engine,
        params,
        [Request(prompt_tokens=[BOS, *prompt], max_new_tokens=max_tokens, ignore_eos=True)],
    )
    assert 2 not in want.tokens.tolist(), "pick a prompt whose greedy output has no EOS"

    driver = orchestrator.Driver(
        prefill_engines=[adapter],
        generate_engines=[adapter],
        prefill_params=[params],
        generate_params=[params],
        interleaved_mode=True,
    )
    client = orchestrator.LLMOrchestrator(driver=driver)
    request = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
        max_tokens=max_tokens,
    )

    async def decode():
        got = []
        async for response in client.Decode(request):
            got.extend(response.stream_content.samples[0].token_ids)
        return got

    async def run():
        try:
            return await asyncio.wait_for(decode(), timeout=TIMEOUT_S)
        finally:
            # Stop the driver while the event loop still runs: a driver thread that posts to
            # a closed loop raises, and JetStream's JetThread then SIGKILLs the process.
            driver.stop()

    start = time.time()
    got = asyncio.run(run())
    assert got == want.tokens.tolist(), (got, want.tokens, time.time() - start)
