"""Build the sample preference pairs: data/sample/preferences.jsonl (fixed seed, no copied text).

    python data/make_preferences.py        # rewrites data/sample/preferences.jsonl

Each record is TRL's standard preference form: `prompt` (the instruction in the pipeline's own template,
so an adapter trained on data/sample/instructions.jsonl starts from the same prompts), `chosen` (the answer
to that instruction) and `rejected` (a well-formed answer to a different instruction of another task
family). The preference is checkable: the chosen answer names the instruction's subject, the rejected one
answers something else. A tiny model learns it in a few dozen DPO steps on a CPU.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_embedded import FAMILIES  # data/ is the script's folder, so its sibling imports as a module

HERE = Path(__file__).resolve().parent
SEED = 4321
N_PAIRS = 1200
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n{context}### Response:\n"


def make_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """n (prompt, chosen, rejected, category) records: chosen answers the prompt, rejected another question."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        family, other = rng.sample(FAMILIES, 2)
        instruction, context, chosen = family(rng)
        _, _, rejected = other(rng)
        block = f"### Context:\n{context}\n\n" if context else ""
        rows.append({"prompt": PROMPT_TEMPLATE.format(instruction=instruction, context=block),
                     "chosen": chosen, "rejected": rejected, "category": family.__name__.lstrip("_")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "sample" / "preferences.jsonl")
    a = ap.parse_args()
    rows = make_pairs(N_PAIRS, SEED)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {a.out} ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
