"""`parallelkit export-hf`: an HFCausalLM checkpoint as a Hugging Face model directory."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from parallelkit.cli.config import parse_size


def export_hf_command(argv: Sequence[str]) -> int:
    """Write an HFCausalLM checkpoint as a Hugging Face model directory (config.json, safetensors, tokenizer)."""
    from parallelkit.models.hf_export import export_hf

    parser = argparse.ArgumentParser(prog="parallelkit export-hf", description=export_hf_command.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint of parallelkit.models.HFCausalLM (sharded directory or file)")
    parser.add_argument("out", help="the directory to write; AutoModelForCausalLM.from_pretrained(OUT) loads it")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB (default)")
    parser.add_argument("--tokenizer", help="copy tokenizer files from here (default: the pretrained directory)")
    parser.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA run's adapters alone, in PEFT's format (default: merged into the base weights)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty OUT, replacing the files an export writes and keeping the rest (default: refuse)",
    )
    args = parser.parse_args(argv)
    size = parse_size(args.max_shard_size, "--max-shard-size")
    out = export_hf(args.checkpoint, args.out, size, args.tokenizer, adapters=args.adapters, overwrite=args.overwrite)
    if args.adapters:
        print(f"wrote {out}: load it with peft.PeftModel.from_pretrained(base_model, {str(out)!r})")
    else:
        print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
