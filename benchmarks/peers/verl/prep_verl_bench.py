"""Prepare an offline verl 0.9.1 GRPO+LoRA benchmark folder (benchmarks/peers/README.md).

Makes, under OUT/:
  model/            config.json (copied), generation_config.json, and with --weights random bf16 safetensors
                    made on the GPU (verl's FSDP engine loads with from_pretrained, so weights must exist on disk;
                    SGLang uses load_format=dummy and gets the weights from the trainer at the first sync).
  tok/              synthetic WordLevel fast tokenizer with Qwen ids ("\n"=198, <|endoftext|>=151643,
                    <|im_start|>=151644, <|im_end|>=151645; verl's Qwen token builder needs "\n" as one token
                    and <|im_end|>). Kept apart from config.json on purpose: with model_type=qwen2 next to it,
                    AutoTokenizer swaps in Qwen2Tokenizer and "\n" encodes to []. Pass it as model.tokenizer_path.
  train.parquet     N prompts, each exactly --prompt-len tokens after the (content-only) chat template.
  reward.py         compute_score -> random float (GRPO groups get non-zero advantages).

usage: python prep_verl_bench.py --config qwen2.5-7b.json --out /data/verl_q7 --prompts 512 --prompt-len 256 [--weights]
"""

import argparse
import json
import os
import random
import shutil

SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
NEWLINE_ID = 198
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def make_tokenizer(model_dir: str) -> None:
    """A WordLevel fast tokenizer with Qwen's special ids and a content-only chat template, saved to `model_dir`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(151643) if i != NEWLINE_ID}
    vocab["\n"] = NEWLINE_ID
    vocab.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<t\d+>|\n"), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model_dir)


def make_parquet(path: str, n: int, prompt_len: int, seed: int = 0) -> None:
    """`n` verl RL rows (`data_source`, `prompt`, `ability`, `reward_model`, `extra_info`) of `prompt_len` tokens."""
    import pandas as pd

    rng = random.Random(seed)
    ids = [i for i in range(151643) if i != NEWLINE_ID]
    rows = []
    for i in range(n):
        content = "".join(f"<t{rng.choice(ids)}>" for _ in range(prompt_len))
        rows.append(
            {
                "data_source": "synthetic",
                "prompt": [{"role": "user", "content": content}],
                "ability": "none",
                "reward_model": {"style": "rule", "ground_truth": "0"},
                "extra_info": {"split": "train", "index": i},
            }
        )
    pd.DataFrame(rows).to_parquet(path)


def make_weights(model_dir: str) -> None:
    """Random bfloat16 weights for the `config.json` in `model_dir`, made on the GPU and saved beside it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size="5GB")


def main() -> None:
    """Make the folder from the command line (module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--weights", action="store_true")
    args = ap.parse_args()
    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    shutil.copy(args.config, os.path.join(model_dir, "config.json"))
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "eos_token_id": 151645}, f)
    tok_dir = os.path.join(args.out, "tok")
    os.makedirs(tok_dir, exist_ok=True)
    make_tokenizer(tok_dir)
    make_parquet(os.path.join(args.out, "train.parquet"), args.prompts, args.prompt_len)
    with open(os.path.join(args.out, "reward.py"), "w") as f:
        f.write(
            "import random\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
            "    return random.random()\n"
        )
    if args.weights:
        make_weights(model_dir)


if __name__ == "__main__":
    main()
