"""`parallelkit consolidate`: a sharded checkpoint's weights as one state dict."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from parallelkit.checkpoint import consolidate


def consolidate_command(argv: Sequence[str]) -> int:
    """Write a sharded (DCP) checkpoint's model weights as one state dict that the unparallelised model loads."""
    parser = argparse.ArgumentParser(prog="parallelkit consolidate", description=consolidate_command.__doc__)
    parser.add_argument("checkpoint", help="checkpoint directory written by a parallelkit strategy")
    parser.add_argument("out", help="file to write (torch.save of {parameter name: tensor})")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (default: refuse)")
    args = parser.parse_args(argv)
    out = consolidate(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out}: load it with model.load_state_dict(torch.load({str(out)!r}, weights_only=True))")
    return 0
