"""The extract benchmark's inputs: a model folder of one of the benchmark shapes (config.json and
the tiny tokenizer; the engine loads dummy weights) and a prompts file of random corpus words.

    python3 benchmarks/extract_inputs.py --out /tmp/extract                 # gpu_session.sh's
    python3 benchmarks/extract_inputs.py --out /tmp/rows --model 1b-rows --prompts 1024 --words 3-8

Prints the model folder; the prompts are OUT/prompts.txt. The prompts are the same for the same
arguments (a fixed seed), so two packages' runs read the same text.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import scenarios as S  # noqa: E402
from benchmarks.run import prepare_model  # noqa: E402
from vllm_capture.tiny_models import CORPUS  # noqa: E402


def word_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX words, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return bounds


def prompt_lines(count: int, words: tuple[int, int], seed: int = 0) -> list[str]:
    vocabulary = sorted({w for line in CORPUS for w in line.split()})
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(*words)))
            for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for models/KEY/ and prompts.txt")
    parser.add_argument("--model", default="1b", choices=sorted(S.MODELS))
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--words", type=word_range, default=(20, 120), metavar="MIN-MAX")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = prepare_model(S.MODELS[args.model], out)
    (out / "prompts.txt").write_text("\n".join(prompt_lines(args.prompts, args.words)) + "\n")
    print(folder)


if __name__ == "__main__":
    main()
