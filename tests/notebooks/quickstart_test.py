"""Executes `notebooks/quickstart.ipynb` headless on its tiny config and checks what it shows.

The kernel is this interpreter (a kernelspec written into a temporary JUPYTER_PATH), so the
notebook sees the same installed `dora_jax`. The kernel inherits the environment, including
the 8 virtual CPU devices from conftest, `DORA_QUICKSTART_TINY=1` and a temporary workdir. The
notebook runs from notebooks/ and finds the repository root itself.
"""

import json
import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
KERNEL = "dora-quickstart-test"


def _kernelspec(root: pathlib.Path) -> None:
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dora_jax test kernel",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def _texts(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def _pngs(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


@pytest.mark.slow
def test_quickstart_runs_headless_and_shows_results(tmp_path, monkeypatch):
    _kernelspec(tmp_path / "jupyter")
    workdir = tmp_path / "run"
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("DORA_QUICKSTART_TINY", "1")
    monkeypatch.setenv("DORA_QUICKSTART_WORKDIR", str(workdir))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    try:
        client.execute()
    finally:  # keep the executed notebook for a failed run's post-mortem
        nbformat.write(nb, tmp_path / "quickstart.executed.ipynb")

    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(_texts(c) for c in code)
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]

    assert "TINY=True" in text
    assert "audit of a 'dora' run: PASS" in text
    assert re.search(r"held-out pass@1: \d\.\d{3} -> \d\.\d{3}", text)
    assert re.search(r"mode: dora, iterations: 4\b", text)
    assert "rollout totals:" in text
    # The summary plot and the trace's Gantt chart are both displayed as PNGs.
    assert sum(_pngs(c) for c in code) >= 2
    assert any("summary.png" in "".join(c.source) and _pngs(c) for c in code)
    most = re.search(r"most versions decoding at the same moment: (\d+)", text)
    assert most and int(most.group(1)) >= 2, "the trace shows no two versions side by side"
    for name in ("ledger.jsonl", "trace.json", "summary.json", "summary.png", "trace_gantt.png"):
        assert os.path.isfile(workdir / name), name
