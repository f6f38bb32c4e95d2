/* What this build and this machine run: the instruction set the kernels were compiled for, and whether Linux lets
 * the process use AMX's tiles (the tile GEMM and the flash attention ask before they use them). */
#include "common.h"

int64_t infer_simd_width(void) {
#if INFER_AVX512
    return 512;
#elif INFER_AVX2 && INFER_F16C
    return 256;
#else
    return 0;
#endif
}

/* Linux hands out AMX's tile state only to a process that asks (arch_prctl); asked once, the answer kept. */
int amx_available(void) {
#if INFER_AMX
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}
