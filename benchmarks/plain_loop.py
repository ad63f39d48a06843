"""The plain loop: one process, `pipeline.Extractor`, decode -> features -> run, clip after clip.

Run as a whole process (the parent times it from outside, as it times `voxmill extract`):

    python -m benchmarks.plain_loop MANIFEST --models DIR --ops tokenize[,embed]

With both ops each clip is decoded once (`Extractor.wave`) and fed to both models, as a user of
`Extractor` would write it. Prints one JSON line: import, load and loop times, per-stage totals.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--ops", default="tokenize")
    args = parser.parse_args()
    ops = args.ops.split(",")

    from pipeline import Extractor
    from pipeline.audio.decode import load_audio
    from pipeline.inference import Timings, embed, tokenize
    from pipeline.records import ROLE_EMBEDDER, ROLE_TOKENIZER

    imported = time.time()
    roles = [ROLE_TOKENIZER] * ("tokenize" in ops) + [ROLE_EMBEDDER] * ("embed" in ops)
    clips = [json.loads(line) for line in args.manifest.read_text().splitlines() if line.strip()]
    stages: dict[str, float] = {}
    audio_s = 0.0
    with Extractor.from_model_dir(args.models, provider="cpu", roles=roles) as extractor:
        loaded = time.time()
        for clip in clips:
            timings = Timings()
            wave = load_audio(clip["path"], extractor.limits, timings.stages)  # = extractor.wave(path)
            if "tokenize" in ops:
                tokenize(extractor.sessions[ROLE_TOKENIZER], wave.samples, timings)  # = extractor.tokenize
            if "embed" in ops:
                embed(extractor.sessions[ROLE_EMBEDDER], wave.samples, timings)  # = extractor.embed
            audio_s += wave.duration_s
            for stage, ms in timings.stages.items():
                stages[stage] = stages.get(stage, 0.0) + ms
        looped = time.time()
    print(
        json.dumps(
            {
                "started": STARTED,
                "import_s": round(imported - STARTED, 4),
                "load_s": round(loaded - imported, 4),
                "loop_s": round(looped - loaded, 4),
                "clips": len(clips),
                "audio_s": round(audio_s, 3),
                "stages_ms": {k: round(v, 1) for k, v in stages.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
