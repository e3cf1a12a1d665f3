"""Run by compile_cache_lib_test in fresh interpreters: `python compile_cache_main.py DIR`.

Turns the cache on for DIR (before JAX is imported, as the CLI does), compiles and runs one
program, then has a spawned child (as a generation or training host would be) run it too.
Prints one JSON line: this process's and the child's cache hits and results.
"""

import json
import multiprocessing
import sys

from dora_jax.runtime import compile_cache_lib


def _run(queue=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    events = []
    jax.monitoring.register_event_listener(lambda name, **kwargs: events.append(name))
    x = np.random.default_rng(0).normal(size=(32, 32)).astype(np.float32)
    y = np.asarray(jax.jit(lambda a: jnp.tanh(a) @ a.T + 1.0)(x))
    out = {
        "hits": events.count("/jax/compilation_cache/cache_hits"),
        "directory": jax.config.jax_compilation_cache_dir,
        "result": y.tobytes().hex(),
    }
    if queue is not None:
        queue.put(out)
    return out


if __name__ == "__main__":
    compile_cache_lib.use_compilation_cache(sys.argv[1])
    parent = _run()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_run, args=(queue,))
    child.start()
    result = {"parent": parent, "child": queue.get(timeout=120)}
    child.join()
    print(json.dumps(result))
