"""The runtime is what a car carries: it must work with torch and transformers absent."""

from __future__ import annotations

import subprocess
import sys

BLOCK = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_the_runtime_imports_without_torch_or_transformers():
    p = run("import cabinlm.runtime, cabinlm.contract.manifest, cabinlm.cli; print('ok')")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_the_runtime_chats_without_torch_or_transformers(load, tiny_qwen2_dir, export_to):
    folder = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=64, chunk=16)
    p = run(
        "from cabinlm.runtime import open_artifact, Dialogue;"
        f"d = Dialogue(*open_artifact({str(folder)!r}), max_new_tokens=5);"
        "r = d.ask('check the mirrors'); print(r.new_tokens, 'torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    assert p.returncode == 0, p.stderr
    n, torch_loaded = p.stdout.split()
    assert 0 <= int(n) <= 5 and torch_loaded == "False"
