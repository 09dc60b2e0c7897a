"""lora-rl core library: config, models, LoRA, algorithm, engines, store, trainer (no Prefect here).

Importing it sets `OMP_WAIT_POLICY=PASSIVE` unless the environment already sets a policy, so that
torch's OpenMP threads sleep at barriers instead of spinning: on a 2-core CPU with one core busy
elsewhere, spinning threads made a training step about 4x slower (`lora_rl_core.runtime`). OpenMP
reads it once, when torch loads, so it only takes effect when this package is imported before torch;
the `lora-rl` command does that. Set `OMP_WAIT_POLICY=ACTIVE` to keep spinning.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
