"""The `dflash-robot` command line: parse, validate, call the library; timing and printing
live here, never in the algorithm. Subcommands import torch only once they run, so
`--help` and argument errors answer at once."""

from __future__ import annotations

import argparse
import sys

from dflash_robot.cli.common import HelpFormatter

DESCRIPTION = """dflash-robot: lossless DFlash speculative decoding for transformers models.

A small block-diffusion draft proposes a block of tokens, the target model checks the whole
block in one forward pass, and the longest prefix the target agrees with is kept: the
output is exactly the target's own, produced in fewer target passes.

Run `dflash-robot COMMAND --help` for a command's options."""


def build_parser() -> argparse.ArgumentParser:
    from dflash_robot import __version__
    from dflash_robot.cli import bench, convert, export, generate, serve, train

    parser = argparse.ArgumentParser(prog="dflash-robot", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    bench.add_parser(sub)
    train.add_parser(sub)
    train.add_data_parser(sub)
    serve.add_parser(sub)
    convert.add_parser(sub)
    export.add_parser(sub)
    return parser


def _quiet_import_noise() -> None:
    """transformers imports torchao when it is installed (ExecuTorch's extra pulls it in), and
    torchao logs a warning per optional CUDA library it cannot load; none of it concerns a run."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    from dflash_robot.cli import bench, convert, export, generate, serve, train
    from dflash_robot.errors import DFlashError

    args = build_parser().parse_args(argv)
    _quiet_import_noise()
    commands = {"generate": generate.run, "bench": bench.run, "train": train.run, "data": train.run_data,
                "serve": serve.run, "convert": convert.run, "export": export.run}
    try:
        return commands[args.command](args)
    except DFlashError as e:
        print(f"dflash-robot: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndflash-robot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
