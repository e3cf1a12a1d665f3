"""Generation hosts in processes of their own: a dora run whose engines live in other processes
(a child process, and a `dora-jax host` reached over TCP) writes the same ledger as the same run
with the engines in this process, and a host that dies mid-run loses nothing."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import DENSE, VOCAB

from dora_jax import models
from dora_jax.engine import Engine, Request
from dora_jax.models import sharding_lib
from dora_jax.rollout import audit_lib, ledger_lib, request_lib, runner_lib
from dora_jax.rollout.config_lib import RolloutConfig
from dora_jax.rollout.instance_lib import RolloutInstance
from dora_jax.runtime import hosts_lib
from dora_jax.train import TrainConfig, Trainer

MODEL = DENSE
ENGINE = {"max_concurrent_decodes": 4, "max_prefill_length": 16, "max_decode_length": 32}
CONFIG = RolloutConfig(
    mode="dora",
    train_batch_size=8,
    rollout_batch_size=24,
    group_size=4,
    staleness_bound=2,
    num_iterations=5,
    timer_steps=2,
    publish_delay_steps=2,
)


def _rollout(engines, workdir) -> runner_lib.Rollout:
    trainer = Trainer(
        models.create(MODEL, seed=0),
        TrainConfig(tbs=8, group_size=4, learning_rate=1e-3, length_buckets=(64,)),
        sharding_lib.make_mesh(jax.devices()[:1], 1, 1),
    )
    prompts = request_lib.heavy_tail_prompts(
        seed=0, group_size=4, vocab_size=VOCAB, median_length=6, max_length=32
    )
    reward = request_lib.per_sample(lambda pid, toks: float((toks == 3).mean()))
    return runner_lib.Rollout(CONFIG, engines, trainer, prompts, reward, workdir)


def _run(engines, workdir, on_iteration=None) -> runner_lib.Rollout:
    rollout = _rollout(engines, workdir)
    rollout.on_iteration = on_iteration
    rollout.run()
    return rollout


def _ledger(workdir) -> list[dict]:
    return list(ledger_lib.read(str(workdir)))


KEY = "a test secret"


@pytest.fixture
def network_host(monkeypatch):
    """A `dora-jax host` in a process of its own, listening on a free loopback port."""
    monkeypatch.setenv(hosts_lib.KEY_VARIABLE, KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "dora_jax.cli", "host", f"--address=127.0.0.1:{port}"],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        assert "listening" in process.stdout.readline()
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_remote_engines_write_the_same_ledger_as_local_ones(tmp_path, network_host):
    model = models.create(MODEL, seed=0)
    local = [
        Engine(model, mesh=sharding_lib.make_mesh(jax.devices()[i : i + 1], 1, 1), **ENGINE)
        for i in (1, 2)
    ]
    here = _run(local, str(tmp_path / "local"))
    spec = hosts_lib.EngineSpec(MODEL, 0, ENGINE)
    remote = hosts_lib.start_local_hosts([spec]) + hosts_lib.connect_hosts([network_host], [spec])
    try:
        there = _run(remote, str(tmp_path / "remote"))
    finally:
        for engine in remote:
            engine.close()
    assert audit_lib.audit(str(tmp_path / "remote")).passed
    assert there.totals["migrations"] == here.totals["migrations"] >= 1
    # Tokens, log-probs and versions came from the hosts; the ledger records every sample's
    # versions, length and reward: the same run, decided and sampled the same way.
    assert _ledger(tmp_path / "remote") == _ledger(tmp_path / "local")


@pytest.mark.slow
def test_a_host_that_dies_mid_run_loses_nothing(tmp_path):
    remote = hosts_lib.start_local_hosts([hosts_lib.EngineSpec(MODEL, 0, ENGINE)] * 2)

    def kill_first_host(metrics):
        if metrics["iteration"] == 1:
            remote[0].process.kill()  # no goodbye: its connection just ends
            remote[0].process.join()

    try:
        rollout = _run(remote, str(tmp_path), on_iteration=kill_first_host)
    finally:
        for engine in remote:
            engine.close()
    assert rollout.totals["failed_instances"] == 1
    assert rollout.totals["requeued"] >= 1
    assert not rollout.instances[0].healthy and rollout.instances[1].healthy
    report = audit_lib.audit(str(tmp_path))  # C2: every dispatched sample trained or listed
    assert report.passed, report.format()
    trained = [e for e in _ledger(tmp_path) if e["event"] == "train"]
    assert len(trained) == CONFIG.num_iterations * CONFIG.train_batch_size


def test_a_network_host_refuses_a_controller_without_the_key(network_host, monkeypatch):
    monkeypatch.setenv(hosts_lib.KEY_VARIABLE, "not the secret")
    spec = hosts_lib.EngineSpec(MODEL, 0, ENGINE)
    with pytest.raises(multiprocessing.AuthenticationError):
        hosts_lib.connect_hosts([network_host], [spec])
    monkeypatch.setenv(hosts_lib.KEY_VARIABLE, KEY)  # the host keeps serving others
    (engine,) = hosts_lib.connect_hosts([network_host], [spec])
    assert engine.max_concurrent_decodes == ENGINE["max_concurrent_decodes"]
    engine.close()


def test_without_a_key_network_hosts_are_refused_at_start(monkeypatch):
    monkeypatch.delenv(hosts_lib.KEY_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=hosts_lib.KEY_VARIABLE):
        hosts_lib.connect_hosts(["127.0.0.1:7100"], [hosts_lib.EngineSpec(MODEL, 0, ENGINE)])


def test_a_bfloat16_host_holds_its_version_in_bfloat16_and_decodes_as_a_local_engine():
    """A host's engine holds params in the dtype it computes in, as a local one does: a float32
    version from the trainer is cast before it goes down the pipe (half the bytes), and the host
    decodes exactly what a local bfloat16 engine decodes from the same version."""
    dtypes = {"param_dtype": jnp.float32, "dtype": jnp.bfloat16}
    model = models.create(MODEL, seed=0, **dtypes)
    masters = nnx.state(model)  # float32, as the trainer's
    local = RolloutInstance(0, Engine(model, **ENGINE))
    (host,) = hosts_lib.start_local_hosts(
        [hosts_lib.EngineSpec(MODEL, 0, ENGINE, model_kwargs=dtypes)]
    )
    try:
        remote = RolloutInstance(1, host)
        assert host.param_dtype == np.dtype(jnp.bfloat16)
        _, nbytes = remote.load(0, masters)
        assert nbytes == 2 * sum(x.size for x in jax.tree.leaves(masters))
        local.load(0, masters)
        spec = request_lib.PromptSpec(0, np.asarray([3, 9, 4], np.int32), (6,), ignore_eos=True)
        requests = [request_lib.Request(spec, 0, seed=7, version=0) for _ in range(2)]
        for x, request in zip((local, remote), requests, strict=True):
            x.dispatch_prefill([(request, 0)])
            x.dispatch_generate(8)
            assert x.collect()[0] == [request]
        assert requests[0].tokens == requests[1].tokens
        assert requests[0].logprobs == requests[1].logprobs
    finally:
        host.close()


def _with_trained_adapters(state: nnx.State, seed: int) -> nnx.State:
    """`state` with random `lora_b` (zero at initialisation), as a trained LoRA version."""
    rng = np.random.RandomState(seed)
    flat = dict(nnx.to_flat_state(state))
    for key, variable in flat.items():
        if key[-1] == "lora_b":
            flat[key] = variable.replace(jnp.asarray(rng.normal(0, 1, variable.shape), jnp.float32))
    return nnx.from_flat_state(flat)


def _nbytes(state: nnx.State) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def test_lora_hosts_move_the_base_once_then_adapters_and_decode_as_a_local_engine():
    """A generation host keeps a LoRA policy's base from its first version on: later versions,
    from the trainer or from another host, move as their adapters alone, and the host decodes
    what a local engine holding the whole version decodes."""
    lora = {"lora": models.LoRAConfig(rank=2)}
    v0 = nnx.state(models.create(MODEL, seed=0, **lora))
    v1, v2 = _with_trained_adapters(v0, 1), _with_trained_adapters(v0, 2)
    adapters = nnx.filter_state(v1, nnx.LoRAParam)
    spec = hosts_lib.EngineSpec(MODEL, 0, ENGINE, model_kwargs=lora)
    hosts = hosts_lib.start_local_hosts([spec] * 2)
    try:
        a, b = RolloutInstance(0, hosts[0]), RolloutInstance(1, hosts[1])
        assert [a.load(0, v0)[1], b.load(0, v0)[1]] == [_nbytes(v0)] * 2
        assert a.base.nbytes == _nbytes(v0) - _nbytes(adapters)
        assert a.load(1, v1)[1] == _nbytes(adapters)  # from the trainer
        assert b.load(1, a.params.state)[1] == _nbytes(adapters)  # from the other host
        fetched = a.params.state.fetch(adapters_only=True)
        for got, want in zip(jax.tree.leaves(fetched), jax.tree.leaves(adapters), strict=True):
            np.testing.assert_array_equal(got, want)
        with pytest.raises(ValueError, match="a base held by host0 is not here"):
            hosts[1].place(fetched, a.base)

        def decode(x: RolloutInstance) -> tuple[list[int], list[float]]:
            prompt = request_lib.PromptSpec(0, np.asarray([3, 9, 4], np.int32), (8,), True)
            request = request_lib.Request(prompt, 0, seed=7, version=x.version)
            x.dispatch_prefill([(request, 0)])
            x.dispatch_generate(8)
            assert x.collect()[0] == [request]
            return request.tokens, request.logprobs

        local = RolloutInstance(2, Engine(models.create(MODEL, seed=0, **lora), **ENGINE))
        local.load(1, v1)
        under_v1 = decode(local)
        assert decode(b) == under_v1  # adapters copied from host a onto b's base
        assert a.load(2, v2)[1] == _nbytes(adapters)
        local.load(2, v2)
        assert decode(a) == decode(local) != under_v1  # and the adapters matter
    finally:
        for host in hosts:
            host.close()


SILENT_HOSTS_SETTINGS = dict(max_concurrent_decodes=1, max_prefill_length=8, max_decode_length=8,
                             cache_length=16, prefill_buckets=(8,),
                             param_dtype=np.dtype("float32"))  # fmt: skip


def test_a_silent_or_vanished_host_is_an_error_not_a_hang():
    ours, theirs = multiprocessing.Pipe()
    theirs.send(SILENT_HOSTS_SETTINGS)
    engine = hosts_lib.RemoteEngine(ours, name="quiet", timeout_s=0.2)
    with pytest.raises(hosts_lib.HostError, match="quiet: no answer in 0.2 s"):
        engine.init_decode_state()  # nobody serves the other end
    theirs.close()
    with pytest.raises(hosts_lib.HostError, match="quiet: the connection ended"):
        engine.init_decode_state()


def test_slot_frees_and_imports_do_not_wait_and_their_errors_surface_at_the_next_read():
    """`free_slot` and `import_slot` change only the host's decode state, so the controller
    sends them without waiting for the answer (one round trip less per turn with stop-string
    finishes or migrations); the host runs commands in order, and an error of theirs is raised
    by the next answer the controller waits for, where the rollout takes the instance out."""
    ours, theirs = multiprocessing.Pipe()
    theirs.send(SILENT_HOSTS_SETTINGS)
    engine = hosts_lib.RemoteEngine(ours, name="scripted", timeout_s=5)
    state = engine.free_slot(hosts_lib.HostHandle(engine, -1, owned=False), [0])
    state = engine.import_slot(state, 0, {"kv": np.zeros(2)})
    # Both commands are on the wire and nothing was waited for: no answer has been given yet.
    assert [theirs.recv()[0] for _ in range(2)] == ["free", "import"]
    assert not theirs.poll()
    theirs.send(None)  # free: done
    theirs.send(hosts_lib.HostError("import failed on the host"))
    ticket = engine.send("generate_steps")
    theirs.recv()
    theirs.send({"tokens": [1]})
    with pytest.raises(hosts_lib.HostError, match="import failed on the host"):
        engine.wait(ticket)
    assert engine.wait(ticket) == {"tokens": [1]}  # kept: the error came before it
    assert not engine._posted and not engine._early  # no answer piles up


def test_a_host_that_stops_reading_is_an_error_not_a_blocked_controller():
    """A command bigger than the connection's buffer (a version's weights) waits for the host
    to read it; a host that never does must fail its instance like a silent one."""
    ours, theirs = multiprocessing.Pipe()
    theirs.send(SILENT_HOSTS_SETTINGS)
    engine = hosts_lib.RemoteEngine(ours, name="stopped", timeout_s=0.5)
    raised: list[BaseException] = []

    def place_weights():
        try:
            engine.place({"w": np.zeros(1 << 20, np.float32)})  # 4 MB
        except BaseException as e:  # noqa: BLE001 - the test reads it below
            raised.append(e)

    caller = threading.Thread(target=place_weights, daemon=True)
    caller.start()
    caller.join(30)  # a regression blocks for good: fail here, not at the suite's timeout
    assert not caller.is_alive(), "the controller is still blocked writing to the host"
    assert isinstance(raised[0], hosts_lib.HostError)
    assert "stopped: could not hand over a command in 0.5 s" in str(raised[0])
    theirs.close()


@pytest.mark.slow
def test_a_migration_from_a_host_that_died_blames_it_and_keeps_the_request(tmp_path, monkeypatch):
    """The source frees a migrated slot without waiting for the answer, so its host's failure
    surfaces when the destination fetches the slot from it: the source is taken out, not the
    destination, and the request is requeued, not lost."""
    remote = hosts_lib.start_local_hosts([hosts_lib.EngineSpec(MODEL, 0, ENGINE)] * 2)
    try:
        rollout = _rollout(remote, str(tmp_path))
        src, dst = rollout.instances
        rollout.load(src, 0, None)
        rollout.load(dst, 0, None)
        rollout.dispatch_group(0)
        rollout.start(
            [(src, [(r, s) for r, s in zip(rollout.pending[0], src.free(), strict=False)])]
        )
        rollout.pending[0].clear()
        src.dispatch_generate(1)
        src.collect()
        slot = src.active()[0]
        request = src.slots[slot]
        export = src.export

        def export_then_die(slot):
            out = export(slot)
            remote[0].process.kill()
            remote[0].process.join()
            return out

        monkeypatch.setattr(src, "export", export_then_die)
        rollout.migrate(src, slot, dst, dst.free()[0])
        assert not src.healthy and dst.healthy
        assert request in rollout.pending[rollout.window.newest]
        assert not dst.active()
    finally:
        for engine in remote:
            engine.close()


def test_a_host_outlives_a_controller_that_left_an_answer_unread():
    """Over TCP, a controller that closes with an answer still unread resets the connection;
    the host must take that as the end of the connection and serve the next controller."""
    from multiprocessing.connection import Client, Listener

    listener = Listener(("127.0.0.1", 0), authkey=b"k")
    ended: list[BaseException | None] = []

    def host():
        with listener.accept() as connection:
            try:
                hosts_lib.serve(connection, hosts_lib.EngineSpec(MODEL, 0, ENGINE))
                ended.append(None)
            except BaseException as e:  # noqa: BLE001 - the test reads it below
                ended.append(e)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    client = Client(listener.address, authkey=b"k")
    client.recv()  # the engine's settings
    client.send(("free", (0, 1, 0)))  # answered with an error: no decode state 0
    assert client.poll(60)  # the answer is here, and stays unread
    client.close()
    thread.join(60)
    listener.close()
    assert ended == [None]


@pytest.mark.slow
def test_a_dead_host_is_blamed_not_the_instance_copying_a_version_from_it(tmp_path):
    """Copying a version from an instance whose host died must take that instance out and load
    the trainer's copy instead: failing the healthy destination cascaded through every instance
    that copied from the dead one, until the run had none left."""
    remote = hosts_lib.start_local_hosts([hosts_lib.EngineSpec(MODEL, 0, ENGINE)] * 2)
    try:
        rollout = _rollout(remote, str(tmp_path))
        dead, alive = rollout.instances
        rollout.load(dead, 0, None)
        remote[0].process.kill()
        remote[0].process.join()
        rollout.load(alive, 0, dead)
        assert alive.healthy and alive.version == 0 and not dead.healthy
        # The version loaded is the trainer's: the host decodes with it.
        request = Request(prompt_tokens=[1, 2, 3], max_new_tokens=4, ignore_eos=True)
        _, first = remote[1].admit(alive.params, remote[1].init_decode_state(), [request], [0])
        assert first.convert_to_numpy().valid[0]
    finally:
        for engine in remote:
            engine.close()
