/* AMX's tiles: whether this build has them (INFER_AMX: AMX-TILE and AMX-BF16), the one tile configuration every
 * AMX kernel here uses, and whether Linux lets this process use them.
 *
 * A build with AMX still runs where the OS refuses the tiles' state (an older kernel, a VM): every AMX path asks
 * amx_available() first and otherwise takes the AVX-512 one. Include after common.h's INFER_HIDDEN. */
#ifndef INFER_ISA_AMX_H
#define INFER_ISA_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFER_AMX 1
#else
#define INFER_AMX 0
#endif

#if INFER_AMX
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* This thread's tile configuration: all eight tiles 16 rows of 64 bytes (what every AMX kernel here uses). */
static inline void load_full_tiles(void) {
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

/* 1 when this build multiplies on AMX tiles and Linux lets the process use them (asked for once; features.c). */
INFER_HIDDEN int amx_available(void);

#endif
