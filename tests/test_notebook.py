"""The quickstart notebook runs end to end (fit with strategy="slideformer", export, reload, generate)."""

import os
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs_end_to_end(tmp_path, monkeypatch):
    import nbformat  # the dev extra's; imported here so that collecting the suite (e.g. `-m gpu`) needs neither
    from nbclient import NotebookClient

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits it: any download attempt fails the test
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3" with argv "python" runs as this interpreter (jupyter_client substitutes sys.executable)
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}},
                   env=dict(os.environ)).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "loss: first" in outputs
    assert (tmp_path / "quickstart_out" / "hf_model" / "model.safetensors").is_file()
