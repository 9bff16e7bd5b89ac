"""The fit check's GPU prediction against a GPU run's measured peak: no GPU needed to predict, one to measure.

    python benchmarks/bench_gpu_fit_check.py [--from benchmarks/results/real_size_speed_h200_eager2.json]

``bench_real_size.py --device cuda`` records, for every lit_speed row, the command it ran and the step-wise maximum of
``torch.cuda.max_memory_allocated`` (its recorder). This script composes each of those rows' configs again (the
bench's own callbacks and the run folder's overrides left out), asks ``lit_speed.run.memory_fit.fit_check`` what the step
needs on the GPU (:func:`~lit_speed.run.memory_fit.fit_check.estimate_run` with no process: the CPU probe in the run's
precision, eager; the tensors, then x ``GPU_SLACK`` for what the check compares with the device's free memory) and
writes both beside the measured peak. The measurement is the GPU run's (dated in its JSON); the prediction is made
here, on this machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=lambda p: Path(p).resolve(),
                        default=ROOT / "benchmarks" / "results" / "real_size_speed_h200_eager2.json")
    args = parser.parse_args(argv)
    from model_folders import build

    from lit_speed.data.charlm import source_root
    from lit_speed.run.config_check import preflight
    from lit_speed.run.memory_fit import fit_check, fit_check_gpu

    run = json.loads(args.source.read_text())
    rows = []
    for row in run["results"]["rows"]:
        if row["tool"] != "lit" or not row.get("cuda_peak_bytes"):
            continue
        overrides = []
        for arg in row["command"].split()[1:]:
            if arg.startswith(("+callbacks.", "hydra.run.dir=", "peft.export_dir=")):  # the bench's recorder/profiler
                continue
            key, _, value = arg.partition("=")
            if key == "model.pretrained":  # this machine's copy of the same folder
                arg = f"{key}={build(Path(value).name)}"
            elif key == "data.root":
                arg = f"{key}={source_root('lightning')}"
            overrides.append(arg)
        estimate = fit_check.estimate_run(preflight(overrides), process_bytes=0)
        tensors = estimate.tensors
        measured = row["cuda_peak_bytes"]
        rows.append({"name": row["name"], "compiled": "compile]" in row["command"], "predicted_tensors": tensors,
                     "checked_against_free": fit_check_gpu.gpu_step_bytes(estimate), "measured_peak": measured,
                     "predicted_over_measured": round(tensors / measured, 3), "parts": estimate.parts()})
        print(f"{row['name']}: predicted {tensors / 2**30:.2f} GiB (x{fit_check_gpu.GPU_SLACK} -> "
              f"{fit_check_gpu.gpu_step_bytes(estimate) / 2**30:.2f}), measured {measured / 2**30:.2f} GiB: "
              f"x{tensors / measured:.3f}")
    line = (f"predicted GPU step (eager probe, no slack) over the measured step-wise peak of `{args.source.name}` "
            f"({run['machine'].get('gpu')}, {run['date'][:10]}): "
            + ", ".join(f"{r['name']} {r['predicted_tensors'] / 2**30:.2f}/{r['measured_peak'] / 2**30:.2f} GiB "
                        f"x{r['predicted_over_measured']}" for r in rows)
            + f"; checked with x{fit_check_gpu.GPU_SLACK}")
    name = f"gpu_fit_check_{args.source.stem.removeprefix('real_size_speed_')}"
    write_result(name, {"source": str(args.source.relative_to(ROOT)), "gpu": run["machine"].get("gpu"),
                        "slack": fit_check_gpu.GPU_SLACK, "rows": rows}, line)


if __name__ == "__main__":
    main()
