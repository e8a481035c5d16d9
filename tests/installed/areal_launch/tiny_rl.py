"""A user's AReaL 1.0.4 training script in the shape of AReaL's examples/math/gsm8k_rl.py (its config parsing,
``PPOTrainer`` and ``train``), with eight prompts held in memory in place of GSM8K so nothing is downloaded. Run by
tests/installed/test_areal_launch.py as ``python tiny_rl.py --config ...`` and as ``python -m advantage_client.areal
tiny_rl.py --config ...``."""
import sys

from datasets import Dataset

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config


def main(argv):
    config, _ = load_expr_config(argv, GRPOConfig)
    prompts = Dataset.from_dict({"messages": [[{"role": "user", "content": f"t{3 + i} t{4 + i}"}] for i in range(8)],
                                 "answer": [str(i) for i in range(8)]})
    workflow_kwargs = {"reward_fn": "areal.reward.gsm8k.gsm8k_reward_fn", "gconfig": config.gconfig,
                       "tokenizer": config.tokenizer_path, "enable_thinking": False}
    with PPOTrainer(config, train_dataset=prompts, valid_dataset=None) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
