"""`dora-jax COMMAND [flags]`: train | eval | export | audit | bench | host.

Commands follow the flax-examples convention: an ml_collections config file with
`get_config()` (`--config=configs/default.py`) and `--config.field=value` overrides, parsed by
absl. `export` writes a checkpoint's policy as a Hugging Face model directory (`--version`,
default the newest; `--out`, default `WORKDIR/hf_policy_v<version>`). `audit` takes only a
workdir: it re-checks C1-C3 from the ledger alone. `host` runs a
generation or training host for a controller elsewhere (`runtime.generation_hosts`,
`runtime.training_hosts`); the controller picks the role and sends it everything it needs.
Every command keeps its compiled programs in JAX's persistent cache (`compilation_cache_dir`,
`runtime/compile_cache_lib.py`), so restarts and later runs load them instead of compiling.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator

from absl import app, flags, logging
from ml_collections import config_flags

from dora_jax.config_fields_lib import ConfigError
from dora_jax.runtime import compile_cache_lib, cpu_flags_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for run outputs (default: runs/default; bench: runs/bench)."
)


def _workdir(default: str = "runs/default") -> str:
    """`--workdir`, or the command's own default: the bench's must not fill a training run's."""
    return _WORKDIR.value if _WORKDIR.value is not None else default


def _config(command: str):
    if not flags.FLAGS["verbosity"].present:
        # orbax logs every checkpoint step at INFO, which buries the progress display;
        # `--verbosity=0` brings those logs back.
        logging.set_verbosity(logging.WARNING)
    for name in _HOST_FLAGS:
        if flags.FLAGS[name].present:  # ignored here: the config's field decides
            instead = (
                f"here set --config.{name} instead"
                if name in _CONFIG_FIELDS
                else "a controller names its hosts in runtime.generation_hosts/training_hosts"
            )
            sys.exit(f"--{name} is `dora-jax host`'s flag; {instead}")
    for name in _EXPORT_FLAGS:
        if command != "export" and flags.FLAGS[name].present:
            sys.exit(f"--{name} is `dora-jax export`'s flag, not `{command}`'s")
    config = _CONFIG.value
    if config is None:
        sys.exit("--config=configs/<name>.py is required")
    try:
        num_cpu_devices = config.num_cpu_devices
    except OSError as e:  # ml_collections defers a config file it could not read to here
        raise ConfigError(f"--config: {e}") from e
    cpu_flags_lib.use_cpu_devices(num_cpu_devices)
    compile_cache_lib.use_compilation_cache(config.compilation_cache_dir)
    return config


def _train(argv: list[str]) -> None:
    """Trains the config's policy with RL (after its SFT warm-up, if any) in --workdir, resuming
    from the newest checkpoint there; writes the ledger, trace, metrics and final policy."""
    del argv
    # What `timeout`, Slurm, Kubernetes and docker send to stop a job: stopping as on Ctrl-C
    # writes the ledger's end event and lets a checkpoint being saved finish.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = _config("train")
    from dora_jax import app_lib

    summary = app_lib.train_and_evaluate(config, _workdir())
    before, after = (
        app_lib.format_accuracy(summary[k])
        for k in ("heldout_accuracy_before", "heldout_accuracy_after")
    )
    print(
        f"held-out pass@1 {before} -> {after} in {summary['iterations']} iterations, "
        f"{summary['wall_time_s']:.0f}s; outputs in {_workdir()}"
    )


def _eval(argv: list[str]) -> None:
    """Scores the newest checkpoint in --workdir on the held-out prompts (pass@1, pass@k), or
    the starting policy when there is none."""
    del argv
    config = _config("eval")
    from dora_jax import app_lib

    scores = app_lib.evaluate_checkpoint(config, _workdir())
    print("  ".join(f"{k} {v:.4g}" for k, v in scores.items()))


_VERSION = flags.DEFINE_integer("version", None, "`export`: the checkpoint (default: newest).")
_OUT = flags.DEFINE_string("out", None, "`export`: the output directory.")
_EXPORT_FLAGS = ("version", "out")


def _export(argv: list[str]) -> None:
    """Writes checkpoint --version's policy in --workdir (default the newest) as a Hugging Face
    model directory at --out; prints its path."""
    del argv
    config = _config("export")
    from dora_jax import app_lib

    print(app_lib.export_checkpoint(config, _workdir(), _VERSION.value, _OUT.value))


def _audit(argv: list[str]) -> None:
    """Re-checks C1-C3 and length bias from WORKDIR/ledger.jsonl alone (`dora-jax audit
    WORKDIR`; default runs/default); exits non-zero if a rule fails."""
    from dora_jax.rollout import audit_lib

    workdir = argv[1] if len(argv) > 1 else _workdir()
    code = 0
    with _reader_may_stop():
        code = audit_lib.main(workdir)
    sys.exit(code)


@contextlib.contextmanager
def _reader_may_stop() -> Iterator[None]:
    """`dora-jax audit DIR | head`: a reader that stops early has what it wanted, which is no
    error. Flushing at exit would raise again, so stdout then goes where nothing is read."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _bench(argv: list[str]) -> None:
    """Runs the config's rollout modes on the same seeded workload and compares them; writes
    bench.json and each mode's ledger and trace under --workdir (default runs/bench)."""
    del argv
    config = _config("bench")
    from dora_jax.rollout import bench_lib

    bench_lib.run_bench(config, _workdir("runs/bench"))


