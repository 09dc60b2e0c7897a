"""`python -m sglang.launch_server --model-path M --host H --port P [SGLang flags...]` for tests.

Serves the fake SGLang server over an embedded engine on the model folder M (CPU, float32), bound to H:P.
SGLang's other flags are accepted and ignored. Like SGLang it runs child processes: it starts one sleeping
helper, so a test can check that stopping the server ends its whole process group.

Test switches (not SGLang's): `--fake-record FILE` writes the argv and the helper's pid as JSON;
`--fake-exit-at-start CODE` prints "fake start-up failure" and exits with CODE; `--fake-never-healthy`
sleeps without serving.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--fake-record")
    parser.add_argument("--fake-exit-at-start", type=int)
    parser.add_argument("--fake-never-healthy", action="store_true")
    args, _ = parser.parse_known_args()
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if args.fake_record:
        with open(args.fake_record, "w") as f:
            json.dump({"argv": sys.argv[1:], "helper_pid": helper.pid}, f)
    if args.fake_exit_at_start is not None:
        print("fake start-up failure", flush=True)
        helper.kill()
        sys.exit(args.fake_exit_at_start)
    if args.fake_never_healthy:
        time.sleep(600)
    import torch
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_rl_core.engines import EmbeddedEngine
    from lora_rl_testing.sglang_fake import create_sglang_fake_app

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    with EmbeddedEngine(model, AutoTokenizer.from_pretrained(args.model_path), max_batch_size=16) as engine:
        uvicorn.run(create_sglang_fake_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
