"""LoRA adapters as files and names: the rules the store, the engines, the server and the CLI share.

`names`: adapter, run, version, tag and file names (``adapter_name`` / ``parse_adapter_name``, the one
parser of ``<run>-v<NNNNNN>``); `io`: safetensors files and PEFT folders (no pickle, ever; reading a store version is
`lora_rl_core.store.sources`);
`validation`: the checks an adapter passes before anything loads it (``AdapterRules``).
"""

from lora_rl_core.adapters.io import (
    TensorsAndConfig,
    load_safetensors,
    peft_folder,
    refuse_pickles,
    safetensors_bytes,
    safetensors_shapes,
)
from lora_rl_core.adapters.names import (
    CONFIG_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    PICKLE_SUFFIXES,
    RUN_CONFIG_FILE,
    STORE_URI_PREFIX,
    adapter_name,
    adapter_run,
    adapter_version,
    check_adapter_name,
    check_file_name,
    parse_adapter_name,
    parse_adapter_spec,
    parse_version_uri,
    validate_run_id,
    validate_tag,
    validate_version,
)
from lora_rl_core.adapters.validation import (
    AdapterRules,
    adaptable_module_names,
    check_finite,
    module_matches,
    validate_adapter_config,
    validate_adapter_tensors,
)

__all__ = [
    "CONFIG_FILE",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "PICKLE_SUFFIXES",
    "RUN_CONFIG_FILE",
    "STORE_URI_PREFIX",
    "AdapterRules",
    "TensorsAndConfig",
    "adaptable_module_names",
    "adapter_name",
    "adapter_run",
    "adapter_version",
    "check_adapter_name",
    "check_file_name",
    "check_finite",
    "load_safetensors",
    "module_matches",
    "parse_adapter_name",
    "parse_adapter_spec",
    "parse_version_uri",
    "peft_folder",
    "refuse_pickles",
    "safetensors_bytes",
    "safetensors_shapes",
    "validate_adapter_config",
    "validate_adapter_tensors",
    "validate_run_id",
    "validate_tag",
    "validate_version",
]
