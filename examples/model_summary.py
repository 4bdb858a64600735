"""Print a layer-by-layer summary (output shapes, parameter counts) of a RoFormer model.

    python examples/model_summary.py --config_overrides "hidden_size=256,num_hidden_layers=4,intermediate_size=1024"
    python examples/model_summary.py --model_name_or_path path/to/saved/model --seq_len 512 --batch_size 8

Without `--model_name_or_path`, a masked-LM model is built from the default `RoFormerConfig` (RoFormer base)
with the overrides applied.
"""

from __future__ import annotations

import argparse

import transformers
from lib.config_overrides import parse_overrides

import roformer_hf
from roformer_hf import RoFormerConfig, summary


def build_model(model_name_or_path: str | None, overrides: dict[str, object]) -> transformers.PreTrainedModel:
    if model_name_or_path is None:
        return roformer_hf.RoFormerForMaskedLM(RoFormerConfig(**overrides))
    config = transformers.AutoConfig.from_pretrained(model_name_or_path, **overrides)
    architecture = (config.architectures or ["RoFormerForMaskedLM"])[0]
    return getattr(roformer_hf, architecture).from_pretrained(model_name_or_path, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", help="a folder written by save_pretrained (default: a new model)")
    parser.add_argument("--config_overrides", default="", help='e.g. "hidden_size=256,num_hidden_layers=4"')
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--depth", type=int, default=4, help="how deep to show nested modules")
    args = parser.parse_args()

    model = build_model(args.model_name_or_path, parse_overrides(args.config_overrides))
    print(summary(model, batch_size=args.batch_size, seq_len=args.seq_len, depth=args.depth))
    print(f"model.num_parameters() = {model.num_parameters():,}")


if __name__ == "__main__":
    main()