_ADDRESS = flags.DEFINE_string("address", "0.0.0.0:7100", "`host`: HOST:PORT to listen on.")
_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 1, "`host`: virtual CPU devices.")
_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    compile_cache_lib.DEFAULT_DIRECTORY,
    "`host`: JAX's persistent compilation cache ('' = off).",
)
_HOST_FLAGS = ("address", "num_cpu_devices", "compilation_cache_dir")
# The other commands take these from their config (`--config.num_cpu_devices=...`).
_CONFIG_FIELDS = ("num_cpu_devices", "compilation_cache_dir")


def _host(argv: list[str]) -> None:
    """Serves as a generation or training host for a controller elsewhere (which names it in
    runtime.generation_hosts / training_hosts and sends it everything it needs)."""
    del argv
    cpu_flags_lib.use_cpu_devices(_CPU_DEVICES.value)
    compile_cache_lib.use_compilation_cache(_CACHE_DIR.value)
    from dora_jax.runtime import hosts_lib

    try:
        hosts_lib.host_key()
        hosts_lib.parse_address(_ADDRESS.value, "--address")
    except ValueError as e:
        sys.exit(str(e))
    hosts_lib.listen(_ADDRESS.value)


# ml_collections' module that applies `--config.a.b=` overrides to the loaded config.
_APPLYING_OVERRIDES = os.path.join("config_flags", "config_path.py")


def _without_traceback(
    name: str, command: Callable[[list[str]], None], arguments: int = 0
) -> Callable[[list[str]], None]:
    """A `ConfigError` (a bad field, flag, input file or workdir, refused at start) or a stop by
    the data policy (a bad row under `data.on_bad_row=error`, or no usable row in a whole pass)
    ends the command with its message alone, which names the field or the file and row, and so
    does an interruption (Ctrl-C, or SIGTERM to `train`); anything else that goes wrong keeps
    its traceback. More than `arguments` positional arguments are refused: a stray word was
    ignored, and a misspelled flag with it."""

    @functools.wraps(command)
    def run(argv: list[str]) -> None:
        if len(argv) > 1 + arguments:
            sys.exit(f"dora-jax {name}: unexpected argument(s) {argv[1 + arguments :]}")
        try:
            command(argv)
        except KeyboardInterrupt:
            resume = " (the same command resumes from the newest checkpoint)"
            print(
                f"dora-jax {name}: interrupted{resume if name == 'train' else ''}", file=sys.stderr
            )
            sys.exit(130)
        except Exception as e:
            # Imported here: the data pipeline imports jax, which the command sets up first.
            from dora_jax.data.pipeline_lib import BadRowError, NoUsableRowsError

            if not isinstance(e, ConfigError | BadRowError | NoUsableRowsError):
                raise
            sys.exit(f"dora-jax: {e}")

    return run


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, plus a clear line for an override of a field the config lacks, which
    ml_collections raises as an AttributeError or a KeyError (with its own "did you mean"
    hint) from where it applies overrides. The same errors from anywhere else (a config file's
    own bug) keep their traceback."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:
        frames = traceback.extract_tb(e.__traceback__)
        if not any(f.filename.endswith(_APPLYING_OVERRIDES) for f in frames):
            raise
        reason: object = e
        while isinstance(reason, BaseException) and reason.args:  # a KeyError inside
            reason = reason.args[0]
        hint = str(reason).replace("\n", "; ")
        sys.exit(f"dora-jax: a --config override names no field of the config: {hint}")


COMMANDS = {
    name: _without_traceback(name, command, arguments=1 if name == "audit" else 0)
    for name, command in {
        "train": _train,
        "eval": _eval,
        "export": _export,
        "audit": _audit,
        "bench": _bench,
        "host": _host,
    }.items()
}


# Each command's own flags, for its `--help`.
_FLAGS_OF = {
    "train": ("config", "workdir"),
    "eval": ("config", "workdir"),
    "export": ("config", "workdir", *_EXPORT_FLAGS),
    "audit": (),
    "bench": ("config", "workdir"),
    "host": _HOST_FLAGS,
}


def _help(command: str | None) -> str:
    """The whole tool's usage, or one command's: what it does and the flags it takes. absl's
    own help lists the flags of `__main__`, the console script, which has none."""
    if command is None:
        return f"{__doc__}\n{flags.FLAGS.module_help(sys.modules[__name__])}"
    lines = [f"dora-jax {command}: {' '.join(COMMANDS[command].__doc__.split())}"]
    for name in _FLAGS_OF[command]:
        flag = flags.FLAGS[name]
        default = "" if flag.default is None else f" (default: {flag.default!r})"
        lines.append(f"  --{name}: {flag.help}{default}")
    if "config" in _FLAGS_OF[command]:
        lines.append("  --config.FIELD=VALUE: overrides a field of the config file")
    return "\n".join(lines)


def run() -> None:
    """Console-script entry point: the first argument names the command."""
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in sys.argv[1:]):
        with _reader_may_stop():
            print(_help(sys.argv[1] if sys.argv[1] in COMMANDS else None))
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: dora-jax {{{'|'.join(COMMANDS)}}} [--config=configs/default.py] ...")
    app.run(COMMANDS[sys.argv.pop(1)], flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
