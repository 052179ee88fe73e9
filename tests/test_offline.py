"""Loading a model reaches no network (README: a run reaches the network only for a hub id you give it).

bitsandbytes decides at import, on CPUs with AVX512-BF16, to ask the Hub for a kernel (tasks/offline.py). The test
runs the pipeline's own loads in a fresh process under a socket-level guard (an audit hook on name lookups and
connections beyond this machine), with bitsandbytes' CPU check forced to say AVX512-BF16: it fails on any CPU if a
load tries the network, and it would pass trivially on none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tasks.config import PROJECT_ROOT

SCRIPT = r'''
import importlib.abc, importlib.machinery, json, socket, sys
from pathlib import Path

attempts = []
LOCAL = ("localhost", "127.0.0.1", "::1", "", None)


def guard(event, args):
    """Refuse and record every name lookup or connection that would leave this machine."""
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"):
        host = args[0].decode() if isinstance(args[0], bytes) else args[0]
    elif event == "socket.connect" and isinstance(args[1], tuple):  # (host, port[, ...]); a str is a unix socket
        host = args[1][0]
    else:
        return
    if host in LOCAL or str(host).startswith("127."):
        return
    attempts.append(f"{event} {host}")
    raise OSError(f"the test blocks network access ({event} {host})")


class SaysAvx512Bf16(importlib.abc.MetaPathFinder):
    """bitsandbytes.functional with has_avx512bf16() -> True: the check its CPU backend gates the Hub kernel on."""

    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return None

            def exec_module(self, module):
                real.exec_module(module)
                module.has_avx512bf16 = lambda: True

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, SaysAvx512Bf16())
sys.addaudithook(guard)

from tasks.config import ModelArgs
from tasks.prepare_model.stage import prepare_model
from tasks.models.loading import load_quantized

folder = prepare_model.fn(ModelArgs(), Path(sys.argv[1]))  # the base model, quantized to 4 bits
load_quantized(Path(folder))  # as train_adapter and evaluate_adapter load it
import bitsandbytes.backends.cpu.ops as ops
import kernels  # importable again: only bitsandbytes' own import went without it

during = list(attempts)
try:
    socket.getaddrinfo("huggingface.co", 443)
except OSError:
    pass
print(json.dumps({"attempts": during, "guard_works": attempts[len(during):] == ["socket.getaddrinfo huggingface.co"],
                  "gate_taken": hasattr(ops, "gemm_4bit_forward_kernel"),
                  "hub_kernel": getattr(ops, "gemm_4bit_forward_kernel", None) is not None,
                  "kernels": kernels.__name__}))
'''


def test_loading_a_model_attempts_no_network_connection(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "KERNELS_"))}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty hub cache: nothing to find locally either
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "runs")], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["gate_taken"] and found["guard_works"], found  # the check said yes, and the guard is live
    assert found["attempts"] == [], found
    assert not found["hub_kernel"] and found["kernels"] == "kernels"
    assert "kernels-community" not in done.stderr  # bitsandbytes' warning about the kernel it did not fetch
