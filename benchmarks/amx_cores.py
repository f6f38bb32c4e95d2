"""AMX's rate on each core at the same moment: every OpenMP thread runs a loop of bf16 tile products from registers
alone (2 x 2 tiles of results, no loads), and prints its TFLOP/s. On a shared machine the cores need not run alike:
this is the probe docs/performance.md quotes beside the kernels' work sharing. Compiles a small C program with the
system's C compiler (gcc with AMX support) into a temporary folder; needs a CPU with AMX.

    OMP_NUM_THREADS=2 python benchmarks/amx_cores.py
    OMP_NUM_THREADS=2 python benchmarks/amx_cores.py --repeats 5 --products 20000000
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

int main(int argc, char **argv) {
    const long passes = atol(argv[1]) / 4;
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { fprintf(stderr, "the OS refuses AMX\n"); return 1; }
#pragma omp parallel
    {
        tile_config config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
        _tile_loadconfig(&config);
        uint16_t zeros[512] = {0};
        _tile_loadd(4, zeros, 64); _tile_loadd(5, zeros, 64); _tile_loadd(6, zeros, 64); _tile_loadd(7, zeros, 64);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const double began = omp_get_wtime();
        for (long i = 0; i < passes; i++) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        const double seconds = omp_get_wtime() - began;
        _tile_release();
#pragma omp critical
        printf("thread %d: %.2f TFLOP/s\n", omp_get_thread_num(), passes * 4 * 16384.0 / seconds / 1e12);
    }
    return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--products", type=int, default=80_000_000, help="tile products per thread")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cc", default="gcc")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "amx_cores.c", Path(folder) / "amx_cores"
        source.write_text(PROGRAM)
        flags = ["-O2", "-march=native", "-mamx-tile", "-mamx-bf16", "-fopenmp"]
        built = subprocess.run([args.cc, *flags, str(source), "-o", str(binary)], capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"{args.cc} could not build the probe (needs AMX support):\n{built.stderr.strip()}")
        for repeat in range(args.repeats):
            ran = subprocess.run([str(binary), str(args.products)], capture_output=True, text=True)
            if ran.returncode:
                raise SystemExit(ran.stderr.strip())
            print(f"run {repeat + 1}: " + "; ".join(sorted(ran.stdout.strip().splitlines())), flush=True)


if __name__ == "__main__":
    main()
