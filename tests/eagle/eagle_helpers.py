"""Helpers shared by the EAGLE tests."""

from __future__ import annotations

import argparse


def train_args(target, out, work, text_dir, fmt="eagle", extra=()) -> argparse.Namespace:
    from vllm_easyspec_train.trainer import add_train_eagle_arguments

    p = argparse.ArgumentParser()
    add_train_eagle_arguments(p)
    argv = ["--target", str(target), "--out", str(out), "--format", fmt, "--work-dir", str(work),
            "--no-self-distill", "--text-dir", str(text_dir), "--text-tokens", "2400", "--seq-len", "64",
            "--max-steps", "6", "--eval-every", "3", "--save-every", "3", "--eval-steps", "3",
            "--batch-size", "4", "--amp", "none", "--quiet", "--min-train-tokens", "500",
            "--val-fraction", "0.15", *extra]
    a = p.parse_args(argv)
    a._argv = argv
    return a
