"""The sizes of a causal LM and of its LoRA adapter, read from its config (no weights), and the byte estimates the
memory plan (`lora_rl_core.memory.plan`) adds up.

The estimates (bytes) are deliberately simple:

    activations per token and decoder layer, kept for backward:  34 h + 8 I bytes (bf16 matmul inputs kept
        for the LoRA branches, float32 RMSNorm inputs, SDPA q/k/v/out, SwiGLU gate/up/act), h = hidden size,
        I = intermediate size (Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4,
        for the method; the coefficients counted for PEFT LoRA on Llama/Qwen2 blocks with frozen bases)
    with gradient checkpointing per decoder layer: 2 h bytes per token and layer, plus one layer's set
    logits of the completion positions: 20 V bytes per token (bf16 head output, float32 copy, log-softmax,
        entropy, their gradient), V = vocabulary size; an upper bound since `algorithm.logprobs.token_logprobs`
        keeps only the bf16 output (2 V) and makes its bf16 gradient (2 V) plus one row's float32
        temporaries (not re-measured on a GPU, so the plan keeps the margin)
    the activations times ACTIVATION_CALIBRATION (1.15, measured on an H100 at 7B with float32 LoRA compute,
        where PEFT keeps a float32 copy of every adapted layer's input for the backward pass; in bfloat16,
        `trainer.lora_compute_dtype`'s `auto` on CUDA, the LoRA branch keeps the bf16 input the base layer
        keeps anyway, so the estimate stays an upper bound there, not re-measured)
    KV cache: 2 (K and V) x layers x kv heads x head dim x 2 bytes per token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_rl_core.config import LoRAConfig, ModelConfig

GIB = 1024**3
ACTIVATION_CALIBRATION = 1.15
"""Measured over estimated activations: the trainer of a Qwen2.5-7B run on an H100 (micro-batch 8 x 304 tokens,
no checkpointing, float32 LoRA compute) reserved 41.6 GiB at its peak against 38.7 GiB estimated (allocator
rounding, cuBLAS workspaces, autograd temporaries the count leaves out);
benchmarks/results/gpu_scale/earlier/7b-1gpu-fad8b3c.json."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a causal LM and of its LoRA adapter that the memory plan reads.

    Attributes:
        params: base parameters (embeddings and head included).
        lora_params: trainable LoRA parameters for the run's `lora` section.
        hidden / intermediate / layers / vocab: `hidden_size`, `intermediate_size`, `num_hidden_layers`,
            `vocab_size`.
        kv_dim: key/value width per token and layer (`num_key_value_heads x head_dim`).
        attention_heads: `num_attention_heads` (SGLang's tensor parallelism must divide it); 0 = unknown.
        critic_params: PPO's critic (`algorithm.advantage: gae`): its LoRA adapter's parameters and its value
            head's (`hidden + 1`), trained in float32 beside the policy's; 0 without a critic.
    """

    params: int
    lora_params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_dim: int
    attention_heads: int = 0
    critic_params: int = 0

    @classmethod
    def of(cls, model: ModelConfig, lora: LoRAConfig, critic_lora: LoRAConfig | None = None) -> ModelShape:
        """Read the model's config (no weights) and count its parameters on the meta device (`critic_lora`: the
        critic's adapter under `algorithm.advantage: gae`, else None).

        Raises:
            ModelError: the model folder cannot be had.
            ConfigError: `lora.target_modules` (or `critic.lora.target_modules`) names no linear module.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        from lora_rl_core.lora import resolve_target_modules
        from lora_rl_core.models import model_folder

        config = AutoConfig.from_pretrained(model_folder(model), trust_remote_code=model.trust_remote_code)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)

        def adapter_params(cfg: LoRAConfig, section: str) -> int:
            targets = set(resolve_target_modules(meta, cfg, section=section))
            return sum(
                cfg.rank * (mod.in_features + mod.out_features)
                for name, mod in meta.named_modules()
                if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
            )

        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            params=sum(p.numel() for p in meta.parameters()),
            lora_params=adapter_params(lora, "lora"),
            critic_params=adapter_params(critic_lora, "critic.lora") + text.hidden_size + 1 if critic_lora else 0,
            hidden=text.hidden_size,
            intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
            layers=text.num_hidden_layers,
            vocab=text.vocab_size,
            kv_dim=(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
            attention_heads=heads,
        )

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """The base weights, bytes."""
        return self.params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache per token, all layers, bytes."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def activation_bytes(self, tokens: int, frame_tokens: int, *, checkpointing: bool) -> int:
        """Peak activation memory of one micro-batch's forward and backward (module docstring), bytes.

        Args:
            tokens: padded tokens of the micro-batch (`[batch, seq]` numel).
            frame_tokens: positions whose logits are kept (the completions).
            checkpointing: gradient checkpointing per decoder layer.
        """
        per_layer = 34 * self.hidden + 8 * self.intermediate
        body = (
            tokens * (2 * self.hidden * self.layers + per_layer) if checkpointing else tokens * per_layer * self.layers
        )
        return int((body + frame_tokens * 20 * self.vocab) * ACTIVATION_CALIBRATION)
