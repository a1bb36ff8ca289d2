"""``mmrlhf doctor``: the first command on a new machine. Runs the checks of :mod:`mmrlhf.testing.doctor` (engine
vs trainer log-probs per family, toy runs with sleep off and on, a weight-sync round trip, bf16 vs fp32 updates,
torchrun with one rank, the memory plan, the GPU paths that ``auto`` defaults take only once proven here: fla's
kernel and the asynchronous agent loop over vLLM, the GPU benchmarks), prints a pass / fail / skip table and writes
it to a file. A passing ``fla`` or ``agent_loop`` check records its proof for this machine (:mod:`mmrlhf.proofs`)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from mmrlhf.testing.doctor import CHECKS

    parser = sub.add_parser(
        "doctor",
        help="check this machine (GPU first): engine log-probs, toy runs with sleep, weight sync, bf16, torchrun, "
        "the fla kernel and the asynchronous agent loop",
        description="Runs every check on the tiny offline models and prints one row per check (pass / fail / skip, "
        "its number, the reason), written to OUT/doctor.md and OUT/doctor.json. Without a CUDA device the CPU "
        "checks run and the GPU-only ones are skipped with the reason. The fla and agent_loop checks compare a GPU "
        "path with the exercised one; passing, they record a proof for this machine (GPU, torch and package "
        "versions; $MMRLHF_PROOFS, default ~/.cache/mmrlhf/gpu_proofs.json) that lets model.linear_attention_kernel"
        "=auto and agent.loop=auto take that path here. Exits 1 if any check failed.",
    )
    parser.add_argument("--gpu", action="store_true",
                        help="require an accelerator: run on the one torch finds, or stop with an error")
    parser.add_argument("--device", default="auto", help="trainer device: auto (CUDA when present) | cpu | cuda[:i]")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--steps", type=int, default=5, help="toy-run steps (default 5)")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "transformers"],
                        help="toy runs' rollout engine (auto: vLLM when installed)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run of the command itself)")
    parser.add_argument("--family", nargs="+", default=None, metavar="FAMILY",
                        help="engine_logprobs rows for these tiny-model families only (default: every family)")
    parser.add_argument("--out", default="outputs/doctor", help="folder for doctor.md / doctor.json")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from mmrlhf.testing.doctor import CheckResult, DoctorOptions, run_checks, write_report

    device = args.device
    if args.gpu:  # the accelerator torch finds (the device is never named here: the machine decides it)
        from mmrlhf.devices import resolve_device

        found = resolve_device(device)
        if found.type == "cpu":
            print("error: --gpu, but torch finds no accelerator on this machine (run without --gpu, or with "
                  "--device cpu, to check the CPU)", file=sys.stderr)
            return 2
        device = str(found)
    families = {} if args.family is None else {"families": tuple(args.family)}
    opts = DoctorOptions(device=device, steps=args.steps, quick=args.quick, engine=args.engine, **families)

    def echo(row: CheckResult) -> None:
        value = "" if row.value is None else f"{row.value:.4g}"
        print(f"{row.status.upper():<5} {row.name:<26} {value:>10} {row.unit:<20} {row.reason}", flush=True)

    print(f"mmrlhf doctor: device {device}; one line per check as it finishes", flush=True)
    results = run_checks(opts, args.only, echo=echo)
    header = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device,
              "quick": args.quick, "steps": args.steps}
    env = next((r for r in results if r.name == "environment"), None)
    if env is not None:
        header.update({k: v for k, v in env.details.items() if k in ("torch", "gpu", "vllm")})
    md, js = write_report(results, args.out, header)
    failed = [r.name for r in results if r.status == "fail"]
    print(f"\n{sum(r.status == 'pass' for r in results)} passed, {len(failed)} failed, "
          f"{sum(r.status == 'skip' for r in results)} skipped; table: {md}, rows: {js}")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    from mmrlhf.cli import main

    sys.exit(main(["doctor", *sys.argv[1:]]))
