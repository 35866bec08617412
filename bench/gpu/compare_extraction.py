"""Mean cosine per stored layer between two HiddenStateSets of the same samples (on the H200: the flow's
`vllm` extraction against `eagle3 extract --set extraction.backend=hf` on the same SampleSet).

    python3 -m bench.gpu.compare_extraction RUN/hidden_states RUN_HF/hidden_states
"""

from __future__ import annotations

import argparse
import json

from bench.extraction_speed import mean_cosines
from eagle3_core.artifacts import HiddenStateSet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    first, second = HiddenStateSet.load(args.first), HiddenStateSet.load(args.second)
    result = {
        "layer_ids": first.layer_ids,
        "tokens": [first.tokens, second.tokens],
        "mean_cosine_per_stored_layer": mean_cosines(first, second),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
