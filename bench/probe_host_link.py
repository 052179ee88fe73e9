"""How fast activations can move between the GPU and pinned host memory while the GPU computes (GPU).

Times, on one CUDA device: pinned device-to-host and host-to-device copies of `--mib` MiB on a side stream, each
alone and both at once (the link is full duplex), and a bf16 matrix product (8192^3) alone and while both copies
run, so that the cost of overlapping copies with compute is measured, not assumed. Prints one JSON line.

usage (GPU host): python3 bench/probe_host_link.py [--mib 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(work, repeats: int) -> float:
    """Seconds per call of `work`, the device synchronised around each call; the best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.mib * 2**20 // 2
    gpu_out, gpu_in = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16,
                                                                                            device="cuda")
    host_out, host_in = torch.empty(n, dtype=torch.bfloat16, pin_memory=True), torch.ones(n, dtype=torch.bfloat16,
                                                                                            pin_memory=True)
    down, up = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemms = 40

    def d2h() -> None:
        with torch.cuda.stream(down):
            host_out.copy_(gpu_out, non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(up):
            gpu_in.copy_(host_in, non_blocking=True)

    def matmul() -> None:
        for _ in range(gemms):
            torch.mm(a, a)

    def both() -> None:
        d2h()
        h2d()

    def everything() -> None:
        both()
        matmul()

    gib = args.mib / 1024
    gemm_s = timed(matmul, args.repeats)
    with_copies = timed(everything, args.repeats)
    result = {"gpu": torch.cuda.get_device_name(), "mib": args.mib,
              "d2h_gib_s": round(gib / timed(d2h, args.repeats), 1),
              "h2d_gib_s": round(gib / timed(h2d, args.repeats), 1),
              "both_each_gib_s": round(gib / timed(both, args.repeats), 1),
              "matmul_tflops": round(gemms * 2 * 8192**3 / gemm_s / 1e12, 1),
              "matmul_tflops_with_copies": round(gemms * 2 * 8192**3 / with_copies / 1e12, 1),
              "copies_during_matmul_s": round(with_copies, 3), "matmul_s": round(gemm_s, 3)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
