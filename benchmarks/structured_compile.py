"""How long the grammar compiler takes on vLLM-style ``structured_outputs`` (regex, EBNF/Lark grammar, choice) at
kvrelay's limits: the numbers in docs/agents.md ("vLLM's structured outputs").

Each case goes through the server's own checks (kvrelay.server.structured_outputs: one it refuses says so and is
not compiled) and compile, on the default model's tokenizer, no compile cache, one compile thread.

    python benchmarks/structured_compile.py
"""

from __future__ import annotations

import argparse
import json
import time

from kvrelay.eval.harness import environment
from kvrelay.server.protocol import ApiError, CompletionRequest
from kvrelay.server.structured_outputs import compile_structured, structured_of
from kvrelay.weights.loader import load_tokenizer

CASES = {
    "regex [0-9]+": {"regex": "[0-9]+"},
    "regex [a-z]{1,1000} (the largest count)": {"regex": "[a-z]{1,1000}"},
    "regex 680 alternatives (4 KB)": {"regex": "|".join(f"w{i:04d}" for i in range(680))},
    "EBNF [^x]{1,1000} (the largest count)": {"grammar": "root ::= [^x]{1,1000}"},
    "EBNF r{1,30}, r ::= [a-z]{1,30}": {"grammar": "root ::= r{1,30}\nr ::= [a-z]{1,30}"},
    "EBNF 400 rules (10 KB)": {"grammar": "root ::= " + " ".join(f"r{i}" for i in range(400)) + "\n"
                       + "\n".join(f'r{i} ::= "x{i}" [a-z]*' for i in range(400))},
    "Lark yes/no": {"grammar": 'start: "yes" | "no"'},
    "choice of 1024 (the most)": {"choice": [f"choice number {i}" for i in range(1024)]},
    "past the limits: EBNF [^x]{1,1000} [^y]{1,1000}": {"grammar": "root ::= [^x]{1,1000} [^y]{1,1000}"},
    "past the limits: regex [a-z]{1,5000}": {"regex": "[a-z]{1,5000}"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    tokenizer = load_tokenizer()
    compile_structured(structured_of(CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "a"})),
                       tokenizer)  # the vocabulary's one-off setup, not timed
    rows = []
    for name, structured in CASES.items():
        body = CompletionRequest(model="m", prompt="x", structured_outputs=structured)
        start = time.perf_counter()
        try:
            compile_structured(structured_of(body), tokenizer)
            outcome = f"compiled in {(time.perf_counter() - start) * 1e3:.0f} ms"
        except ApiError as exc:
            outcome = f"refused: {exc.message}"
        rows.append({"case": name, "outcome": outcome})
        print(f"{name}: {outcome}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment("cpu"), "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
