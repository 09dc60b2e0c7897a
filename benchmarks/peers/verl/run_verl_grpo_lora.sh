#!/usr/bin/env bash
# verl 0.9.1 GRPO + LoRA + SGLang (colocated, 1 GPU) timing run; ran 10 steps on one H200 (benchmarks/peers/README.md):
# every key checked against the 0.9.1 wheel's verl/trainer/config/_generated_ppo_trainer.yaml.
# usage: OUT=/data/verl_q7 STEPS=8 bash run_verl_grpo_lora.sh   (OUT from prep_verl_bench.py --weights)
set -euo pipefail
OUT=${OUT:?}; STEPS=${STEPS:-8}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
export VERL_FILE_LOGGER_PATH=${OUT}/metrics.jsonl   # one JSON line per step (trainer.logger includes "file")
python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files=${OUT}/train.parquet data.val_files=${OUT}/train.parquet \
  data.train_batch_size=16 data.max_prompt_length=${PROMPT_LEN:-256} data.max_response_length=${RESPONSE_LEN:-256} \
  data.filter_overlong_prompts=False data.truncation=error data.shuffle=False data.dataloader_num_workers=2 \
  actor_rollout_ref.model.path=${OUT}/model actor_rollout_ref.model.tokenizer_path=${OUT}/tok \
  actor_rollout_ref.model.lora_rank=${LORA_RANK:-16} actor_rollout_ref.model.lora_alpha=${LORA_ALPHA:-32} \
  actor_rollout_ref.model.target_modules=all-linear \
  actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.enable_gradient_checkpointing=${GRAD_CKPT:-True} \
  +actor_rollout_ref.model.override_config.attn_implementation=${ATTN:-sdpa} \
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 \
  actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_epochs=1 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${MICRO:-8} \
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=${GPU_MEM:-0.5} \
  actor_rollout_ref.rollout.load_format=dummy \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=${MICRO:-8} \
  actor_rollout_ref.rollout.ignore_eos=True \
  "+actor_rollout_ref.rollout.engine_kwargs.sglang.preferred_sampling_params='{\"ignore_eos\": true}'" \
  +actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=${SGLANG_ATTN:-triton} \
  actor_rollout_ref.rollout.agent.num_workers=2 \
  reward.custom_reward_function.path=${OUT}/reward.py reward.custom_reward_function.name=compute_score \
  reward.num_workers=2 \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 \
  'trainer.logger=["console","file"]' trainer.project_name=verl_bench trainer.experiment_name=$(basename ${OUT}) \
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.total_epochs=1000 trainer.total_training_steps=${STEPS} \
  ray_kwargs.ray_init.num_cpus=16 \
  "$@"
# Options: the trainer tuned (micro-batches by tokens, no recomputation): GRAD_CKPT=False, and
#            actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=N
#          merged-weight sync instead of an SGLang adapter: actor_rollout_ref.model.lora.merge=True
#          skip the old-logprob recompute (use SGLang's logprobs): algorithm.rollout_correction.bypass_mode=True
#          SGLang attention backend: triton here, as our runs resolve it without the FA3 carry (verl's own pick,
#            flashinfer, JIT-compiles its sm90 prefill and the carried site has no cutlass headers); SGLANG_ATTN=fa3
#            once the FA3 carry is staged
